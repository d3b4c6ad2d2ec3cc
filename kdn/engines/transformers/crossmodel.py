"""Reading another family member's KV with a recompute plan (kdn.engines.family), for transformers.

The sender's side: `capture` records the hidden states entering chosen layers while a model
prefills (the same chunked prefill that computes the KV it publishes), and `publish_hidden`
stores them beside the sender's KB, one namespace per layer (kdn.engines.family.hidden_fingerprint:
it names the sender), chunked and checksummed like KV. A chunk holds KV-shaped arrays, so a
hidden state [tokens, hidden] travels as [1, 2, 1, tokens, hidden/2] (its two halves on the
K/V axis: `to_chunk_layout`, `from_chunk_layout`).

The reader's side: `recompute` runs the reader's own layers [start, end) over the sender's
hidden states entering `start` and returns their KV; `assemble` puts it in place of the
sender's KV for those layers. `CrossReader.answer` does a whole read: the sender's KV and hidden
states from the nearest edge (the hidden states first, so the recompute runs while the KV
arrives), the cache rebuilt, the recomputed layers written over it, the question prefilled and
answered greedily; the Answer says exact=False and names the sender and plan (`cross_model`).
With the admin token it keeps the assembled KV under the plan's own namespace
(kdn.engines.family.cross_fingerprint) and reads it from there next time, with no recompute.

`profile` measures, on calibration KBs and questions, how often each candidate plan's greedy
answers agree with the reader's own (teacher-forced: the reader's reference answer is run in
one forward over the assembled cache, and a plan agrees on a question where every position's
argmax is the reference's token, i.e. its greedy answer would be identical); family.choose picks
from it. `calibrate` runs both on the calibration split (CALIBRATION_DOCS cut into `windows`,
CALIBRATION_QUESTIONS), the one `kdn model plan` stores a pair's plan from and `kdn bench
crossmodel` holds its report split apart from. Nothing here is exact and nothing here is
reached without asking for it.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import time

import numpy as np
import torch

from kdn.core.errors import ManifestError, ModelError
from kdn.engines.base import Answer
from kdn.engines.family import Plan, check_family, choose, cross_fingerprint, hidden_fingerprint

# The calibration split: plans are profiled and chosen on these bundled documents and
# questions only (`kdn bench crossmodel` reports on other documents and other questions).
CALIBRATION_DOCS = ("constitution-article-iii", "bill-of-rights", "gettysburg-address")
CALIBRATION_QUESTIONS = ("What is this text about?", "Summarize the passage in one sentence.",
                         "Who is speaking in this text?", "Name one power or right the passage mentions.",
                         "What is the first sentence of the passage?")


# --- hidden states ---------------------------------------------------------------------------
@contextlib.contextmanager
def capture(model, layers):
    """Within the block, record the hidden states entering each of `layers` on every forward
    of `model`: yields {layer: [tensor [tokens, hidden] per forward, in order]}."""
    layers = sorted({int(a) for a in layers})
    for a in layers:
        if not 0 <= a < model.layers:
            raise ModelError(f"layer {a} is outside {model.name}'s {model.layers} layers")
    got = {a: [] for a in layers}
    blocks = model.hf.model.layers

    def hook_for(a):
        def hook(module, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            got[a].append(h[0].detach().clone())
        return hook
    handles = [blocks[a].register_forward_pre_hook(hook_for(a), with_kwargs=True) for a in layers]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def prefill_with_hidden(model, tokens, layers, chunk_tokens: int = 256) -> tuple:
    """(KV [layers, 2, kv_heads, T, head_dim], {layer: hidden [T, hidden] float32 numpy}) of a
    plain chunked prefill of tokens (model.prefill: the KV is the KB's own, bit for bit)."""
    with capture(model, layers) as got:
        kv = model.prefill(tokens, chunk_tokens=chunk_tokens).kv
    return kv, {a: torch.cat(parts).float().numpy() for a, parts in got.items()}


def to_chunk_layout(hidden: np.ndarray) -> np.ndarray:
    """hidden [tokens, hidden] -> [1, 2, 1, tokens, hidden/2]: its halves on the K/V axis."""
    t, h = hidden.shape
    if h % 2:
        raise ModelError(f"hidden size {h} is odd: it cannot be stored as two halves")
    return np.ascontiguousarray(hidden.reshape(t, 2, h // 2).transpose(1, 0, 2)[None, :, None])


def from_chunk_layout(arr) -> np.ndarray:
    """The inverse of to_chunk_layout: [1, 2, 1, tokens, hidden/2] -> [tokens, hidden]."""
    arr = np.asarray(arr)
    if arr.ndim != 5 or arr.shape[0] != 1 or arr.shape[1] != 2 or arr.shape[2] != 1:
        raise ModelError(f"hidden states arrive as [1, 2, 1, tokens, hidden/2], got {arr.shape}")
    return np.ascontiguousarray(arr[0, :, 0].transpose(1, 0, 2).reshape(arr.shape[3], -1))


# --- the reader's recompute ----------------------------------------------------------------
def recompute(model, hidden, start: int, end: int) -> np.ndarray:
    """KV [end - start, 2, kv_heads, T, head_dim] of the reader `model`'s layers [start, end) run
    over `hidden` [T, hidden] (the states entering `start`, positions 0..T-1): one causal pass
    of those layers, with the reader's own weights."""
    if not 0 <= start < end <= model.layers:
        raise ModelError(f"layers [{start}, {end}) are not within {model.name}'s {model.layers}")
    h = torch.as_tensor(np.asarray(hidden), dtype=model.hf.dtype).unsqueeze(0)
    if h.dim() != 3 or h.shape[2] != model.hf.config.hidden_size:
        raise ModelError(f"hidden states must be [tokens, {model.hf.config.hidden_size}], got "
                         f"{tuple(h.shape[1:])}")
    m, t = model.hf.model, h.shape[1]
    cache = model.new_cache()
    pos = torch.arange(t).unsqueeze(0)
    with torch.inference_mode():
        emb = m.rotary_emb(h, position_ids=pos)
        for i in range(start, end):   # no mask and no past: square causal attention in any sdpa
            h = m.layers[i](h, attention_mask=None, position_embeddings=emb, position_ids=pos,
                            past_key_values=cache, use_cache=True)
        out = np.empty((end - start, 2, model.kv_heads, t, model.head_dim), dtype=np.float32)
        for j, i in enumerate(range(start, end)):
            layer = cache.layers[i]
            out[j, 0], out[j, 1] = layer.keys[0].float().numpy(), layer.values[0].float().numpy()
    model.counters["recompute_calls"] += 1
    model.counters["recompute_layers"] += end - start
    return out


def assemble(sender_kv: np.ndarray, recomputed: np.ndarray, start: int) -> np.ndarray:
    """A copy of sender_kv [layers, 2, ...] with layers [start, start + len(recomputed)) replaced."""
    out = np.array(sender_kv, copy=True)
    out[start:start + recomputed.shape[0]] = recomputed
    return out


def overwrite_layers(model, cache, recomputed, start: int) -> None:
    """Write recomputed KV [k, 2, kv_heads, T, head_dim] over layers [start, start + k) of an
    engine cache holding T tokens (in place: the cache's buffers are the arena's)."""
    pairs = model._layer_kv(cache)
    src = torch.from_numpy(np.asarray(recomputed))
    with torch.inference_mode():
        for j in range(src.shape[0]):
            k, v = pairs[start + j]
            k[0].copy_(src[j, 0])
            v[0].copy_(src[j, 1])


# --- publishing the sender's hidden states --------------------------------------------------
def publish_hidden(client, model, kb: str, documents, layers) -> dict:
    """Store the hidden states of sender `model` entering each of `layers` over KB `kb`'s
    knowledge beside its KV (published by kdn.client.publish.publish_documents under the same
    client), one namespace per layer. Returns {"layers": {layer: receipt}, "bytes": total}.
    The client needs the admin token (it publishes)."""
    from kdn.client.publish import Publisher, knowledge_documents
    from kdn.client.documents import check_documents
    if client.fingerprint != model.fingerprint:
        raise ModelError(f"the client publishes for {client.fingerprint!r}, not {model.fingerprint!r}: "
                         "hidden states are stored under the model that computed them")
    named = knowledge_documents(model, check_documents(documents))
    tokens = [t for _, toks in named for t in toks]
    _, hidden = prefill_with_hidden(model, tokens, layers, client.chunk_tokens)
    out, total = {}, 0
    for a, h in hidden.items():
        pub = Publisher(client.view, client.tenant, hidden_fingerprint(model.fingerprint, a),
                        chunk_tokens=client.chunk_tokens)
        receipt = pub.publish(kb, named, to_chunk_layout(h))
        out[a] = receipt
        total += h.nbytes
    return {"layers": out, "bytes": total, "tokens": len(tokens)}


# --- reading across --------------------------------------------------------------------------
class CrossReader:
    """Answers of reader `model` over KBs published by `plan.sender`, with `plan` (opt-in: nothing
    else in KDN reads another model's KV). client: the reader's kdn Client (its tenant, token
    and network); keep: store the assembled KV under the plan's namespace when the client holds
    the admin token (default), and read it from there next time; pool: the executor recomputing
    while the sender's KV arrives (a service shares one among its readers; by default the reader
    makes its own, shut down by close())."""

    def __init__(self, client, model, plan: Plan, keep: bool = True, pool=None):
        from kdn.client.reader import Reader
        if not isinstance(plan, Plan):
            raise ModelError(f"plan must be a kdn.engines.family.Plan, got {type(plan).__name__}")
        if plan.reader != model.fingerprint:
            raise ModelError(f"the plan is for reader {plan.reader[:12]}…, not {model.name} "
                             f"({model.fingerprint[:12]}…)")
        if plan.layers != model.layers:
            raise ModelError(f"the plan names {plan.layers} layers; {model.name} has {model.layers}")
        self.client, self.model, self.plan = client, model, plan
        view, tenant, token = client.view, client.tenant, client.token
        self.sender = Reader(view, tenant, plan.sender, token=token, accept=None, chunk_tokens=client.chunk_tokens)
        self.hidden = Reader(view, tenant, hidden_fingerprint(plan.sender, plan.start), token=token,
                             accept=None, chunk_tokens=client.chunk_tokens)
        self.kept = Reader(view, tenant, cross_fingerprint(plan), token=token, accept=None,
                           chunk_tokens=client.chunk_tokens)
        self.keep = keep and view.admin_token is not None
        self._own_pool = pool is None
        self._pool = pool or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-recompute")

    def close(self) -> None:
        if self._own_pool:
            self._pool.shutdown(wait=True)

    def _how_to_publish(self, kb: str) -> str:
        recipe = self.model.name.partition("+")[2] or "VARIANT"
        return (f"its publisher stores them with `kdn publish {kb} PATH... --hidden-for {recipe}` "
                f"(from Python: kdn.engines.transformers.crossmodel.publish_hidden)")

    def _kept(self, prompt, n_know):
        """The assembled KV kept under the plan's namespace, when it covers the knowledge (any
        kept KB the prompt starts with: a KB republished with other tokens matches no more)."""
        got = self.kept.fetch(prompt)
        return got if got.tokens >= n_know else None

    def prepare(self, kb: str, tail, spare: int, version: int = None) -> tuple:
        """(engine cache, tokens cached, facts) for a prompt of KB `kb`'s knowledge then `tail`
        (token ids), room for `spare` more: the sender's KV with the plan's layers recomputed
        (or the assembled KV kept before). facts: {"fetched", "prompt", "know", "hidden_bytes",
        "recompute_s", "rebuild_s", "kept", "fetch_s", "manifest", "keep"}; keep: None, or (a
        reader that keeps: admin token) a callable storing the assembled KV under the plan's
        namespace, to call once the answer no longer waits."""
        model, plan = self.model, self.plan
        t0 = time.perf_counter()
        m = self.sender.manifest(kb, version)
        know = m.token_ids().tolist()
        prompt = know + list(tail)
        kept = self._kept(prompt, len(know)) if self.keep else None
        fetched, hidden_bytes, recompute_s = kept, 0, 0.0
        if kept is None:
            try:
                h = self.hidden.fetch(know, kb=kb)
            except ManifestError:
                raise ModelError(f"the sender has not stored its hidden states entering layer {plan.start} "
                                 f"for {kb!r}: {self._how_to_publish(kb)}") from None
            if h.tokens < len(know):
                raise ModelError(f"the sender's hidden states entering layer {plan.start} cover {h.tokens} of "
                                 f"{kb!r}'s {len(know)} tokens: {self._how_to_publish(kb)}")
            hidden = from_chunk_layout(np.concatenate(h.kv_parts(), axis=3))
            hidden_bytes = h.nbytes

            def work():
                t = time.perf_counter()
                return recompute(model, hidden, plan.start, plan.end), time.perf_counter() - t
            job = self._pool.submit(work)           # recompute while the sender's KV arrives
            fetched = self.sender.fetch(prompt, kb=kb, version=m.version)
            recomputed, recompute_s = job.result()
        # the sender's KV may stop short of the knowledge (a chunk no copy of which answered): the
        # reader computes the rest itself over what came, as any fetch; such KV is never kept
        t1 = time.perf_counter()
        n = fetched.tokens
        cache = model.cache_from_kv(fetched.kv_parts(), len(prompt) - n + spare)
        if kept is None and n:
            overwrite_layers(model, cache, recomputed[:, :, :, :n], plan.start)
        rebuild_s = time.perf_counter() - t1
        def keep():
            kv = np.concatenate(fetched.kv_parts(), axis=3)[:, :, :, :len(know)]
            kv = assemble(kv, recomputed[:, :, :, :len(know)], plan.start)
            from kdn.client.publish import Publisher
            named = [(d.name, know[d.start:d.end]) for d in m.documents]
            Publisher(self.client.view, self.client.tenant, cross_fingerprint(plan),
                      chunk_tokens=self.client.chunk_tokens).publish(kb, named, kv)
        whole = n >= len(know)
        return cache, n, {"keep": keep if kept is None and self.keep and whole else None, "fetched": fetched,
                          "prompt": prompt, "know": know, "hidden_bytes": hidden_bytes,
                          "recompute_s": recompute_s, "rebuild_s": rebuild_s, "kept": kept is not None,
                          "fetch_s": t1 - t0, "manifest": m}

    def answer(self, kb: str, question: str, max_new_tokens: int = 48, version: int = None,
               check: bool = False) -> Answer:
        model, plan = self.model, self.plan
        cache, n, f = self.prepare(kb, model.question_tokens(question), max_new_tokens, version)
        prompt, fetched = f["prompt"], f["fetched"]
        gen = model.generate(prompt, cache=cache, cached_tokens=n, max_new_tokens=max_new_tokens)
        ttft = f["fetch_s"] + f["rebuild_s"] + gen.ttft_s
        a = Answer(question=question, text=gen.text.strip(), tokens=gen.tokens, prompt_tokens=len(prompt),
                   cached_tokens=n, ttft_s=ttft, fetch_s=f["fetch_s"], sources=fetched.source_counts(),
                   edge=fetched.edge, bytes_moved=fetched.nbytes + f["hidden_bytes"], exact=False,
                   wire_bytes=fetched.wire_bytes + f["hidden_bytes"],
                   cross_model={**plan.describe(), "kept": f["kept"]},
                   extra={"rebuild_s": f["rebuild_s"], "recompute_s": f["recompute_s"],
                          "hidden_bytes": f["hidden_bytes"]})
        if f["keep"] is not None:
            f["keep"]()
        if check:
            base = model.generate(prompt, max_new_tokens=max_new_tokens)
            a.baseline_ttft_s, a.baseline_tokens = base.ttft_s, base.tokens
            a.identical = base.tokens == gen.tokens
        return a


# --- profiling a pair -------------------------------------------------------------------------
def agreement(model, cache, n_cached: int, tail, reference, finish: str) -> tuple:
    """(identical, first token equal) of the greedy answer over `cache` (n_cached tokens, then the
    prompt's `tail`) against `reference` tokens (ended by EOS when finish == "stop"), teacher-forced
    in one forward; the cache is cropped back to n_cached after."""
    target = list(reference) + ([min(model.eos_ids)] if finish == "stop" else [])
    ids = list(tail) + list(reference)
    logits = model.logits(ids, cache, all_logits=True)[len(tail) - 1:len(tail) - 1 + len(target)]
    model.crop(cache, n_cached)
    picks = torch.argmax(logits, dim=-1).tolist()
    ok = [p == t or (t in model.eos_ids and p in model.eos_ids) for p, t in zip(picks, target)]
    return all(ok), bool(ok[0])


def profile(reader, sender, items, starts, ends=None, max_new_tokens: int = 16, log=None) -> list:
    """Per candidate plan [a, b) (a in starts, b in ends, a < b), over calibration `items`
    [(knowledge text, [questions])]: {"start", "end", "agree", "first", "items"}: the share of
    questions whose greedy answer would be identical to the reader's own, and whose first token is."""
    log = log or (lambda m: None)
    check_family(reader.fingerprint_fields, sender.fingerprint_fields)
    starts = sorted(set(starts))
    ends = sorted(set(ends or [reader.layers]))
    score = {(a, b): [0, 0, 0] for a in starts for b in ends if a < b}
    for text, questions in items:
        know = reader.knowledge_tokens(text)
        if know != sender.knowledge_tokens(text):
            raise ModelError("the two models tokenize the knowledge differently: not one family")
        sender_kv, hidden = prefill_with_hidden(sender, know, starts)
        own = reader.prefill(know).kv
        refs = []
        for q in questions:
            tail = reader.question_tokens(q)
            g = reader.generate(know + tail, cache=reader.cache_from_kv([own], len(tail) + max_new_tokens + 1),
                                cached_tokens=len(know), max_new_tokens=max_new_tokens)
            refs.append((tail, g.tokens, g.finish))
        for a in starts:
            full = recompute(reader, hidden[a], a, max(b for b in ends if b > a)) if any(b > a for b in ends) else None
            for b in ends:
                if b <= a:
                    continue
                cache = reader.cache_from_kv([sender_kv], max_new_tokens + 64)
                overwrite_layers(reader, cache, full[:b - a], a)
                for tail, ref, finish in refs:
                    same, first = agreement(reader, cache, len(know), tail, ref, finish)
                    s = score[(a, b)]
                    s[0] += 1
                    s[1] += same
                    s[2] += first
        log(f"  profiled {len(questions)} questions over {len(know)} knowledge tokens")
    return [{"start": a, "end": b, "agree": s[1] / s[0], "first": s[2] / s[0], "items": s[0]}
            for (a, b), s in score.items() if s[0]]


def windows(model, documents, names, window: int) -> list:
    """[(label, text)]: each named document cut into pieces of `window` tokens (a last piece
    under a third of a window joins the one before)."""
    out = []
    for name, text in documents:
        if name not in names:
            continue
        ids = model.encode(text)
        cuts = list(range(0, len(ids), window))
        if len(cuts) > 1 and len(ids) - cuts[-1] < window // 3:
            cuts.pop()
        for i, s in enumerate(cuts):
            e = cuts[i + 1] if i + 1 < len(cuts) else len(ids)
            out.append((f"{name}@{s}", model.tokenizer.decode(ids[s:e])))
    return out


def calibrate(reader, sender, documents, block: int = 3, window: int = 600, target: float = 0.95,
              max_new_tokens: int = 16, names=CALIBRATION_DOCS, questions=CALIBRATION_QUESTIONS,
              log=None) -> tuple:
    """(profile, plan or None) of the pair on the calibration split: the `names` documents of
    `documents` ([(name, text)]) cut into `window`-token KBs, asked `questions`; every plan
    recomputing whole blocks of `block` layers profiled, and family.choose's pick for `target`."""
    if not isinstance(block, int) or isinstance(block, bool) or not 1 <= block <= reader.layers:
        raise ModelError(f"block must be an int in [1, {reader.layers}], got {block!r}")
    if not isinstance(window, int) or isinstance(window, bool) or window < 16:
        raise ModelError(f"window must be an int of at least 16 tokens, got {window!r}")
    calib = windows(reader, documents, names, window)
    if not calib:
        raise ModelError(f"no calibration text: none of {list(names)} is among the documents given")
    L = reader.layers
    profile_ = profile(reader, sender, [(t, tuple(questions)) for _, t in calib], starts=range(0, L, block),
                       ends=list(range(block, L + 1, block)) + ([L] if L % block else []),
                       max_new_tokens=max_new_tokens, log=log)
    plan = choose(profile_, reader.fingerprint, sender.fingerprint, L, target=target,
                  calibration={"kbs": [n for n, _ in calib], "questions": list(questions),
                               "window": window, "block": block, "max_new_tokens": max_new_tokens})
    return profile_, plan
