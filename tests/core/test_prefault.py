"""kdn.core.prefault: which mappings it reads as Ray's object store, the runs of pages it
populates, and, on a real shared-memory mapping, that it populates only pages that hold
memory (it never makes the store allocate any) and gives up, saying why, where it cannot run;
that a fill allocates the store's first bytes and no others, writes no byte, keeps to its
budget a pass, ends its thread when done and stops, saying why, where the kernel refuses."""
import ctypes
import errno
import mmap
import os
import sys
import time

import numpy as np
import pytest

from kdn.core import prefault
from kdn.core.prefault import Prefaulter, in_memory, runs, store_mappings, store_regions

MAPS = """\
55d0c0000000-55d0c0021000 r-xp 00000000 08:01 131  /usr/bin/python3.11
7f217c000000-7f21bc000000 rw-s 00000000 00:1b 79   /dev/shm/plasmaLQngck (deleted)
7f21bc000000-7f21bc100000 rw-p 00000000 00:00 0
7f21c0000000-7f21c0200000 r--s 00000000 00:1b 80   /var/tmp/ray/plasma_store_file
7f21d0000000-7f21d0200000 rw-p 00000000 00:1b 81   /dev/shm/plasmaPrivate
"""


def test_only_shared_mappings_of_the_object_store_are_read_as_it():
    assert store_regions(MAPS) == [(0x7f217c000000, 0x7f21bc000000), (0x7f21c0000000, 0x7f21c0200000)]
    assert store_regions("") == []
    assert [m[2] for m in store_mappings(MAPS)] == ["/dev/shm/plasmaLQngck", "/var/tmp/ray/plasma_store_file"]


MOUNTS = """\
/dev/vda1 / ext4 rw,relatime 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0
hugetlbfs /mnt/huge\\040pages hugetlbfs rw 0 0
tmpfs /var/tmp/ray tmpfs rw 0 0
"""


def test_only_a_store_in_memory_is_filled_by_its_mount():
    assert in_memory("/dev/shm/plasmaLQngck", MOUNTS)
    assert in_memory("/mnt/huge pages/plasma", MOUNTS)
    assert in_memory("/var/tmp/ray/plasma_store_file", MOUNTS)           # the longest mount point wins
    assert not in_memory("/var/tmp/plasmaXYZ", MOUNTS)                   # Ray's fallback on a disk
    assert not in_memory("/dev/shmx/plasma", MOUNTS) and not in_memory("/x", "")


def test_runs_are_the_true_stretches():
    assert runs(np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)) == [(1, 3), (4, 5), (7, 8)]
    assert runs(np.zeros(4, bool)) == [] and runs(np.ones(3, bool)) == [(0, 3)]


SHM = "/dev/shm"      # where Ray keeps its store: tmpfs, whose holes a read would fill (a disk file's would not)


linux_shm = pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.isdir(SHM),
                               reason="mincore/madvise are Linux's; the store's semantics are tmpfs's")


@pytest.fixture
def store():
    """A 64-page shared-memory file, all holes, named as Ray's store is: its path, page size,
    mmap (m), a numpy view of it and the view's (start, end) region."""
    import types
    page = os.sysconf("SC_PAGE_SIZE")
    path = os.path.join(SHM, f"plasma-kdn-test-{os.getpid()}")
    with open(path, "w+b") as f:
        f.truncate(64 * page)
        m = mmap.mmap(f.fileno(), 64 * page)
    view = np.frombuffer(m, np.uint8)
    st = types.SimpleNamespace(path=path, page=page, m=m, view=view,
                               region=(view.ctypes.data, view.ctypes.data + 64 * page))
    yield st
    del st.view, view                 # no export of the mapping left: it can close
    m.close()
    os.unlink(path)


def held_bytes(path) -> int:
    return os.stat(path).st_blocks * 512


@linux_shm
def test_it_populates_only_pages_that_hold_memory_and_each_once():
    page = os.sysconf("SC_PAGE_SIZE")
    path = os.path.join(SHM, f"plasma-kdn-test-{os.getpid()}")   # named as Ray's store is
    with open(path, "w+b") as f:
        f.truncate(64 * page)                                   # 64 pages, all holes
        m = mmap.mmap(f.fileno(), 64 * page)
    try:
        for i in (3, 4, 5, 40):                                 # 4 pages hold memory
            m[i * page] = 1
        view = np.frombuffer(m, np.uint8)
        start = view.ctypes.data
        p = Prefaulter()                                        # not started: no thread
        region = (start, start + 64 * page)
        assert p.populate(region, budget=1000) == 4
        assert p.populate(region, budget=1000) == 0             # each page once
        used = os.stat(path).st_blocks * 512
        assert used == 4 * page, "no hole was filled"
        m[10 * page] = 2                                        # a page the store fills later
        assert p.populate(region, budget=1) == 1 and p.counters["pages_populated"] == 5
        assert p.stats()["stopped_why"] is None
    finally:
        del view
        m.close()
        os.unlink(path)


@pytest.fixture
def plenty(monkeypatch):
    """Whatever this machine has free, a fill's reserve is not what a test is about."""
    monkeypatch.setattr(prefault, "_spare_memory", lambda: None)


