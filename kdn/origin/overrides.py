"""Operators' per-KB settings: pin to regions, replica count, TTL on edges, prefetch, emphasis.

An override belongs to a KB of a tenant ("tenant/name") and applies to its latest version at
once (the origin pushes, pins and sets TTLs when it changes) and to every later publish.
Emphasis ({document: integer weight}, kdn.core.emphasis) is the one readers see: the origin
lists each version of the KB with it in its meta, and the service edits the KB's KV by it for
every request that does not name its own ({} clears it).
Values come from operators' tools and are checked here before anything changes: a number
is a real number (never True, NaN or inf) within a sane bound, regions are the topology's.
"""
from kdn.core.checks import check_int
from kdn.core.emphasis import check_weights
from kdn.core.errors import BadRequest
from kdn.core.manifest import check_ttl


def kb_id(tenant: str, name: str) -> str:
    return f"{tenant}/{name}"


def check_regions(value, regions) -> list:
    if not isinstance(value, (list, tuple)) or not all(isinstance(r, str) for r in value):
        raise BadRequest(f"pin_regions must be a list of region names, got {value!r:.80}")
    unknown = [r for r in value if r not in regions]
    if unknown:
        raise BadRequest(f"pin_regions: cannot pin to unknown region(s) {unknown!r:.120}; regions: {', '.join(regions)}")
    return list(dict.fromkeys(value))


def check_replicas(value, n_edges: int) -> int:
    most = max(1, n_edges)
    return check_int(value, "replicas", 1, most, note=f"the network has {n_edges} edge(s)")


def updated(current: dict, regions, n_edges: int, pin_regions=None, replicas=None, ttl_s=None,
            prefetch=None, emphasis=None, documents=None) -> dict:
    """A KB's override with the given settings changed (None: unchanged); BadRequest naming
    the first bad value, before anything is changed. Emphasis weights name documents of
    `documents` (the latest version's names; None: not checked yet)."""
    ov = dict(current)
    if pin_regions is not None:
        ov["pin_regions"] = check_regions(pin_regions, regions)
    if replicas is not None:
        ov["replicas"] = check_replicas(replicas, n_edges)
    if ttl_s is not None:
        ov["ttl_s"] = check_ttl(ttl_s)
    if prefetch is not None:
        if not isinstance(prefetch, bool):
            raise BadRequest(f"prefetch must be True or False, got {prefetch!r:.40}")
        ov["prefetch"] = prefetch
    if emphasis is not None:
        w = check_weights(emphasis, documents)
        if w:
            ov["emphasis"] = w
        else:
            ov.pop("emphasis", None)     # every weight 1: the KB's exact KV again
    return ov
