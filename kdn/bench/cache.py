"""`kdn bench cache`: hit ratio of the edge cache's LRU and S3-FIFO policies on Zipf traces.

Each trace draws requests over N distinct equal-size chunks from a bounded Zipf(alpha)
popularity (rank r has weight 1/r^alpha; ranks are shuffled over keys), seeded, so every
policy sees the very same requests. Each request is a cache get, and a miss is followed by a
put, which is how an edge fills pull-through. The table gives hit ratios per policy, cache
size (a share of the distinct chunks) and alpha, each policy's miss-ratio reduction against
the first policy (LRU) on the same trace, and how many requests per second the replay ran.
"""
import argparse
import time

import numpy as np

from kdn.bench import emit_json, table
from kdn.edge.cache import ChunkCache


def zipf_trace(n_keys: int, n_requests: int, alpha: float, seed: int) -> np.ndarray:
    """n_requests key ids in [0, n_keys) drawn from a bounded Zipf(alpha), ranks shuffled."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_keys + 1, dtype=np.float64) ** alpha
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n_requests), side="right")
    ranks = np.minimum(ranks, n_keys - 1)
    return rng.permutation(n_keys)[ranks]


def replay(trace, policy: str, slots: int, item_bytes: int = 1) -> dict:
    cache = ChunkCache(slots * item_bytes, policy=policy)
    get, put = cache.get, cache.put
    value = b""
    t0 = time.perf_counter()
    for key in trace.tolist():
        if get(key) is None:
            put(key, value, nbytes=item_bytes)
    dt = time.perf_counter() - t0
    s = cache.stats()
    return dict(hit_ratio=s["hits"] / s["gets"], evictions=s["evictions"], seconds=dt,
                requests_per_s=len(trace) / dt)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench cache", description=__doc__.splitlines()[0])
    ap.add_argument("--keys", type=int, default=100_000, help="distinct chunks (default 100000)")
    ap.add_argument("--requests", type=int, default=1_000_000, help="requests per trace (default 1000000)")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.8, 1.0], help="Zipf exponents")
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.01, 0.10],
                    help="cache sizes as a share of the distinct chunks (default 0.01 0.10)")
    ap.add_argument("--policies", nargs="+", default=["lru", "s3fifo"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.keys < 1 or args.requests < 1 or not all(0 < x <= 1 for x in args.sizes):
        ap.error("--keys and --requests must be >= 1 and every --sizes value in (0, 1]")

    rows = []
    for alpha in args.alphas:
        trace = zipf_trace(args.keys, args.requests, alpha, args.seed)
        for share in args.sizes:
            slots = max(1, int(round(args.keys * share)))
            base = None
            for policy in args.policies:
                r = replay(trace, policy, slots)
                if base is None:
                    base = r["hit_ratio"]
                miss_base = 1.0 - base
                reduction = (miss_base - (1.0 - r["hit_ratio"])) / miss_base if miss_base else 0.0
                rows.append(dict(alpha=alpha, cache=f"{share:.0%}", slots=slots, policy=policy,
                                 hit_ratio=round(r["hit_ratio"], 4),
                                 **{f"miss_cut_vs_{args.policies[0]}": round(reduction, 4)},
                                 evictions=r["evictions"], req_per_s=round(r["requests_per_s"])))
    print(f"edge cache hit ratio: {args.keys} distinct equal-size chunks, {args.requests} requests "
          f"per trace, seed {args.seed}; get, and put on miss")
    table(rows)
    if args.json:
        emit_json(dict(bench="cache", keys=args.keys, requests=args.requests, seed=args.seed, rows=rows))
    return 0
