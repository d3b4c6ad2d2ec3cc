"""`kdn bench route`: KV-aware routing against Serve's default and an oracle, in one run.

Several KBs whose KV together exceeds what one replica's engine cache holds, R replicas in
one region (2 by default), a Zipf-skewed stream of requests; for each routing policy the
time to first token (p50, p99) and the engine-hit rate (requests whose KB's KV was already
in the replica's engine, so nothing was fetched):

- kv: kdn.serve.router.decide, the function `kdn serve`'s router runs, fed what the router
  is fed: the replicas' reports (what their EngineKV holds, every ROUTING_STATS_PERIOD_S)
  and where it sent each KB since;
- default: Serve's power of two choices (two replicas at random, the shorter queue);
- oracle: knows every replica's cache and queue at the moment of the request and picks the
  replica with the least expected time to first token.

What is measured and what is replayed. The costs are measured on this machine with the real
model (SmolLM2-135M) and a real network (a LocalCluster, an origin and an edge): each KB's
fetch from the edge, the cache rebuild, the question's prefill to the first token over the
rebuilt cache, and a decode step. The KBs are real text (windows of the bundled documents,
each starting elsewhere, so no two share a chunk key) and their KV is the model's own
prefill of it. A hit costs the first token only (the replica keeps its
rebuilt cache: kdn.serve.chat crops it back to the KB); a miss adds the fetch and the rebuild.
The request stream is then replayed through each policy on
one clock, each replica a FIFO queue with its own EngineKV (kdn.serve.router's cache, bytes
counted) whose service times are those measured costs. On 2 shared cores, R replicas and a
load generator running at once would measure their contention for the cores, not routing;
the live path (Serve, the router class, the replicas' reports) is tested in
tests/serve/test_serve.py. The same trace and seed go through every policy.

The bound, printed beside the result (`bound`): on an idle replica a hit's first token is the
question's prefill over the cached KV, a miss's the same plus fetch and rebuild, so a hit is
only 1 + (fetch + rebuild) / first token faster than a miss. That ratio is the most routing
gains by turning misses into hits; beyond it only shorter queues help. On 2 CPU cores the
question's prefill dwarfs fetch and rebuild (the ratio measured 1.08-1.09), so the goal of
1.3x over Serve's default is out of reach here, whatever the router does.
"""
import argparse
import collections
import random
import sys
import time
import uuid

from kdn.bench import emit_json, median, p, table
from kdn.bench.harness import scratch_dir

REGION = "local"
GOAL_HIT_POINTS, GOAL_P50_SPEEDUP = 5.0, 1.3


def measure_costs(n_kbs: int, kb_tokens: int, question_tokens: int, reps: int, log) -> dict:
    """Per-request costs on the real model and network: fetch (per KB), rebuild, first token,
    decode step; and each KB's KV bytes."""
    from kdn.cli.knowledge import bundled_documents, bundled_questions
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, init_ray, start_network, teardown
    from kdn.engines.transformers.model import load_model
    from kdn.placement.topology import Topology
    import torch
    torch.set_num_threads(1)      # on shared cores one thread is steadier (see kdn bench ttft)
    model = load_model(log=log)
    kv_bytes = kb_tokens * model.kv_bytes_per_token
    cluster = net = None
    root = scratch_dir("kdn-bench-route-")
    try:
        cluster = LocalCluster([REGION], cpus=2, object_store_bytes=max(1 << 30, 3 * n_kbs * kv_bytes))
        init_ray(cluster.address)
        topo = Topology.default_local([REGION], capacity_bytes=max(1 << 30, 2 * n_kbs * kv_bytes))
        net = start_network(topo, root, network=f"bench-route-{uuid.uuid4().hex[:6]}")
        client = Client(network=net.name, region=REGION, fingerprint=model.fingerprint,
                        tenant="default")
        text = model.tokenizer.encode("\n\n".join(t for _, t in bundled_documents()), add_special_tokens=False)
        if len(text) < kb_tokens + n_kbs:
            raise SystemExit(f"--kb-tokens {kb_tokens} with {n_kbs} KBs needs more than the bundled "
                             f"documents' {len(text)} tokens")
        step = (len(text) - kb_tokens) // max(1, n_kbs - 1)
        t0 = time.perf_counter()
        for i in range(n_kbs):                  # real text, the model's own KV of it
            toks = text[i * step:i * step + kb_tokens]
            client.publish(f"route-{i}", [("d", toks)], model.prefill(toks).kv)
        log(f"published {n_kbs} KBs of {kb_tokens} tokens ({kv_bytes / 2**20:.0f} MiB of KV each; "
            f"prefilled in {time.perf_counter() - t0:.0f} s)")
        question = model.tokenizer.encode(" " + bundled_questions()[0], add_special_tokens=False)
        question = (question * (question_tokens // len(question) + 1))[:question_tokens]
        fetch, rebuild, first, step = [], [], [], []
        for i in range(n_kbs):
            ids = client.manifest(f"route-{i}").token_ids().tolist()
            prompt = ids + question
            for _ in range(reps):
                t0 = time.perf_counter()
                f = client.fetch(prompt, kb=f"route-{i}")
                t1 = time.perf_counter()
                cache = model.cache_from_kv(f.kv_parts(), len(prompt) - f.tokens + 8)
                t2 = time.perf_counter()
                g = model.generate(prompt, cache=cache, cached_tokens=f.tokens, max_new_tokens=4)
                fetch.append(t1 - t0)
                rebuild.append(t2 - t1)
                first.append(g.ttft_s)
                step.append((g.total_s - g.ttft_s) / max(1, len(g.tokens) - 1))
        costs = {"fetch_s": median(fetch), "rebuild_s": median(rebuild), "first_token_s": median(first),
                 "decode_step_s": median(step), "kv_bytes": kv_bytes}
        log("measured: " + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in costs.items() if k.endswith("_s")))
        return costs
    finally:
        teardown(net, cluster, root)


def zipf_trace(n_requests: int, n_kbs: int, s: float, rate_hz: float, seed: int) -> list:
    """(arrival time, KB index) of a Poisson stream whose KBs follow Zipf(s) over n_kbs."""
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** s for k in range(n_kbs)]
    kbs = list(range(n_kbs))
    rng.shuffle(kbs)                      # which KB is popular is not its index
    t, out = 0.0, []
    for _ in range(n_requests):
        t += rng.expovariate(rate_hz)
        out.append((t, rng.choices(kbs, weights)[0]))
    return out


