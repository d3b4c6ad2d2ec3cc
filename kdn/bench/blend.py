"""`kdn bench blend`: blended reuse of segment KV against a full prefill of the same prompts.

Quality: multi-document prompts built from the bundled knowledge (a random subset of 2-3 of
the 5 documents in random order, plus a bundled question; seeded). For each, a full prefill
generates the reference greedy continuation (G tokens); each recompute share then blends the
documents' segment KV and runs the reference continuation through the blended cache in one
teacher-forced pass. Reported per share: next-token top-1 agreement (the first new token),
top-1 agreement over all G positions, and the matching greedy continuation length (the
first teacher-forced disagreement is exactly where greedy generation would diverge).
share 0 is naive concatenation, the lower baseline.

Speed: 4 documents x ~1k tokens (the bundled documents' segment tokens concatenated and cut
into 4 pieces of DOC_TOKENS), time to first token of blending (KV already at the worker:
re-position + select + recompute + question prefill) vs a full prefill, median of reps.
Fetch time over the network is measured by `kdn bench fetch`, not here.
"""
import argparse
import random
import time


from kdn.bench import emit_json, matching_prefix, median, table

SHARES = [0.0, 0.05, 0.1, 0.15, 0.3]
QUICK_SHARES = [0.0, 0.15, 0.3]
DOC_TOKENS = 1000


