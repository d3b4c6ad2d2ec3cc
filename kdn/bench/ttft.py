"""`kdn bench ttft`: time to first token with the knowledge's KV fetched from an edge, vs a full prefill.

A worker asked a 32-token question over N tokens of knowledge either prefills all N+32
tokens (what every engine does today) or fetches the knowledge's KV from the edge on its
own node, rebuilds the model's cache from it and prefills only the 32 question tokens
(KDN). This bench measures both in one run at 1k, 2k, 4k and 8k tokens of knowledge with
SmolLM2-135M-Instruct on this CPU, on a one-region network built for it (LocalCluster:
one labelled Ray node, an origin and one edge; torn down at the end).

What a speedup can be at most is measured in the same run, so the figure is judged against
this machine, not a guess: no KDN path can beat the question's own prefill over an already
built cache plus one memory copy of the KV bytes, so

    limit = full prefill TTFT / (question-only prefill over a built cache + memcpy of the KV)

and KDN's TTFT (fetch + cache rebuild + question prefill until the first token) is good
when its speedup is close to that limit. Each rep runs KDN, the plain prefill of the same
prompt (worker.answer with check=True) and the question alone over a built cache back to
back, so machine noise hits all three alike; the first generated token of KDN and of the
plain prefill is compared. On a busy machine, --threads 1 gives steadier figures: two
OpenMP threads that must share their cores with other processes stall each other.

Knowledge is the bundled public-domain documents (kdn/data), repeated as needed and cut to
exactly N tokens of system turn; the question is cut to exactly 32 tokens of user turn.
Each length is a prefix of the next and they are published shortest first, each reusing
the cached prefix of the one before, so publishing prefills about 8k tokens in all.
"""
import argparse
import sys
import time
import uuid

import numpy as np

from kdn.bench import emit_json, median
from kdn.bench.harness import row_at, scratch_dir, ttft_table
from kdn.core.errors import BadRequest

LENGTHS = (1024, 2048, 4096, 8192)
QUICK_LENGTHS = (1024, 2048)
QUESTION_TOKENS = 32
TARGET_LENGTH, TARGET_SPEEDUP = 4096, 30.0
REGION = "local"
QUESTION = ("Reading the documents above closely, which powers does the Constitution give to the "
            "President, who may hold that office, and for how long may they serve in it?")
# Text that adds one token at a time when the cut lands short of the exact count.
PADDING = (".", " a", ",", " the", "\n")


def fit(count, text: str, n_tokens: int) -> str:
    """A prefix of text (plus single-token padding) for which count(result) == n_tokens."""
    if count(text) < n_tokens:
        raise BadRequest(f"text of {count(text)} tokens is shorter than the {n_tokens} asked for")
    lo, hi = 0, len(text)                      # the longest character prefix with <= n tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:mid]) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    cut = text[:lo]
    while count(cut) > n_tokens and cut:       # token counts of prefixes are nearly monotone
        cut = cut[:-1]
    while count(cut) < n_tokens:
        have = count(cut)
        for pad in PADDING:
            if count(cut + pad) == have + 1:
                cut += pad
                break
        else:
            raise BadRequest(f"cannot pad {have} tokens to exactly {n_tokens}")
    return cut


def knowledge_texts(model, lengths) -> dict:
    """{n: text} whose knowledge turn is exactly n tokens; each a character prefix of the longest."""
    from kdn.cli.knowledge import bundled_documents
    base = "\n\n".join(text for _, text in bundled_documents())
    body = base
    while len(model.knowledge_tokens(body)) < max(lengths) + 64:
        body += "\n\n" + base
    count = lambda t: len(model.knowledge_tokens(t))
    return {n: fit(count, body, n) for n in lengths}


def question_text(model, n_tokens: int = QUESTION_TOKENS) -> str:
    return fit(lambda t: len(model.question_tokens(t)), QUESTION, n_tokens)