def replay(policy: str, trace, costs: dict, replicas: int, cache_kbs: int, new_tokens: int,
           seed: int) -> dict:
    """TTFTs and engine hits of trace under policy (kv, default, oracle) on one clock."""
    from kdn.serve.router import ROUTING_STATS_PERIOD_S, EngineKV, decide
    rng = random.Random(seed)
    names = [f"replica-{i}" for i in range(replicas)]
    caches = {r: EngineKV(cache_kbs * costs["kv_bytes"]) for r in names}
    busy_until = {r: 0.0 for r in names}          # when its queue drains
    ends = {r: collections.deque() for r in names}  # end times of requests queued or running
    reported = {r: set() for r in names}          # what the router last heard (every period)
    recent, next_report = {}, 0.0
    hit_s = costs["first_token_s"]                         # the rebuilt cache kept: no fetch, no rebuild
    miss_s = costs["fetch_s"] + costs["rebuild_s"]          # on top of hit_s
    decode_s = costs["decode_step_s"] * max(0, new_tokens - 1)
    ttfts, hits, why, decide_s = [], 0, collections.Counter(), []
    for t, k in trace:
        kb = f"default/route-{k}"
        while next_report <= t:                   # the replicas' periodic reports
            for r in names:
                reported[r] = {e[0] for e in caches[r].entries}
            next_report += ROUTING_STATS_PERIOD_S
        for r in names:
            while ends[r] and ends[r][0] <= t:
                ends[r].popleft()
        queues = {r: len(ends[r]) for r in names}
        if policy == "kv":
            holders = {r for r in names if kb in reported[r]} | ({recent[kb]} if kb in recent else set())
            service = hit_s + decode_s + miss_s / 2
            t0 = time.perf_counter()
            chosen, w = decide(kb, queues, holders, service, miss_s)
            decide_s.append(time.perf_counter() - t0)
            why[w] += 1
            recent[kb] = chosen
        elif policy == "default":
            pair = rng.sample(names, 2) if replicas > 1 else names
            chosen = min(pair, key=lambda r: queues[r])
        else:                                     # oracle: least expected TTFT, knowing all
            def expected(r):
                held = (kb, None) in caches[r].entries
                return max(busy_until[r], t) + (0 if held else miss_s) + hit_s
            chosen = min(names, key=expected)
        hit = caches[chosen].get(kb, None) is not None
        if not hit:
            caches[chosen].put(kb, None, object(), costs["kv_bytes"], miss_s)
        start = max(busy_until[chosen], t)
        first = start + (0 if hit else miss_s) + hit_s
        busy_until[chosen] = first + decode_s
        ends[chosen].append(busy_until[chosen])
        ttfts.append(first - t)
        hits += hit
    out = {"policy": policy, "requests": len(trace), "ttft_p50_s": p(ttfts, 50),
           "ttft_p99_s": p(ttfts, 99), "ttft_mean_s": sum(ttfts) / len(ttfts),
           "engine_hit_pct": 100.0 * hits / len(trace)}
    if decide_s:
        out.update(decision_us_p50=p(decide_s, 50) * 1e6, decision_us_p99=p(decide_s, 99) * 1e6,
                   decisions=dict(why))
    return out


