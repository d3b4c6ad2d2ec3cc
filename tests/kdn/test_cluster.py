"""The launcher (kdn/cluster.py): settings checked before anything starts, a dead recorded
cluster found out at once and cleared, only our own processes stopped, fixed edge ports."""
import json
import subprocess
import sys
import time

import psutil
import pytest

from kdn import cluster
from kdn.errors import BadRequest, KDNError, NetworkError, TopologyError


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KDN_HOME", str(tmp_path))
    monkeypatch.delenv("KDN_READ_TOKENS", raising=False)
    return tmp_path


def _ray_heads() -> set:
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "gcs_server"}


@pytest.mark.parametrize("env,kw,error,match", [
    ({"KDN_READ_TOKENS": "a"}, {}, KDNError, "tenant=token"),
    ({"KDN_READ_TOKENS": "a=short"}, {}, KDNError, "at least 16 characters"),
    ({}, {"network": ""}, BadRequest, "network name"),
    ({}, {"network": "a:b"}, BadRequest, "network name"),
    ({}, {"edge_codec": "zstdd"}, BadRequest, "edge store codec"),
    ({}, {"origin_codec": "q8"}, BadRequest, "lossy codec"),
    ({}, {"topology_file": "/dev/zero"}, TopologyError, "not a regular file"),
])
def test_bad_settings_are_refused_before_anything_starts(home, monkeypatch, env, kw, error, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = _ray_heads()
    t0 = time.monotonic()
    with pytest.raises(error, match=match):
        cluster.up(**kw)
    assert time.monotonic() - t0 < 5
    assert _ray_heads() == before                      # no Ray cluster was started
    assert not cluster.state_path().exists()


def _dead_record(home, pids):
    port = cluster.free_ports(1)[0]                   # nothing listens there
    state = {"network": "kdn", "root": str(home / "origin"), "started": 1.0,
             "address": f"127.0.0.1:{port}", "embedded": True, "pids": pids}
    cluster.state_path().write_text(json.dumps(state))
    return state


def test_a_dead_recorded_cluster_is_reported_at_once(home):
    _dead_record(home, [])
    t0 = time.monotonic()
    with pytest.raises(NetworkError, match="is not running .* run `kdn down`"):
        cluster.read_state(require_alive=True)
    assert time.monotonic() - t0 < 3


def test_down_clears_a_dead_record_and_kills_only_our_processes(home):
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recs = cluster.process_records([ours.pid])
        # the stranger's pid is recorded with another start time: a reused pid, not ours
        recs.append([stranger.pid, psutil.Process(stranger.pid).create_time() - 1000])
        _dead_record(home, recs)
        t0 = time.monotonic()
        state = cluster.down()
        assert time.monotonic() - t0 < 10
        assert state["was_dead"] is True
        assert ours.wait(timeout=10) is not None
        assert stranger.poll() is None                  # never touched
        assert not cluster.state_path().exists()
    finally:
        for p in (ours, stranger):
            p.kill()
            p.wait()


def test_a_corrupt_record_is_a_clear_error(home):
    cluster.state_path().write_text("{not json")
    with pytest.raises(NetworkError, match="not a KDN cluster record"):
        cluster.read_state()


def test_free_ports_are_distinct_and_bindable():
    import socket
    ports = cluster.free_ports(5)
    assert len(set(ports)) == 5
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
