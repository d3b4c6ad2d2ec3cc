"""Benchmarks: `kdn bench NAME` runs kdn.bench.NAME.main(argv).

Every benchmark prints a readable table and, with --json, one JSON object as its last line.
Figures are compared against a baseline measured in the same run (ratios), because a shared
2-core machine is noisy. Helpers here keep the output format identical across benchmarks.
"""
import json
import statistics
import sys
import time

from kdn.cli.table import table  # noqa: F401 - every bench prints the CLI's tables

NAMES = ["keys", "frames", "store", "cache", "tiers", "placement", "fetch", "ttft", "transport",
         "load", "codecs", "blend", "fuzz", "links", "quantlab", "vllm", "serve", "l2", "route", "emphasis",
         "hey", "mpserver", "agent", "attention", "crossmodel"]


def emit_json(obj, file=None):
    """Print one JSON object on one line (the last line of a --json run)."""
    print(json.dumps(obj, sort_keys=True, default=float), file=file or sys.stdout, flush=True)


def timeit(fn, reps=5, warmup=1):
    """Run fn warmup+reps times; return the list of per-rep seconds (after warmup)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def median(xs):
    return statistics.median(xs)


def p(xs, q):
    """q-th percentile (0..100) of xs, nearest-rank."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = max(0, min(len(s) - 1, int(round(q / 100 * (len(s) - 1)))))
    return s[k]


def matching_prefix(a, b) -> int:
    """How many leading items two sequences share (matching continuation length, key prefixes)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
