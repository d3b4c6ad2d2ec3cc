"""The membership an edge routes by: newer versions win, placement from the ring."""
import pytest

from kdn.edge.membership import Membership
from kdn.core.errors import TopologyError


def _m(kit, version, members):
    return {"version": version, "members": members, "replicas": 1, "topology": kit.topology(),
            "overrides": {"kb": {"ttl_s": 5.0}}}


def test_an_edge_starts_from_its_topology_and_takes_newer_versions_only(kit):
    m = Membership(kit.topology(), replicas=2)
    assert m.version == 0 and sorted(e.name for e in m.ring.edges) == ["far-0", "here-0"]
    assert m.apply(_m(kit, 3, [["far-0", "far", 1.0]]))
    assert m.version == 3 and m.replicas == 1 and m.overrides == {"kb": {"ttl_s": 5.0}}
    assert m.to_dict()["members"] == [["far-0", "far", 1.0]]
    assert not m.apply(_m(kit, 2, [["here-0", "here", 1.0]])), "an older broadcast loses"
    assert m.apply(_m(kit, 3, [["far-0", "far", 1.0]])), "the same version again is taken"


def test_a_bad_topology_changes_nothing(kit):
    m = Membership(kit.topology(), replicas=2)
    bad = dict(_m(kit, 5, [["far-0", "far", 1.0]]), topology={"regions": {}})
    with pytest.raises(TopologyError):
        m.apply(bad)
    assert m.version == 0 and len(m.ring) == 2


def test_sources_rank_the_other_owners_nearest_first(kit):
    m = Membership(kit.topology(), replicas=2)
    keys = [bytes([i]) * 16 for i in range(20)]
    src = m.sources(keys, "here-0", "here")
    assert all(s == ["far-0"] for s in src.values()), "with two edges and two replicas, the other"
    assert m.owner_regions(keys[0]) in (["here", "far"], ["far", "here"])
    empty = Membership(kit.topology(), replicas=2)
    empty.apply(_m(kit, 1, []))
    assert empty.owners(keys[:2]) == [[], []]
