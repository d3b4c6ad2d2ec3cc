"""Routing across regions (kdn.serve.regions): the decision is a pure function of each region's
View (wait, fetch, tier) and the round trips from the caller's region. The ingress builds the
Views from Serve's request routers (tests/serve/test_router.py) and routes through it live
(tests/serve/test_serve.py)."""
import math
import time

from kdn.serve.regions import UNAVAILABLE, View, decide_region, tier_of

RTT = {"us-east": 0.0, "eu-west": 0.110, "ap-south": 0.160}


def test_equal_regions_stay_home():
    views = {r: View(1.0, 0.05, "edge_memory") for r in RTT}
    assert decide_region("us-east", views, RTT) == ("us-east", "home")


def test_a_queue_worse_than_the_round_trip_goes_to_the_neighbour():
    views = {"us-east": View(3.0, 0.0, "engine"), "eu-west": View(0.0, 0.0, "engine"),
             "ap-south": View(0.0, 0.0, "engine")}
    # eu-west is nearer than ap-south: its whole cost, round trip included, is the least
    assert decide_region("us-east", views, RTT) == ("eu-west", "cross_region_queue")


def test_a_difference_within_the_round_trip_stays_home():
    views = {"us-east": View(0.10, 0.0, "engine"), "eu-west": View(0.0, 0.0, "engine"),
             "ap-south": View(0.0, 0.0, "engine")}
    assert decide_region("us-east", views, RTT) == ("us-east", "home")     # 0.10 < 0 + 0.110


def test_where_the_kv_is_can_move_a_request():
    # home must fetch from the origin (2 s); eu-west's engine holds the KB: the KV is why
    views = {"us-east": View(0.0, 2.0, "origin"), "eu-west": View(0.0, 0.0, "engine")}
    assert decide_region("us-east", views, RTT) == ("eu-west", "cross_region_kv")
    # the same queues, the same tier at home and abroad: home
    views["us-east"] = View(0.0, 0.0, "engine")
    assert decide_region("us-east", views, RTT) == ("us-east", "home")


def test_a_home_without_replicas_sends_to_the_nearest_region_that_has_one():
    views = {"us-east": UNAVAILABLE, "eu-west": View(5.0, 0.0, "engine"), "ap-south": View(5.0, 0.0, "engine")}
    assert decide_region("us-east", views, RTT) == ("eu-west", "home_unavailable")
    everywhere_down = {r: UNAVAILABLE for r in RTT}
    assert decide_region("us-east", everywhere_down, RTT) == ("us-east", "home_unavailable")


def test_regions_not_known_are_never_chosen():
    views = {"us-east": View(9.0, 0.0, "engine"), "eu-west": None, "ap-south": View(0.0, 0.0, "edge_memory")}
    assert decide_region("us-east", views, RTT) == ("ap-south", "cross_region_queue")
    assert decide_region("us-east", {"us-east": None, "eu-west": View(0, 0, "edge_memory")}, RTT) == ("us-east", "no_view")
    # a region with no round trip known (not in the topology's table) is not a candidate
    assert decide_region("us-east", {"us-east": View(9.0, 0, "edge_memory"), "mars": View(0, 0, "edge_memory")}, RTT) == \
        ("us-east", "home")


def test_a_decision_over_many_regions_takes_well_under_a_millisecond():
    regions = [f"r{i}" for i in range(64)]
    rtt = {r: 0.001 * i for i, r in enumerate(regions)}
    views = {r: View(i % 5, 0.01 * (i % 3), "edge_memory") for i, r in enumerate(regions)}
    t0 = time.perf_counter()
    for _ in range(1000):
        decide_region("r7", views, rtt)
    assert (time.perf_counter() - t0) / 1000 < 1e-3


def test_the_tier_of_a_fetch_is_the_farthest_source_of_its_chunks():
    assert tier_of({"local": 3}) == "edge_memory"
    assert tier_of({"local": 2, "disk": 1}) == "edge_disk"
    assert tier_of({"disk": 1, "peer": 1}) == "peer"
    assert tier_of({"local": 2, "peer": 1}) == "peer"
    assert tier_of({"local": 1, "peer": 1, "origin": 1}) == "origin"
    assert View(1.5, 0.25, "edge_memory").ttft_s == 1.75 and UNAVAILABLE.ttft_s == math.inf


def test_the_links_routing_uses_are_the_edges_measurements_where_there_are_any():
    """kdn.serve.app.measured_links: the least round trip any edge of a region measured to an
    edge of another, the origin's link as its edges measured it; declared figures elsewhere."""
    from kdn.serve.app import measured_links
    declared = {"rtt_s": {"us-east": {"us-east": 0.0004, "eu-west": 0.110, "ap-south": 0.160},
                          "eu-west": {"us-east": 0.110, "eu-west": 0.0004, "ap-south": 0.130}},
                "origin": {"us-east": (0.0002, 10e9), "eu-west": (0.055, 1e9), "ap-south": (0.080, 1e9)}}
    edges = {"us-east-0": {"region": "us-east", "links": {
                 "eu-west-0": {"round_trip_ms": 3.0, "gbps": 0.5},
                 "origin": {"round_trip_ms": 0.2, "gbps": None}}},
             "us-east-1": {"region": "us-east", "links": {"eu-west-0": {"round_trip_ms": 2.0, "gbps": None}}},
             "eu-west-0": {"region": "eu-west", "links": {
                 "origin": {"round_trip_ms": 4.0, "gbps": 0.25},
                 "gone-9": {"round_trip_ms": 0.1, "gbps": 9.0}}},      # not a member: ignored
             "ap-south-0": {"region": "ap-south", "links": None}}
    got = measured_links(declared, edges)
    assert got["rtt_s"]["us-east"] == {"us-east": 0.0004, "eu-west": 0.002, "ap-south": 0.160}
    assert got["rtt_s"]["eu-west"] == declared["rtt_s"]["eu-west"]        # eu-west measured no edge
    assert got["origin"] == {"us-east": (0.0001, 10e9), "eu-west": (0.002, 0.25e9), "ap-south": (0.080, 1e9)}
    assert declared["rtt_s"]["us-east"]["eu-west"] == 0.110                # the declared are kept
