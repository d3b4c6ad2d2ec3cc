"""`kdn bench codecs`: size, speed and model quality of every KV codec on SmolLM2's real KV.

The bundled knowledge base is prefilled once on the 256-token chunk grid (exact fp32 KV);
every chunk is encoded and decoded with each codec, and the decoded KV replaces the exact
KV as the cached prefix. Against the exact cache, per codec:

- size: payload bytes against the fp32 KV and against the same KV in fp16 (x smaller);
- speed: encode and decode GB/s of fp32 KV bytes, one thread (numpy and zstd are
  single-threaded here), best of --speed-reps passes over --speed-chunks full chunks;
- top-1 agreement: for --prompts questions about the knowledge (the bundled questions, then
  questions quoting its sentences), each a prompt knowledge + question, the share whose next
  token (the answer's first) is the one the exact cache gives. The first answer token is
  nearly always predictable (every codec scores ~100% here), so answer_top1 also scores
  every position of each prompt's exact greedy answer (--answer-tokens, teacher-forced):
  the share where the codec's top-1 is the exact cache's token;
- continuation: the greedy continuation of the first --continuations prompts, --cont-tokens
  tokens each; the mean number of leading tokens equal to the exact cache's continuation;
- perplexity change: the knowledge's last --ppl-tokens tokens are scored (teacher-forced)
  given the codec's KV of every earlier chunk; ppl = exp(mean NLL) and its change against
  the exact KV in percent. pos_agree is the top-1 agreement at those positions.

Codecs whose decoded KV is bit-identical to another's are scored once (lossless ones equal
the exact KV; "q4z" decodes to exactly "q4"'s tensor). The plot (--plot PATH) shows size
against fp16 versus top-1 agreement (filled: the answers' first tokens; crosses:
answer_top1; hollow: pos_agree), with the
targets (4x, 99%) drawn in.
"""
import argparse
import math
import re
import time

import numpy as np
import torch
import xxhash

from kdn.bench import emit_json, matching_prefix, table
from kdn.core.chunk import _CODECS
from kdn.core.codecs import LOSSLESS, LOSSY

CHUNK = 256
PACK_TOKENS = 512           # prompt tokens per packed forward pass
TARGET_RATIO_FP16 = 4.0
TARGET_AGREE = 0.99
TARGET_DECODE_GBPS = 1.0


def questions(docs, n: int) -> list:
    """n distinct questions on the documents: the bundled ones, then ones quoting sentences."""
    from kdn.cli.knowledge import bundled_questions
    out = list(bundled_questions())
    per_doc = [[s.strip() for s in re.split(r"(?<=[.;:?!])\s+|\n+", text) if len(s.split()) >= 8]
               for _, text in docs]
    templates = ('What does the text say about "{a}"?', 'Which document contains the words "{b}"?')
    for template in templates:
        for i in range(max(map(len, per_doc), default=0)):
            for sentences in per_doc:
                if i < len(sentences):
                    w = re.sub(r"[^\w' ,-]", "", sentences[i]).split()
                    out.append(template.format(a=" ".join(w[:6]), b=" ".join(w[2:8])))
    out = list(dict.fromkeys(out))
    if len(out) < n:
        out += [f"Summarize part {i + 1} of the text in one sentence." for i in range(n - len(out))]
    return out[:n]


def _header(c: np.ndarray, nbytes: int) -> dict:
    return {"layers": c.shape[0], "heads": c.shape[2], "tokens": c.shape[3],
            "head_dim": c.shape[4], "dtype": "float32", "raw": c.nbytes, "nbytes": nbytes}


def roundtrip(name: str, kv: np.ndarray):
    """(decoded KV, payload bytes): every 256-token chunk of kv through the codec."""
    enc, dec = _CODECS[name]
    parts, size = [], 0
    for s in range(0, kv.shape[3], CHUNK):
        c = np.ascontiguousarray(kv[:, :, :, s:s + CHUNK])
        payload = memoryview(enc(c, "float32")).cast("B")
        parts.append(dec(payload, _header(c, payload.nbytes)))
        size += payload.nbytes
    return np.concatenate(parts, axis=3), size


def speed(name: str, kv: np.ndarray, chunks: int, reps: int) -> tuple:
    """(encode GB/s, decode GB/s) of fp32 KV bytes: best of reps over `chunks` full chunks."""
    enc, dec = _CODECS[name]
    picked = [np.ascontiguousarray(kv[:, :, :, s:s + CHUNK])
              for s in range(CHUNK, kv.shape[3] - CHUNK + 1, CHUNK)][:chunks] \
        or [np.ascontiguousarray(kv[:, :, :, :CHUNK])]
    nbytes = sum(c.nbytes for c in picked)
    best_e = best_d = float("inf")
    for _ in range(reps):
        te = td = 0.0
        for c in picked:
            t0 = time.perf_counter()
            payload = memoryview(enc(c, "float32")).cast("B")
            t1 = time.perf_counter()
            dec(payload, _header(c, payload.nbytes))
            td += time.perf_counter() - t1
            te += t1 - t0
        best_e, best_d = min(best_e, te), min(best_d, td)
    return nbytes / max(best_e, 1e-9) / 1e9, nbytes / max(best_d, 1e-9) / 1e9


