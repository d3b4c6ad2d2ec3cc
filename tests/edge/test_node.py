"""The edge actor's RPC surface on a real network: membership refresh, bounded fetches,
drop_corrupt and set_ttl with their token rules, the admin's read of a new namespace, and
an HTTP port kept across a restart.

A two-region network with an admin token and read tokens for two tenants (acme, beta), fault
injection on, and an edge refresh period of one second.
"""
import os
import socket
import time
import uuid

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.launch.cluster import start_edge, start_network, stop_network
from kdn.core.errors import AccessDenied, BadRequest
from kdn.client.http import EdgeHTTPClient
from kdn.core.keys import namespace_digest
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west")
FP = "synthetic-node"
ADMIN = "node-admin-token-0123456789abcdef"
ACME, BETA = "acme-read-token-0123456789", "beta-read-token-0123456789"
AUTH = {"admin": ADMIN, "readers": {"acme": ACME, "beta": BETA}}
REFRESH_S = 1.0
N_TOKENS = 1024                   # 4 chunks of 256 tokens: 32 KiB of KV each
CHUNK_BYTES = 2 * 2 * 2 * 256 * 8 * 4


def _call(handle, method, *args, **kw):
    """handle.method(*args, **kw), a KDNError raised remotely as itself."""
    try:
        return ray.get(getattr(handle, method).remote(*args, **kw), timeout=60)
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None


def _start(name, tmp, **edge_options):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=64 << 20)
    opts = {"fault_injection": True, "membership_refresh_s": REFRESH_S, **edge_options}
    return start_network(topo, tmp, network=name, auth=AUTH, edge_options=opts)


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    n = _start(f"node{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("origin"),
               max_reply_bytes=int(2.5 * CHUNK_BYTES), object_store_fill_bytes=64 << 20)
    kbs = {}
    for seed, (tenant, token) in enumerate((("acme", ACME), ("beta", BETA))):
        toks, kv = _tokens(N_TOKENS, seed), _kv(N_TOKENS, seed)
        cl = Client(network=n.name, region="us-east", tenant=tenant, fingerprint=FP, token=token,
                    admin_token=ADMIN)
        cl.publish("kb", [("d", toks)], kv)
        kbs[tenant] = {"toks": toks, "kv": kv, "keys": list(cl.manifest("kb").keys), "ns": cl.ns,
                       "client": cl}
    n.kbs = kbs
    yield n
    stop_network(n)


def _tokens(n, seed):
    return np.random.default_rng(seed + 1000).integers(0, 49152, n).tolist()


def _kv(n, seed):
    return np.random.default_rng(seed).standard_normal((2, 2, 2, n, 8)).astype(np.float32)


def _holder(net, key):
    return next(e for e in net.edges if _call(net.edge(e), "have", [key], token=ADMIN)[0])


# --- membership ---------------------------------------------------------------------------
def test_an_edge_that_missed_a_broadcast_converges_within_its_refresh_period(ray_cluster, tmp_path):
    """Issue 12 item 1: the refresh called the origin's membership() with token= and the
    origin's did not take it; a broad except hid the TypeError, so it never ran."""
    n = _start(f"mem{uuid.uuid4().hex[:8]}", tmp_path / "origin")
    try:
        # eu-west-0 leaves the ring: the origin broadcasts the new membership to the members
        # only, so eu-west-0 misses it and must learn it by asking
        left = _call(n.origin, "remove_edge", "eu-west-0", token=ADMIN)
        edge = n.edge("eu-west-0")
        t0 = time.monotonic()
        while _call(edge, "membership")["version"] != left["version"]:
            assert time.monotonic() - t0 < REFRESH_S + 5, "the edge never refreshed its membership"
            time.sleep(0.2)
        got = _call(edge, "membership")
        assert [m[0] for m in got["members"]] == ["us-east-0"]
        counters = _call(edge, "stats")["counters"]
        assert counters["membership_refreshed"] >= 1 and counters.get("background_errors", 0) == 0
    finally:
        stop_network(n)


