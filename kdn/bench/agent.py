"""`kdn bench agent`: agents' conversations, turn after turn, with and without conversation KV.

On a 3-region network built for it (a labelled Ray node per region, an edge in each, torn
down at the end), a KB of about 1,000 tokens is published, and one worker per region (a Ray
actor on that region's node with the real model, one thread, as a `kdn serve` replica
answers) answers agent conversations: each turn appends a tool result of 700-1,000 tokens
(deterministic from --seed) and asks for a 32-token answer, so the last turn stays inside
the model's 8,192-token context. Conversations go round-robin, one turn of each at a time,
so each one's history waits at the edge while the others run. Modes, in one run:

- **off**: no KDN at all (every turn's whole prompt computed);
- **kb**: the KB's KV from KDN, the conversation recomputed every turn (before conversations);
- **cached**: conversation KV kept after each answer and read back by the next turn by the same
  worker (replica), which also keeps its own engine cache of its last conversations
  (--replica-kv bytes, as a `kdn serve` replica does: kdn.serve.chat.Chat._local) and continues
  from it when no edge holds more;
- **replica**: the same, each turn answered by the region's other replica (a second worker on
  the same node), so every turn reads what the other one kept;
- **moved**: the same, but from turn --move-at on the conversation is answered in another
  region, which reads the history from the first region's home edge across the link;
- **limit**: the same worker keeps each conversation's last engine cache in memory and
  computes only the new tokens: the best any cache can do (what vLLM's own prefix cache does
  inside one engine), measured here with the same kernels;
- **vllm**: vLLM alone (the CPU build, no KDN, its own prefix caching on) answering the same
  conversations in one engine in this process: the single-engine anchor. Its kernels are not
  the transformers worker's, so its answers (and so its later prompts) may differ; its greedy
  tokens are not compared with off's. Skipped, and said, where vLLM is not installed.

Per mode and turn: time to first token (p50, p99 over conversations), prompt and cached
tokens, the cached share of the tokens earlier turns computed (the last partial chunk
excepted: the goal is 95%), prefill tokens saved, and bytes moved. The baselines (off, kb) run
on the first --baseline-conversations conversations only (their prefill is the slow part);
every mode's greedy tokens are compared with off's on the conversations both ran.

Then a load (--load-conversations, default 64, for --load-seconds): that many conversations at
once, short turns round-robin over the workers, with the tenant's conversation budget per edge
set low (--load-budget): the most conversation KV any edge held against that budget, what was
evicted, and every worker's and edge's RSS before and after.
"""
import argparse
import random
import resource
import time
import uuid

from kdn.bench import emit_json, p, table
from kdn.bench.harness import REGIONS, scratch_dir
from kdn.core.errors import BadRequest

KB = "agent-bench"
KB_TOKENS = 1000
ANSWER_TOKENS = 32
MODES = ("off", "kb", "cached", "replica", "moved", "limit", "vllm")
KDN_MODES = MODES[:-1]         # the modes the transformers workers answer
EDGE_CONVERSATION_BYTES = 3 << 30   # each edge's conversation tier (and the tenant's budget there)
WORDS = ("sensor", "valve", "pump", "relay", "queue", "disk", "shard", "replica", "batch", "cache",
         "socket", "thread", "ticket", "invoice", "order", "route", "region", "edge", "origin", "node")


def tool_result(rng: random.Random, model, lo: int = 700, hi: int = 1000) -> str:
    """A tool's output of lo..hi tokens: log-like lines with numbers and names."""
    target, lines = rng.randint(lo, hi), []
    while True:
        w = rng.sample(WORDS, 3)
        lines.append(f"{rng.randint(10, 23)}:{rng.randint(10, 59)} {w[0]}-{rng.randint(1, 99)} "
                     f"{w[1]}={rng.randint(0, 9999)} {w[2]} status={rng.choice(['ok', 'warn', 'fail'])}")
        text = "\n".join(lines)
        if len(model.encode(text)) >= target:
            return text


def conversation_script(seed: int, turns: int, model) -> list:
    """One conversation's user turns: tool results and a question each."""
    rng = random.Random(seed)
    return [f"Tool output (step {t + 1}):\n{tool_result(rng, model)}\n"
            f"Summarize what failed in one sentence." for t in range(turns)]


