"""`kdn bench hey`: many HTTP clients at once against one edge's POST /v1/fetch, with `hey`.

An edge's HTTP server and its pull-through share one event loop, so what runs on that loop
(hashing, ray.put, file I/O) is a stall every concurrent reader waits through. This bench
shows it as throughput and tail latency under concurrency: a one-node network (origin + one
edge with HTTP) holds a published KB of --chunks chunks (2 MiB each: 256 tokens x 16 layers
x 2 KV heads x head_dim 64, float16), and `hey` (a Go load generator: apt-get install hey)
runs --clients connections for --seconds, three times: every request one chunk (the KB's
first: the loop's own cost per request), every request the whole KB (the bytes), and the
whole KB again from an edge whose memory holds one chunk of it (a second network, one
chunk of memory): every chunk of every answer is then pulled from the origin, verified and
put into the edge's store (concurrent misses share one load), the work a first fetch does.
Beside both whole-KB loads, 2 more clients GET /health, which does nothing but answer on
the edge's event loop: its latency is how long the loop keeps a request waiting (work on
the loop stalls it; work in threads only shares the cores).
Every request's answer is checked by hey only for its status (200); the bytes are checked
once before, by the reader over HTTP (kdn.client.http.HTTPEdges; every frame verified).

Figures: requests/s, and latency p50/p95/p99 as hey gives them (p99 needs 100 requests).
Compare runs of one sitting only (the machine's load changes them): the load average is
printed with them.
"""
import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import xxhash

from kdn.bench import emit_json, table
from kdn.bench.harness import scratch_dir

REGION = "bench"
TENANT, FINGERPRINT = "default", "bench-hey"
LAYERS, HEADS, HEAD_DIM, TOKENS = 16, 2, 64, 256
PROBE_CLIENTS = 2         # clients asking GET /health beside a load
PROBE_AFTER_S = 1.0       # the probe starts this long after the load, and ends as long before


def hey(url: str, body: Path, clients: int, seconds: float) -> dict:
    """hey's summary of --clients connections POSTing body to url (body None: a GET) for seconds."""
    post = [] if body is None else ["-m", "POST", "-T", "application/msgpack", "-D", str(body)]
    out = subprocess.run(["hey", "-z", f"{seconds}s", "-c", str(clients), *post, url],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    # hey prints "0% in 0.0000 secs" for a percentile its requests are too few to give
    lat = {int(q): float(s) * 1e3 for q, s in re.findall(r"\s(\d+)%+ in ([\d.]+) secs", out) if int(q)}
    if 50 not in lat:
        raise RuntimeError(f"hey printed no latency distribution:\n{out}")
    codes = dict(re.findall(r"\[(\d+)\]\s+(\d+) responses", out))
    return {"rps": rps, "p50_ms": lat[50], "p95_ms": lat.get(95), "p99_ms": lat.get(99),
            "ok": int(codes.get("200", 0)), "other": sum(int(n) for c, n in codes.items() if c != "200")}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench hey", description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=8, help="chunks in the KB (2 MiB each)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent HTTP connections")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long each load runs")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if shutil.which("hey") is None:
        ap.error("hey is not installed: apt-get install -y hey (Debian/Ubuntu)")

    from kdn.launch.cluster import LocalCluster, start_network, stop_network, teardown
    from kdn.client.join import init_ray
    from kdn.client import Client
    from kdn.client.http import HTTPEdges
    from kdn.client.reader import Reader
    from kdn.placement.topology import Topology
    import ray

    n_tokens = args.chunks * TOKENS
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((LAYERS, 2, HEADS, n_tokens, HEAD_DIM)).astype(np.float16)
    tokens = rng.integers(0, 49152, n_tokens).tolist()
    tmp = Path(scratch_dir("kdn-bench-hey-"))
    network = f"bench-hey-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster([REGION], cpus=2, object_store_bytes=max(512 << 20, 6 * kv.nbytes))
    rows, res = [], {}
    want = [xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(kv[:, :, :, s:s + TOKENS])).cast("B"))
            for s in range(0, n_tokens, TOKENS)]
    chunk_bytes = kv.nbytes // args.chunks

    def network_with(capacity_bytes: int, name: str):
        """A network whose one edge has capacity_bytes of memory, the KB published: (net, url, manifest)."""
        topo = Topology.default_local([REGION], edges_per_region=1, capacity_bytes=capacity_bytes)
        net = start_network(topo, tmp / name, network=name, http=True, replicas=1)
        (edge,) = net.edges.values()
        url = ray.get(edge.ping.remote())["http"]
        cl = Client(network=name, region=REGION, tenant=TENANT, fingerprint=FINGERPRINT)
        cl.publish("hey", [("blob", tokens)], kv)
        edges = HTTPEdges([url], timeout_s=120)
        f = Reader(edges, TENANT, FINGERPRINT).fetch(tokens)
        if [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in f.chunks] != want:
            raise RuntimeError("HTTP fetch returned other bytes than published")
        edges.close()
        return net, url, cl.manifest("hey")

    def row(name, mib, r, label=None):
        res[name] = r
        rows.append({"request": label or name, "MiB": mib, "req/s": r["rps"], "p50_ms": r["p50_ms"],
                     "p95_ms": r["p95_ms"], "p99_ms": r["p99_ms"] or "-", "200s": r["ok"],
                     "others": r["other"]})

    def load(name, url, m, keys, probe: bool = False):
        """hey on /v1/fetch of keys; with probe, GET /health from PROBE_CLIENTS more clients
        beside it meanwhile: how long the loop keeps a trivial request waiting."""
        body = tmp / f"{len(rows)}.msgpack"
        body.write_bytes(msgpack.packb({"ns": bytes(m.ns), "keys": [bytes(k) for k in keys],
                                        "codec": "raw"}, use_bin_type=True))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            big = pool.submit(hey, url + "/v1/fetch", body, args.clients, args.seconds)
            if probe:
                time.sleep(PROBE_AFTER_S)               # the load is under way
                small = hey(url + "/health", None, PROBE_CLIENTS, args.seconds - 2 * PROBE_AFTER_S)
            row(name, len(keys) * chunk_bytes / 2**20, big.result())
        if probe:
            row(f"{name}: GET /health beside it", 0, small,
                label=f"  GET /health beside it ({PROBE_CLIENTS} clients)")
    net = None
    try:
        init_ray(cluster.address)
        net, url, m = network_with(1 << 30, network)
        load("one chunk", url, m, list(m.keys[:1]))
        load("whole KB", url, m, list(m.keys), probe=True)
        stop_network(net)
        # main holds 3/4 of memory: one chunk of the KB, so every answer pulls the others
        net, url, m = network_with(chunk_bytes * 4 // 3 + 4096, network + "-pulled")
        load("whole KB, pulled", url, m, list(m.keys), probe=True)
    finally:
        teardown(net, cluster, tmp)     # the network that was up, its cluster, the scratch folder
        ray.shutdown()
    load = os.getloadavg()
    table(rows, ["request", "MiB", "req/s", "p50_ms", "p95_ms", "p99_ms", "200s", "others"])
    print(f"{args.clients} clients, {args.seconds:g} s each; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")
    if args.json:
        emit_json({"bench": "hey", "clients": args.clients, "seconds": args.seconds,
                   "chunks": args.chunks, "load": load, "results": res})


if __name__ == "__main__":
    main()
