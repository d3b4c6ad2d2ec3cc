"""`kdn bench emphasis`: does editing a KB's KV make the model follow the document it is told to trust?

A task set generated from templates with a fixed seed (never tuned to the method):
- conflict items: a KB of two documents that disagree (a superseded and a current version of
  a rule, a rumour and an official notice), in varied wording and random order, and a
  question whose one-word answer (a digit, a name, a weekday) differs between them; the
  trusted document is the current / official one;
- control items: two documents that do not conflict (two different topics); the operator's
  emphasized document is the first, and the question asks about either one (half each).

Each item is answered greedily (at most 12 tokens, stopping once the reply names an answer) under every condition, all in one run with
SmolLM2-135M: the KB as published (none); the trusted document emphasized by duplicating
its KV k times (dup k: +log k on its attention logits, kdn.engines.emphasis); its values or keys
scaled instead (vscale / kscale, the post-hoc steering alternatives); the trusted document
simply placed last (last, the prompt-side alternative, its own prefill); and both (last+dup).
Per condition: accuracy (the first of the two answers the reply names is the trusted one;
for control, the reply names the gold answer), the mean probability margin of the trusted
answer's first token over the other's (with or without a leading space; control: the gold
token's probability) at the reply's first position ("margin": near 0 where the model
starts its reply with "The ...") and at the answer slot, the first step whose greedy token
starts either answer ("slot_margin", over the `slots` items that reached one), time to first token from KB KV in hand (edit + cache rebuild +
question), and the bytes: cache bytes, and the bytes of the chunks an edit adds to the
network (those from the first edited chunk on; the chunks before it are the KB's own).
"""
import argparse
import random
import re
import statistics
import time

import numpy as np

from kdn.bench import emit_json, table

NEW_TOKENS = 12
DIGITS = [str(d) for d in range(2, 10)]
NAMES = ["Anna", "Tom", "Maria", "Peter", "James", "David", "Mark", "Paul"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]

# (kind, answers, fact phrasings "{x}", questions): one topic; a document states one fact of it
TOPICS = [
    ("hour", DIGITS, ["The front office opens at {x} o'clock every weekday morning.",
                      "Every weekday the front office opens its doors at {x} o'clock.",
                      "Opening time of the front office: {x} o'clock, Monday to Friday."],
     ["At what hour does the front office open?", "When does the front office open? Give the hour."]),
    ("fee", DIGITS, ["A day of parking in the staff garage costs {x} euros.",
                     "Staff pay {x} euros for one day in the garage.",
                     "The garage charges staff {x} euros per day."],
     ["How many euros does a day of staff parking cost?", "What is the daily garage fee for staff, in euros?"]),
    ("floor", DIGITS, ["The quarterly review takes place on floor {x}.",
                       "Go to floor {x} for the quarterly review.",
                       "The quarterly review is held on floor {x} of the main building."],
     ["On which floor is the quarterly review?", "Which floor hosts the quarterly review?"]),
    ("lead", NAMES, ["The project lead of Atlas is {x}.", "{x} leads the Atlas project.",
                     "Questions about Atlas go to its lead, {x}."],
     ["Who is the project lead of Atlas?", "Who leads the Atlas project?"]),
    ("day", DAYS, ["The cafeteria is closed on {x} for cleaning.", "Every {x} the cafeteria stays closed.",
                   "Cleaning day, when the cafeteria is closed, is {x}."],
     ["On which day is the cafeteria closed?", "Which weekday is the cafeteria closed?"]),
    ("guests", DIGITS, ["Each employee may bring at most {x} guests to the summer party.",
                        "The summer party allows {x} guests per employee.",
                        "Up to {x} guests per employee can attend the summer party."],
     ["How many guests may an employee bring to the summer party?",
      "What is the guest limit per employee at the summer party?"]),
    ("contact", NAMES, ["Security incidents are reported to {x}.", "Report any security incident to {x}.",
                        "The contact for security incidents is {x}."],
     ["Who receives reports of security incidents?", "To whom should a security incident be reported?"]),
]

