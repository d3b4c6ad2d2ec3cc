"""`kdn bench fetch`: KV fetch through the network against a plain `ray.get` of the same bytes.

It builds its own two-node Ray cluster on loopback (LocalCluster: regions "near" and "far",
never an existing cluster), starts a network with one edge per node (near-0, far-0; the
origin on the near node), publishes a synthetic 64 MiB prefix and checks that both edges hold
every chunk in memory (with 2 edges and 2 replicas each owns all of it; otherwise the KB is
warmed into the region). A worker actor on the near node (label_selector region=near) then
measures, in one run and interleaved rep by rep so machine noise hits both sides alike:

- same node: Client.fetch(tokens) — the worker's region, read from its node's label, makes
  near-0 its nearest edge — against ray.get of a trivial actor on the near node that holds
  the same chunk arrays and returns them;
- cross node: Client(region="far").fetch(tokens) from the same near-node worker — the client
  ranks far-0 first, so the chunks cross from the far node's object store (the far edge gets
  fresh objects before every rep, untimed, so no copy from an earlier rep is reused) — against the same
  trivial actor placed on the far node;
- with --hosts, each region is a host of its own (kdn/testing/netns.py: the far node in a
  network namespace on a bridge, its own address, a tc cap with --cap), and the bare TCP
  socket from the far host to the worker is timed in every rep beside the fetches (one
  transfer of the same bytes, the same worker), the link's ceiling for one connection. The
  edges then serve HTTP on their host's address (with tokens), so the
  cross-node fetch takes the reader's default data plane, far-0's HTTP frames
  (kdn.client.dataplane), and a third path reads the same over Ray (data_plane "ray"),
  interleaved with the others;
- one-chunk latency: Client.fetch of the first 256 tokens from near-0, p50/p99 over many
  calls, next to ray.get of one chunk array from the near trivial actor; and the same for a
  one-layer chunk (a second, tiny KB), which shows the fixed cost of a call when few bytes move.

Both sides return numpy arrays through Ray's object store, so the ratios say what the edge
adds (key computation, manifest match, tier lookup, Chunk objects, checks) on top of the
transport every Ray program pays. Every fetched byte is compared with the trivial actor's
copy once. The default KV shape is SmolLM2-135M's (30 layers, 3 KV heads, head_dim 64, fp32:
45 KiB per token), so 64 MiB is 1456 tokens in six chunks of 256 (the last 176).
"""
import argparse
import sys
import time
import uuid

import numpy as np

from kdn.bench import emit_json, median, p, table
from kdn.bench.harness import add_own_cores, check_host_flags, scratch_dir
from kdn.core.errors import BadRequest, NetworkError
from kdn.core.keys import CHUNK_TOKENS

REGIONS = ("near", "far")
FINGERPRINT = "bench-fetch-synthetic"
KB = "bench-fetch"
TARGET_RATIO = 0.8
TARGET_P50_MS = 2.0
DTYPES = {"float32": np.float32, "float16": np.float16}


class PlainHolder:
    """The baseline: holds the chunk arrays in its own memory and returns them, nothing else."""

    def __init__(self, arrays, small):
        self.arrays = [np.array(a, copy=True) for a in arrays]
        self.small_array = np.array(small, copy=True)

    def node(self):
        import ray
        return ray.get_runtime_context().get_node_labels().get("region")

    def all(self):
        return self.arrays

    def one(self, i):
        return self.arrays[i]

    def small(self):
        return self.small_array