# --- bounded fetches ------------------------------------------------------------------------
def test_a_fetch_is_answered_in_bounded_replies_that_say_more(net):
    kb = net.kbs["acme"]
    edge, keys, got = net.edge("us-east-0"), kb["keys"], []
    while True:
        reply = _call(edge, "fetch", keys[len(got):], kb["ns"], token=ACME)
        assert len(reply["refs"]) <= 2 and sum(reply["wire"]) <= 2.5 * CHUNK_BYTES
        got += ray.get(reply["refs"])
        if not reply["more"]:
            break
    assert [c.key for c in got] == keys
    assert np.array_equal(np.concatenate([c.kv for c in got], axis=3), kb["kv"])
    f = kb["client"].fetch(kb["toks"])                # the client follows "more" itself
    assert f.tokens == N_TOKENS and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kb["kv"])


def test_a_repeated_key_is_refused_on_the_ray_path(net):
    kb = net.kbs["acme"]
    with pytest.raises(BadRequest, match=r"keys\[1\] repeats key"):
        _call(net.edge("us-east-0"), "fetch", [kb["keys"][0]] * 128, kb["ns"], token=ACME)
    with pytest.raises(BadRequest, match="16385 keys in one request; the limit is 16384"):
        _call(net.edge("us-east-0"), "lookup", [kb["keys"][0]] * 16385, kb["ns"], token=ACME)


# --- read auth --------------------------------------------------------------------------------
def test_the_admin_reads_a_namespace_nothing_is_published_under_yet(net):
    """Issue 13.1: a publisher's reuse fetch of a brand-new KB gets an empty prefix."""
    new_ns = namespace_digest("gamma", FP)
    keys = [bytes([i]) * 16 for i in range(3)]
    for edge in net.edges.values():
        reply = _call(edge, "fetch", keys, new_ns, token=ADMIN)
        assert reply["refs"] == [] and reply["sources"] == [] and reply["more"] is False
        assert _call(edge, "lookup", keys, new_ns, token=ADMIN)["chunks"] == 0
    with pytest.raises(AccessDenied, match="read token"):
        _call(net.edge("us-east-0"), "fetch", keys, new_ns, token=ACME)
    cl = Client(network=net.name, region="eu-west", tenant="gamma", fingerprint=FP, admin_token=ADMIN)
    toks, kv = _tokens(300, 9), _kv(300, 9)
    assert cl.publish("new", [("d", toks)], kv)["version"] == 1


# --- drop_corrupt -----------------------------------------------------------------------------
def test_drop_corrupt_needs_the_namespace_reader_and_drops_only_what_really_fails(net):
    acme, beta = net.kbs["acme"], net.kbs["beta"]
    key = acme["keys"][1]
    name = _holder(net, key)
    edge = net.edge(name)
    assert _call(edge, "inject_corruption", key, token=ADMIN) is True
    with pytest.raises(AccessDenied, match="read token"):
        _call(edge, "drop_corrupt", [key], acme["ns"], token="wrong-token-0123456789")
    with pytest.raises(AccessDenied, match="read token"):
        _call(edge, "drop_corrupt", [key], acme["ns"], token=BETA)
    # beta may name its own namespace, but acme's copy is not under it: nothing is touched
    assert _call(edge, "drop_corrupt", [key], beta["ns"], token=BETA) == 0
    assert _call(edge, "have", [key], token=ADMIN) == [True]
    # an honest report of an intact copy drops nothing; of the corrupt one, drops it
    assert _call(edge, "drop_corrupt", [acme["keys"][0]], acme["ns"], token=ACME) == 0
    assert _call(edge, "drop_corrupt", [key], acme["ns"], token=ACME) == 1
    assert _call(edge, "have", [key], token=ADMIN) == [False]
    f = acme["client"].fetch(acme["toks"])
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), acme["kv"])


