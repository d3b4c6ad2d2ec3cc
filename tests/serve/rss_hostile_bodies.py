"""RSS of `kdn serve`'s processes under hostile request bodies and abandoned streams.

Not a test module (pytest collects test_*.py only): helpers that tests/serve/test_serve.py
uses, and a command that measures on a service of its own:

    .venv/bin/python tests/serve/rss_hostile_bodies.py                 # 8 x 300 MB, both ways
    .venv/bin/python tests/serve/rss_hostile_bodies.py --bodies 8 --mb 300 --abandoned 200 --every 20

It starts a local 3-region cluster and network, publishes the Bill of Rights with SmolLM2,
deploys the service in two regions (one replica each, 2 routers), then:
- sends `--bodies` concurrent POSTs of `--mb` MB to /v1/chat/completions, first with a
  Content-Length, then chunked (no Content-Length), and prints each process's RSS (Serve's
  HTTP proxy, each router replica, each region replica) before, at its peak while the
  bodies arrive (sampled every 0.1 s), and after, with every status the clients got;
- opens `--abandoned` streams, alternating regions, each left after its first chunk, and
  prints the processes' RSS every `--every` streams (warm-up or a leak).
Every request goes to 127.0.0.1.
"""
import argparse
import json
import sys
import threading
import time

import httpx
import psutil

MIB = 1 << 20
ADMIN = "admin-" + "a" * 32
READ = "read-default-" + "r" * 24


def _listens_on(p, port: int) -> bool:
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="tcp"))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def service_processes(network: str, port: int = None) -> dict:
    """{label: psutil.Process} of the service's processes on this machine: 'proxy' (Serve's
    HTTP proxy: the one listening on port, the service's), 'router#<pid>' and
    '<region>#<pid>' (replicas), found by the titles Ray gives its workers
    ('ray::ProxyActor', 'ray::ServeReplica:<app>:<deployment>')."""
    from kdn.serve.app import app_name
    prefix = f"ray::ServeReplica:{app_name(network)}:"
    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        title = " ".join(p.info["cmdline"] or [])
        if title.startswith("ray::ProxyActor"):
            if port is None or _listens_on(p, port):
                out["proxy"] = p
        elif title.startswith(prefix):
            deployment = title[len(prefix):].split()[0].split(".")[0]
            out[f"{deployment}#{p.pid}"] = p
    return out


def rss_mib(procs: dict) -> dict:
    """{label: RSS in MiB} of processes still alive."""
    out = {}
    for label, p in procs.items():
        try:
            out[label] = round(p.memory_info().rss / MIB, 1)
        except psutil.NoSuchProcess:
            pass
    return out