class FetchWorker:
    """Runs every measurement from one process on the near node."""

    def __init__(self, network: str, tokens: list, small_tokens: list, plain: dict, hosts: bool = False,
                 admin: str = None):
        from kdn.client import Client
        self.tokens, self.small_tokens = tokens, small_tokens
        self.plain = plain                     # region -> PlainHolder handle
        self.admin = admin                     # the network's admin token (--hosts), or None: open
        self.near = Client(network=network, fingerprint=FINGERPRINT, admin_token=admin)
        self.far = Client(network=network, region="far", fingerprint=FINGERPRINT, admin_token=admin)
        # between hosts, far reads far-0's HTTP frames (the reader's default data plane:
        # kdn.client.dataplane); far_ray reads it over Ray, as every read did before
        self.far_ray = Client(network=network, region="far", fingerprint=FINGERPRINT, admin_token=admin,
                              data_plane="ray") if hosts else None

    def where(self):
        from kdn.client.view import node_region
        return {"node_region": node_region(), "near_client": self.near.region,
                "far_client": self.far.region}

    def check(self, n_bytes: int) -> dict:
        """Fetch through both edges once; every byte must equal the plain copy."""
        import ray
        ref = ray.get(self.plain["near"].all.remote())
        out = {}
        for name, client in (("same_node", self.near), ("cross_node", self.far)):
            f = client.fetch(self.tokens)
            got = [c.kv for c in f.chunks]
            out[name] = {"edge": f.edge, "sources": f.source_counts(), "tokens": f.tokens,
                         "nbytes": f.nbytes,
                         "equal": f.nbytes == n_bytes and len(got) == len(ref)
                         and all(np.array_equal(a, b) for a, b in zip(got, ref))}
        return out

    def throughput(self, reps: int, link=None) -> dict:
        """Seconds per whole-prefix transfer, four paths interleaved rep by rep (after a warmup).
        link (--hosts): SocketLink's arguments (nbytes, piece, host, prefix): one bare-socket
        transfer from the far host is timed in each rep too ("socket": the link's ceiling in
        the same minute as the fetches beside it)."""
        from kdn.bench.transport import SocketLink
        beside = None if link is None else SocketLink(*link[:2], host=link[2], prefix=link[3])
        try:
            return self._throughput(reps, beside)
        finally:
            if beside is not None:
                beside.close()

    def _throughput(self, reps: int, beside) -> dict:
        import ray
        paths = {
            "same_node_fetch": lambda: self.near.fetch(self.tokens).nbytes,
            "same_node_plain": lambda: sum(a.nbytes for a in ray.get(self.plain["near"].all.remote())),
            "cross_node_fetch": lambda: self.far.fetch(self.tokens).nbytes,
            "cross_node_plain": lambda: sum(a.nbytes for a in ray.get(self.plain["far"].all.remote())),
        }
        if self.far_ray is not None:
            paths["cross_node_fetch_ray"] = lambda: self.far_ray.fetch(self.tokens).nbytes
        if beside is not None:
            def socket():
                beside.one()
                return beside.nbytes
            paths["socket"] = socket
        times = {k: [] for k in paths}
        nbytes = {}
        far_edge = ray.get_actor(f"{self.far.network}:edge:far-0", namespace="kdn")
        keys = list(self.far.manifest(KB).keys)
        for rep in range(reps + 1):
            for name, fn in paths.items():
                if name.startswith("cross_node_fetch"):
                    # Fresh objects on the far node each rep (untimed): otherwise Ray serves the
                    # copy the previous rep left on this node, and nothing crosses nodes.
                    ray.get(far_edge.drop.remote(keys, token=self.admin))
                    self.far.warm(KB, "far")
                t0 = time.perf_counter()
                nbytes[name] = fn()
                dt = time.perf_counter() - t0
                if rep:                      # rep 0 is the warmup
                    times[name].append(dt)
        return {"seconds": times, "nbytes": nbytes,
                "over_http": self.far.stats()["data_plane"].get("http_fetches", 0)}

    def latency(self, calls: int, small: bool = False) -> dict:
        """Milliseconds per one-chunk fetch from the same-node edge, and per plain one-chunk get.

        small=False: the first chunk of the 64 MiB prefix; small=True: the one-layer chunk.
        """
        import ray
        first = self.small_tokens if small else self.tokens[:CHUNK_TOKENS]
        holder = self.plain["near"]
        plain = holder.small.remote if small else (lambda: holder.one.remote(0))
        fetch_ms, plain_ms, keys_ms = [], [], []
        self.near.fetch(first)
        ray.get(plain())
        for _ in range(calls):
            t0 = time.perf_counter()
            f = self.near.fetch(first)
            fetch_ms.append((time.perf_counter() - t0) * 1e3)
            if len(f.chunks) != 1 or f.edge != "near-0" or f.sources != ["local"]:
                raise NetworkError(f"one-chunk fetch got {len(f.chunks)} chunks from {f.edge}: {f.sources}")
            t0 = time.perf_counter()
            ray.get(plain())
            plain_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            self.near.keys_for(first)
            keys_ms.append((time.perf_counter() - t0) * 1e3)
        return {"fetch_ms": fetch_ms, "plain_ms": plain_ms, "keys_ms": keys_ms,
                "chunk_bytes": f.nbytes}