def lossless_alternatives(kv: np.ndarray, chunks: int) -> list:
    """What the "zstd" codec was chosen over, measured on the same chunks: zstd on the raw
    bytes (no byte planes), lz4 on the byte planes, and the codec itself. Ratio against the
    raw bytes; encode and decode GB/s of raw bytes, one thread."""
    import lz4.frame
    import zstandard
    picked = [np.ascontiguousarray(kv[:, :, :, s:s + CHUNK])
              for s in range(0, kv.shape[3] - CHUNK + 1, CHUNK)][:chunks]
    zc, zd = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    def planes(c):
        return [np.ascontiguousarray(p) for p in c.reshape(-1).view(np.uint8).reshape(-1, 4).T]

    methods = {
        "zstd, whole bytes": (lambda c: [zc.compress(memoryview(c).cast("B"))],
                              lambda blobs, n: [zd.decompress(b, max_output_size=n) for b in blobs]),
        "zstd, byte planes": (lambda c: [zc.compress(p) for p in planes(c)],
                              lambda blobs, n: [zd.decompress(b, max_output_size=n) for b in blobs]),
        "lz4, byte planes": (lambda c: [lz4.frame.compress(p) for p in planes(c)],
                             lambda blobs, n: [lz4.frame.decompress(b) for b in blobs]),
    }
    rows = []
    raw = sum(c.nbytes for c in picked)
    for name, (enc, dec) in methods.items():
        t0 = time.perf_counter()
        blobs = [enc(c) for c in picked]
        t1 = time.perf_counter()
        for c, b in zip(picked, blobs):
            dec(b, c.nbytes)
        t2 = time.perf_counter()
        size = sum(len(x) for b in blobs for x in b)
        rows.append({"method": name, "x_raw": raw / size, "enc_GBps": raw / (t1 - t0) / 1e9,
                     "dec_GBps": raw / (t2 - t1) / 1e9})
    return rows