# (trusted head, untrusted head, trusted name, untrusted name) per framing
FRAMES = [
    ("Policy {t}, {vn} revision ({yn}), in force since {yn}. It replaces the {vo} revision.",
     "Policy {t}, {vo} revision ({yo}). This revision is superseded and no longer applies.",
     "policy-current.md", "policy-old.md"),
    ("Official notice from the management, {yn}:",
     "Rumour heard in the break room, not confirmed by anyone:",
     "official-notice.md", "rumour.md"),
    ("Current handbook ({yn} edition), the only valid edition:",
     "Old handbook ({yo} edition), outdated:",
     "handbook-current.md", "handbook-old.md"),
    ("Announcement approved by the board on {yn}-03-01:",
     "Draft from {yo}, rejected and never adopted:",
     "announcement.md", "draft.md"),
]
SUFFIX = " Answer with one word."
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth"]


def build_tasks(n_conflict: int = 80, n_control: int = 40, seed: int = 0) -> list:
    """Items {set, docs [(name, text)] in KB order, trusted (doc name), question, gold, other}."""
    rng = random.Random(seed)
    out = []
    for i in range(n_conflict):
        kind, answers, facts, questions = TOPICS[i % len(TOPICS)]
        head_t, head_u, name_t, name_u = FRAMES[rng.randrange(len(FRAMES))]
        gold, other = rng.sample(answers, 2)
        yn = rng.randrange(2022, 2026)
        v = rng.randrange(1, len(ORDINALS))
        fill = dict(t=rng.choice("ABCDEFGH") + str(rng.randrange(10, 99)), vn=ORDINALS[v], vo=ORDINALS[v - 1],
                    yn=yn, yo=yn - rng.randrange(2, 6))   # no digit of an answer outside the fact
        f_t, f_u = rng.sample(facts, 2) if len(facts) > 1 else (facts[0], facts[0])
        trusted = (name_t, head_t.format(**fill) + " " + f_t.format(x=gold))
        untrusted = (name_u, head_u.format(**fill) + " " + f_u.format(x=other))
        docs = [trusted, untrusted] if rng.random() < 0.5 else [untrusted, trusted]
        out.append(dict(set="conflict", kind=kind, docs=docs, trusted=name_t, gold=gold, other=other,
                        question=rng.choice(questions) + SUFFIX))
    for i in range(n_control):
        a, b = rng.sample(range(len(TOPICS)), 2)
        texts = []
        for j, t in enumerate((a, b)):
            kind, answers, facts, _ = TOPICS[t]
            texts.append((f"notes-{kind}.md", rng.choice(facts).format(x=rng.choice(answers))))
        ask = i % 2                        # 0: about the emphasized document, 1: about the other
        kind, answers, facts, questions = TOPICS[(a, b)[ask]]
        gold = next(x for x in answers if re.search(rf"\b{x}\b", texts[ask][1]))
        out.append(dict(set="control", kind=kind, docs=texts, trusted=texts[0][0], gold=gold, other=None,
                        question=rng.choice(questions) + SUFFIX, asks_emphasized=ask == 0))
    return out


def first_answer(text: str, gold: str, other) -> "str | None":
    """Which of gold / other the reply names first (None: neither)."""
    hits = [(m.start(), w) for w in (gold, other) if w for m in [re.search(rf"\b{re.escape(w)}\b", text)] if m]
    return min(hits)[1] if hits else None