class Worker:
    """One region's worker: the model and a Chat per mode (a Ray actor on that region's node)."""

    def __init__(self, network: str, region: str, replica_kv: int):
        import torch
        torch.set_num_threads(1)
        from kdn.client import Client
        from kdn.engines.transformers.model import load_model
        from kdn.serve.chat import Chat
        self.model = load_model()
        client = Client(network=network, region=region, fingerprint=self.model.fingerprint)
        self.plain = Chat(self.model, client, history=False)
        self.history = Chat(self.model, client, history=True)
        from kdn.serve.router import EngineKV
        self.replica_kv = replica_kv
        self.history.conversation_kv = EngineKV(replica_kv)
        self.manifest = client.manifest(KB)
        self.engine = {}          # conversation -> (tokens whose KV the cache holds, cache): limit

    def ready(self) -> bool:
        return True

    def forget(self, replica_kv: int = None) -> dict:
        """Let go of every engine cache this worker keeps (between modes; replica_kv: its
        conversations' from now on); its counters."""
        from kdn.serve.router import EngineKV
        got = dict(self.history.counters)
        self.replica_kv = replica_kv or self.replica_kv
        self.history.conversation_kv = EngineKV(self.replica_kv)
        self.engine.clear()
        return got

    def rss(self) -> int:
        import psutil
        return psutil.Process().memory_info().rss

    def turn(self, mode: str, conversation: str, messages: list, hints=(), max_tokens: int = ANSWER_TOKENS) -> dict:
        t0 = time.perf_counter()
        chat = self.history if mode in ("cached", "replica", "moved") else self.plain
        before = {k: chat.counters[k] for k in ("fetch_s", "rebuild_s")}
        fresh0 = self.model.arena.counters["allocated_bytes"]
        faults0 = resource.getrusage(resource.RUSAGE_SELF)
        if mode == "limit":
            turn = self._from_engine(conversation, messages)
        else:
            turn = chat.begin(self.manifest, messages, max_tokens, fetch=mode != "off",
                              salt=f"{mode}/{conversation}", hints=hints, conversation=conversation)
        begin_s = time.perf_counter() - t0      # the prompt, its lookups, fetches and rebuild
        spent = {k: chat.counters[k] - v for k, v in before.items()}
        faults1 = resource.getrusage(resource.RUSAGE_SELF)
        # the memory behind the rebuild: fresh buffers the arena faulted in, page faults
        spent.update(fresh_bytes=self.model.arena.counters["allocated_bytes"] - fresh0,
                     minor_faults=faults1.ru_minflt - faults0.ru_minflt,
                     major_faults=faults1.ru_majflt - faults0.ru_majflt)
        fetched = (turn.history.get("chunks", 0) * 256 + turn.history.get("tail", 0)) * self.model.kv_bytes_per_token
        steps, ttft = [], None
        for s in chat.stream(turn.prompt, turn.cache, turn.cached, max_tokens):
            if ttft is None:
                ttft = time.perf_counter() - t0
            steps.append(s)
        tokens = [s.token for s in steps if s.token is not None]
        text = "".join(s.text for s in steps)
        if mode in ("cached", "replica", "moved"):
            chat.keep(turn, tokens, text)
        elif mode == "limit":
            self.engine[conversation] = (turn.prompt + tokens, turn.cache)
        return {"ttft_s": ttft, "prompt": len(turn.prompt), "cached": turn.cached, "tokens": tokens,
                "text": text, "fetched_bytes": fetched, "region": turn.history.get("region"),
                "engine": bool(turn.history.get("engine")), "begin_s": begin_s, **spent}

    def _from_engine(self, conversation: str, messages: list):
        """The turn over this worker's own cache of the conversation's last turn, cropped to
        what the new prompt repeats (the limit: nothing fetched, nothing rebuilt)."""
        from kdn.core.conversation import reproduced
        kept = self.engine.pop(conversation, None)
        turn = self.plain.begin(self.manifest, messages, ANSWER_TOKENS, fetch=kept is None)
        if kept is not None:
            tokens, cache = kept
            n = min(reproduced(tokens, turn.prompt), self.model.cache_tokens(cache), len(turn.prompt) - 1)
            self.model.crop(cache, n)
            turn.cache, turn.cached = cache, n
        return turn


