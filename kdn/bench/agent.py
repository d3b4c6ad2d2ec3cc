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
- **cached**: conversation KV kept after each answer and read back by the next turn, same region;
- **moved**: the same, but from turn --move-at on the conversation is answered in another
  region, which reads the history from the first region's home edge across the link;
- **limit**: the same worker keeps each conversation's last engine cache in memory and
  computes only the new tokens: the best any cache can do (what vLLM's own prefix cache does
  inside one engine), measured here with the same kernels.

Per mode and turn: time to first token (p50, p99 over conversations), prompt and cached
tokens, the cached share of the tokens earlier turns computed (the last partial chunk
excepted: the goal is 95%), prefill tokens saved, and bytes moved. The baselines (off, kb) run
on the first --baseline-conversations conversations only (their prefill is the slow part);
every mode's greedy tokens are compared with off's on the conversations both ran.
"""
import argparse
import random
import tempfile
import time
import uuid

from kdn.bench import emit_json, p, table
from kdn.core.errors import BadRequest

REGIONS = ("us-east", "eu-west", "ap-south")
KB = "agent-bench"
KB_TOKENS = 1000
ANSWER_TOKENS = 32
MODES = ("off", "kb", "cached", "moved", "limit")
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

    def __init__(self, network: str, region: str):
        import torch
        torch.set_num_threads(1)
        from kdn.client import Client
        from kdn.engines.transformers.model import load_model
        from kdn.serve.chat import Chat
        self.model = load_model()
        client = Client(network=network, region=region, fingerprint=self.model.fingerprint)
        self.plain = Chat(self.model, client, history=False)
        self.history = Chat(self.model, client, history=True)
        self.manifest = client.manifest(KB)
        self.engine = {}          # conversation -> (tokens whose KV the cache holds, cache): limit

    def ready(self) -> bool:
        return True

    def turn(self, mode: str, conversation: str, messages: list, hints=()) -> dict:
        t0 = time.perf_counter()
        chat = self.history if mode in ("cached", "moved") else self.plain
        if mode == "limit":
            turn = self._from_engine(conversation, messages)
        else:
            turn = chat.begin(self.manifest, messages, ANSWER_TOKENS, fetch=mode != "off",
                              salt=f"{mode}/{conversation}", hints=hints)
        fetched = turn.history.get("chunks", 0) * 256 * self.model.kv_bytes_per_token
        steps, ttft = [], None
        for s in chat.stream(turn.prompt, turn.cache, turn.cached, ANSWER_TOKENS):
            if ttft is None:
                ttft = time.perf_counter() - t0
            steps.append(s)
        tokens = [s.token for s in steps if s.token is not None]
        text = "".join(s.text for s in steps)
        if mode in ("cached", "moved"):
            chat.keep(turn, tokens, text)
        elif mode == "limit":
            self.engine[conversation] = (turn.prompt + tokens, turn.cache)
        return {"ttft_s": ttft, "prompt": len(turn.prompt), "cached": turn.cached, "tokens": tokens,
                "text": text, "fetched_bytes": fetched, "region": turn.history.get("region")}

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


def run(conversations: int, turns: int, baseline: int, move_at: int, seed: int, log) -> dict:
    import ray
    from kdn.bench.ttft import knowledge_texts
    from kdn.client import Client
    from kdn.client.join import init_ray
    from kdn.client.publish import publish_documents
    from kdn.engines.transformers.model import load_model
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.placement.topology import Topology

    model = load_model(log=log)
    scripts = [conversation_script(seed + i, turns, model) for i in range(conversations)]
    cluster = net = None
    root = tempfile.mkdtemp(prefix="kdn-bench-agent-")
    try:
        cluster = LocalCluster(list(REGIONS), cpus=1, object_store_bytes=3 << 30)
        init_ray(cluster.address)
        topo = Topology.default_local(list(REGIONS), capacity_bytes=2 << 30)
        net = start_network(topo, root, network=f"bench-agent-{uuid.uuid4().hex[:6]}")
        pub = Client(network=net.name, region=REGIONS[0], fingerprint=model.fingerprint)
        text = knowledge_texts(model, [KB_TOKENS])[KB_TOKENS]
        r = publish_documents(pub, model, KB, [("knowledge", text)])
        log(f"network up, {KB} published ({r['tokens']} tokens)")
        remote = ray.remote(num_cpus=1)(Worker)
        workers = {reg: remote.options(label_selector={"region": reg}).remote(net.name, reg)
                   for reg in (REGIONS[0], REGIONS[2])}
        ray.get([w.ready.remote() for w in workers.values()])
        home, away = REGIONS[0], REGIONS[2]
        results = {m: [[None] * turns for _ in range(conversations)] for m in MODES}
        for mode in MODES:
            n = baseline if mode in ("off", "kb") else conversations
            history = [[] for _ in range(n)]
            t0 = time.perf_counter()
            for t in range(turns):
                for c in range(n):
                    history[c].append({"role": "user", "content": scripts[c][t]})
                    where = away if mode == "moved" and t >= move_at else home
                    hints = (home,) if where != home else ()
                    got = ray.get(workers[where].turn.remote(mode, f"c{c}", history[c], hints))
                    history[c].append({"role": "assistant", "content": got["text"]})
                    results[mode][c][t] = got
            log(f"{mode}: {n} conversations x {turns} turns in {time.perf_counter() - t0:.0f} s")
        return summarize(results, conversations, turns, baseline, r["tokens"], model.kv_bytes_per_token)
    finally:
        teardown(net, cluster, root)


def summarize(results: dict, conversations: int, turns: int, baseline: int, kb_tokens: int,
              kv_bytes_per_token: int) -> dict:
    """Per mode and turn: TTFT p50/p99, cached share of earlier tokens, saved prefill, bytes."""
    rows = []
    for mode, convs in results.items():
        done = [c for c in convs if c[0] is not None]
        for t in range(turns):
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
                         "fetched_bytes": sum(g["fetched_bytes"] for g in got)})
    same = {}
    for mode in MODES:
        pairs = [(a["tokens"], b["tokens"]) for ca, cb in zip(results["off"][:baseline], results[mode][:baseline])
                 for a, b in zip(ca, cb) if a is not None and b is not None]
        same[mode] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    return {"conversations": conversations, "turns": turns, "baseline_conversations": baseline,
            "kb_tokens": kb_tokens, "kv_bytes_per_token": kv_bytes_per_token, "rows": rows,
            "identical_to_off": same}


def report(out: dict, move_at: int) -> None:
    """The table: per turn, each mode's p50 time to first token, the cached share, and the
    two ratios the goals name (cached against the limit, recomputing against a moved turn)."""
    by = {(r["mode"], r["turn"]): r for r in out["rows"]}
    rows = []
    for t in range(1, out["turns"] + 1):
        c, lim, off, mv = by[("cached", t)], by[("limit", t)], by[("off", t)], by[("moved", t)]
        rows.append({"turn": t, **{f"{m} p50 s": f"{by[(m, t)]['ttft_p50_s']:.2f}" for m in MODES},
                     "cached p99 s": f"{c['ttft_p99_s']:.2f}", "cached share": f"{c['cached_share']:.1%}",
                     "cached/limit": f"{c['ttft_p50_s'] / lim['ttft_p50_s']:.2f}x",
                     "off/moved": f"{off['ttft_p50_s'] / mv['ttft_p50_s']:.1f}x",
                     "history MB": f"{mv['fetched_bytes'] / 1e6:.0f}"})
    table(rows)
    print(f"moved: turns {move_at + 1}.. answered in another region; identical greedy tokens to off: "
          + ", ".join(f"{m} {v:.0%}" for m, v in out["identical_to_off"].items() if v is not None))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench agent", description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=8, help="concurrent conversations (default 8)")
    ap.add_argument("--turns", type=int, default=6, help="turns each (default 6)")
    ap.add_argument("--baseline-conversations", dest="baseline", type=int, default=2,
                    help="conversations the off and kb baselines run (default 2)")
    ap.add_argument("--move-at", dest="move_at", type=int, default=None,
                    help="turn index from which 'moved' answers in another region (default turns // 2)")
    ap.add_argument("--seed", type=int, default=7, help="seed of the tool results (default 7)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    move_at = args.turns // 2 if args.move_at is None else args.move_at
    if args.conversations < 1 or args.turns < 2 or not 1 <= args.baseline <= args.conversations \
            or not 1 <= move_at < args.turns:
        raise BadRequest("need --conversations >= 1, --turns >= 2, 1 <= --baseline-conversations <= "
                         "--conversations and 1 <= --move-at < --turns")
    out = run(args.conversations, args.turns, args.baseline, move_at, args.seed,
              log=lambda m: print(m, flush=True))
    out["move_at"] = move_at
    if args.json:
        emit_json(out)
    report(out, move_at)
    return 0
