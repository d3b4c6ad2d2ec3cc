"""The origin over an S3 bucket restarts on another node with nothing lost: its node is
killed, Ray starts it on the other node of its region over the same bucket, and every
committed version is intact and served (a real S3 server on loopback: moto, credentials
checked)."""
import time

import numpy as np
import psutil
import pytest
import ray

from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.errors import KDNError
from kdn.placement.topology import Topology
from kdn.client.publish import split_kv

FP = "synthetic-model"
ORIGIN_REGION = "kdn-ob"      # a region of its own, on two nodes the test adds and removes


@pytest.fixture(scope="module")
def s3():
    from kdn.testing.s3 import LocalS3
    server = LocalS3()
    yield server
    server.stop()


def _kv(f):
    return np.concatenate(f.kv_parts(), axis=3)


def _node_of(pid, nodes):
    """The Ray node whose raylet started the worker process pid."""
    ancestors = {p.pid for p in psutil.Process(pid).parents()}
    for node in nodes:
        if any(i.process is not None and i.process.pid in ancestors
               for infos in node.all_processes.values() for i in infos):
            return node
    raise AssertionError(f"no node of {ORIGIN_REGION} runs pid {pid}")


def test_the_origin_restarts_on_another_node_over_the_same_bucket(ray_cluster, s3, network_name, synth):
    nodes = [ray_cluster.add_node(ORIGIN_REGION) for _ in range(2)]
    regions = {r: (0.2, 10.0) for r in ("us-east", "eu-west", ORIGIN_REGION)}
    links = {("us-east", "eu-west"): (30.0, 1.0), ("us-east", ORIGIN_REGION): (30.0, 1.0),
             ("eu-west", ORIGIN_REGION): (30.0, 1.0)}
    topo = Topology(regions, links, [("us-east-0", "us-east", 256 << 20), ("eu-west-0", "eu-west", 256 << 20)],
                    ORIGIN_REGION)
    url = s3.url(network_name)
    net = start_network(topo, url, network=network_name, origin_options={"store_env": s3.env})
    try:
        cl = Client(network=net.name, region="us-east", fingerprint=FP)
        kbs = {}
        for name, n, seed in (("handbook", 1000, 70), ("faq", 600, 71)):
            toks, kv = synth.tokens(n, seed=seed), synth.kv(n, seed=seed)
            assert cl.publish(name, [("d", toks)], kv)["version"] == 1
            kbs[name] = (toks, kv)
        toks2, kv2 = synth.tokens(1300, seed=72), synth.kv(1300, seed=72)
        assert cl.publish("handbook", [("d", toks2)], kv2)["version"] == 2
        ray.get(net.origin.set_override.remote("default", "faq", replicas=1, token=cl.view.admin_token),
                timeout=30)
        before = {(m.name, m.version): m for m in cl.manifests(refresh=True)}
        assert sorted(before) == [("faq", 1), ("handbook", 1), ("handbook", 2)]

        first = ray.get(net.origin.ping.remote(), timeout=30)["pid"]
        victim = _node_of(first, nodes)
        ray_cluster.remove_node(victim)                   # the origin's machine is gone
        deadline = time.time() + 120
        while True:                                       # Ray restarts it on the other node
            try:
                pid = cl.view.origin(10).ping()["pid"]
                if pid != first:
                    break
            except KDNError:
                pass
            assert time.time() < deadline, "the origin must come back on the other node"
            time.sleep(1.0)
        assert _node_of(pid, [n for n in nodes if n is not victim]) is not victim

        st = cl.view.origin().stats()
        assert st["store"]["backend"] == url + "/store" and st["store"]["versions"] == 3
        assert st["overrides"] == {"default/faq": {"replicas": 1}}       # kept in the bucket
        assert [m[0] for m in cl.view.origin().membership()["members"]] == ["eu-west-0", "us-east-0"]
        after = {(m["name"], m["version"]): m for m in cl.view.origin().manifests()}
        assert sorted(after) == sorted(before)
        for (name, version), m in before.items():        # every version intact, served by the origin
            toks, kv = kbs[name] if (name, version) != ("handbook", 2) else (toks2, kv2)
            want = split_kv(m, kv)
            got = cl.view.origin().get_chunks(list(m.keys))
            assert all(g is not None and g.decode().equal(w) for g, w in zip(got, want))
        f = Client(network=net.name, region="eu-west", fingerprint=FP).fetch(toks2)
        assert f.tokens == 1300 and np.array_equal(_kv(f), kv2)
        toks3, kv3 = synth.tokens(700, seed=73), synth.kv(700, seed=73)
        assert cl.publish("handbook", [("d", toks3)], kv3)["version"] == 3   # numbering goes on
    finally:
        stop_network(net)
        for node in nodes:          # the survivor leaves gracefully: Ray marks it dead at once
            if node in ray_cluster.nodes.get(ORIGIN_REGION, []):
                ray_cluster.remove_node(node, graceful=True)
        for node in nodes:          # later tests must not be placed on a node about to be dead
            ray_cluster.await_dead(node)
