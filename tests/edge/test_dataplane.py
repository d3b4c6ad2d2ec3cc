"""Peer pulls over KDN's HTTP frames (kdn/edge/dataplane.py, POST /v1/peer): the bytes a peer
holds arrive verified and byte-equal, only with the admin token, never past a drop the asker
applied, and a corrupt frame costs only its key.

A network on the session's loopback cluster: one edge per region, each region a Ray node of
its own, so "auto" pulls between edges go over HTTP frames; with data_plane "ray" the same
reads go through Ray. The frame parser is also tested alone, on bodies built here.
"""
import time

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.client.http import EdgeHTTPClient, _PeerFrames
from kdn.core.chunk import Chunk, Encoded, encode
from kdn.core.errors import AccessDenied, BadRequest, RemoteError

ADMIN = "admin-token-dataplane-0123456789"
READ = "acme-read-token-dataplane-0123"
BETA = "beta-read-token-dataplane-01"
AUTH = {"admin": ADMIN, "readers": {"acme": READ}}
FP = "synthetic-dataplane"


def _stats(net):
    return {e: ray.get(h.stats.remote(), timeout=30) for e, h in net.edges.items()}


def _read_everywhere(net, toks, kv):
    """Each region's reader fetches the KB; its bytes must be the published ones."""
    sources = set()
    for region in ("us-east", "eu-west", "ap-south"):
        f = Client(network=net.name, region=region, tenant="acme", fingerprint=FP, token=READ).fetch(toks)
        assert f.tokens == len(toks)
        assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
        sources.update(f.sources)
    return sources


@pytest.fixture(scope="module")
def shared(small_network):
    """One network for the tests below that need no settings of their own (HTTP frames, one
    owner per key, corruption injectable): each publishes a KB of its own and reads the growth
    of the counters it checks, so they hold in any order."""
    return small_network(auth={"admin": ADMIN, "readers": {"acme": READ, "beta": BETA}}, http=True,
                         replicas=1, edge_options={"fault_injection": True})


def _counters(net, edge: str, part: str = "counters") -> dict:
    return ray.get(net.edges[edge].stats.remote(token=ADMIN), timeout=30)[part]


def _grew(before: dict, after: dict, name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


@pytest.mark.parametrize("plane,into", [("auto", "store"), ("auto", "process"), ("ray", "store")])
def test_peer_pulls_between_nodes_go_over_http_frames_and_bring_the_published_bytes(small_network, synth, plane, into):
    net = small_network(auth=AUTH, http=True, replicas=1,
                        edge_options={"data_plane": plane, "pull_into": into})
    toks, kv = synth.tokens(1500, seed=31), synth.kv(1500, seed=31)
    Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP,
           admin_token=ADMIN).publish("kb", [("d", toks)], kv)
    sources = _read_everywhere(net, toks, kv)
    assert any(s.startswith("peer:") for s in sources)       # some chunk crossed between edges
    planes = [s["data_plane"] for s in _stats(net).values()]
    http_chunks = sum(p.get("peer_http_chunks", 0) for p in planes)
    ray_pulls = sum(p.get("peer_ray_pulls", 0) for p in planes)
    if plane == "auto":         # every edge on a node of its own: every peer pull over HTTP
        assert http_chunks > 0 and ray_pulls == 0
        assert sum(p.get("peer_http_bytes", 0) for p in planes) > 0
    else:
        assert http_chunks == 0 and ray_pulls > 0


