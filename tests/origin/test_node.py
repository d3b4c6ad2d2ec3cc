"""The origin actor: publish, membership, operator controls, input checks, faults.

Most tests run the actor's methods in this process against stand-in edges (the `edges`
fixture: the origin meets edges only through kdn.core.rpc.Actors' interface). The last ones run
it as a real Ray actor on the `ray_cluster`, where arguments and errors cross Ray.
"""
import asyncio
import errno
import math
import os
import time

import msgpack
import numpy as np
import pytest

from kdn.core.chunk import Chunk
from kdn.core.errors import (AccessDenied, BadRequest, ManifestError, StoreError, VersionNotFound)
from kdn.core.manifest import Manifest
from kdn.origin.node import OriginNode
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology

ADMIN = "admin-token-0123456789"
TOPO = Topology.default_local(["us-east", "eu-west", "ap-south"], edges_per_region=1,
                              capacity_bytes=1 << 30)
EDGES = [e.name for e in TOPO.edges]                       # ap-south-0, eu-west-0, us-east-0
MEMBERS = [(e.name, e.region, 1.0) for e in TOPO.edges]


def run(coro):
    return asyncio.run(coro)


def kb(name="handbook", tenant="acme", tokens=range(0, 1000)) -> Manifest:
    return Manifest.build(name, tenant, "fp-1", [("a", np.asarray(tokens))], chunk_tokens=64)


def chunks_of(m: Manifest) -> list:
    def kv(key):
        return np.random.default_rng(int.from_bytes(key[:8], "little")).standard_normal(
            (2, 2, 2, 16, 8)).astype(np.float32)
    return [Chunk(k, m.ns, kv(k), "float32") for k in m.keys]


def make_origin(tmp_path, edges, names=EDGES, **kw):
    fake = edges(names, token=ADMIN)
    node = OriginNode("t", str(tmp_path), TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake, **kw)
    return node, fake


async def absent(node, keys, token=ADMIN) -> list:
    """Indices of keys the origin does not hold intact (stored() answers None for them)."""
    return [i for i, x in enumerate(await node.stored(list(keys), token=token)) if x is None]


async def publish(node, m, token=ADMIN) -> dict:
    cs = chunks_of(m)
    missing = await absent(node, m.keys, token=token)
    if missing:
        await node.put_chunks([cs[i] for i in missing], token=token)
    return await node.commit(m.to_dict(), token=token)


def chunk_file(tmp_path, key):
    return tmp_path / "store" / "chunks" / key.hex()[:2] / (key.hex() + ".kdnc")