class Runner:
    """Answers one item under one condition; keeps the KB's KV per document order."""

    def __init__(self, model):
        from kdn.client.publish import knowledge_documents
        self.model, self.knowledge_documents = model, knowledge_documents

    def kb(self, docs):
        """(named [(doc, tokens)], knowledge tokens, KV [layers, 2, heads, T, hd])."""
        named = self.knowledge_documents(self.model, docs)
        tokens = [t for _, toks in named for t in toks]
        return named, tokens, self.model.prefill(tokens).kv

    def answer(self, named, tokens, kv, question: str, weights: dict, method: str, stop=(), slot=()):
        """(reply text, first-position probabilities [vocab], answer-slot probabilities [vocab] or
        None, ttft s, cache tokens, edited-from token). The answer slot: the first step whose
        greedy token is one of `slot` (the answers' first tokens)."""
        from kdn.engines import emphasis as E
        model = self.model
        q = model.question_tokens(question)
        t0 = time.perf_counter()
        reps = E.token_weights(E.document_spans(model, named), weights, len(tokens))
        factors = reps if method == "duplicate" else reps.astype(np.float32)
        edited = E.edit(kv, factors, method)
        extra = E.extra_tokens(reps, method)
        cache = model.cache_from_kv([edited], len(q) + NEW_TOKENS)
        logits = E.forward(model, q, cache, len(tokens), extra)
        ttft = time.perf_counter() - t0
        probs = logits.float().softmax(-1).numpy()
        out, pos, at_slot = [], len(tokens) + len(q), None
        while len(out) < NEW_TOKENS:
            nxt = int(logits.argmax())
            if at_slot is None and nxt in slot:
                at_slot = logits.float().softmax(-1).numpy()
            if nxt in model.eos_ids:
                break
            out.append(nxt)
            if stop and first_answer(model.tokenizer.decode(out, skip_special_tokens=True), *stop):
                break                       # the reply named one of the answers: that decides it
            logits = E.forward(model, [nxt], cache, pos, extra)
            pos += 1
        return (model.tokenizer.decode(out, skip_special_tokens=True), probs, at_slot, ttft, edited.shape[3],
                E.first_edited(reps))


def conditions(weights) -> list:
    """(label, placed last?, weight, method)."""
    rows = [("none", False, 1, "duplicate")]
    rows += [(f"dup {k}", False, k, "duplicate") for k in weights]
    rows += [("vscale 2", False, 2, "vscale"), ("kscale 1.5", False, 1.5, "kscale"),
             ("last", True, 1, "duplicate"), (f"last+dup {weights[1]}", True, weights[1], "duplicate")]
    return rows