def test_a_fetchs_slices_are_joined_in_key_order_up_to_the_first_one_cut_short():
    from kdn.client.dataplane import join_replies
    from kdn.core.dataplane import slices
    assert slices(list("abcdefg"), 2) == [list("abcd"), list("efg")]
    assert slices(list("abc"), 2) == [list("abc")] and slices([], 2) == [[]]       # too few: one
    assert slices(list("abcd"), 8) == [list("a"), list("b"), list("c"), list("d")]

    def reply(names, more, ring=1, move_s=0.1):
        return {"chunks": names, "sources": ["edge"] * len(names), "codecs": ["raw"] * len(names),
                "wire": [10] * len(names), "exact": [True] * len(names), "more": more, "edge": "e",
                "ring": ring, "move_s": move_s}
    got = join_replies([reply(["a", "b"], False), reply(["c", "d"], False, ring=2, move_s=0.3)], [2, 2])
    assert got["chunks"] == ["a", "b", "c", "d"] and got["wire"] == [10] * 4 and not got["more"]
    assert got["ring"] == 2 and got["move_s"] == 0.3
    got = join_replies([reply(["a"], True), reply(["c", "d"], False, move_s=0.5)], [2, 2])   # the first cut short
    assert got["chunks"] == ["a"] and got["more"] and got["sources"] == ["edge"] and got["move_s"] == 0.1
    got = join_replies([reply(["a", "b"], False), reply(["c"], True), reply(["e"], False)], [2, 2, 1])
    assert got["chunks"] == ["a", "b", "c"] and got["more"]
    # a slice that stops at a key the edge lacks ends the prefix there, "more" or not
    got = join_replies([reply(["a"], False), reply(["c", "d"], False)], [2, 2])
    assert got["chunks"] == ["a"] and not got["more"] and got["wire"] == [10]
    got = join_replies([reply([], False), reply(["c", "d"], False)], [2, 2])
    assert got["chunks"] == [] and got["sources"] == [] and not got["more"]


def test_the_origins_pushes_to_edges_on_other_nodes_are_pulled_over_its_http_frames(small_network, synth):
    """The origin (us-east's node) serves its stored frames over HTTP: the edges on the other
    nodes take its pushes by pulling them from there, the one on its own node over Ray, and
    every copy is the published bytes. Its server answers the admin only, refuses a bad body,
    and an edge that does not reach it says so (the origin then sends the bytes over Ray).
    An edge answers a push before copying it into its node's store, then copies every chunk
    (kdn/edge/arrivals.py), whichever way it came; each pulled stream is received into a
    buffer used before or new."""
    net = small_network(auth=AUTH, http=True, replicas=3)          # every edge holds every chunk
    toks, kv = synth.tokens(1500, seed=35), synth.kv(1500, seed=35, layers=4)   # chunks >= INLINE_BYTES
    pub = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, admin_token=ADMIN)
    pub.publish("kb", [("d", toks)], kv)
    keys = pub.manifest("kb").keys
    ray.get(net.origin.pushes_settled.remote(token=ADMIN), timeout=120)
    origin = ray.get(net.origin.stats.remote(token=ADMIN), timeout=30)
    url = origin["http"]["url"]
    assert url.startswith("http://127.0.0.1:")
    planes = {e: s["data_plane"] for e, s in _stats(net).items()}
    assert {e: p.get("origin_http_chunks", 0) for e, p in planes.items()} == {
        "us-east-0": 0, "eu-west-0": len(keys), "ap-south-0": len(keys)}
    assert origin["counters"]["push_http_chunks"] == 2 * len(keys)
    assert origin["counters"]["push_ray_chunks"] == len(keys)        # us-east-0, on the origin's node
    assert origin["counters"]["push_http_bytes"] == 2 * origin["counters"]["push_ray_bytes"] > kv.nbytes
    assert origin["counters"]["chunks_pushed"] == 3 * len(keys)
    for path in ("http", "ray"):          # the two edges' pulls overlap: the path was busy for less
        c = origin["counters"]            # than their own times added up, and for some of it
        assert 0 < c[f"push_{path}_busy_us"] <= c[f"push_{path}_us"], c
    for e in ("eu-west-0", "ap-south-0"):
        assert planes[e]["origin_http_buffers_reused"] + planes[e]["origin_http_buffers_new"] == \
            planes[e]["origin_http_streams"] > 0, planes[e]
    for e in planes:                      # pulled over HTTP, or given over Ray (us-east-0)
        deadline = time.monotonic() + 30
        while _counters(net, e).get("pushes_adopted", 0) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        c = _counters(net, e)
        assert c.get("pushes_adopted", 0) == len(keys) and not c.get("pushes_adopt_errors"), c
    sources = _read_everywhere(net, toks, kv)             # the bytes, from each region's own edge
    assert not any(s.startswith("peer:") for s in sources), sources
    with pytest.raises(AccessDenied, match="401"):
        EdgeHTTPClient(url, allow_remote=True).peer_get(keys)
    with pytest.raises(AccessDenied, match="403"):
        EdgeHTTPClient(url, token=READ).peer_get(keys)
    with EdgeHTTPClient(url, token=ADMIN) as c:
        objs, nbytes = c.peer_get(list(keys[:2]) + [b"\x00" * 16])      # one key the origin lacks
        assert [o is not None for o in objs] == [True, True, False]
        assert np.array_equal(np.concatenate([o.kv for o in objs[:2]], axis=3), kv[:, :, :, :2 * 256])
        with pytest.raises(BadRequest, match="named twice"):
            c.peer_get([keys[0], keys[0]])
    edge = net.edges["eu-west-0"]
    assert ray.get(edge.pull_chunks.remote(url, keys, token=ADMIN, origin_ip="192.0.2.1"),
                   timeout=30) == {"pulled": None, "kept": 0}      # a loopback URL of another host
    with pytest.raises(ray.exceptions.RayTaskError, match="pull_chunks needs the network's admin token"):
        ray.get(edge.pull_chunks.remote(url, keys), timeout=30)
    with pytest.raises(ray.exceptions.RayTaskError, match="url must be the origin's"):
        ray.get(edge.pull_chunks.remote("file:///etc/passwd", keys, token=ADMIN), timeout=30)


