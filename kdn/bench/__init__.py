"""Benchmarks: `kdn bench NAME` runs kdn.bench.NAME.main(argv).

Every benchmark prints a readable table and, with --json, one JSON object as its last line.
Figures are compared against a baseline measured in the same run (ratios), because a shared
2-core machine is noisy. Helpers here keep the output format identical across benchmarks.
"""
import json
import statistics
import sys
import time

NAMES = ["keys", "codec", "store", "cache", "tiers", "placement", "fetch", "ttft", "transport",
         "load", "codecs", "blend", "fuzz", "links", "quantlab", "vllm", "serve", "emphasis"]


def table(rows, columns=None, file=None):
    """Print rows (list of dicts) as an aligned text table."""
    file = file or sys.stdout
    if not rows:
        print("(no rows)", file=file)
        return
    columns = columns or list(rows[0].keys())

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)


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
