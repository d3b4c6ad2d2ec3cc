"""The launcher (kdn/launch/cluster.py): settings checked before anything starts, a dead recorded
cluster found out at once and cleared, only our own processes stopped, fixed edge ports."""
import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kdn.launch import cluster
from kdn.core.errors import BadRequest, KDNError, NetworkError, TopologyError


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
    ({}, {"edge_disk": "lots"}, BadRequest, "--edge-disk: 'lots' is not a size"),
    ({}, {"edge_disk": "0G"}, BadRequest, "--edge-disk: must be more than 0 bytes"),
    ({}, {"edge_disk_dir": "edge-disk"}, BadRequest, "--edge-disk-dir needs --edge-disk"),
    ({}, {"edge_disk": "1G", "edge_disk_dir": "/proc/kdn"}, BadRequest, "--edge-disk-dir /proc/kdn"),
    ({}, {"origin": "gs://bucket/kdn"}, BadRequest, "only a directory or s3://bucket/prefix"),
    ({}, {"origin": "store-a", "root": "store-b"}, BadRequest, "give the origin's store once"),
    ({}, {"origin": "s3://x/kdn"}, KDNError, "'x' is not a valid bucket name"),
    ({"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"},
     {"origin": "s3://kdn-origin/kdn"}, KDNError, "origin bucket s3://kdn-origin/kdn is not usable"),
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


def test_free_ports_are_distinct_bindable_and_outside_the_kernels_ephemeral_range(monkeypatch):
    """Not where outgoing connections take their local ports (one took an edge's port between
    the draw and the edge's bind), nor Ray's worker ports; a port in use is never given."""
    import socket
    ports = cluster.free_ports(5)
    assert len(set(ports)) == 5
    lo, hi = cluster.FIXED_PORTS
    assert all(lo <= p <= hi and p < cluster.ephemeral_low() for p in ports), ports
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    with socket.socket() as taken:                 # every draw but one is in use: that one is given
        taken.bind(("127.0.0.1", ports[0]))
        draws = iter([[ports[0]] * 15 + [ports[1]]])
        monkeypatch.setattr(cluster.random.SystemRandom, "sample", lambda self, pop, k: next(draws))
        assert cluster.free_ports(1) == [ports[1]]
    low = cluster.ephemeral_low()
    monkeypatch.setattr(cluster, "ephemeral_low", lambda: lo + 10)      # no room below it: the kernel's pick
    assert all(p >= low for p in cluster.free_ports(2))


def test_sizes_read_binary_and_decimal_units():
    assert cluster.parse_size("200G") == 200 * 2**30 and cluster.parse_size("512MiB") == 512 * 2**20
    assert cluster.parse_size("10GB") == 10**10 and cluster.parse_size("1.5T") == int(1.5 * 2**40)
    assert cluster.parse_size("4096") == 4096


def test_wrong_bucket_credentials_are_a_clear_error_at_up(home, monkeypatch):
    """`kdn up --origin s3://...` lists the bucket with the AWS_* variables before it starts
    anything: a wrong secret or a missing bucket names itself (a real S3 server on loopback)."""
    from kdn.testing.s3 import LocalS3
    s3 = LocalS3()
    try:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)
        assert cluster.check_origin(origin=s3.url("kdn")) == (s3.url("kdn"), {"store_env": s3.env})
        before = _ray_heads()
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        with pytest.raises(KDNError, match="origin bucket s3://kdn-origin/kdn is not usable with the "
                                           "endpoint and credentials of AWS_ENDPOINT_URL.*403"):
            cluster.up(origin=s3.url("kdn"))
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.env["AWS_SECRET_ACCESS_KEY"])
        with pytest.raises(KDNError, match="s3://no-such-bucket/kdn"):
            cluster.up(origin="s3://no-such-bucket/kdn")
        assert _ray_heads() == before and not cluster.state_path().exists()
    finally:
        s3.stop()


