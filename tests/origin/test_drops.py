"""The origin's drop log (kdn/origin/drops.py) over both backends, a directory and a real S3
server on loopback: keys come back in order from any position, the log survives a new
process, stays bounded, refuses to guess, and a collect or a host's delete logs each key
before it is gone. The head told to edges is settled: every key before it is gone from the
store; and a collect under readers finishes."""
import msgpack
import pytest

from kdn.core.errors import StoreError
from kdn.origin.drops import DropLog, settled
from kdn.origin.objects import LocalObjects, open_objects
from kdn.origin.store import ChunkStore


def keys(n, start=0):
    return [i.to_bytes(16, "big") for i in range(start, start + n)]


@pytest.fixture(params=["dir", "s3"])
def objects(request, tmp_path):
    if request.param == "dir":
        return lambda: LocalObjects(tmp_path / "origin")
    bucket = request.getfixturevalue("bucket")
    return lambda: open_objects(bucket.url, env=bucket.env)


def test_keys_come_back_in_order_from_any_position_and_after_a_restart(objects):
    log = DropLog(objects())
    assert (log.head, log.since(0)) == (0, ([], 0))
    assert log.append(keys(3)) == 3 and log.append([]) == 3 and log.append(keys(2, 3)) == 5
    assert log.since(0) == (keys(5), 5)
    assert log.since(2) == (keys(3, 2), 5) and log.since(3) == (keys(2, 3), 5)
    assert log.since(5) == ([], 5), "level with the head: nothing to replay"
    assert log.since(1, 4) == (keys(3, 1), 4), "up to a settled head"
    assert log.since(0, 3) == (keys(3), 3) and log.since(4, 3) == (None, 3)
    assert log.since(6) == (None, 5), "a position ahead of the log (a store rebuilt): start over"
    again = DropLog(objects())                       # a new origin process over the same objects
    assert again.state() == log.state() == {"log": log.id, "head": 5}
    assert again.since(1) == (keys(4, 1), 5)
    assert again.append(keys(1, 5)) == 6 and log.id == again.id


def test_another_store_has_another_log_id(tmp_path):
    a, b = DropLog(LocalObjects(tmp_path / "a")), DropLog(LocalObjects(tmp_path / "b"))
    assert a.id != b.id and len(a.id) == 16


def test_the_log_stays_bounded_and_a_trimmed_position_starts_over(tmp_path):
    log = DropLog(LocalObjects(tmp_path), max_kept=4)
    for i in range(5):
        log.append(keys(2, 2 * i))                    # 10 keys in appends of two
    assert log.head == 10 and log.oldest == 6, "the newest appends kept, about max_kept keys"
    assert log.since(6) == (keys(4, 6), 10)
    assert log.since(3) == (None, 10), "keys no longer kept: the edge drops everything it holds"
    names = [n for n, _ in LocalObjects(tmp_path).list("drops/") if n != "drops/log-id"]
    assert len(names) == 2, names
    assert DropLog(LocalObjects(tmp_path), max_kept=4).since(8) == (keys(2, 8), 10)


def test_an_unreadable_segment_is_an_error_naming_it_not_a_guess(tmp_path):
    objs = LocalObjects(tmp_path)
    log = DropLog(objs)
    log.append(keys(2))
    name = "drops/0000000000000000-0000000000000002"
    objs.put(name, [b"\xc1 not msgpack"])
    with pytest.raises(StoreError, match="unreadable") as e:
        log.since(0)
    assert name in str(e.value)
    objs.put(name, [msgpack.packb(keys(3))])        # three keys where the name says two
    with pytest.raises(StoreError, match="holds 3 keys, its name says 2"):
        log.since(1)


def test_collect_and_a_hosts_delete_log_each_key_before_it_is_gone(tmp_path):
    import numpy as np
    from kdn.core.chunk import Chunk
    from kdn.core.dtypes import OPAQUE
    from kdn.core.keys import namespace_digest
    s = ChunkStore(tmp_path / "origin")
    ns = namespace_digest("default", "drops-test")
    orphans = [Chunk(k, ns, np.full((1, 2, 1, 4, 2), i, np.float32), "float32")
               for i, k in enumerate(keys(3, 100))]
    objs = [Chunk(k, ns, np.full(64, i, np.uint8), OPAQUE) for i, k in enumerate(keys(2, 200))]
    s.put_chunks(orphans)
    s.put_objects(objs)
    s.release()                                     # the publisher of the orphans gave up
    assert s.collect()["chunks"] == 3
    assert s.drops.since(0) == (keys(3, 100), 3), "every collected key logged"
    other = namespace_digest("other", "drops-test")
    assert s.delete_objects(keys(2, 200), other) == ([], []) and s.drops.head == 3, "nothing of ours: nothing logged"
    # a key never stored here is logged too: edges may hold a copy its writer withdrew
    assert s.delete_objects(keys(3, 199), ns) == (keys(2, 200), keys(1, 199))
    assert s.drops.since(3) == (keys(2, 200) + keys(1, 199), 6)


def test_the_settled_head_names_only_keys_gone_and_a_collect_under_readers_finishes(tmp_path, monkeypatch):
    """Readers of the store (an edge's pull-through: get_chunks reads in the store's I/O
    threads) while a collect removes what they read: the collect finishes (its own reads
    once queued behind theirs, which waited for its lock: forever), and the head an edge is
    told never counts a key still stored."""
    import threading
    import time
    import numpy as np
    from kdn.core.chunk import Chunk
    from kdn.core.dtypes import OPAQUE
    from kdn.core.errors import ChunkNotFound
    from kdn.core.keys import namespace_digest
    s = ChunkStore(tmp_path / "origin", fsync=False)
    ns = namespace_digest("default", "drops-test")
    objs = [Chunk(k, ns, np.full(1 << 12, i % 256, np.uint8), OPAQUE) for i, k in enumerate(keys(64, 300))]
    s.put_objects(objs)
    delete = s.objects.delete

    def slow_delete(name):                            # a removal half done lasts a while
        time.sleep(0.005)
        return delete(name)
    monkeypatch.setattr(s.objects, "delete", slow_delete)
    stop = threading.Event()

    def read():
        while not stop.is_set():
            try:
                s.map(s.get, [o.key for o in objs])
            except ChunkNotFound:
                pass
    readers = [threading.Thread(target=read, daemon=True) for _ in range(4)]
    for t in readers:
        t.start()
    collected = {}
    collect = threading.Thread(target=lambda: collected.update(s.collect(object_ttl_s=0)), daemon=True)
    collect.start()
    deadline = time.monotonic() + 20
    while s.drops.head < len(objs) and time.monotonic() < deadline:
        time.sleep(0.001)
    state = {}                                        # the keys are logged: waits for their removal
    asking = threading.Thread(target=lambda: state.update(settled(s)), daemon=True)
    asking.start()
    asking.join(20)
    assert state == {"log": s.drops.id, "head": len(objs)}, "the collect never ended"
    logged, head = s.drops.since(0, state["head"])
    assert head == len(objs) and not any(s.has(k) for k in logged)
    collect.join(20)
    stop.set()
    for t in readers:
        t.join(20)
    assert not collect.is_alive() and collected["objects_expired"] == len(objs), collected