def synthetic(mib: float, layers: int, heads: int, head_dim: int, dtype: str, seed: int = 0):
    """(tokens, kv[layers, 2, heads, T, head_dim]) with T the most tokens that fit in mib MiB."""
    per_token = layers * 2 * heads * head_dim * np.dtype(DTYPES[dtype]).itemsize
    n = int(mib * (1 << 20)) // per_token
    if n < 1:
        raise BadRequest(f"kdn bench fetch: {mib} MiB holds no token of {per_token} bytes")
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 49152, n).tolist()
    kv = rng.standard_normal((layers, 2, heads, n, head_dim), dtype=np.float32).astype(DTYPES[dtype])
    return tokens, kv


def chunk_arrays(kv, chunk_tokens=CHUNK_TOKENS):
    n = kv.shape[3]
    return [np.ascontiguousarray(kv[:, :, :, s:min(s + chunk_tokens, n)]) for s in range(0, n, chunk_tokens)]


def ensure_everywhere(client, net, kb, keys, log, admin=None) -> dict:
    """Make both edges hold every chunk of kb (warm it into a region whose edge lacks some)."""
    import ray
    held = {}
    for region in REGIONS:
        edge = net.edge(f"{region}-0")
        have = ray.get(edge.have.remote(keys, token=admin))
        if not all(have):
            log(f"  {region}-0 holds {sum(have)}/{len(keys)} chunks: warming {kb} into {region}")
            client.warm(kb, region)
            have = ray.get(edge.have.remote(keys, token=admin))
        if not all(have):
            raise NetworkError(f"edge {region}-0 still lacks {have.count(False)} of {len(keys)} chunks")
        st = ray.get(edge.stats.remote(token=admin))
        held[region] = {"main": st["main"]["items"], "hot": st["hot_copies"]}
    return held


