"""The membership an edge routes by: the ring of edges, replicas, overrides and topology.

The origin owns the membership and broadcasts each new version to every member; an edge also
asks for it every refresh period, so one that missed a broadcast (it was out of the ring,
restarting, or the call was lost) converges by itself. Before either, an edge routes by the
topology it was started with (version 0). Placement is computed here: no per-request call
asks anyone where a key lives.
"""
import collections

from kdn.placement.links import RANK_BYTES
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology




class Membership:
    def __init__(self, topology: dict, replicas: int):
        self.topology = Topology.from_dict(topology)
        self.replicas = replicas
        self.version = 0
        self.overrides = {}
        self.ring = Ring(list(self.topology.edges))
        self.counters = collections.Counter()    # memberships applied, stale ones ignored

    def apply(self, m: dict) -> bool:
        """Take m if it is not older than what we route by; whether it was taken."""
        if m["version"] < self.version:
            self.counters["membership_stale"] += 1
            return False
        topology = Topology.from_dict(m["topology"])       # both built before anything changes
        ring = Ring([Edge(*e) for e in m["members"]])
        self.version, self.topology, self.ring = m["version"], topology, ring
        self.counters["membership_applied"] += 1
        self.replicas = m.get("replicas", self.replicas)
        self.overrides = m.get("overrides", {})
        return True

    def to_dict(self) -> dict:
        return {"version": self.version, "replicas": self.replicas,
                "members": [[e.name, e.region, e.weight] for e in self.ring.edges],
                "topology": self.topology.to_dict(), "overrides": self.overrides}

    def owners(self, keys) -> list:
        """The ring owners of each key, in ring preference order."""
        if not len(self.ring):
            return [[] for _ in keys]
        return self.ring.owners_batch(list(keys), self.replicas)

    def owner_regions(self, key) -> list:
        return [self.ring.region_of(o) for o in self.owners([key])[0]]

    def sources(self, keys, me: str, region: str, links=None) -> dict:
        """key -> the other owners of key, nearest to region first: by the time a chunk
        (RANK_BYTES) takes from each, measured where `links` (kdn/placement/links.py) has
        measured the owner, the topology's declared link otherwise."""
        out, timed = {}, {}
        for k, owners in zip(keys, self.owners(keys)):
            cands = [o for o in owners if o != me]
            for o in cands:
                if o not in timed:
                    t = None if links is None else links.transfer_s(o, RANK_BYTES)
                    timed[o] = t if t is not None else self.topology.transfer_time(
                        self.ring.region_of(o), region, RANK_BYTES)
            out[k] = [o for _, _, o in sorted((timed[o], i, o) for i, o in enumerate(cands))]
        return out
