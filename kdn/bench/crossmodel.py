"""`kdn bench crossmodel`: what the fine-tuned variant loses reading its base model's KV raw.

The baseline of issue 38 (reuse across models of one family). The variant is
kdn.engines.transformers.variant's default recipe (a LoRA on every layer trained on the bundled
founding documents; `kdn model variant` builds it, this bench builds it if it is missing).
For each bundled question, the knowledge is the bundled documents (the KB every member of the
family reads), and the variant answers greedily (max_new_tokens) four ways:

- reference: the variant's own full prefill of knowledge and question;
- own KV: the variant's KV of the knowledge (computed once, untimed, as a published KB would
  be) rebuilt into its cache, then the question: exact reuse, what KDN does within a model;
- base KV raw: the base model's KV of the same knowledge served to the variant as if it were
  its own: the fast path issue 38 must make safe (nothing in KDN serves this: a fingerprint
  mismatch never reads another model's KV; this bench does it on purpose, by hand);
- base model: the base model's own answer, full prefill (how far the variant has moved).

Per way: time to first token (p50 over the questions; for the KV ways, the cache rebuild and the
question's prefill; the KV's transfer is not in it: the arrays are local), KV bytes read, and
agreement with the reference: the same first answer token, and the whole greedy answer
token-identical. Nothing here picks a setting, so there is no calibration split; the plans of
issue 38 §2 will be chosen on held-apart KBs and questions.
"""
import argparse
import statistics
import time

import numpy as np
import torch

from kdn.bench import emit_json, table


def run(args, log) -> dict:
    from kdn.cli.knowledge import bundled_documents, bundled_questions
    from kdn.engines.transformers.model import load_model
    from kdn.engines.transformers.variant import VARIANT, build
    torch.set_num_threads(args.threads)
    folder, record, trained = build(bundled_documents(), VARIANT, log=log)
    log(f"variant {record['recipe']['name']}: {folder} ({'trained now' if trained else 'built before'})")
    base = load_model(log=log)
    variant = load_model(log=log, variant=folder)
    knowledge = "\n\n".join(text for _, text in bundled_documents())
    questions = bundled_questions()[:args.questions]
    know = variant.knowledge_tokens(knowledge)
    if know != base.knowledge_tokens(knowledge):
        raise RuntimeError("the two models tokenize the knowledge differently: not one family")
    own_kv = variant.prefill(know).kv
    base_kv = base.prefill(know).kv
    log(f"knowledge: {len(know)} tokens, {own_kv.nbytes / 2**20:.1f} MiB of KV; "
        f"max |variant KV - base KV| = {float(np.abs(own_kv - base_kv).max()):.3f}")
    ways = {w: {"ttft": [], "tokens": []} for w in ("reference", "own KV", "base KV raw", "base model")}
    for q in questions:
        prompt = know + variant.question_tokens(q)
        ref = variant.generate(prompt, max_new_tokens=args.max_new_tokens)
        ways["reference"]["ttft"].append(ref.ttft_s)
        ways["reference"]["tokens"].append(ref.tokens)
        for way, kv in (("own KV", own_kv), ("base KV raw", base_kv)):
            t0 = time.perf_counter()
            cache = variant.cache_from_kv([kv], spare_tokens=len(prompt) - len(know) + args.max_new_tokens)
            g = variant.generate(prompt, cache=cache, cached_tokens=len(know), max_new_tokens=args.max_new_tokens)
            ways[way]["ttft"].append(g.ttft_s + (time.perf_counter() - t0 - g.total_s))
            ways[way]["tokens"].append(g.tokens)
        b = base.generate(prompt, max_new_tokens=args.max_new_tokens)
        ways["base model"]["ttft"].append(b.ttft_s)
        ways["base model"]["tokens"].append(b.tokens)
        log(f"  {q[:60]!r}: reference {variant.tokenizer.decode(ref.tokens)[:60]!r}")
    refs = ways["reference"]["tokens"]
    rows = []
    for way, got in ways.items():
        ttft = statistics.median(got["ttft"])
        rows.append({
            "way": way, "ttft p50 ms": ttft * 1e3,
            "x reference": statistics.median(ways["reference"]["ttft"]) / ttft,
            "KV MiB read": own_kv.nbytes / 2**20 if way in ("own KV", "base KV raw") else 0.0,
            "first token %": 100.0 * np.mean([bool(a[:1] == r[:1]) for a, r in zip(got["tokens"], refs)]),
            "answer %": 100.0 * np.mean([a == r for a, r in zip(got["tokens"], refs)])})
    examples = [{"question": q, **{way: variant.tokenizer.decode(got["tokens"][i], skip_special_tokens=True)
                                   for way, got in ways.items()}} for i, q in enumerate(questions[:3])]
    return {"rows": rows, "examples": examples, "questions": len(questions), "knowledge_tokens": len(know),
            "variant": str(folder), "variant_fingerprint": variant.fingerprint,
            "base_fingerprint": base.fingerprint, "max_new_tokens": args.max_new_tokens,
            "recipe": record["recipe"]}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench crossmodel", description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=8, help="bundled questions to ask (default all 8)")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    log = (lambda m: None) if args.json else (lambda m: print(m, flush=True))
    out = run(args, log)
    table(out["rows"], ["way", "ttft p50 ms", "x reference", "KV MiB read", "first token %", "answer %"])
    for ex in out["examples"]:
        print(f"\n{ex['question']}")
        for way in ("reference", "base KV raw", "base model"):
            print(f"  {way:12} {ex[way]!r}")
    if args.json:
        emit_json({"bench": "crossmodel", **out})
    return 0
