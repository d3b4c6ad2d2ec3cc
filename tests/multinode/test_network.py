"""The network on a real 3-region Ray cluster on loopback: publish, fetch, faults, hot copies.

The tests that touch only their own KBs share one network, started once for the module (each
publishes its own KV, so its own keys; the republish test in a tenant of its own, as it lists
the tenant's KBs). Each test that kills an edge or the origin, changes the membership or counts hot
copies starts its own network (own actor names, own origin directory) on the session's
cluster, and stops it at the end. KV is synthetic but real: numpy arrays checked byte for byte.
"""
import os
import signal
import threading
import time
import uuid

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
FP = "synthetic-model"
FAST_HOT = {"replication": {"half_life_s": 5.0, "promote_rate": 0.2}}


def _start(root, name):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    return start_network(topo, root, network=name, edge_options=FAST_HOT)


@pytest.fixture
def net(ray_cluster, tmp_path, network_name):
    """A network of this test's own."""
    n = _start(tmp_path / "origin", network_name)
    yield n
    stop_network(n)


@pytest.fixture(scope="module")
def shared(ray_cluster, tmp_path_factory):
    """The module's network, for the tests that touch only their own KBs."""
    name = f"m{uuid.uuid4().hex[:8]}"
    n = _start(tmp_path_factory.mktemp(name) / "origin", name)
    yield n
    stop_network(n)


def _client(net, region="us-east", tenant="default"):
    return Client(network=net.name, region=region, tenant=tenant, fingerprint=FP)


def _kv_of(fetched):
    return np.concatenate(fetched.kv_parts(), axis=3)


def _pid(handle):
    return ray.get(handle.ping.remote(), timeout=30)["pid"]


@ray.remote(num_cpus=0)
def _worker_fetch(network, prompt, expected):
    """A worker in some region: its client takes the region from its Ray node's label."""
    cl = Client(network=network, fingerprint=FP)
    f = cl.fetch(prompt)
    got = np.concatenate(f.kv_parts(), axis=3)
    return {"region": cl.region, "edge": f.edge, "tokens": f.tokens, "sources": f.sources,
            "equal": bool(np.array_equal(got, expected))}


def test_publish_then_fetch_from_a_worker_in_every_region(shared, synth):
    net = shared
    toks, kv = synth.tokens(1000), synth.kv(1000)
    receipt = _client(net).publish("handbook", [("part1", toks[:600]), ("part2", toks[600:])], kv)
    assert receipt["version"] == 1 and receipt["chunks"] == 4 and receipt["tokens"] == 1000
    assert receipt["sent_chunks"] == 4
    # every chunk went to 2 owners (replicas=2), in 2 different regions
    assert sum(receipt["placement"].values()) == 8
    prompt = toks + synth.tokens(40, seed=7)       # knowledge + a question
    refs = [_worker_fetch.options(label_selector={"region": r}).remote(net.name, prompt, kv)
            for r in REGIONS]
    for r, got in zip(REGIONS, ray.get(refs, timeout=120)):
        assert got["region"] == r
        assert got["edge"] == f"{r}-0", "a worker must be served by the edge of its own region"
        assert got["tokens"] == 1000 and got["equal"]
        assert all(s == "local" or s.startswith("peer:") or s == "origin" for s in got["sources"])
        assert "local" in got["sources"]


def test_republishing_identical_chunks_transfers_nothing(shared, synth):
    net = shared
    cl = _client(net, tenant="republish")          # the tenant's KB list is this test's alone
    toks, kv = synth.tokens(700, seed=1), synth.kv(700, seed=1)
    first = cl.publish("kb", [("d", toks)], kv)
    again = cl.publish("kb", [("d", toks)], kv)
    assert again["sent_chunks"] == 0 and again["sent_bytes"] == 0
    assert again["unchanged"] and again["version"] == first["version"] == 1
    # a new version that appends a document sends only the chunks that changed
    toks2 = toks + synth.tokens(300, seed=2)
    kv2 = np.concatenate([kv, synth.kv(300, seed=2)], axis=3)
    v2 = cl.publish("kb", [("d", toks), ("e", toks2[700:])], kv2)
    assert v2["version"] == 2 and not v2["unchanged"]
    assert v2["sent_chunks"] == 2      # chunks 0,1 (full, unchanged) stay; 2 (was partial) and 3 are new
    assert [m.version for m in cl.manifests(refresh=True)] == [1, 2]
    f = cl.fetch(toks2 + [5, 6, 7], kb="kb")
    assert f.tokens == 1000 and np.array_equal(_kv_of(f), kv2)


