"""`kdn bench load`: concurrent workers fetch a Zipf mix over Ray and HTTP; one edge is killed halfway.

The bench builds its own 3-region Ray cluster on loopback (LocalCluster, never an existing
cluster), starts a network with HTTP on every edge, and publishes --kbs synthetic knowledge
bases of 1-8 chunks each (the last chunk partial). It keeps, per KB, the xxh3 digest, dtype
and shape of every published chunk, so every fetched chunk is verified byte for byte without
keeping the KV itself in the workers.

Then --workers worker processes per transport fetch for --seconds: Ray workers are actors
placed on the nodes of the regions in turn (their Client takes its region from the node's
label), HTTP workers are plain processes outside Ray that read the edges' HTTP URLs with
the one reader over HTTP (kdn.client.http.HTTPEdges). Access control is on: the tenant has a read token every worker presents. Each worker picks KB i with probability proportional to 1/(i+1)^zipf and asks
for that KB followed by a short question. Halfway, the bench SIGKILLs one edge's process (a
crash, not a stop). Ray restarts the actor empty, on a new HTTP port.

Failover is the point. The Ray client already moves to the next edge on a dead actor. An
HTTP worker holds the edges' URLs nearest first; a connection error or timeout moves it to
the next URL and counts a failover, not an error, and a URL that failed is tried last for a
while. The bench writes the restarted edge's new URL to a file the HTTP workers re-read, as
a service registry would. An error is anything a caller would see: a fetch that fails on
every edge, a 4xx or 5xx, a short prefix, a byte that differs. The target is zero errors.
"""
import argparse
import json
import multiprocessing as mp
import os
import secrets
import signal
import sys
import threading
import time
import uuid

import numpy as np
import xxhash

from kdn.bench import emit_json, p, table
from kdn.bench.harness import REGIONS, scratch_dir
from kdn.core.keys import CHUNK_TOKENS

TENANT = "bench-load"
FINGERPRINT = "bench-load-synthetic"
QUESTION_TOKENS = 16
HTTP_TIMEOUT_S = 5.0          # an HTTP call that takes longer is a dead edge: fail over
SUSPECT_S = 10.0              # a URL that failed is tried last for this long
MAX_ERROR_SAMPLES = 5


# --- the knowledge bases ----------------------------------------------------------------------
def kv_digest(kv) -> int:
    """xxh3_64 of an array's bytes (C order): what a fetched chunk must hash to."""
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(kv).reshape(-1).view(np.uint8)))


