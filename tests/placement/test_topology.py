"""Topology: the TOML a user writes, every way it can be wrong, and source ranking by time."""
import pytest

from kdn.core.errors import TopologyError
from kdn.placement import Edge, Topology

GOOD = """
origin_region = "us-east"

[regions.us-east]
latency_ms = 0.2
bandwidth_gbps = 10.0
edges = [
  { name = "use-1", capacity_bytes = 8_000_000_000 },
  { name = "use-2", capacity_bytes = 4_000_000_000 },
]

[regions.eu-west]
latency_ms = 0.3
bandwidth_gbps = 12.5
edges = [ { name = "euw-1", capacity_bytes = 8_000_000_000 } ]

[regions.ap-south]
latency_ms = 0.2
bandwidth_gbps = 10.0

[[links]]
between = ["us-east", "eu-west"]
latency_ms = 40.0
bandwidth_gbps = 1.0

[[links]]
between = ["us-east", "ap-south"]
latency_ms = 90.0
bandwidth_gbps = 5.0

[[links]]
between = ["eu-west", "ap-south"]
latency_ms = 60
bandwidth_gbps = 0.5
"""


def write(tmp_path, text, name="topo.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_good_file_loads_and_round_trips(tmp_path):
    t = Topology.from_toml(write(tmp_path, GOOD))
    assert t.regions == ["ap-south", "eu-west", "us-east"] and t.origin_region == "us-east"
    assert t.region_of("euw-1") == "eu-west" and t.capacity_bytes("use-2") == 4_000_000_000
    assert t.edges_in("us-east") == ["use-1", "use-2"] and t.edges_in("ap-south") == []
    assert t.latency_ms("eu-west", "us-east") == 40.0 == t.latency_ms("us-east", "eu-west")
    assert t.latency_ms("eu-west", "eu-west") == 0.3 and t.bandwidth_gbps("eu-west", "eu-west") == 12.5
    assert t.bandwidth_gbps("ap-south", "eu-west") == 0.5
    assert t.region_capacity_bytes() == {"us-east": 12_000_000_000, "eu-west": 8_000_000_000, "ap-south": 0}
    by_name = {e.name: e for e in t.edges}
    assert by_name["use-1"].region == "us-east"
    assert by_name["use-1"].weight == pytest.approx(2 * by_name["use-2"].weight)
    again = Topology.from_toml(write(tmp_path, t.to_toml(), "again.toml"))
    assert again.to_dict() == t.to_dict() == Topology.from_dict(t.to_dict()).to_dict()


def test_transfer_time_is_latency_plus_queue_and_bytes_over_bandwidth(tmp_path):
    t = Topology.from_toml(write(tmp_path, GOOD))
    assert t.transfer_time("us-east", "eu-west", 10**9) == pytest.approx(0.040 + 1.0)
    assert t.transfer_time("us-east", "eu-west", 10**9, queue_bytes=5 * 10**8) == pytest.approx(0.040 + 1.5)
    assert t.transfer_time("eu-west", "eu-west", 0) == pytest.approx(0.0003)


def test_rank_sources_by_time_not_latency(tmp_path):
    t = Topology.from_toml(write(tmp_path, GOOD))
    cands = [("far-but-fat", "ap-south"), ("near-but-thin", "eu-west")]
    # a reader in us-east: eu-west is 40 ms at 1 GB/s, ap-south 90 ms at 5 GB/s
    assert t.rank_sources("us-east", cands, 1000) == ["near-but-thin", "far-but-fat"]
    assert t.rank_sources("us-east", cands, 2 * 10**9) == ["far-but-fat", "near-but-thin"]
    # a queue at the source makes it further away
    local = [("busy", "us-east"), ("idle", "us-east")]
    assert t.rank_sources("us-east", local, 10**6, {"busy": 10**9}) == ["idle", "busy"]
    assert t.rank_sources("us-east", local, 10**6) == ["busy", "idle"]          # ties keep order
    assert t.stats()["ranked"] == 4


def test_default_local_is_sane():
    t = Topology.default_local(["a", "b", "c", "d"], edges_per_region=2, capacity_bytes=10**9)
    assert len(t.edges) == 8 and t.origin_region == "a" and t.edges_in("c") == ["c-0", "c-1"]
    for r in t.regions:
        assert t.latency_ms(r, r) == 0.2
        for s in t.regions:
            if s != r:
                assert 30 <= t.latency_ms(r, s) <= 80 and t.bandwidth_gbps(r, s) < t.bandwidth_gbps(r, r)
    assert t.latency_ms("a", "d") == 80 and t.latency_ms("a", "b") < t.latency_ms("a", "c")
    e = t.add_edge("b-9", "b", 10**9)
    assert e == Edge("b-9", "b", 10**9 / 2**30) and t.region_of("b-9") == "b"
    with pytest.raises(TopologyError, match="duplicate edge 'b-9'"):
        t.add_edge("b-9", "c", 10**9)
    with pytest.raises(TopologyError, match="unknown region 'zz'"):
        t.add_edge("z-1", "zz", 10**9)


BAD = [
    # (replace this, with this, message parts)
    ('[[links]]\nbetween = ["eu-west", "ap-south"]\nlatency_ms = 60\nbandwidth_gbps = 0.5\n', "",
     ["no link between regions 'ap-south' and 'eu-west'"]),
    ("latency_ms = 40.0", "latency_ms = -40.0", ["links[0].latency_ms", "must be a number >= 0, got -40.0"]),
    ('between = ["us-east", "eu-west"]', 'between = ["us-east", "eu-wset"]',
     ["links[0]", "unknown region 'eu-wset'"]),
    ('{ name = "euw-1", capacity_bytes', '{ name = "use-1", capacity_bytes',
     ["regions.eu-west.edges[0]", "duplicate edge 'use-1'", "regions.us-east"]),
    ("bandwidth_gbps = 12.5", 'bandwidth_gbps = "fast"',
     ["regions.eu-west.bandwidth_gbps", "must be a number > 0, got 'fast'"]),
    ("bandwidth_gbps = 0.5", "bandwidth_gbps = 0", ["links[2].bandwidth_gbps", "must be a number > 0, got 0"]),
    ('origin_region = "us-east"', 'origin_region = "mars"', ["origin_region", "unknown region 'mars'"]),
    ('origin_region = "us-east"', "", ["origin_region is missing"]),
    ("capacity_bytes = 4_000_000_000", "capacity_bytes = 4.5", ["regions.us-east.edges[1].capacity_bytes",
                                                                "must be an int >= 1, got 4.5"]),
    ("capacity_bytes = 4_000_000_000", "capacity = 4", ["regions.us-east.edges[1].capacity_bytes is missing"]),
    ('[regions.eu-west]\nlatency_ms = 0.3\n', "[regions.eu-west]\n", ["regions.eu-west.latency_ms is missing"]),
    ('between = ["us-east", "ap-south"]', 'between = ["us-east", "eu-west"]',
     ["links[1]", "duplicate link between 'us-east' and 'eu-west'"]),
    ('between = ["us-east", "ap-south"]', 'between = ["us-east", "us-east"]',
     ["links[1]", "two different regions"]),
    ("latency_ms = 90.0", "latency_ms = true", ["links[1].latency_ms", "must be a number >= 0, got True"]),
    ("[[links]]", "[[links]\n", ["not valid TOML"]),
    ('origin_region = "us-east"', 'origin_region = "us-east"\nzone = 3', ["unknown top-level key(s) ['zone']"]),
]


@pytest.mark.parametrize("old,new,parts", BAD, ids=[b[2][-1][:40] for b in BAD])
def test_each_bad_file_names_the_problem(tmp_path, old, new, parts):
    assert old in GOOD
    p = write(tmp_path, GOOD.replace(old, new, 1), "bad.toml")
    with pytest.raises(TopologyError) as ei:
        Topology.from_toml(p)
    msg = str(ei.value)
    assert msg.startswith(str(p) + ":"), msg
    for part in parts:
        assert part in msg, msg


def test_unreadable_and_non_table_inputs(tmp_path):
    with pytest.raises(TopologyError, match="missing.toml: cannot read topology file"):
        Topology.from_toml(tmp_path / "missing.toml")
    with pytest.raises(TopologyError, match="<dict>: regions: must be a non-empty table"):
        Topology.from_dict({"origin_region": "a", "regions": {}})
    with pytest.raises(TopologyError, match="<dict>: a topology must be a table, got list"):
        Topology.from_dict([])
    with pytest.raises(TopologyError, match="unknown edge 'nope'"):
        Topology.default_local(["a"]).region_of("nope")
    with pytest.raises(TopologyError, match="unknown region 'x'"):
        Topology.default_local(["a"]).latency_ms("a", "x")


def test_a_device_or_huge_file_is_refused_at_once(tmp_path):
    import time
    t0 = time.monotonic()
    with pytest.raises(TopologyError, match="/dev/zero: not a regular file"):
        Topology.from_toml("/dev/zero")
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * ((1 << 20) + 10))
    with pytest.raises(TopologyError, match="larger than 1048576 bytes"):
        Topology.from_toml(big)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.parametrize("bad", ["a/b", "edge:1", "", " x", "x" * 65])
