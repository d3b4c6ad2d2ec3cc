"""`kdn bench fuzz`: hostile input against a real edge's HTTP API for --seconds (kdn.testing.fuzzer).

It starts a network of its own (two regions, an admin token and a read token for the fuzzed
tenant, so wrong and absent tokens are really refused, not merely ignored), publishes one
KB, and fuzzes one edge with every kind of kdn.testing.fuzzer case while a thread samples the edge
process's memory (psutil, on the pid /health reports). A few idle connections (half a
request line, or nothing) are held open meanwhile: the edge must close them within its
idle bound. It reports cases by kind and status (0 answers may be 5xx), the edge's peak RSS
against its RSS before, the idle connections closed, and whether the edge still serves the
right bytes with nothing it stores changed.
"""
import argparse
import secrets
import sys
import threading
import uuid

import numpy as np
import xxhash

from kdn.bench import emit_json, table
from kdn.bench.harness import scratch_dir
from kdn.testing.fuzzer import Fuzzer

MIB = 1 << 20


class PeakRSS:
    """Samples a process's resident memory in a thread; peak and first sample in bytes."""

    def __init__(self, pid: int, period_s: float = 0.05):
        import psutil
        self.proc, self.period_s = psutil.Process(pid), period_s
        self.first = self.peak = self.proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil
        while not self._stop.wait(self.period_s):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:     # the edge went away: the final check will say so
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _publish(net, regions, tenant, fp, admin, read, seed):
    from kdn.client import Client
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 49152, 1000).tolist()
    kv = rng.standard_normal((2, 2, 2, 1000, 16), dtype=np.float32)
    cl = Client(network=net.name, region=regions[0], tenant=tenant, fingerprint=fp, token=read,
                admin_token=admin)
    cl.publish("fuzzed", [("doc", tokens)], kv)
    keys = list(cl.manifest("fuzzed").keys)
    digests = {k: xxhash.xxh3_64_intdigest(np.ascontiguousarray(kv[:, :, :, s:s + 256]).tobytes())
               for k, s in zip(keys, range(0, 1000, 256))}
    return cl.ns, keys, digests


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="how long to fuzz")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-s", type=float, default=1.0, help="how long a slowloris case trickles")
    ap.add_argument("--idle-s", type=float, default=5.0, help="the edge's idle connection bound")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.seconds <= 0:
        ap.error(f"--seconds must be positive, got {args.seconds}")

    def log(msg):
        print(msg, file=sys.stderr if args.json else sys.stdout, flush=True)

    import ray
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.placement.topology import Topology
    regions = ("us-east", "eu-west")
    root = scratch_dir("kdn-bench-fuzz-")
    cluster = net = None
    try:
        cluster = LocalCluster(regions, cpus=1, object_store_bytes=256 << 20)
        init_ray(cluster.address)
        topo = Topology.default_local(list(regions), capacity_bytes=256 << 20)
        tenant, fp = "fuzz", "fuzz-synthetic"
        admin, read = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        net = start_network(topo, root, network=f"fuzz-{uuid.uuid4().hex[:6]}", http=True,
                            replicas=len(regions), auth={"admin": admin, "readers": {tenant: read}},
                            edge_options={"http_idle_s": args.idle_s})
        ns, keys, digests = _publish(net, regions, tenant, fp, admin, read, args.seed)
        url = ray.get(net.edge(f"{regions[0]}-0").ping.remote(token=admin), timeout=30)["http"]
        fz = Fuzzer(url, ns, keys, digests, tenant, fp, seed=args.seed, slow_s=args.slow_s,
                    regions=regions, token=read)
        fz.check()                          # one valid fetch first: every chunk local
        before = fz.state()
        log(f"fuzzing {url} for {args.seconds:.0f} s")
        idle = {}
        with PeakRSS(fz.health()["pid"]) as rss:
            waiter = threading.Thread(target=lambda: idle.update(fz.idle(4, args.idle_s + 10)))
            waiter.start()
            rep = fz.run(seconds=args.seconds)
            waiter.join()
        after, final = fz.state(), fz.check()
    finally:
        teardown(net, cluster, root)
    d = rep.to_dict()
    table([{"kind": k, "cases": n} for k, n in d["cases"].items()])
    print()
    table([{"status": s, "answers": n} for s, n in d["statuses"].items()])
    fivexx = sum(n for s, n in d["statuses"].items() if s.isdigit() and int(s) >= 500)
    print(f"{d['total']} cases in {d['seconds']:.1f} s; {len(d['problems'])} problems; {fivexx} "
          f"answers 5xx; {d['parser_refusals']} refused by the HTTP parser (plain text); slowest "
          f"/health during slowloris {d['health_ms_max']:.1f} ms; edge RSS {rss.first / MIB:.0f} "
          f"MiB before, peak {rss.peak / MIB:.0f} MiB; idle connections closed {idle.get('closed')}"
          f"/4 within {idle.get('seconds')} s; stored state "
          f"{'unchanged' if before == after else f'CHANGED {before} -> {after}'}; "
          f"after: {final or 'healthy, right bytes'}")
    for kind, what, problem in d["problems"][:20]:
        print(f"  {kind}: {what}: {problem}")
    d.update(state_before=before, state_after=after, state_unchanged=before == after,
             final_check=final or "ok", answers_5xx=fivexx, edge_rss_mib=rss.first / MIB,
             edge_peak_rss_mib=rss.peak / MIB, idle=idle)
    if args.json:
        emit_json(d)
    bad = d["problems"] or before != after or final or fivexx or idle.get("open")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
