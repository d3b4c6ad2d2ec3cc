"""Operator calls (kdn/client/operator.py) on a real network: they need the admin token and no
model; bad values are refused before anything changes; status reports a dead edge as down."""

import time

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.core.errors import AccessDenied, BadRequest

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
