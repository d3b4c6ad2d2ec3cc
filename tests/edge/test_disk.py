"""The edge's disk tier without Ray: records round-trip verified, an index rebuilt warm from
the directory, torn and corrupt records dropped, eviction deletes files, a full device drops
the write (counted) and never a read."""
import contextlib
import errno
import os
import resource
import signal
import subprocess
import time

import numpy as np
import pytest

from kdn.core.chunk import Encoded, encode_parts
from kdn.edge.disk import SUFFIX, DiskTier
from kdn.core.errors import BadRequest
from kdn.core.files import TEMP_SUFFIX
from kdn.core.keys import namespace_digest

OTHER = namespace_digest("other", "edge-unit")


def _files(d) -> list:
    return sorted(p.name for p in d.rglob("*") if p.is_file())


def test_write_then_read_gives_the_same_bytes_raw_and_compressed(kit, tmp_path):
    a, b = kit.make_chunks(2)
    z = Encoded.of(b, "zstd")
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.write(a) and disk.write(z)
    assert disk.write(a) is True and disk.counters["disk_write_skipped_held"] == 1
    got = disk.read(a.key, kit.NS)
    assert got.equal(a)
    gz = disk.read(b.key)
    assert isinstance(gz, Encoded) and gz.codec == "zstd" and gz.decode().equal(b)
    assert disk.read(a.key, OTHER) is None, "another namespace's reader finds nothing"
    s = disk.stats()
    assert s["items"] == 2 and s["bytes"] == os.path.getsize(disk.path(a.key)) + z.nbytes
    assert s["write_backs"] == 2 and s["hits"] == 2
    assert (os.stat(disk.path(a.key)).st_mode & 0o777) == 0o600


def test_a_restarted_tier_comes_back_warm_and_drops_torn_and_corrupt_records(kit, tmp_path):
    cs = kit.make_chunks(4)
    disk = DiskTier(tmp_path, 1 << 20)
    for c in cs:
        assert disk.write(c)
    torn, corrupt = disk.path(cs[1].key), disk.path(cs[2].key)
    with open(torn, "r+b") as f:                       # a write cut short by a crash
        f.truncate(os.path.getsize(torn) - 100)
    with open(corrupt, "r+b") as f:                    # a flipped bit in the payload
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    leftover = torn.with_name(torn.name + ".1.2.3" + TEMP_SUFFIX)
    leftover.write_bytes(b"half a record")
    again = DiskTier(tmp_path, 1 << 20)
    assert len(again) == 3, "the torn record is not indexed"
    assert not torn.exists() and not leftover.exists()
    assert again.counters["disk_dropped_corrupt"] == 1 and again.counters["disk_temp_removed"] == 1
    assert again.read(cs[0].key, kit.NS).equal(cs[0]) and again.read(cs[3].key).equal(cs[3])
    assert again.read(cs[2].key) is None, "a corrupt payload is found on read, never served"
    assert not corrupt.exists() and cs[2].key not in again
    assert again.counters["disk_dropped_corrupt"] == 2


def test_eviction_deletes_the_victims_file(kit, tmp_path):
    cs = kit.make_chunks(3)
    size = sum(len(part) for part in encode_parts(cs[0]))      # a record is the chunk's frame
    disk = DiskTier(tmp_path, 2 * size + 100, policy="lru")
    for c in cs:
        assert disk.write(c)
    assert cs[0].key not in disk and not disk.path(cs[0].key).exists()
    assert _files(tmp_path) == sorted(c.key.hex() + SUFFIX for c in cs[1:])
    assert disk.counters["disk_evicted"] == 1 and disk.stats()["evictions"] == 1