def build_prompts(names, questions, n, seed=0):
    """n (document names in prompt order, question) pairs: 2-3 documents each, random order."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        k = rng.choice((2, 3))
        out.append((rng.sample(names, k), questions[i % len(questions)]))
    return out


def teacher_forced(model, cache, cached_tokens, prompt, targets):
    """Argmax after each of prompt[-1], targets[:-1], computed over `cache` (holding prompt[:cached])."""
    logits = model.logits(list(prompt[cached_tokens:]) + list(targets[:-1]), cache, all_logits=True)
    first = len(prompt) - cached_tokens - 1
    return logits[first:first + len(targets)].argmax(-1).tolist()


def quality(model, seg_tokens, seg_kv, prompts, shares, new_tokens, log):
    from kdn.engines.transformers import blend as B
    per = {s: {"top1": 0, "pos_agree": 0, "positions": 0, "match": [], "ttft": [], "full": 0}
           for s in shares}
    full_ttft = []
    for i, (names, q) in enumerate(prompts):
        segs = [seg_tokens[n] for n in names]
        prompt = B.prompt_tokens(model, segs, q)
        ref = model.generate(prompt, max_new_tokens=new_tokens)
        targets = ref.tokens + ([min(model.eos_ids)] if ref.finish == "stop" else [])
        eos_ok = set(model.eos_ids)
        full_ttft.append(ref.ttft_s)
        for s in shares:
            b = B.blend(model, B.header_tokens(model), [(seg_tokens[n], seg_kv[n]) for n in names], share=s)
            got = teacher_forced(model, b.cache, b.context_tokens, prompt, targets)
            agree = [g == t or (g in eos_ok and t in eos_ok) for g, t in zip(got, targets)]
            r = per[s]
            r["top1"] += agree[0]
            r["pos_agree"] += sum(agree)
            r["positions"] += len(agree)
            m = matching_prefix(agree, [True] * len(agree))
            r["match"].append(m)
            r["full"] += m == len(agree)
            r["ttft"].append(b.seconds["total"])  # question pass: see the speed table
        so_far = ", ".join(f"{s:.0%}: top1 {per[s]['top1']}/{i + 1} match {sum(per[s]['match']) / (i + 1):.1f}"
                           for s in shares)
        log(f"  prompt {i + 1}/{len(prompts)}: {len(prompt)} tokens, docs {'+'.join(names)}; {so_far}")
    rows = []
    n = len(prompts)
    for s in shares:
        r = per[s]
        rows.append({"share": s, "label": "naive" if s == 0 else f"blend {s:.0%}",
                     "top1_next": r["top1"] / n, "top1_all": r["pos_agree"] / max(1, r["positions"]),
                     "match_len": sum(r["match"]) / n, "full_match": r["full"] / n,
                     "blend_s": median(r["ttft"])})
    return rows, median(full_ttft)


def speed(model, pieces, questions, share, reps, log):
    """TTFT of full prefill vs blending at `share` and naive, 4 x DOC_TOKENS documents."""
    from kdn.engines.transformers import blend as B
    segs = [(t, B.segment_kv(model, t)) for t in pieces]
    out = {"full": [], "blend": [], "naive": [], "top1": 0, "top1_naive": 0, "n": 0}
    breakdown = []
    warm = B.prompt_tokens(model, [t for t, _ in segs], questions[0])   # warm against warm:
    model.generate(warm, max_new_tokens=1)                              # each side once, untimed
    B.generate_blended(model, segs, questions[0], share=share, max_new_tokens=1)
    for r in range(reps):
        q = questions[r % len(questions)]
        order = segs[r % len(segs):] + segs[:r % len(segs)]   # a different order each rep
        prompt = B.prompt_tokens(model, [t for t, _ in order], q)
        full = model.generate(prompt, max_new_tokens=1)
        g, b = B.generate_blended(model, order, q, share=share, max_new_tokens=1)
        g0, _ = B.generate_blended(model, order, q, share=0.0, max_new_tokens=1)
        out["full"].append(full.ttft_s)
        out["blend"].append(g.ttft_s)
        out["naive"].append(g0.ttft_s)
        top = int(full.logits.argmax())
        out["top1"] += int(g.logits.argmax()) == top
        out["top1_naive"] += int(g0.logits.argmax()) == top
        out["n"] += 1
        breakdown.append({**b.seconds, "question": g.ttft_s - b.seconds["total"]})
        log(f"  rep {r + 1}/{reps}: {len(prompt)} tokens, full {full.ttft_s:.2f} s, "
            f"blend {g.ttft_s:.2f} s, naive {g0.ttft_s:.2f} s")
    parts = {k: median([d[k] for d in breakdown]) for k in breakdown[0]}
    return out, parts, len(prompt)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    xs = [r["share"] * 100 for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["top1_next"] * 100 for r in rows], "o-", label="next-token top-1 agreement")
    ax.plot(xs, [r["top1_all"] * 100 for r in rows], "s-", label="top-1 agreement, all positions")
    ax.plot(xs, [r["full_match"] * 100 for r in rows], "^-", label="whole continuation matches")
    ax.set_xlabel("recompute share (%)  [0 = naive concatenation]")
    ax.set_ylabel("% of prompts / positions")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("Blended segment KV vs full prefill (SmolLM2-135M)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench blend", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="12 prompts, 3 shares, 2 speed reps")
    ap.add_argument("--prompts", type=int, default=None, help="quality prompts (default 50)")
    ap.add_argument("--shares", type=str, default=None, help="comma-separated recompute shares")
    ap.add_argument("--share", type=float, default=None, help="share for the speed test (default 0.15)")
    ap.add_argument("--new-tokens", type=int, default=16, help="reference continuation length")
    ap.add_argument("--reps", type=int, default=None, help="speed repetitions (default 3)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=str, default=None, help="write quality vs share PNG here")
    ap.add_argument("--part", choices=("all", "speed", "quality"), default="all")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)

    from kdn.engines.transformers import blend as B
    from kdn.cli.knowledge import bundled_documents, bundled_questions
    from kdn.engines.transformers.model import load_model

    log = (lambda *a: print(*a, flush=True)) if args.verbose else (lambda *a: None)
    n_prompts = args.prompts or (12 if args.quick else 50)
    shares = ([float(x) for x in args.shares.split(",")] if args.shares
              else (QUICK_SHARES if args.quick else SHARES))
    for s in shares:
        B.check_share(s)
    share = B.DEFAULT_SHARE if args.share is None else B.check_share(args.share)
    reps = args.reps or (2 if args.quick else 3)

    model = load_model()
    docs = bundled_documents()
    questions = bundled_questions()
    t0 = time.perf_counter()
    seg_tokens = {n: B.segment_tokens(model, t) for n, t in docs}
    seg_kv = {n: B.segment_kv(model, t) for n, t in seg_tokens.items()}
    publish_s = time.perf_counter() - t0
    speed_out = quality_out = None
    if args.part in ("all", "speed"):
        stream = [t for _, toks in seg_tokens.items() for t in toks]
        pieces = [stream[i * DOC_TOKENS:(i + 1) * DOC_TOKENS] for i in range(4)]
        if len(pieces[-1]) < DOC_TOKENS:
            raise SystemExit(f"the bundled documents hold {len(stream)} tokens; 4 x {DOC_TOKENS} needed")
        sp, parts, n_tok = speed(model, pieces, questions, share, reps, log)
        full, bl, nv = median(sp["full"]), median(sp["blend"]), median(sp["naive"])
        srows = [{"method": "full prefill", "ttft_s": full, "speedup": 1.0, "top1": 1.0},
                 {"method": f"blend {share:.0%}", "ttft_s": bl, "speedup": full / bl, "top1": sp["top1"] / sp["n"]},
                 {"method": "naive concat", "ttft_s": nv, "speedup": full / nv, "top1": sp["top1_naive"] / sp["n"]}]
        print(f"speed: 4 documents x {DOC_TOKENS} tokens ({n_tok}-token prompts), KV at the worker, "
              f"median of {reps}")
        table(srows, ["method", "ttft_s", "speedup", "top1"])
        print("blend breakdown (s): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        speed_out = {"doc_tokens": DOC_TOKENS, "documents": 4, "prompt_tokens": n_tok, "share": share,
                     "full_s": full, "blend_s": bl, "naive_s": nv, "speedup": full / bl,
                     "speedup_naive": full / nv, "top1": sp["top1"] / sp["n"],
                     "top1_naive": sp["top1_naive"] / sp["n"], "breakdown": parts, "reps": reps}

    if args.part in ("all", "quality"):
        prompts = build_prompts([n for n, _ in docs], questions, n_prompts, args.seed)
        rows, full_s = quality(model, seg_tokens, seg_kv, prompts, shares, args.new_tokens, log)
        print(f"\nquality: {n_prompts} prompts (2-3 of {len(docs)} bundled documents, random order), "
              f"{args.new_tokens}-token reference continuations; segment prefill {publish_s:.1f} s")
        table(rows, ["label", "top1_next", "top1_all", "match_len", "full_match", "blend_s"])
        print(f"(blend_s: re-position + select + recompute, median; full prefill TTFT median on "
              f"these prompts: {full_s:.3f} s)")
        quality_out = {"prompts": n_prompts, "new_tokens": args.new_tokens, "rows": rows,
                       "full_prefill_s": full_s}
        if args.plot:
            plot(rows, args.plot)
            print(f"plot written to {args.plot}")

    if args.json:
        emit_json({"bench": "blend", "speed": speed_out, "quality": quality_out})
    return 0
