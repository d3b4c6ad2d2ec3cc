"""Operator calls (kdn/client/operator.py) on a real network: they need the admin token and no
model; bad values are refused before anything changes; status reports a dead edge as down."""

import time

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.core.emphasis import emphasis_fingerprint
from kdn.core.errors import AccessDenied, BadRequest, VersionNotFound
from kdn.core.keys import namespace_digest

REGIONS = ["us-east", "eu-west", "ap-south"]
ADMIN = "admin-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def net(small_network):
    n = small_network(auth={"admin": ADMIN, "readers": {}})
    rng = np.random.default_rng(3)
    Client(network=n.name, fingerprint="fp", admin_token=ADMIN).publish(
        "kb", [("d", rng.integers(0, 1000, 300).tolist())],
        rng.standard_normal((2, 2, 2, 300, 8)).astype(np.float32))
    return n


def test_operator_calls_need_the_admin_token_but_no_model(net):
    ops = Client(network=net.name, admin_token=ADMIN)            # no fingerprint
    got = ops.set_replicas("kb", 3)
    assert got["override"] == {"replicas": 3} and sum(got["pushed"].values()) >= 2
    with pytest.raises(AccessDenied, match="admin token"):
        Client(network=net.name).set_replicas("kb", 2)


@pytest.mark.parametrize("call,match", [
    (lambda o: o.pin("kb", None), "list of region names"),
    (lambda o: o.pin("kb", "eu-west"), "list of region names"),
    (lambda o: o.set_replicas("kb", True), "replicas"),
    (lambda o: o.set_ttl("kb", float("nan")), "ttl_s"),
    (lambda o: o.warm("kb", "mars"), "mars"),
])
def test_bad_operator_values_are_refused_and_change_nothing(net, call, match):
    ops = Client(network=net.name, admin_token=ADMIN)
    before = ops.status()["origin"]["overrides"]
    with pytest.raises(BadRequest, match=match):
        call(ops)
    assert ops.status()["origin"]["overrides"] == before


def test_delete_is_an_operator_call_that_needs_no_model(net):
    rng = np.random.default_rng(4)
    docs, kv = [("d", rng.integers(0, 1000, 300).tolist())], rng.standard_normal((2, 2, 2, 300, 8)).astype(np.float32)
    for fp in ("fp-a", "fp-b"):                      # one KB, its version 1 under two models
        assert Client(network=net.name, fingerprint=fp, admin_token=ADMIN).publish("twice", docs, kv)["version"] == 1
    ops = Client(network=net.name, admin_token=ADMIN)                # no fingerprint
    with pytest.raises(BadRequest, match=r"^twice@v1 of tenant 'default' exists under 2 models \(fp-a, fp-b\): "
                                         r"name the one to delete"):
        ops.delete("twice", 1)
    with pytest.raises(VersionNotFound, match="KB 'twice' of tenant 'default' has no version 7"):
        ops.delete("twice", 7)
    with pytest.raises(BadRequest, match="version must be an int >= 1, got True"):
        ops.delete("twice", True)
    assert Client(network=net.name, fingerprint="fp-a", admin_token=ADMIN).delete("twice", 1) == \
        {"deleted": "twice@v1", "emphasized_copies": 0}                 # that model's version
    assert ops.delete("twice", 1) == {"deleted": "twice@v1", "emphasized_copies": 0}   # only fp-b has one
    with pytest.raises(VersionNotFound):
        ops.delete("twice", 1)
    with pytest.raises(AccessDenied, match="admin token"):
        Client(network=net.name).delete("kb", 1)
    assert Client(network=net.name, fingerprint="fp", admin_token=ADMIN).manifest("kb").version == 1


def _copy_fingerprints(fp: str, n: int) -> list:
    """n emphasized-copy fingerprints of model fp, the first one's namespace listed before the
    KB's (the origin lists by namespace digest: a "latest" lookup that took the first of equal
    versions took that copy for the KB)."""
    kb_ns = namespace_digest("default", fp)
    fps = [emphasis_fingerprint(fp, bytes([i]) * 16) for i in range(256)]
    first = next(f for f in fps if namespace_digest("default", f) < kb_ns)
    return [first] + [f for f in fps if f != first][:n - 1]


