"""A process's view of the network (kdn/client/view.py) on a real network: nearest edge first, a
failed edge tried last, membership from the edges while the origin is away, origin calls
retried until their deadline and then a clear Unreachable."""
import time
import uuid

import pytest

from kdn.core.errors import BadRequest, NetworkError
from kdn.core.rpc import Actors, Unreachable
from kdn.client.view import NetworkView

REGIONS = ["us-east", "eu-west", "ap-south"]
ADMIN = "admin-secret-0123456789abcdef"


@pytest.fixture(scope="module")
def net(small_network):
    return small_network(auth={"admin": ADMIN, "readers": {}})


def test_edges_are_ranked_nearest_first_and_a_failed_one_goes_last(net):
    v = NetworkView(net.name, region="ap-south", admin_token=ADMIN)
    assert v.ranked_edges()[0] == "ap-south-0"
    assert v.membership["version"] >= 1 and len(v.ring) == 3
    v._suspect["ap-south-0"] = time.monotonic() + 60
    assert v.ranked_edges()[-1] == "ap-south-0"
    reply, edge, failed = v.nearest(10).membership()
    assert edge != "ap-south-0" and failed == [] and reply["version"] == v.membership["version"]


def test_an_unknown_region_is_a_clear_error(net):
    with pytest.raises(BadRequest, match="region 'mars' is not in the network's topology"):
        NetworkView(net.name, region="mars")


def test_a_network_that_is_not_there_fails_fast_and_clearly(ray_cluster):
    t0 = time.monotonic()
    with pytest.raises(NetworkError, match="neither the origin nor any edge answers"):
        NetworkView(f"missing{uuid.uuid4().hex[:6]}")
    assert time.monotonic() - t0 < 15


def test_origin_calls_carry_the_admin_token_and_give_up_at_their_deadline(net):
    v = NetworkView(net.name, admin_token=ADMIN)
    assert v.origin().stats()["role"] == "origin"
    v.actors = Actors(f"gone{uuid.uuid4().hex[:6]}")   # as if the origin were down for good
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match="did not answer stats within 1 s"):
        v.origin(1.0).stats()
    assert 0.8 < time.monotonic() - t0 < 5


def test_a_region_the_views_ring_has_no_edge_in_is_read_again_before_it_is_given_up(net, monkeypatch):
    """An edge the ring dropped and took back (as the origin's health watch does for an edge
    that stopped answering): a view that read membership in between holds a ring with no edge
    in that region, and a History that calls no edge would never learn otherwise. Its next
    home() re-reads membership (at most every RECHECK_S) and finds the edge again."""
    from kdn.client import view as view_module
    from kdn.client.history import History
    v = NetworkView(net.name, region="eu-west", admin_token=ADMIN)
    tokens = list(range(600))                       # two whole chunks
    h = History(v, "acme", "fp")
    assert h.home(tokens, 0, "eu-west")[0] == "eu-west-0"
    monkeypatch.setattr(view_module, "RECHECK_S", 3600.0)  # read just now, however slow the calls below
    v.origin().remove_edge("eu-west-0")
    v.refresh()
    v.origin().add_edge("eu-west-0", "eu-west")
    version = v.membership["version"]
    assert "eu-west" not in v.ring.regions, "this view read the ring without it"
    assert h.home(tokens, 0, "eu-west") is None, "read within RECHECK_S: not read again"
    assert v.membership["version"] == version
    monkeypatch.setattr(view_module, "RECHECK_S", 0.0)
    edge, scope, ns = h.home(tokens, 0, "eu-west")
    assert edge == "eu-west-0" and v.membership["version"] > version
    assert h.home(tokens, 0, "mars") is None        # a region with no edge at all: still None
    v.actors = Actors(f"gone{uuid.uuid4().hex[:6]}")  # the origin down: the request goes on soon
    t0 = time.monotonic()
    assert h.home(tokens, 0, "mars") is None and time.monotonic() - t0 < 1.0 + 2.0