def test_the_peer_endpoint_answers_only_the_admin_and_never_past_a_drop_the_asker_applied(shared, synth):
    net = shared
    toks, kv = synth.tokens(1024, seed=32), synth.kv(1024, seed=32)
    pub = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, admin_token=ADMIN)
    pub.publish("kb-peer", [("d", toks)], kv)
    keys = pub.manifest("kb-peer").keys
    url = ray.get(net.edges["eu-west-0"].ping.remote(), timeout=30)["http"]
    held = ray.get(net.edges["eu-west-0"].have.remote(keys, token=ADMIN), timeout=30)
    assert any(held) and not all(held)           # replicas=1: eu-west-0 owns some keys only

    with pytest.raises(AccessDenied, match="401"):
        EdgeHTTPClient(url).peer_get(keys)
    with pytest.raises(AccessDenied, match="403"):
        EdgeHTTPClient(url, token=READ).peer_get(keys)     # a tenant's token is not the admin's
    with EdgeHTTPClient(url, token=ADMIN) as c:
        with pytest.raises(BadRequest, match="repeats key"):
            c.peer_get([keys[0], keys[0]])
        with pytest.raises(BadRequest, match="drops must be"):
            c.peer_get(keys, drops={"log": 7})
        objs, nbytes = c.peer_get(keys)
        assert [o is not None for o in objs] == held
        for i, o in enumerate(objs):
            if o is not None:
                assert isinstance(o, Chunk) and o.key == keys[i] and o.ns == pub.ns
                assert np.array_equal(o.kv, kv[:, :, :, 256 * i:256 * (i + 1)])
        assert nbytes >= sum(o.nbytes for o in objs if o is not None)
        # an asker that applied a drop log this edge never saw: nothing, not old bytes
        objs, nbytes = c.peer_get(keys, drops={"log": "another-log", "head": 3})
        assert objs == [None] * len(keys) and nbytes == 0
        # answers with no frame at all (keys it lacks) leave the connection ready for the next
        lacking = [k for k, h in zip(keys, held) if not h]
        for _ in range(2):
            assert c.peer_get(lacking) == ([None] * len(lacking), 0)
        objs, _ = c.peer_get(keys)
        assert [o is not None for o in objs] == held and c.counters["reconnects"] == 0


