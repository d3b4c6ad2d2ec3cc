"""Keep this process's page tables over Ray's object store filled, off the load path, and
have the kernel allocate the store's memory ahead of the copies into it.

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

An edge runs one to fill the store (`fill_bytes`): the kernel allocates the first fill_bytes
of its node's store (madvise MADV_POPULATE_WRITE on the pages that hold no memory yet, which
zeroes them and writes no byte of an object), so a copy into the store later (a host's
store, the edge's own copy of it, a push or a pull arriving) takes no page fault for the
store's memory: on a 2-core AMD EPYC a 256 MiB `ray.put` took 135 ms into store memory new to
the node, 65-75 ms into memory the node had allocated but this process had not mapped, and
18-20 ms into memory mapped here. Ray's store hands memory out from its lowest addresses up,
and keeps what it has allocated, so filling the lowest bytes takes at start the memory a busy
edge would take anyway (its capacity, by default: the edge's `object_store_fill_bytes`, or
KDN_OBJECT_STORE_FILL_BYTES from its node's environment, kdn.edge.options.fill_bytes). A
fill leaves RESERVE_SHARE of the machine's memory available (several nodes' stores share one
machine in a test or a demo), and one that reaches that reserve or is refused stops and says
why; the rest of the store is then allocated as it is used, as without it.
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
MADV_POPULATE_WRITE = 23
RESERVE_SHARE = 0.25           # of this machine's memory, what a fill leaves available
STORE_MARK = "/plasma"         # Ray's object store file: /dev/shm/plasma... (or its plasma directory)


def store_regions(maps_text: str) -> list:
    """(start, end) of the object store's shared mappings in a /proc/PID/maps text."""
    return [(start, end) for start, end, _ in store_mappings(maps_text)]


def store_mappings(maps_text: str) -> list:
    """(start, end, path) of the object store's shared mappings in a /proc/PID/maps text."""
    out = []
    for line in maps_text.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and STORE_MARK in parts[5] and "s" in parts[1]:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            out.append((start, end, parts[5].strip().removesuffix(" (deleted)")))
    return out


def in_memory(path: str, mounts_text: str) -> bool:
    """Whether path lies on a file system in memory (tmpfs, hugetlbfs), by the longest mount
    point of a /proc/mounts text above it: a store on a disk (Ray's fallback where /dev/shm is
    small) is never filled, which would write zeros to that disk."""
    best, kind = "", None
    for line in mounts_text.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1].replace("\\040", " ")
            if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, parts[2]
    return kind in ("tmpfs", "hugetlbfs")


