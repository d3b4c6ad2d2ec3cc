"""The network's membership: which edges exist, in which region, with what weight.

The origin owns it. Every change of members gets a new version number; edges and clients
take a membership only if its version is not older than the one they hold, so a late
broadcast never undoes a newer one. It lives in one object beside the store (a file, or an
object in the origin's bucket: kdn/origin/objects.py), with the operators' per-KB overrides, so
an origin restarted on any node finds it; a change is written first and only then takes
effect in memory: a failed write (a full disk, a refusing bucket) changes nothing. A file that cannot be read is
quarantined (renamed aside, logged, counted) and the origin starts from the topology's
edges instead of not at all, because Ray never restarts an actor whose constructor raised;
it then numbers its next version above every version its edges hold (`recovering`).
"""
import collections
import logging

import msgpack

from kdn.core.checks import check_int, check_number
from kdn.core.errors import BadRequest, StoreError
from kdn.core.names import check_node_name
from kdn.origin.objects import CORRUPT_SUFFIX, open_objects
from kdn.placement.ring import Edge, Ring

log = logging.getLogger(__name__)

FILE = "membership.msgpack"
MAX_MEMBERS = 4096
MAX_WEIGHT = 1e6            # a weight is a relative capacity: 1e6 times another edge is absurd


def check_weight(weight, what: str = "weight") -> float:
    return check_number(weight, what, 0, MAX_WEIGHT, open_lo=True)


def check_members(members, regions) -> list:
    """members as [(name, region, weight)], or BadRequest naming the first problem: a list
    of at most MAX_MEMBERS triples, names valid and unique, regions among `regions`."""
    if not isinstance(members, (list, tuple)) or len(members) > MAX_MEMBERS:
        raise BadRequest(f"members must be a list of at most {MAX_MEMBERS} (name, region, weight), "
                         f"got {type(members).__name__}"
                         + (f" of {len(members)}" if isinstance(members, (list, tuple)) else ""))
    out = []
    for i, m in enumerate(members):
        if not isinstance(m, (list, tuple)) or len(m) != 3:
            raise BadRequest(f"member {i} must be (name, region, weight), got {m!r:.80}")
        name, region, weight = m
        check_node_name(name, f"member {i} name")
        if not isinstance(region, str) or region not in regions:
            raise BadRequest(f"edge {name!r} is in region {region!r:.60}, which the topology does not "
                             f"name (regions: {', '.join(regions)})")
        out.append((name, region, check_weight(weight, f"edge {name!r} weight")))
    names = [m[0] for m in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise BadRequest(f"edge names must be unique; given more than once: {', '.join(twice)}")
    return out


def _parse(buf) -> tuple:
    """(members, version, overrides) from a file's bytes; ValueError if they are not that."""
    try:
        d = msgpack.unpackb(buf, raw=False)
    except (ValueError, msgpack.UnpackException) as e:   # msgpack's errors for bad bytes
        raise ValueError(f"not msgpack: {e}") from None
    if not isinstance(d, dict) or not {"members", "version"} <= d.keys():
        raise ValueError("not a membership record")
    version, overrides = d["version"], d.get("overrides", {})
    check_int(version, "membership version", 0, error=ValueError)
    if not isinstance(overrides, dict):
        raise ValueError("overrides are not a dict")
    return d["members"], version, overrides


class Membership:
    """Members, their version, the overrides and the ring built from the members: one record,
    saved before it changes. `replicas` is the default number of ring owners per chunk."""

    def __init__(self, root, topology, replicas: int):
        """root: the origin's folder or s3://bucket/prefix (or an origin.objects backend)."""
        self.objects = open_objects(root)
        self.path = self.objects.where(FILE)
        self.topology = topology
        self.replicas = replicas
        self.counters = collections.Counter(membership_quarantined=0, membership_saves=0)
        self.quarantined = None    # where an unreadable file was moved, if one was
        self.recovering = False    # started without a readable file: version unknown
        self.members, self.version, self.overrides = self._load()
        self.ring = Ring([Edge(*m) for m in self.members])

    def _load(self) -> tuple:
        aside = FILE + CORRUPT_SUFFIX
        try:
            members, version, overrides = _parse(self.objects.get(FILE))
            return check_members(members, self.topology.regions), version, overrides
        except FileNotFoundError:
            if self.objects.size(aside) is None:
                return [], 0, {}          # a new network: the launcher sets the members
            why = "only a quarantined copy exists"   # quarantined, then restarted before a save
        except (ValueError, BadRequest, OSError) as e:
            self.objects.rename(FILE, aside)
            self.counters["membership_quarantined"] += 1
            why = str(e)
        log.error("membership file %s is unreadable (%s); moved to %s; starting from the "
                  "topology's edges", self.path, why, aside)
        self.quarantined, self.recovering = self.objects.where(aside), True
        return [(e.name, e.region, float(e.weight)) for e in self.topology.edges], 0, {}

    def save(self, members=None, overrides=None, version=None) -> None:
        """Write the record with these changes, then take them (new members: a new version).
        On a failed write (StoreError) nothing changed, in memory or on disk."""
        members = self.members if members is None else list(members)
        overrides = self.overrides if overrides is None else overrides
        if version is None:
            version = self.version + (members != self.members)
        record = {"members": [list(m) for m in members], "version": version, "overrides": overrides}
        try:
            self.objects.put(FILE, msgpack.packb(record, use_bin_type=True))
        except StoreError as e:
            raise StoreError(f"cannot save the membership to {self.path}: {e}; nothing changed") from None
        if members != self.members:
            self.ring = Ring([Edge(*m) for m in members])
        self.members, self.overrides, self.version = members, overrides, version
        self.counters["membership_saves"] += 1

    def names(self) -> list:
        return [m[0] for m in self.members]

    def edges_in(self, region: str) -> list:
        return [n for n, r, _ in self.members if r == region]

    def view(self) -> dict:
        """What edges and clients route by. Never the overrides: they name tenants' KBs, and
        anyone may read a membership (an edge hands its copy to any client)."""
        return {"version": self.version, "members": [list(m) for m in self.members],
                "replicas": self.replicas, "topology": self.topology.to_dict()}
