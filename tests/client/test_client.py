"""kdn/client/__init__.py and the modules it joins (kdn/client/view.py, kdn/client/reader.py, kdn/client/operator.py) on a
real network: reads from the nearest edge, failover to the next one, operator calls without a
model, and the RPC discipline — a refusal arrives as itself, a bug is never swallowed.

The scripted-edge cases of the reader (bounded replies, corrupt copies) are in test_reader.py;
publishing is in test_publish.py.
"""
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
import ray

from kdn.client import Client, connect
from kdn.launch.cluster import start_network, stop_network
from kdn.core.env import RAY_ENV
from kdn.core.errors import AccessDenied, BadRequest, ManifestError
from kdn.placement.topology import Topology

FP = "synthetic-model"
ADMIN = "admin-secret-0123456789abcdef"
ACME = "acme-read-token-0123456789"
REGIONS = ["us-east", "eu-west", "ap-south"]


def _kv(f):
    return np.concatenate(f.kv_parts(), axis=3)


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    topo = Topology.default_local(REGIONS, edges_per_region=1, capacity_bytes=128 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("client-origin"), network=f"c{uuid.uuid4().hex[:8]}",
                      auth={"admin": ADMIN, "readers": {"acme": ACME}})
    yield n
    stop_network(n)


@pytest.fixture(scope="module")
def published(net):
    rng = np.random.default_rng(21)
    toks = rng.integers(0, 49152, 700).tolist()
    kv = rng.standard_normal((2, 2, 2, 700, 8)).astype(np.float32)
    admin = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, admin_token=ADMIN)
    admin.publish("kb", [("d", toks)], kv)
    return toks, kv


def test_fetch_and_lookup_read_the_published_bytes_from_the_nearest_edge(net, published):
    toks, kv = published
    reader = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=FP, token=ACME)
    assert reader.ranked_edges()[0] == "eu-west-0"
    prompt = toks + [5, 6, 7]                        # the KB, then a question
    f = reader.fetch(prompt)
    assert (f.tokens, f.edge, f.failovers, f.kb.label()) == (700, "eu-west-0", [], "acme/kb@v1")
    assert np.array_equal(_kv(f), kv) and f.exact and f.nbytes == kv.nbytes
    assert sum(f.source_counts().values()) == 3
    assert reader.lookup(prompt) == {"chunks": 3, "tokens": 700, "keys": 3, "edge": "eu-west-0",
                                     "kb": "acme/kb@v1"}
    assert reader.stats()["counters"] == {"fetches": 1, "chunks": 3}
    with pytest.raises(ManifestError, match="no knowledge base 'other' for tenant 'acme'"):
        reader.fetch(prompt, kb="other")


def test_a_remote_refusal_arrives_as_itself_and_is_no_failover(net, published):
    toks, _ = published
    wrong = Client(network=net.name, region="ap-south", tenant="acme", fingerprint=FP, token="w" * 30)
    with pytest.raises(AccessDenied) as info:
        wrong.fetch(toks)
    assert type(info.value) is AccessDenied and "read token" in str(info.value)
    assert "Traceback" not in str(info.value) and "\x1b" not in str(info.value)
    assert wrong.ranked_edges()[0] == "ap-south-0", "a refusal does not make an edge suspect"


def test_a_bug_in_a_call_is_not_swallowed(net):
    cl = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, token=ACME)
    # A wrong signature (the membership-refresh bug of issue 12) raises, not "no edge answered".
    with pytest.raises(TypeError, match="no_such_argument"):
        cl.view.nearest().lookup([], cl.ns, token=ACME, no_such_argument=1)
    with pytest.raises(TypeError, match="no_such_argument"):
        cl.view.origin().membership(no_such_argument=1)
    assert cl.ranked_edges()[0] == "us-east-0", "a bug does not make an edge suspect"


def test_a_client_without_a_fingerprint_does_operator_calls_but_no_reads(net, published):
    toks, _ = published
    op = Client(network=net.name, region="us-east", tenant="acme", admin_token=ADMIN)
    st = op.status()
    assert st["origin"]["members"] == 3
    assert sorted(e["name"] for e in st["edges"] if not e.get("down")) == ["ap-south-0", "eu-west-0", "us-east-0"]
    for read in (lambda: op.fetch(toks), lambda: op.lookup(toks), lambda: op.manifests(),
                 lambda: op.publish("kb", [("d", toks)], None), lambda: op.ns):
        with pytest.raises(BadRequest, match="fingerprint=model.fingerprint"):
            read()
    with pytest.raises(BadRequest, match="fingerprint=model.fingerprint"):
        connect(network=net.name, tenant="acme", token=ACME).fetch(toks)
    for bad in (None, "ap-south", [1]):
        with pytest.raises(BadRequest, match="pin takes a list of region names"):
            op.pin("kb", bad)
    # an operator call reaches the origin and acts: every chunk of the KB is pinned in ap-south
    op.pin("kb", ["ap-south"])
    keys = list(Client(network=net.name, tenant="acme", fingerprint=FP, token=ACME).manifest("kb").keys)
    assert ray.get(net.edge("ap-south-0").have.remote(keys, token=ADMIN), timeout=30) == [True] * 3


def test_failover_to_the_next_edge_and_membership_from_edges(ray_cluster, tmp_path, network_name, synth):
    topo = Topology.default_local(REGIONS, edges_per_region=1, capacity_bytes=128 << 20)
    n = start_network(topo, tmp_path / "origin", network=network_name)
    try:
        toks, kv = synth.tokens(600, seed=22), synth.kv(600, seed=22)
        Client(network=n.name, region="us-east", fingerprint=FP).publish("kb", [("d", toks)], kv)
        reader = Client(network=n.name, region="eu-west", fingerprint=FP)
        assert reader.fetch(toks).edge == "eu-west-0"
        ray.kill(n.edge("eu-west-0"), no_restart=True)           # the nearest edge is gone
        f = reader.fetch(toks)
        assert f.failovers == ["eu-west-0"] and f.edge != "eu-west-0" and f.tokens == 600
        assert np.array_equal(_kv(f), kv)
        again = reader.fetch(toks)
        assert again.failovers == [], "a failed edge is tried last for a while, not first"
        ray.kill(n.origin, no_restart=True)                      # and now the origin
        reader.refresh()                                         # membership from the live edges
        assert sorted(e.name for e in reader.ring.edges) == ["ap-south-0", "eu-west-0", "us-east-0"]
        assert np.array_equal(_kv(reader.fetch(toks)), kv), "edges serve what they hold"
    finally:
        stop_network(n)


def test_importing_ray_before_kdn_still_connects(ray_cluster, net, published):
    toks, _ = published
    script = (
        "import ray\n"                            # first, as a user's program may
        "import kdn\n"
        "from kdn.client import connect\n"
        f"c = connect(network={net.name!r}, region='us-east',\n"   # address: $RAY_ADDRESS
        f"            tenant='acme', fingerprint={FP!r}, token={ACME!r})\n"
        f"print('tokens', c.fetch({toks!r}).tokens)\n")
    env = {k: v for k, v in os.environ.items() if k not in RAY_ENV}   # only what kdn itself sets
    env["RAY_ADDRESS"] = ray_cluster.address
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=180, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "tokens 700"
