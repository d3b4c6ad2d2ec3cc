"""An edge's settings from the topology file (kdn/edge/options.py): checked by the edge's
rules, each error naming the file and the edge; the launcher refuses a bad file before
anything starts. The object-store fill's default, from a node's environment."""
import pytest

from kdn.core.errors import BadRequest, TopologyError
from kdn.edge.options import check_edge_options
from kdn.placement.topology import Topology

WHERE = "topo.toml: edge 'use-2'"


@pytest.mark.parametrize("options,parts", [
    ({"disk_bytes": 0}, ["topo.toml: edge 'use-2': disk_bytes", "must be an int >= 1, got 0"]),
    ({"disk_dir": "/d"}, ["disk_dir without disk_bytes"]),
    ({"disk_bytes": 1 << 30, "disk_dir": ""}, ["disk_dir: must be a directory path"]),
    ({"capacity": 4}, ["unknown key(s) ['capacity']", "capacity_bytes"]),
    ({"kv_events": 5601}, ["kv_events: must be an endpoint"]),
    ({"object_store_fill_bytes": -1}, ["object_store_fill_bytes", "must be an int >= 0, got -1"]),
    ({"object_store_fill_bytes": "1G"}, ["object_store_fill_bytes", "must be an int >= 0"]),
    ({"kv_events": {"endpoint": "tcp://127.0.0.1:5601", "colour": 1}}, ["kv_events: unknown setting(s) colour"]),
])
def test_each_bad_setting_names_the_file_the_edge_and_the_problem(options, parts):
    with pytest.raises(TopologyError) as e:
        check_edge_options(options, WHERE)
    assert all(p in str(e.value) for p in parts), str(e.value)


def test_good_settings_come_back_checked():
    got = check_edge_options({"disk_bytes": 1 << 30, "disk_dir": "/mnt/kdn",
                              "kv_events": "tcp://127.0.0.1:5601"}, WHERE)
    assert got["disk_bytes"] == 1 << 30 and got["disk_dir"] == "/mnt/kdn"
    assert got["kv_events"]["endpoint"] == "tcp://127.0.0.1:5601"
    assert check_edge_options({}, WHERE) == {}
    assert check_edge_options({"object_store_fill_bytes": 0}, WHERE) == {"object_store_fill_bytes": 0}


def test_the_launcher_refuses_a_bad_file_before_starting_anything(tmp_path):
    from kdn.launch.cluster import start_network
    t = Topology.default_local(["here"], capacity_bytes=1 << 20).to_dict()
    t["regions"]["here"]["edges"][0]["disk_bytes"] = -1
    topo = Topology.from_dict(t)
    with pytest.raises(TopologyError, match="disk_bytes"):
        start_network(topo, tmp_path / "origin", network="never-started")   # no Ray needed: refused first


def test_the_fill_is_the_edges_own_setting_else_its_nodes_environment_else_its_capacity():
    from kdn.edge.options import FILL_ENV, fill_bytes
    assert fill_bytes(None, 1 << 30, {}) == 1 << 30                          # the default: its capacity
    assert fill_bytes(None, 1 << 30, {FILL_ENV: "0"}) == 0                   # a node's default
    assert fill_bytes(None, 1 << 30, {FILL_ENV: " 268435456 "}) == 256 << 20
    assert fill_bytes(None, 1 << 30, {FILL_ENV: ""}) == 1 << 30              # set but empty: unset
    assert fill_bytes(5, 1 << 30, {FILL_ENV: "0"}) == 5                      # the edge's own wins
    for bad in ("-1", "1G", "0x10", "\u00b2"):
        with pytest.raises(BadRequest, match=f"KDN_OBJECT_STORE_FILL_BYTES must be a whole number.*{bad}"):
            fill_bytes(None, 1 << 30, {FILL_ENV: bad})
    with pytest.raises(BadRequest, match="object_store_fill_bytes"):
        fill_bytes(-1, 1 << 30, {})


def test_a_bad_fill_in_the_launchers_environment_is_refused_before_anything_starts(monkeypatch, tmp_path):
    from kdn.edge.options import FILL_ENV
    from kdn.launch.cluster import start_network
    monkeypatch.setenv(FILL_ENV, "2GiB")
    with pytest.raises(BadRequest, match="KDN_OBJECT_STORE_FILL_BYTES must be a whole number.*2GiB"):
        start_network(Topology.default_local(["us-east"]), tmp_path / "origin", network="nofill")
    assert not (tmp_path / "origin").exists()
