"""Keep this process's page tables over Ray's object store filled, off the load path.

A reader maps the edge's objects with no copy (Ray's object store is one shared-memory file
every process of a node maps whole), but the first touch of each 4 KiB page of an object
this process has never read costs a page fault: on a 2-core AMD EPYC, 17-40 ms of a 45-68 ms
load of 32 x 8 MiB objects fresh in the store, against 5 ms once the store's memory is
handed out again (`kdn bench l2 --breakdown`). A host layer's loads (LMCache's, SGLang's)
are on the engine's time; a fault taken earlier, by a thread with nothing else to do, is
not.

`Prefaulter` is that thread: every PERIOD_S it finds the object store's mappings in this
process (/proc/self/maps: Ray's `plasma` files), asks the kernel which of their pages hold
memory (mincore), and has the kernel fill this process's page tables for those it has not
filled yet (madvise MADV_POPULATE_READ): system calls that fail with an error on a range
that is not mapped any more, never a read that could fault. Only pages already holding
memory are populated, so it never makes the store allocate any; at most BUDGET_PAGES a
period, so it takes a bounded share of a core. Linux only (5.14+ for MADV_POPULATE_READ);
elsewhere, or where a call is refused, it stops and says why in `stats()`.
"""
import ctypes
import ctypes.util
import errno
import os
import sys
import threading

import numpy as np

PERIOD_S = 0.5                 # how often it looks for newly filled pages of the store
BUDGET_PAGES = 1 << 17         # pages populated a period at most (512 MiB of 4 KiB pages)
MADV_POPULATE_READ = 22        # linux/mman.h (Linux 5.14)
STORE_MARK = "/plasma"         # Ray's object store file: /dev/shm/plasma... (or its plasma directory)


def store_regions(maps_text: str) -> list:
    """(start, end) of the object store's shared mappings in a /proc/PID/maps text."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and STORE_MARK in parts[5] and "s" in parts[1]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end))
    return out


def runs(mask: np.ndarray) -> list:
    """(first, end) index ranges of the True runs of a boolean array."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


class Prefaulter:
    """The thread of the module; start() once, stop() at close. Counters in stats()."""

    def __init__(self, period_s: float = PERIOD_S, budget_pages: int = BUDGET_PAGES):
        self.period_s, self.budget = period_s, budget_pages
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._done = {}                # (start, end) -> bool array: pages populated already
        self._stop = threading.Event()
        self._thread = None
        self.counters = {"passes": 0, "pages_populated": 0, "populate_errors": 0}
        self.stopped_why = None        # why it gave up, if it did
        self._libc = None
        if not sys.platform.startswith("linux"):
            self.stopped_why = f"not on Linux ({sys.platform})"
        else:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self._libc = libc

    def start(self) -> "Prefaulter":
        if self._libc is None:
            return self
        self._thread = threading.Thread(target=self._run, name="kdn-prefault", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def stats(self) -> dict:
        return {**self.counters, "running": self._thread is not None and self._thread.is_alive(),
                "stopped_why": self.stopped_why}

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with open("/proc/self/maps") as f:
                    regions = store_regions(f.read())
            except OSError as e:
                self.stopped_why = f"cannot read /proc/self/maps: {e}"
                return
            left = self.budget
            for region in regions:
                left -= self.populate(region, left)
                if self.stopped_why:
                    return
            for gone in set(self._done) - set(regions):    # unmapped (Ray disconnected)
                del self._done[gone]
            self.counters["passes"] += 1
            self._stop.wait(self.period_s)

    def populate(self, region, budget: int) -> int:
        """Populate up to `budget` of region's pages that hold memory and were not populated
        yet; how many it populated."""
        start, end = region
        n = (end - start) // self.page
        done = self._done.setdefault(region, np.zeros(n, bool))
        vec = np.zeros(n, np.uint8)
        if self._libc.mincore(start, n * self.page, vec.ctypes.data) != 0:
            err = ctypes.get_errno()
            if err != errno.ENOMEM:          # ENOMEM: unmapped meanwhile, gone next pass
                self.stopped_why = f"mincore: {os.strerror(err)}"
            return 0
        resident = (vec & 1).astype(bool)
        done &= resident                     # a page the store gave back is to be populated again
        todo = resident & ~done
        made = 0
        for a, b in runs(todo):
            b = min(b, a + budget - made)
            if b <= a:
                break
            if self._libc.madvise(start + a * self.page, (b - a) * self.page, MADV_POPULATE_READ) != 0:
                err = ctypes.get_errno()
                self.counters["populate_errors"] += 1
                if err == errno.EINVAL:      # a kernel before 5.14: nothing to do here
                    self.stopped_why = "madvise(MADV_POPULATE_READ) is not supported by this kernel"
                    return made
                continue                     # ENOMEM/EFAULT: the range changed; next pass
            done[a:b] = True
            made += b - a
            self.counters["pages_populated"] += b - a
        return made
