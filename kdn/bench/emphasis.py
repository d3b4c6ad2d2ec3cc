"""`kdn bench emphasis`: does editing a KB's KV make the model follow the document it is told to trust?

The items are written by hand, as data (kdn.bench.emphasis_items): 50 conflicts, ten for each
answer kind (number, name, date, yes/no, place), documents from one sentence to several
paragraphs, questions worded differently; and 16 controls, two documents that do not
disagree, the first emphasized, the question about either. The trusted document sits first
or second, alternating within each kind.

The split. A fixed share of each answer kind (and of the controls) is the calibration split,
chosen by the xxh3 digest of "<seed>:<item id>" (seed 0 by default), so the split is the same
on every machine and does not depend on the items' order. The emphasis weight is chosen on the
calibration conflict items only (`choose_weight`: the most right answers, ties to the smaller
weight, no emphasis a candidate too); every figure the bench reports as its result is measured
on the other items, the report split, which chose nothing. The run has two phases: the
calibration items are answered under every condition and the weight chosen; only then are the
report items answered, under none, the chosen weight and last (--report-all: every condition,
to show what choosing on them would have picked). The tables show both splits.

Each item is answered greedily (at most 24 tokens, stopping once the reply has named one of
the answers in full), all in one run with SmolLM2-135M: the KB as published (none); the
trusted document emphasized by duplicating its KV k times (dup k: +log k on its attention
logits, kdn.engines.kv_edit); the trusted document simply placed last (last, the prompt-side
alternative, its own prefill); on request (--also) its values or keys scaled instead
(vscale 2 / kscale 1.5) and both placed last and duplicated (last+dup).

Per condition: right (the first answer the reply names, as a whole word, is the trusted one;
for controls, the reply names the asked item's answer), other (it names the untrusted one
first), neither, degenerate (an empty or looping reply, `is_degenerate`); on the report split,
the items the chosen weight turned right and turned wrong against none; the mean probability
margin of the trusted answer's first token over the other's at the answer slot, the first step
whose greedy token starts either answer (over the items that reached one); time to first token
from KB KV in hand (edit + cache rebuild + question); the bytes of the cache and of the chunks
an edit adds to the network (those from the first edited chunk on: the chunks before it are
the KB's own).
"""
import argparse
import re
import statistics
import time

import numpy as np
import xxhash

from kdn.bench import emit_json, table

NEW_TOKENS = 24
CALIBRATION_SHARE = 0.4        # of each answer kind (and of the controls)
CHUNK_TOKENS = 256


# --- the items and their split -------------------------------------------------------------
def build_tasks(quick: bool = False) -> list:
    """Items {id, set, kind, length, docs [(name, text)] in KB order, trusted (doc name),
    question, gold [forms], other [forms] or None} from kdn.bench.emphasis_items. quick: the
    first two conflicts of each kind and the first four controls."""
    from kdn.bench.emphasis_items import CONFLICTS, CONTROLS
    by_id = {c["id"]: c for c in CONFLICTS}
    seen, out = {}, []
    for c in CONFLICTS:
        n = seen[c["kind"]] = seen.get(c["kind"], -1) + 1
        if quick and n >= 2:
            continue
        docs = [c["trusted"], c["untrusted"]] if n % 2 == 0 else [c["untrusted"], c["trusted"]]
        out.append(dict(id=c["id"], set="conflict", kind=c["kind"], length=c["length"], docs=docs,
                        trusted=c["trusted"][0], question=c["question"], gold=list(c["gold"]),
                        other=list(c["other"])))
    for cid, emph, other, asks in CONTROLS[:4] if quick else CONTROLS:
        e, o = by_id[emph], by_id[other]
        asked = e if asks == "emphasized" else o
        out.append(dict(id=cid, set="control", kind=asked["kind"], length=asked["length"],
                        docs=[e["trusted"], o["trusted"]], trusted=e["trusted"][0], question=asked["question"],
                        gold=list(asked["gold"]), other=None, asks_emphasized=asks == "emphasized"))
    return out