def run(conversations: int, turns: int, baseline: int, move_at: int, seed: int, log,
        load_conversations: int = 0, load_seconds: float = 60.0, load_budget: int = 256 << 20,
        vllm: bool = True, replica_kv: int = 4 << 30, modes=MODES,
        edge_conversation_bytes: int = EDGE_CONVERSATION_BYTES) -> dict:
    import ray
    from kdn.bench.ttft import knowledge_texts
    from kdn.client import Client
    from kdn.client.join import init_ray
    from kdn.client.publish import publish_documents
    from kdn.engines.transformers.model import load_model
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.placement.topology import Topology
    from kdn.core.conversation import CONVERSATION_SHARE

    model = load_model(log=log)
    scripts = [conversation_script(seed + i, turns, model) for i in range(conversations)]
    cluster = net = None
    root = scratch_dir("kdn-bench-agent-")
    try:
        # the edges' conversation tier holds the run's whole working set (8 conversations of up
        # to ~6,400 tokens: 2.2 GB), as an operator sizing for these agents would
        cluster = LocalCluster(list(REGIONS), cpus=1, object_store_bytes=edge_conversation_bytes + (1 << 30))
        init_ray(cluster.address)
        topo = Topology.default_local(list(REGIONS), capacity_bytes=int(edge_conversation_bytes / CONVERSATION_SHARE))
        net = start_network(topo, root, network=f"bench-agent-{uuid.uuid4().hex[:6]}")
        pub = Client(network=net.name, region=REGIONS[0], fingerprint=model.fingerprint)
        text = knowledge_texts(model, [KB_TOKENS])[KB_TOKENS]
        r = publish_documents(pub, model, KB, [("knowledge", text)])
        log(f"network up, {KB} published ({r['tokens']} tokens)")
        pub.set_conversation_policy(budget_bytes=edge_conversation_bytes)
        remote = ray.remote(num_cpus=0)(Worker)     # turns run one at a time: no two compute at once
        workers = {(reg, i): remote.options(label_selector={"region": reg}).remote(net.name, reg, replica_kv)
                   for reg, i in ((REGIONS[0], 0), (REGIONS[0], 1), (REGIONS[2], 0))}
        ray.get([w.ready.remote() for w in workers.values()])
        home, away = REGIONS[0], REGIONS[2]
        results = {m: [[None] * turns for _ in range(conversations)] for m in MODES}
        for mode in [m for m in KDN_MODES if m in modes]:
            n = baseline if mode in ("off", "kb") else conversations
            history = [[] for _ in range(n)]
            ray.get([w.forget.remote() for w in workers.values()])
            t0 = time.perf_counter()
            for t in range(turns):
                for c in range(n):
                    history[c].append({"role": "user", "content": scripts[c][t]})
                    where = (away, 0) if mode == "moved" and t >= move_at else \
                        (home, t % 2 if mode == "replica" else 0)
                    hints = (home,) if where[0] != home else ()
                    got = ray.get(workers[where].turn.remote(mode, f"c{c}", history[c], hints))
                    history[c].append({"role": "assistant", "content": got["text"]})
                    results[mode][c][t] = got
            log(f"{mode}: {n} conversations x {turns} turns in {time.perf_counter() - t0:.0f} s")
        if load_conversations:
            load = load_phase({f"{r}/{i}": w for (r, i), w in workers.items()}, net.name,
                              load_conversations, load_seconds, load_budget, model, seed, log)
        for w in workers.values():
            ray.kill(w)
        if vllm and "vllm" in modes:
            results["vllm"] = vllm_alone(model, pub.manifest(KB).token_ids().tolist(), scripts, turns, log)
        out = summarize(results, conversations, turns, baseline, r["tokens"], model.kv_bytes_per_token)
        if load_conversations:
            out["load"] = load
        out["vllm"] = bool(vllm) and results["vllm"][0][0] is not None
        return out
    finally:
        teardown(net, cluster, root)


