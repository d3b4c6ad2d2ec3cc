"""Nothing wrong is ever served: corruption planted at each hop is caught, dropped and refetched.

Hops: an edge's own copy (object store), a peer's copy crossing to another edge, the origin's
disk. The manifest carries each chunk's checksum, so the reader verifies end to end.

The tests share one network (started once for the module): each publishes its own KV (its
own keys) and counts what it caused as the change of the edges' and the origin's counters.
"""
import uuid
from pathlib import Path

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.errors import AccessDenied
from kdn.core.keys import key_hex
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
FP = "synthetic-model"


@pytest.fixture(scope="module")
def origin_root(tmp_path_factory):
    return tmp_path_factory.mktemp("integrity") / "origin"


@pytest.fixture(scope="module")
def net(ray_cluster, origin_root):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    n = start_network(topo, origin_root, network=f"i{uuid.uuid4().hex[:8]}",
                      edge_options={"fault_injection": True})
    yield n
    stop_network(n)


def _counter(handle, name):
    return ray.get(handle.stats.remote())["counters"].get(name, 0)


def _kv(f):
    return np.concatenate(f.kv_parts(), axis=3)


def _publish(net, synth, n=1024, seed=0):
    cl = Client(network=net.name, region="us-east", fingerprint=FP)
    toks, kv = synth.tokens(n, seed=seed), synth.kv(n, seed=seed)
    cl.publish("kb", [("d", toks)], kv)
    return cl, toks, kv


def test_manifest_records_a_checksum_per_chunk(net, synth):
    cl, toks, kv = _publish(net, synth)
    m = cl.manifest("kb")
    assert len(m.sums) == len(m.keys) == 4
    assert all(c.digest() == s for c, s in zip(cl.fetch(toks).chunks, m.sums))


def test_a_corrupt_copy_on_the_local_edge_is_dropped_and_refetched(net, synth):
    cl, toks, kv = _publish(net, synth, seed=1)
    key = cl.manifest("kb").keys[0]
    holder = next(r for r in REGIONS if ray.get(net.edge(f"{r}-0").have.remote([key]))[0])
    edge = net.edge(f"{holder}-0")
    reported = _counter(edge, "corrupt_reported")
    assert ray.get(edge.inject_corruption.remote(key))
    reader = Client(network=net.name, region=holder, fingerprint=FP)
    f = reader.fetch(toks)
    assert f.tokens == 1024 and np.array_equal(_kv(f), kv), "a client must never receive wrong KV"
    assert reader.counters["corrupt_chunks"] == 1
    assert _counter(edge, "corrupt_reported") == reported + 1
    # the edge refilled a good copy (it owns the key) and serves it from then on
    f2 = reader.fetch(toks)
    assert np.array_equal(_kv(f2), kv) and reader.counters["corrupt_chunks"] == 1


def test_a_corrupt_peer_copy_is_caught_and_another_source_used(net, synth):
    cl, toks, kv = _publish(net, synth, seed=2)
    keys = list(cl.manifest("kb").keys)
    # find a region whose edge does not own key 0: it must get it from a peer
    owners = cl.ring.owners(keys[0], 2)
    reader_region = next(r for r in REGIONS if f"{r}-0" not in owners)
    before = sum(_counter(net.edge(o), "corrupt_reported") for o in owners)
    for o in owners:   # every owner's copy is corrupt: only the origin has good bytes
        assert ray.get(net.edge(o).inject_corruption.remote(keys[0]))
    reader = Client(network=net.name, region=reader_region, fingerprint=FP)
    f = reader.fetch(toks)
    assert f.tokens == 1024 and np.array_equal(_kv(f), kv)
    assert reader.counters["corrupt_chunks"] >= 1
    assert sum(_counter(net.edge(o), "corrupt_reported") for o in owners) >= before + 1


def test_a_corrupt_file_on_the_origin_disk_is_never_served(net, synth, origin_root):
    cl, toks, kv = _publish(net, synth, seed=3)
    keys = list(cl.manifest("kb").keys)
    detected = ray.get(net.origin.stats.remote())["store"]["corrupt_detected"]
    path = next(Path(origin_root).rglob(key_hex(keys[2]) + "*"))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    for r in REGIONS:                       # no edge holds chunk 2: only the origin could serve it
        ray.get(net.edge(f"{r}-0").drop.remote([keys[2]]))
    f = Client(network=net.name, region="eu-west", fingerprint=FP).fetch(toks)
    assert f.tokens == 512, "the prefix stops before the chunk nobody holds a good copy of"
    assert np.array_equal(_kv(f), kv[:, :, :, :512])
    st = ray.get(net.origin.stats.remote())
    assert st["store"]["corrupt_detected"] >= detected + 1


def test_fault_injection_is_off_unless_enabled(ray_cluster, tmp_path, network_name, synth):
    topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=64 << 20)
    n = start_network(topo, tmp_path / "o", network=network_name + "x")
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(n.edge("us-east-0").inject_corruption.remote(b"\0" * 16))
        assert isinstance(e.value.as_instanceof_cause(), AccessDenied)
    finally:
        stop_network(n)
