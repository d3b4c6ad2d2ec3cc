"""How fast this machine writes memory a process has just been given, with and without
numpy's request for transparent huge pages:

    .venv/bin/python tools/first_touch.py [GIB] [IDLE_S]       # default 1 GiB, 4 s

numpy asks the kernel for huge pages (madvise MADV_HUGEPAGE) on every array of 4 MiB or more,
unless NUMPY_MADVISE_HUGEPAGE=0. For each setting this writes GIB GiB of new memory after
IDLE_S seconds idle, then again at once (the first array freed in between), and prints GB/s.
On session 41's VM the first write with huge pages ran at a small fraction of the one
without, with no compaction (`compact_stall` in /proc/vmstat unchanged): it wrote
0.11-0.12 GB/s with them against 1.3-2.5 without, and 2.3-8.6 against 2.2-2.6 right after a
free. A figure that allocates large arrays in fresh memory pays it where it runs.
"""
import json
import sys
import time

import numpy as np

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:                     # numpy < 2
    from numpy.core.multiarray import _set_madvise_hugepage


def write_gbs(nbytes: int) -> float:
    """GB/s of filling nbytes of new memory (numpy: malloc, then every page written once)."""
    t0 = time.perf_counter()
    a = np.ones(nbytes // 4, np.float32)
    took = time.perf_counter() - t0
    del a
    return nbytes / took / 1e9


def touch(gib: float, idle_s: float) -> dict:
    n, rows = int(gib * (1 << 30)), {}
    before = _set_madvise_hugepage(True)
    try:
        for huge in (True, False):
            _set_madvise_hugepage(huge)
            time.sleep(idle_s)
            name = "huge_pages" if huge else "no_huge_pages"
            rows[name] = {"first": round(write_gbs(n), 2), "again": round(write_gbs(n), 2)}
    finally:
        _set_madvise_hugepage(before)
    return rows


def main(argv) -> None:
    print(json.dumps(touch(float(argv[0]) if argv else 1.0, float(argv[1]) if len(argv) > 1 else 4.0)))


if __name__ == "__main__":
    main(sys.argv[1:])