def synthetic_kbs(n_kbs: int, max_chunks: int, layers: int, heads: int, head_dim: int,
                  dtype: str, seed: int = 0) -> list:
    """[(name, tokens, kv)]: KB i has 1..max_chunks chunks, its last one partial."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_kbs):
        chunks = int(rng.integers(1, max_chunks + 1))
        n = chunks * CHUNK_TOKENS - int(rng.integers(0, CHUNK_TOKENS // 2))
        tokens = rng.integers(0, 49152, n).tolist()
        kv = rng.standard_normal((layers, 2, heads, n, head_dim), dtype=np.float32).astype(dtype)
        out.append((f"kb{i:02d}", tokens, kv))
    return out


def expectation(name: str, tokens: list, kv, seed: int) -> dict:
    """What a worker needs to ask for a KB and verify the answer: prompt, digests, shapes."""
    rng = np.random.default_rng(seed)
    spans = range(0, len(tokens), CHUNK_TOKENS)
    parts = [kv[:, :, :, s:s + CHUNK_TOKENS] for s in spans]
    return {"kb": name, "prompt": tokens + rng.integers(0, 49152, QUESTION_TOKENS).tolist(),
            "tokens": len(tokens), "digests": [kv_digest(a) for a in parts],
            "shapes": [tuple(a.shape) for a in parts], "dtype": str(kv.dtype),
            "nbytes": int(kv.nbytes)}


def verify(f, want: dict) -> int:
    """Bytes verified in Fetched f against the published KB; raises AssertionError on any difference."""
    if len(f.chunks) != len(want["digests"]):
        raise AssertionError(f"{want['kb']}: {len(f.chunks)} chunks fetched, "
                             f"{len(want['digests'])} published")
    if f.tokens != want["tokens"]:
        raise AssertionError(f"{want['kb']}: {f.tokens} tokens covered, {want['tokens']} published")
    n = 0
    for i, (c, d, shape) in enumerate(zip(f.chunks, want["digests"], want["shapes"])):
        if c.dtype != want["dtype"] or tuple(c.kv.shape) != shape:
            raise AssertionError(f"{want['kb']} chunk {i}: {c.dtype} {tuple(c.kv.shape)}, "
                                 f"published {want['dtype']} {shape}")
        if kv_digest(c.kv) != d:
            raise AssertionError(f"{want['kb']} chunk {i}: bytes differ from the published KV")
        n += c.kv.nbytes
    return n


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


class Tally:
    """One worker's figures: latencies, bytes verified, failovers, errors (a few kept)."""

    def __init__(self, transport: str, worker: int, region: str):
        self.d = {"transport": transport, "worker": worker, "region": region, "requests": 0,
                  "errors": 0, "failovers": 0, "bytes": 0, "chunks": 0, "latency_s": [],
                  "after_kill": 0, "error_samples": [], "edges": {}}

    def ok(self, seconds, nbytes, chunks, failovers, edge, after_kill):
        d = self.d
        d["requests"] += 1
        d["latency_s"].append(seconds)
        d["bytes"] += nbytes
        d["chunks"] += chunks
        d["failovers"] += failovers
        d["after_kill"] += after_kill
        d["edges"][edge] = d["edges"].get(edge, 0) + 1

    def error(self, seconds, exc, failovers=0):
        d = self.d
        d["requests"] += 1
        d["errors"] += 1
        d["failovers"] += failovers
        d["latency_s"].append(seconds)
        if len(d["error_samples"]) < MAX_ERROR_SAMPLES:
            d["error_samples"].append(f"{type(exc).__name__}: {exc}"[:300])


# --- Ray workers ------------------------------------------------------------------------------
class RayLoadWorker:
    """A worker inside Ray: Client.fetch of the Zipf mix from the edge nearest its node."""

    def __init__(self, network: str, wants: list, token: str):
        from kdn.client import Client
        self.client = Client(network=network, tenant=TENANT, fingerprint=FINGERPRINT, token=token)
        self.wants = wants
        self.client.manifests(refresh=True)

    def region(self) -> str:
        return self.client.region

    def run(self, worker: int, start_at: float, stop_at: float, kill_at: float, weights, seed: int):
        rng = np.random.default_rng(seed)
        tally = Tally("ray", worker, self.client.region)
        while time.time() < start_at:
            time.sleep(0.005)
        while time.time() < stop_at:
            want = self.wants[rng.choice(len(self.wants), p=weights)]
            t0 = time.perf_counter()
            try:
                f = self.client.fetch(want["prompt"], kb=want["kb"])
                n = verify(f, want)
                tally.ok(time.perf_counter() - t0, n, len(f.chunks), len(f.failovers), f.edge,
                         time.time() >= kill_at)
            except Exception as e:  # noqa: BLE001 - counted: the bench reports every error
                tally.error(time.perf_counter() - t0, e)
        return tally.d