def test_fetch_returns_longest_prefix_and_stops_at_first_unknown_chunk(shared, synth):
    net = shared
    cl = _client(net, "eu-west")
    toks, kv = synth.tokens(512, seed=3), synth.kv(512, seed=3)
    cl.publish("two-chunks", [("d", toks)], kv)
    other = toks[:256] + synth.tokens(400, seed=4)     # shares the first chunk only
    f = cl.fetch(other)
    assert f.tokens == 256 and len(f.chunks) == 1 and np.array_equal(_kv_of(f), kv[:, :, :, :256])
    assert cl.fetch(synth.tokens(300, seed=9)).tokens == 0
    assert cl.lookup(toks + [1, 2])["tokens"] == 512


def test_tenants_cannot_read_each_other(shared, synth):
    net = shared
    toks, kv = synth.tokens(300, seed=5), synth.kv(300, seed=5)
    _client(net, tenant="acme").publish("secret", [("d", toks)], kv)
    other = _client(net, tenant="globex")
    assert other.manifests(refresh=True) == []
    f = other.fetch(toks)
    assert f.tokens == 0 and f.chunks == []


def test_edge_killed_during_a_stream_of_fetches_loses_nothing(net, synth):
    toks, kv = synth.tokens(1100, seed=6), synth.kv(1100, seed=6)
    cl = _client(net, "us-east")
    cl.publish("kb", [("d", toks)], kv)
    results, errors, stop = [], [], threading.Event()

    def stream():
        reader = _client(net, "us-east")
        while not stop.is_set():
            try:
                f = reader.fetch(toks)
                results.append((f.edge, f.tokens == 1100 and np.array_equal(_kv_of(f), kv)))
            except Exception as e:  # noqa: BLE001 - counted: the test asserts there are none
                errors.append(repr(e))

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    os.kill(_pid(net.edge("us-east-0")), signal.SIGKILL)       # a crash, not a polite stop
    time.sleep(4.0)
    stop.set()
    t.join(60)
    assert errors == []
    assert len(results) > 10 and all(ok for _, ok in results)
    assert {e for e, _ in results} - {"us-east-0"}, "some fetches must have failed over"
    # the edge came back (Ray restarts it) empty, and refills by pull-through
    st = ray.get(net.edge("us-east-0").stats.remote(), timeout=60)
    f = _client(net, "us-east").fetch(toks)
    assert f.edge == "us-east-0" and np.array_equal(_kv_of(f), kv)
    assert st["uptime_s"] < 30


def test_origin_killed_edges_serve_and_a_restarted_origin_recovers(net, synth, tmp_path):
    cl = _client(net)
    kbs = {}
    for i, n in enumerate((300, 800)):
        toks, kv = synth.tokens(n, seed=10 + i), synth.kv(n, seed=10 + i)
        cl.publish(f"kb{i}", [("d", toks)], kv)
        kbs[f"kb{i}"] = (toks, kv)
    os.kill(_pid(net.origin), signal.SIGKILL)
    # while the origin is down (or restarting), edges serve what they hold: R=2 owners
    for r in REGIONS:
        reader = _client(net, r)
        for toks, kv in kbs.values():
            f = reader.fetch(toks)
            assert f.tokens == len(toks) and np.array_equal(_kv_of(f), kv)
            assert "origin" not in f.sources
    # Ray restarts the origin actor; it reopens its store from disk
    deadline = time.time() + 60
    while True:
        try:
            ms = _client(net).manifests(refresh=True)
            break
        except Exception:  # noqa: BLE001 - still restarting
            if time.time() > deadline:
                raise
            time.sleep(0.5)
    assert sorted((m.name, m.version) for m in ms) == [("kb0", 1), ("kb1", 1)]
    st = ray.get(net.origin.stats.remote(), timeout=30)
    assert st["store"]["versions"] == 2 and st["store"]["corrupt_detected"] == 0


