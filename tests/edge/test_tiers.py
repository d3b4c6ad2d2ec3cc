"""The edge's two tiers: lookups by namespace, hits by tier, TTL, pins, drops."""
import asyncio
import threading
import time

import xxhash

from kdn.core.chunk import decode
from kdn.edge.tiers import Held, Tiers
from kdn.core.keys import namespace_digest

OTHER = namespace_digest("other", "edge-unit")


def _tiers(kit, chunks=(), role="main", **kw):
    t = Tiers(kw.pop("capacity", 8 << 20), **kw)
    for c in chunks:
        assert t.put(role, c.key, kit.held(c))
    return t


def test_get_counts_hits_by_tier_and_ignores_another_namespace(kit):
    a, b = kit.make_chunks(2)
    t = _tiers(kit, [a])
    t.put("hot", b.key, kit.held(b))
    assert t.get(a.key, kit.NS).key == a.key and t.get(b.key).key == b.key
    assert t.counters == {"main_hits": 1, "hot_hits": 1}
    # a reader of another namespace finds nothing, and nothing it can see moves
    before = (t.main.stats()["hits"], t.hot.stats()["hits"])
    assert t.get(a.key, OTHER) is None and t.get(b.key, OTHER) is None
    assert t.counters == {"main_hits": 1, "hot_hits": 1}
    assert (t.main.stats()["hits"], t.hot.stats()["hits"]) == before
    assert t.holds(a.key, kit.NS) and not t.holds(a.key, OTHER) and t.holds(a.key)


def test_set_ttl_applies_to_chunks_held_now_and_sweep_drops_them(kit):
    cs = kit.make_chunks(3)
    t = _tiers(kit, cs[:2])
    assert t.set_ttl([c.key for c in cs], 0.05) == 2, "only held chunks get a deadline"
    assert t.get(cs[0].key) is not None
    time.sleep(0.06)
    assert t.get(cs[0].key) is None, "an expired chunk is not served even before the sweep"
    assert asyncio.run(t.sweep()) == 2 and len(t) == 0 and t.counters["ttl_expired"] == 2
    assert t.expiry == {}


def test_pin_moves_a_hot_copy_to_main_and_a_pin_that_does_not_fit_is_counted(kit):
    a, b = kit.make_chunks(2)
    t = _tiers(kit, [a], capacity=4 * a.nbytes, hot_fraction=0.5)
    t.put("hot", b.key, kit.held(b))
    assert t.pin([a.key, b.key, b"\0" * 16]) == 2
    assert b.key in t.main and b.key not in t.hot
    assert t.main.stats()["pinned_items"] == 2
    big = Held(None, b"\1" * 16, kit.NS, 10 * a.nbytes, 10 * a.nbytes)
    assert t.put("main", big.key, big, pin=True) is False        # kept unpinned: too big anyway
    assert t.counters["pin_refused"] == 1


def test_drop_removes_from_both_tiers_and_forgets_the_ttl(kit):
    a, = kit.make_chunks(1)
    t = _tiers(kit, [a])
    t.set_ttl([a.key], 100)
    assert asyncio.run(t.drop([a.key])) == 1 and asyncio.run(t.drop([a.key])) == 0
    assert a.key not in t.expiry and t.peek(a.key) is None


def test_stats_report_both_tiers_and_the_kv_held(kit):
    a, b = kit.make_chunks(2)
    t = _tiers(kit, [a, b])
    s = t.stats()
    assert s["main"]["items"] == 2 and s["hot"]["items"] == 0
    assert s["held_raw_bytes"] == a.raw + b.raw and s["hot_copies"] == 0


def test_memorys_victims_go_to_the_disk_tier_and_a_disk_hit_is_promoted(kit, tmp_path, loop):
    from kdn.edge.disk import DiskTier
    cs = kit.make_chunks(4)
    t = Tiers(3 * cs[0].nbytes, policy="lru", hot_fraction=0.34, disk=DiskTier(tmp_path, 1 << 20))
    for c in cs:                       # main holds one chunk: three are victims
        t.put("main", c.key, kit.held(c))
    assert len(t.main) == 1 and len(t.pending) == 3, "victims are queued, not written yet"
    assert len(t.disk) == 0
    assert loop.run(t.drain_write_backs(lambda obj: True)) == 3
    assert len(t.disk) == 3 and t.pending_bytes == 0
    assert t.holds(cs[0].key, kit.NS) and not t.holds(cs[0].key, OTHER)
    got = loop.run(t.from_disk([cs[0].key], kit.NS, ["hot"]))
    assert loop.run(got[0].resolve()).equal(cs[0]) and t.hot.peek(cs[0].key) is got[0]
    assert t.counters["disk_hits"] == 1 and t.stats()["disk"]["write_backs"] == 3
    assert loop.run(t.drop([cs[1].key])) == 1 and not t.disk.path(cs[1].key).exists()
    # a full queue drops the write-back (counted) rather than hold memory for a slow disk
    t.write_back_queue_bytes = 1
    t.put("main", b"\7" * 16, kit.held(cs[3]))
    assert t.counters["disk_write_back_dropped_busy"] == 1


