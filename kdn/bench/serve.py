"""`kdn bench serve`: the OpenAI-compatible service's time to first token and throughput.

On a 3-region network built for it (LocalCluster: a labelled Ray node per region, an origin
and an edge per region; torn down at the end), a KB of about 4k knowledge tokens is
published and `kdn serve` deployed (one replica per region). Then, per region:

- **API, KDN**: a streamed chat completion through the official openai client to
  /<region>/v1, timed from the request to the first chunk that carries text;
- **API, KDN off**: the same request with `kdn_fetch: false`, so the same service, replica and
  route compute the knowledge's KV (a full prefill, seconds, so in the first --off-reps
  reps only): `ttft_speedup` = off / KDN;
- **worker direct**: the same request handed to the region's deployment by a Serve handle,
  as the router hands it, without HTTP, the proxy or the router: what the API adds is
  API / direct - 1, and the goal is at most 15%.

The three alternate within each rep, so the machine's noise hits them alike; medians are
reported, and the greedy text of the API with and without KDN and of the worker direct
must be the same. Each replica has one CPU (Ray gives its torch one thread).

Then load: 1, 4 and 16 concurrent clients (threads, each with its own openai client) send
plain completions round-robin over the regions' routes; requests per second and p50/p99
latency per concurrency. Every answer must be 200 and carry the KB's cached tokens.
"""
import argparse
import json
import statistics
import sys
import threading
import time
import uuid

from kdn.bench import emit_json, median, p, table
from kdn.bench.harness import REGIONS, scratch_dir
from kdn.core.errors import BadRequest

KNOWLEDGE_TOKENS = 4096
QUESTION = "In one sentence: what do the documents above say about the powers of Congress?"
CONCURRENCY = (1, 4, 16)
GOAL_OVERHEAD = 0.15
KB = "serve-bench"


def _sse_objects(raw: bytes):
    """The JSON objects in one or more SSE events (`data: {...}\\n\\n`), [DONE] skipped."""
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def api_ttft(client, model: str, question: str, max_tokens: int, fetch: bool = True) -> tuple:
    """(seconds to the first text, text, cached tokens) of a streamed completion via HTTP."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True},
        extra_body=None if fetch else {"kdn_fetch": False})
    first, text, cached = None, [], None
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(c.choices[0].delta.content)
        if c.usage is not None:
            cached = c.usage.prompt_tokens_details.cached_tokens
    return first, "".join(text), cached


def direct_ttft(handle, body: dict, tenant: str = "default", token=None) -> tuple:
    """(seconds to the first text, text, cached tokens) of the same request handed straight
    to a region's deployment (what the router does after HTTP and its checks)."""
    t0 = time.perf_counter()
    gen = handle.options(stream=True).stream.remote(body, tenant, token)
    first, text, cached = None, [], None
    head = next(gen)
    if head["status"] != 200:
        raise BadRequest(f"the worker refused the request: {head}")
    for raw in gen:
        for obj in _sse_objects(raw):
            delta = obj["choices"][0]["delta"] if obj.get("choices") else {}
            if delta.get("content"):
                if first is None:
                    first = time.perf_counter() - t0
                text.append(delta["content"])
            if obj.get("usage"):
                cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first, "".join(text), cached


def measure_ttft(base_url: str, handle, model: str, question: str, reps: int, max_tokens: int,
                 kb_tokens: int, off_reps: int = 2, log=lambda m: None, token: str = None,
                 tenant: str = "default") -> dict:
    """One region: API with KDN, the worker direct (reps each) and API with KDN off (the
    first off_reps reps: a full prefill costs seconds); medians and ratios. token: the
    tenant's read token where the network has one (the API's key; handed to the worker direct)."""
    import openai
    from kdn.serve.api import parse_chat
    client = openai.OpenAI(base_url=base_url, api_key=token or "none", max_retries=0, timeout=600)
    body = dict(parse_chat({"model": model, "messages": [{"role": "user", "content": question}],
                            "max_tokens": max_tokens, "stream": True}, model.partition("@")[0]).__dict__)
    api_ttft(client, model, question, max_tokens)                 # untimed: connections, paths warm
    direct_ttft(handle, body, tenant, token)
    api, off, direct, same = [], [], [], []
    for i in range(reps):
        order = [("api", True), ("direct", None)] + ([("off", False)] if i < off_reps else [])
        order = order[i % len(order):] + order[:i % len(order)]    # rotate who goes first
        got = {}
        for what, fetch in order:
            if what == "direct":
                got[what] = direct_ttft(handle, body, tenant, token)
            else:
                got[what] = api_ttft(client, model, question, max_tokens, fetch)
        for what in ("api", "direct"):
            if got[what][2] != kb_tokens:
                raise BadRequest(f"{what}: {got[what][2]} cached tokens, the KB has {kb_tokens}")
        api.append(got["api"][0])
        direct.append(got["direct"][0])
        same.append(got["api"][1] == got["direct"][1])
        line = f"  rep {i + 1}/{reps}: API {got['api'][0] * 1000:.0f} ms, direct {got['direct'][0] * 1000:.0f} ms"
        if "off" in got:
            if got["off"][2] != 0:
                raise BadRequest(f"with kdn_fetch off, {got['off'][2]} tokens were still cached")
            off.append(got["off"][0])
            same.append(got["api"][1] == got["off"][1])
            line += f", API without KDN {got['off'][0] * 1000:.0f} ms"
        log(line)
    a, d, o = median(api), median(direct), median(off)
    return {"api_ttft_s": a, "direct_ttft_s": d, "no_kdn_ttft_s": o, "ttft_speedup": o / a,
            "api_overhead": a / d - 1, "api_added_ms": (a - d) * 1000, "same_text": all(same),
            "api_all_s": api, "direct_all_s": direct, "no_kdn_all_s": off}


