"""`kdn bench crossmodel`: a fine-tuned variant reading its base model's KV, raw and with recompute plans.

Issue 38's bench. The variant is one of kdn.engines.transformers.variant's recipes (--recipe;
built here if missing). The pair is (reader: the variant, sender: the base model).

Items are KBs cut from the bundled documents (windows of --window tokens of one document's
text) and questions about them, in two held-apart splits:
- calibration: the windows of Article III, the Bill of Rights and the Gettysburg Address, with
  CALIBRATION_QUESTIONS. The plans are profiled and chosen here only
  (kdn.engines.transformers.crossmodel.profile: every contiguous block range [a, b) on a grid of
  --block layers; per number of recomputed layers the range that agreed most; the plan
  kdn.engines.family.choose picks for --target);
- report: the windows of the Declaration of Independence and Article II, with REPORT_QUESTIONS.
  Every figure printed is measured here.

Per way, on the report split, the variant answers greedily (--max-new-tokens):
- reference: its own full prefill of knowledge and question;
- own KV: its own KV of the knowledge rebuilt into its cache (exact reuse, what KDN does);
- base KV raw: the base model's KV used as if it were its own (nothing in KDN serves this);
- plan a-b: the base model's KV with layers [a, b) recomputed by the variant from the base
  model's hidden states entering layer a (the sender's, stored beside its KV);
- base model: the base model's own answer (how far the variant moved).

Time to first token (p50): for the KV ways the cache rebuild, the plan's recompute and the
question's prefill (the KV and hidden states are local arrays here: no transfer; `KV MiB read`
counts what a reader would fetch, hidden states included). Agreement with the reference: the
same first answer token, the whole greedy answer token-identical, and the share of the
reference's tokens reproduced before the first difference. Accuracy (`gold %`): GOLD_QUESTIONS
have a gold answer, each asked of the report KBs whose text holds its fact (`needle`); an answer
is right when it names one of the accepted strings (case-insensitive). They count in the
agreement columns too.
"""
import argparse
import statistics
import time

import numpy as np
import torch

from kdn.bench import emit_json, matching_prefix, table
from kdn.engines.transformers.crossmodel import CALIBRATION_DOCS, CALIBRATION_QUESTIONS, calibrate, windows

REPORT_DOCS = ("declaration-of-independence", "constitution-article-ii")
REPORT_QUESTIONS = ("What is the main idea of this passage?", "Who wrote this, and to whom?",
                    "List two things the passage says.", "Explain the passage to a child.",
                    "What does the last sentence say?")
# (question, the fact in a KB's text that answers it, accepted answers): asked only of report KBs
# that hold the fact; written before any run, never used to choose anything
GOLD_QUESTIONS = (
    ("For how many years does the President hold office?", "term of four years", ("four", "4")),
    ("How old must a person be to be eligible to the Office of President?", "age of thirty five years",
     ("thirty five", "thirty-five", "35")),
    ("Who is the Commander in Chief of the Army and Navy?", "commander in chief", ("president",)),
    ("Which unalienable Rights does the text name?", "unalienable rights", ("life", "liberty", "happiness")),
    ("What do the united Colonies declare themselves to be?", "free and independent states", ("independent",)),
)


def gold_for(text: str) -> list:
    """[(question, accepted answers)] of the GOLD_QUESTIONS whose fact is in text."""
    flat = " ".join(text.lower().split())
    return [(q, ok) for q, needle, ok in GOLD_QUESTIONS if needle in flat]


def is_right(answer: str, accepted) -> bool:
    return any(a in answer.lower() for a in accepted)