def test_an_owner_leaves_a_corrupt_copy_out_of_its_answer_and_the_reader_gets_the_published_bytes(shared, synth):
    """A copy that fails its checks never leaves its edge: the owner's peer answer leaves it
    out and the owner drops it; the puller takes that chunk from the origin and sends the
    owner the origin's copy (read repair)."""
    net = shared
    toks, kv = synth.tokens(1024, seed=34), synth.kv(1024, seed=34)
    pub = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, admin_token=ADMIN)
    pub.publish("kb-owner", [("d", toks)], kv)
    keys = pub.manifest("kb-owner").keys
    owner = next(e for e in ("eu-west-0", "ap-south-0")
                 if any(ray.get(net.edges[e].have.remote(keys, token=ADMIN), timeout=30)))
    k = keys[ray.get(net.edges[owner].have.remote(keys, token=ADMIN), timeout=30).index(True)]
    before = _counters(net, owner)
    assert ray.get(net.edges[owner].inject_corruption.remote(k, token=ADMIN), timeout=30)
    f = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, token=READ).fetch(toks)
    assert f.tokens == 1024 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    assert "origin" in f.sources
    st = ray.get(net.edges[owner].stats.remote(token=ADMIN), timeout=30)
    # the owner's copy now is the origin's (read repair, after the reply): the published bytes
    i = keys.index(k)
    with EdgeHTTPClient(st["http"], token=ADMIN) as c:
        deadline = time.monotonic() + 10
        while (got := c.peer_get([k])[0][0]) is None and time.monotonic() < deadline:
            time.sleep(0.1)
    assert got is not None and np.array_equal(got.kv, kv[:, :, :, 256 * i:256 * (i + 1)])
    assert _grew(before, st["counters"], "peer_corrupt_skipped") == 1
    assert _grew(before, st["counters"], "corrupt_detected") >= 1


def _frame_body(chunks, codecs):
    return b"".join(encode(c, codec) for c, codec in zip(chunks, codecs))


def test_a_corrupt_frame_costs_only_its_key_and_a_frame_out_of_order_is_refused(synth):
    kv = synth.kv(768, seed=33)
    keys = [bytes([i]) * 16 for i in range(4)]
    chunks = [Chunk(k, b"n" * 16, np.ascontiguousarray(kv[:, :, :, 256 * i:256 * (i + 1)]), "float32")
              for i, k in enumerate(keys[:3])]
    body = bytearray(_frame_body(chunks, ["raw", "zstd", "raw"]))
    body[len(encode(chunks[0])) - 5] ^= 0xFF             # the first frame's payload, corrupted
    kept = []
    frames = _PeerFrames("http://x:1", memoryview(bytes(body)), keys, keep=lambda o: kept.append(o) or o)
    frames.take(len(body))
    objs, corrupt = frames.done()
    assert corrupt == 1 and objs[0] is None and objs[3] is None      # key 3: the edge lacked it
    assert isinstance(objs[1], Encoded) and objs[1].codec == "zstd"   # kept as sent, verified
    assert np.array_equal(objs[1].decode().kv, chunks[1].kv)
    assert np.array_equal(objs[2].kv, chunks[2].kv) and kept == [objs[1], objs[2]]

    backwards = _frame_body([chunks[1], chunks[0]], ["raw", "raw"])
    with pytest.raises(RemoteError, match="out of order"):
        _PeerFrames("http://x:1", memoryview(backwards), keys).take(len(backwards))
    stranger = _frame_body([Chunk(b"z" * 16, b"n" * 16, chunks[0].kv, "float32")], ["raw"])
    with pytest.raises(RemoteError, match="not asked for"):
        _PeerFrames("http://x:1", memoryview(stranger), keys).take(len(stranger))