def test_a_victim_waiting_for_the_disk_is_still_served(kit, tmp_path):
    from kdn.edge.disk import DiskTier
    a, b = kit.make_chunks(2)
    t = Tiers(2 * a.nbytes, policy="lru", hot_fraction=0.25, disk=DiskTier(tmp_path, 1 << 20))
    t.put("main", a.key, kit.held(a))
    t.put("main", b.key, kit.held(b))                  # a is the victim, queued
    assert a.key in t.pending and t.get(a.key, kit.NS).obj.equal(a)
    assert t.get(a.key, OTHER) is None and t.counters["write_back_queue_hits"] == 1


def test_a_ttl_sweep_deletes_its_files_in_one_worker_thread_call(kit, tmp_path, loop):
    from kdn.edge.disk import DiskTier
    cs = kit.make_chunks(6)
    t = Tiers(4 * cs[0].nbytes, policy="lru", disk=DiskTier(tmp_path, 8 << 20))
    for c in cs[1:]:
        assert t.disk.write(c)
    t.put("main", cs[0].key, kit.held(cs[0]))
    assert t.set_ttl([c.key for c in cs], 0.01) == 6, "chunks on disk get the TTL too"
    threads, discard = [], t.disk.discard

    def spied(key):
        threads.append(threading.current_thread())
        return discard(key)
    t.disk.discard = spied
    time.sleep(0.02)
    assert loop.run(t.sweep()) == 6 and len(t) == 0 and len(t.disk) == 0 and t.expiry == {}
    assert not any(t.disk.path(c.key).exists() for c in cs)
    assert len(threads) == 6 and len(set(threads)) == 1 and threads[0] is not loop.thread


def test_a_peers_object_is_read_once_so_each_load_hashes_it_once(kit, ray_cluster, monkeypatch):
    """A peer's chunk is a reference into its store, and each read of a reference is a new
    object: a Held that read it again for every check (the frame sent, the copy kept, the
    disk's fill) would hash it again each time. It is read once and kept."""
    import ray
    from kdn.core import chunk as chunk_module
    from kdn.edge import forms as forms_module
    a, = kit.make_chunks(1)
    ref = ray.put(a)
    assert ray.get(ref) is not ray.get(ref), "Ray hands out a new object per read"
    hashed = []

    class Counting:             # xxhash, counting the passes over a whole chunk's KV
        def __getattr__(self, name):
            return getattr(xxhash, name)

        def xxh3_64_intdigest(self, buf, *args):
            if memoryview(buf).nbytes >= a.nbytes:
                hashed.append(memoryview(buf).nbytes)
            return xxhash.xxh3_64_intdigest(buf, *args)
    f = forms_module.Forms("raw", {a.key: a.digest()}.get, None, "here")
    for module in (forms_module, chunk_module):     # the edge's hashing, and Chunk.digest's
        monkeypatch.setattr(module, "xxhash", Counting())
    h = Held.from_wire(Held.of(a).wire())
    assert not h.own

    async def one_load():
        parts, bad = f.frames([await h.resolve()], ["raw"])          # sent to the reader
        kept = f.store_form(await h.resolve())                       # the copy kept
        return bad, kept, f.intact(await h.resolve())                # the disk's fill
    bad, kept, intact = asyncio.run(one_load())
    assert bad is None and kept is not None and intact
    assert hashed == [a.nbytes], f"hashed {len(hashed)} times"