def split_items(tasks, seed: int = 0, share: float = CALIBRATION_SHARE) -> dict:
    """{item id: "calibration" | "report"}: in each group (the conflicts of one answer kind; the
    controls), the round(share * n) items whose xxh3_64("<seed>:<id>") is smallest calibrate."""
    groups = {}
    for t in tasks:
        groups.setdefault(t["kind"] if t["set"] == "conflict" else "control", []).append(t["id"])
    out = {}
    for ids in groups.values():
        ranked = sorted(ids, key=lambda i: xxhash.xxh3_64_intdigest(f"{seed}:{i}".encode()))
        k = int(round(share * len(ranked)))
        out.update({i: ("calibration" if n < k else "report") for n, i in enumerate(ranked)})
    return out


def choose_weight(right: dict) -> int:
    """The weight to report: right {weight: right answers on the calibration conflict items}
    (1: no emphasis). The most right answers; a tie goes to the smaller weight (the smaller edit)."""
    if not right:
        raise ValueError("no calibration results to choose a weight from")
    return min(right, key=lambda w: (-right[w], w))


def weight_from_calibration(outcomes: dict, split: dict) -> tuple:
    """(chosen weight, {weight: right on calibration}) from outcomes {item id: {weight: right?}}
    of the conflict items: only the items `split` calls calibration are read."""
    right = {}
    for item, by_weight in outcomes.items():
        if split[item] != "calibration":
            continue
        for w, ok in by_weight.items():
            right[w] = right.get(w, 0) + bool(ok)
    return choose_weight(right), right


# --- reading a reply -----------------------------------------------------------------------
def _find(text: str, forms) -> "re.Match | None":
    """The earliest whole-word, case-insensitive match of any form in text."""
    hits = [m for f in forms or () for m in [re.search(rf"(?<!\w){re.escape(f)}(?!\w)", text, re.I)] if m]
    return min(hits, key=lambda m: (m.start(), -m.end()), default=None)


def first_answer(text: str, gold, other) -> "str | None":
    """"gold" or "other": which answer the reply names first (None: neither). gold / other: a
    form or a list of accepted forms."""
    g = _find(text, [gold] if isinstance(gold, str) else gold)
    o = _find(text, [other] if isinstance(other, str) else other)
    if g and (not o or g.start() <= o.start()):
        return "gold"
    return "other" if o else None


def answered(text: str, gold, other) -> bool:
    """Whether the reply has named an answer in full: a match with text after it (so "1" is not
    taken for an answer while "12" may still be coming, nor "Priya" while "Priya Raman" may)."""
    m = [x for x in (_find(text, gold), _find(text, other or ())) if x]
    return bool(m) and min(m, key=lambda x: x.start()).end() < len(text)


def is_degenerate(text: str) -> bool:
    """An empty reply, one with no word, a word three times in a row, or (8+ words) one whose
    distinct words are fewer than half: the model looping rather than answering."""
    words = re.findall(r"\w+", text.lower())
    if not words:
        return True
    if any(a == b == c for a, b, c in zip(words, words[1:], words[2:])):
        return True
    return len(words) >= 8 and len(set(words)) < len(words) / 2


# --- answering -----------------------------------------------------------------------------
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
        """(reply text, answer-slot probabilities [vocab] or None, ttft s, cache tokens,
        edited-from token). The answer slot: the first step whose greedy token is one of `slot`
        (the answers' first tokens). stop: (gold forms, other forms): the reply ends once it has
        named one in full."""
        from kdn.engines import kv_edit as E
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
        out, pos, at_slot = [], len(tokens) + len(q), None
        while len(out) < NEW_TOKENS:
            nxt = int(logits.argmax())
            if at_slot is None and nxt in slot:
                at_slot = logits.float().softmax(-1).numpy()
            if nxt in model.eos_ids:
                break
            out.append(nxt)
            if stop and answered(model.tokenizer.decode(out, skip_special_tokens=True), *stop):
                break                       # the reply named one of the answers: that decides it
            logits = E.forward(model, [nxt], cache, pos, extra)
            pos += 1
        return (model.tokenizer.decode(out, skip_special_tokens=True), at_slot, ttft, edited.shape[3],
                E.first_edited(reps))


