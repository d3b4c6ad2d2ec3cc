"""The servers' bulk writes (kdn.core.serving.FrameWrites): a body lands in a buffer of the
writes before only once nothing views that buffer, never beside a chunk still read, and the
buffers kept stay within their bounds. (The writes over a real edge's and origin's HTTP
servers are in tests/edge/test_http.py and tests/origin/.)"""
import numpy as np
import pytest

from kdn.core import serving
from kdn.core.serving import FrameWrites


@pytest.fixture
def small(monkeypatch):
    """Bodies of a few KB kept as large ones are (the bounds scaled down)."""
    monkeypatch.setattr(serving, "KEPT_BODY_MIN", 0)


def _fill(buf, value):
    np.frombuffer(memoryview(buf), np.uint8)[:] = value


def test_a_body_reuses_a_buffer_only_once_nothing_views_it(small):
    w = FrameWrites(prefix="ingest_")
    first = w._buffer(1000)
    _fill(first, 1)
    view = np.frombuffer(memoryview(first).toreadonly(), np.uint8)[10:20]   # a chunk of the body
    del first
    second = w._buffer(1000)                       # the first is viewed: new memory
    _fill(second, 2)
    assert (w.counters["ingest_buffers_new"], w.counters["ingest_buffers_reused"]) == (2, 0)
    assert view.tolist() == [1] * 10               # the live chunk is untouched
    del second                                     # nothing views the second any more
    third = w._buffer(900)                         # so it is written again (900 fills over half)
    assert w.counters["ingest_buffers_reused"] == 1 and third.nbytes == 900
    _fill(third, 3)
    assert view.tolist() == [1] * 10
    del view, third
    assert w._buffer(1000) is not None and w.counters["ingest_buffers_reused"] == 2
    w._buffer(400)                                 # under half of any kept one: new memory
    assert w.counters["ingest_buffers_new"] == 3


def test_the_buffers_kept_stay_within_their_bytes(small, monkeypatch):
    monkeypatch.setattr(serving, "KEPT_BODY_BYTES", 2500)
    w = FrameWrites()
    held = [w._buffer(1000), w._buffer(1000)]      # both in use, both kept (2000 bytes)
    assert sum(b.nbytes for b in w._kept) == 2000
    extra = w._buffer(1000)                        # no room and none free: not kept
    assert sum(b.nbytes for b in w._kept) == 2000 and extra.nbytes == 1000
    held.pop()                                     # one kept buffer free again
    w._buffer(1200)                                # too big for it: the free one makes room
    assert sorted(b.nbytes for b in w._kept) == [1000, 1200]
    assert w.counters["write_buffers_new"] == 4 and w.counters["write_buffers_reused"] == 0


def test_small_bodies_and_many_sizes_keep_few_buffers():
    """Empty or small bodies keep nothing (their faults cost little), and bodies of ever new
    sizes keep at most KEPT_BODIES buffers: the list a body's buffer is looked up in stays short."""
    w = FrameWrites()
    for n in (0, 1, 5000, serving.KEPT_BODY_MIN - 1):
        assert w._buffer(n).nbytes == n
    assert w._kept == []
    for i in range(3 * serving.KEPT_BODIES):       # each a byte over the last: no kept one fits it
        w._buffer(serving.KEPT_BODY_MIN + i)
    assert len(w._kept) == serving.KEPT_BODIES
    assert sum(b.nbytes for b in w._kept) <= serving.KEPT_BODY_BYTES
