"""CPU-seconds the kernel takes to allocate shared memory the way an edge's object-store fill does
(kdn.core.prefault: madvise MADV_POPULATE_WRITE over a mapping of a file in /dev/shm, as Ray's
object store is), per GiB:

    .venv/bin/python tools/fill_cpu.py [GIB] [ROUNDS]     # default 1 GiB, 3 rounds

Each round maps a fresh file of GIB GiB in /dev/shm, populates it in one call, and reports this
process's user + system CPU time for the call; the file is removed after each round.
"""
import ctypes
import ctypes.util
import mmap
import os
import resource
import statistics
import sys
import time

from kdn.core.prefault import MADV_POPULATE_WRITE


def one(nbytes: int) -> tuple:
    """(CPU s, wall s) of populating nbytes of a fresh /dev/shm mapping."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    path = f"/dev/shm/kdn-fill-cpu-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as m:
            view = (ctypes.c_char * nbytes).from_buffer(m)
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            if libc.madvise(ctypes.addressof(view), nbytes, MADV_POPULATE_WRITE) != 0:
                raise SystemExit(f"madvise failed: {os.strerror(ctypes.get_errno())} (Linux 5.14 or later)")
            wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            del view
        return (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime), wall
    finally:
        os.close(fd)
        os.unlink(path)


def main(argv) -> None:
    gib = float(argv[0]) if argv else 1.0
    rounds = int(argv[1]) if len(argv) > 1 else 3
    nbytes = int(gib * (1 << 30)) // mmap.PAGESIZE * mmap.PAGESIZE
    got = [one(nbytes) for _ in range(rounds)]
    cpu = [c / gib for c, _ in got]
    print(f"{gib:g} GiB of /dev/shm populated, {rounds} rounds: CPU s per GiB "
          f"{' '.join(f'{c:.2f}' for c in cpu)} (median {statistics.median(cpu):.2f}); wall s per GiB "
          f"{' '.join(f'{w / gib:.2f}' for _, w in got)}")


if __name__ == "__main__":
    main(sys.argv[1:])
