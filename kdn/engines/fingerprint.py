"""Engine fingerprints: which engine computed a KV cache is part of the model's name.

kdn.engines.transformers.model names a model by what makes two KV caches interchangeable (architecture, shapes,
RoPE, KV dtype, a digest of the weights). Two engines running the same weights still
compute KV that differs in the last bits (vLLM's CPU kernels against transformers' sdpa: about
6e-5 in fp32, measured), so their caches are interchangeable only where a test shows
token-identical output, and that is never proven in general. KV that vLLM computed is
therefore published under its own fingerprint: the model's fields plus the engine and the
device kind. "transformers" is the fingerprint kdn.engines.transformers.model.Model gives the same weights, for
reading KV across engines on purpose (kdn bench vllm measures how often that agrees).

Both are computed from the model folder alone (config.json and the weights), so a publisher,
an engine's connector and a worker of the other engine agree without talking.
"""
import json
from pathlib import Path

import torch
import xxhash

from kdn.core.dtypes import DTYPES, name_of
from kdn.core.errors import ModelError


def weights_of(folder: Path) -> str:
    """The weights digest of a model folder: the one kdn.engines.transformers.model recorded when it converted
    the folder (the same digest kdn.engines.transformers.model.Model computes), else xxh3 over its safetensors."""
    from kdn.engines.transformers.model import META_FILE   # the converter's record
    meta = folder / META_FILE
    if meta.is_file():
        try:
            return json.loads(meta.read_text())["weights_digest"]
        except (ValueError, KeyError) as e:
            raise ModelError(f"{meta} is not a KDN model record ({e})") from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{folder} has no safetensors weights to name the model by")
    h = xxhash.xxh3_128()
    for f in files:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 22):
                h.update(block)
    return "files:" + h.hexdigest()


def fingerprints(model_path, dtype=torch.float32, device: str = "cpu") -> dict:
    """{"vllm": KV computed by vLLM on `device`, "transformers": KV computed by kdn.engines.transformers.model}
    for the model folder `model_path` with weights and KV in `dtype` ("transformers" is None
    unless float32: kdn.engines.transformers.model names a cast model by the digest of its cast weights)."""
    from transformers import AutoConfig

    from kdn.engines.transformers.model import fingerprint_fields, model_fingerprint
    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise ModelError(f"{model_path!r} is not a local model folder (config.json); KDN names a "
                         f"model by its files")
    kv_dtype = name_of(dtype)
    if kv_dtype is None:
        raise ModelError(f"KV dtype {dtype} is not one KDN stores ({', '.join(DTYPES)})")
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    weights = weights_of(folder)
    fields = dict(fingerprint_fields(config, weights, kv_dtype), engine="vllm", device=device)
    blob = json.dumps(fields, sort_keys=True, default=str)
    return {"vllm": xxhash.xxh3_128_hexdigest(blob.encode()),
            "transformers": model_fingerprint(config, weights, kv_dtype)
            if dtype == torch.float32 else None}
