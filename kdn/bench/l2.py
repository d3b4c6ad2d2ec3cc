"""LMCache's own L2 bench (`lmcache bench l2`) on KDN beside LMCache's fs and resp adapters.

One run, one table: KDN read from a warm edge on the reader's node (`kdn-local`), KDN read
from another region's edge on another Ray node (`kdn-remote`), LMCache's `fs` adapter over a
temp directory (the page cache) and its `resp` adapter over a `redis-server` started here on
127.0.0.1. Each row is one `lmcache bench l2 ... --no-skip-verify --format json` process
(LMCache's code measures; this module only starts servers and reads its JSON): load GB/s,
p99 load latency (of one round of --num-keys objects), store GB/s, all keys verified.

The KDN network: three regions on this machine (kdn.launch.cluster.LocalCluster), one edge each,
every key on every edge (replicas = 3, so the reader's edge is warm once stores are pushed),
memory enough for the whole run. Nothing enforces the topology's WAN on loopback, so the
table gives the modelled floor of a cross-region load (bytes / link bandwidth + one-way
latency, kdn.placement.topology.default_local) beside the measured row.
"""
import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from kdn.bench import emit_json, table

REGIONS = ("us-east", "eu-west", "ap-south")
READER, REMOTE = "us-east", "eu-west"      # the bench process runs on the head node: us-east


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(workdir: str):
    """A redis-server on 127.0.0.1 (no persistence); (process, port). FileNotFoundError if absent."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"redis-server did not answer on 127.0.0.1:{port} within 10 s")


def lmcache_bench(adapter: dict, args, out_path: str) -> dict:
    """One `lmcache bench l2` process; its JSON metrics."""
    # LMCache's CLI module run by this interpreter: its console script's shebang may name
    # another environment's Python (a copied venv), which would bench that one's kdn
    cmd = [sys.executable, "-m", "lmcache.cli.main", "bench", "l2", "--l2-adapter", json.dumps(adapter), "--num-keys", str(args.num_keys),
           "--data-size-kb", str(args.data_size_kb), "--rounds", str(args.rounds),
           "--no-skip-verify", "--format", "json", "--output", out_path, "-q"]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
    if done.returncode != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"lmcache bench l2 failed ({done.returncode}):\n{done.stderr[-2000:]}")
    with open(out_path) as f:
        return json.load(f)["metrics"]


def row(name: str, metrics: dict, note: str = "") -> dict:
    ops = {m["operation"]: m for k, m in metrics.items() if k.startswith("op_")}
    load, store = ops["Load"], ops["Store"]
    return {"adapter": name,
            "load GB/s": load["throughput_avg_mbps"] / 1e3,
            "load p99 ms": load["duration_p99_ms"],
            "store GB/s": store["throughput_avg_mbps"] / 1e3,
            "verified": f"{load['total_success']}/{load['total_keys']}",
            "note": note}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench l2", description=__doc__.splitlines()[0])
    ap.add_argument("--num-keys", type=int, default=32, help="objects per round (default 32)")
    ap.add_argument("--data-size-kb", type=int, default=8192, help="KiB per object (default 8192)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only these rows (kdn-local kdn-remote fs resp)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per lmcache bench process")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    want = args.only or ["kdn-local", "kdn-remote", "fs", "resp"]
    run_bytes = (args.rounds + 1) * args.num_keys * args.data_size_kb * 1024   # + a warmup round

    from kdn.client.join import init_ray
    from kdn.launch.cluster import LocalCluster, start_network, stop_network
    from kdn.placement.topology import Topology
    work = tempfile.mkdtemp(prefix="kdn-bench-l2-")
    rows, cluster, net, redis = [], None, None, None
    try:
        # every edge holds the whole run (replicas = 3); each node's object store that and a
        # round in flight
        # (an edge's main tier is 75% of its capacity)
        topo = Topology.default_local(list(REGIONS), capacity_bytes=int(1.6 * run_bytes))
        if any(n.startswith("kdn") for n in want):
            cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=int(1.5 * run_bytes) + (512 << 20))
            init_ray(cluster.address)
            name = f"l2{uuid.uuid4().hex[:6]}"
            net = start_network(topo, os.path.join(work, name), network=name, replicas=len(REGIONS))
        round_bytes = args.num_keys * args.data_size_kb * 1024
        wan_s = round_bytes / (topo.bandwidth_gbps(READER, REMOTE) * 1e9) + topo.latency_ms(READER, REMOTE) / 1e3
        for which in want:
            out = os.path.join(work, f"{which}.json")
            if which.startswith("kdn"):
                region = READER if which == "kdn-local" else REMOTE
                adapter = {"type": "plugin", "module_path": "kdn.engines.lmcache",
                           "class_name": "KDNL2Adapter",
                           "adapter_params": {"network": net.name, "region": region,
                                              "address": cluster.address,
                                              "tenant": which}}      # each row stores anew
                note = ("edge on the reader's node" if which == "kdn-local" else
                        f"{REMOTE}'s edge, another node; modelled WAN floor "
                        f"{round_bytes / wan_s / 1e9:.2f} GB/s, {wan_s * 1e3:.0f} ms a round")
            elif which == "fs":
                adapter = {"type": "fs", "base_path": os.path.join(work, "fs")}
                os.makedirs(adapter["base_path"])
                note = "page cache (tmp dir)"
            elif which == "resp":
                try:
                    redis, port = start_redis(work)
                except FileNotFoundError as e:
                    rows.append({"adapter": "resp", "note": f"skipped: {e}"})
                    continue
                adapter = {"type": "resp", "host": "127.0.0.1", "port": port}
                note = "redis-server on 127.0.0.1"
            else:
                raise SystemExit(f"unknown row {which!r}")
            rows.append(row(which, lmcache_bench(adapter, args, out), note))
            if redis is not None:
                redis.terminate()
                redis.wait(10)
                redis = None
    finally:
        if redis is not None:
            redis.kill()
        if net is not None:
            stop_network(net)
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    print(f"lmcache bench l2: {args.num_keys} keys x {args.data_size_kb} KiB a round, "
          f"{args.rounds} rounds (+1 warmup), --no-skip-verify")
    table(rows, ["adapter", "load GB/s", "load p99 ms", "store GB/s", "verified", "note"])
    if args.json:
        emit_json({"bench": "l2", "rows": rows})
    return 0


if __name__ == "__main__":
    main()