# --- HTTP workers -----------------------------------------------------------------------------
class EdgeURLs:
    """The edges' HTTP URLs nearest first from a region, re-read when the registry file changes."""

    def __init__(self, path: str, region: str):
        self.path, self.region = path, region
        self.mtime = None
        self.order = []              # [url], nearest first
        self.suspect = {}            # url -> monotonic time until which it is tried last
        self.reload()

    def reload(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return
        if st.st_mtime_ns == self.mtime:
            return
        with open(self.path) as fh:
            doc = json.load(fh)
        self.mtime = st.st_mtime_ns
        self.order = [doc["urls"][e] for e in doc["order"][self.region] if doc["urls"].get(e)]

    def ranked(self) -> list:
        self.reload()
        now = time.monotonic()
        return sorted(self.order, key=lambda u: self.suspect.get(u, 0) > now)

    def failed(self, url):
        self.suspect[url] = time.monotonic() + SUSPECT_S


def http_fetch(urls: EdgeURLs, clients: dict, want: dict, token: str) -> tuple:
    """(Fetched, failovers): the first edge URL that answers, in this bench's ranking (one
    kdn.client.reader.Reader per URL, over HTTP); an edge that does not answer is failed
    over, one that answers with a fault (RemoteError, a 5xx) is an error."""
    from kdn.core.errors import NoLiveEdge
    from kdn.client.http import HTTPEdges
    from kdn.client.reader import Reader
    failovers, tried = 0, []
    for url in urls.ranked():
        reader = clients.get(url)
        if reader is None:
            reader = clients[url] = Reader(HTTPEdges([url], token=token, timeout_s=HTTP_TIMEOUT_S),
                                           TENANT, FINGERPRINT, token=token)
        try:
            return reader.fetch(want["prompt"], kb=want["kb"]), failovers
        except NoLiveEdge:
            reader.view.close()
            clients.pop(url, None)
            urls.failed(url)
            failovers += 1
            tried.append(url)
    raise NoLiveEdge(f"no edge URL answered (tried {', '.join(tried) or 'none'})")


def http_worker(worker: int, region: str, registry: str, wants: list, weights, seed: int,
                start_at, seconds: float, kill_at, ready, out, token: str) -> None:
    """A worker outside Ray (its own process): the Zipf mix over the edges' HTTP URLs."""
    rng = np.random.default_rng(seed)
    urls = EdgeURLs(registry, region)
    clients = {}
    tally = Tally("http", worker, region)
    try:
        http_fetch(urls, clients, wants[0], token)    # warm: a connection and the KB list
        ready.put(worker)
        while start_at.value == 0:
            time.sleep(0.005)
        while time.time() < start_at.value:
            time.sleep(0.005)
        stop = start_at.value + seconds
        while time.time() < stop:
            want = wants[rng.choice(len(wants), p=weights)]
            t0 = time.perf_counter()
            failovers = 0
            try:
                f, failovers = http_fetch(urls, clients, want, token)
                n = verify(f, want)
                tally.ok(time.perf_counter() - t0, n, len(f.chunks), failovers, f.edge,
                         bool(kill_at.value) and time.time() >= kill_at.value)
            except Exception as e:  # noqa: BLE001 - counted: the bench reports every error
                tally.error(time.perf_counter() - t0, e, failovers)
    except Exception as e:  # noqa: BLE001 - a worker that cannot start reports it, not hangs
        tally.error(0.0, e)
        ready.put(worker)
    finally:
        for c in clients.values():
            c.view.close()
        out.put(tally.d)


# --- the run ----------------------------------------------------------------------------------
def write_registry(path: str, urls: dict, order: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"urls": urls, "order": order}, fh)
    os.replace(tmp, path)