@linux_shm
def test_a_fill_allocates_the_first_bytes_only_writes_nothing_and_keeps_its_budget(store, plenty):
    path, m, page, view, region = store.path, store.m, store.page, store.view, store.region
    for i in (3, 4, 5):                                         # an object's bytes already there
        m[i * page:(i + 1) * page] = bytes([i]) * page
    p = Prefaulter(fill_bytes=16 * page, map_resident=False)    # not started: no thread
    assert p.fill(region, budget=5) == 5                        # pages 0-2, 6, 7: the budget
    assert held_bytes(path) == 8 * page and region not in p._filled
    assert p.fill(region, budget=100) == 8                      # pages 8-15: the rest
    assert region in p._filled and held_bytes(path) == 16 * page    # nothing past the first 16
    assert p.fill(region, budget=100) == 0 and p.counters["pages_filled"] == 13
    for i in (3, 4, 5):
        assert m[i * page:(i + 1) * page] == bytes([i]) * page  # the object's bytes untouched
    assert not view[:3 * page].any() and not view[6 * page:16 * page].any()   # filled: zeros
    assert p.stats()["fill_stopped_why"] is None and p.stats()["fill_bytes"] == 16 * page
    assert p.stats()["filled_bytes"] == 13 * page


@linux_shm
def test_a_budget_that_ends_inside_a_run_of_holes_goes_on_from_there(store, plenty):
    path, m, page, region = store.path, store.m, store.page, store.region
    for i in (3, 4, 5):
        m[i * page] = 1
    p = Prefaulter(fill_bytes=16 * page, map_resident=False)
    got = []
    while region not in p._filled:
        got.append(p.fill(region, budget=2))
        assert len(got) < 20, got
    assert sum(got) == 13 and held_bytes(path) == 16 * page     # no hole left behind


@linux_shm
def test_a_refused_fill_stops_says_why_and_harms_nothing(store, plenty):
    path, m, page, region = store.path, store.m, store.page, store.region
    m[0:page] = b"x" * page
    p = Prefaulter(fill_bytes=8 * page, map_resident=False)
    real = p._libc

    class ShortOfMemory:                                        # the kernel refuses: ENOMEM
        mincore = real.mincore

        @staticmethod
        def madvise(*args):
            ctypes.set_errno(errno.ENOMEM)
            return -1
    p._libc = ShortOfMemory
    assert p.fill(region, budget=100) == 0
    assert region in p._filled and p.counters["fill_errors"] == 1
    assert p.stats()["fill_stopped_why"].startswith("madvise(MADV_POPULATE_WRITE): Cannot allocate memory")
    assert held_bytes(path) == page and m[0:page] == b"x" * page

    class Old(ShortOfMemory):                                   # a kernel before 5.14
        @staticmethod
        def madvise(*args):
            ctypes.set_errno(errno.EINVAL)
            return -1

    class NoMincore(ShortOfMemory):                             # a sandbox without mincore
        @staticmethod
        def mincore(*args):
            ctypes.set_errno(errno.ENOSYS)
            return -1
    for libc, why in ((Old, "madvise(MADV_POPULATE_WRITE): it needs Linux 5.14 or later"),
                      (NoMincore, "mincore: Function not implemented")):
        q = Prefaulter(fill_bytes=8 * page, map_resident=False)
        q._libc = libc
        assert q.fill(region, budget=100) == 0 and region in q._filled
        assert q.stats()["fill_stopped_why"].startswith(why)
    assert held_bytes(path) == page


@linux_shm
def test_a_fill_leaves_the_machines_reserve_and_says_so(store, monkeypatch):
    path, page, region = store.path, store.page, store.region
    spare = [2 * page]                                          # what is available above the reserve
    monkeypatch.setattr(prefault, "_spare_memory", lambda: spare[0])
    p = Prefaulter(fill_bytes=16 * page, map_resident=False)
    assert p.fill(region, budget=100) == 2 and region not in p._filled
    spare[0] = 0
    assert p.fill(region, budget=100) == 0 and region in p._filled
    assert held_bytes(path) == 2 * page
    assert p.stats()["fill_stopped_why"].startswith("this machine's available memory is down to its reserve (25%")


@linux_shm
def test_the_spare_memory_is_what_is_available_above_a_quarter_of_the_total():
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    total = int(info["MemTotal"].split()[0]) * 1024
    got = prefault._spare_memory()
    assert 0 <= got <= total - total // 4


@linux_shm
def test_a_fill_only_thread_fills_at_the_lowest_priority_and_ends(store, plenty, monkeypatch):
    path, page, region = store.path, store.page, store.region
    monkeypatch.setattr(prefault, "store_mappings", lambda text: [(*region, path)])
    nice = []
    real_setpriority = os.setpriority
    monkeypatch.setattr(os, "setpriority", lambda which, who, prio: nice.append((who, prio))
                        or real_setpriority(which, who, prio))
    p = Prefaulter(period_s=0.01, budget_pages=10, fill_bytes=32 * page, map_resident=False).start()
    p._thread.join(timeout=10)
    assert not p.stats()["running"]
    assert p.counters["pages_filled"] == 32 and p.counters["passes"] >= 4     # 10 pages a pass
    assert held_bytes(path) == 32 * page and p.counters["pages_populated"] == 0
    assert nice == [(p._thread.native_id, 19)]


def test_the_thread_reads_this_processs_mappings_each_pass_and_stops_when_asked(monkeypatch):
    seen = []
    monkeypatch.setattr(prefault, "store_mappings", lambda text: seen.append(text) or [])
    p = Prefaulter(period_s=0.01).start()
    deadline = time.monotonic() + 10
    while p.counters["passes"] < 3:
        assert time.monotonic() < deadline, p.stats()
        time.sleep(0.01)
    p.stop()
    assert not p.stats()["running"] and p.stats()["stopped_why"] is None
    assert len(seen) >= 3 and all("[stack]" in text for text in seen)     # /proc/self/maps


def test_off_linux_it_does_nothing_and_says_why(monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    p = Prefaulter().start()
    assert p._thread is None
    assert p.stats() == {"passes": 0, "pages_populated": 0, "populate_errors": 0, "running": False,
                         "stopped_why": "not on Linux (darwin)"}