# --- set_ttl ------------------------------------------------------------------------------------
def test_set_ttl_applies_at_once_to_chunks_already_on_the_edge(net):
    beta = net.kbs["beta"]
    name = _holder(net, beta["keys"][0])
    edge = net.edge(name)
    held = _call(edge, "have", beta["keys"], token=ADMIN)
    with pytest.raises(AccessDenied, match="admin token"):
        _call(edge, "set_ttl", beta["keys"], 0.5, token=BETA)
    for bad in (0, -1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(BadRequest, match=r"ttl_s \(seconds\) must be a number in \(0, 315360000\]"):
            _call(edge, "set_ttl", beta["keys"], bad, token=ADMIN)
    assert _call(edge, "set_ttl", beta["keys"], 0.5, token=ADMIN) == sum(held)
    time.sleep(2.0)                                   # past the TTL and a background tick
    assert _call(edge, "have", beta["keys"], token=ADMIN) == [False] * len(beta["keys"])
    assert _call(edge, "stats")["counters"]["ttl_expired"] >= sum(held)


# --- HTTP port across a restart ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_restarted_edge_serves_http_on_the_same_port(net):
    topo = Topology.from_dict(net.topology.to_dict())
    extra = topo.add_edge("us-east-9", "us-east", 16 << 20)
    port = _free_port()
    h = start_edge(net.name, extra, topo, http_port=port, auth=AUTH)
    first = _call(h, "ping")
    url = first["http"]
    assert url == f"http://127.0.0.1:{port}" and EdgeHTTPClient(url).health()["pid"] == first["pid"]
    ray.kill(h, no_restart=False)
    t0 = time.monotonic()
    while True:          # the origin's health check pings a restarted edge; so does this test
        assert time.monotonic() - t0 < 60, "the edge did not come back"
        try:
            again = _call(h, "ping")
            if again["pid"] != first["pid"]:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.5)
    assert again["http"] == url
    health = EdgeHTTPClient(url).health()
    assert health["ok"] and health["edge"] == "us-east-9" and health["pid"] == again["pid"]


# --- the object store filled ahead (kdn.core.prefault) --------------------------------------------
def _store_held(n_bytes: int) -> int:
    """Of the first n_bytes of this node's object store (this process maps it as the edges
    do), how many hold memory."""
    import ctypes
    import ctypes.util
    from kdn.core.prefault import store_regions
    with open("/proc/self/maps") as f:
        start, end = max(store_regions(f.read()), key=lambda r: r[1] - r[0])
    page = os.sysconf("SC_PAGE_SIZE")
    n = min(n_bytes, end - start) // page
    vec = np.zeros(n, np.uint8)
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, n * page, vec.ctypes.data) == 0
    return int((vec & 1).sum()) * page


def test_an_edge_fills_its_nodes_object_store_as_told_and_is_told_not_to(net):
    """An edge given object_store_fill_bytes (here its capacity, the default where the node's
    environment says nothing: tests/edge/test_options.py) has that much of its node's store
    allocated; one given nothing, on a node whose environment says 0, starts no fill."""
    edge = net.edge("us-east-0")                 # on the head node: this process's node
    deadline = time.monotonic() + 60
    while (fill := _call(edge, "stats", token=ADMIN)["object_store_fill"])["running"]:
        assert time.monotonic() < deadline, fill
        time.sleep(0.2)
    assert fill["fill_bytes"] == 64 << 20 and not fill["fill_errors"]
    why = fill["fill_stopped_why"]               # a machine short of memory, a store on a disk
    assert why is None or why.startswith(("this machine's available", "the object store is not in memory"))
    if why is None:
        # the node's first 64 MiB hold memory: filled by the edge, or allocated already by
        # objects before it (so this also holds where the edge filled none of it)
        assert _store_held(64 << 20) == 64 << 20
        assert fill["filled_bytes"] <= 64 << 20 and fill["passes"] >= 1
    topo = Topology.from_dict(net.topology.to_dict())
    extra = topo.add_edge("us-east-8", "us-east", 16 << 20)
    # no setting: the node's environment's (tests/conftest.py: KDN_OBJECT_STORE_FILL_BYTES=0)
    h = start_edge(net.name, extra, topo, auth=AUTH)
    assert _call(h, "stats", token=ADMIN)["object_store_fill"] is None
    ray.kill(h, no_restart=True)