def run(args, log) -> dict:
    import ray
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.placement.topology import Topology

    tokens, kv = synthetic(args.mib, args.layers, args.heads, args.head_dim, args.dtype)
    arrays = chunk_arrays(kv)
    # A one-layer chunk of the same heads: what a one-chunk fetch costs when bytes are few.
    per_layer_chunk = 2 * args.heads * CHUNK_TOKENS * args.head_dim * np.dtype(DTYPES[args.dtype]).itemsize
    small_tokens, small_kv = synthetic(per_layer_chunk / 2**20, 1, args.heads, args.head_dim, args.dtype, seed=1)
    total = sum(a.nbytes for a in arrays)
    log(f"KV {args.layers}x2x{args.heads}x{len(tokens)}x{args.head_dim} {args.dtype}: "
        f"{total / 2**20:.2f} MiB in {len(arrays)} chunks")
    cluster = net = None
    actors = []
    root = scratch_dir("kdn-bench-fetch-")
    try:
        t0 = time.perf_counter()
        if args.hosts:       # each region a host of its own: the far one in a network namespace
            from kdn.testing.netns import HostCluster
            cluster = HostCluster(REGIONS, cpus=2, object_store_bytes=args.object_store_mib << 20,
                                  cores="own" if args.own_cores else None)
            if args.cap:
                cluster.hosts.cap("far", args.cap)
        else:
            cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=args.object_store_mib << 20)
            init_ray(cluster.address)
        topo = Topology.default_local(list(REGIONS))        # edges near-0, far-0; origin in near
        name = f"bench-fetch-{uuid.uuid4().hex[:6]}"
        admin = None
        if args.hosts:      # edges serve HTTP on their host's address: that needs tokens
            import secrets
            admin = secrets.token_urlsafe(24)
            net = start_network(topo, root, network=name, http=True, edge_options={"http_host": "node"},
                                auth={"admin": admin, "readers": {"default": "*"}})
        else:
            net = start_network(topo, root, network=name)
        log(f"cluster + network up in {time.perf_counter() - t0:.1f} s")
        client = Client(network=name, region="near", fingerprint=FINGERPRINT, admin_token=admin)
        t0 = time.perf_counter()
        receipt = client.publish(KB, [("synthetic", tokens)], kv)
        client.publish(KB + "-small", [("synthetic-small", small_tokens)], small_kv)
        keys = list(client.manifest(KB).keys)
        held = ensure_everywhere(client, net, KB, keys, log, admin)
        ensure_everywhere(client, net, KB + "-small", list(client.manifest(KB + "-small").keys), log, admin)
        log(f"published {receipt['chunks']} chunks in {time.perf_counter() - t0:.1f} s; "
            f"placement {receipt['placement']}")

        holder = ray.remote(PlainHolder)
        ref, small_ref = ray.put(arrays), ray.put(small_kv)
        plain = {r: holder.options(num_cpus=0, label_selector={"region": r}).remote(ref, small_ref)
                 for r in REGIONS}
        actors += list(plain.values())
        where = ray.get([plain[r].node.remote() for r in REGIONS])
        worker = ray.remote(FetchWorker).options(num_cpus=1, label_selector={"region": "near"}) \
            .remote(name, tokens, small_tokens, plain, bool(args.hosts), admin)
        actors.append(worker)
        placed = ray.get(worker.where.remote())
        if placed["node_region"] != "near" or where != list(REGIONS):
            raise NetworkError(f"actors not where asked: worker {placed}, plain holders {where}")
        check = ray.get(worker.check.remote(total))
        for path, c in check.items():
            if not c["equal"]:
                raise NetworkError(f"{path}: fetched bytes differ from the published KV: {c}")
        log(f"checked: {check}")

        edge = net.edge("near-0")
        link = None
        if args.hosts:      # the link's ceiling, one bare-TCP transfer from the far host each rep
            link = (total, arrays[0].nbytes, cluster.address_of("far"), cluster.command("far", []))
        tp = ray.get(worker.throughput.remote(args.reps, link))
        mid = ray.get(edge.stats.remote(token=admin))["counters"]
        lat = ray.get(worker.latency.remote(args.calls))
        after = ray.get(edge.stats.remote(token=admin))["counters"]
        small = ray.get(worker.latency.remote(args.calls, small=True))
        fetches = after.get("fetches", 0) - mid.get("fetches", 0)
        edge_us = (after.get("fetch_us", 0) - mid.get("fetch_us", 0)) / max(1, fetches)
        socket_s = tp["seconds"].pop("socket", None)
        return dict(total=total, n_chunks=len(arrays), n_tokens=len(tokens), held=held,
                    check=check, tp=tp, lat=lat, small=small, edge_us_mean=edge_us,
                    socket_s=socket_s, hosts=None if not args.hosts else
                    {r: cluster.address_of(r) for r in REGIONS})
    finally:
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
        teardown(net, cluster, root)