def load(urls, model: str, question: str, clients: int, per_client: int, max_tokens: int,
         kb_tokens: int, token: str = None) -> dict:
    """`clients` threads each send `per_client` plain completions, client i to urls[i % n]:
    requests per second over the whole run and latency percentiles."""
    import openai
    lat, bad = [], []
    lock = threading.Lock()
    go = threading.Barrier(clients + 1)

    def one(i):
        c = openai.OpenAI(base_url=urls[i % len(urls)], api_key=token or "none", max_retries=0, timeout=600)
        c.models.list()                                          # connection up before the clock
        go.wait()
        for _ in range(per_client):
            t0 = time.perf_counter()
            try:
                r = c.chat.completions.create(model=model, max_tokens=max_tokens,
                                              messages=[{"role": "user", "content": question}])
            except openai.APIError as e:
                with lock:
                    bad.append(f"{type(e).__name__}: {e}")
                continue
            dt = time.perf_counter() - t0
            with lock:
                if r.usage.prompt_tokens_details.cached_tokens != kb_tokens:
                    bad.append(f"cached_tokens {r.usage.prompt_tokens_details.cached_tokens} != {kb_tokens}")
                lat.append(dt)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"clients": clients, "requests": clients * per_client, "ok": len(lat), "errors": bad[:5],
            "n_errors": len(bad), "wall_s": wall, "rps": len(lat) / wall,
            "p50_s": p(lat, 50), "p99_s": p(lat, 99), "mean_s": statistics.fmean(lat) if lat else None}