def test_edge_and_region_names_are_plain_words(bad):
    with pytest.raises(TopologyError, match="letters, digits"):
        Topology.default_local(["us-east"]).add_edge(bad, "us-east", 1 << 20)
    with pytest.raises(TopologyError, match="letters, digits"):
        Topology.from_dict({"origin_region": "us-east",
                            "regions": {"us-east": {"latency_ms": 0.1, "bandwidth_gbps": 1.0, "edges": []},
                                        bad: {"latency_ms": 0.1, "bandwidth_gbps": 1.0, "edges": []}},
                            "links": []})


def test_an_edge_names_its_disk_tier_and_it_round_trips_unread(tmp_path):
    """An edge's own settings (kdn/edge/options.py checks them) are kept as written."""
    text = GOOD.replace('{ name = "use-2", capacity_bytes = 4_000_000_000 }',
                        '{ name = "use-2", capacity_bytes = 4_000_000_000, disk_bytes = 500_000_000_000, '
                        'disk_dir = "/mnt/nvme/kdn" }')
    t = Topology.from_toml(write(tmp_path, text))
    assert t.edge_options("use-2") == {"disk_bytes": 500_000_000_000, "disk_dir": "/mnt/nvme/kdn"}
    assert t.edge_options("use-1") == {}
    again = Topology.from_toml(write(tmp_path, t.to_toml(), "again.toml"))
    assert again.to_dict() == t.to_dict() and again.edge_options("use-2") == t.edge_options("use-2")
