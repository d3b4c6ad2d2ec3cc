"""`kdn bench transport`: fetch GB/s of the same KV over Ray, over HTTP, and from Redis.

One run, one machine, the same bytes: a one-node network (origin + one edge with HTTP) holds
a published KB of N chunks (default 32 chunks of 2 MiB = 64 MiB: 256 tokens x 16 layers x
2 KV heads x head_dim 64, float16), all in the edge's memory. Each rep fetches all of it:

- ray:   Client.fetch(tokens) in a Ray worker process on the edge's node: keys computed in
         the worker, the edge's answer through the object store (mapped, not copied, on the
         worker's side), every chunk verified against its manifest checksum.
- http:  Reader over HTTPEdges (kdn.client.http) in this process (not a Ray call): the frames
         received into one reused buffer, each verified (xxh3) as soon as it is in.
- socket: the HTTP path's ceiling: another process sends the same number of bytes from its
         memory over one loopback TCP connection, received by recv_into into one reused
         buffer here, with no protocol and no checksum.
- redis: redis-server on loopback (Debian's, started and stopped here, no persistence)
         holding each chunk's frame under its key; one MGET of all keys, each value read into
         its own preallocated buffer over RESP on a raw socket (redis-py if installed is
         measured too) and verified into Chunks exactly like HTTP.
- copy:  one numpy copy of 64 MiB in this process, the memory-bandwidth ceiling of the run.

GB/s = bytes of KV / median seconds of >= 5 reps (1e9 B/s). Peers that are not part of this
repository (LMCache's KV server, Mooncake Store) are measured by an "anchors" folder of
harnesses kept outside it: name it with --anchors DIR or $KDN_ANCHORS_DIR, and the folder
of their virtual environments with $ANCHORS; with --run-anchors they run beside KDN in the
same run, else their recorded figures (DIR/results_here.jsonl) are printed, labelled so.
Without an anchors folder, only the peers this command runs itself (Redis) are compared.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import xxhash

from kdn.bench import emit_json, median, table
from kdn.bench.harness import add_own_cores, check_host_flags, scratch_dir, start_redis, stop_process
from kdn.core.chunk import decode, encode
from kdn.client.http import RECV_STEP

REGION = "bench"
TENANT, FINGERPRINT = "default", "bench-transport"
HEADS, HEAD_DIM, TOKENS = 2, 64, 256


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


# --- Redis over RESP on a raw socket ---------------------------------------------------------
class Resp:
    """The least RESP2 client that reads large values fast: bulk replies land by recv_into
    in a buffer allocated at their announced length, never assembled from pieces."""

    def __init__(self, port: int, timeout_s: float = 60.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.pending = bytearray()

    def close(self):
        self.sock.close()

    def send(self, *args):
        parts = [f"*{len(args)}\r\n".encode()]
        for a in args:
            a = a.encode() if isinstance(a, str) else a
            parts += [f"${len(a)}\r\n".encode(), a, b"\r\n"]
        big = [p for p in parts if len(p) > 65536]
        if not big:
            self.sock.sendall(b"".join(parts))
        else:
            for p in parts:
                self.sock.sendall(p)

    def _line(self) -> bytes:
        while True:
            i = self.pending.find(b"\r\n")
            if i >= 0:
                line = bytes(self.pending[:i])
                del self.pending[:i + 2]
                return line
            more = self.sock.recv(65536)
            if not more:
                raise ConnectionError("redis closed the connection")
            self.pending += more

    def _exact(self, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        mv = memoryview(out)
        have = min(n, len(self.pending))
        mv[:have] = self.pending[:have]
        del self.pending[:have]
        while have < n:
            r = self.sock.recv_into(mv[have:])
            if not r:
                raise ConnectionError("redis closed the connection mid-value")
            have += r
        while len(self.pending) < 2:
            self.pending += self.sock.recv(65536)
        del self.pending[:2]
        return out

    def reply(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b":"):
            return rest
        if kind == b"-":
            raise RuntimeError(f"redis: {rest.decode()}")
        if kind == b"$":
            n = int(rest)
            return None if n < 0 else self._exact(n)
        if kind == b"*":
            return [self.reply() for _ in range(int(rest))]
        raise RuntimeError(f"redis: unexpected reply {line[:40]!r}")


# --- the socket's limit: bytes from memory to a reused buffer, nothing else --------------------
SOCKET_SERVER = """
import socket, sys
import numpy as np
n, reps, piece, host = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
src = memoryview(np.ones(n, np.uint8))
s = socket.socket()
s.bind((host, 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
for _ in range(reps):
    if c.recv(1) != b"x":
        break
    for at in range(0, n, piece):      # a chunk at a time, as an edge sends its frames
        c.sendall(src[at:at + piece])
c.close()
"""


class SocketLink:
    """A bare TCP link (see bare_socket), its server and connection kept open: each one() is
    one timed transfer of nbytes, so a bench can interleave it with other paths rep by rep."""

    def __init__(self, nbytes: int, piece: int, verify: bool = False, host: str = "127.0.0.1",
                 prefix=(), transfers: int = 1000):
        self.nbytes, self.piece, self.verify = nbytes, piece, verify
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", SOCKET_SERVER, str(nbytes),
                                      str(transfers), str(piece), host], stdout=subprocess.PIPE, text=True)
        try:
            port = int(self.proc.stdout.readline())
            self.buf = np.ones(nbytes, np.uint8)             # touched: no page faults in the timing
            self.sock = socket.create_connection((host, port), timeout=60)
        except BaseException:     # the server process must not outlive a failed start
            stop_process(self.proc)
            raise

    def one(self) -> float:
        """Seconds for one transfer, received RECV_STEP bytes at a time (as the HTTP client)."""
        mv, nbytes, piece = memoryview(self.buf), self.nbytes, self.piece
        t0 = time.perf_counter()
        self.sock.sendall(b"x")
        got = hashed = 0
        while got < nbytes:
            r = self.sock.recv_into(mv[got:min(nbytes, got + RECV_STEP)])
            if not r:
                raise RuntimeError(f"the socket server hung up after {got} of {nbytes} bytes")
            got += r
            while self.verify and (got - hashed >= piece or (got == nbytes and hashed < got)):
                end = min(hashed + piece, got)
                xxhash.xxh3_64_intdigest(mv[hashed:end])
                hashed = end
        return time.perf_counter() - t0

    def close(self) -> None:
        self.sock.close()
        stop_process(self.proc)


def bare_socket(nbytes: int, reps: int, piece: int, verify: bool = False, host: str = "127.0.0.1",
                prefix=()) -> list:
    """Seconds per nbytes sent by another process over one TCP connection (loopback, or to
    `host` where the server runs under `prefix`: another host's namespace) from a
    buffer in its memory (`piece` bytes per send), received by recv_into into one reused
    buffer here, RECV_STEP bytes at a time: what a socket does with no protocol, no checksum
    and no allocation (the HTTP path's ceiling). verify: each piece is also hashed (xxh3_64)
    as soon as it is in, as a reader that trusts nothing does with each frame: the ceiling
    of any verified read over one connection, on the reader's one core."""
    link = SocketLink(nbytes, piece, verify, host, prefix, reps + 1)
    try:
        return [link.one() for _ in range(reps + 1)][1:]
    finally:
        link.close()


def hash_only(kv: np.ndarray, reps: int, piece: int) -> list:
    """Seconds to xxh3_64 kv piece by piece (what verifying a read costs the reader's core)."""
    raw = memoryview(kv.reshape(-1).view(np.uint8))
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for at in range(0, raw.nbytes, piece):
            xxhash.xxh3_64_intdigest(raw[at:at + piece])
        times.append(time.perf_counter() - t0)
    return times[1:]


def timed_fetches(reader, tokens, reps: int) -> tuple:
    """(seconds of each of reps fetches of tokens by reader, the sources they named)."""
    times, sources = [], set()
    for _ in range(reps):
        t0 = time.perf_counter()
        f = reader.fetch(tokens)
        times.append(time.perf_counter() - t0)
        sources |= set(f.sources)
        del f
    return times, sources


# --- the Ray side ----------------------------------------------------------------------------
def _ray_worker(network, tokens, digests, reps):
    """In a Ray worker on the edge's node: time Client.fetch of the whole KB, reps times."""
    from kdn.client import Client
    cl = Client(network=network, region=REGION, tenant=TENANT, fingerprint=FINGERPRINT)
    f = cl.fetch(tokens)                          # warm: manifests, handles; check the bytes
    ok = [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in f.chunks] == digests
    times, sources = [], set(f.sources)
    for _ in range(reps):
        del f
        t0 = time.perf_counter()
        f = cl.fetch(tokens)
        times.append(time.perf_counter() - t0)
        sources |= set(f.sources)
    return {"times": times, "ok": ok, "nbytes": f.nbytes, "sources": sorted(sources), "pid": os.getpid()}


def _ray_cold_worker(network, token_sets, digests, region, token, data_plane="ray", link=None, streams=None):
    """In a Ray worker: time Client.fetch of each KB once (token_sets: one per KB, the first
    a warm-up), so every fetch pulls objects this node has never held (Ray keeps a pulled
    copy: fetching one KB again would read it from this node's own store). data_plane: the
    reader's (kdn.client.dataplane; "auto" reads another node's edge over its HTTP frames).
    link: SocketLink's arguments (nbytes, piece, host, prefix): each fetch is then preceded by
    one bare-socket transfer from the same host, timed ("socket": the ceiling beside it).
    streams: the parallel connections of a fetch over HTTP (kdn.client.dataplane; its default
    when None)."""
    from kdn.client import Client
    cl = Client(network=network, region=region, tenant=TENANT, fingerprint=FINGERPRINT, token=token,
                data_plane=data_plane)
    if streams is not None:
        cl.view.plane.streams = streams
    times, ok, sources, nbytes, sockets = [], True, set(), 0, []
    http = cl.stats()["data_plane"].get("http_fetches", 0)
    beside = None if link is None else SocketLink(*link[:2], host=link[2], prefix=link[3])
    try:
        for toks in token_sets:
            if beside is not None:
                sockets.append(beside.one())
            t0 = time.perf_counter()
            f = cl.fetch(toks)
            times.append(time.perf_counter() - t0)
            ok = ok and [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in f.chunks] == digests
            sources |= set(f.sources)
            nbytes = f.nbytes
            del f
    finally:
        if beside is not None:
            beside.close()
    return {"times": times[1:], "ok": ok, "nbytes": nbytes, "sources": sorted(sources),
            "over_http": cl.stats()["data_plane"].get("http_fetches", 0) - http, "socket": sockets[1:]}


# --- anchors ---------------------------------------------------------------------------------
ANCHOR_RUNS = {   # label -> (venv, script, args): 64 MiB in 2 x 32 MiB values, read direction
    "LMCache 0.5.6 lm:// retrieve": ("venv-lmcache", "lmcache_bench.py", ["--backend", "lm", "--chunks", "2"]),
    "Mooncake 0.3.13 get_into": ("venv-mooncake", "mooncake_bench.py", ["--n", "2", "--mib", "32", "--api", "buffer"]),
}
RECORDED = {   # label -> (system, op) in results_here.jsonl
    "LMCache 0.5.6 lm:// retrieve": ("lmcache-0.5.6 engine -> lm://", "retrieve"),
    "Mooncake 0.3.13 get_into": ("mooncake-store-0.3.13 (tcp)", "get", "buffer"),
    "Redis 7 + redis-py GET": ("redis-7 (redis-py)", "get", "tcp-loopback"),
}


def run_anchors(anchors: Path, venvs: Path, reps: int) -> dict:
    out = {}
    for label, (venv, script, args) in ANCHOR_RUNS.items():
        py = venvs / venv / "bin" / "python"
        if not py.exists():
            continue
        try:
            p = subprocess.run([str(py), str(anchors / script), *args, "--reps", str(reps)],
                               capture_output=True, text=True, timeout=400, cwd=anchors)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            out[label] = json.loads(lines[-1])["gbps"] if lines else None
        except (subprocess.TimeoutExpired, ValueError, KeyError, OSError):
            out[label] = None
    return out


def recorded_anchors(anchors: Path) -> dict:
    path = anchors / "results_here.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    out = {}
    for label, want in RECORDED.items():
        for r in rows:
            extra = r.get("api", r.get("transport"))
            if (r.get("system"), r.get("op")) == want[:2] and (len(want) < 3 or extra == want[2]):
                out[label] = r["gbps"]
                break
    return out


# --- the benchmark ---------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench transport", description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=32, help="chunks in the KB (default 32)")
    ap.add_argument("--chunk-mib", type=int, default=2, help="MiB per chunk (default 2)")
    ap.add_argument("--reps", type=int, default=5, help="timed reps per transport (>= 5)")
    ap.add_argument("--anchors", default=os.environ.get("KDN_ANCHORS_DIR"),
                    help="the folder of peer harnesses (LMCache, Mooncake; default $KDN_ANCHORS_DIR)")
    ap.add_argument("--run-anchors", action="store_true",
                    help="run LMCache/Mooncake anchors from the venvs under $ANCHORS (slow)")
    ap.add_argument("--hosts", action="store_true",
                    help="between two hosts of their own (network namespaces on a bridge, root "
                         "needed): the reader here, the edge on the other host; bare socket, HTTP "
                         "and Ray between the same two addresses")
    ap.add_argument("--cap", default=None, metavar="RATE",
                    help="with --hosts: cap the other host's link with tc (e.g. 2gbit, 800mbit)")
    add_own_cores(ap)
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.reps < 5 or args.chunks < 1 or args.chunk_mib < 1:
        ap.error("--reps must be >= 5, --chunks and --chunk-mib >= 1")
    check_host_flags(ap, args, HOST_REGIONS)
    cap_bps = link_rate(args.cap) if args.cap else None

    layers = (args.chunk_mib << 20) // (2 * HEADS * TOKENS * HEAD_DIM * 2)
    n_tokens = args.chunks * TOKENS
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((layers, 2, HEADS, n_tokens, HEAD_DIM), dtype=np.float32).astype(np.float16)
    tokens = rng.integers(0, 49152, n_tokens).tolist()
    total = kv.nbytes
    print(f"KV: {args.chunks} chunks x {kv.nbytes // args.chunks / 2**20:.0f} MiB "
          f"({TOKENS} tokens x {layers} layers x {HEADS} heads x {HEAD_DIM} head_dim, float16) "
          f"= {total / 2**20:.0f} MiB; median of {args.reps} reps", flush=True)

    if args.hosts:
        return across_hosts(args, kv, tokens, cap_bps)
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.client import Client
    from kdn.client.http import HTTPEdges
    from kdn.client.reader import Reader
    from kdn.placement.topology import Topology
    import ray

    tmp = scratch_dir("kdn-bench-transport-")
    network = f"bench-transport-{uuid.uuid4().hex[:6]}"
    cluster = LocalCluster([REGION], cpus=2, object_store_bytes=max(512 << 20, 6 * total))
    redis_proc = net = None
    rows, res = [], {}
    try:
        init_ray(cluster.address)
        topo = Topology.default_local([REGION], edges_per_region=1,
                                      capacity_bytes=max(1 << 30, 4 * total))
        net = start_network(topo, Path(tmp) / "origin", network=network, http=True, replicas=1)
        (edge,) = net.edges.values()
        url = ray.get(edge.ping.remote())["http"]
        cl = Client(network=network, region=REGION, tenant=TENANT, fingerprint=FINGERPRINT)
        cl.publish("transport", [("blob", tokens)], kv)
        m = cl.manifest("transport")
        from kdn.core.chunk import Chunk
        chunks = [Chunk(k, m.ns, np.ascontiguousarray(kv[:, :, :, s:s + TOKENS]), "float16")
                  for k, s in zip(m.keys, range(0, n_tokens, TOKENS))]
        digests = [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in chunks]

        def record(name, client, times, note, nbytes=total):
            med = median(times)
            res[name] = gbps(nbytes, med)
            rows.append({"transport": name, "client": client, "GB/s": res[name],
                         "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                         "max_ms": max(times) * 1e3, "note": note})

        # copy: the ceiling of this run
        dst = np.empty_like(kv)
        times = []
        for _ in range(args.reps + 1):
            t0 = time.perf_counter()
            np.copyto(dst, kv)
            times.append(time.perf_counter() - t0)
        record("copy", "np.copyto", times[1:], "memory bandwidth, one core")
        del dst

        # ray: a worker process on the edge's node
        worker = ray.remote(num_cpus=0)(_ray_worker).options(label_selector={"region": REGION})
        got = ray.get(worker.remote(network, tokens, digests, args.reps), timeout=600)
        if not got["ok"] or got["nbytes"] != total:
            raise RuntimeError(f"Ray fetch returned other bytes than published ({got['nbytes']} B)")
        record("ray", "Client.fetch (worker)", got["times"],
               f"object store, zero-copy map; sources {','.join(got['sources'])}")

        # http: this process, no Ray call on the path
        h = Reader(HTTPEdges([url], timeout_s=120), TENANT, FINGERPRINT)
        f = h.fetch(tokens)
        if [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in f.chunks] != digests:
            raise RuntimeError("HTTP fetch returned other bytes than published")
        del f
        times, sources = timed_fetches(h, tokens, args.reps)
        record("http", "Reader over HTTPEdges", times,
               f"one recv buffer, every frame verified; sources {','.join(sorted(sources))}")
        h.view.close()
        piece = total // args.chunks
        record("socket", "recv_into", bare_socket(total, args.reps, piece),
               "bare TCP from another process's memory: the HTTP path's ceiling")
        record("socket+xxh3", "recv_into + xxh3", bare_socket(total, args.reps, piece, verify=True),
               "the same, each piece hashed as it arrives: any verified read's ceiling")
        record("xxh3", "xxh3_64", hash_only(kv, args.reps, piece), "hashing alone, one core")

        # redis
        try:
            redis_proc, port = start_redis(tmp)
        except FileNotFoundError as e:
            redis_proc = None
            print(f"Redis skipped: {e}", flush=True)
        else:
            names = [c.key.hex() for c in chunks]
            r = Resp(port)
            for name, c in zip(names, chunks):
                r.send("SET", name, encode(c))
                r.reply()

            def redis_fetch():
                r.send("MGET", *names)
                return [decode(v) for v in r.reply()]

            got = redis_fetch()
            if [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in got] != digests:
                raise RuntimeError("Redis returned other bytes than stored")
            del got
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                got = redis_fetch()
                times.append(time.perf_counter() - t0)
                del got
            record("redis", "RESP, recv_into", times, "MGET, a buffer per value, frames verified")
            r.close()
            try:
                import redis as redis_py
                rp = redis_py.Redis(host="127.0.0.1", port=port, socket_timeout=120)
                rp.mget(names)
                times = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    got = [decode(v) for v in rp.mget(names)]
                    times.append(time.perf_counter() - t0)
                    del got
                record("redis-py", "redis-py MGET", times, "bytes per value, frames verified")
                rp.close()
            except ImportError:
                pass
    finally:
        stop_process(redis_proc)
        teardown(net, cluster, tmp)

    table(rows, ["transport", "client", "GB/s", "median_ms", "min_ms", "max_ms", "note"])
    out = {"bench": "transport", "chunks": args.chunks, "chunk_bytes": total // args.chunks,
           "bytes": total, "reps": args.reps, "ray_gbps": res["ray"], "http_gbps": res["http"],
           "redis_gbps": res.get("redis"), "copy_gbps": res["copy"],
           "http_over_ray": res["http"] / res["ray"], "socket_gbps": res["socket"],
           "http_over_socket": res["http"] / res["socket"],
           "verified_socket_gbps": res["socket+xxh3"], "xxh3_gbps": res["xxh3"],
           "http_over_verified_socket": res["http"] / res["socket+xxh3"],
           "http_over_redis": res["http"] / res["redis"] if "redis" in res else None}
    if "redis-py" in res:
        out["redis_py_gbps"] = res["redis-py"]

    anchors = Path(args.anchors) if args.anchors else None
    venvs = Path(os.environ["ANCHORS"]) if os.environ.get("ANCHORS") else None
    ran = run_anchors(anchors, venvs, args.reps) if args.run_anchors and venvs and anchors else {}
    if ran:
        print(f"\nPeers measured now by {anchors} (64 MiB, read direction):")
        table([{"peer": k, "GB/s": v if v is not None else "failed"} for k, v in ran.items()])
        out["anchors_this_run"] = ran
    elif args.run_anchors:
        print("\n--run-anchors: name the anchors folder (--anchors or KDN_ANCHORS_DIR) and set "
              "ANCHORS to the folder holding their venvs; nothing run", file=sys.stderr)
    # Peers are other systems measured in this run: Redis, and the anchors when they ran.
    peers = {k: v for k, v in res.items() if k in ("redis", "redis-py")}
    peers.update({k: v for k, v in ran.items() if v})
    if peers:
        fastest = max(peers, key=peers.get)
        out.update(fastest_peer=fastest, fastest_peer_gbps=peers[fastest],
                   http_over_fastest_peer=res["http"] / peers[fastest],
                   ray_over_fastest_peer=res["ray"] / peers[fastest])
        print(f"\nfastest peer measured in this run: {fastest} {peers[fastest]:.2f} GB/s; "
              f"KDN HTTP {out['http_over_fastest_peer']:.2f}x of it, KDN Ray {out['ray_over_fastest_peer']:.2f}x")
    recorded = recorded_anchors(anchors) if anchors else {}
    if recorded:
        print("\nPeers recorded earlier on this machine, not this run (anchors/results_here.jsonl, "
              "512 MiB, read direction):")
        table([{"peer": k, "GB/s": v} for k, v in recorded.items()])
        out["anchors_recorded"] = recorded
    if args.json:
        emit_json(out)
    return 0


# --- between hosts ---------------------------------------------------------------------------
HOST_REGIONS = ("near", "far")      # near: this process's host (the bridge); far: a namespace


def link_rate(rate: str) -> float:
    """tc's rate ("2gbit", "800mbit", "100kbit") in bytes per second; ValueError otherwise."""
    import re
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", str(rate).strip().lower())
    if not m:
        raise ValueError(f"--cap takes a rate like 2gbit or 800mbit, got {rate!r}")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


# edges on the near host pulling from the far edge: (name, topology options, row)
PEER_EDGES = (("near-http", {}, "peer-http"),     # the default: auto, 2 streams, into the process
              ("near-http1", {"peer_streams": 1}, "peer-http-1stream"),
              ("near-store", {"pull_into": "store"}, "peer-http-store"),
              ("near-ray", {"data_plane": "ray"}, "peer-ray"))


def peer_pulls(net, kbs: dict, ns, digests, token, admin, link: SocketLink = None) -> dict:
    """edge -> (seconds of each pull but the first (a warm-up), GB/s of the same HTTP pulls by
    its own timing and the share of that time spent before the first byte (the far edge's
    work), both None over Ray). kbs: edge -> the keys of its KBs, one per rep (keys it never
    held, held by the far edge). Rep by rep, each edge in turn fetches its KB and this process,
    on the same host, takes the objects (so the machine's noise and warm-up hit every data
    plane alike); the bytes must be the published ones. With link, each rep also times one
    bare-socket transfer first: out["socket"], the link's ceiling measured beside the pulls."""
    import ray
    from kdn.core.rpc import resolve_refs
    times = {e: [] for e in kbs}
    sockets = []
    before = {e: ray.get(net.edges[e].stats.remote(token=admin))["data_plane"] for e in kbs}
    for rep in range(len(next(iter(kbs.values())))):
        if rep == 1:                 # the edges' own timing from here: rep 0 is the warm-up
            before = {e: ray.get(net.edges[e].stats.remote(token=admin))["data_plane"] for e in kbs}
        if link is not None:         # the link's ceiling in the same rep (its first a warm-up)
            sockets.append(link.one())
        for edge, reps in kbs.items():
            h = net.edges[edge]
            t0 = time.perf_counter()
            got = ray.get(h.fetch.remote(reps[rep], ns, region="near", token=token), timeout=300)
            objs = resolve_refs(got["refs"], timeout=300)
            times[edge].append(time.perf_counter() - t0)
            if [xxhash.xxh3_64_intdigest(memoryview(o.kv).cast("B")) for o in objs] != digests \
                    or set(got["sources"]) != {"peer:far-0"}:
                st = ray.get(h.stats.remote(token=admin))
                raise RuntimeError(f"edge {edge} returned other bytes or sources ({set(got['sources'])}) "
                                   f"than the far edge's: its data plane {st['data_plane']}, "
                                   f"ring {st['ring_version']} of {st['members']} members")
            del got, objs
    out = {}
    for edge in kbs:
        after = ray.get(net.edges[edge].stats.remote(token=admin))["data_plane"]
        moved = after.get("peer_http_bytes", 0) - before[edge].get("peer_http_bytes", 0)
        us = after.get("peer_http_us", 0) - before[edge].get("peer_http_us", 0)
        wait = after.get("peer_http_wait_us", 0) - before[edge].get("peer_http_wait_us", 0)
        streams = after.get("peer_http_streams", 0) - before[edge].get("peer_http_streams", 0)
        pulls = after.get("peer_http_pulls", 0) - before[edge].get("peer_http_pulls", 0)
        # wait is summed over each pull's connections (one thread each): per pull, their mean
        share = wait * pulls / streams / us if us and streams else None
        out[edge] = (times[edge][1:], moved / us / 1e3 if us else None, share)
    out["socket"] = sockets[1:]
    return out


ORIGIN_PLANES = (("origin-push-http", "node"), ("origin-push-ray", None))   # row, origin http_host


def origin_pushes(args, cluster, kv, admin, read, link: SocketLink) -> dict:
    """The origin's pushes to an edge on the far host, over each path: {row: [seconds per rep]}
    and "socket": one bare-socket transfer timed before each rep. One network per path (the
    origin here, serving its frames on this host's address or on none; one edge, far-0, that
    owns every chunk), KBs of the same size published alternately, each push timed by the
    origin from its first batch's call to its last one's answer (push_<path>_busy_us: the
    edge holds the chunks; a KB over PUSH_BATCH_BYTES goes in batches that overlap, each
    timed on its own in push_<path>_us). The edge answers before copying them into its
    node's store (kdn/edge/arrivals.py), whichever way they came."""
    from kdn.client import Client
    from kdn.launch.cluster import start_network, stop_network
    from kdn.placement.topology import Topology
    import ray
    near, far_region = HOST_REGIONS
    nets, pubs, out = {}, {}, {"socket": []}
    rng = np.random.default_rng(7)
    try:
        for row, host in ORIGIN_PLANES:
            topo = Topology({r: (0.2, 10.0) for r in HOST_REGIONS}, {(near, far_region): (1.0, 10.0)},
                            [("far-0", far_region, int((args.reps + 2) * kv.nbytes / 0.7))], near,
                            source="bench transport --hosts (pushes)")
            nets[row] = start_network(topo, Path(scratch_dir("kdn-bench-push-")) / "origin",
                                      network=f"bench-push-{uuid.uuid4().hex[:6]}", http=True, replicas=1,
                                      auth={"admin": admin, "readers": {TENANT: read}},
                                      edge_options={"http_host": "node"}, origin_options={"http_host": host})
            pubs[row] = Client(network=nets[row].name, region=near, tenant=TENANT, fingerprint=FINGERPRINT,
                               admin_token=admin)
            out[row] = []
        path = {row: "http" if host else "ray" for row, host in ORIGIN_PLANES}
        for i in range(args.reps + 1):               # the first rep warms up, untimed
            sock = link.one()
            for row, _ in ORIGIN_PLANES:
                origin = nets[row].origin
                before = ray.get(origin.stats.remote(token=admin))["counters"]
                pubs[row].publish(f"push-{i}", [("blob", rng.integers(0, 49152, kv.shape[3]).tolist())], kv)
                ray.get(origin.pushes_settled.remote(token=admin), timeout=600)
                after = ray.get(origin.stats.remote(token=admin))["counters"]
                moved = after.get(f"push_{path[row]}_bytes", 0) - before.get(f"push_{path[row]}_bytes", 0)
                us = after.get(f"push_{path[row]}_busy_us", 0) - before.get(f"push_{path[row]}_busy_us", 0)
                if moved < kv.nbytes:
                    raise RuntimeError(f"{row}: the push of rep {i} moved {moved} bytes over "
                                       f"{path[row]}, not the KB's {kv.nbytes}")
                if i:
                    out[row].append(us / 1e6 * kv.nbytes / moved)
            if i:
                out["socket"].append(sock)
        far = ray.get(nets["origin-push-http"].edges["far-0"].stats.remote(token=admin))
        out["http_split"] = {"pull_us": far["data_plane"].get("origin_http_us", 0),
                             "keep_us": far["counters"].get("pushes_pulled_keep_us", 0),
                             "adopt_us": far["counters"].get("pushes_adopt_us", 0),
                             **{k: far["data_plane"].get(f"origin_http_buffers_{k}", 0) for k in ("reused", "new")}}
        far = ray.get(nets["origin-push-ray"].edges["far-0"].stats.remote(token=admin))
        out["ray_split"] = {"keep_us": far["counters"].get("pushes_ray_keep_us", 0),
                            "adopt_us": far["counters"].get("pushes_adopt_us", 0)}
        # the copies pushed are the published bytes: far-0 of each network answers them
        for row in nets:
            toks = pubs[row].manifest(f"push-{args.reps}").token_ids().tolist()
            f = Client(network=nets[row].name, region=far_region, tenant=TENANT, fingerprint=FINGERPRINT,
                       token=read, data_plane="ray").fetch(toks)
            if f.tokens != kv.shape[3] or set(f.sources) != {"local"} or not np.array_equal(
                    np.concatenate(f.kv_parts(), axis=3), kv):
                raise RuntimeError(f"{row}: far-0 does not hold the published bytes ({f.tokens} tokens, "
                                   f"sources {sorted(set(f.sources))})")
    finally:
        for net in nets.values():
            stop_network(net)
    return out


WRITE_BEHIND_PLANES = (("write-behind-http", {}, "http"),            # row, far-0's options, path
                       ("write-behind-ray", {"data_plane": "ray"}, "ref"))
EDGE_STORE_ROWS = {"write-behind-http": ("edge-store-http", "auto"),   # the writer's row, its data_plane
                   "write-behind-ray": ("edge-store-ray", "ray")}


def write_behind(args, kv, admin, read, link: SocketLink) -> dict:
    """Stores acknowledged at the edge on the far host, made durable at the origin here, over
    each path: {row: [seconds per rep]} and "socket": one bare-socket transfer timed before
    each rep. One network per path (the origin here; one edge, far-0, serving HTTP; on the Ray
    path its data_plane is "ray", so it hands the origin references instead of having it pull
    its frames). Each rep stores the KB's bytes as --chunks new opaque objects at far-0 (ack
    edge) and waits until they are durable; the time is the origin's own, from asking for the
    bytes to holding them (object_pull_http_us: the frames received and verified;
    object_ref_us: Ray's get of the references), scaled to the KB's bytes.
    The stores themselves are a writer's here (EDGE_STORE_ROWS: a view of far's region on the
    default data plane, which writes them to far-0's HTTP server, and on "ray"): timed from
    the call to far-0's answer (acknowledged, in its memory)."""
    from kdn.client.view import NetworkView
    from kdn.core.keys import namespace_digest
    from kdn.integrations.objects import object_key, pack
    from kdn.launch.cluster import start_network, stop_network
    from kdn.placement.topology import Topology
    import ray
    near, far_region = HOST_REGIONS
    ns = namespace_digest(TENANT, "bench/write-behind")
    flat = np.ascontiguousarray(kv).reshape(-1).view(np.uint8)
    piece = flat.size // args.chunks
    nets, out, last, writers = {}, {"socket": []}, {}, {}
    counter = {"http": ("object_pull_http_bytes", "object_pull_http_us"),
               "ref": ("object_ref_bytes", "object_ref_us")}
    try:
        for row, options, _ in WRITE_BEHIND_PLANES:
            topo = Topology({r: (0.2, 10.0) for r in HOST_REGIONS}, {(near, far_region): (1.0, 10.0)},
                            [("far-0", far_region, int((args.reps + 2) * kv.nbytes / 0.7))], near,
                            source="bench transport --hosts (write-behind)", options={"far-0": options})
            nets[row] = start_network(topo, Path(scratch_dir("kdn-bench-wb-")) / "origin",
                                      network=f"bench-wb-{uuid.uuid4().hex[:6]}", http=True, replicas=1,
                                      auth={"admin": admin, "readers": {TENANT: read}},
                                      edge_options={"http_host": "node"},
                                      origin_options={"http_host": "node"})
            out[row] = []
        writers = {row: NetworkView(nets[row].name, region=far_region, admin_token=admin, data_plane=plane)
                   for row, (_, plane) in EDGE_STORE_ROWS.items()}
        out.update({store_row: [] for store_row, _ in EDGE_STORE_ROWS.values()})
        for i in range(args.reps + 1):               # the first rep warms up, untimed
            sock = link.one()
            for row, _, path in WRITE_BEHIND_PLANES:
                objs = [pack(object_key(ns, f"{row}-{i}-{j}".encode()), ns, flat[j * piece:(j + 1) * piece])
                        for j in range(args.chunks)]
                origin, edge = nets[row].origin, nets[row].edges["far-0"]
                before = ray.get(origin.stats.remote(token=admin))["counters"]
                puts = writers[row].plane.stats().get("http_puts", 0)
                t0 = time.perf_counter()
                got, at, _ = writers[row].nearest(600.0).put_objects(objs, token=admin)
                took = time.perf_counter() - t0
                store_row, plane = EDGE_STORE_ROWS[row]
                if at != "far-0" or (writers[row].plane.stats().get("http_puts", 0) - puts) != (plane == "auto"):
                    raise RuntimeError(f"{store_row}: the stores of rep {i} went to {at}, not over {plane}")
                if got["pending"] != len(objs):
                    raise RuntimeError(f"{row}: far-0 acknowledged {got['pending']} of {len(objs)} stores early")
                if not ray.get(edge.stores_durable.remote(600.0, token=admin), timeout=660)["durable"]:
                    raise RuntimeError(f"{row}: the stores of rep {i} did not become durable")
                after = ray.get(origin.stats.remote(token=admin))["counters"]
                nbytes, us = (after.get(c, 0) - before.get(c, 0) for c in counter[path])
                want = sum(o.nbytes for o in objs)
                if nbytes < want:
                    raise RuntimeError(f"{row}: the origin read {nbytes} bytes of rep {i} over {path}, "
                                       f"not the {want} stored")
                if i:
                    out[row].append(us / 1e6 * want / nbytes)
                    out[store_row].append(took)
                last[row] = objs
            if i:
                out["socket"].append(sock)
        c = ray.get(nets["write-behind-http"].edges["far-0"].stats.remote(token=admin))["counters"]
        out["store_split"] = {k: c.get(f"store_http_{k}_us", 0) for k in ("receive", "keep")}
        for row, objs in last.items():     # the origin holds the very bytes far-0 acknowledged
            back = ray.get(nets[row].origin.get_chunks.remote([o.key for o in objs], token=admin), timeout=600)
            if [None if b is None else b.kv.tobytes() for b in back] != [o.kv.tobytes() for o in objs]:
                raise RuntimeError(f"{row}: the origin does not hold the bytes stored at far-0")
    finally:
        for w in writers.values():          # their keep-alive connections to far-0
            w.plane.close()
        for net in nets.values():
            stop_network(net)
    return out


def _far_publish(network, admin, kv, seed: int, data_plane: str) -> dict:
    """One publish of kv as a new KB from a worker on the far host, on data_plane: the
    publisher's write counters (kdn/client/ingest.py) and its receipt's sent bytes."""
    from kdn.client import Client
    cl = Client(network=network, tenant=TENANT, fingerprint=FINGERPRINT, admin_token=admin,
                data_plane=data_plane)
    toks = np.random.default_rng(seed).integers(0, 49152, kv.shape[3]).tolist()
    receipt = cl.publish(f"far-{data_plane}-{seed}", [("blob", toks)], kv)
    return {"writes": cl.view.writes().stats(), "sent_bytes": receipt["sent_bytes"], "tokens": toks}


PUBLISH_PLANES = (("publish-http", "auto", "http"), ("publish-ray", "ray", "ray"))   # row, data_plane, counters


def far_publishes(args, kv, admin, read, link: SocketLink) -> dict:
    """A publisher on the far host writing the KB's chunks to the origin here, over each path:
    {row: [seconds per rep]} and "socket": one bare-socket transfer timed before each rep. One
    network (the origin here, serving HTTP on this host's address; one edge on the far host);
    each rep publishes a new KB from a worker on the far host on the default data plane (the
    origin's HTTP server) and on "ray", alternately; the time is the publisher's own, from
    sending the chunks to the origin's answer (they are durable then: kdn/client/ingest.py's
    http_us and ray_us), scaled to the KB's bytes."""
    from kdn.client import Client
    from kdn.launch.cluster import start_network, stop_network
    from kdn.placement.topology import Topology
    import ray
    near, far_region = HOST_REGIONS
    topo = Topology({r: (0.2, 10.0) for r in HOST_REGIONS}, {(near, far_region): (1.0, 10.0)},
                    [("far-0", far_region, int((args.reps + 2) * 2 * kv.nbytes / 0.7))], near,
                    source="bench transport --hosts (publishes)")
    net = start_network(topo, Path(scratch_dir("kdn-bench-pub-")) / "origin",
                        network=f"bench-pub-{uuid.uuid4().hex[:6]}", http=True, replicas=1,
                        auth={"admin": admin, "readers": {TENANT: read}},
                        edge_options={"http_host": "node"}, origin_options={"http_host": "node"})
    out = {"socket": [], **{row: [] for row, _, _ in PUBLISH_PLANES}}
    worker = ray.remote(num_cpus=0)(_far_publish).options(label_selector={"region": far_region})
    try:
        last = None
        for i in range(args.reps + 1):               # the first rep warms up, untimed
            sock = link.one()
            for row, plane, path in PUBLISH_PLANES:
                got = ray.get(worker.remote(net.name, admin, kv, 1000 * i + len(row), plane), timeout=600)
                w = got["writes"]
                if w.get(f"{path}_bytes", 0) < kv.nbytes or w.get("http_failures", 0):
                    raise RuntimeError(f"{row}: the publish of rep {i} wrote {w} , not the KB's "
                                       f"{kv.nbytes} bytes over {path}")
                if i:
                    out[row].append(w[f"{path}_us"] / 1e6 * kv.nbytes / w[f"{path}_bytes"])
                last = got["tokens"]
            if i:
                out["socket"].append(sock)
        http = ray.get(net.origin.stats.remote(token=admin))["http"]
        out["http_split"] = {k: http.get(f"ingest_chunks_{k}_us", 0) for k in ("receive", "store")}
        f = Client(network=net.name, region=near, tenant=TENANT, fingerprint=FINGERPRINT, token=read,
                   data_plane="ray").fetch(last)        # the last KB published reads back exact
        # moved, not computed: the published bytes themselves, on any CPU
        if f.tokens != kv.shape[3] or not np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv):
            raise RuntimeError("a KB published from the far host does not read back as published")
    finally:
        stop_network(net)
    return out


def _keep_conversations(network, read, kv, seeds) -> list:
    """In a worker on the far host: keep one conversation of kv per seed at its home edge
    there (kdn.client.history); the token ids of each."""
    from kdn.client import Client
    from kdn.client.history import History
    cl = Client(network=network, tenant=TENANT, fingerprint=FINGERPRINT, token=read)
    history, out = History(cl.view, TENANT, FINGERPRINT, token=read), []
    for seed in seeds:
        toks = np.random.default_rng(seed).integers(0, 49152, kv.shape[3]).tolist()
        kept = history.store(toks, kv, 0, 0)
        if kept["chunks"] * TOKENS != kv.shape[3]:
            raise RuntimeError(f"the far host kept {kept['chunks']} chunks of a conversation, not all")
        out.append(toks)
    return out


CONVERSATION_PLANES = (("conversation-http", "auto"), ("conversation-ray", "ray"))   # row, data_plane


def conversation_reads(args, net, kv, admin, read, link: SocketLink) -> dict:
    """A conversation's next turn here reading its history from its home edge on the far host
    (kdn.client.history: find, then fetch), over each path: {row: [seconds per rep]} and
    "socket": one bare-socket transfer timed before each rep. Each rep a worker on the far host
    keeps two new conversations of the KB's size there, one per path, read here once each
    (fetch's time: the home edge's answer to the verified chunks), then dropped."""
    from kdn.client import Client
    from kdn.client.history import History
    import ray
    near, far_region = HOST_REGIONS
    keeper = ray.remote(num_cpus=0)(_keep_conversations).options(label_selector={"region": far_region})
    histories = {row: History(Client(network=net.name, region=near, tenant=TENANT, fingerprint=FINGERPRINT,
                                     token=read, data_plane=plane).view, TENANT, FINGERPRINT, token=read)
                 for row, plane in CONVERSATION_PLANES}
    out = {"socket": [], **{row: [] for row, _ in CONVERSATION_PLANES}}
    want = np.ascontiguousarray(kv).tobytes()
    for i in range(args.reps + 1):               # the first rep warms up, untimed
        token_sets = ray.get(keeper.remote(net.name, read, kv, [2 * i, 2 * i + 1]), timeout=600)
        sock = link.one()
        for (row, _), toks in zip(CONVERSATION_PLANES, token_sets):
            history = histories[row]
            found = history.find(toks + [1], 0, hints=[far_region])
            if found is None or found.held * TOKENS != kv.shape[3]:
                raise RuntimeError(f"{row}: the far edge does not hold the conversation kept there")
            t0 = time.perf_counter()
            chunks = history.fetch(found)
            seconds = time.perf_counter() - t0
            if np.concatenate([c.kv for c in chunks], axis=3).tobytes() != want:   # moved: the bytes kept
                raise RuntimeError(f"{row}: the history read is not the KV kept")
            if i:
                out[row].append(seconds)
        if i:
            out["socket"].append(sock)
        ray.get(net.edges["far-0"].drop_conversations.remote(TENANT, token=admin), timeout=60)
    if histories["conversation-http"].counters["fetches_http"] != args.reps + 1 or \
            histories["conversation-ray"].counters.get("fetches_http", 0):
        raise RuntimeError("the conversation rows did not read over the paths they are named for")
    return out


def across_hosts(args, kv, tokens, cap_bps) -> int:
    """The same KB read across a link between two hosts (kdn.testing.netns): the edge on the
    far host, the readers here. Rows: the bare socket from the far host (the link's ceiling
    for one connection), the same hashed, KDN's HTTP frames from the far edge, Ray's pull of
    the far edge's answer into a worker on this host, the same worker's Client on its default
    data plane (kdn.client.dataplane: the far edge's HTTP frames), and an edge here pulling
    from the far edge (peer pulls) on each data plane (kdn/edge/dataplane.py), interleaved
    rep by rep with one bare-socket transfer each (socket-beside: the peer pulls' ratios are
    to it, so a noisy minute hits both alike); the client row likewise, each fetch preceded by
    one bare-socket transfer in the same worker (socket-beside-client: client_over_socket_beside);
    then a conversation's history kept at the far edge, read here for its next turn over each
    path (conversation_reads), after one bare-socket transfer each (socket-beside-conversation);
    last, the origin (on this host) pushing a KB to an edge on the far host, pulled from the
    origin's HTTP frames and over Ray, alternately, after one bare-socket transfer each
    (socket-beside-push; origin_pushes)."""
    import secrets
    from kdn.testing.netns import HostCluster, available
    why = available()
    if why:
        print(f"--hosts: {why}", file=sys.stderr)
        return 2
    from kdn.launch.cluster import start_network, stop_network
    from kdn.client import Client
    from kdn.client.http import HTTPEdges
    from kdn.client.reader import Reader
    from kdn.placement.topology import Topology
    import ray
    total = kv.nbytes
    admin, read = secrets.token_hex(16), secrets.token_hex(16)
    tmp = tempfile.mkdtemp(prefix="kdn-bench-transport-")
    # the far edge holds every KB published (a KB per rep for each reader), all in its main tier
    far_bytes = int(((len(PEER_EDGES) + 1) * (args.reps + 1) + 2) * total / 0.7)
    cluster = HostCluster(HOST_REGIONS, cpus=1, object_store_bytes=far_bytes + 4 * total,
                          cores="own" if args.own_cores else None)
    net, rows, res = None, [], {}
    try:
        far = cluster.hosts
        if args.cap:
            far.cap("far", args.cap)
        resent = {"here": far.retransmitted(), "far": far.retransmitted("far")}
        # one edge, on the far host: it owns every chunk, so every byte read here crosses the link
        near, far_region = HOST_REGIONS
        # ... and edges on this host that pull from it (peer pulls), one per data plane; out of
        # the ring (below), so they own nothing and keep nothing: every pull crosses the link
        topo = Topology({r: (0.2, 10.0) for r in HOST_REGIONS}, {(near, far_region): (1.0, 10.0)},
                        [("far-0", far_region, far_bytes)]
                        + [(name, near, 1 << 30) for name, _, _ in PEER_EDGES], near,
                        source="bench transport --hosts", options={n: o for n, o, _ in PEER_EDGES if o})
        net = start_network(topo, Path(tmp) / "origin", network=f"bench-hosts-{uuid.uuid4().hex[:6]}",
                            http=True, replicas=1, auth={"admin": admin, "readers": {TENANT: read}},
                            edge_options={"http_host": "node"})
        url = ray.get(net.edges["far-0"].ping.remote())["http"]
        pub = Client(network=net.name, region="far", tenant=TENANT, fingerprint=FINGERPRINT, admin_token=admin)
        for name, _, _ in PEER_EDGES:
            pub.remove_edge(name, kill=False)
        ring = ray.get(net.origin.membership.remote(token=admin))
        for name, _, _ in PEER_EDGES:        # told at once (else at their next refresh)
            ray.get(net.edges[name].set_membership.remote(ring, token=admin))
        pub.publish("transport", [("blob", tokens)], kv)
        # Ray's rows read a KB of their own per rep (the same bytes under other keys): cold pulls
        rng = np.random.default_rng(1)
        token_sets = [rng.integers(0, 49152, len(tokens)).tolist() for _ in range(args.reps + 1)]
        for i, toks in enumerate(token_sets):
            pub.publish(f"transport-{i}", [("blob", toks)], kv)
        peer_kbs = {}                        # edge -> the keys of its own KBs, one per rep
        for name, _, _ in PEER_EDGES:
            peer_kbs[name] = []
            for i in range(args.reps + 1):
                kb = f"peer-{name}-{i}"
                pub.publish(kb, [("blob", rng.integers(0, 49152, len(tokens)).tolist())], kv)
                peer_kbs[name].append(pub.manifest(kb).keys)
        ray.get(net.origin.pushes_settled.remote(token=admin), timeout=600)   # the far edge holds all
        h = Reader(HTTPEdges([url], token=read, allow_remote=True, timeout_s=120), TENANT, FINGERPRINT,
                   token=read)
        f = h.fetch(tokens)                          # the far edge pulls what the ring put elsewhere
        digests = [xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")) for c in f.chunks]
        want = [xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(kv[:, :, :, s:s + TOKENS])).cast("B"))
                for s in range(0, kv.shape[3], TOKENS)]
        if digests != want:
            raise RuntimeError("HTTP fetch across the link returned other bytes than published")

        def beside(name, what, measure):
            """measure(link) with a bare-socket link of its own to the far host, its transfers
            recorded as row `name`: the ceiling of `what` in the same minutes."""
            link = SocketLink(total, piece, host=far.address("far"), prefix=prefix)
            try:
                got = measure(link)
            finally:
                link.close()
            record(name, "recv_into", got["socket"],
                   f"bare TCP again, one transfer before each rep of {what} below: their ceiling")
            return got

        def record(name, client, times, note):
            med = median(times)
            res[name] = gbps(total, med)
            rows.append({"transport": name, "client": client, "GB/s": res[name], "median_ms": med * 1e3,
                         "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3, "note": note})

        piece = total // args.chunks
        prefix = cluster.command("far", [])
        record("socket", "recv_into", bare_socket(total, args.reps, piece, host=far.address("far"), prefix=prefix),
               "bare TCP from the far host: one connection's ceiling on this link")
        record("socket+xxh3", "recv_into + xxh3",
               bare_socket(total, args.reps, piece, verify=True, host=far.address("far"), prefix=prefix),
               "the same, each piece hashed as it arrives")
        del f
        times, sources = timed_fetches(h, tokens, args.reps)
        h.view.close()
        record("http", "Reader over HTTPEdges", times,
               f"the far edge's frames, every one verified; sources {','.join(sorted(sources))}")
        worker = ray.remote(num_cpus=0)(_ray_cold_worker).options(label_selector={"region": "near"})
        got = ray.get(worker.remote(net.name, token_sets, digests, "far", read), timeout=600)
        if not got["ok"] or got["nbytes"] != total:
            raise RuntimeError(f"Ray fetch across the link returned other bytes ({got['nbytes']} B)")
        record("ray", "Client.fetch (worker here)", got["times"],
               f"the far edge's answer pulled by Ray across the link, a KB never pulled before each rep; "
               f"sources {','.join(got['sources'])}")
        got = ray.get(worker.remote(net.name, token_sets, digests, "far", read, "auto",
                                    (total, piece, far.address("far"), prefix)), timeout=600)
        if not got["ok"] or got["nbytes"] != total:
            raise RuntimeError(f"the default fetch across the link returned other bytes ({got['nbytes']} B)")
        if got["over_http"] < len(token_sets):
            raise RuntimeError(f"the default data plane read {got['over_http']} of {len(token_sets)} KBs over "
                               f"HTTP frames: the row would be mislabelled")
        record("client", "Client.fetch (worker here)", got["times"],
               "the same KBs, the reader's default data plane: the far edge's HTTP frames "
               "(kdn.client.dataplane)")
        record("socket-beside-client", "recv_into (worker here)", got["socket"],
               "bare TCP in the same worker, one transfer before each of the client row's fetches: "
               "its ceiling in the same minute")
        got = ray.get(worker.remote(net.name, token_sets, digests, "far", read, "auto",
                                    (total, piece, far.address("far"), prefix), 1), timeout=600)
        if not got["ok"] or got["nbytes"] != total or got["over_http"] < len(token_sets):
            raise RuntimeError(f"the one-connection fetch across the link returned other bytes "
                               f"({got['nbytes']} B) or went over Ray")
        record("client-1stream", "Client.fetch (worker here)", got["times"],
               "the same, each fetch over one connection instead of the default's 2")
        record("socket-beside-client-1stream", "recv_into (worker here)", got["socket"],
               "bare TCP in the same worker, one transfer before each of the row above's fetches")
        pulled = beside("socket-beside", "the peer pulls",
                        lambda link: peer_pulls(net, peer_kbs, pub.ns, digests, read, admin, link))
        for name, _, row in PEER_EDGES:
            times, measured, waited = pulled[name]
            record(row, f"edge {name} pulls from far-0", times,
                   "an edge here pulls a KB it never held from the far edge; a Ray reader here "
                   "takes the objects")
            if measured is not None:     # the data plane alone: request to the last frame verified
                res[row + "-pull"] = measured
                rows.append({"transport": row + "-pull", "client": f"edge {name}'s own timing",
                             "GB/s": measured, "median_ms": total / measured / 1e6, "min_ms": None,
                             "max_ms": None, "note": "the same pulls, as the edge timed them: "
                                                     "request sent to last frame verified, all reps; "
                                                     f"{waited:.0%} of it before the first byte"})
        conversed = beside("socket-beside-conversation", "the conversation reads",
                           lambda link: conversation_reads(args, net, kv, admin, read, link))
        for row, plane in CONVERSATION_PLANES:
            record(row, "History.fetch (here)", conversed[row],
                   "a conversation kept at the far edge, its history read here for the next turn "
                   + ("over the far edge's HTTP frames (the default data plane)" if plane == "auto"
                      else "over Ray (data_plane ray)") + ", every chunk verified")
        stop_network(net)                    # its far edge's memory, for the pushes' networks
        net = None
        pushed = beside("socket-beside-push", "the pushes",
                        lambda link: origin_pushes(args, cluster, kv, admin, read, link))
        split = pushed["http_split"]
        print(f"origin-push-http, as far-0 timed it (all reps with the warm-up): pulling the frames "
              f"{split['pull_us'] / 1e3:.0f} ms, keeping the copies {split['keep_us'] / 1e3:.0f} ms, "
              f"then copying them into the store after the answer {split['adopt_us'] / 1e3:.0f} ms; "
              f"received into memory used before {split['reused']} times, into new {split['new']}")
        split = pushed["ray_split"]
        print(f"origin-push-ray, as far-0 timed it (all reps with the warm-up): keeping the arguments' "
              f"copies {split['keep_us'] / 1e3:.0f} ms, then copying them into the store after the answer "
              f"{split['adopt_us'] / 1e3:.0f} ms")
        behind = beside("socket-beside-write-behind", "the write-behind",
                        lambda link: write_behind(args, kv, admin, read, link))
        split = behind["store_split"]
        print(f"edge-store-http, as far-0 timed it (all reps with the warm-up): receiving and verifying the "
              f"frames {split['receive'] / 1e3:.0f} ms, keeping them {split['keep'] / 1e3:.0f} ms")
        published = beside("socket-beside-publish", "the publishes",
                           lambda link: far_publishes(args, kv, admin, read, link))
        split = published["http_split"]
        print(f"publish-http, as the origin timed it (all reps with the warm-up): receiving and verifying the "
              f"frames {split['receive'] / 1e3:.0f} ms, storing them durably {split['store'] / 1e3:.0f} ms")
        for row, plane, _ in PUBLISH_PLANES:
            record(row, "publisher on the far host", published[row],
                   "a KB published from a worker on the far host to the origin here "
                   + ("as frames to the origin's HTTP server (the default data plane)" if plane == "auto"
                      else "over Ray (data_plane ray)")
                   + "; the publisher's time from sending the chunks to the answer (durable)")
        for store_row, plane in EDGE_STORE_ROWS.values():
            record(store_row, "writer here, ack edge", behind[store_row],
                   "the same objects stored from this host at the edge on the far host "
                   + ("as frames to far-0's HTTP server (the default data plane)" if plane == "auto"
                      else "over Ray (data_plane ray)")
                   + "; the writer's time from the call to far-0's answer (held in its memory)")
        for row, _, path in WRITE_BEHIND_PLANES:
            record(row, "origin takes far-0's stores", behind[row],
                   "objects stored at the edge on the far host (ack edge), made durable here: "
                   + ("the origin pulls them from far-0's HTTP frames, each verified"
                      if path == "http" else "far-0 hands the origin references, Ray pulls them")
                   + "; the origin's time from asking to holding them")
        for row, host in ORIGIN_PLANES:
            record(row, "origin pushes to far-0", pushed[row],
                   "a KB published here, pushed by the origin to the edge on the far host "
                   + ("that pulls it from the origin's HTTP frames" if host else "over Ray")
                   + ", timed by the origin from its first batch's call to its last one's answer")
        resent = {"here": far.retransmitted() - resent["here"], "far": far.retransmitted("far") - resent["far"]}
    finally:
        if net is not None:
            stop_network(net)
        cluster.shutdown()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"between hosts {cluster.hosts.head} (here) and {cluster.address_of('far')} (far edge)"
          + (f", the far link capped at {args.cap} ({cap_bps / 1e9:.3f} GB/s)" if cap_bps else ", no cap")
          + ("; each host on CPUs of its own (" + ", ".join(f"{r} {sorted(c)}" for r, c in cluster.cores.items())
             + ")" if cluster.cores else "")
          + f"; TCP segments retransmitted during the run: {resent['here']} from here (every process "
            f"here, loopback too), {resent['far']} from the far host")
    table(rows, ["transport", "client", "GB/s", "median_ms", "min_ms", "max_ms", "note"])
    out = {"bench": "transport", "hosts": True, "cap": args.cap, "cap_gbps": cap_bps / 1e9 if cap_bps else None,
           "retransmitted_here": resent["here"], "retransmitted_far": resent["far"],
           "cores": {r: sorted(c) for r, c in cluster.cores.items()} if cluster.cores else None,
           "bytes": total, "chunks": args.chunks, "reps": args.reps,
           **{f"{k.replace('+', '_')}_gbps": v for k, v in res.items()},
           "http_over_socket": res["http"] / res["socket"], "ray_over_socket": res["ray"] / res["socket"],
           "http_over_ray": res["http"] / res["ray"],
           "client_over_socket": res["client"] / res["socket"], "client_over_ray": res["client"] / res["ray"],
           # the reader against the socket timed beside it, rep by rep, in the same worker
           "client_over_socket_beside": res["client"] / res["socket-beside-client"],
           "client_1stream_over_socket_beside": res["client-1stream"] / res["socket-beside-client-1stream"],
           "client_over_client_1stream": res["client"] / res["client-1stream"],
           # peer pulls against the socket timed beside them, rep by rep
           **{f"{row.replace('-', '_')}_over_socket": res[row] / res["socket-beside"]
              for row in res if row.startswith("peer")},
           "peer_http_over_peer_ray": res["peer-http"] / res["peer-ray"],
           # the origin's pushes against the socket timed beside them, rep by rep
           **{f"{row.replace('-', '_')}_over_socket": res[row] / res["socket-beside-push"]
              for row, _ in ORIGIN_PLANES},
           "origin_push_http_over_origin_push_ray": res["origin-push-http"] / res["origin-push-ray"],
           # an edge's write-behind against the socket timed beside it, rep by rep
           **{f"{row.replace('-', '_')}_over_socket": res[row] / res["socket-beside-write-behind"]
              for row, _, _ in WRITE_BEHIND_PLANES},
           "write_behind_http_over_write_behind_ray": res["write-behind-http"] / res["write-behind-ray"],
           # a writer's stores at the far edge against the same socket
           **{f"{row.replace('-', '_')}_over_socket": res[row] / res["socket-beside-write-behind"]
              for row, _ in EDGE_STORE_ROWS.values()},
           "edge_store_http_over_edge_store_ray": res["edge-store-http"] / res["edge-store-ray"],
           # a far publisher's writes against the socket timed beside them, rep by rep
           **{f"{row.replace('-', '_')}_over_socket": res[row] / res["socket-beside-publish"]
              for row, _, _ in PUBLISH_PLANES},
           "publish_http_over_publish_ray": res["publish-http"] / res["publish-ray"],
           # a conversation's history read across hosts against the socket timed beside it
           **{f"{row.replace('-', '_')}_over_socket": res[row] / res["socket-beside-conversation"]
              for row, _ in CONVERSATION_PLANES},
           "conversation_http_over_conversation_ray": res["conversation-http"] / res["conversation-ray"]}
    if cap_bps:
        out.update(http_over_cap=res["http"] * 1e9 / cap_bps, ray_over_cap=res["ray"] * 1e9 / cap_bps,
                   client_over_cap=res["client"] * 1e9 / cap_bps,
                   client_1stream_over_cap=res["client-1stream"] * 1e9 / cap_bps,
                   socket_over_cap=res["socket"] * 1e9 / cap_bps,
                   **{f"{row.replace('-', '_')}_over_cap": res[row] * 1e9 / cap_bps
                      for row in res if row.startswith(("peer", "origin", "write-behind", "edge-store", "publish",
                                                        "conversation"))})
    print("; ".join(f"{k} {v:.2f}x" for k, v in out.items() if k.endswith(("_over_socket", "_over_ray", "_over_cap"))))
    if args.json:
        emit_json(out)
    return 0
