"""LMCache's multiprocess servers over KDN, end to end: one stores in a region, another loads in another.

Two `lmcache server` processes (LMCache 0.5.6, CPU), each with KDN as its plugin L2 adapter
(kdn.integrations.lmcache) in its own region: `--store-region` (default us-east) and
`--load-region` (default ap-south), on a three-region KDN network started here
(kdn.launch.cluster.LocalCluster, one edge per region). LMCache's own `lmcache bench server
--mode cpu --transfer-mode lmcache_driven` drives them (LMCache's code sends the requests and
computes the checksums; this module starts the processes and reads what they print):

1. against the storing server: each sequence's cold request stores its KV (LMCache's L1, and
   through the adapter into KDN), its warm request retrieves it; LMCache checks the digests;
2. against the loading server, whose L1 is empty: each cold lookup can only hit through KDN
   (a load from the load region's edge), and the warm request's digest must be the storing
   server's.

Prints each sequence's digests and lookups, LMCache's latencies for both servers, and what the
load region's edge served; exits 1 if any digest differs or any cold lookup of the loading
server missed. (LMCache's own check compares a sequence's cold store with its warm retrieve
in one server: the loading server stores nothing, so it has none; the digests here compare
across the two servers.)
"""
import argparse
import json
import os
import re
import socket
import subprocess
import time
import uuid

from kdn.bench import emit_json, table
from kdn.bench.harness import REGIONS, scratch_dir, stop_process
from kdn.bench.l2 import lmcache_cmd, lmcache_env

_LINE = re.compile(r"\[seq (\d+)/(cold|warm)\] (LOOKUP|CHECKSUM): (.*)")


def start_server(region: str, network: str, address: str, ports: tuple, log_path: str):
    """An `lmcache server` with KDN as its L2 adapter in region; (process, rpc url, http url)."""
    rpc, http = ports
    adapter = {"type": "plugin", "module_path": "kdn.integrations.lmcache", "class_name": "KDNL2Adapter",
               "adapter_params": {"network": network, "region": region, "address": address}}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(lmcache_cmd("server", "--host", "127.0.0.1", "--port", str(rpc),
                                         "--http-host", "127.0.0.1", "--http-port", str(http),
                                         "--l1-size-gb", "1", "--eviction-policy", "LRU",
                                         "--l2-adapter", json.dumps(adapter)),
                                stdout=log, stderr=subprocess.STDOUT, env=lmcache_env())
    return proc, f"tcp://127.0.0.1:{rpc}", f"http://127.0.0.1:{http}"


def wait_listening(proc, port: int, log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lmcache server exited ({proc.returncode}) before it listened:\n"
                             + open(log_path).read()[-3000:])
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"lmcache server did not listen on 127.0.0.1:{port} within {timeout_s:.0f} s")