def test_bad_settings_are_refused_with_the_problem_named(tmp_path):
    with pytest.raises(BadRequest, match=r"edge disk capacity \(bytes\) must be an int >= 1, got 0"):
        DiskTier(tmp_path, 0)
    with pytest.raises(BadRequest, match=r"edge disk capacity \(bytes\) must be an int >= 1, got '1G'"):
        DiskTier(tmp_path, "1G")


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """Writes past nbytes fail with the kernel's EFBIG (SIGXFSZ ignored) while inside."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_write_past_the_file_size_limit_is_dropped_and_counted_and_reads_go_on(kit, tmp_path):
    a, b = kit.make_chunks(2)
    disk = DiskTier(tmp_path, 1 << 20)
    assert disk.write(a)
    with _file_size_limit(1024):                       # the chunks are 128 KiB
        assert disk.write(b) is False
        assert disk.read(a.key).equal(a), "a full disk never costs a read"
    assert disk.counters["disk_full_dropped"] == 1 and disk.stats()["full_dropped"] == 1
    assert b.key not in disk and _files(tmp_path) == [a.key.hex() + SUFFIX], "no temp file left"


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs where this process may mount one (root in a container); else skip."""
    d = tmp_path / "tiny"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield d
    finally:
        # an edge actor stopped by the test lets go of its files when its process exits,
        # a moment after stop_network returns: wait for that, then detach the mount anyway
        for _ in range(50):
            if subprocess.run(["umount", str(d)], capture_output=True).returncode == 0:
                break
            time.sleep(0.2)
        else:
            subprocess.run(["umount", "-l", str(d)], check=True)


def test_a_full_device_drops_the_write_with_enospc_and_reads_go_on(kit, tiny_tmpfs):
    cs = kit.make_chunks(40, tokens=4)                  # 8 KiB each: more than 256 KiB
    disk = DiskTier(tiny_tmpfs, 1 << 30)               # the budget is not what stops it
    kept = [c for c in cs if disk.write(c)]
    assert 0 < len(kept) < len(cs)
    assert disk.counters["disk_full_dropped"] == len(cs) - len(kept)
    assert all(disk.read(c.key).equal(c) for c in kept)
    assert not list(tiny_tmpfs.rglob("*" + TEMP_SUFFIX))
    with pytest.raises(OSError) as e:                  # what the tier saw is the real thing
        (tiny_tmpfs / "probe").write_bytes(b"\0" * (256 << 10))
    assert e.value.errno == errno.ENOSPC


# --- on a real network ------------------------------------------------------------------------
ADMIN = "disk-admin-token-0123456789abcdef"
CHUNK_BYTES = 2 * 2 * 2 * 256 * 8 * 4          # 32 KiB of KV per 256-token chunk


def _network(tmp_path, disk_dir, n_chunks: int, memory_chunks: float = 2.0):
    """One edge (us-east) whose memory holds about one main chunk, its disk under
    disk_dir, and a published KB of n_chunks; returns (net, keys, ns, kv)."""
    import uuid
    from kdn.client import Client
    from kdn.launch.cluster import start_network
    from kdn.placement.topology import Topology
    topo = Topology.default_local(["us-east"], capacity_bytes=int(memory_chunks * CHUNK_BYTES))
    net = start_network(topo, tmp_path / "origin", network=f"disk{uuid.uuid4().hex[:8]}",
                        auth={"admin": ADMIN}, replicas=1,
                        edge_options={"disk_bytes": 64 << 20, "disk_dir": str(disk_dir),
                                      "policy": "lru"})
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 49152, 256 * n_chunks).tolist()
    kv = rng.standard_normal((2, 2, 2, 256 * n_chunks, 8)).astype(np.float32)
    cl = Client(network=net.name, region="us-east", tenant="default", fingerprint="disk-test",
                admin_token=ADMIN)
    cl.publish("kb", [("d", toks)], kv)
    return net, list(cl.manifest("kb").keys), cl.ns, kv


def _edge_call(h, method, *args, **kw):
    import ray
    return ray.get(getattr(h, method).remote(*args, token=ADMIN, **kw), timeout=60)