def test_an_edge_on_loopback_is_read_over_http_only_from_its_own_host():
    """kdn.core.dataplane.Addresses: which URL a process reads an edge's frames from, by mode."""
    from kdn.core.dataplane import Addresses
    here = Addresses("auto", node_id="n1", node_ip="10.1.0.1")
    here.note("beside", {"url": "http://127.0.0.1:9001", "node": "n1", "ip": "10.1.0.1"})
    here.note("same-host", {"url": "http://127.0.0.1:9002", "node": "n2", "ip": "10.1.0.1"})
    here.note("other-host-loopback", {"url": "http://127.0.0.1:9003", "node": "n3", "ip": "10.1.0.3"})
    here.note("other-host", {"url": "http://10.1.0.4:9004", "node": "n4", "ip": "10.1.0.4"})
    here.note("no-http", {"url": None, "node": "n5", "ip": "10.1.0.5"})
    assert [here.url(e) for e in ("beside", "same-host", "other-host-loopback", "other-host", "no-http")] == \
        [None, "http://127.0.0.1:9002", None, "http://10.1.0.4:9004", None]
    assert here.with_http() == ["beside", "other-host", "same-host"]
    assert not here.stale("other-host") and here.stale("never-asked") and not here.stale("no-http")
    here.forget("other-host")
    assert here.stale("other-host") and here.url("other-host") is None
    always = Addresses("http", node_id="n1", node_ip="10.1.0.1")
    always.note("beside", {"url": "http://127.0.0.1:9001", "node": "n1", "ip": "10.1.0.1"})
    assert always.url("beside") == "http://127.0.0.1:9001"
    never = Addresses("ray", node_id="n1", node_ip="10.1.0.1")
    never.note("other-host", {"url": "http://10.1.0.4:9004", "node": "n4", "ip": "10.1.0.4"})
    assert never.url("other-host") is None


def test_a_bad_data_plane_is_refused_by_name():
    from kdn.core.errors import TopologyError
    from kdn.core.dataplane import check_data_plane
    from kdn.edge.options import check_edge_options
    with pytest.raises(BadRequest, match="data_plane must be one of auto, http, ray"):
        check_data_plane("tcp")
    with pytest.raises(TopologyError, match="edge e: data_plane: must be one of"):
        check_edge_options({"data_plane": "udp"}, "edge e")
    with pytest.raises(TopologyError, match="peer_streams"):
        check_edge_options({"peer_streams": 0}, "edge e")
    with pytest.raises(TopologyError, match="edge e: http_host: must be"):
        check_edge_options({"http_host": "my-host"}, "edge e")
    assert check_edge_options({"http_host": "node"}, "e") == {"http_host": "node"}
    assert check_edge_options({"http_host": "10.0.0.7"}, "e") == {"http_host": "10.0.0.7"}
    with pytest.raises(TopologyError, match="edge e: pull_into: must be one of process, store"):
        check_edge_options({"pull_into": "disk"}, "edge e")
    assert check_edge_options({"pull_into": "process", "data_plane": "http", "peer_streams": 4}, "e") == \
        {"pull_into": "process", "data_plane": "http", "peer_streams": 4}
    from kdn.core.errors import BadConfig
    from kdn.integrations.lmcache import KDNL2AdapterConfig
    with pytest.raises(BadConfig, match="field 'data_plane' must be one of auto, http, ray"):
        KDNL2AdapterConfig.from_dict({"data_plane": "tcp"})
    assert KDNL2AdapterConfig.from_dict({"data_plane": "ray"}).data_plane == "ray"
    assert KDNL2AdapterConfig.from_dict({}).data_plane == "auto"


