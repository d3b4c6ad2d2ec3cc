"""Operator calls (kdn/client/operator.py) on a real network: they need the admin token and no
model; bad values are refused before anything changes; status reports a dead edge as down."""

import time

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.core.errors import AccessDenied, BadRequest, VersionNotFound

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
        {"deleted": "twice@v1"}                      # that model's version
    assert ops.delete("twice", 1) == {"deleted": "twice@v1"}           # now only fp-b has one
    with pytest.raises(VersionNotFound):
        ops.delete("twice", 1)
    with pytest.raises(AccessDenied, match="admin token"):
        Client(network=net.name).delete("kb", 1)
    assert Client(network=net.name, fingerprint="fp", admin_token=ADMIN).manifest("kb").version == 1


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