def run(model, tasks, weights, log, only=None) -> list:
    runner = Runner(model)
    first = {t: {i for i in (model.encode(t)[0], model.encode(" " + t)[0])    # a lone space is no answer
                 if model.tokenizer.decode([i]).strip()} for t in DIGITS + NAMES + DAYS}
    stats = {}
    for n, item in enumerate(tasks):
        kbs = {}
        for label, last, w, method in conditions(weights):
            if only and label not in only:
                continue
            docs = item["docs"]
            if last:
                docs = [d for d in docs if d[0] != item["trusted"]] + [d for d in docs if d[0] == item["trusted"]]
            key = tuple(d[0] for d in docs)
            if key not in kbs:
                kbs[key] = runner.kb(docs)
            named, tokens, kv = kbs[key]
            ids = first[item["gold"]] | (first[item["other"]] if item["other"] else set())
            text, probs, at_slot, ttft, cache_tokens, edited_from = runner.answer(
                named, tokens, kv, item["question"], {item["trusted"]: w} if w != 1 else {}, method,
                (item["gold"], item["other"]), ids)
            got = first_answer(text, item["gold"], item["other"])
            s = stats.setdefault((item["set"], label), dict(n=0, correct=0, other=0, margin=[], slot=[], ttft=[],
                                                            cache_tokens=[], tokens=[], edited_tokens=[]))
            s["n"] += 1
            s["correct"] += got == item["gold"]
            s["other"] += got is not None and got == item["other"]
            def margin(p):
                gold = sum(float(p[i]) for i in first[item["gold"]])
                return gold - (sum(float(p[i]) for i in first[item["other"]]) if item["other"] else 0.0)
            s["margin"].append(margin(probs))
            if at_slot is not None:
                s["slot"].append(margin(at_slot))
            s["ttft"].append(ttft)
            s["cache_tokens"].append(cache_tokens)
            s["tokens"].append(len(tokens))
            ct = 256
            s["edited_tokens"].append(0 if edited_from is None else cache_tokens - edited_from // ct * ct)
            log(f"{n:3d} {item['set']:8s} {label:10s} gold={item['gold']:9s} got={got!s:9s} "
                f"margin={s['margin'][-1]:+.3f} slot={margin(at_slot) if at_slot is not None else float('nan'):+.3f} ttft={1e3 * ttft:.0f}ms {text!r}")
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench emphasis", description=__doc__.split("\n")[0])
    ap.add_argument("--conflict", type=int, default=84, help="conflict items (default 84)")
    ap.add_argument("--control", type=int, default=40, help="control items (default 40)")
    ap.add_argument("--weights", type=str, default="2,4,8", help="duplicate weights, comma-separated")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", type=str, default=None,
                    help="comma-separated conditions to run (default all; 'none' and 'last' always)")
    ap.add_argument("--quick", action="store_true", help="14 conflict and 8 control items")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared machine more threads fight for cores)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    import torch
    from kdn.engines.transformers.model import load_model
    torch.set_num_threads(args.threads)

    log = (lambda *a: print(*a, flush=True)) if args.verbose else (lambda *a: None)
    weights = [int(w) for w in args.weights.split(",")]
    if len(weights) < 2:
        raise SystemExit("--weights needs at least two weights")
    n_conf, n_ctrl = (14, 8) if args.quick else (args.conflict, args.control)
    model = load_model()
    tasks = build_tasks(n_conf, n_ctrl, args.seed)
    t0 = time.perf_counter()
    only = None if not args.only else {"none", "last", *(c.strip() for c in args.only.split(","))}
    stats = run(model, tasks, weights, log, only)
    bpt = model.kv_bytes_per_token
    rows = []
    for (set_name, label), s in stats.items():
        rows.append({"set": set_name, "condition": label, "n": s["n"],
                     "accuracy": round(100.0 * s["correct"] / s["n"], 1),
                     "other_answer": round(100.0 * s["other"] / s["n"], 1),
                     "margin": round(statistics.mean(s["margin"]), 4),
                     "slot_margin": round(statistics.mean(s["slot"]), 3) if s["slot"] else None,
                     "slots": len(s["slot"]),
                     "ttft_ms": round(1e3 * statistics.median(s["ttft"]), 2),
                     "cache_kib": round(statistics.mean(s["cache_tokens"]) * bpt / 1024, 1),
                     "kb_kib": round(statistics.mean(s["tokens"]) * bpt / 1024, 1),
                     "edited_chunk_kib": round(statistics.mean(s["edited_tokens"]) * bpt / 1024, 1)})
    table(rows)
    acc = {(r["set"], r["condition"]): r["accuracy"] for r in rows}
    best = max((f"dup {k}" for k in weights if ("conflict", f"dup {k}") in acc), key=lambda c: acc[("conflict", c)])
    verdict = {"best_dup": best,
               "conflict_gain_vs_none": round(acc[("conflict", best)] - acc[("conflict", "none")], 1),
               "conflict_gain_vs_last": round(acc[("conflict", best)] - acc[("conflict", "last")], 1),
               "control_change": round(acc[("control", best)] - acc[("control", "none")], 1)}
    print(f"\nbest duplicate weight: {best}; conflict accuracy {verdict['conflict_gain_vs_none']:+.1f} "
          f"points vs none, {verdict['conflict_gain_vs_last']:+.1f} vs placed last; control "
          f"{verdict['control_change']:+.1f} points ({time.perf_counter() - t0:.0f} s)")
    if args.json:
        emit_json({"bench": "emphasis", "model": model.name, "seed": args.seed, "rows": rows, **verdict,
                   "conflict_items": n_conf, "control_items": n_ctrl, "kv_bytes_per_token": bpt})


if __name__ == "__main__":
    main()