def test_a_copy_received_over_http_goes_into_the_nodes_store_only_when_kept(ray_cluster, kit):
    """A pulled copy lives in the edge's process (a Ray reader gets it in the reply); the copy
    the edge keeps is put into its node's object store, born where the pulled one was."""
    import asyncio
    from kdn.core.rpc import resolve_refs
    from kdn.edge.tiers import Held
    a, = kit.make_chunks(1)
    edge = kit.local_edge()
    got = Held.here(a)
    got.born, got.src = 3, "far-0"          # as kdn/edge/dataplane.py receives it
    assert got.ref is None
    kept = asyncio.run(edge.pull.own_copy(got))
    assert isinstance(kept.ref, ray.ObjectRef) and kept.born == 3 and kept.own
    assert np.array_equal(ray.get(kept.ref).kv, a.kv)
    # a reply's list mixes references and objects carried in it: each resolves to its chunk
    objs = resolve_refs([kept.ref, a], timeout=30)
    assert [o.key for o in objs] == [a.key, a.key] and np.array_equal(objs[0].kv, objs[1].kv)


def test_a_peer_on_loopback_is_pulled_over_http_only_from_its_own_host():
    """A peer's URL on 127.0.0.1 names this host's loopback everywhere else: a peer on another
    host that bound it is pulled over Ray, never over a connection to whatever listens here."""
    import asyncio
    import types
    from kdn.edge.dataplane import PeerPulls

    def peers(answer):
        async def data_address():
            return answer
        return types.SimpleNamespace(edge=lambda name: types.SimpleNamespace(data_address=data_address))

    here = {"url": "http://127.0.0.1:8001", "node": "n2", "ip": "10.0.0.1"}
    elsewhere = dict(here, ip="10.0.0.2")
    bound = {"url": "http://10.0.0.2:8001", "node": "n2", "ip": "10.0.0.2"}
    mine = dict(bound, node="n1")
    got = {name: asyncio.run(PeerPulls(peers(a), "n1", "auto", "10.0.0.1")._url("p"))
           for name, a in (("here", here), ("elsewhere", elsewhere), ("bound", bound), ("mine", mine))}
    assert got == {"here": "http://127.0.0.1:8001", "elsewhere": None,
                   "bound": "http://10.0.0.2:8001", "mine": None}    # mine: same node, Ray
    assert asyncio.run(PeerPulls(peers(mine), "n1", "http", "10.0.0.1")._url("p")) == "http://10.0.0.2:8001"
    assert asyncio.run(PeerPulls(peers(bound), "n1", "ray", "10.0.0.1")._url("p")) is None


def test_a_reader_on_another_node_fetches_over_the_edges_http_frames(shared, synth):
    """This process runs on us-east's node: reading eu-west's edge (another node) goes over that
    edge's HTTP frames (kdn.client.dataplane), reading us-east's own edge and data_plane "ray"
    over Ray; the bytes are the published ones every way. LMCache's objects (no manifest: the
    reader names their tenant) go the same way, and a token not the tenant's is refused."""
    from kdn.client.view import NetworkView
    from kdn.integrations.objects import Objects
    net = shared
    toks, kv = synth.tokens(1024, seed=37), synth.kv(1024, seed=37)
    Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP,
           admin_token=ADMIN).publish("kb-reader", [("d", toks)], kv)
    planes = {}
    for region, plane in (("eu-west", "auto"), ("eu-west", "ray"), ("us-east", "auto")):
        c = Client(network=net.name, region=region, tenant="acme", fingerprint=FP, token=READ,
                   data_plane=plane)
        f = c.fetch(toks)
        assert f.tokens == 1024 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
        assert f.edge == f"{region}-0"
        planes[region, plane] = c.stats()["data_plane"]
    over_http = planes["eu-west", "auto"]
    assert over_http["http_fetches"] >= 1 and over_http["http_bytes"] >= kv.nbytes
    # its 4 chunks came over 2 connections side by side (kdn/client/dataplane.py), joined in order
    assert over_http["http_fetches"] == over_http["http_split_fetches"] == 1, over_http
    assert over_http["http_streams"] == 2, over_http
    one = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=FP, token=READ)
    one.view.plane.streams = 1
    f = one.fetch(toks)
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)     # the published bytes, moved
    assert one.stats()["data_plane"]["http_fetches"] == one.stats()["data_plane"]["http_streams"] == 1
    assert one.stats()["data_plane"]["http_split_fetches"] == 0
    assert over_http["http_edges"] == ["eu-west-0"]
    assert planes["eu-west", "ray"].get("http_fetches", 0) == 0       # asked for Ray
    assert planes["us-east", "auto"].get("http_fetches", 0) == 0      # the edge beside it: Ray

    view = NetworkView(net.name, region="eu-west", admin_token=ADMIN)
    writer = Objects(view, "lmcache", ADMIN, ack="origin")
    ns = writer.namespace("acme", "m")
    datas = [np.random.default_rng(i).integers(0, 255, 3 << 20, dtype=np.uint8) for i in range(3)]
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    assert writer.store([(ns, k) for k in keys], datas) > 0
    reader = Objects(NetworkView(net.name, region="eu-west"), "lmcache", read_tokens={"acme": READ})
    assert reader.namespace("acme", "m") == ns
    outs = [np.zeros(3 << 20, np.uint8) for _ in keys]
    assert reader.load(ns, keys, outs) == [True] * 3
    assert all(np.array_equal(o, d) for o, d in zip(outs, datas))
    assert reader.stats()["data_plane"]["http_fetches"] >= 1
    other = Objects(NetworkView(net.name, region="eu-west"), "lmcache",
                    read_tokens={"acme": BETA})
    other.namespace("acme", "m")
    with pytest.raises(AccessDenied):
        other.load(ns, keys, [np.zeros(3 << 20, np.uint8) for _ in keys])