def runs(mask: np.ndarray) -> list:
    """(first, end) index ranges of the True runs of a boolean array."""
    if not mask.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.view(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


class Prefaulter:
    """The thread of the module; start() once, stop() at close. Counters in stats()."""

    def __init__(self, period_s: float = PERIOD_S, budget_pages: int = BUDGET_PAGES,
                 fill_bytes: int = 0, map_resident: bool = True):
        """fill_bytes: of the store, the first this many bytes are filled (an edge; 0: none);
        map_resident: this process's page tables are filled over the store's pages that hold
        memory (a host). A Prefaulter that only fills ends its thread once the fill is done."""
        self.period_s, self.budget = period_s, budget_pages
        self.fill_bytes, self.map_resident = max(0, int(fill_bytes)), bool(map_resident)
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._done = {}                # (start, end) -> bool array: pages populated already
        self._filled = set()           # regions whose fill is done (or stopped)
        self._cursor = {}              # region -> the page its fill looks on from
        self._stop = threading.Event()
        self._thread = None
        self.counters = {"passes": 0, "pages_populated": 0, "populate_errors": 0}
        if self.fill_bytes:
            self.counters.update(pages_filled=0, fill_errors=0)
        self.stopped_why = None        # why it gave up, if it did
        self.fill_stopped_why = None   # why the fill stopped short, if it did
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
        out = {**self.counters, "running": self._thread is not None and self._thread.is_alive(),
               "stopped_why": self.stopped_why}
        if self.fill_bytes:
            out.update(fill_bytes=self.fill_bytes, filled_bytes=self.counters["pages_filled"] * self.page,
                       fill_stopped_why=self.fill_stopped_why)
        return out

    def _run(self) -> None:
        if self.fill_bytes and not self.map_resident:
            _lowest_priority()               # a fill takes the CPU no one else wants
        while not self._stop.is_set():
            try:
                with open("/proc/self/maps") as f:
                    mappings = store_mappings(f.read())
            except OSError as e:
                self.stopped_why = f"cannot read /proc/self/maps: {e}"
                return
            regions = [(a, b) for a, b, _ in mappings]
            left = self.budget
            # the store: its largest mapping (not a fallback file)
            main = max(mappings, key=lambda r: r[1] - r[0], default=None)
            if main is not None:
                main, path = main[:2], main[2]
                if self.fill_bytes and main not in self._filled:
                    if self._on_disk(path):
                        self.fill_stopped_why = (f"the object store is not in memory ({path}): a fill "
                                                 f"would write zeros to a disk")
                        self._filled.add(main)
                    else:
                        left -= self.fill(main, left)
            for region in regions if self.map_resident else ():
                left -= self.populate(region, left)
                if self.stopped_why:
                    return
            for gone in set(self._done) - set(regions):    # unmapped (Ray disconnected)
                del self._done[gone]
            self.counters["passes"] += 1
            if not self.map_resident and main is not None and main in self._filled:
                return                       # a fill only, done
            self._stop.wait(self.period_s)

    @staticmethod
    def _on_disk(path: str) -> bool:
        try:
            with open("/proc/mounts") as f:
                return not in_memory(path, f.read())
        except OSError:
            return True                      # not known: not filled

    def fill(self, region, budget: int) -> int:
        """Have the kernel allocate up to `budget` of the pages among region's first fill_bytes
        that hold no memory yet, writing none (MADV_POPULATE_WRITE); how many it allocated.
        Each call looks on from where the last stopped (a few budgets' worth of pages at most).
        Once none is left, or a call is refused, the region is done (fill_stopped_why says why
        it stopped short)."""
        start, end = region
        spare = _spare_memory()
        if spare is not None and spare < budget * self.page:
            budget = max(0, spare // self.page)
            if not budget:
                self.fill_stopped_why = (f"this machine's available memory is down to its reserve "
                                         f"({RESERVE_SHARE:.0%} of it): the rest of the store is "
                                         f"allocated as it is used")
                self._filled.add(region)
                return 0
        n = min((end - start) // self.page, self.fill_bytes // self.page)
        at = self._cursor.get(region, 0)
        upto = min(n, at + 4 * budget)
        vec = np.zeros(max(0, upto - at), np.uint8)
        if vec.size and self._libc.mincore(start + at * self.page, vec.size * self.page, vec.ctypes.data) != 0:
            err = ctypes.get_errno()
            if err != errno.ENOMEM:          # ENOMEM: unmapped meanwhile, gone next pass
                self.fill_stopped_why = f"mincore: {os.strerror(err)}"
                self._filled.add(region)
            return 0
        made, last = 0, upto
        for a, run_end in runs((vec & 1) == 0):
            b = min(run_end, a + budget - made)
            if b <= a:
                last = a
                break
            if self._libc.madvise(start + (at + a) * self.page, (b - a) * self.page, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                self.counters["fill_errors"] += 1
                why = ("it needs Linux 5.14 or later" if err == errno.EINVAL else os.strerror(err))
                self.fill_stopped_why = (f"madvise(MADV_POPULATE_WRITE): {why}: the rest of the store is "
                                         f"allocated as it is used")
                self._filled.add(region)
                return made
            made += b - a
            self.counters["pages_filled"] += b - a
            last = b
            if b < run_end:                  # the budget ended inside this run: on from here next time
                break
        self._cursor[region] = at + last
        if at + last >= n:
            self._filled.add(region)
        return made

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


def _spare_memory():
    """Bytes a fill may still take: this machine's available memory (psutil) above
    RESERVE_SHARE of its total, and within this process's cgroup (v2) memory limit, if it has
    one, above RESERVE_SHARE of that, its droppable page cache not counted as used (past the
    limit a fill is met by the OOM killer, not an error; a parent cgroup's limit is not read)."""
    import psutil
    mem = psutil.virtual_memory()
    spare = max(0, mem.available - int(RESERVE_SHARE * mem.total))
    try:
        with open("/proc/self/cgroup") as f:
            own = next(line.split("::", 1)[1].strip() for line in f if line.startswith("0::"))
        folder = os.path.join("/sys/fs/cgroup", own.lstrip("/"))
        with open(os.path.join(folder, "memory.max")) as f:
            limit = f.read().strip()
        if limit != "max":
            with open(os.path.join(folder, "memory.current")) as f:
                used = int(f.read())
            with open(os.path.join(folder, "memory.stat")) as f:     # page cache it can drop
                stat = dict(line.split() for line in f if line.count(" ") == 1)
            used -= int(stat.get("inactive_file", 0))
            within = max(0, int(limit) - used - int(RESERVE_SHARE * int(limit)))
            spare = min(spare, within)
    except (OSError, StopIteration, ValueError):
        pass
    return spare


def _lowest_priority() -> None:
    """This thread at the lowest CPU priority (nice 19: Linux's are per thread), where the
    system lets it (it may not: a container without the right, say)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except PermissionError:
        pass
