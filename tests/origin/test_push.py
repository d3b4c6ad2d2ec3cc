"""Pushes: ring owners plus pinned regions, only what an edge lacks, batches bounded in bytes,
re-homing only to new owners, dead edges skipped and counted."""
import asyncio

import numpy as np
import pytest

from kdn.core.chunk import Chunk, Encoded
from kdn.core.manifest import Manifest
from kdn.origin import push
from kdn.origin.membership import Membership
from kdn.origin.push import Pusher, outgoing
from kdn.origin.store import ChunkStore
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology

TOPO = Topology.default_local(["us-east", "eu-west", "ap-south"], edges_per_region=2,
                              capacity_bytes=1 << 30)
MEMBERS = [(e.name, e.region, 1.0) for e in TOPO.edges]
NAMES = [m[0] for m in MEMBERS]


def published(store, name="kb", n_tokens=1000):
    m = Manifest.build(name, "acme", "fp", [("d", np.arange(n_tokens))], chunk_tokens=64)
    rng = np.random.default_rng(1)
    for k in m.keys:
        store.put(Chunk(k, m.ns, rng.standard_normal((2, 2, 2, 16, 8)).astype(np.float32), "float32"))
    return store.commit(m)


@pytest.fixture
def parts(tmp_path, edges):
    store = ChunkStore(tmp_path / "store", fsync=False)
    ms = Membership(tmp_path, TOPO, replicas=2)
    ms.save(members=MEMBERS)
    fake = edges(NAMES)
    return store, ms, fake, Pusher(store, fake, ms)


def test_targets_are_owners_plus_the_first_edge_of_each_pinned_region(parts):
    store, ms, _, pusher = parts
    m = published(store)
    owners = ms.ring.owners_batch(list(m.keys), 2)
    t = pusher.targets(m)
    assert sum(map(len, t.values())) == 2 * len(m.keys)
    assert all(set(t[n]) == {k for k, o in zip(m.keys, owners) if n in o} for n in t)
    ms.save(overrides={"acme/kb": {"pin_regions": ["eu-west"], "replicas": 1}})
    t = pusher.targets(m)
    first = ms.edges_in("eu-west")[0]
    assert sorted(t[first]) == sorted(m.keys)                  # the whole KB, each key once
    assert sum(len(ks) for n, ks in t.items() if n != first) <= len(m.keys)


def test_push_sends_only_what_each_edge_lacks(parts):
    store, ms, fake, pusher = parts
    m = published(store)

    async def go():
        placement, pushed = await pusher.push(m)
        assert placement == pushed and sum(pushed.values()) == 2 * len(m.keys)
        for n, e in fake.edges.items():
            assert len(e.held) == placement.get(n, 0)
            assert all(isinstance(c, Chunk) for c in e.held.values())
        _, again = await pusher.push(m)
        assert sum(again.values()) == 0 and fake.count("put_chunks") == {n: 1 for n in placement}
    asyncio.run(go())


def test_batches_are_bounded_in_bytes(parts, monkeypatch):
    store, ms, fake, pusher = parts
    m = published(store)
    monkeypatch.setattr(push, "PUSH_BATCH_BYTES", 3 * store.size_of(m.keys[0]))

    async def go():
        return await pusher.send(NAMES[0], list(m.keys), asyncio.Semaphore(2))

    assert asyncio.run(go()) == len(m.keys)
    assert fake.count("put_chunks")[NAMES[0]] == -(-len(m.keys) // 3)


def test_a_paths_busy_time_counts_overlapping_batches_once_and_keeps_up_while_they_run(parts, monkeypatch):
    """push_<path>_busy_us: the wall time a path has a batch in flight (kdn status divides a
    path's bytes by it), each batch's own time in push_<path>_us adding up to more."""
    *_, pusher = parts
    now = [100.0]
    monkeypatch.setattr(push.time, "perf_counter", lambda: now[0])
    first, second = pusher._busy("http"), pusher._busy("http")
    first.__enter__()
    now[0] += 1.0
    second.__enter__()                     # beside the first for 1 s
    now[0] += 1.0
    first.__exit__(None, None, None)
    assert pusher.counters["push_http_busy_us"] == 2_000_000      # counted as they end, not at idle
    now[0] += 1.0
    second.__exit__(None, None, None)
    now[0] += 5.0                          # idle: not counted
    with pytest.raises(TimeoutError):
        with pusher._busy("http"):         # a batch that fails still ends its time
            now[0] += 0.5
            raise TimeoutError
    assert pusher.counters["push_http_busy_us"] == 3_500_000 and not pusher._in_flight
    assert pusher.counters["push_ray_busy_us"] == 0


def test_rehome_sends_each_chunk_only_to_its_new_owners(parts):
    store, ms, fake, pusher = parts
    m = published(store)
    old = Ring([Edge(*x) for x in MEMBERS[:-1]])
    new_owner = MEMBERS[-1][0]
    owned = {k for k, o in zip(m.keys, ms.ring.owners_batch(list(m.keys), 2)) if new_owner in o}

    async def go():
        return await pusher.rehome(old)

    assert asyncio.run(go()) == len(owned)
    assert set(fake.edges[new_owner].held) == owned
    assert sum(len(e.held) for n, e in fake.edges.items() if n != new_owner) == 0


def test_a_dead_edge_is_skipped_and_counted(parts):
    store, ms, fake, pusher = parts
    m = published(store)
    dead = NAMES[0]
    fake.dead.add(dead)

    async def go():
        return await pusher.push(m)

    placement, pushed = asyncio.run(go())
    assert pushed[dead] == 0 and placement[dead] > 0
    assert pusher.counters["edge_call_failures"] == 1
    assert asyncio.run(pusher.every_edge().set_ttl([m.keys[0]], 5.0))[0] is None


def test_outgoing_sends_stored_frames_as_they_are_and_never_a_corrupt_one(tmp_path):
    store = ChunkStore(tmp_path, fsync=False, codec="zstd")
    m = published(store)
    path = tmp_path / "chunks" / m.keys[1].hex()[:2] / (m.keys[1].hex() + ".kdnc")
    raw = bytearray(path.read_bytes())
    raw[-20] ^= 1
    path.write_bytes(bytes(raw))
    out = outgoing(store, [m.keys[0], m.keys[1], bytes(16)])
    assert isinstance(out[0], Encoded) and out[0].codec == "zstd" and out[1:] == [None, None]
    assert out[0].decode().equal(store.get(m.keys[0]))