def test_hot_copies_appear_in_the_region_that_reads_most(net, synth):
    toks, kv = synth.tokens(1024, seed=20), synth.kv(1024, seed=20)
    cl = _client(net, "ap-south")
    cl.publish("hot", [("d", toks)], kv)
    first = cl.fetch(toks)
    remote = [i for i, s in enumerate(first.sources) if s != "local"]
    assert remote, "with 3 edges and 2 replicas some chunks are owned outside ap-south"
    deadline = time.time() + 30
    while time.time() < deadline:
        f = cl.fetch(toks)
        assert np.array_equal(_kv_of(f), kv)
        if all(s == "local" for s in f.sources):
            break
        time.sleep(0.2)
    assert all(s == "local" for s in f.sources), f.sources
    st = ray.get(net.edge("ap-south-0").stats.remote())
    assert st["hot_copies"] >= len(remote) and st["counters"]["hot_promoted"] >= len(remote)
    # the other regions did not get copies they do not read
    for r in ("us-east", "eu-west"):
        assert ray.get(net.edge(f"{r}-0").stats.remote())["hot_copies"] == 0


def test_membership_changes_while_serving_fail_no_fetch(net, synth):
    toks, kv = synth.tokens(2000, seed=30), synth.kv(2000, seed=30)
    cl = _client(net, "eu-west")
    cl.publish("kb", [("d", toks)], kv)
    results, errors, stop = [], [], threading.Event()

    def stream():
        reader = _client(net, "eu-west")
        while not stop.is_set():
            try:
                f = reader.fetch(toks)
                results.append(f.tokens == 2000 and np.array_equal(_kv_of(f), kv))
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))

    t = threading.Thread(target=stream)
    t.start()
    try:
        added = cl.add_edge("eu-west-1", "eu-west", capacity_bytes=256 << 20)
        assert "eu-west-1" in [m[0] for m in added["members"]]
        st = ray.get(ray.get_actor(f"{net.name}:edge:eu-west-1", namespace="kdn").stats.remote())
        owned = sum("eu-west-1" in o for o in cl.ring.owners_batch(list(cl.manifest("kb").keys), 2))
        assert owned > 0 and st["counters"].get("received_main", 0) == owned
        removed = cl.remove_edge("us-east-0")
        assert "us-east-0" not in [m[0] for m in removed["members"]]
        time.sleep(1.0)
    finally:
        stop.set()
        t.join(60)
    assert errors == [] and len(results) > 5 and all(results)
    # after the move every chunk still has 2 owners that hold it
    keys = list(cl.manifest("kb").keys)
    for key, owners in zip(keys, cl.ring.owners_batch(keys, 2)):
        for o in owners:
            h = ray.get_actor(f"{net.name}:edge:{o}", namespace="kdn")
            assert ray.get(h.have.remote([key]))[0], f"owner {o} lacks a chunk after re-homing"


def test_operator_pin_replicas_warm_and_ttl(shared, synth):
    net = shared
    toks, kv = synth.tokens(900, seed=40), synth.kv(900, seed=40)
    cl = _client(net)
    cl.publish("ops", [("d", toks)], kv)
    keys = list(cl.manifest("ops").keys)

    def holders():
        return {r: sum(ray.get(net.edge(f"{r}-0").have.remote(keys))) for r in REGIONS}

    cl.set_replicas("ops", 3)
    assert holders() == {r: len(keys) for r in REGIONS}
    cl.pin("ops", ["ap-south"])
    st = ray.get(net.edge("ap-south-0").stats.remote())
    assert st["main"]["pinned_items"] == len(keys)
    with pytest.raises(Exception, match="unknown region"):
        cl.pin("ops", ["mars"])
    w = cl.warm("ops", "eu-west")
    assert w["region"] == "eu-west"
    # a TTL applies at once to chunks already on edges (pushed, pinned and warmed above) ...
    got = cl.set_ttl("ops", 1.0)
    assert sum(got["ttl_set"].values()) >= 3 * len(keys)
    time.sleep(3.0)
    assert holders() == {r: 0 for r in REGIONS}, "a TTL must reach chunks already on edges"
    toks2, kv2 = synth.tokens(300, seed=41), synth.kv(300, seed=41)
    cl.publish("ops", [("d", toks2)], kv2)       # a new version is pushed with the TTL
    k2 = list(cl.manifest("ops").keys)
    time.sleep(3.0)
    held = sum(sum(ray.get(net.edge(f"{r}-0").have.remote(k2))) for r in REGIONS)
    assert held == 0, "chunks past their TTL must leave the edges"
    f = cl.fetch(toks2)                           # ... and are still served, from the origin
    assert f.tokens == 300 and np.array_equal(_kv_of(f), kv2)