def vllm_alone(model, kb_tokens: list, scripts: list, turns: int, log) -> list:
    """The conversations answered by vLLM alone, in one engine in this process (prefix caching
    on, no KDN): per conversation and turn {ttft_s, prompt, cached, tokens, text}. The prompt is
    the KB's tokens (its manifest's) and the messages as the workers render them; the engine's own timing gives the
    time to first token. [[None]...] when vLLM is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        log("vllm: not installed, the anchor is skipped")
        return [[None] * turns for _ in scripts]
    import os
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from kdn.engines.vllm.run import ENGINE_DEFAULTS, greedy, model_folder
    from kdn.serve.chat import messages_tokens
    t0 = time.perf_counter()
    llm = LLM(model=model_folder(), **ENGINE_DEFAULTS)
    log(f"vllm: engine up in {time.perf_counter() - t0:.0f} s")
    out = [[None] * turns for _ in scripts]
    history = [[] for _ in scripts]
    t0 = time.perf_counter()
    try:
        for t in range(turns):
            for c, script in enumerate(scripts):
                history[c].append({"role": "user", "content": script[t]})
                prompt = kb_tokens + messages_tokens(model, history[c])
                w0 = time.perf_counter()
                o = llm.generate({"prompt_token_ids": prompt}, greedy(ANSWER_TOKENS), use_tqdm=False)[0]
                wall = time.perf_counter() - w0
                ttft = getattr(getattr(o, "metrics", None), "first_token_latency", 0.0) or wall
                text = o.outputs[0].text
                history[c].append({"role": "assistant", "content": text})
                out[c][t] = {"ttft_s": ttft, "prompt": len(prompt), "cached": o.num_cached_tokens or 0,
                             "tokens": list(o.outputs[0].token_ids), "text": text, "fetched_bytes": 0,
                             "region": None}
    finally:
        del llm
    log(f"vllm: {len(scripts)} conversations x {turns} turns in {time.perf_counter() - t0:.0f} s")
    return out


def load_phase(workers: dict, network: str, conversations: int, seconds: float, budget: int,
               model, seed: int, log) -> dict:
    """conversations at once for `seconds` (round-robin over the workers, short turns), with
    the tenant's conversation budget set to `budget` per edge: every process's RSS before and
    after, the most conversation KV any edge held, and what it evicted."""
    import psutil
    import ray
    from kdn.client import Client
    from kdn.serve.router import CONVERSATION_KV_BYTES
    ops = Client(network=network, region=REGIONS[0])
    ops.set_conversation_policy(budget_bytes=budget)
    ray.get([w.forget.remote(CONVERSATION_KV_BYTES) for w in workers.values()])   # as kdn serve's
    pids = {e["name"]: e["pid"] for e in ops.status()["edges"]}
    names = sorted(workers)

    def rss():
        out = {f"edge {n}": psutil.Process(pid).memory_info().rss for n, pid in pids.items()}
        out.update({f"worker {w}": ray.get(workers[w].rss.remote()) for w in names})
        return out
    before, most, turns = rss(), 0, 0
    rng = random.Random(seed)
    tools = [tool_result(rng, model, 200, 300) for _ in range(8)]
    history = [[] for _ in range(conversations)]
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        c = turns % conversations
        history[c].append({"role": "user", "content": f"({c}) {tools[(turns // conversations) % 8]}\nAnything failed?"})
        w = names[c % len(names)]
        got = ray.get(workers[w].turn.remote("cached", f"load{c}", history[c], (), 8))
        history[c].append({"role": "assistant", "content": got["text"]})
        turns += 1
        if turns % 8 == 0:
            most = max([most] + [e.get("conversations", {}).get("bytes", 0) for e in ops.status()["edges"]])
    after = rss()
    edges = ops.status()["edges"]
    most = max([most] + [e["conversations"]["bytes"] for e in edges])
    ops.set_conversation_policy(budget_bytes=EDGE_CONVERSATION_BYTES)
    log(f"load: {turns} turns of {conversations} conversations in {time.perf_counter() - t0:.0f} s")
    return {"conversations": conversations, "seconds": seconds, "turns": turns, "budget_bytes": budget,
            "most_conversation_bytes": most, "rss_before": before, "rss_after": after,
            "evicted": sum(e["conversations"].get("conv_evicted_budget", 0)
                           + e["conversations"].get("conv_evicted_capacity", 0) for e in edges)}


def summarize(results: dict, conversations: int, turns: int, baseline: int, kb_tokens: int,
              kv_bytes_per_token: int) -> dict:
    """Per mode and turn: TTFT p50/p99, cached share of earlier tokens, saved prefill, bytes."""
    rows = []
    for mode, convs in results.items():
        done = [c for c in convs if c[0] is not None]
        for t in range(turns if done else 0):     # a mode that did not run (vllm absent): no rows
            got = [c[t] for c in done]
            earlier = [c[t - 1]["prompt"] + len(c[t - 1]["tokens"]) if t else kb_tokens for c in done]
            reusable = [e // 256 * 256 if t else e for e in earlier]   # the last partial chunk excepted
            rows.append({"mode": mode, "turn": t + 1, "conversations": len(got),
                         "ttft_p50_s": p([g["ttft_s"] for g in got], 50),
                         "ttft_p99_s": p([g["ttft_s"] for g in got], 99),
                         "prompt_tokens": sum(g["prompt"] for g in got) / len(got),
                         "cached_tokens": sum(g["cached"] for g in got) / len(got),
                         "cached_share": sum(min(g["cached"], r) for g, r in zip(got, reusable)) / sum(reusable),
                         "saved_tokens": sum(g["cached"] for g in got),
                         "fetched_bytes": sum(g["fetched_bytes"] for g in got),
                         "engine_turns": sum(bool(g.get("engine")) for g in got),
                         # where the time before the prefill went (p50s): all of it, the fetches
                         # (KB and history), the cache's rebuild from them
                         **{f"{k}_p50_s": p([g.get(k, 0.0) for g in got], 50)
                            for k in ("begin_s", "fetch_s", "rebuild_s")},
                         # the memory behind the rebuilds: page faults (p50), fresh buffers (sum)
                         **{f"{k}_p50": p([g.get(k, 0) for g in got], 50) for k in ("minor_faults", "major_faults")},
                         "fresh_bytes": sum(g.get("fresh_bytes", 0) for g in got),
                         **{f"{k}_each": [g.get(k) for g in got]
                            for k in ("rebuild_s", "fresh_bytes", "minor_faults")}})
    same = {}
    for mode in KDN_MODES:                     # vLLM's own kernels answer differently: not compared
        pairs = [(a["tokens"], b["tokens"]) for ca, cb in zip(results.get("off", [])[:baseline],
                                                               results.get(mode, [])[:baseline])
                 for a, b in zip(ca, cb) if a is not None and b is not None]
        same[mode] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return {"conversations": conversations, "turns": turns, "baseline_conversations": baseline,
            "kb_tokens": kb_tokens, "kv_bytes_per_token": kv_bytes_per_token, "rows": rows,
            "identical_to_off": same}


def report(out: dict, move_at: int) -> None:
    """The table: per turn, each mode's p50 time to first token, the cached share, and the
    two ratios the goals name (cached against the limit, recomputing against a moved turn)."""
    from kdn.serve.router import CONVERSATION_KV_BYTES
    by = {(r["mode"], r["turn"]): r for r in out["rows"]}
    modes = [m for m in MODES if (m, 1) in by]

    def ratio(a, b, t, fmt="{:.2f}x"):
        if (a, t) not in by or (b, t) not in by:
            return "-"
        return fmt.format(by[(a, t)]["ttft_p50_s"] / by[(b, t)]["ttft_p50_s"])
    rows = []
    for t in range(1, out["turns"] + 1):
        c, mv, vl = by.get(("cached", t)), by.get(("moved", t)), by.get(("vllm", t))
        rows.append({"turn": t, **{f"{m} p50 s": f"{by[(m, t)]['ttft_p50_s']:.2f}" for m in modes},
                     **({"cached p99 s": f"{c['ttft_p99_s']:.2f}", "cached share": f"{c['cached_share']:.1%}",
                         "cached from engine": f"{c.get('engine_turns', 0)}/{c['conversations']}"} if c else {}),
                     "cached/limit": ratio("cached", "limit", t), "replica/limit": ratio("replica", "limit", t),
                     "off/moved": ratio("off", "moved", t, "{:.1f}x"),
                     **({"history MB": f"{mv['fetched_bytes'] / 1e6:.0f}"} if mv else {}),
                     **({"vllm cached share": f"{vl['cached_share']:.1%}"} if vl else {})})
    table(rows)
    if "vllm" not in modes:
        print("vllm: the single-engine anchor did not run (not in --modes, --no-vllm, or vLLM not installed)")
    print(f"moved: turns {move_at + 1}.. answered in another region; identical greedy tokens to off: "
          + ", ".join(f"{m} {v:.0%}" for m, v in out["identical_to_off"].items() if v is not None))
    ld = out.get("load")
    if ld:
        print(f"load: {ld['conversations']} conversations for {ld['seconds']:.0f} s, {ld['turns']} turns; "
              f"a tenant's budget of {ld['budget_bytes'] / 2**20:.0f} MiB per edge: at most "
              f"{ld['most_conversation_bytes'] / 2**20:.0f} MiB held, {ld['evicted']} chunks evicted; "
              f"each worker's own conversation cache {CONVERSATION_KV_BYTES / 2**30:.0f} GiB")
        table([{"process": k, "RSS before MiB": f"{v / 2**20:.0f}", "after MiB": f"{ld['rss_after'][k] / 2**20:.0f}"}
               for k, v in ld["rss_before"].items()])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench agent", description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    ap.add_argument("--turns", type=int, default=6, help="turns each (default 6)")
    ap.add_argument("--baseline-conversations", dest="baseline", type=int, default=2,
                    help="conversations the off and kb baselines run (default 2)")
    ap.add_argument("--move-at", dest="move_at", type=int, default=None,
                    help="turn index from which 'moved' answers in another region (default turns // 2)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the tool results (default 7)")
    ap.add_argument("--load-conversations", dest="load_conversations", type=int, default=64,
                    help="then this many conversations at once, short turns, for --load-seconds "
                         "(memory within budgets; 0: skip; default 64)")
    ap.add_argument("--load-seconds", dest="load_seconds", type=float, default=60.0)
    ap.add_argument("--load-budget", dest="load_budget", default="256MiB",
                    help="the tenant's conversation budget per edge during the load (default 256MiB)")
    ap.add_argument("--replica-kv", dest="replica_kv", default="4GiB",
                    help="each worker's own engine cache of its last conversations (default 4GiB: "
                         "every conversation of the default run; a `kdn serve` replica keeps 1GiB)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"the modes to run, comma-separated (default all: {','.join(MODES)})")
    ap.add_argument("--edge-conversation-bytes", dest="edge_conv", default="3GiB",
                    help="each edge's conversation tier and the tenant's budget there (default 3GiB: "
                         "the default run's working set fits)")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false",
                    help="skip the vLLM-alone anchor (an engine start, ~45 s, and ~2 GiB)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    from kdn.launch.cluster import parse_size
    load_budget = parse_size(args.load_budget, "--load-budget")
    replica_kv = parse_size(args.replica_kv, "--replica-kv")
    edge_conv = parse_size(args.edge_conv, "--edge-conversation-bytes")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or set(modes) - set(MODES):
        raise BadRequest(f"--modes takes a comma-separated list of {', '.join(MODES)}, got {args.modes!r}")
    move_at = args.turns // 2 if args.move_at is None else args.move_at
    if args.conversations < 1 or args.turns < 2 or not 1 <= args.baseline <= args.conversations \
            or not 1 <= move_at < args.turns:
        raise BadRequest("need --conversations >= 1, --turns >= 2, 1 <= --baseline-conversations <= "
                         "--conversations and 1 <= --move-at < --turns")
    if args.load_conversations < 0 or args.load_seconds <= 0:
        raise BadRequest("need --load-conversations >= 0 and --load-seconds > 0")
    out = run(args.conversations, args.turns, args.baseline, move_at, args.seed,
              log=lambda m: print(m, flush=True), load_conversations=args.load_conversations,
              load_seconds=args.load_seconds, load_budget=load_budget, vllm=args.vllm,
              replica_kv=replica_kv, modes=modes, edge_conversation_bytes=edge_conv)
    out["move_at"] = move_at
    if args.json:
        emit_json(out)
    report(out, move_at)
    return 0