def _wait_disk(h, want, timeout_s=30.0):
    """The edge's stats once its disk tier holds `want` records (its writer is async)."""
    import time
    t0 = time.monotonic()
    while True:
        s = _edge_call(h, "stats")
        if want(s["disk"]):
            return s
        assert time.monotonic() - t0 < timeout_s, f"disk tier never got there: {s['disk']}"
        time.sleep(0.1)


def test_an_edge_restarted_on_its_disk_comes_back_warm_and_serves_only_verified_bytes(
        ray_cluster, tmp_path):
    import time
    import ray
    from kdn.launch.cluster import stop_network
    net, keys, ns, kv = _network(tmp_path, tmp_path / "edges", n_chunks=6)
    try:
        h = net.edge("us-east-0")
        s = _wait_disk(h, lambda d: d["items"] == 5 and d["write_back_queued"] == 0)
        assert s["disk"]["write_backs"] == 5 and s["main"]["items"] == 1, "one fits in memory"
        files = sorted((tmp_path / "edges" / "us-east-0").rglob("*" + SUFFIX))
        assert len(files) == s["disk"]["items"]
        on_disk = {bytes.fromhex(p.name[:-len(SUFFIX)]): p for p in files}
        torn, corrupt = [k for k in keys if k in on_disk][-2:]
        with open(on_disk[torn], "r+b") as f:
            f.truncate(100)
        with open(on_disk[corrupt], "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0x40]))
        ray.kill(net.origin, no_restart=True)           # from now on only the edge can answer
        pid = _edge_call(h, "ping")["pid"]
        ray.kill(h, no_restart=False)                   # Ray restarts it on the same node
        t0 = time.monotonic()
        while True:
            try:
                if _edge_call(h, "ping")["pid"] != pid:
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass
            assert time.monotonic() - t0 < 60, "the edge did not come back"
            time.sleep(0.3)
        s = _edge_call(h, "stats")
        assert s["main"]["items"] == 0 and s["disk"]["items"] == len(files) - 1, "torn record dropped"
        served = 0
        for i, k in enumerate(keys):
            reply = _edge_call(h, "fetch", [k], ns, resolve=True)
            got = reply["chunks"]
            if k in on_disk and k not in (torn, corrupt):
                expect = kv[:, :, :, 256 * i:256 * (i + 1), :]
                assert len(got) == 1 and np.array_equal(got[0].kv, expect), f"chunk {i}"
                assert reply["sources"] == ["disk"], "a disk hit is named as one"
                served, from_disk = served + 1, k
            else:
                assert got == [], f"chunk {i}: not on disk, or bad there, and the origin is down"
        c = _edge_call(h, "stats")["counters"]
        assert served == len(files) - 2 and c["disk_hits"] == c["served_disk"] == served
        again = _edge_call(h, "fetch", [from_disk], ns, resolve=True)   # promoted to memory by its read
        assert again["sources"] == ["local"] and "served_local" not in c
        assert c["disk_dropped_corrupt"] == 2 and not on_disk[corrupt].exists()
    finally:
        stop_network(net)


def test_a_full_disk_drops_write_backs_counted_and_every_read_is_served(ray_cluster, tiny_tmpfs,
                                                                       tmp_path):
    from kdn.launch.cluster import stop_network
    net, keys, ns, kv = _network(tmp_path, tiny_tmpfs, n_chunks=16)   # 512 KiB > 256 KiB
    try:
        h = net.edge("us-east-0")
        s = _wait_disk(h, lambda d: d["full_dropped"] > 0 and d["write_back_queued"] == 0)
        assert 0 < s["disk"]["items"] < 16 and s["background_failure"] is None
        got = _edge_call(h, "fetch", keys, ns, resolve=True)["chunks"]
        assert len(got) == 16
        assert np.array_equal(np.concatenate([c.kv for c in got], axis=3), kv)
        m = _edge_call(h, "stats")["counters"]
        assert m["disk_full_dropped"] >= 1 and m.get("background_errors", 0) == 0
    finally:
        stop_network(net)