def run(args, log) -> dict:
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers import crossmodel as X
    from kdn.engines.transformers.model import load_model
    from kdn.engines.transformers.variant import RECIPES, build
    torch.set_num_threads(args.threads)
    folder, record, trained = build(bundled_documents(), RECIPES[args.recipe], log=log)
    log(f"variant {record['recipe']['name']}: {folder} ({'trained now' if trained else 'built before'})")
    base = load_model(log=log)
    variant = load_model(log=log, variant=folder)
    L, block = variant.layers, args.block
    docs = bundled_documents()
    calib = windows(variant, docs, CALIBRATION_DOCS, args.window)       # profiled by calibrate
    report = windows(variant, docs, REPORT_DOCS, args.window)[:args.kbs]
    log(f"calibration: {len(calib)} KBs x {len(CALIBRATION_QUESTIONS)} questions; "
        f"report: {len(report)} KBs x {len(REPORT_QUESTIONS)} questions")

    # --- calibration: profile every block range, pick per size and the plan ---------------
    t0 = time.perf_counter()
    profile, chosen = calibrate(variant, base, docs, block=block, window=args.window, target=args.target,
                                max_new_tokens=args.max_new_tokens, log=log)
    log(f"profiled {len(profile)} plans in {time.perf_counter() - t0:.0f} s")
    best = {}
    for p in profile:
        k = p["end"] - p["start"]
        if k < L and (k not in best or (p["agree"], p["start"]) > (best[k]["agree"], best[k]["start"])):
            best[k] = p
    plans = [(p["start"], p["end"]) for k, p in sorted(best.items())]

    # --- report: every way on held-apart KBs and questions ---------------------------------
    ways = ["reference", "own KV", "base KV raw"] + [f"plan {a}-{b}" for a, b in plans] + ["base model"]
    got = {w: {"ttft": [], "tokens": [], "bytes": 0} for w in ways}
    gold = []                                    # per item: its accepted answers, or None
    hidden_size = variant.hf.config.hidden_size
    for label, text in report:
        know = variant.knowledge_tokens(text)
        if know != base.knowledge_tokens(text):
            raise RuntimeError("the two models tokenize the knowledge differently: not one family")
        base_kv, hidden = X.prefill_with_hidden(base, know, sorted({a for a, _ in plans}))
        own_kv = variant.prefill(know).kv
        asked = [(q, None) for q in REPORT_QUESTIONS] + gold_for(text)
        for q, accepted in asked:
            gold.append(accepted)
            tail = variant.question_tokens(q)
            prompt, spare = know + tail, len(tail) + args.max_new_tokens
            ref = variant.generate(prompt, max_new_tokens=args.max_new_tokens)
            got["reference"]["ttft"].append(ref.ttft_s)
            got["reference"]["tokens"].append(ref.tokens)
            for way in ways[1:-1]:
                t1 = time.perf_counter()
                if way == "own KV":
                    cache = variant.cache_from_kv([own_kv], spare)
                    nbytes = own_kv.nbytes
                else:
                    cache = variant.cache_from_kv([base_kv], spare)
                    nbytes = base_kv.nbytes
                    if way.startswith("plan"):
                        a, b = (int(x) for x in way.split()[1].split("-"))
                        X.overwrite_layers(variant, cache, X.recompute(variant, hidden[a], a, b), a)
                        nbytes += len(know) * hidden_size * 4
                g = variant.generate(prompt, cache=cache, cached_tokens=len(know), max_new_tokens=args.max_new_tokens)
                got[way]["ttft"].append(g.ttft_s + (time.perf_counter() - t1 - g.total_s))
                got[way]["tokens"].append(g.tokens)
                got[way]["bytes"] = max(got[way]["bytes"], nbytes)
            b_ = base.generate(prompt, max_new_tokens=args.max_new_tokens)
            got["base model"]["ttft"].append(b_.ttft_s)
            got["base model"]["tokens"].append(b_.tokens)
        log(f"  {label}: {len(know)} tokens, {len(asked) - len(REPORT_QUESTIONS)} gold questions")
    refs = got["reference"]["tokens"]
    ref_ttft = statistics.median(got["reference"]["ttft"])
    rows = []
    for way in ways:
        g = got[way]
        ttft = statistics.median(g["ttft"])
        cal = None
        if way.startswith("plan"):
            a, b = (int(x) for x in way.split()[1].split("-"))
            cal = next(p["agree"] for p in profile if (p["start"], p["end"]) == (a, b))
        rows.append({
            "way": way + (" (chosen)" if chosen and way == f"plan {chosen.start}-{chosen.end}" else ""),
            "recomputed": (L if way in ("reference", "base model") else 0) if cal is None else b - a,
            "ttft p50 ms": ttft * 1e3, "x reference": ref_ttft / ttft,
            "KV MiB read": g["bytes"] / 2**20,
            "calib answer %": "-" if cal is None else 100.0 * cal,
            "first token %": 100.0 * np.mean([bool(t[:1] == r[:1]) for t, r in zip(g["tokens"], refs)]),
            "answer %": 100.0 * np.mean([t == r for t, r in zip(g["tokens"], refs)]),
            "prefix %": 100.0 * np.mean([matching_prefix(t, r) / max(1, len(r)) for t, r in zip(g["tokens"], refs)]),
            "gold %": (100.0 * np.mean([is_right(variant.tokenizer.decode(t, skip_special_tokens=True), ok)
                                        for t, ok in zip(g["tokens"], gold) if ok])
                       if any(gold) else "-")})
    return {"rows": rows, "profile": profile, "chosen": chosen.to_dict() if chosen else None,
            "target": args.target, "questions": len(refs), "gold_questions": sum(1 for ok in gold if ok),
            "calibration_kbs": [n for n, _ in calib],
            "report_kbs": [n for n, _ in report], "variant": str(folder), "recipe": record["recipe"],
            "variant_fingerprint": variant.fingerprint, "base_fingerprint": base.fingerprint,
            "max_new_tokens": args.max_new_tokens, "block": block, "window": args.window}


def main(argv=None):
    from kdn.engines.transformers.variant import RECIPES
    ap = argparse.ArgumentParser(prog="kdn bench crossmodel", description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="founding-docs", choices=sorted(RECIPES),
                    help="the variant (default founding-docs; founding-docs-light is a lighter fine-tune; "
                         "founding-docs-upper the default's on layers 21-29 only)")
    ap.add_argument("--window", type=int, default=600, help="tokens per KB (default 600)")
    ap.add_argument("--kbs", type=int, default=5, help="report KBs at most (default 5)")
    ap.add_argument("--block", type=int, default=3, help="plans recompute whole blocks of this many layers (default 3)")
    ap.add_argument("--target", type=float, default=0.95,
                    help="the calibration agreement a chosen plan must reach (default 0.95)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    out = run(args, log)
    table(out["rows"], ["way", "recomputed", "ttft p50 ms", "x reference", "KV MiB read", "calib answer %",
                        "first token %", "answer %", "prefix %", "gold %"])
    c = out["chosen"]
    print(f"\nchosen on calibration for >= {out['target']:.0%} identical answers: "
          + (f"recompute layers {c['start']}-{c['end']}" if c else
             "none (no plan short of recomputing every layer reached it: the variant prefills itself)"))
    if args.json:
        emit_json({"bench": "crossmodel", **out})
    return 0