class Scorer:
    """The model's answers with one cached knowledge prefix, exact or decoded."""

    def __init__(self, model, knowledge: list, prompts: list, ppl_start: int):
        self.m, self.knowledge, self.prompts, self.ppl_start = model, knowledge, prompts, ppl_start

    def _forward(self, ids, cache, all_logits=False):
        return self.m.logits(ids, cache, all_logits)

    def next_tokens(self, kv) -> list:
        """The next token after each prompt (the answer's first token)."""
        return [a[0] for a in self.argmax_tails(kv, self.prompts, [1] * len(self.prompts))]

    def answer_agreement(self, kv, answers) -> float:
        """Share of answer positions where kv's top-1 is the exact cache's greedy token.

        Each prompt is followed by its exact answer (teacher forcing), so every answer
        position is scored, not just the first (which is nearly always predictable).
        """
        pairs = [(q, a) for q, a in zip(self.prompts, answers) if a]
        answers = [a for _, a in pairs]
        got = self.argmax_tails(kv, [q + a[:-1] for q, a in pairs], [len(a) for a in answers])
        hits = sum(int(x == y) for g, a in zip(got, answers) for x, y in zip(g, a))
        return hits / max(1, sum(map(len, answers)))

    def answers(self, kv, tokens: int) -> list:
        """The exact cache's greedy answer to each prompt (up to `tokens` tokens, before EOS)."""
        cache = self.m.cache_from_kv([kv])
        n = self.m.cache_tokens(cache)
        out = []
        for q in self.prompts:
            g = self.m.generate(self.knowledge + q, cache=cache, cached_tokens=n, max_new_tokens=tokens)
            out.append(list(g.tokens))
            self.m.crop(cache, n)
        return out

    def argmax_tails(self, kv, seqs, tails) -> list:
        """For each sequence after the cached knowledge, the top-1 token at its last `tail`
        positions; sequences packed PACK_TOKENS to a forward pass.

        A pack is the sequences back to back after the cached knowledge, with a
        block-diagonal causal mask (each sees the knowledge and itself) and positions
        restarting after the knowledge for each: the same logits as one sequence at a time
        (to ~4e-5, the chunked-prefill noise), at a fraction of the cost.
        """
        cache = self.m.cache_from_kv([kv])
        n = self.m.cache_tokens(cache)
        out, i = [], 0
        while i < len(seqs):
            pack = [seqs[i]]
            while i + len(pack) < len(seqs) and \
                    sum(map(len, pack)) + len(seqs[i + len(pack)]) <= PACK_TOKENS:
                pack.append(seqs[i + len(pack)])
            first = i
            i += len(pack)
            total = sum(map(len, pack))
            mask = torch.zeros((1, 1, total, n + total), dtype=torch.bool)
            mask[..., :n] = True
            positions, ends, at = [], [], 0
            for q in pack:
                k = len(q)
                mask[0, 0, at:at + k, n + at:n + at + k] = torch.ones(k, k, dtype=torch.bool).tril()
                positions += range(n, n + k)
                at += k
                ends.append(at - 1)
            with torch.inference_mode():
                logits = self.m.hf(input_ids=torch.tensor([sum(pack, [])], dtype=torch.long),
                                   attention_mask=mask, position_ids=torch.tensor([positions]),
                                   **self.m.cache_kwargs(cache)).logits[0]
            for j, e in enumerate(ends):
                t = tails[first + j]
                out.append(logits[e - t + 1:e + 1].argmax(-1).tolist())
            self.m.crop(cache, n)
        return out

    def continuations(self, kv, count: int, tokens: int) -> list:
        n = len(self.knowledge)
        return [self.m.generate(self.knowledge + q, cache=self.m.cache_from_kv([kv]),
                                cached_tokens=n, max_new_tokens=tokens).tokens
                for q in self.prompts[:count]]

    def perplexity(self, kv):
        """(ppl of knowledge[ppl_start + 1:] given kv[:ppl_start], argmax at each position)."""
        cache = self.m.cache_from_kv([kv[:, :, :, :self.ppl_start]])
        ids = self.knowledge[self.ppl_start:]
        logits = self._forward(ids, cache, all_logits=True).float()
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
        return math.exp(nll.item()), logits.argmax(-1)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, r in enumerate(rows):
        color = "tab:green" if r["lossless"] else "tab:blue"
        ax.scatter(r["x_fp16"], 100 * r["top1"], color=color,
                   label="prompts: next token after the question" if i == 0 else None)
        ax.scatter(r["x_fp16"], 100 * r["answer_top1"], color=color, marker="x",
                   label="prompts: every answer token (teacher-forced)" if i == 0 else None)
        ax.scatter(r["x_fp16"], 100 * r["pos_agree"], facecolors="none", edgecolors=color,
                   label="knowledge text: every position (teacher-forced)" if i == 0 else None)
        ax.annotate(r["codec"], (r["x_fp16"], 100 * r["pos_agree"]), textcoords="offset points",
                    xytext=(4, -10), fontsize=8)
    ax.legend(loc="lower left", fontsize=8)
    ax.axvline(TARGET_RATIO_FP16, color="grey", ls="--", lw=0.8)
    ax.axhline(100 * TARGET_AGREE, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("size ratio vs fp16 KV (x smaller)")
    ax.set_ylabel("next-token top-1 agreement with exact KV (%)")
    ax.set_title("KDN KV codecs on SmolLM2-135M (targets dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench codecs", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="2 documents, 40 prompts, 2 continuations, 256 scored tokens")
    ap.add_argument("--codecs", default=",".join(("raw",) + LOSSLESS + LOSSY))
    ap.add_argument("--prompts", type=int, default=None, help="questions scored (default 200)")
    ap.add_argument("--continuations", type=int, default=None, help="greedy continuations (5)")
    ap.add_argument("--cont-tokens", type=int, default=16)
    ap.add_argument("--answer-tokens", type=int, default=16,
                    help="tokens of each prompt's exact answer scored teacher-forced (answer_top1)")
    ap.add_argument("--ppl-tokens", type=int, default=None, help="tokens scored for perplexity (512)")
    ap.add_argument("--speed-chunks", type=int, default=4, help="full chunks timed per codec")
    ap.add_argument("--speed-reps", type=int, default=3, help="timing repetitions (best kept)")
    ap.add_argument("--plot", default=None, help="write a PNG of size ratio vs agreement here")
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)
    n_prompts = args.prompts or (40 if args.quick else 200)
    n_cont = args.continuations if args.continuations is not None else (2 if args.quick else 5)
    ppl_tokens = args.ppl_tokens or (256 if args.quick else 512)
    names = [c for c in args.codecs.split(",") if c]
    unknown = [c for c in names if c not in _CODECS]
    if unknown:
        ap.error(f"unknown codec(s) {', '.join(unknown)}; known: {', '.join(sorted(_CODECS))}")

    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers.model import load_model
    t_start = time.perf_counter()
    model = load_model(log=print)
    docs = bundled_documents()[:2] if args.quick else bundled_documents()
    knowledge = model.knowledge_tokens("\n\n".join(text for _, text in docs))
    ppl_start = max(CHUNK, (len(knowledge) - ppl_tokens) // CHUNK * CHUNK)
    prompts = [model.question_tokens(q) for q in questions(docs, n_prompts)]
    t0 = time.perf_counter()
    exact = model.prefill(knowledge, chunk_tokens=CHUNK).kv
    print(f"knowledge: {len(docs)} documents, {len(knowledge)} tokens, "
          f"{exact.nbytes / 1e6:.1f} MB fp32 KV, prefill {time.perf_counter() - t0:.1f} s; "
          f"{len(prompts)} prompts, perplexity on tokens [{ppl_start}, {len(knowledge)})", flush=True)

    scorer = Scorer(model, knowledge, prompts, ppl_start)
    t0 = time.perf_counter()
    ref_next = scorer.next_tokens(exact)
    ref_answers = scorer.answers(exact, args.answer_tokens)
    ref_cont = scorer.continuations(exact, n_cont, args.cont_tokens)
    ref_ppl, ref_pos = scorer.perplexity(exact)
    print(f"exact KV scored in {time.perf_counter() - t0:.1f} s", flush=True)

    exact_digest = xxhash.xxh3_128_hexdigest(memoryview(exact).cast("B"))
    scored = {exact_digest: {"top1": 1.0, "cont": float(args.cont_tokens) if n_cont else 0.0,
                             "ppl": ref_ppl, "pos_agree": 1.0, "answer_top1": 1.0}}
    fp32, fp16 = exact.nbytes, exact.nbytes // 2
    rows = []
    for name in names:
        decoded, size = roundtrip(name, exact)
        enc_gbps, dec_gbps = speed(name, exact, args.speed_chunks, args.speed_reps)
        digest = xxhash.xxh3_128_hexdigest(memoryview(decoded).cast("B"))
        if digest not in scored:
            t0 = time.perf_counter()
            nxt = scorer.next_tokens(decoded)
            cont = scorer.continuations(decoded, n_cont, args.cont_tokens)
            ppl, pos = scorer.perplexity(decoded)
            scored[digest] = {
                "top1": sum(a == b for a, b in zip(nxt, ref_next)) / len(ref_next),
                "cont": (sum(matching_prefix(a, b) for a, b in zip(cont, ref_cont)) / n_cont) if n_cont else 0.0,
                "ppl": ppl, "pos_agree": (pos == ref_pos).float().mean().item(),
                "answer_top1": scorer.answer_agreement(decoded, ref_answers)}
            print(f"{name}: scored in {time.perf_counter() - t0:.1f} s", flush=True)
        q = scored[digest]
        err = float(np.abs(decoded - exact).max())
        rows.append({"codec": name, "lossless": digest == exact_digest, "bytes": size,
                     "x_fp32": fp32 / size, "x_fp16": fp16 / size,
                     "enc_GBps": enc_gbps, "dec_GBps": dec_gbps,
                     "top1": q["top1"], "answer_top1": q["answer_top1"],
                     "cont_match": q["cont"], "ppl": q["ppl"],
                     "ppl_change_pct": 100 * (q["ppl"] / ref_ppl - 1), "pos_agree": q["pos_agree"],
                     "max_abs_err": err})
    table(rows, ["codec", "lossless", "bytes", "x_fp32", "x_fp16", "enc_GBps", "dec_GBps", "top1",
                 "answer_top1", "cont_match", "ppl", "ppl_change_pct", "pos_agree", "max_abs_err"])
    meets = [r["codec"] for r in rows if not r["lossless"] and r["x_fp16"] >= TARGET_RATIO_FP16
             and r["top1"] >= TARGET_AGREE and r["dec_GBps"] >= TARGET_DECODE_GBPS]
    lossless_ok = all(r["bytes"] <= fp32 for r in rows if r["codec"] in LOSSLESS)
    alternatives = lossless_alternatives(exact, args.speed_chunks)
    print("\nlossless alternatives, measured on the same chunks (the zstd codec keeps, per plane, "
          "only the planes zstd shrinks; lz4 and whole-byte zstd were not kept):")
    table(alternatives, ["method", "x_raw", "enc_GBps", "dec_GBps"])
    print(f"target (lossy >= {TARGET_RATIO_FP16}x fp16, >= {100 * TARGET_AGREE:.0f}% top-1, "
          f">= {TARGET_DECODE_GBPS} GB/s decode): {', '.join(meets) or 'not met'}; "
          f"lossless never larger than raw: {lossless_ok}; "
          f"total {time.perf_counter() - t_start:.0f} s")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        emit_json({"bench": "codecs", "tokens": len(knowledge), "prompts": len(prompts),
                   "continuations": n_cont, "cont_tokens": args.cont_tokens,
                   "ppl_tokens": len(knowledge) - ppl_start, "ref_ppl": ref_ppl,
                   "rows": rows, "target_met_by": meets, "lossless_never_larger": lossless_ok,
                   "lossless_alternatives": alternatives})