def run_bench(rpc: str, http: str, args, out_path: str) -> tuple:
    """One `lmcache bench server` run; ({seq: {kind: {"lookup", "checksum"}}}, its JSON metrics)."""
    cmd = lmcache_cmd("bench", "server", "--rpc-url", rpc, "--url", http, "--mode", "cpu",
                   "--transfer-mode", "lmcache_driven", "--num-tokens", str(args.num_tokens),
                   "--start", "0", "--end", str(args.sequences), "--interval", "0.2",
                   "--format", "json", "--output", out_path)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=lmcache_env())
    if done.returncode != 0 or not os.path.exists(out_path):
        raise SystemExit(f"lmcache bench server failed ({done.returncode}):\n{done.stdout[-2000:]}"
                         f"{done.stderr[-2000:]}")
    seqs = {}
    for m in _LINE.finditer(done.stdout + done.stderr):
        seqs.setdefault(int(m.group(1)), {}).setdefault(m.group(2), {})[m.group(3).lower()] = m.group(4).strip()
    with open(out_path) as f:
        return seqs, json.load(f)["metrics"]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench mpserver", description=__doc__.splitlines()[0])
    ap.add_argument("--store-region", default="us-east", choices=REGIONS)
    ap.add_argument("--load-region", default="ap-south", choices=REGIONS)
    ap.add_argument("--sequences", type=int, default=4, help="requests per server (default 4)")
    ap.add_argument("--num-tokens", type=int, default=512, help="tokens per request (default 512)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per LMCache process")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.store_region == args.load_region:
        ap.error("--store-region and --load-region must differ")

    from kdn.client.join import init_ray
    from kdn.client.view import NetworkView
    from kdn.launch.cluster import LocalCluster, free_ports, start_network, teardown
    from kdn.placement.topology import Topology
    work = scratch_dir("kdn-bench-mpserver-")
    cluster, net, procs = None, None, []
    try:
        cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=2 << 30)
        init_ray(cluster.address)
        name = f"mp{uuid.uuid4().hex[:6]}"
        net = start_network(Topology.default_local(list(REGIONS), capacity_bytes=1 << 30),
                            os.path.join(work, name), network=name)
        ports = free_ports(4)
        servers = {}
        for role, region, (rpc, http) in (("store", args.store_region, ports[:2]),
                                          ("load", args.load_region, ports[2:])):
            log_path = os.path.join(work, f"server-{role}.log")
            proc, rpc_url, http_url = start_server(region, name, cluster.address, (rpc, http), log_path)
            procs.append(proc)
            servers[role] = (rpc_url, http_url, http, proc, log_path)
        for rpc_url, http_url, http, proc, log_path in servers.values():
            wait_listening(proc, http, log_path, args.timeout_s)
        stored, m_store = run_bench(*servers["store"][:2], args, os.path.join(work, "store.json"))
        view = NetworkView(name, region=args.load_region)
        edge = view.ranked_edges()[0]                     # the load region's own edge
        before = view.at(edge).stats()["counters"]
        loaded, m_load = run_bench(*servers["load"][:2], args, os.path.join(work, "load.json"))
        after = view.at(edge).stats()["counters"]
    finally:
        for proc in procs:
            stop_process(proc, 20)
        teardown(net, cluster, work)       # the scratch folder too (servers' logs included)

    rows, bad = [], 0
    for seq in range(args.sequences):
        s, ld = stored.get(seq, {}), loaded.get(seq, {})
        digest = s.get("cold", {}).get("checksum", "").split(" ")[0]
        got = ld.get("warm", {}).get("checksum", "").split(" ")[0]
        hit = ld.get("cold", {}).get("lookup", "")
        ok = bool(digest) and digest == got and re.match(r"(\d+)/\1 chunks hit", hit) is not None
        bad += not ok
        rows.append({"sequence": seq, f"stored digest ({args.store_region})": digest,
                     f"loaded digest ({args.load_region})": got, "cold lookup there": hit,
                     "same": "yes" if ok else "NO"})
    print(f"lmcache bench server: {args.sequences} sequences x {args.num_tokens} tokens, stored through "
          f"KDN in {args.store_region}, loaded through KDN in {args.load_region} (its L1 empty)")
    table(rows, list(rows[0]))
    lat = []
    for role, m in (("store", m_store), ("load", m_load)):
        lat.append({"server": f"{role} ({args.store_region if role == 'store' else args.load_region})",
                    "LMCache's cold=warm checks ok": m["results"]["checksum_ok"],
                    **{f"{k} p50 ms": m.get(k, {}).get(f"{k}_p50") for k in
                       ("cold_lookup", "cold_store", "warm_lookup", "warm_retrieve")}})
    print()
    table(lat, list(lat[0]))
    served = {k: after.get(k, 0) - before.get(k, 0) for k in ("fetches", "chunks_served", "bytes_served")}
    print(f"\n{edge} ({args.load_region}) during the loading server's run: {served}")
    print("every digest the same, every cold lookup a hit: " + ("yes" if not bad else f"NO ({bad} sequences)"))
    if args.json:
        emit_json({"bench": "mpserver", "sequences": rows, "servers": lat, "edge": edge, "served": served})
    return 1 if bad else 0
