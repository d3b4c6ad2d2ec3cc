"""Routing across regions in `kdn serve`: which region answers a `/v1` request for KB k.

A request that names no region (`/v1/...`, not `/<region>/v1/...`) is answered in the
caller's region unless that region's expected time to first token is worse than a
neighbour's by more than the round trip between them. A region's expected time to first
token for k (`View.ttft_s`) is its wait, requests ahead per replica x its replicas' mean
service time, plus the fetch of k from the tier that holds it for that region: nothing
when a replica's engine holds it ("engine"), else the region's last measured fetch of k,
named by where it came from ("edge_memory" or "edge_disk": the region's edge, its memory
tiers or its disk tier; "peer": another edge; "origin"), else, for a KB the region never
fetched, the origin's link to it at the KB's size ("origin_estimate") or, size unknown,
DEFAULT_FETCH_S for every region alike ("unknown"). The ingress builds each region's View
from what Serve already gives its request router there (kdn.serve.router.KBAffinityRouter:
the replicas, their reports, their queue lengths); `decide_region` is pure and one pass
over the regions (microseconds). The region it picks is final for a request it sends
across: the request goes to that region's deployment, and a retry after a replica's death
is decided afresh only for a request that had stayed home, so a request is routed across
regions at most once and never loops.
"""
import math
from dataclasses import dataclass

DEFAULT_FETCH_S = 0.05        # a KB's fetch when nothing says where it is (every region alike)
TIERS = ("engine", "edge_memory", "edge_disk", "peer", "origin", "origin_estimate", "unknown")
# where an answer's knowledge KV came from, measured by the replica (EngineKV.served_from):
# its engine, the fetch's farthest tier (tier_of), a conversation's own KV kept by an earlier
# turn ("history": kdn.client.history), or nowhere ("none": the prompt was computed)
KV_SOURCES = ("engine", "edge_memory", "edge_disk", "peer", "origin", "history", "none")
# why a region was chosen: stayed home; routed away for the queue or for where the KV is; the
# caller's region had no replica; nothing known of the caller's region (no view yet)
OUTCOMES = ("home", "cross_region_queue", "cross_region_kv", "home_unavailable", "no_view")


@dataclass(frozen=True)
class View:
    """What one region offers a KB now: its wait, the fetch of the KB there and its tier."""
    wait_s: float
    fetch_s: float
    tier: str

    @property
    def ttft_s(self) -> float:
        return self.wait_s + self.fetch_s


UNAVAILABLE = View(math.inf, 0.0, "unknown")     # a region with no running replica


def tier_of(source_counts: dict) -> str:
    """The tier a fetch came from, by its chunks' sources (kdn.core.names.source_kind):
    the farthest any chunk came from (origin, then peer, then the region's edge's disk, then
    its memory)."""
    for tier, kind in (("origin", "origin"), ("peer", "peer"), ("edge_disk", "disk")):
        if source_counts.get(kind):
            return tier
    return "edge_memory"


def decide_region(home: str, views: dict, rtt_s: dict) -> tuple:
    """(region, why) for a request whose caller is in `home`. views: region -> View, or None
    where nothing is known of it (never chosen); rtt_s: region -> the round trip from home
    to it, seconds. why: one of OUTCOMES."""
    mine = views.get(home)
    if mine is None:
        return home, "no_view"
    best, best_s = None, math.inf
    for r, v in views.items():
        if r == home or v is None or r not in rtt_s:
            continue
        s = v.ttft_s + rtt_s[r]
        if s < best_s or (s == best_s and best is not None and r < best):
            best, best_s = r, s
    if mine.wait_s == math.inf:                  # no replica at home: the nearest that has one
        return (best, "home_unavailable") if best is not None else (home, "home_unavailable")
    if best is None or mine.ttft_s <= best_s:
        return home, "home"
    # the queue is why when the waits alone differ by more than the round trip; else the KV's tier
    queue = mine.wait_s - views[best].wait_s > rtt_s[best]
    return best, "cross_region_queue" if queue else "cross_region_kv"