def memcpy_s(nbytes: int, reps: int = 5) -> float:
    """Median seconds to copy nbytes from one buffer to another (pages touched beforehand)."""
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def measure(client, model, kb: str, question: str, reps: int, log) -> dict:
    """One context length: KDN and full-prefill TTFT (interleaved reps) and the limit's terms."""
    from kdn.engines.transformers.worker import answer
    m = client.manifest(kb)
    prompt = m.token_ids().tolist() + model.question_tokens(question)
    warm = client.fetch(prompt, kb=kb)         # untimed: pages and object-store paths warm
    room = len(prompt) - warm.tokens + 1       # the question and the first token, appended in place
    model.cache_from_kv(warm.kv_parts(), room)
    kdn, full, fetch, rebuild, same, question_only = [], [], [], [], [], []
    for i in range(reps):
        a = answer(client, model, kb, question, max_new_tokens=1, check=True)
        if a.cached_tokens != m.n_tokens:
            raise BadRequest(f"{kb}: fetched {a.cached_tokens} of {m.n_tokens} knowledge tokens")
        cache = model.cache_from_kv(warm.kv_parts(), room)  # the question over a cache already built
        g = model.generate(prompt, cache=cache, cached_tokens=warm.tokens, max_new_tokens=1)
        kdn.append(a.ttft_s)
        full.append(a.baseline_ttft_s)
        fetch.append(a.fetch_s)
        rebuild.append(a.extra["rebuild_s"])
        same.append(bool(a.identical))
        question_only.append(g.ttft_s)
        log(f"  {kb} rep {i + 1}/{reps}: KDN {a.ttft_s * 1000:.0f} ms (fetch {a.fetch_s * 1000:.0f}, "
            f"rebuild {a.extra['rebuild_s'] * 1000:.0f}), question only {g.ttft_s * 1000:.0f} ms, "
            f"full prefill {a.baseline_ttft_s:.2f} s")
    copy_s = memcpy_s(warm.nbytes)
    full_s, kdn_s, q_s = median(full), median(kdn), median(question_only)
    return {
        "knowledge_tokens": m.n_tokens, "question_tokens": len(prompt) - m.n_tokens,
        "kv_bytes": warm.nbytes, "reps": reps,
        "full_ttft_s": full_s, "kdn_ttft_s": kdn_s, "speedup": full_s / kdn_s,
        "fetch_s": median(fetch), "rebuild_s": median(rebuild),
        "question_prefill_s": q_s, "memcpy_s": copy_s, "memcpy_gbps": warm.nbytes / copy_s / 1e9,
        "limit": full_s / (q_s + copy_s), "first_token_identical": all(same),
        "full_ttft_all_s": full, "kdn_ttft_all_s": kdn,
    }


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    xs = [r["knowledge_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [r["full_ttft_s"] for r in rows], "o-", label="full prefill (no KDN)")
    ax.plot(xs, [r["kdn_ttft_s"] for r in rows], "s-", label="KDN: fetch + rebuild + question prefill")
    ax.plot(xs, [r["question_prefill_s"] + r["memcpy_s"] for r in rows], "k:",
            label="floor: question prefill + KV memcpy")
    for r in rows:
        ax.annotate(f"{r['speedup']:.0f}x (limit {r['limit']:.0f}x)",
                    (r["knowledge_tokens"], r["kdn_ttft_s"]),
                    textcoords="offset points", xytext=(0, 8), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(xs, [f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in xs])
    ax.set_xlabel(f"knowledge tokens (+ a {rows[0]['question_tokens']}-token question)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("KDN: time to first token, SmolLM2-135M-Instruct on CPU")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(lengths, reps: int, threads, log) -> tuple:
    import torch
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.engines.transformers.model import load_model
    from kdn.client.publish import publish_documents
    from kdn.placement.topology import Topology

    if threads:
        torch.set_num_threads(threads)
    model = load_model(log=log)
    texts = knowledge_texts(model, lengths)
    question = question_text(model)
    kv_total = sum(lengths) * model.kv_bytes_per_token
    cluster = net = None
    root = scratch_dir("kdn-bench-ttft-")
    try:
        t0 = time.perf_counter()
        cluster = LocalCluster([REGION], cpus=2, object_store_bytes=max(1 << 30, 2 * kv_total))
        init_ray(cluster.address)
        topo = Topology.default_local([REGION], capacity_bytes=max(2 << 30, 2 * kv_total))
        net = start_network(topo, root, network=f"bench-ttft-{uuid.uuid4().hex[:6]}")
        client = Client(network=net.name, region=REGION, fingerprint=model.fingerprint)
        log(f"cluster + network up in {time.perf_counter() - t0:.1f} s")
        for n in sorted(lengths):            # shortest first: each longer one reuses its prefix
            r = publish_documents(client, model, f"ttft-{n}", [("knowledge", texts[n])])
            log(f"published ttft-{n}: {r['tokens']} tokens, prefilled {r['prefilled_tokens']} "
                f"(reused {r['reused_tokens']}) in {r['prefill_s']:.1f} s")
        rows = []
        for n in lengths:
            rows.append(measure(client, model, f"ttft-{n}", question, reps, log))
        return rows, {"threads": torch.get_num_threads(), "model": model.name,
                      "fingerprint": model.fingerprint}
    finally:
        teardown(net, cluster, root)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench ttft", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1k and 2k tokens only")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    help="comma-separated knowledge lengths in tokens (default 1024,2048,4096,8192)")
    ap.add_argument("--reps", type=int, default=3, help="timed reps per length (median reported)")
    ap.add_argument("--threads", type=int,
                    help="torch intra-op threads (default: torch's; 1 is steadier on a busy machine)")
    ap.add_argument("--plot", default="kdn-ttft.png", help="PNG path for TTFT vs context length")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    if args.reps < 1 or any(n < 64 for n in lengths):
        raise BadRequest(f"need --reps >= 1 and lengths >= 64 tokens, got reps={args.reps}, "
                         f"lengths={lengths}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)
    rows, info = run(list(lengths), args.reps, args.threads, log)

    print(f"time to first token, {info['model']} on CPU ({info['threads']} threads), "
          f"{rows[0]['question_tokens']}-token question, median of {args.reps}")
    ttft_table(rows, "limit", {
        "rebuild ms": lambda r: f"{r['rebuild_s'] * 1000:.1f}",
        "question ms": lambda r: f"{r['question_prefill_s'] * 1000:.0f}",
        "memcpy ms": lambda r: f"{r['memcpy_s'] * 1000:.1f}",
        "of limit": lambda r: f"{100 * r['speedup'] / r['limit']:.0f}%"})
    at = row_at(rows, TARGET_LENGTH)
    if at:
        verdict = "met" if at["speedup"] >= TARGET_SPEEDUP else "NOT met"
        print(f"target >= {TARGET_SPEEDUP:.0f}x at {TARGET_LENGTH} tokens: {at['speedup']:.1f}x, {verdict} "
              f"(limit measured in this run: {at['limit']:.1f}x)")
    plot(rows, args.plot)
    print(f"plot: {args.plot}")
    if args.json:
        emit_json({"bench": "ttft", **info, "reps": args.reps, "plot": args.plot,
                   "target": {"knowledge_tokens": TARGET_LENGTH, "speedup": TARGET_SPEEDUP},
                   "speedup_at_target": at["speedup"] if at else None,
                   "lengths": rows})
    return 0 if all(r["first_token_identical"] for r in rows) else 1
