"""Links measured, not declared (kdn/placement/links.py): round trips are the least of the last
calls, throughput a weighted mean of real transfers; a peer's bytes are timed as they arrive;
owners are ranked by what was measured where it was, by the topology where not."""
import asyncio

import numpy as np
import pytest

from kdn.core.chunk import Chunk
from kdn.placement.links import MIN_TRANSFER_BYTES, RANK_BYTES, ROUND_TRIPS, Links, rank_by_region
from kdn.edge.membership import Membership
from kdn.edge.tiers import Held
from kdn.placement.topology import Topology


def test_round_trips_are_the_least_of_the_last_calls_and_throughput_a_weighted_mean():
    links = Links()
    assert links.round_trip_s("a") is None and links.transfer_s("a", 1 << 20) is None
    for s in (0.004, 0.001, 0.003):
        links.call("a", s)
    assert links.round_trip_s("a") == 0.001
    for _ in range(ROUND_TRIPS):                    # the old minimum ages out
        links.call("a", 0.002)
    assert links.round_trip_s("a") == 0.002
    assert links.transfer_s("a", 1 << 20) is None, "no throughput measured yet"
    links.transfer("a", 100, 1e-6)                  # too small to measure a pipe
    assert links.gbps("a") is None
    links.transfer("a", 10**9, 1.0)
    links.transfer("a", 10**9, 0.5)
    assert links.gbps("a") == pytest.approx(0.3 * 2.0 + 0.7 * 1.0)
    assert links.transfer_s("a", 10**8) == pytest.approx(0.001 + 10**8 / 1.3e9)
    st = links.stats()["a"]
    assert st["transfers"] == 2 and st["bytes"] == 2 * 10**9 and st["round_trip_ms"] == pytest.approx(2.0)


def test_a_peers_bytes_are_timed_as_they_arrive_and_only_once():
    links = Links()
    kv = np.zeros(MIN_TRANSFER_BYTES, np.uint8)
    chunk = Chunk(b"k" * 16, b"n" * 16, kv, "opaque")

    async def main():
        fut = asyncio.get_running_loop().create_future()
        held = Held.from_wire((fut, chunk.key, chunk.ns, chunk.nbytes, chunk.raw, "raw", "opaque"), "far-0", links)
        asyncio.get_running_loop().call_later(0.05, fut.set_result, chunk)
        got = await held.resolve()
        again = await held.resolve()                # read once: not a second transfer
        return got, again
    got, again = asyncio.run(main())
    assert got is chunk and again is chunk
    st = links.stats()["far-0"]
    assert st["transfers"] == 1 and st["bytes"] == chunk.nbytes
    assert links.gbps("far-0") < chunk.nbytes / 0.04 / 1e9          # it took the 50 ms it took


def test_owners_are_ranked_by_what_was_measured_and_by_the_topology_until_then():
    topo = Topology.default_local(["here", "near", "far"], capacity_bytes=1 << 30)
    m = Membership(topo.to_dict(), replicas=3)
    key = b"x" * 16
    declared = m.sources([key], "here-0", "here")[key]
    assert declared == ["near-0", "far-0"], "the topology: near is 55 ms away, far 80 ms"
    links = Links()
    assert m.sources([key], "here-0", "here", links)[key] == declared
    for node, rtt, gbps in (("near-0", 0.300, 0.01), ("far-0", 0.002, 2.0)):   # the measurement says otherwise
        links.call(node, rtt)
        links.transfer(node, 10**8, 10**8 / (gbps * 1e9))
    assert m.sources([key], "here-0", "here", links)[key] == ["far-0", "near-0"]


def test_a_reader_ranks_edges_by_region_measured_where_fresh_declared_otherwise(monkeypatch):
    """rank_by_region (a client's view): the declared order first; a region measured slower
    than another's declared link goes behind it, one measured faster than declared is not drawn
    nearer; two edges of one region keep the ring's order whichever was measured; a
    measurement older than max_age_s stops counting."""
    import kdn.placement.links as mod
    topo = Topology.default_local(["us-east", "eu-west", "ap-south"])
    cands = [("ap-south-0", "ap-south"), ("eu-west-1", "eu-west"), ("eu-west-0", "eu-west"),
             ("us-east-0", "us-east")]
    assert rank_by_region(topo, "eu-west", cands) == ["eu-west-1", "eu-west-0", "ap-south-0", "us-east-0"]
    clock = [1000.0]
    monkeypatch.setattr(mod.time, "monotonic", lambda: clock[0])

    def measured(**nodes):       # node=(round trip s, bytes, seconds) of one call and one transfer
        out = Links()
        for node, (rtt, nbytes, seconds) in nodes.items():
            out.call(node.replace("_", "-"), rtt)
            out.transfer(node.replace("_", "-"), nbytes, seconds)
        return out

    def ranked(links, **kw):
        return rank_by_region(topo, "eu-west", cands, links, max_age_s=60, **kw)
    # eu-west-0 measured fast: its region stays first, and eu-west-1 (unmeasured, first on the
    # ring) stays before it: edges of one region are never reordered by a measurement
    assert ranked(measured(eu_west_0=(0.0005, 64 << 20, 0.03))) == ["eu-west-1", "eu-west-0", "ap-south-0", "us-east-0"]
    # measured at 5 MB/s: a chunk takes ~0.2 s there, more than a declared 55-80 ms elsewhere
    links = measured(eu_west_0=(0.001, 8 << 20, 1.6))
    assert links.transfer_s("eu-west-0", RANK_BYTES) > topo.transfer_time("us-east", "eu-west", RANK_BYTES)
    assert ranked(links) == ["ap-south-0", "us-east-0", "eu-west-1", "eu-west-0"]
    # us-east measured even slower than that: behind eu-west
    links.call("us-east-0", 0.001)
    links.transfer("us-east-0", 1 << 20, 1.0)
    assert ranked(links) == ["ap-south-0", "eu-west-1", "eu-west-0", "us-east-0"]
    # a remote edge measured faster than its declared link is not drawn nearer than declared
    fast = measured(ap_south_0=(0.0001, 64 << 20, 0.01), eu_west_0=(0.004, 64 << 20, 0.1))
    assert fast.transfer_s("ap-south-0", RANK_BYTES) < fast.transfer_s("eu-west-0", RANK_BYTES)
    assert ranked(fast) == ["eu-west-1", "eu-west-0", "ap-south-0", "us-east-0"]
    assert rank_by_region(topo, "eu-west", cands, links, max_age_s=60, min_transfers=2) == \
        ["eu-west-1", "eu-west-0", "ap-south-0", "us-east-0"], "one transfer each: not yet"
    clock[0] += 61                               # stale: eu-west and us-east declared again
    assert links.transfer_s("eu-west-0", RANK_BYTES, max_age_s=60) is None
    assert links.transfer_s("eu-west-0", RANK_BYTES) is not None, "kept, only not trusted for ranking"
    assert rank_by_region(topo, "eu-west", cands, links, max_age_s=60) == \
        ["eu-west-1", "eu-west-0", "ap-south-0", "us-east-0"]