def conditions(weights, also=()) -> list:
    """(label, placed last?, weight, method): none, dup k for each weight, last; and `also`."""
    rows = [("none", False, 1, "duplicate")]
    rows += [(f"dup {k}", False, k, "duplicate") for k in weights]
    rows += [("last", True, 1, "duplicate")]
    extra = {"vscale": ("vscale 2", False, 2, "vscale"), "kscale": ("kscale 1.5", False, 1.5, "kscale"),
             "last+dup": (f"last+dup {weights[len(weights) // 2]}", True, weights[len(weights) // 2], "duplicate")}
    return rows + [extra[a] for a in also]


def first_tokens(model, forms) -> set:
    """Token ids that start an answer form (as written, capitalized, lower case; with or without
    a leading space; a lone space is no answer)."""
    out = set()
    for f in forms:
        for v in {f, f[:1].upper() + f[1:], f.lower()}:
            for s in (v, " " + v):
                i = model.encode(s)[0]
                if model.tokenizer.decode([i]).strip():
                    out.add(i)
    return out


def run(model, tasks, conds, log) -> list:
    """One record per (item, condition of `conds`): {id, set, kind, length, condition, weight, got,
    degenerate, text, slot, ttft, cache_tokens, tokens, edited_tokens}."""
    runner, records = Runner(model), []
    for n, item in enumerate(tasks):
        kbs, done = {}, {}
        g_ids = first_tokens(model, item["gold"])
        o_ids = first_tokens(model, item["other"]) if item["other"] else set()
        g_ids, o_ids = g_ids - o_ids, o_ids - g_ids           # a shared first token says nothing
        for label, last, w, method in conds:
            docs = item["docs"]
            if last:
                docs = [d for d in docs if d[0] != item["trusted"]] + [d for d in docs if d[0] == item["trusted"]]
            key = tuple(d[0] for d in docs)
            if (key, w, method) not in done:                  # "last" where the trusted one is last already
                if key not in kbs:
                    kbs[key] = runner.kb(docs)
                named, tokens, kv = kbs[key]
                text, at_slot, ttft, cache_tokens, edited_from = runner.answer(
                    named, tokens, kv, item["question"], {item["trusted"]: w} if w != 1 else {}, method,
                    (item["gold"], item["other"]), g_ids | o_ids)
                slot = None if at_slot is None else (sum(float(at_slot[i]) for i in g_ids)
                                                     - sum(float(at_slot[i]) for i in o_ids))
                edited = 0 if edited_from is None else cache_tokens - edited_from // CHUNK_TOKENS * CHUNK_TOKENS
                done[(key, w, method)] = dict(text=text, slot=slot, ttft=ttft, cache_tokens=cache_tokens,
                                              tokens=len(tokens), edited_tokens=edited)
            r = dict(done[(key, w, method)], id=item["id"], set=item["set"], kind=item["kind"],
                     length=item["length"], condition=label, weight=w if method == "duplicate" and not last else None)
            r["got"] = first_answer(r["text"], item["gold"], item["other"])
            r["degenerate"] = is_degenerate(r["text"])
            records.append(r)
            log(f"{n:3d} {item['id']:22s} {label:10s} gold={item['gold'][0]:14.14s} got={r['got']!s:6s} "
                f"slot={r['slot'] if r['slot'] is not None else float('nan'):+.3f} ttft={1e3 * r['ttft']:.0f}ms "
                f"{r['text']!r}")
    return records


# --- summaries -----------------------------------------------------------------------------
def summarize(records, split: dict, bytes_per_token: int) -> list:
    """One row per (split, set, condition)."""
    groups = {}
    for r in records:
        groups.setdefault((split[r["id"]], r["set"], r["condition"]), []).append(r)
    rows = []
    for (part, set_name, label), rs in groups.items():
        slots = [r["slot"] for r in rs if r["slot"] is not None]
        n = len(rs)
        rows.append({"split": part, "set": set_name, "condition": label, "n": n,
                     "right": sum(r["got"] == "gold" for r in rs),
                     "right_pct": round(100.0 * sum(r["got"] == "gold" for r in rs) / n, 1),
                     "other": sum(r["got"] == "other" for r in rs),
                     "neither": sum(r["got"] is None for r in rs),
                     "degenerate": sum(r["degenerate"] for r in rs),
                     "slot_margin": round(statistics.mean(slots), 3) if slots else None,
                     "slots": len(slots),
                     "ttft_ms": round(1e3 * statistics.median(r["ttft"] for r in rs), 1),
                     "cache_kib": round(statistics.mean(r["cache_tokens"] for r in rs) * bytes_per_token / 1024, 1),
                     "kb_kib": round(statistics.mean(r["tokens"] for r in rs) * bytes_per_token / 1024, 1),
                     "edited_chunk_kib": round(statistics.mean(r["edited_tokens"] for r in rs)
                                               * bytes_per_token / 1024, 1)})
    order = {"calibration": 0, "report": 1}
    return sorted(rows, key=lambda r: (order[r["split"]], r["set"] != "conflict"))   # stable within


def held_out(records, split: dict, chosen: str, set_name: str = "conflict") -> dict:
    """On the report split's items of one set: right under none and under the chosen condition,
    the items it turned right and wrong, degenerate replies under each."""
    by = {}
    for r in records:
        if split[r["id"]] == "report" and r["set"] == set_name and r["condition"] in ("none", chosen, "last"):
            by.setdefault(r["id"], {})[r["condition"]] = r
    ids = sorted(by)
    right = {c: sum(by[i][c]["got"] == "gold" for i in ids) for c in ("none", chosen, "last")}
    return {"items": len(ids), "right_none": right["none"], "right_chosen": right[chosen],
            "right_last": right["last"],
            "turned_right": sorted(i for i in ids if by[i]["none"]["got"] != "gold" and by[i][chosen]["got"] == "gold"),
            "turned_wrong": sorted(i for i in ids if by[i]["none"]["got"] == "gold" and by[i][chosen]["got"] != "gold"),
            "degenerate_none": sum(by[i]["none"]["degenerate"] for i in ids),
            "degenerate_chosen": sum(by[i][chosen]["degenerate"] for i in ids),
            "degenerate_chosen_items": sorted(i for i in ids if by[i][chosen]["degenerate"])}


def by_group(records, split: dict, chosen: str) -> list:
    """Report-split conflicts by answer kind and by document length: right under none / chosen."""
    rows = []
    for field in ("kind", "length"):
        groups = {}
        for r in records:
            if split[r["id"]] == "report" and r["set"] == "conflict" and r["condition"] in ("none", chosen):
                g = groups.setdefault(r[field], {"none": 0, chosen: 0, "ids": set()})
                g[r["condition"]] += r["got"] == "gold"
                g["ids"].add(r["id"])
        for value, g in groups.items():
            rows.append({"by": field, "group": value, "n": len(g["ids"]), "right_none": g["none"],
                         f"right_{chosen.replace(' ', '')}": g[chosen]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench emphasis", description=__doc__.split("\n")[0])
    ap.add_argument("--weights", type=str, default="2,4,8",
                    help="duplicate weights to choose among on the calibration split (default 2,4,8)")
    ap.add_argument("--seed", type=int, default=0, help="the split's seed (default 0)")
    ap.add_argument("--calibration-share", type=float, default=CALIBRATION_SHARE,
                    help=f"share of each answer kind that calibrates (default {CALIBRATION_SHARE})")
    ap.add_argument("--also", type=str, default="",
                    help="more conditions, comma-separated: vscale, kscale, last+dup")
    ap.add_argument("--report-all", action="store_true",
                    help="answer the report split under every weight too, not only none, the chosen one and "
                         "last (what choosing on the reported items would have picked; it changes nothing)")
    ap.add_argument("--quick", action="store_true", help="2 conflicts of each kind and 4 controls")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: on a shared machine more threads fight for cores)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    from kdn.core.emphasis import check_weights
    from kdn.core.errors import BadRequest
    try:                                    # the service's rule for a weight; 1 is no emphasis, run always
        weights = sorted({check_weights({"trusted.md": int(w)}).get("trusted.md", 1) for w in args.weights.split(",")})
    except (BadRequest, ValueError) as e:
        raise SystemExit(f"--weights: integers in [2, 16], comma-separated ({e})")
    if 1 in weights:
        raise SystemExit("--weights: 1 is no emphasis, which every run answers (condition 'none')")
    also = [a.strip() for a in args.also.split(",") if a.strip()]
    if not 0 < args.calibration_share < 1 or set(also) - {"vscale", "kscale", "last+dup"}:
        raise SystemExit("--calibration-share must be in (0, 1); --also takes vscale, kscale, last+dup")
    import torch
    from kdn.engines.transformers.model import load_model
    torch.set_num_threads(args.threads)

    log = (lambda *a: print(*a, flush=True)) if args.verbose else (lambda *a: None)
    tasks = build_tasks(args.quick)
    split = split_items(tasks, args.seed, args.calibration_share)
    count = {(s, p): sum(1 for t in tasks if t["set"] == s and split[t["id"]] == p)
             for s in ("conflict", "control") for p in ("calibration", "report")}
    split_line = (f"split (seed {args.seed}): {args.calibration_share:.0%} of each answer kind and of the controls "
                  f"calibrate, by xxh3 of '<seed>:<item id>': calibration {count[('conflict', 'calibration')]} "
                  f"conflict + {count[('control', 'calibration')]} control items, report "
                  f"{count[('conflict', 'report')]} conflict + {count[('control', 'report')]} control items")
    print(split_line)
    print("calibration items: " + ", ".join(sorted(t["id"] for t in tasks if split[t["id"]] == "calibration")),
          flush=True)
    model = load_model()
    t0 = time.perf_counter()
    every = conditions(weights, also)
    records = run(model, [t for t in tasks if split[t["id"]] == "calibration"], every, log)   # 1: calibrate
    outcomes = {}
    for r in records:
        if r["set"] == "conflict" and r["weight"] is not None:
            outcomes.setdefault(r["id"], {})[r["weight"]] = r["got"] == "gold"
    w, calibration_right = weight_from_calibration(outcomes, split)
    chosen = "none" if w == 1 else f"dup {w}"
    report_conds = every if args.report_all else [c for c in every if c[0] in ("none", chosen, "last")
                                                   or c[3] != "duplicate" or c[0].startswith("last+")]
    records += run(model, [t for t in tasks if split[t["id"]] == "report"], report_conds, log)  # 2: report
    bpt = model.kv_bytes_per_token
    rows = summarize(records, split, bpt)
    cols = ["set", "condition", "n", "right", "right_pct", "other", "neither", "degenerate", "slot_margin",
            "ttft_ms", "cache_kib", "edited_chunk_kib"]
    print("\ncalibration split (the weight is chosen here, on its conflict items):")
    table([r for r in rows if r["split"] == "calibration"], cols)
    n_cal = count[("conflict", "calibration")]
    print(f"chosen on calibration: {chosen} (right of {n_cal}: "
          + ", ".join(("none" if k == 1 else f"dup {k}") + f" {calibration_right[k]}" for k in sorted(calibration_right))
          + "; ties go to the smaller weight)")
    print("\nreport split (held out; it chose nothing):")
    table([r for r in rows if r["split"] == "report"], cols)
    h = held_out(records, split, chosen)
    c = held_out(records, split, chosen, "control")
    gain = 100.0 * (h["right_chosen"] - h["right_none"]) / max(1, h["items"])
    print(f"\nheld out, {h['items']} conflict items: none {h['right_none']}/{h['items']}, {chosen} "
          f"{h['right_chosen']}/{h['items']} ({gain:+.1f} points), placed last {h['right_last']}/{h['items']}; "
          f"turned right {len(h['turned_right'])}, turned wrong {len(h['turned_wrong'])}"
          + (f" ({', '.join(h['turned_wrong'])})" if h["turned_wrong"] else "")
          + f"; degenerate replies {h['degenerate_chosen']} (none: {h['degenerate_none']}); controls "
          f"{c['right_none']}/{c['items']} -> {c['right_chosen']}/{c['items']} "
          f"({time.perf_counter() - t0:.0f} s)")
    groups = by_group(records, split, chosen)
    table(groups)
    if args.json:
        emit_json({"bench": "emphasis", "model": model.name, "seed": args.seed,
                   "calibration_share": args.calibration_share, "split_line": split_line,
                   "split": {p: sorted(i for i, s in split.items() if s == p) for p in ("calibration", "report")},
                   "weights": weights, "chosen": chosen, "chosen_weight": w,
                   "calibration_right": {str(k): v for k, v in sorted(calibration_right.items())},
                   "held_out": h, "held_out_control": c, "held_out_gain_points": round(gain, 1),
                   "by_group": groups, "rows": rows, "kv_bytes_per_token": bpt,
                   "replies": [{k: r[k] for k in ("id", "condition", "got", "degenerate", "text")} for r in records]})


if __name__ == "__main__":
    main()