def bound(costs: dict, new_tokens: int) -> dict:
    """What any routing can win on these costs. An idle replica's first token is hit_s on a hit
    and hit_s + fetch + rebuild on a miss: their ratio (hit_speedup) is the most a policy that
    turns misses into hits gains on a request's time to first token; beyond it only shorter
    queues help, and those depend on how much longer a miss keeps a replica busy (service_ratio,
    with the answer's decode). goal_reachable: hit_speedup reaches GOAL_P50_SPEEDUP."""
    miss = costs["fetch_s"] + costs["rebuild_s"]
    busy = costs["first_token_s"] + costs["decode_step_s"] * max(0, new_tokens - 1)
    hit_speedup = 1 + miss / costs["first_token_s"]
    return {"hit_speedup": hit_speedup, "service_ratio": 1 + miss / busy,
            "goal_reachable": hit_speedup >= GOAL_P50_SPEEDUP}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench route", description=__doc__.split("\n\n")[0])
    ap.add_argument("--kbs", type=int, default=8, help="knowledge bases (default 8)")
    ap.add_argument("--kb-tokens", type=int, default=2048, help="tokens per KB (default 2048)")
    ap.add_argument("--replicas", type=int, default=2, help="replicas in the region (default 2)")
    ap.add_argument("--cache-kbs", type=int, default=2,
                    help="KBs one replica's engine cache holds (default 2: all KBs exceed it)")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--zipf", type=float, default=1.1, help="Zipf exponent of the KB mix")
    ap.add_argument("--load", type=float, default=0.7,
                    help="offered load: arrivals per second x a miss's service time / replicas")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens each answer generates")
    ap.add_argument("--reps", type=int, default=3, help="cost measurements per KB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.replicas < 2 or a.kbs <= a.cache_kbs:
        ap.error("needs --replicas >= 2 and more --kbs than --cache-kbs holds")

    def log(msg):
        print(msg, file=sys.stderr, flush=True)
    costs = measure_costs(a.kbs, a.kb_tokens, 32, a.reps, log)
    miss_s = costs["fetch_s"] + costs["rebuild_s"] + costs["first_token_s"] + \
        costs["decode_step_s"] * (a.new_tokens - 1)
    rate = a.load * a.replicas / miss_s
    trace = zipf_trace(a.requests, a.kbs, a.zipf, rate, a.seed)
    rows = [replay(pol, trace, costs, a.replicas, a.cache_kbs, a.new_tokens, a.seed)
            for pol in ("kv", "default", "oracle")]
    by = {r["policy"]: r for r in rows}
    verdict = {"hit_points_below_oracle": by["oracle"]["engine_hit_pct"] - by["kv"]["engine_hit_pct"],
               "p50_speedup_vs_default": by["default"]["ttft_p50_s"] / by["kv"]["ttft_p50_s"],
               "p99_speedup_vs_default": by["default"]["ttft_p99_s"] / by["kv"]["ttft_p99_s"],
               "oracle_p50_speedup_vs_default": by["default"]["ttft_p50_s"] / by["oracle"]["ttft_p50_s"],
               **bound(costs, a.new_tokens)}
    verdict["goal_met"] = (verdict["hit_points_below_oracle"] <= GOAL_HIT_POINTS
                           and verdict["p50_speedup_vs_default"] >= GOAL_P50_SPEEDUP)
    print(f"{a.kbs} KBs x {a.kb_tokens} tokens ({costs['kv_bytes'] / 2**20:.0f} MiB KV each), "
          f"{a.replicas} replicas caching {a.cache_kbs} KBs each, Zipf {a.zipf}, "
          f"{a.requests} requests at {rate:.2f}/s (load {a.load})")
    table([{k: v for k, v in r.items() if k != "decisions"} for r in rows],
          ["policy", "requests", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "engine_hit_pct"])
    print(f"kv vs oracle: {verdict['hit_points_below_oracle']:.1f} hit points below (goal <= "
          f"{GOAL_HIT_POINTS}); p50 {verdict['p50_speedup_vs_default']:.2f}x, p99 "
          f"{verdict['p99_speedup_vs_default']:.2f}x better than default (goal p50 >= {GOAL_P50_SPEEDUP}x); "
          f"kv decisions {by['kv']['decisions']}, decide() p50/p99 {by['kv']['decision_us_p50']:.0f}/"
          f"{by['kv']['decision_us_p99']:.0f} us")
    print(f"the bound on this machine: a miss adds fetch + rebuild "
          f"({(costs['fetch_s'] + costs['rebuild_s']) * 1000:.0f} ms) to a hit's first token "
          f"({costs['first_token_s'] * 1000:.0f} ms, the question's own prefill): with no queue a hit is "
          f"only {verdict['hit_speedup']:.2f}x faster than a miss, the most that turning misses into hits "
          f"gives a request; beyond it only shorter queues help, and a miss keeps a replica busy only "
          f"{verdict['service_ratio']:.2f}x as long as a hit. The goal (p50 >= {GOAL_P50_SPEEDUP}x default's) "
          f"is {'within' if verdict['goal_reachable'] else 'out of'} reach here: measured "
          f"{verdict['p50_speedup_vs_default']:.2f}x, the oracle {verdict['oracle_p50_speedup_vs_default']:.2f}x. "
          f"Routing has more to win where a miss costs a prefill (a conversation's history computed again).")
    if a.json:
        emit_json({"costs": costs, "rows": rows, "verdict": verdict, "args": vars(a)})
    return 0 if verdict["goal_met"] else 1
