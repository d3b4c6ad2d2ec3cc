"""The servers' bulk writes (kdn.core.serving.FrameWrites) and the receive buffers they and
the HTTP client keep (kdn.core.buffers.KeptBuffers): a buffer is written again only once
nothing views it, never beside a chunk still read, and the buffers kept stay within their
bounds. (The writes over a real edge's and origin's HTTP servers are in
tests/edge/test_http.py, the client's reuse in its test_receive_buffer_* there.)"""
import sys

import numpy as np

from kdn.core import serving
from kdn.core.buffers import KeptBuffers
from kdn.core.serving import FrameWrites


def _fill(buf, value):
    np.frombuffer(memoryview(buf), np.uint8)[:] = value


def test_a_buffer_is_written_again_only_once_nothing_views_it():
    kept = KeptBuffers(4, 1 << 20, fill=0.5)
    first, reused = kept.take(1000)
    assert not reused
    _fill(first, 1)
    view = np.frombuffer(memoryview(first).toreadonly(), np.uint8)[10:20]   # a chunk of the body
    del first
    second, reused = kept.take(1000)               # the first is viewed: new memory
    assert not reused
    _fill(second, 2)
    assert view.tolist() == [1] * 10               # the live chunk is untouched
    del second                                     # nothing views the second any more
    third, reused = kept.take(900)                 # so it is written again (900 fills over half)
    assert reused and third.nbytes == 900
    _fill(third, 3)
    assert view.tolist() == [1] * 10
    del view, third
    assert kept.take(1000)[1]                      # both free now
    assert not kept.take(400)[1]                   # under half of any kept one: new memory
    assert not kept.take(1001)[1]                  # more than any holds: new memory


def test_the_buffers_kept_stay_within_their_bytes_and_count():
    kept = KeptBuffers(3, 2500)
    held = [kept.take(1000)[0], kept.take(1000)[0]]  # both in use, both kept (2000 bytes)
    _fill(held[0], 7)
    assert kept.nbytes == 2000
    extra, _ = kept.take(1000)                     # no room, none free: in place of the oldest in use
    assert kept.nbytes == 2000
    assert not any(b is held[0].base for b in kept._kept)      # the first: freed once its views go
    del held[1], extra                             # the two kept ones free again
    kept.take(1200)                                # too big for them: a free one makes room
    assert sorted(b.nbytes for b in kept._kept) == [1000, 1200]
    assert kept.take(10)[1]                        # fill 0: any free buffer that holds it
    assert held[0].tolist() == [7] * 1000          # the dropped one, still viewed, never written
    small = KeptBuffers(2, 1 << 20, least_bytes=100)
    held = [small.take(99)[0], small.take(100)[0], small.take(101)[0], small.take(102)[0]]
    assert sorted(b.nbytes for b in small._kept) == [101, 102]   # at most 2, the newest, none under 100
    assert not KeptBuffers(2, 500).take(600)[1] and KeptBuffers(2, 500)._kept == []


def test_threads_sharing_kept_buffers_never_write_into_a_buffer_another_one_views():
    """An edge's pulling connections share one KeptBuffers (kdn/edge/dataplane.py): each of 4
    threads takes a buffer, fills it with its own byte while holding a view of it, and checks
    every byte is still its own before letting go. A buffer handed to two threads at once would
    show another thread's byte. Buffers are reused all along, within the bounds."""
    import threading
    kept = KeptBuffers(4, 64 << 10, fill=0.5)
    bad, reused = [], [0] * 4

    def work(t):
        for i in range(300):
            buf, again = kept.take(8 << 10)
            reused[t] += again
            view = np.frombuffer(memoryview(buf).toreadonly(), np.uint8)   # as a chunk views it
            _fill(buf, t + 1)
            del buf
            if not (view == t + 1).all():
                bad.append((t, i))
            del view

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)                    # threads switch all the time: races show
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert not bad, bad[:5]
    assert sum(reused) > 600 and kept.nbytes <= 64 << 10 and len(kept._kept) <= 4


def test_a_servers_bodies_of_ever_new_sizes_keep_few_buffers():
    """Empty or small bodies keep nothing (their faults cost little), and bodies of ever new
    sizes keep at most KEPT_BODIES buffers, within KEPT_BODY_BYTES; each body is counted."""
    w = FrameWrites(prefix="ingest_")
    for n in (0, 1, 5000, serving.KEPT_BODY_MIN - 1):
        assert w._buffer(n).nbytes == n
    assert w._kept.nbytes == 0
    for i in range(3 * serving.KEPT_BODIES):       # each a byte over the last: no kept one fits it
        w._buffer(serving.KEPT_BODY_MIN + i)
    assert len(w._kept._kept) == serving.KEPT_BODIES and w._kept.nbytes <= serving.KEPT_BODY_BYTES
    assert w._buffer(serving.KEPT_BODY_MIN).nbytes == serving.KEPT_BODY_MIN      # a free one again
    assert w.counters["ingest_buffers_reused"] == 1
    assert w.counters["ingest_buffers_new"] == 4 + 3 * serving.KEPT_BODIES