def watch_restart(handle, old_pid: int, edge: str, urls: dict, order: dict, registry: str,
                  info: dict, deadline_s: float = 60.0) -> None:
    """Ping the killed edge until its restarted process answers; publish its new HTTP URL."""
    import ray
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        try:
            got = ray.get(handle.ping.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - still restarting
            time.sleep(0.2)
            continue
        if got["pid"] != old_pid and got.get("http"):
            urls[edge] = got["http"]
            write_registry(registry, urls, order)
            info.update(restarted_s=round(time.monotonic() - t0, 2), new_pid=got["pid"],
                        new_url=got["http"])
            return
        time.sleep(0.2)


def run(args, log) -> dict:
    import ray
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.placement.topology import Topology

    kbs = synthetic_kbs(args.kbs, args.max_chunks, args.layers, args.heads, args.head_dim, args.dtype,
                        seed=args.seed)
    wants = [expectation(n, t, kv, args.seed + i) for i, (n, t, kv) in enumerate(kbs)]
    total = sum(w["nbytes"] for w in wants)
    log(f"{len(kbs)} KBs, {sum(len(w['digests']) for w in wants)} chunks, "
        f"{total / 2**20:.1f} MiB ({args.layers}x2x{args.heads}x{args.head_dim} {args.dtype})")
    weights = zipf_weights(len(wants), args.zipf)
    cluster = net = None
    actors, procs = [], []
    root = scratch_dir("kdn-bench-load-")
    registry = os.path.join(root, "edges.json")
    try:
        t0 = time.perf_counter()
        cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=args.object_store_mib << 20)
        init_ray(cluster.address)
        topo = Topology.default_local(list(REGIONS), capacity_bytes=1 << 30)
        name = f"bench-load-{uuid.uuid4().hex[:6]}"
        # Access control on, as `kdn up` runs it: an admin token to publish, a read token for
        # the tenant that every worker (Ray and HTTP) presents.
        admin, read = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        net = start_network(topo, os.path.join(root, "origin"), network=name, http=True,
                            auth={"admin": admin, "readers": {TENANT: read}})
        log(f"cluster + network up in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        publisher = Client(network=name, region=REGIONS[0], tenant=TENANT, fingerprint=FINGERPRINT,
                           token=read, admin_token=admin)
        for kb, tokens, kv in kbs:
            publisher.publish(kb, [(kb, tokens)], kv)
        del kbs
        log(f"published in {time.perf_counter() - t0:.1f} s")

        pings = {e: ray.get(h.ping.remote(), timeout=30) for e, h in net.edges.items()}
        urls = {e: pg["http"] for e, pg in pings.items()}
        cands = [(e.name, e.region) for e in topo.edges]
        order = {r: topo.rank_sources(r, cands, 1 << 20) for r in REGIONS}
        write_registry(registry, urls, order)

        worker_cls = ray.remote(RayLoadWorker)
        wants_ref = ray.put(wants)
        for i in range(args.workers):
            actors.append(worker_cls.options(num_cpus=0, label_selector={"region": REGIONS[i % 3]})
                          .remote(name, wants_ref, read))
        regions = ray.get([a.region.remote() for a in actors], timeout=120)
        ctx = mp.get_context("spawn")
        start_at, kill_at = ctx.Value("d", 0.0), ctx.Value("d", 0.0)
        ready, out = ctx.Queue(), ctx.Queue()
        for i in range(args.workers):
            pr = ctx.Process(target=http_worker, daemon=True,
                             args=(i, REGIONS[i % 3], registry, wants, weights, args.seed + 100 + i,
                                   start_at, args.seconds, kill_at, ready, out, read))
            pr.start()
            procs.append(pr)
        for _ in procs:
            ready.get(timeout=120)
        log(f"{args.workers} Ray workers in {regions}, {args.workers} HTTP workers ready")

        begin = time.time() + 0.5
        start_at.value = begin
        kill_time = begin + args.seconds / 2
        kill_at.value = kill_time
        refs = [a.run.remote(i, begin, begin + args.seconds, kill_time, weights, args.seed + i)
                for i, a in enumerate(actors)]
        killed = {"edge": args.kill, "pid": pings[args.kill]["pid"], "old_url": urls[args.kill]}
        time.sleep(max(0.0, kill_time - time.time()))
        os.kill(killed["pid"], signal.SIGKILL)
        killed["at_s"] = round(time.time() - begin, 2)
        log(f"killed {args.kill} (pid {killed['pid']}) at {killed['at_s']} s")
        watcher = threading.Thread(target=watch_restart, daemon=True,
                                   args=(net.edge(args.kill), killed["pid"], args.kill, urls, order,
                                         registry, killed))
        watcher.start()
        tallies = ray.get(refs, timeout=args.seconds + 120)
        for _ in procs:
            tallies.append(out.get(timeout=120))
        watcher.join(60)
        for pr in procs:
            pr.join(30)
        return {"tallies": tallies, "killed": killed, "seconds": args.seconds,
                "published_bytes": total, "kbs": len(wants)}
    finally:
        for pr in procs:
            if pr.is_alive():
                pr.terminate()
                pr.join(5)
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        teardown(net, cluster, root)