# --- publish -------------------------------------------------------------------------------
def test_publish_stores_commits_and_pushes_to_ring_owners(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        m = kb()
        receipt = await publish(node, m)
        assert (receipt["version"], receipt["unchanged"], receipt["chunks"]) == (1, False, 16)
        owners = node.roster.ring.owners_batch(list(m.keys), 2)
        for name, e in fake.edges.items():
            want = {k for k, o in zip(m.keys, owners) if name in o}
            assert set(e.held) == want and receipt["placement"][name] == len(want)
            assert [x["version"] for x in e.manifests] == [1]
        assert sum(receipt["pushed"].values()) == 2 * 16
        again = await publish(node, m)                   # nothing missing, no new version, no push
        assert (again["version"], again["unchanged"], sum(again["pushed"].values())) == (1, True, 0)
        assert await absent(node, m.keys) == []
        st = await node.stats(token=ADMIN)
        assert st["counters"]["chunks_written"] == 16 and st["counters"]["versions_committed"] == 1
        assert st["store"]["versions"] == 1
    run(go())


def test_a_corrupt_stored_chunk_is_missing_and_a_republish_repairs_it(tmp_path, edges):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        m = kb()
        await publish(node, m)
        path = chunk_file(tmp_path, m.keys[5])
        raw = bytearray(path.read_bytes())
        raw[-50] ^= 0x10
        path.write_bytes(bytes(raw))
        assert await absent(node, m.keys) == [5]
        assert await node.has(list(m.keys[4:7]), token=ADMIN) == [True, False, True]
        # with ns: the lookup hint, by header only (cheap for any reader's lookup)
        assert await node.has(list(m.keys[4:7]), m.ns, token=ADMIN) == [True, True, True]
        assert await node.has(list(m.keys[4:7]), bytes(16), token=ADMIN) == [False] * 3
        assert (await node.get_chunks([m.keys[5]], token=ADMIN)) == [None]    # never served
        receipt = await publish(node, m)
        assert receipt["unchanged"] and receipt["version"] == 1
        assert await absent(node, m.keys) == []
        (got,) = await node.get_chunks([m.keys[5]], token=ADMIN)
        assert got.equal(chunks_of(m)[5])
        st = await node.stats(token=ADMIN)
        assert st["store"]["repaired"] == 1 and st["counters"]["chunks_written"] == 17
    run(go())


def test_stored_verifies_a_large_kb_quickly(tmp_path, edges):
    """stored() reads every stored chunk: 16 MiB of KV here, measured and bounded loosely."""
    import time

    async def go():
        node, _ = make_origin(tmp_path, edges)
        m = Manifest.build("big", "acme", "fp-1", [("a", np.arange(64 * 256))], chunk_tokens=256)
        rng = np.random.default_rng(0)
        cs = [Chunk(k, m.ns, rng.standard_normal((8, 2, 4, 256, 16)).astype(np.float32), "float32")
              for k in m.keys]   # 64 chunks of 256 KiB
        await node.put_chunks(cs, token=ADMIN)
        t0 = time.perf_counter()
        assert await absent(node, m.keys) == []
        return time.perf_counter() - t0

    assert run(go()) < 2.0


def test_publish_refuses_bad_input_with_bad_request(tmp_path, edges):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        m = kb()
        with pytest.raises(BadRequest, match="a key must be 16 bytes, got 3 bytes"):
            await node.stored([b"abc"], token=ADMIN)
        with pytest.raises(BadRequest, match="keys must be a list of at most"):
            await node.stored(b"x" * 16, token=ADMIN)
        with pytest.raises(BadRequest, match="item 1 is a str, not a Chunk"):
            await node.put_chunks([chunks_of(m)[0], "chunk"], token=ADMIN)
        with pytest.raises(BadRequest, match="push must be True or False, got 1"):
            await node.commit(m.to_dict(), push=1, token=ADMIN)
        with pytest.raises(ManifestError, match="chunk\\(s\\) are not stored"):
            await node.commit(m.to_dict(), token=ADMIN)
        with pytest.raises(BadRequest, match="namespace digest must be 16 bytes"):
            await node.manifests(b"short", token=ADMIN)
        with pytest.raises(BadRequest, match="KB name must match"):
            await node.manifest(m.ns, "../etc", token=ADMIN)
        with pytest.raises(BadRequest, match="version must be an int >= 1, got True"):
            await node.delete_version(m.ns, "handbook", True, token=ADMIN)
        with pytest.raises(VersionNotFound):
            await node.delete_version(m.ns, "handbook", 1, token=ADMIN)
    run(go())


def test_every_method_but_ping_membership_and_stats_needs_the_admin_token(tmp_path, edges):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        m = kb()
        calls = {"stored": ([m.keys[0]],), "has": ([m.keys[0]],), "put_chunks": ([],),
                 "commit": (m.to_dict(),), "get_chunks": ([m.keys[0]],), "manifests": (),
                 "manifest": (m.ns, "handbook"), "delete_version": (m.ns, "handbook", 1),
                 "collect": (), "set_members": (MEMBERS,), "add_edge": ("x-1", "us-east"),
                 "remove_edge": ("us-east-0",), "set_override": ("acme", "handbook"),
                 "warm": ("acme", "handbook", "us-east"), "auth_config": (),
                 "put_objects": ([],), "delete_objects": ([], m.ns), "pushes_settled": (),
                 "pull_objects": ("us-east-0", [])}
        for method, args in calls.items():
            for token in (None, "wrong-token-0123456789"):
                with pytest.raises(AccessDenied, match="needs the network's admin token"):
                    await getattr(node, method)(*args, token=token)
        assert (await node.ping(token=None))["role"] == "origin"
        assert (await node.membership())["version"] == 0
        assert (await node.stats())["role"] == "origin"
        assert await node.auth_config(token=ADMIN) == {"admin": ADMIN, "readers": {}}
    run(go())


# --- membership ----------------------------------------------------------------------------
def test_set_members_broadcasts_a_new_version_and_rehomes(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        m1 = await node.set_members(MEMBERS[:2], token=ADMIN)
        assert m1["version"] == 1 and [x[0] for x in m1["members"]] == EDGES[:2]
        m = kb()
        await publish(node, m)
        assert fake.edges["us-east-0"].held == {}
        m2 = await node.set_members(MEMBERS, token=ADMIN)
        assert m2["version"] == 2
        for e in fake.edges.values():
            assert e.version == 2 and "overrides" not in e.membership   # edges never get KB names
        owned = {k for k, o in zip(m.keys, node.roster.ring.owners_batch(list(m.keys), 2))
                 if "us-east-0" in o}
        assert owned and set(fake.edges["us-east-0"].held) == owned       # re-homed to the new edge
        assert (await node.stats(token=ADMIN))["counters"]["rehomed_chunks"] >= len(owned)
        same = await node.set_members(MEMBERS, token=ADMIN)              # no change: no new version
        assert same["version"] == 2
        reopened = OriginNode("t", str(tmp_path), TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake)
        assert (await reopened.membership())["version"] == 2
        assert reopened.roster.members == MEMBERS
    run(go())


@pytest.mark.parametrize("members, message", [
    ([("us-east-0", "us-east", 1.0), ("x", "mars", 1.0)], "edge 'x' is in region 'mars', which the topology does not name"),
    ([("us-east-0", "us-east", 1.0), ("us-east-0", "eu-west", 1.0)], "edge names must be unique; given more than once: us-east-0"),
    ([("us-east-0", "us-east", True)], "edge 'us-east-0' weight must be a number"),
    ([("us-east-0", "us-east", math.nan)], "edge 'us-east-0' weight must be a number"),
    ([("us-east-0", "us-east", 0)], "edge 'us-east-0' weight must be a number"),
    ([("a:b", "us-east", 1.0)], "member 0 name must be 1-64 letters"),
    ([("us-east-0", "us-east")], "member 0 must be \\(name, region, weight\\)"),
    ("us-east-0", "members must be a list"),
])
def test_a_bad_set_members_changes_nothing(tmp_path, edges, members, message):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        saved = (tmp_path / "membership.msgpack").read_bytes()
        calls = len(fake.calls)
        with pytest.raises(BadRequest, match=message):
            await node.set_members(members, token=ADMIN)
        assert (await node.membership())["version"] == 1 and node.roster.members == MEMBERS
        assert (tmp_path / "membership.msgpack").read_bytes() == saved
        assert len(fake.calls) == calls                  # nothing broadcast
    run(go())


def test_add_and_remove_edge_check_their_arguments(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges, names=EDGES + ["eu-west-1"])
        await node.set_members(MEMBERS, token=ADMIN)
        with pytest.raises(BadRequest, match="edge 'us-east-0' is already a member"):
            await node.add_edge("us-east-0", "us-east", token=ADMIN)
        with pytest.raises(BadRequest, match="region 'mars'"):
            await node.add_edge("eu-west-1", "mars", token=ADMIN)
        with pytest.raises(BadRequest, match="edge 'nope' is not a member"):
            await node.remove_edge("nope", token=ADMIN)
        added = await node.add_edge("eu-west-1", "eu-west", 2.0, token=ADMIN)
        assert added["version"] == 2 and ["eu-west-1", "eu-west", 2.0] in added["members"]
        removed = await node.remove_edge("us-east-0", token=ADMIN)
        assert removed["version"] == 3 and "us-east-0" not in [x[0] for x in removed["members"]]
        assert fake.forgotten == ["us-east-0"]
    run(go())


def test_overrides_are_shown_in_stats_to_the_admin_only(tmp_path, edges):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        await publish(node, kb())
        await node.set_override("acme", "handbook", replicas=3, token=ADMIN)
        for token in (None, ADMIN):
            m = await node.membership(token=token)
            assert "overrides" not in m and m["version"] == 1
        st = await node.stats()
        assert st["override_count"] == 1 and "overrides" not in st and "quarantined_manifests" not in st
        assert "acme" not in repr(st) and "handbook" not in repr(st)
        st = await node.stats(token=ADMIN)
        assert st["overrides"] == {"acme/handbook": {"replicas": 3}} and st["quarantined_manifests"] == []
    run(go())


def test_a_corrupt_membership_file_is_quarantined_and_the_version_recovered(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS[:2], token=ADMIN)
        await node.set_members(MEMBERS, token=ADMIN)            # edges now hold version 2
        path = tmp_path / "membership.msgpack"
        path.write_bytes(path.read_bytes()[:-7])               # a torn file
        restarted = OriginNode("t", str(tmp_path), TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake)
        st = await restarted.stats()
        assert st["membership_quarantined"] and st["membership_recovering"]
        assert st["counters"]["membership_quarantined"] == 1
        assert (tmp_path / "membership.msgpack.corrupt").exists() and not path.exists()
        assert restarted.roster.members == MEMBERS              # the topology's edges
        await restarted.ping()                                  # starts the watch
        for _ in range(300):                                    # a round a second; the machine may be busy
            await asyncio.sleep(0.1)
            if not restarted.roster.recovering:
                break
        assert (await restarted.membership())["version"] == 3   # above every edge's 2
        assert all(e.version == 3 for e in fake.edges.values())
        d = msgpack.unpackb(path.read_bytes())
        assert d["version"] == 3 and [tuple(x) for x in d["members"]] == MEMBERS
        again = OriginNode("t", str(tmp_path), TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake)
        assert not again.roster.recovering and again.roster.version == 3
    run(go())


def test_an_operator_change_while_recovering_is_numbered_above_the_edges(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS[:2], token=ADMIN)
        await node.set_members(MEMBERS, token=ADMIN)
        (tmp_path / "membership.msgpack").write_bytes(b"torn")
        restarted = OriginNode("t", str(tmp_path), TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake)
        out = await restarted.set_members(MEMBERS[1:], token=ADMIN)
        assert out["version"] == 4 and not restarted.roster.recovering
        assert {n: e.version for n, e in fake.edges.items()} == {EDGES[0]: 3, EDGES[1]: 4, EDGES[2]: 4}
        assert [x[0] for x in fake.edges["us-east-0"].membership["members"]] == EDGES[1:]
    run(go())


def test_a_quarantined_membership_without_a_new_file_still_recovers(tmp_path, edges):
    (tmp_path / "membership.msgpack").write_bytes(b"\x92garbage")
    node, _ = make_origin(tmp_path, edges)                      # quarantines
    assert node.roster.recovering
    again, _ = make_origin(tmp_path, edges)                     # restarted before saving anything
    assert again.roster.recovering and again.roster.members == MEMBERS


def test_a_dead_edge_does_not_fail_a_publish_and_is_counted(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        fake.dead.add("eu-west-0")
        receipt = await publish(node, kb())
        assert receipt["pushed"]["eu-west-0"] == 0 and receipt["pushed"]["us-east-0"] > 0
        st = await node.stats()
        assert st["counters"]["edge_call_failures"] >= 2      # add_manifest and have
    run(go())


# --- opaque objects (put_objects: LMCache's and SGLang's) ---------------------------------------
OBJ_NS = bytes(range(16))


def opaque(n, seed=0) -> list:
    rng = np.random.default_rng(seed)
    return [Chunk(rng.bytes(16), OBJ_NS, rng.integers(0, 256, 3000 + i, dtype=np.uint8), "opaque")
            for i in range(n)]


def test_put_objects_names_the_keys_it_holds_with_other_bytes_and_keeps_their_first(tmp_path, edges):
    """A key keeps its first bytes: a second store of it with other bytes writes nothing and its
    answer names the key (kept_other), so a write-behind edge that acknowledged those bytes lets
    its copy go (kdn/edge/stores.py); the same bytes again are named by no one."""
    async def go():
        node, _ = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        objs = opaque(3, seed=40)
        first = await node.put_objects(objs, token=ADMIN)
        assert (first["written"], first["kept_other"]) == (3, [])
        other = Chunk(objs[1].key, OBJ_NS, np.full(3001, 7, dtype=np.uint8), "opaque")
        again = await node.put_objects([objs[0], other], token=ADMIN)
        assert (again["received"], again["written"], again["kept_other"]) == (2, 0, [objs[1].key])
        got = await node.get_chunks([objs[1].key], token=ADMIN)
        assert got[0].kv.tobytes() == objs[1].kv.tobytes()                 # the first bytes
        assert (await node.stats(token=ADMIN))["counters"]["objects_kept_other"] == 1
        await node.pushes_settled(token=ADMIN)
    run(go())


def test_pull_objects_refuses_bad_keys_and_declines_a_stranger_or_without_a_data_plane(tmp_path, edges):
    """An edge's write-behind over its HTTP frames (kdn/origin/intake.py), with keys; an edge
    out of the ring (it may still hold a backlog), and every edge of an origin with no data
    plane (no http_host), are read over Ray: the origin says so ({"pulled": None}), storing
    nothing."""
    async def go():
        node, _ = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        assert await node.pull_objects("nobody-0", [bytes(16)], token=ADMIN) == {"pulled": None}
        with pytest.raises(BadRequest, match="edge name"):
            await node.pull_objects("../etc", [bytes(16)], token=ADMIN)
        with pytest.raises(BadRequest, match="keys must be a list"):
            await node.pull_objects("us-east-0", "not-keys", token=ADMIN)
        with pytest.raises(BadRequest, match="a key"):
            await node.pull_objects("us-east-0", [b"short"], token=ADMIN)
        with pytest.raises(BadRequest, match="named twice"):
            await node.pull_objects("us-east-0", [bytes(16), bytes(16)], token=ADMIN)
        with pytest.raises(BadRequest, match="one 64-bit checksum"):
            await node.pull_objects("us-east-0", [bytes(16)], [1, 2], token=ADMIN)
        with pytest.raises(BadRequest, match="one 64-bit checksum"):
            await node.pull_objects("us-east-0", [bytes(16)], ["x"], token=ADMIN)
        assert await node.pull_objects("us-east-0", [bytes(16)], token=ADMIN) == {"pulled": None}
        assert (await node.stats(token=ADMIN))["counters"].get("objects_received", 0) == 0
    run(go())


def test_a_pulled_object_stands_only_with_the_checksum_the_edge_acknowledged():
    """The edge's server answers with the copy it holds, which may not be the one it queued
    (another copy of the key in its main tier): only a frame of the acknowledged bytes is
    stored; other bytes, or no checksum to compare, go over Ray (kdn/origin/intake.py)."""
    from kdn.core.chunk import Encoded
    from kdn.origin.intake import _as_acknowledged
    objs = opaque(3, seed=41)
    got = _as_acknowledged([objs[0], objs[1], None], [objs[0].digest(), objs[0].digest(), 5])
    assert got[0] is objs[0] and got[1] is None and got[2] is None
    assert _as_acknowledged([objs[0]], [None]) == [None]
    zipped = Encoded.of(objs[2], "zstd")                    # kept compressed at the edge: decoded
    # a lossless round trip of stored bytes, nothing computed: equal on any CPU
    assert _as_acknowledged([zipped], [objs[2].digest()])[0].kv.tobytes() == objs[2].kv.tobytes()


def test_a_delete_drops_at_every_edge_a_key_the_origin_never_got_and_leaves_a_kbs_chunk_alone(tmp_path, edges):
    """A host's store withdrawn from its edge's backlog before its delete (kdn/edge/stores.py,
    withdraw) never reached the origin, yet a reader in its region may have pulled a copy from
    that edge: the origin's delete drops the keys it does not hold at every edge too, and logs
    them, while a KB's chunk named in the same delete stays stored and held."""
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        m = kb()
        await publish(node, m)
        await node.pushes_settled(token=ADMIN)
        never = opaque(1)[0]
        for e in fake.edges.values():               # pulled from the edge that acknowledged it
            e.held[never.key] = never
        head = node.store.drops.head
        out = await node.delete_objects([never.key, m.keys[0]], OBJ_NS, token=ADMIN)
        assert out["deleted"] == 0 and sum(out["dropped"].values()) == len(fake.edges)
        assert not any(never.key in e.held for e in fake.edges.values())
        assert node.store.drops.since(head)[0] == [never.key], "logged: an edge away replays it"
        assert (await node.get_chunks([m.keys[0]], token=ADMIN))[0] is not None   # a KB's chunk: not ours
    run(go())


def test_objects_survive_an_origin_restart_and_its_collect(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        objs = opaque(5)
        assert (await node.put_objects(objs, token=ADMIN))["written"] == 5
        m = kb()
        await publish(node, m)
        await node.delete_version(m.ns, m.name, 1, token=ADMIN)          # its chunks: garbage
        restarted = OriginNode("t", str(tmp_path), TOPO.to_dict(), auth={"admin": ADMIN},
                               actors=fake)                               # nothing in memory
        gone = await restarted.collect(token=ADMIN)
        assert (gone["chunks"], gone["objects_kept"]) == (len(set(m.keys)), 5)
        got = await restarted.get_chunks([o.key for o in objs], token=ADMIN)
        assert [g.kv.tobytes() for g in got] == [o.kv.tobytes() for o in objs]
        await node.pushes_settled(token=ADMIN)
        out = await restarted.delete_objects([o.key for o in objs[:2]] + [m.keys[0]], OBJ_NS,
                                             token=ADMIN)
        assert out["deleted"] == 2 and sum(out["dropped"].values()) > 0   # edges dropped copies
        assert not any(o.key in e.held for o in objs[:2] for e in fake.edges.values())
        left = await restarted.get_chunks([o.key for o in objs[:3]], token=ADMIN)
        assert left[:2] == [None, None] and left[2].kv.tobytes() == objs[2].kv.tobytes()
        with pytest.raises(BadRequest, match="object_ttl_s"):
            await restarted.collect(object_ttl_s=-5, token=ADMIN)
    run(go())


def test_put_objects_answers_before_its_push_and_reads_fall_back_to_the_origin(tmp_path, edges,
                                                                                monkeypatch):
    monkeypatch.setattr("kdn.origin.node.PUSH_QUIET_S", 0)       # pushed at once: the edges hold it back

    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        release, call = asyncio.Event(), fake.call

        async def slow(edge, method, *args, **kw):           # every edge slow to take a push
            if method == "put_chunks":
                await release.wait()
            return await call(edge, method, *args, **kw)
        fake.call = slow
        objs = opaque(6)
        got = await asyncio.wait_for(node.put_objects(objs, token=ADMIN), 5)   # not held by edges
        assert (got["written"], got["pushing"]) == (6, 6)
        assert not any(e.held for e in fake.edges.values())
        served = await node.get_chunks([o.key for o in objs], token=ADMIN)     # the fallback
        assert [c.kv.tobytes() for c in served] == [o.kv.tobytes() for o in objs]
        release.set()
        assert (await node.pushes_settled(token=ADMIN))["objects_pushed"] == 6
        owners = node.roster.ring.owners_batch([o.key for o in objs], 2)
        for o, os_ in zip(objs, owners):
            assert all(fake.edges[e].held[o.key].kv.tobytes() == o.kv.tobytes() for e in os_)
        # bounded: beyond the backlog a push is skipped (counted), the store still answers
        monkeypatch.setattr("kdn.origin.node.OBJECT_PUSH_QUEUE_BYTES", 4096)
        assert (await node.put_objects(opaque(2, seed=1), token=ADMIN))["pushing"] == 0
        # a push failing of a bug is counted and logged, never hidden, never the caller's error

        def broken(*a, **kw):
            raise TypeError("put_chunks() got an unexpected keyword argument")
        monkeypatch.setattr("kdn.origin.node.OBJECT_PUSH_QUEUE_BYTES", 1 << 30)
        for e in fake.edges.values():
            e.put_chunks = broken
        assert (await node.put_objects(opaque(1, seed=2), token=ADMIN))["written"] == 1
        st = await node.pushes_settled(token=ADMIN)
        assert (st["object_pushes_skipped"], st["object_push_errors"]) == (2, 1)
    run(go())


def test_object_pushes_wait_for_a_quiet_intake_and_go_at_once_when_someone_waits_for_them(
        tmp_path, edges, monkeypatch):
    """A burst of stores is taken in first: their pushes start once no store came for
    PUSH_QUIET_S, in the order they were queued; pushes_settled and delete_objects start the
    waiting ones at once."""
    monkeypatch.setattr("kdn.origin.node.PUSH_QUIET_S", 1.0)

    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)

        def held():
            return sum(len(e.held) for e in fake.edges.values())
        burst = [opaque(2, seed=10 + i) for i in range(3)]
        for objs in burst:                   # each well within the quiet time of the one before
            await node.put_objects(objs, token=ADMIN)
            await asyncio.sleep(0.1)
        during, quiet_from = held(), time.monotonic()
        owners = node.roster.ring.owners_batch([c.key for objs in burst for c in objs], 2)
        while held() < sum(len(o) for o in owners) and time.monotonic() - quiet_from < 10:
            await asyncio.sleep(0.02)
        landed_after = time.monotonic() - quiet_from
        after_quiet = held()
        await node.put_objects(opaque(2, seed=20), token=ADMIN)
        t0 = time.monotonic()
        st = await node.pushes_settled(token=ADMIN)
        settled_in = time.monotonic() - t0
        late = opaque(1, seed=21)                # queued, then deleted: the delete starts its push
        await node.put_objects(late, token=ADMIN)
        t0 = time.monotonic()
        gone = await node.delete_objects([late[0].key], OBJ_NS, token=ADMIN)
        deleted_in = time.monotonic() - t0
        return (during, after_quiet, owners, landed_after, settled_in, st, deleted_in, gone,
                node.counters, [e.held.get(late[0].key) for e in fake.edges.values()])
    (during, after_quiet, owners, landed_after, settled_in, st, deleted_in, gone, counters,
     late_held) = run(go())
    assert during == 0, "no push while the stores come"
    assert after_quiet == sum(len(o) for o in owners) > 0 and landed_after >= 0.6, landed_after
    assert settled_in < 0.9 and deleted_in < 0.9, "a caller waiting for the pushes does not wait out the quiet"
    assert st["objects_pushed"] == 8 and counters["object_pushes_deferred"] == 3    # the last two hurried
    assert counters["object_push_defer_us"] >= 3 * 0.9e6
    assert gone["deleted"] == 1 and late_held == [None] * len(late_held), "its push landed before the drop"


def test_an_edge_that_answers_wrongly_fails_the_call(tmp_path, edges):
    """Only failover errors are absorbed: a bug on the other side surfaces."""
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)

        def broken(keys, ns=None):
            raise TypeError("have() got an unexpected keyword argument")

        fake.edges["eu-west-0"].have = broken
        with pytest.raises(TypeError, match="unexpected keyword"):
            await publish(node, kb())
    run(go())


# --- operator controls ---------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    ({"replicas": True}, "replicas must be an int in \\[1, 3\\]"),
    ({"replicas": 4}, "replicas must be an int in \\[1, 3\\] \\(the network has 3 edge"),
    ({"replicas": 10**12}, "replicas must be an int"),
    ({"replicas": 2.0}, "replicas must be an int"),
    ({"ttl_s": math.nan}, r"ttl_s \(seconds\) must be a number in \(0, 315360000\]"),
    ({"ttl_s": math.inf}, r"ttl_s \(seconds\) must be a number in \(0, 315360000\]"),
    ({"ttl_s": 1e12}, r"ttl_s \(seconds\) must be a number in \(0, 315360000\]"),
    ({"ttl_s": False}, r"ttl_s \(seconds\) must be a number in \(0, 315360000\]"),
    ({"ttl_s": 0}, r"ttl_s \(seconds\) must be a number in \(0, 315360000\]"),
    ({"pin_regions": "eu-west"}, "pin_regions must be a list of region names"),
    ({"pin_regions": [None]}, "pin_regions must be a list of region names"),
    ({"pin_regions": ["mars"]}, "cannot pin to unknown region\\(s\\) \\['mars'\\]"),
    ({"prefetch": "yes"}, "prefetch must be True or False"),
])
def test_set_override_refuses_bad_values_and_changes_nothing(tmp_path, edges, kw, message):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        await publish(node, kb())
        with pytest.raises(BadRequest, match=message):
            await node.set_override("acme", "handbook", token=ADMIN, **kw)
        assert node.roster.overrides == {}
    run(go())