def run(regions, tokens: int, reps: int, off_reps: int, concurrency, per_client: int, max_tokens: int,
        log) -> dict:
    import ray
    from ray import serve as ray_serve
    from kdn.serve import app as serve
    from kdn.bench.ttft import knowledge_texts
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, free_ports, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.engines.transformers.model import load_model
    from kdn.placement.topology import Topology
    from kdn.client.publish import publish_documents

    model = load_model(log=log)
    text = knowledge_texts(model, [tokens])[tokens]
    cluster = net = None
    root = scratch_dir("kdn-bench-serve-")
    try:
        t0 = time.perf_counter()
        cluster = LocalCluster(list(regions), cpus=2)
        init_ray(cluster.address)
        topo = Topology.default_local(list(regions), capacity_bytes=1 << 30)
        net = start_network(topo, root, network=f"bench-serve-{uuid.uuid4().hex[:6]}")
        pub = Client(network=net.name, region=regions[0], fingerprint=model.fingerprint)
        r = publish_documents(pub, model, KB, [("knowledge", text)])
        log(f"network up and {KB} published ({r['tokens']} tokens) in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        info = serve.deploy(net.name, regions=list(regions), port=free_ports(1)[0],
                            max_queued_requests=4 * max(concurrency))
        log(f"service up in {time.perf_counter() - t0:.1f} s: {info['url']}")
        name = f"{model.name}@{KB}"
        rows = []
        for region in regions:
            log(f"{region}: time to first token, {reps} reps")
            handle = ray_serve.get_deployment_handle(region, app_name=serve.app_name(net.name))
            row = measure_ttft(info["regions"][region], handle, name, QUESTION, reps, max_tokens,
                               r["tokens"], off_reps, log)
            rows.append({"region": region, **row})
        loads = []
        for c in concurrency:
            got = load(list(info["regions"].values()), name, QUESTION, c, per_client, max_tokens, r["tokens"])
            log(f"{c} clients: {got['ok']}/{got['requests']} ok, {got['rps']:.2f} req/s, "
                f"p50 {got['p50_s']:.3f} s, p99 {got['p99_s']:.3f} s")
            loads.append(got)
        serve.undeploy(net.name)
        return {"model": model.name, "knowledge_tokens": r["tokens"],
                "kv_bytes": r["tokens"] * model.kv_bytes_per_token,
                "regions": rows, "load": loads, "ray": ray.__version__}
    finally:
        teardown(net, cluster, root)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench serve", description=__doc__.splitlines()[0])
    ap.add_argument("--regions", default=",".join(REGIONS), help="comma-separated (default: 3 regions)")
    ap.add_argument("--tokens", type=int, default=KNOWLEDGE_TOKENS, help="knowledge tokens (default 4096)")
    ap.add_argument("--reps", type=int, default=8, help="timed reps per region (median reported)")
    ap.add_argument("--off-reps", dest="off_reps", type=int, default=2,
                    help="of those, reps that also time the API with KDN off (a full prefill; default 2)")
    ap.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                    help="concurrent clients, comma-separated (default 1,4,16)")
    ap.add_argument("--requests-per-client", dest="per_client", type=int, default=4,
                    help="plain completions each client sends (default 4)")
    ap.add_argument("--max-tokens", dest="max_tokens", type=int, default=8, help="tokens per answer (default 8)")
    ap.add_argument("--quick", action="store_true", help="one region, 1k tokens, 2 reps, 1 and 4 clients")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    regions = [r for r in args.regions.split(",") if r]
    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c]
    except ValueError:
        raise BadRequest(f"--concurrency must be comma-separated ints, got {args.concurrency!r}") from None
    if args.quick:
        regions, args.tokens, args.reps, args.off_reps, concurrency = regions[:1], 1024, 2, 1, [1, 4]
    if (not regions or args.reps < 1 or not 1 <= args.off_reps <= args.reps or args.tokens < 64
            or args.per_client < 1 or args.max_tokens < 1 or not concurrency or min(concurrency) < 1):
        raise BadRequest("need regions, --reps >= 1, 1 <= --off-reps <= --reps, --tokens >= 64, "
                         "--requests-per-client >= 1, "
                         "--max-tokens >= 1 and concurrency >= 1")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    out = run(regions, args.tokens, args.reps, args.off_reps, concurrency, args.per_client, args.max_tokens,
              log)

    print(f"kdn serve, {out['model']} on CPU, {out['knowledge_tokens']} knowledge tokens, "
          f"{args.max_tokens}-token answers, median of {args.reps}")
    table([{"region": r["region"], "API ms": f"{r['api_ttft_s'] * 1000:.0f}",
            "worker direct ms": f"{r['direct_ttft_s'] * 1000:.0f}",
            "API adds": f"{r['api_added_ms']:.0f} ms ({100 * r['api_overhead']:+.0f}%)",
            "API, KDN off ms": f"{r['no_kdn_ttft_s'] * 1000:.0f}", "ttft speedup": f"{r['ttft_speedup']:.1f}x",
            "same text": "yes" if r["same_text"] else "NO"} for r in out["regions"]])
    print()
    table([{"clients": g["clients"], "requests": g["requests"], "ok": g["ok"], "req/s": f"{g['rps']:.2f}",
            "p50 s": f"{g['p50_s']:.3f}", "p99 s": f"{g['p99_s']:.3f}"} for g in out["load"]])
    worst = max(r["api_overhead"] for r in out["regions"])
    met = worst <= GOAL_OVERHEAD
    print(f"goal: the API adds at most {GOAL_OVERHEAD:.0%} to the worker's time to first token: "
          f"worst region {worst:+.1%}, {'met' if met else 'NOT met'}")
    ok = all(r["same_text"] for r in out["regions"]) and all(g["n_errors"] == 0 for g in out["load"])
    if args.json:
        emit_json({"bench": "serve", **out, "reps": args.reps, "max_tokens": args.max_tokens,
                   "goal": {"api_overhead_max": GOAL_OVERHEAD, "worst": worst, "met": met},
                   "ttft_speedup": {r["region"]: r["ttft_speedup"] for r in out["regions"]},
                   "rps": {str(g["clients"]): g["rps"] for g in out["load"]},
                   "p50_s": {str(g["clients"]): g["p50_s"] for g in out["load"]},
                   "p99_s": {str(g["clients"]): g["p99_s"] for g in out["load"]}})
    return 0 if ok else 1