def test_emphasized_copies_are_never_the_kb_and_go_with_it(net):
    """A KB's emphasized copies (manifests of its name and version under fingerprints derived
    from its model's, kdn.engines.emphasis_variants) never stand for the KB: emphasis set, cleared and
    set again in a row, warm, status, delete and a reader's KB list see the KB's own manifests
    only; deleting the version retires its copies (gone from the origin's listing and from the
    edges), and a copy's fingerprint is refused where a model's is meant."""
    rng = np.random.default_rng(5)
    docs = [("kb-a.txt", rng.integers(0, 1000, 200).tolist()), ("kb-b.txt", rng.integers(0, 1000, 200).tolist())]
    kv = rng.standard_normal((2, 2, 2, 400, 8)).astype(np.float32)
    own = Client(network=net.name, fingerprint="fp-e", admin_token=ADMIN)
    assert own.publish("kba", docs, kv)["version"] == 1
    copies = _copy_fingerprints("fp-e", 3)
    for i, fp in enumerate(copies):              # as publish_emphasis stores an edit of v1
        meta = {"emphasis": {"kb-b.txt": i + 2}, "of": {"kb": "kba", "version": 1}, "exact": False}
        got = Client(network=net.name, fingerprint=fp, admin_token=ADMIN).publish(
            "kba", [("emphasized", rng.integers(0, 1000, 300).tolist())],
            rng.standard_normal((2, 2, 2, 300, 8)).astype(np.float32), meta=meta)
        assert got["version"] == 1
    ops = Client(network=net.name, admin_token=ADMIN)                 # no fingerprint: `kdn` as run
    listed = lambda **kw: {(m["fingerprint"], m["version"]) for m in ops.view.origin().manifests(name="kba", **kw)}
    assert listed() == {("fp-e", 1)} | {(fp, 1) for fp in copies}    # edges still learn the copies
    assert listed(own=True) == {("fp-e", 1)}
    # emphasize, clear, emphasize again: the KB's documents, every time
    for weights in ({"kb-a.txt": 3}, {}, {"kb-b.txt": 2}, {"kb-a.txt": 4, "kb-b.txt": 2}, {}, {"kb-a.txt": 2}):
        got = ops.set_emphasis("kba", weights)
        assert got["override"].get("emphasis", {}) == weights
    with pytest.raises(BadRequest, match=r"names document 'emphasized', which the knowledge base does not "
                                         r"have \(it has: 'kb-a.txt', 'kb-b.txt'\)"):
        ops.set_emphasis("kba", {"emphasized": 2})
    assert ops.warm("kba", "eu-west")["version"] == 1
    # status: the KB's own versions; its copies counted apart
    origin = ops.status()["origin"]
    assert [k for k in origin["kbs"] if k["name"] == "kba"] == \
        [{"tenant": "default", "name": "kba", "fingerprint": "fp-e", "versions": [1]}]
    assert origin["store"]["emphasized_copies"] == 3
    assert origin["store"]["versions"] == sum(len(k["versions"]) for k in origin["kbs"])
    # what the service lists as models (a tenant's KBs of its model): the KB, once
    assert [m.name for m in own.manifests(refresh=True)] == ["kba"]
    with pytest.raises(BadRequest, match=r"^fingerprint 'fp-e~emphasis-[0-9a-f]{32}' is an emphasized copy's, "
                                         r"not a model's: delete the KB version under its model \('fp-e'\)"):
        Client(network=net.name, fingerprint=copies[1], admin_token=ADMIN).delete("kba", 1)
    assert ops.delete("kba", 1) == {"deleted": "kba@v1", "emphasized_copies": 3}
    assert listed() == set()                                          # retired with it
    assert Client(network=net.name, fingerprint=copies[0], admin_token=ADMIN).manifests(refresh=True) == []
    origin = ops.status()["origin"]
    assert origin["store"]["emphasized_copies"] == 0 and not [k for k in origin["kbs"] if k["name"] == "kba"]
    with pytest.raises(VersionNotFound):
        ops.delete("kba", 1)
    # a copy that does not say which version it edits, or edits none committed, would outlive
    # it: refused, nothing committed
    publisher = Client(network=net.name, fingerprint=copies[2], admin_token=ADMIN)
    for meta, match in (({"exact": False}, r"is under an emphasized fingerprint .*must name the version of 'kba'"),
                        ({"of": {"kb": "kba", "version": 1}, "exact": False},
                         r"is an emphasized copy of kba@v1 under model 'fp-e', which is not committed")):
        with pytest.raises(BadRequest, match=match):
            publisher.publish("kba", [("emphasized", [1, 2, 3])], np.zeros((2, 2, 2, 3, 8), np.float32), meta=meta)
    assert listed() == set()


def test_status_reports_every_node_and_a_dead_edge_as_down(net):
    ops = Client(network=net.name, admin_token=ADMIN)
    st = ops.status()
    assert st["origin"]["role"] == "origin" and "overrides" in st["origin"]
    assert sorted(e["name"] for e in st["edges"]) == sorted(f"{r}-0" for r in REGIONS)
    assert not any(e.get("down") for e in st["edges"])
    anon = Client(network=net.name).status()                     # no admin: no KB names
    assert "overrides" not in anon["origin"] and "kb" not in repr(anon["origin"])
    victim = net.edge("ap-south-0")
    ray.kill(victim, no_restart=True)
    # ray.kill returns before the actor is gone, and a call sent just after it can still be
    # answered (the kill travels through the GCS, the call straight to the actor): wait
    deadline = time.monotonic() + 30
    while True:
        try:
            ray.get(victim.stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        assert time.monotonic() < deadline, "the killed edge still answers after 30 s"
        time.sleep(0.2)
    st = ops.status(timeout_s=3.0)
    down = [e["name"] for e in st["edges"] if e.get("down")]
    assert down == ["ap-south-0"]