def summarize(r: dict, args) -> dict:
    sec = r["tp"]["seconds"]
    gbps = {k: r["total"] / 1e9 / median(v) for k, v in sec.items()}
    lat = r["lat"]
    out = {
        "bytes": r["total"], "chunks": r["n_chunks"], "tokens": r["n_tokens"],
        "chunk_bytes": lat["chunk_bytes"], "reps": args.reps, "calls": args.calls,
        "shape": [args.layers, 2, args.heads, r["n_tokens"], args.head_dim], "dtype": args.dtype,
        "same_node_gbps": gbps["same_node_fetch"], "same_node_plain_gbps": gbps["same_node_plain"],
        "same_node_ratio": gbps["same_node_fetch"] / gbps["same_node_plain"],
        "cross_node_gbps": gbps["cross_node_fetch"], "cross_node_plain_gbps": gbps["cross_node_plain"],
        "cross_node_ratio": gbps["cross_node_fetch"] / gbps["cross_node_plain"],
        "one_chunk_p50_ms": p(lat["fetch_ms"], 50), "one_chunk_p99_ms": p(lat["fetch_ms"], 99),
        "one_chunk_plain_p50_ms": p(lat["plain_ms"], 50), "one_chunk_plain_p99_ms": p(lat["plain_ms"], 99),
        "keys_for_p50_ms": p(lat["keys_ms"], 50),
        "small_chunk_bytes": r["small"]["chunk_bytes"],
        "small_chunk_p50_ms": p(r["small"]["fetch_ms"], 50), "small_chunk_p99_ms": p(r["small"]["fetch_ms"], 99),
        "small_chunk_plain_p50_ms": p(r["small"]["plain_ms"], 50),
        "small_chunk_plain_p99_ms": p(r["small"]["plain_ms"], 99),
        "edge_handler_mean_ms": r["edge_us_mean"] / 1e3,
        "held": r["held"],
        "rep_ms": {k: [round(x * 1e3, 2) for x in v] for k, v in sec.items()},
        "hosts": r["hosts"], "cap": args.cap,
    }
    if "cross_node_fetch_ray" in gbps:
        out["cross_node_ray_gbps"] = gbps["cross_node_fetch_ray"]
        out["cross_node_fetches_over_http"] = r["tp"]["over_http"]
        if out["cross_node_fetches_over_http"] < args.reps + 1:
            raise NetworkError(f"only {out['cross_node_fetches_over_http']} cross-node fetches went over "
                               f"HTTP frames: the row would be mislabelled")
    if r["socket_s"]:
        out["socket_gbps"] = r["total"] / 1e9 / median(r["socket_s"])
        out["cross_node_over_socket"] = out["cross_node_gbps"] / out["socket_gbps"]
        out["cross_node_ray_over_socket"] = out["cross_node_ray_gbps"] / out["socket_gbps"]
        out["cross_node_plain_over_socket"] = out["cross_node_plain_gbps"] / out["socket_gbps"]
    if args.cap:
        from kdn.bench.transport import link_rate
        out["cap_gbps"] = link_rate(args.cap) / 1e9
        out["cross_node_over_cap"] = out["cross_node_gbps"] / out["cap_gbps"]
        out["cross_node_ray_over_cap"] = out["cross_node_ray_gbps"] / out["cap_gbps"]
    out["targets_met"] = {"same_node_ratio": out["same_node_ratio"] >= TARGET_RATIO,
                          "cross_node_ratio": out["cross_node_ratio"] >= TARGET_RATIO,
                          "one_chunk_p50_ms": out["one_chunk_p50_ms"] <= TARGET_P50_MS}
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench fetch", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=64.0, help="size of the published prefix (MiB)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=3, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--reps", type=int, default=7, help="whole-prefix transfers per path (>= 5)")
    ap.add_argument("--calls", type=int, default=200, help="one-chunk fetches for the latency")
    ap.add_argument("--object-store-mib", type=int, default=1024, help="per Ray node")
    ap.add_argument("--hosts", action="store_true",
                    help="each region a host of its own (network namespaces on a bridge, root "
                         "needed), with the bare-socket ceiling between the same two hosts")
    ap.add_argument("--cap", default=None, metavar="RATE",
                    help="with --hosts: cap the far host's link with tc (e.g. 2gbit, 800mbit)")
    add_own_cores(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error(f"--reps must be >= 5 (a median of fewer is noise), got {args.reps}")
    check_host_flags(ap, args, REGIONS)
    if args.cap is not None:
        from kdn.bench.transport import link_rate
        try:
            link_rate(args.cap)
        except ValueError as e:
            ap.error(str(e))
    if args.hosts:
        from kdn.testing.netns import available
        why = available()
        if why:
            ap.error(f"--hosts: {why}")

    def log(msg):
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    s = summarize(run(args, log), args)
    mib = s["bytes"] / 2**20
    rows = [
        {"path": "same node (near-0)", "MiB": mib, "fetch GB/s": s["same_node_gbps"],
         "plain ray.get GB/s": s["same_node_plain_gbps"], "ratio": s["same_node_ratio"],
         "target": f">= {TARGET_RATIO}", "met": s["targets_met"]["same_node_ratio"]},
        {"path": "cross node (far-0)" + (", HTTP frames (default)" if args.hosts else ""), "MiB": mib,
         "fetch GB/s": s["cross_node_gbps"],
         "plain ray.get GB/s": s["cross_node_plain_gbps"], "ratio": s["cross_node_ratio"],
         "target": f">= {TARGET_RATIO}", "met": s["targets_met"]["cross_node_ratio"]}]
    if "cross_node_ray_gbps" in s:
        rows.append({"path": "cross node (far-0), over Ray", "MiB": mib, "fetch GB/s": s["cross_node_ray_gbps"],
                     "plain ray.get GB/s": s["cross_node_plain_gbps"],
                     "ratio": s["cross_node_ray_gbps"] / s["cross_node_plain_gbps"], "target": "", "met": ""})
    table(rows)
    print()
    table([
        {"one chunk, same node": f"model chunk {s['chunk_bytes'] / 2**20:.2f} MiB", "calls": s["calls"],
         "fetch p50 ms": s["one_chunk_p50_ms"], "fetch p99 ms": s["one_chunk_p99_ms"],
         "plain p50 ms": s["one_chunk_plain_p50_ms"], "plain p99 ms": s["one_chunk_plain_p99_ms"],
         "target": f"p50 <= {TARGET_P50_MS}", "met": s["targets_met"]["one_chunk_p50_ms"]},
        {"one chunk, same node": f"1-layer chunk {s['small_chunk_bytes'] / 2**10:.0f} KiB",
         "calls": s["calls"],
         "fetch p50 ms": s["small_chunk_p50_ms"], "fetch p99 ms": s["small_chunk_p99_ms"],
         "plain p50 ms": s["small_chunk_plain_p50_ms"], "plain p99 ms": s["small_chunk_plain_p99_ms"],
         "target": "(overhead floor)", "met": ""},
    ])
    if "socket_gbps" in s:
        print(f"between hosts {s['hosts']['near']} (the worker) and {s['hosts']['far']} (far-0)"
              + (f", the far link capped at {args.cap}" if args.cap else "") +
              f": bare TCP socket {s['socket_gbps']:.3f} GB/s; cross-node fetch "
              f"{s['cross_node_over_socket']:.2f}x of it ({s['cross_node_fetches_over_http']} fetches over "
              f"HTTP frames), over Ray {s['cross_node_ray_over_socket']:.2f}x, plain ray.get "
              f"{s['cross_node_plain_over_socket']:.2f}x"
              + (f"; fetch {s['cross_node_over_cap']:.2f}x the cap, over Ray "
                 f"{s['cross_node_ray_over_cap']:.2f}x" if args.cap else ""))
    print(f"model-chunk fetch breakdown: keys_for p50 {s['keys_for_p50_ms']:.3f} ms in the client, "
          f"EdgeNode.fetch {s['edge_handler_mean_ms']:.3f} ms mean in the edge; the rest is Ray "
          f"(call, serialization into the object store, get)")
    if args.json:
        emit_json(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