class PeakRSS:
    """Samples the processes' RSS every period_s in a thread while it is entered: .peak."""

    def __init__(self, procs: dict, period_s: float = 0.1):
        self.procs, self.period_s = procs, period_s
        self.peak = rss_mib(procs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.period_s):
            for label, mib in rss_mib(self.procs).items():
                self.peak[label] = max(self.peak.get(label, 0.0), mib)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def post_bodies(url: str, n: int, size: int, chunked: bool, token: str = READ,
                timeout_s: float = 300) -> list:
    """n concurrent POSTs of `size` bytes to url (Content-Length, or chunked in 1 MiB
    pieces): [(status or None, error code or exception text, seconds)] per request."""
    body = b" " * size
    piece = 1 << 20
    results = [None] * n

    def pieces():
        for i in range(0, size, piece):
            yield body[i:i + piece]

    def one(i):
        t0 = time.monotonic()
        try:
            with httpx.Client(timeout=timeout_s) as c:
                r = c.post(url, content=pieces() if chunked else body,
                           headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            try:
                code = r.json()["error"]["code"]
            except (ValueError, KeyError, TypeError):
                code = r.text[:80]
            results[i] = (r.status_code, code, round(time.monotonic() - t0, 2))
        except httpx.HTTPError as e:
            results[i] = (None, f"{type(e).__name__}: {e}"[:120], round(time.monotonic() - t0, 2))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    return results


def hostile_bodies(network: str, url: str, n: int, size: int, chunked: bool, settle_s: float = 2.0) -> dict:
    """RSS of the service's processes before, at peak while n bodies of size arrive, and after."""
    from urllib.parse import urlsplit
    procs = service_processes(network, urlsplit(url).port)
    before = rss_mib(procs)
    with PeakRSS(procs) as peak:
        results = post_bodies(url, n, size, chunked)
        time.sleep(settle_s)
    after = rss_mib(procs)
    return {"chunked": chunked, "bodies": n, "mb": size / 1e6, "results": results,
            "rss_mib": {k: {"before": before.get(k), "peak": peak.peak.get(k), "after": after.get(k),
                            "grew": round(after.get(k, 0) - before.get(k, 0), 1)} for k in sorted(procs)}}


def abandoned_streams(network: str, urls: list, n: int, every: int, token: str = READ,
                      model: str = None, max_tokens: int = 400) -> list:
    """n streams (round robin over urls) each left after its first chunk; the processes'
    RSS in MiB before and after every `every` streams: [{"streams", label: MiB, ...}]."""
    import openai
    from urllib.parse import urlsplit
    from kdn.engines.transformers.model import MODEL_NAME
    procs = service_processes(network, urlsplit(urls[0]).port)
    rows = [{"streams": 0, **rss_mib(procs)}]
    for i in range(n):
        c = openai.OpenAI(base_url=urls[i % len(urls)], api_key=token, max_retries=0, timeout=120)
        stream = c.chat.completions.create(model=model or f"{MODEL_NAME}@rights", max_tokens=max_tokens,
                                           stream=True,
                                           messages=[{"role": "user", "content": "Recite every amendment."}])
        for _ in stream:
            break
        stream.close()
        c.close()
        if (i + 1) % every == 0:
            time.sleep(1.0)            # the replicas see their callers go
            rows.append({"streams": i + 1, **rss_mib(procs)})
    return rows


def _table(report: dict) -> str:
    lines = [f"{report['bodies']} x {report['mb']:.0f} MB bodies, "
             f"{'chunked' if report['chunked'] else 'Content-Length'}:",
             f"  statuses: {sorted(str(r[0]) + ' ' + str(r[1])[:40] for r in report['results'])}",
             f"  {'process':<22}{'before':>9}{'peak':>9}{'after':>9}{'grew':>9}  (RSS MiB)"]
    for k, v in report["rss_mib"].items():
        lines.append(f"  {k:<22}{v['before'] or 0:>9.1f}{v['peak'] or 0:>9.1f}{v['after'] or 0:>9.1f}{v['grew']:>9.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bodies", type=int, default=8)
    ap.add_argument("--mb", type=float, default=300)
    ap.add_argument("--abandoned", type=int, default=0, help="streams to abandon after the bodies")
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import tempfile
    import uuid
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, free_ports, start_network
    from kdn.client.join import init_ray
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers.model import load_model
    from kdn.placement.topology import Topology
    from kdn.client.publish import publish_documents
    from kdn.serve import app as serve
    regions = ["us-east", "eu-west", "ap-south"]
    cluster = LocalCluster(regions, cpus=2, object_store_bytes=768 << 20)
    init_ray(cluster.address)
    out = {}
    try:
        name = f"rss{uuid.uuid4().hex[:6]}"
        auth = {"admin": ADMIN, "readers": {"default": READ}}
        topo = Topology.default_local(regions, edges_per_region=1, capacity_bytes=256 << 20)
        net = start_network(topo, tempfile.mkdtemp(prefix="kdn-rss-"), network=name, auth=auth)  # noqa: F841 (kept: its actors live while referenced)
        model = load_model()
        pub = Client(network=name, region="us-east", fingerprint=model.fingerprint, admin_token=ADMIN)
        publish_documents(pub, model, "rights", [("bill-of-rights", dict(bundled_documents())["bill-of-rights"])])
        del model
        info = serve.deploy(name, regions=["us-east", "eu-west"], port=free_ports(1)[0], auth=auth,
                            replica_cpus=0, routers=2)
        url = info["url"] + "/chat/completions"
        urls = list(info["regions"].values())
        # one answer through each region first: every process is warm before it is measured
        for u in urls:
            r = httpx.post(u + "/chat/completions", headers={"Authorization": f"Bearer {READ}"}, timeout=300,
                           json={"model": "smollm2-135m-instruct@rights", "max_tokens": 4,
                                 "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
        size = int(args.mb * 1e6)
        for chunked in (False, True):
            if args.bodies:
                rep = hostile_bodies(name, url, args.bodies, size, chunked)
                out["chunked" if chunked else "content_length"] = rep
                print(_table(rep), flush=True)
        if args.abandoned:
            rows = abandoned_streams(name, urls, args.abandoned, args.every)
            out["abandoned"] = rows
            labels = [k for k in rows[0] if k != "streams"]
            print(f"{args.abandoned} streams abandoned after their first chunk (RSS MiB):")
            print("  " + f"{'streams':>8}" + "".join(f"{k:>22}" for k in labels))
            for row in rows:
                print("  " + f"{row['streams']:>8}" + "".join(f"{row.get(k, 0):>22.1f}" for k in labels))
        if args.json:
            print(json.dumps(out))
        serve.undeploy(name)
    finally:
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