def test_set_override_names_the_kb(tmp_path, edges):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        with pytest.raises(ManifestError, match="no committed knowledge base acme/nothing"):
            await node.set_override("acme", "nothing", replicas=1, token=ADMIN)
        with pytest.raises(BadRequest, match="tenant must match"):
            await node.set_override(None, "handbook", replicas=1, token=ADMIN)
    run(go())


def test_an_override_on_a_full_disk_changes_nothing(tmp_path, edges, monkeypatch):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        await publish(node, kb())
        saved = (tmp_path / "membership.msgpack").read_bytes()

        def no_space(fd):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", no_space)
        with pytest.raises(StoreError, match="cannot save the membership .* No space left on device"):
            await node.set_override("acme", "handbook", replicas=3, token=ADMIN)
        monkeypatch.undo()
        assert node.roster.overrides == {}
        assert (tmp_path / "membership.msgpack").read_bytes() == saved
        assert not list(tmp_path.glob("*.kdntmp"))
        assert (await node.set_override("acme", "handbook", replicas=3, token=ADMIN))["override"] == {"replicas": 3}
    run(go())


def test_pin_and_replicas_push_at_once(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        m = kb()
        await publish(node, m)
        out = await node.set_override("acme", "handbook", pin_regions=["ap-south"], token=ADMIN)
        assert out["placement"]["ap-south-0"] == len(m.keys)
        assert set(fake.edges["ap-south-0"].held) == set(m.keys) == fake.edges["ap-south-0"].pinned
        out = await node.set_override("acme", "handbook", replicas=3, token=ADMIN)
        assert all(set(e.held) == set(m.keys) for e in fake.edges.values())
        assert out["override"] == {"pin_regions": ["ap-south"], "replicas": 3}
    run(go())


def test_a_ttl_applies_at_once_to_chunks_edges_already_hold(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        v1 = kb()
        await publish(node, v1)
        v2 = kb(tokens=range(0, 1100))
        await publish(node, v2)
        out = await node.set_override("acme", "handbook", ttl_s=60, token=ADMIN)
        for name, e in fake.edges.items():
            assert set(e.ttl) == set(e.held) and set(e.ttl.values()) == {60.0}
            assert out["ttl_set"][name] == len(e.held)
        assert fake.count("set_ttl") == {n: 1 for n in EDGES}
    run(go())


def test_warm_copies_a_kb_into_a_region(tmp_path, edges):
    async def go():
        node, fake = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        m = kb()
        await publish(node, m)
        before = len(fake.edges["eu-west-0"].held)
        out = await node.warm("acme", "handbook", "eu-west", token=ADMIN)
        assert out == {"kb": "handbook", "version": 1, "region": "eu-west",
                       "sent": {"eu-west-0": len(m.keys) - before}}
        assert set(fake.edges["eu-west-0"].held) == set(m.keys)
        with pytest.raises(BadRequest, match="region 'mars' is not one of"):
            await node.warm("acme", "handbook", "mars", token=ADMIN)
        with pytest.raises(ManifestError, match="no committed knowledge base acme/handbook version 9"):
            await node.warm("acme", "handbook", "eu-west", version=9, token=ADMIN)
    run(go())


def test_one_corrupt_manifest_leaves_other_tenants_served(tmp_path, edges):
    async def go():
        node, _ = make_origin(tmp_path, edges)
        await node.set_members(MEMBERS, token=ADMIN)
        bad, good = kb(tenant="acme"), kb(tenant="zeta")
        await publish(node, bad)
        await publish(node, good)
        (path,) = (tmp_path / "store" / "manifests" / bad.ns.hex()).glob("*/*.kdnm")
        path.write_bytes(path.read_bytes()[:100])
        listed = await node.manifests(token=ADMIN)
        assert [(d["tenant"], d["name"], d["version"]) for d in listed] == [("zeta", "handbook", 1)]
        assert (await node.warm("zeta", "handbook", "eu-west", token=ADMIN))["version"] == 1
        assert (await node.set_override("zeta", "handbook", replicas=1, token=ADMIN))["override"] == {"replicas": 1}
        st = await node.stats(token=ADMIN)
        assert st["store"]["manifests_quarantined"] == 1
        assert st["quarantined_manifests"] == [f"{bad.ns.hex()}/handbook/0000000001.corrupt"]
        assert (await publish(node, bad))["version"] == 2    # re-publishing restores the KB
    run(go())


# --- as a Ray actor --------------------------------------------------------------------------
def stand_in_edge_class():
    """A Ray actor answering what the origin calls on an edge, recording tokens and chunks.
    Defined in a function so Ray ships it by value to its workers."""
    import ray

    @ray.remote(num_cpus=0)
    class StandInEdge:
        def __init__(self):
            self.held, self.version, self.tokens = set(), 0, set()

        def _saw(self, token):
            self.tokens.add(token)

        async def ping(self, token=None, drops=None, conversation_policies=None):
            return {"role": "edge"}

        async def membership(self, token=None):
            self._saw(token)
            return {"version": self.version}

        async def set_membership(self, m, token=None):
            self._saw(token)
            self.version = max(self.version, m["version"])
            return self.version

        async def add_manifest(self, m, token=None):
            self._saw(token)

        async def have(self, keys, ns=None, token=None):
            self._saw(token)
            return [k in self.held for k in keys]

        async def put_chunks(self, chunks, role="main", pin=False, ttl_s=None, token=None,
                             drops=None):
            self._saw(token)
            self.held.update(c.key for c in chunks if c is not None)
            return len(chunks)

        async def report(self):
            return {"held": self.held, "version": self.version, "tokens": self.tokens}

    return StandInEdge


def test_the_origin_over_ray(ray_cluster, tmp_path, network_name):
    import time

    import ray

    from kdn.core.names import NAMESPACE, edge_actor_name, origin_name
    from kdn.core.rpc import Actors

    opts = dict(namespace=NAMESPACE, max_concurrency=1000, num_cpus=0)
    origin = ray.remote(OriginNode).options(name=origin_name(network_name), **opts).remote(
        network=network_name, root=str(tmp_path), topology=TOPO.to_dict(), auth={"admin": ADMIN})
    cls = stand_in_edge_class()
    stand_ins = {n: cls.options(name=edge_actor_name(network_name, n), namespace=NAMESPACE).remote()
                 for n in EDGES}
    actors = Actors(network_name, token=ADMIN)
    try:
        # Every method takes token=: membership too (an edge's refresh once died on it silently).
        assert actors.origin(60, "sync").membership()["version"] == 0
        assert ray.get(origin.membership.remote(token="anything"), timeout=30)["version"] == 0
        assert ray.get(origin.stats.remote(token=None), timeout=30)["role"] == "origin"
        with pytest.raises(BadRequest, match="region 'mars'"):     # arrives as itself, not a RayTaskError
            actors.origin(30, "sync").set_members([("x", "mars", 1.0)])
        assert actors.origin(30, "sync").set_members(MEMBERS)["version"] == 1
        with pytest.raises(AccessDenied):
            Actors(network_name).origin(30, "sync").set_members(MEMBERS)

        m = kb()
        cs = chunks_of(m)
        assert actors.origin(30, "sync").stored(list(m.keys)) == [None] * 16
        assert actors.origin(30, "sync").put_chunks(cs) == \
            {"received": 16, "written": 16, "sums": [c.digest() for c in cs]}
        receipt = actors.origin(30, "sync").commit(m.to_dict())
        assert receipt["version"] == 1 and sum(receipt["pushed"].values()) == 32
        reports = {n: ray.get(h.report.remote(), timeout=30) for n, h in stand_ins.items()}
        owners = dict(zip(m.keys, Ring([Edge(*x) for x in MEMBERS]).owners_batch(list(m.keys), 2)))
        for n, r in reports.items():
            assert r["held"] == {k for k, o in owners.items() if n in o}
            assert r["version"] == 1 and r["tokens"] == {ADMIN}

        ray.kill(stand_ins.pop("eu-west-0"), no_restart=True)      # an edge dies
        m2 = kb(name="faq")
        actors.origin(30, "sync").put_chunks(chunks_of(m2))
        receipt = actors.origin(60, "sync").commit(m2.to_dict())
        assert receipt["version"] == 1 and receipt["pushed"]["eu-west-0"] == 0
        deadline = time.time() + 30             # marked down, then the ring without it saved
        while not ((st := ray.get(origin.stats.remote(token=ADMIN), timeout=10))["membership_version"] == 2
                   and "eu-west-0" in st["down"]):
            assert time.time() < deadline, f"the origin must take a dead edge out of the ring: {st}"
            time.sleep(0.5)
        assert st["counters"]["edge_call_failures"] >= 2 and st["counters"]["edges_marked_down"] == 1
        assert st["membership_version"] == 2 and st["members"] == 2
    finally:
        for h in [origin, *stand_ins.values()]:
            ray.kill(h, no_restart=True)


def test_the_health_watch_outlives_a_refusal_and_reports_a_bug(tmp_path, edges):
    from kdn.core.errors import StoreError
    from kdn.origin.health import PERIOD_S
    raised = iter([StoreError("disk full"), TypeError("a bug")])

    async def go():
        node, _ = make_origin(tmp_path, edges)

        async def round_():
            raise next(raised)
        node._health_round = round_
        node._start_background()
        await asyncio.sleep(2.5 * PERIOD_S)
        return await node.stats(token=ADMIN)
    st = run(go())
    assert st["counters"]["health_errors"] == 1
    assert st["watch_failure"] == "TypeError: a bug"


def test_an_origin_over_a_bucket_keeps_everything_there_and_restarts_from_it(bucket, edges):
    """Nothing of the origin outside its bucket: a new origin over the same s3:// URL (as on
    another node) finds every version, chunk, the membership and the overrides; a corrupt
    membership object there is quarantined like a file."""
    async def go():
        fake = edges(EDGES, token=ADMIN)
        node = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                          store_codec="zstd", store_env=bucket.env)
        await node.set_members(MEMBERS[:2], token=ADMIN)
        await node.set_members(MEMBERS, token=ADMIN)
        v1 = await publish(node, kb())
        v2 = await publish(node, kb(name="faq", tokens=range(5000, 5300)))
        await node.set_override("acme", "handbook", replicas=3, ttl_s=60, token=ADMIN)
        assert node.root == bucket.url
        restarted = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                               store_codec="zstd", store_env=bucket.env)
        assert restarted.roster.version == 2 and restarted.roster.members == MEMBERS
        assert restarted.roster.overrides == {"acme/handbook": {"replicas": 3, "ttl_s": 60.0}}
        ms = await restarted.manifests(token=ADMIN)
        assert sorted((m["name"], m["version"]) for m in ms) == [("faq", 1), ("handbook", 1)]
        assert (v1["version"], v2["version"]) == (1, 1)
        m = kb()
        got = await restarted.get_chunks(list(m.keys), token=ADMIN)
        assert all(g.decode().equal(c) for g, c in zip(got, chunks_of(m)))
        assert await absent(restarted, m.keys) == []
        st = await restarted.stats(token=ADMIN)
        assert st["store"]["backend"] == bucket.url + "/store" and st["store"]["versions"] == 2
        restarted.objects.put("membership.msgpack", b"torn")
        third = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                           store_env=bucket.env)
        assert third.roster.recovering and third.roster.quarantined == bucket.url + "/membership.msgpack.corrupt"
        assert third.objects.get("membership.msgpack.corrupt") == b"torn"
    run(go())


