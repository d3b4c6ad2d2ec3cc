"""How fast this machine writes memory a process has just been given, with and without
numpy's request for transparent huge pages, and files into the page cache, right after
memory was freed and after it lay free a while:

    .venv/bin/python tools/first_touch.py [GIB] [IDLE_S] [CACHE_IDLE_S]   # 1 GiB, 4 s, 30 s

numpy asks the kernel for huge pages (madvise MADV_HUGEPAGE) on every array of 4 MiB or more,
unless NUMPY_MADVISE_HUGEPAGE=0. For each setting this writes GIB GiB of new memory after
IDLE_S seconds idle, then again at once (the first array freed in between), and prints GB/s.
Then "page_cache": GIB GiB written as 8 MiB files under the temp dir (as LMCache's `fs`
adapter writes them: `kdn bench l2`'s fs row), once right after 3 GiB were touched and freed
and once CACHE_IDLE_S seconds after, with the MiB this guest reported free to its host in
between (virtio free page reporting: /sys/module/page_reporting, where the kernel has it).
Then "durable_files": GIB GiB of 8 MiB files each fsynced (as the origin makes objects durable),
through the page cache and as the origin writes them (kdn.core.files: O_DIRECT), each
CACHE_IDLE_S / 2 seconds after 3 GiB were freed.

On session 42's VM (Firecracker's kernel, free page reporting at 2 MiB) memory that lay free
a few seconds was reported and given back to the host; writing it again paid the host's
faults: files at 4.2-4.6 GB/s right after a free and 0.33-0.36 GB/s 30 s after, with 8 GiB
reported meanwhile. That is `fs`'s swing in `kdn bench l2` (docs/figures.md, session 42).
Durable 8 MiB files: 0.51-0.60 GB/s through the page cache, 1.23-1.33 as the origin writes them.
"""
import json
import os
import sys
import tempfile
import time

import numpy as np

try:
    from numpy._core.multiarray import _set_madvise_hugepage
except ImportError:                     # numpy < 2
    from numpy.core.multiarray import _set_madvise_hugepage

REPORTED = "/sys/module/page_reporting/parameters/reported_kib"
FILE_BYTES = 8 << 20                    # LMCache's objects in kdn bench l2 (32 x 8 MiB a round)


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


def reported_kib():
    """KiB this guest has reported free to its host since boot; None where not exposed."""
    try:
        with open(REPORTED) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def page_cache(gib: float, idle_s: float) -> dict:
    """GB/s of writing gib GiB of 8 MiB files right after 3 GiB were freed, and idle_s
    seconds after; each time the files go (and are synced away) after."""
    n, buf, out = int(gib * (1 << 30)) // FILE_BYTES, os.urandom(FILE_BYTES), {}
    with tempfile.TemporaryDirectory(prefix="kdn-first-touch-") as d:
        for name, wait in (("after_free", 0.0), ("after_idle", idle_s)):
            write_gbs(3 << 30)                               # 3 GiB touched and freed
            r0 = reported_kib()
            time.sleep(wait)
            t0 = time.perf_counter()
            for i in range(n):
                with open(os.path.join(d, f"{name}-{i}"), "wb") as f:
                    f.write(buf)
            out[name] = round(n * FILE_BYTES / (time.perf_counter() - t0) / 1e9, 2)
            r1 = reported_kib()
            out[f"{name}_reported_mib"] = None if r0 is None else (r1 - r0) // 1024
            for i in range(n):
                os.unlink(os.path.join(d, f"{name}-{i}"))
            os.sync()
    return out


def durable_files(gib: float, idle_s: float) -> dict:
    """GB/s of writing gib GiB of 8 MiB files, each fsynced, through the page cache and as the
    origin writes them (kdn.core.files.write_atomic with direct: O_DIRECT through its reused
    aligned buffers), each idle_s seconds after 3 GiB were freed; "o_direct_refused" where the
    file system took no O_DIRECT (then both went through the page cache)."""
    from kdn.core import files
    n, out = int(gib * (1 << 30)) // FILE_BYTES, {}
    data = os.urandom(FILE_BYTES - 1000)        # not a whole number of blocks, as objects are not
    with tempfile.TemporaryDirectory(prefix="kdn-first-touch-") as d:
        for name in ("page_cache", "o_direct"):
            write_gbs(3 << 30)
            time.sleep(idle_s)
            t0 = time.perf_counter()
            for i in range(n):
                files.write_atomic(os.path.join(d, f"{name}-{i}"), data, fsync=True,
                                   direct=name == "o_direct")
            out[name] = round(n * len(data) / (time.perf_counter() - t0) / 1e9, 2)
            with open(os.path.join(d, f"{name}-{n - 1}"), "rb") as f:
                if f.read() != data:
                    raise SystemExit(f"{name}: a file read back differs from what was written")
            for p in os.listdir(d):
                os.unlink(os.path.join(d, p))
        out["o_direct_refused"] = os.stat(d).st_dev in files._no_direct
    return out


def main(argv) -> None:
    gib = float(argv[0]) if argv else 1.0
    rows = touch(gib, float(argv[1]) if len(argv) > 1 else 4.0)
    cache_idle = float(argv[2]) if len(argv) > 2 else 30.0
    rows["page_cache"] = page_cache(gib, cache_idle)
    rows["durable_files"] = durable_files(gib, cache_idle / 2)
    print(json.dumps(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
