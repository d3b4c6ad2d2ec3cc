"""`kdn bench quantlab`: quantizer variants tried on SmolLM2's KV, before any becomes a codec.

Exploration, not a codec: each variant quantizes and dequantizes the bundled knowledge's
exact KV chunk by chunk (256 tokens) in memory, and is scored against the exact KV on the
knowledge's last --tokens tokens (teacher-forced): KL(exact || variant) of the next-token
distribution (the least noisy measure), perplexity change, and top-1 agreement. Size is the
zstd-compressed levels plus side information, against fp16. Variants:

- k4v3 / k4v4: kdn.core.codecs' quantizer (keys per channel over 128 or 64 tokens, values per
  token over 64 channels), with and without each chunk's first token exact (format v2);
- value codebooks: normal-float (NF, levels at normal quantiles) instead of uniform;
- rotation: a random-sign 64x64 Hadamard applied to values (and keys) before quantizing;
- per-layer bits: 4-bit values in the first third of the layers, 3-bit after;
- --layers: per-layer sensitivity, one layer's K or V quantized (k4v3) at a time.

The findings are in docs/figures.md (compressed KV) and in kdn/core/codecs.py's comments.
"""
import argparse
import math
import time

import numpy as np
import torch
import zstandard

from kdn.bench import emit_json, table

CHUNK = 256


def _uniform(axis, g, bits):
    from kdn.core.codecs import _dequantize, _quantize

    def f(a):
        q, mn, sc = _quantize(np.ascontiguousarray(a), axis, g, (1 << bits) - 1)
        out = np.empty(a.shape, np.float32)
        _dequantize(q, mn, sc, axis, g, out)
        return out, [q, mn, sc]
    return f


def _nf(axis, bits):
    """Levels at normal quantiles, scaled to each group's [min, max] (asymmetric)."""
    n = 1 << bits
    p = torch.tensor((np.arange(n) + 0.5) / n)
    cb = (torch.erfinv(2 * p - 1) * math.sqrt(2)).numpy()
    cb = (cb / np.abs(cb).max()).astype(np.float32)

    def f(a):
        lo, hi = a.min(axis=axis, keepdims=True), a.max(axis=axis, keepdims=True)
        mid = ((hi + lo) / 2).astype(np.float16).astype(np.float32)
        half = ((hi - lo) / 2).astype(np.float16).astype(np.float32)
        half[half == 0] = 1
        idx = np.abs(((a - mid) / half)[..., None] - cb).argmin(-1).astype(np.uint8)
        return cb[idx] * half + mid, [idx, mid.astype(np.float16), half.astype(np.float16)]
    return f


def _by_layer_third(first, rest):
    """Values of the first third of the layers quantized by `first`, the others by `rest`."""
    def f(a):
        cut = a.shape[0] // 3
        d1, p1 = first(a[:cut])
        d2, p2 = rest(a[cut:])
        return np.concatenate([d1, d2]), p1 + p2
    return f


def _hadamard(n, seed=0):
    h = np.array([[1.0]])
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], n)
    return (h / np.sqrt(n) * signs[None, :]).astype(np.float32)


def _rotated(inner, r):
    def f(a):
        d, parts = inner(a @ r)
        return d @ r.T, parts
    return f


