"""The membership record: checked before it changes, saved before it is taken, quarantined
when unreadable (the origin then starts from the topology's edges)."""
import errno
import math
import os

import msgpack
import pytest

from kdn.core.errors import BadRequest, StoreError
from kdn.origin.membership import FILE, Membership, check_members
from kdn.placement.topology import Topology

TOPO = Topology.default_local(["us-east", "eu-west"], edges_per_region=1, capacity_bytes=1 << 30)
REGIONS = TOPO.regions


def test_check_members_normalises_and_names_the_first_problem():
    assert check_members([["a", "us-east", 1], ("b", "eu-west", 2.5)], REGIONS) == \
        [("a", "us-east", 1.0), ("b", "eu-west", 2.5)]
    assert check_members([], REGIONS) == []
    for members, message in [
        ([("a", "us-east", 1.0), ("b", "mars", 1.0)], "edge 'b' is in region 'mars'"),
        ([("a", "us-east", 1.0), ("a", "us-east", 1.0)], "given more than once: a"),
        ([("a", "us-east", math.inf)], "edge 'a' weight must be a number in \\(0, 1000000\\], got inf"),
        ([("a", "us-east", -1)], "edge 'a' weight"),
        ([("a", "us-east", "1")], "edge 'a' weight"),
        ([("a/b", "us-east", 1.0)], "member 0 name must be"),
        ([("", "us-east", 1.0)], "member 0 name must be"),
        ([None], "member 0 must be \\(name, region, weight\\), got None"),
        ({"a": 1}, "members must be a list"),
        ([("a", "us-east", 1.0)] * 5000, "at most 4096"),
    ]:
        with pytest.raises(BadRequest, match=message):
            check_members(members, REGIONS)


def test_a_saved_membership_reopens_and_only_member_changes_bump_the_version(tmp_path):
    ms = Membership(tmp_path, TOPO, replicas=2)
    assert (ms.members, ms.version, ms.overrides, ms.recovering) == ([], 0, {}, False)
    members = [("us-east-0", "us-east", 1.0)]
    ms.save(members=members)
    assert ms.version == 1 and len(ms.ring) == 1
    ms.save(overrides={"t/kb": {"replicas": 1}})
    assert ms.version == 1
    again = Membership(tmp_path, TOPO, replicas=2)
    assert (again.members, again.version, again.overrides) == (members, 1, {"t/kb": {"replicas": 1}})
    assert os.stat(tmp_path / FILE).st_mode & 0o777 == 0o600
    assert again.view() == {"version": 1, "members": [["us-east-0", "us-east", 1.0]],
                            "replicas": 2, "topology": TOPO.to_dict()}     # no KB names


def test_a_failed_save_changes_nothing(tmp_path, monkeypatch):
    ms = Membership(tmp_path, TOPO, replicas=2)
    ms.save(members=[("us-east-0", "us-east", 1.0)])
    before = (tmp_path / FILE).read_bytes()

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(StoreError, match="cannot save the membership .*No space left on device.*nothing changed"):
        ms.save(members=[("eu-west-0", "eu-west", 1.0)], overrides={"t/kb": {}})
    monkeypatch.undo()
    assert (ms.members, ms.version, ms.overrides) == ([("us-east-0", "us-east", 1.0)], 1, {})
    assert [e.name for e in ms.ring.edges] == ["us-east-0"]
    assert (tmp_path / FILE).read_bytes() == before and os.listdir(tmp_path) == [FILE]


@pytest.mark.parametrize("content", [
    b"",
    b"\xc1\xc1\xc1",                                                        # not msgpack
    msgpack.packb([1, 2, 3]),                                               # not a record
    msgpack.packb({"members": [], "version": "7"}),                         # a bad version
    msgpack.packb({"members": [["a", "mars", 1.0]], "version": 3}),         # an unknown region
    msgpack.packb({"members": [], "version": 3, "overrides": [1]}),
])
def test_an_unreadable_file_is_quarantined_and_the_topology_used(tmp_path, content):
    (tmp_path / FILE).write_bytes(content)
    ms = Membership(tmp_path, TOPO, replicas=2)
    assert ms.members == [(e.name, e.region, 1.0) for e in TOPO.edges]
    assert ms.recovering and ms.counters["membership_quarantined"] == 1
    assert ms.quarantined == str(tmp_path / (FILE + ".corrupt"))
    assert (tmp_path / (FILE + ".corrupt")).read_bytes() == content
    ms.save(version=5)
    again = Membership(tmp_path, TOPO, replicas=2)
    assert not again.recovering and again.version == 5 and again.members == ms.members
