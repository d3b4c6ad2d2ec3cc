"""kdn.integrations.prefault: which mappings it reads as Ray's object store, the runs of pages it
populates, and, on a real shared-memory mapping, that it populates only pages that hold
memory (it never makes the store allocate any) and gives up, saying why, where it cannot run."""
import mmap
import os
import sys
import time

import numpy as np
import pytest

from kdn.integrations import prefault
from kdn.integrations.prefault import Prefaulter, runs, store_regions

MAPS = """\
55d0c0000000-55d0c0021000 r-xp 00000000 08:01 131  /usr/bin/python3.11
7f217c000000-7f21bc000000 rw-s 00000000 00:1b 79   /dev/shm/plasmaLQngck (deleted)
7f21bc000000-7f21bc100000 rw-p 00000000 00:00 0
7f21c0000000-7f21c0200000 r--s 00000000 00:1b 80   /tmp/ray/plasma_store_file
7f21d0000000-7f21d0200000 rw-p 00000000 00:1b 81   /dev/shm/plasmaPrivate
"""


def test_only_shared_mappings_of_the_object_store_are_read_as_it():
    assert store_regions(MAPS) == [(0x7f217c000000, 0x7f21bc000000), (0x7f21c0000000, 0x7f21c0200000)]
    assert store_regions("") == []


def test_runs_are_the_true_stretches():
    assert runs(np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)) == [(1, 3), (4, 5), (7, 8)]
    assert runs(np.zeros(4, bool)) == [] and runs(np.ones(3, bool)) == [(0, 3)]


SHM = "/dev/shm"      # where Ray keeps its store: tmpfs, whose holes a read would fill (a disk file's would not)


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.isdir(SHM),
                    reason="mincore/madvise are Linux's; the store's semantics are tmpfs's")
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


def test_the_thread_reads_this_processs_mappings_each_pass_and_stops_when_asked(monkeypatch):
    seen = []
    monkeypatch.setattr(prefault, "store_regions", lambda text: seen.append(text) or [])
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
