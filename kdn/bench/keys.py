"""`kdn bench keys`: how fast a worker computes the chunk keys of a prompt.

Hashes N tokens (1M by default) into chained 256-token chunk keys from each input type a
worker may hold — a uint32 array (no conversion), an int64 numpy array or torch tensor
(tokenizer output: one checked conversion), and a Python list (numpy must read every int
object). The headline is the int64 array; the target is under 50 ms for 1M tokens. The
xxh3 pass alone (the same bytes hashed in one call) is the floor the chain is compared to.
"""
import argparse

import numpy as np
import torch
import xxhash

from kdn.bench import emit_json, median, table, timeit
from kdn.core.keys import chunk_keys, namespace_digest

TARGET_MS = 50.0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench keys", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1_000_000, help="tokens to hash")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)

    ns = namespace_digest("bench", "bench-model")
    i64 = np.random.default_rng(0).integers(0, 152_000, size=args.tokens, dtype=np.int64)
    inputs = {"uint32 ndarray": i64.astype("<u4"), "int64 ndarray": i64,
              "torch int64": torch.from_numpy(i64), "list": i64.tolist()}
    expect = chunk_keys(i64, ns, args.chunk_tokens)
    rows, ms = [], {}
    for name, tokens in inputs.items():
        assert chunk_keys(tokens, ns, args.chunk_tokens) == expect
        t = median(timeit(lambda: chunk_keys(tokens, ns, args.chunk_tokens), reps=args.reps))
        ms[name] = t * 1e3
        rows.append({"input": name, "ms": t * 1e3, "Mtokens_per_s": args.tokens / t / 1e6,
                     "keys": len(expect)})
    raw = inputs["uint32 ndarray"].tobytes()
    floor = median(timeit(lambda: xxhash.xxh3_128_digest(raw), reps=args.reps))
    rows.append({"input": "xxh3_128 one call (floor)", "ms": floor * 1e3,
                 "Mtokens_per_s": args.tokens / floor / 1e6, "keys": 1})
    table(rows)
    head = ms["int64 ndarray"]
    print(f"\n{args.tokens:,} tokens from an int64 array: {head:.2f} ms "
          f"(target < {TARGET_MS:.0f} ms: {'met' if head < TARGET_MS else 'MISSED'})")
    if args.json:
        emit_json({"bench": "keys", "tokens": args.tokens, "chunk_tokens": args.chunk_tokens,
                   "keys": len(expect), "ms": head, "tokens_per_s": args.tokens / head * 1e3,
                   "ms_uint32": ms["uint32 ndarray"], "ms_int64": ms["int64 ndarray"],
                   "ms_torch": ms["torch int64"], "ms_list": ms["list"],
                   "ms_xxh3_floor": floor * 1e3, "target_ms": TARGET_MS,
                   "target_met": head < TARGET_MS})
    return 0