def test_an_embedded_nodes_object_store_holds_its_regions_edges_below_rays_spilling_point():
    """Edges keep the chunks they hold in their node's object store, and Ray spills to disk
    past 80% of it: `kdn up` and the demo size each node for its region's edges plus chunks
    in flight (an edge of 2 GiB once got a 1 GiB store)."""
    from kdn.placement.topology import Topology
    topo = Topology.default_local(["a", "b"], capacity_bytes=2 << 30)
    got = cluster.object_store_for(topo)
    held = int((2 << 30) * 1.5)                               # KBs, and the conversation tier beside them
    assert held + cluster.IN_FLIGHT_BYTES <= cluster.SPILL_THRESHOLD * got < held + (512 << 20)
    two = Topology.default_local(["a", "b"], edges_per_region=2, capacity_bytes=1 << 30)
    assert cluster.object_store_for(two) == got               # two edges of a region share its node
    assert cluster.object_store_for(Topology.default_local(["a"], capacity_bytes=1 << 20)) == 1 << 30
    huge = Topology.default_local(["a"], capacity_bytes=1 << 50)   # more than the machine: capped
    assert cluster.object_store_for(huge) == max(1 << 30, int(0.3 * psutil.virtual_memory().total))


def test_edges_bigger_than_their_nodes_object_store_are_named_with_the_size_to_give(ray_cluster):
    """On a cluster KDN did not size (`kdn up --address`): one warning per region whose edges'
    memory would spill, naming the region, both sizes and the fix; none where it fits."""
    from kdn.placement.topology import Topology
    regions = ray_cluster.regions                              # 768 MiB object stores
    topo = Topology.default_local(regions, capacity_bytes=64 << 20)
    assert cluster.store_room_warnings(topo) == []
    topo.add_edge(f"{regions[0]}-big", regions[0], 1 << 30)
    lines = cluster.store_room_warnings(topo)
    assert len(lines) == 1 and lines[0].startswith(f"region {regions[0]}: ")
    assert "1.59 GiB in memory" in lines[0] and "0.75 GiB object store" in lines[0]   # 1.0625 GiB x 1.5
    assert "at least 2.30 GiB" in lines[0] and "--object-store-memory" in lines[0]


def test_a_cluster_without_a_log_monitor_starts_none_and_its_workers_still_log_to_files(ray_cluster):
    """LocalCluster(log_monitor=False) (the suite's cluster): no process tails the workers'
    files to forward them (KDN's drivers take none), and those files are still written."""
    import ray
    from ray._private import ray_constants
    head = ray_cluster.cluster.head_node
    assert ray_constants.PROCESS_TYPE_LOG_MONITOR not in head.all_processes
    assert ray_constants.PROCESS_TYPE_RAYLET in head.all_processes        # the node itself runs

    @ray.remote(num_cpus=0)
    def shout():
        import sys
        print("kdn-log-check", file=sys.stderr, flush=True)
        return 1
    assert ray.get(shout.remote(), timeout=60) == 1
    logs = Path(head.get_logs_dir_path())
    assert any("kdn-log-check" in p.read_text(errors="replace") for p in logs.glob("worker-*.err"))


def test_kdn_down_counts_a_killed_process_gone_once_it_is_a_zombie_or_reaped():
    """`kdn down` waits for what it killed to be gone (a raylet frees its store's memory on the
    way out), but not for a zombie nothing reaps (an orphan in a container)."""
    from kdn.launch.cluster import _exiting
    running = subprocess.Popen(["sleep", "30"])
    done = subprocess.Popen(["true"])
    try:
        p = psutil.Process(done.pid)
        deadline = time.monotonic() + 10
        while p.status() != psutil.STATUS_ZOMBIE:          # exited, not reaped yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _exiting(psutil.Process(running.pid)) and not _exiting(p)
        done.wait()
        assert not _exiting(p)                             # reaped: no such process
    finally:
        running.kill()
        running.wait()