def test_a_copy_gone_bad_after_its_check_costs_one_refetch_and_its_holder_drops_it(shared, synth):
    """An edge frames a copy with the checksum it found on arrival (Held.xxh). If the copy went
    bad since, the receiver finds the mismatch: a reader over HTTP frames reports it and gets
    the key elsewhere, as over Ray; an edge pulling it over HTTP tells the owner. Either way
    the holder rereads its copy and drops it, and the bytes read are the published ones."""
    net = shared
    toks, kv = synth.tokens(2048, seed=36), synth.kv(2048, seed=36)
    pub = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, admin_token=ADMIN)
    pub.publish("kb-gone-bad", [("d", toks)], kv)
    keys = pub.manifest("kb-gone-bad").keys
    have = {e: ray.get(net.edges[e].have.remote(keys, token=ADMIN), timeout=30) for e in ("eu-west-0", "ap-south-0")}
    name = max(have, key=lambda e: sum(have[e]))           # replicas=1: it owns some keys only
    other = next(e for e in have if e != name)
    held = have[name]
    assert sum(held) >= 2
    k, k2 = [key for key, h in zip(keys, held) if h][:2]
    before, pulled = _counters(net, name), _counters(net, other, "data_plane")
    assert ray.get(net.edges[name].inject_corruption.remote(k, stale_checksum=True, token=ADMIN), timeout=30)
    # a reader on another node reads the owner over its HTTP frames
    c = Client(network=net.name, region=name[:-2], tenant="acme", fingerprint=FP, token=READ)
    f = c.fetch(toks)
    assert f.tokens == 2048 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    st = c.stats()
    assert st["counters"]["corrupt_chunks"] == 1 and st["data_plane"]["http_fetches"] >= 2
    owner = _counters(net, name)
    assert _grew(before, owner, "corrupt_reported") == 1 and _grew(before, owner, "corrupt_detected") >= 1
    # the same with an edge pulling: the other region's edge asks the owner, over HTTP
    assert ray.get(net.edges[name].inject_corruption.remote(k2, stale_checksum=True, token=ADMIN), timeout=30)
    f = Client(network=net.name, region=other[:-2], tenant="acme", fingerprint=FP, token=READ).fetch(toks)
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    assert _grew(pulled, _counters(net, other, "data_plane"), "peer_http_corrupt") == 1
    assert _grew(before, _counters(net, name), "corrupt_reported") == 2