def test_an_origin_over_a_refusing_bucket_fails_the_publish_clearly(bucket, edges):
    import socket

    from kdn.origin.objects import S3Objects
    async def go():
        fake = edges(EDGES, token=ADMIN)
        node = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                          store_env=bucket.env)
        await node.set_members(MEMBERS, token=ADMIN)
        await publish(node, kb())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        node.store.objects = S3Objects("kdn-origin", bucket.url.split("/", 3)[3] + "/store",
                                       {**bucket.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"},
                                       timeout_s=0.5, retries=0)
        m2 = kb(name="faq", tokens=range(5000, 5300))
        with pytest.raises(StoreError, match=f"bucket {bucket.url}/store: cannot read chunks/.*"
                                             f"127.0.0.1:{port}"):
            await publish(node, m2)
        with pytest.raises(StoreError, match=f"bucket {bucket.url}/store: cannot list manifests/"):
            await node.commit(m2.to_dict(), token=ADMIN)
        fresh = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                           store_env=bucket.env)
        assert [m["name"] for m in await fresh.manifests(token=ADMIN)] == ["handbook"]
    run(go())


def test_an_origin_restarting_while_its_bucket_is_away_waits_for_it(bucket, edges, monkeypatch):
    """Ray never restarts an actor whose constructor raised: an origin that starts while its
    bucket does not answer tries again, and opens with everything once the bucket is back."""
    import socket
    import threading

    from moto.server import ThreadedMotoServer

    import kdn.origin.node as node_mod
    fake = edges(EDGES, token=ADMIN)
    first = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                       store_env=bucket.env)
    run(first.set_members(MEMBERS, token=ADMIN))
    run(publish(first, kb()))
    with socket.socket() as s:               # where the bucket will answer again, in a moment
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    later = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)   # same moto state
    timer = threading.Timer(1.0, later.start)
    timer.start()
    monkeypatch.setattr(node_mod, "OPEN_WAITS_S", (0.5, 0.5, 1, 1, 2, 4))
    try:
        back = OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                          store_env={**bucket.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
        assert back.roster.members == MEMBERS and back.store.manifest(kb().ns, "handbook").version == 1
        monkeypatch.setattr(node_mod, "OPEN_WAITS_S", (0.2,))
        with pytest.raises(StoreError, match="nothing answers at the endpoint"):
            OriginNode("t", bucket.url, TOPO.to_dict(), auth={"admin": ADMIN}, actors=fake,
                       store_env={**bucket.env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    finally:
        timer.join()
        later.stop()
