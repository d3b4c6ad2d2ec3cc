"""Access control on the Ray path and the HTTP path alike: admin token for writes and operators,
per-tenant read tokens, constant-time checks; refused calls change nothing."""
import numpy as np
import pytest
import ray

from kdn.core.auth import Tokens, ensure_admin_token
from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.errors import AccessDenied, KDNError
from kdn.client.http import EdgeHTTPClient, HTTPEdges
from kdn.client.reader import Reader
from kdn.placement.topology import Topology

FP = "synthetic-model"
ADMIN = "admin-secret-0123456789abcdef"
ACME = "acme-read-token-0123456789"


@pytest.fixture
def net(ray_cluster, tmp_path, network_name):
    topo = Topology.default_local(["us-east", "eu-west"], edges_per_region=1, capacity_bytes=128 << 20)
    n = start_network(topo, tmp_path / "origin", network=network_name, http=True,
                      auth={"admin": ADMIN, "readers": {"acme": ACME, "open": "*"}})
    yield n
    stop_network(n)


def _cause(excinfo):
    e = excinfo.value
    return e.as_instanceof_cause() if isinstance(e, ray.exceptions.RayTaskError) else e


def test_publishing_and_operator_calls_need_the_admin_token(net, synth):
    toks, kv = synth.tokens(300, seed=1), synth.kv(300, seed=1)
    anon = Client(network=net.name, region="us-east", tenant="open", fingerprint=FP)
    with pytest.raises(AccessDenied, match="admin token"):
        anon.publish("kb", [("d", toks)], kv)
    wrong = Client(network=net.name, region="us-east", tenant="open", fingerprint=FP,
                   admin_token="x" * 30)
    with pytest.raises(AccessDenied):
        wrong.publish("kb", [("d", toks)], kv)
    assert ray.get(net.origin.stats.remote())["store"]["chunks"] == 0, "a refused publish stores nothing"
    admin = Client(network=net.name, region="us-east", tenant="open", fingerprint=FP, admin_token=ADMIN)
    assert admin.publish("kb", [("d", toks)], kv)["version"] == 1
    with pytest.raises(AccessDenied):
        anon.set_replicas("kb", 2)
    with pytest.raises(AccessDenied):
        anon.pin("kb", ["eu-west"])
    # a tenant the operator left open ("open=*") reads freely; one without a token is closed
    f = anon.fetch(toks)
    assert f.tokens == 300 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    Client(network=net.name, region="us-east", tenant="closed", fingerprint=FP,
           admin_token=ADMIN).publish("kb", [("d", toks)], kv)
    with pytest.raises(AccessDenied, match="read token"):
        Client(network=net.name, region="us-east", tenant="closed", fingerprint=FP).fetch(toks)
    # node-to-node calls are admin calls too: nobody pushes chunks into an edge directly
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(net.edge("us-east-0").put_chunks.remote([], role="main"))
    assert isinstance(_cause(e), AccessDenied)
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(net.edge("us-east-0").drop.remote(list(admin.manifest("kb").keys)))
    assert isinstance(_cause(e), AccessDenied)
    assert admin.fetch(toks).tokens == 300, "a refused drop dropped nothing"


def test_a_tenant_with_a_read_token_needs_it_on_ray_and_http(net, synth):
    toks, kv = synth.tokens(600, seed=2), synth.kv(600, seed=2)
    Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP,
           admin_token=ADMIN).publish("secret", [("d", toks)], kv)
    for token in (None, "not-the-token-0123456789"):
        reader = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=FP, token=token)
        with pytest.raises(AccessDenied, match="read token"):
            reader.manifests(refresh=True)
        with pytest.raises(AccessDenied):
            reader.fetch(toks)
    ok = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=FP, token=ACME)
    f = ok.fetch(toks)
    assert f.tokens == 600 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    url = ray.get(net.edge("eu-west-0").ping.remote())["http"]
    with pytest.raises(AccessDenied, match="401"):           # no token
        Reader(HTTPEdges([url]), "acme", FP).fetch(toks)
    with pytest.raises(AccessDenied, match="403"):           # a wrong one
        Reader(HTTPEdges([url], token="not-the-token-0123456789"), "acme", FP).fetch(toks)
    got = Reader(HTTPEdges([url], token=ACME), "acme", FP, token=ACME).fetch(toks)
    assert got.tokens == 600 and all(np.array_equal(a.kv, b.kv) for a, b in zip(got.chunks, f.chunks))
    with EdgeHTTPClient(url, token=ACME) as hc:
        assert hc.health()["ok"]


def test_token_rules():
    t = Tokens(admin=ADMIN, readers={"acme": ACME})
    t.check_admin(ADMIN, "x")
    with pytest.raises(AccessDenied):
        t.check_admin(ADMIN[:-1], "x")
    with pytest.raises(AccessDenied):
        t.check_admin(None, "x")
    t.check_read("acme", ACME, "x")
    t.check_read("acme", ADMIN, "x")           # the admin reads everything
    with pytest.raises(AccessDenied):          # read tokens on: a tenant without one is closed
        t.check_read("other", None, "x")
    Tokens(admin=ADMIN, readers={"acme": ACME, "pub": "*"}).check_read("pub", None, "x")  # left open
    Tokens(admin=ADMIN).check_read("other", None, "x")    # no read tokens at all: everyone reads
    with pytest.raises(AccessDenied):
        t.check_read("acme", 12345, "x")
    with pytest.raises(KDNError, match="at least 16"):
        Tokens(admin="short")
    Tokens().check_admin(None, "x")            # an open development network


def test_admin_token_file_is_private(tmp_path, monkeypatch):
    monkeypatch.delenv("KDN_ADMIN_TOKEN", raising=False)
    a = ensure_admin_token(tmp_path)
    assert len(a) >= 32 and ensure_admin_token(tmp_path) == a
    assert (tmp_path / "admin_token").stat().st_mode & 0o777 == 0o600