def test_a_chunk_verified_before_its_put_is_framed_from_the_store_without_hashing_again(kit, ray_cluster, monkeypatch):
    """An edge verifies a copy as it arrives (hashing it) and then puts it into its node's
    store; every later read of the reference is a new object. The checksum goes with the Held,
    so framing the sealed copy for a peer or a client costs no second pass. A chunk put
    unverified, or a copy made writable, is hashed when framed; a peer's object crossed a link
    and is hashed by whoever reads it."""
    import ray
    from kdn.edge import forms as forms_module
    from kdn.edge.tiers import resolve_all
    a, b = kit.make_chunks(2)
    f = forms_module.Forms("raw", {a.key: a.digest(), b.key: b.digest()}.get, None, "here")
    arrived = ray.get(ray.put(a))                 # a pushed copy, as the edge reads it: read-only
    verified = f.store_form(arrived)              # verified as it arrives: hashed
    assert verified._xxh == a.digest()
    held, unverified = Held.of(verified), Held.of(b)
    assert held.xxh == a.digest() and unverified.xxh is None
    hashed = []

    class Counting:
        def __getattr__(self, name):
            return getattr(xxhash, name)

        def xxh3_64_intdigest(self, buf, *args):
            hashed.append(memoryview(buf).nbytes)
            return xxhash.xxh3_64_intdigest(buf, *args)
    monkeypatch.setattr(forms_module, "xxhash", Counting())
    objs = asyncio.run(resolve_all([held, unverified]))
    assert objs[0]._xxh == a.digest() and not objs[0].kv.flags.writeable
    parts, bad = f.frames(objs, ["raw", "raw"])
    assert bad is None and hashed == [b.nbytes], "only the chunk put unverified is hashed"
    assert [decode(b"".join(bytes(p) for p in fr)).equal(c) for fr, c in zip(parts, (a, b))] == [True, True]
    # one read at a time (Held.resolve) carries it too; a peer's object (from_wire) does not
    again = Held.of(verified)
    assert asyncio.run(again.resolve())._xxh == a.digest()
    assert asyncio.run(Held.from_wire(again.wire()).resolve())._xxh is None


def test_an_object_under_the_inline_size_is_kept_in_the_edges_heap_as_a_copy_of_its_own(kit, ray_cluster):
    """Under Ray an edge keeps a chunk in its node's object store, but one under INLINE_BYTES in
    its own memory: a read-only copy (never a view pinning the buffer it arrived in), with the
    checksum it was verified with; it crosses to a peer inside the answer, and the peer holds
    it as a copy received (kept, it copies it again)."""
    import numpy as np
    import ray
    from kdn.core.chunk import Chunk, Encoded
    from kdn.edge.tiers import INLINE_BYTES
    big, = kit.make_chunks(1)                                  # 128 KiB: stored
    at = Chunk(b"a" * 16, b"n" * 16, np.ones(INLINE_BYTES, np.uint8), "opaque")   # at the bound: stored
    assert big.nbytes > INLINE_BYTES and isinstance(Held.kept(big).ref, ray.ObjectRef)
    assert isinstance(Held.kept(at).ref, ray.ObjectRef)
    arrived = np.zeros(1 << 20, np.uint8)                       # a large buffer it is a view into
    arrived[:4096] = np.arange(4096) % 251
    small = Chunk(b"s" * 16, b"n" * 16, arrived[:4096], "opaque")
    object.__setattr__(small, "_xxh", xxhash.xxh3_64_intdigest(small.kv))
    held = Held.kept(small)
    assert held.ref is None and held.obj is not small and held.obj.kv.base is not arrived
    assert not held.obj.kv.flags.writeable and held.obj._xxh == small._xxh
    assert np.array_equal(held.obj.kv, small.kv) and (held.key, held.nbytes, held.own) == (small.key, 4096, True)
    arrived[:4096] = 0                                          # the buffer reused: the copy is its own
    assert asyncio.run(held.resolve()).kv[1] == 1
    peer = Held.from_wire(held.wire(), "far-0")
    assert peer.ref is None and peer.obj is held.obj and not peer.own and peer.src == "far-0"
    frame = Encoded.of(Chunk(big.key, big.ns, np.zeros_like(big.kv), "float32"), "zstd")
    kept = Held.kept(frame)                                     # 128 KiB of KV in a small frame: inline
    assert frame.nbytes < INLINE_BYTES and kept.ref is None and kept.obj is not frame
    assert kept.obj.codec == "zstd" and bytes(kept.obj.frame) == bytes(frame.frame)
    assert not kept.obj.frame.flags.writeable