class Lab:
    def __init__(self, model, tokens, kv, scored_tokens):
        self.m, self.tokens, self.kv = model, tokens, kv
        self.start = max(CHUNK, (len(tokens) - scored_tokens) // CHUNK * CHUNK)
        self.ref_ppl, self.ref_top, self.ref_logp = self.score(kv)
        self.zc = zstandard.ZstdCompressor(level=1)

    def score(self, kv):
        cache = self.m.cache_from_kv([kv[:, :, :, :self.start]])
        ids = self.tokens[self.start:]
        logits = self.m.logits(ids, cache, all_logits=True).float()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        return math.exp(nll.item()), logits.argmax(-1), torch.log_softmax(logits, -1)

    def quantized(self, kfn, vfn, first_exact=True, layers=None, part=None):
        """(dequantized KV, compressed bytes); layers/part: quantize only that layer's K or V."""
        x, out, size = self.kv, np.empty_like(self.kv), 0
        for s in range(0, x.shape[3], CHUNK):
            c = np.ascontiguousarray(x[:, :, :, s:s + CHUNK])
            k = c[:, 0].copy()
            if first_exact and k.shape[2] > 1:
                k[:, :, :1] = k[:, :, 1:2]
            kd, kparts = kfn(k)
            vd, vparts = vfn(np.ascontiguousarray(c[:, 1]))
            o = np.stack([kd, vd], 1)
            if first_exact:
                o[:, :, :, :1] = c[:, :, :, :1].astype(np.float16).astype(np.float32)
                size += c[:, :, :, :1].size * 2
            if layers is not None:
                keep = c.copy()
                keep[layers, part] = o[layers, part]
                o = keep
            out[:, :, :, s:s + CHUNK] = o
            size += len(self.zc.compress(b"".join(p.tobytes() for p in kparts + vparts)))
        return out, size

    def row(self, name, kv, size=None):
        ppl, top, logp = self.score(kv)
        kl = (self.ref_logp.exp() * (self.ref_logp - logp)).sum(-1).mean().item()
        r = {"variant": name, "KL_x1e4": 1e4 * kl, "ppl_change_pct": 100 * (ppl / self.ref_ppl - 1),
             "top1": (top == self.ref_top).float().mean().item()}
        if size is not None:
            r["x_fp16"] = self.kv.nbytes / 2 / size
        return r


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench quantlab", description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=5, help="bundled documents (1-5)")
    ap.add_argument("--tokens", type=int, default=512, help="knowledge tokens scored")
    ap.add_argument("--layers", action="store_true", help="also per-layer sensitivity (60 passes)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not 1 <= args.docs <= 5:
        ap.error("--docs must be 1..5")
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers.model import load_model
    t0 = time.perf_counter()
    model = load_model(log=print)
    docs = bundled_documents()[:args.docs]
    tokens = model.knowledge_tokens("\n\n".join(text for _, text in docs))
    kv = model.prefill(tokens, chunk_tokens=CHUNK).kv
    lab = Lab(model, tokens, kv, args.tokens)
    print(f"{len(tokens)} tokens, scoring [{lab.start}, {len(tokens)}); ref ppl {lab.ref_ppl:.3f}", flush=True)
    r = _hadamard(kv.shape[-1]) if kv.shape[-1] & (kv.shape[-1] - 1) == 0 else None
    k128, k64, v3, v4 = _uniform(2, 128, 4), _uniform(2, 64, 4), _uniform(3, 64, 3), _uniform(3, 64, 4)
    variants = [("k4v3 (k4v3z v1: no exact token)", k128, v3, False),
                ("k4v3 + first token exact (k4v3z)", k128, v3, True),
                ("k4v4 (q4z v1: no exact token)", k64, v4, False),
                ("k4v4 + first token exact (q4z)", k64, v4, True),
                ("k4v3, 4-bit values in the first third of layers", k128, _by_layer_third(v4, v3), True),
                ("k4v3, NF values", k128, _nf(3, 3), True),
                ("k4v4, NF values", k128, _nf(3, 4), True)]
    if r is not None:
        variants += [("k4v3, Hadamard values", k128, _rotated(v3, r), True),
                     ("k4v3, Hadamard keys + values", _rotated(k128, r), _rotated(v3, r), True)]
    rows = []
    for name, kf, vf, first in variants:
        q, size = lab.quantized(kf, vf, first)
        rows.append(lab.row(name, q, size))
        print(f"  {name}: done", flush=True)
    table(rows, ["variant", "x_fp16", "KL_x1e4", "ppl_change_pct", "top1"])
    print("(x_fp16 here: zstd of levels + side info per chunk, an estimate; kdn bench codecs "
          "measures the real codecs)")
    layer_rows = []
    if args.layers:
        for part, label in ((0, "K"), (1, "V")):
            for layer in range(kv.shape[0]):
                q, _ = lab.quantized(k128, v3, True, layers=layer, part=part)
                layer_rows.append(dict(lab.row(f"{label} layer {layer}", q), part=label, layer=layer))
            kls = [x["KL_x1e4"] for x in layer_rows if x["part"] == label]
            print(f"{label} per-layer KL x1e4 (k4v3, one layer at a time): "
                  + " ".join(f"{v:.1f}" for v in kls) + f"  sum {sum(kls):.1f}", flush=True)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        emit_json({"bench": "quantlab", "tokens": len(tokens), "variants": rows,
                   "layers": layer_rows})