def summarize(r: dict, workers: int) -> dict:
    out = {"seconds": r["seconds"], "kbs": r["kbs"], "published_bytes": r["published_bytes"],
           "killed": r["killed"], "workers_per_transport": workers}
    for transport in ("ray", "http"):
        ts = [t for t in r["tallies"] if t["transport"] == transport]
        lat = [x for t in ts for x in t["latency_s"]]
        req = sum(t["requests"] for t in ts)
        nbytes = sum(t["bytes"] for t in ts)
        edges = {}
        for t in ts:
            for e, n in t["edges"].items():
                edges[e] = edges.get(e, 0) + n
        out[transport] = {
            "workers": len(ts), "requests": req, "errors": sum(t["errors"] for t in ts),
            "failovers": sum(t["failovers"] for t in ts),
            "requests_after_kill": sum(t["after_kill"] for t in ts),
            "p50_ms": p(lat, 50) * 1e3, "p99_ms": p(lat, 99) * 1e3, "max_ms": max(lat, default=0) * 1e3,
            "req_per_s": req / r["seconds"], "gb_per_s": nbytes / 1e9 / r["seconds"],
            "bytes_verified": nbytes, "chunks_verified": sum(t["chunks"] for t in ts),
            "served_by": dict(sorted(edges.items())),
            "error_samples": [s for t in ts for s in t["error_samples"]][:MAX_ERROR_SAMPLES],
        }
    out["transports"] = ["ray", "http"]
    for k in ("requests", "errors", "failovers", "bytes_verified", "chunks_verified"):
        out[k] = out["ray"][k] + out["http"][k]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench load", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4, help="worker processes per transport")
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the workers fetch")
    ap.add_argument("--kbs", type=int, default=20, help="knowledge bases published")
    ap.add_argument("--max-chunks", type=int, default=8, help="a KB has 1..this many chunks")
    ap.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of KB popularity")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    ap.add_argument("--kill", default="us-east-0", help="the edge SIGKILLed halfway")
    ap.add_argument("--object-store-mib", type=int, default=512, help="per Ray node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.workers < 1 or args.seconds <= 0 or args.kbs < 1 or args.max_chunks < 1:
        ap.error("--workers, --seconds, --kbs and --max-chunks must be positive")
    if args.kill not in {f"{r}-0" for r in REGIONS}:
        ap.error(f"--kill must name an edge of {', '.join(f'{r}-0' for r in REGIONS)}, got {args.kill!r}")

    def log(msg):
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    s = summarize(run(args, log), args.workers)
    table([{"transport": t, "workers": s[t]["workers"], "requests": s[t]["requests"],
            "errors": s[t]["errors"], "failovers": s[t]["failovers"],
            "after kill": s[t]["requests_after_kill"], "p50 ms": s[t]["p50_ms"],
            "p99 ms": s[t]["p99_ms"], "req/s": s[t]["req_per_s"], "GB/s": s[t]["gb_per_s"],
            "MiB verified": s[t]["bytes_verified"] / 2**20} for t in ("ray", "http")])
    k = s["killed"]
    print(f"killed {k['edge']} at {k['at_s']} s; restarted in {k.get('restarted_s', '?')} s on "
          f"{k.get('new_url', '(no new URL seen)')}; total {s['requests']} requests, "
          f"{s['errors']} errors, {s['failovers']} failovers, "
          f"{s['bytes_verified'] / 2**20:.1f} MiB verified")
    for t in ("ray", "http"):
        print(f"{t} served by: {s[t]['served_by']}")
        for e in s[t]["error_samples"]:
            print(f"  {t} error: {e}")
    if args.json:
        emit_json(s)
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