# --- the RPC surface (no Ray) -------------------------------------------------------------------
def test_every_rpc_method_takes_a_token_and_no_private_flag():
    """kdn.core.rpc passes token= on every call; a method without it once failed silently."""
    import inspect
    from kdn.edge.node import EdgeNode
    methods = {n: f for n, f in inspect.getmembers(EdgeNode, inspect.isfunction) if not n.startswith("_")}
    assert {"fetch", "lookup", "peer_get", "drop_corrupt", "set_ttl", "membership", "stats",
            "ping"} <= set(methods)
    for name, f in methods.items():
        params = inspect.signature(f).parameters
        assert "token" in params and params["token"].default is None, name
        # (Ray adds _ray_trace_ctx to an actor class's methods once it has made an actor of it)
        assert not [p for p in params if p.startswith("_") and p != "_ray_trace_ctx"], name


def test_operator_input_is_checked_before_anything_changes(kit):
    import asyncio
    a, = kit.make_chunks(1)
    edge = kit.local_edge([a])
    for call in (edge.pin_keys(None), edge.set_ttl(None, 5), edge.drop("not-a-list"),
                 edge.have([b"short"]), edge.put_chunks(None), edge.put_chunks([a], role="cold"),
                 edge.put_chunks([object()]), edge.set_ttl([a.key], float("nan"))):
        with pytest.raises(BadRequest):
            asyncio.run(call)
    assert edge.tiers.holds(a.key) and edge.tiers.expiry == {}


def test_the_background_loop_outlives_a_refusal_and_reports_a_bug(kit):
    """A refusal (KDNError) is counted and the loop goes on; a bug ends it loudly, in stats,
    instead of leaving an edge that silently never refreshes."""
    import asyncio
    from kdn.edge import node as edge_node
    from kdn.core.errors import NetworkError
    edge = kit.local_edge()
    raised = iter([NetworkError("origin refused"), TypeError("a bug")])

    def tick():
        raise next(raised)
    edge._tick = tick

    async def go():
        edge._start_background()
        await asyncio.sleep(2.5 * edge_node.POLICY_TICK_S)
        return await edge.stats()
    st = asyncio.run(go())
    assert st["counters"]["background_errors"] == 1
    assert st["background_failure"] == "TypeError: a bug"


def test_component_counters_never_share_a_name(kit):
    """all_counters() sums the components' counters into one: a name two components count
    would add up two different things (background_errors once did: the node's failed ticks
    plus the peers' failed read repairs)."""
    import asyncio
    import re
    from pathlib import Path
    from kdn.core.errors import NetworkError
    from kdn.edge import node as edge_node
    where = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "edge").glob("*.py")):
        for name in set(re.findall(r'counters\["([a-z_]+)"\]', path.read_text())):
            where.setdefault(name, []).append(path.name)
    assert {n: m for n, m in where.items() if len(m) > 1} == {}

    edge = kit.local_edge()

    def tick():
        raise NetworkError("origin refused")
    edge._tick = tick

    async def repair():
        raise NetworkError("repair refused")

    async def go():
        edge._start_background()
        edge.peers.later(repair(), "read repair")
        await asyncio.sleep(1.5 * edge_node.POLICY_TICK_S)      # one tick
        return edge.all_counters()
    counters = asyncio.run(go())
    assert (counters["background_errors"], counters["after_reply_errors"]) == (1, 1)
