"""An inference worker: answer a question over a published knowledge base, computing only the question.

The worker builds the prompt a chat model would see (the KB's knowledge tokens, from its
manifest, then the question's turn), fetches the longest cached prefix from the nearest
edge, rebuilds the model's cache from the chunks, prefills only the rest and generates
greedily. Time to first token is measured from the moment the worker starts to fetch; the
baseline (`check=True`) is the same prompt prefilled from nothing, and its generated tokens
must be identical — KDN never changes what the model says (unless the client accepted a
lossy codec, kdn.core.codecs; the answer then says exact=False).

A comparison is warm against warm: the model is warmed up when it loads (Model.warm_up), and
with `check=True` the KDN side's fetch and rebuild run once untimed before either side is
timed, so neither pays a process's first calls. `compared` says which side was faster in
plain words.
"""
import time

from kdn.core.errors import ModelError
from kdn.engines.base import Answer


def answer(client, model, kb: str, question: str, max_new_tokens: int = 48, check: bool = False,
           version: int = None) -> Answer:
    """Answer `question` over KB `kb` with KV from the network; with check, also without it."""
    if client.reader.fingerprint != model.fingerprint:    # BadRequest without a fingerprint
        raise ModelError(f"the client reads KV of model {client.fingerprint!r}, not of {model.fingerprint!r}")
    m = client.manifest(kb, version)
    prompt = m.token_ids().tolist() + model.question_tokens(question)
    if check:    # warm against warm: the KDN side's first fetch and rebuild, untimed
        warm = client.fetch(prompt, kb=kb, version=m.version)
        if warm.tokens:
            model.cache_from_kv(warm.kv_parts(), len(prompt) - warm.tokens + max_new_tokens)
        del warm
    t0 = time.perf_counter()
    f = client.fetch(prompt, kb=kb, version=m.version)
    t1 = time.perf_counter()
    # room for the question and the answer: the engine appends them in place
    cache = model.cache_from_kv(f.kv_parts(), len(prompt) - f.tokens + max_new_tokens) if f.tokens else None
    rebuild_s = time.perf_counter() - t1
    gen = model.generate(prompt, cache=cache, cached_tokens=f.tokens, max_new_tokens=max_new_tokens)
    ttft = (t1 - t0) + rebuild_s + gen.ttft_s
    a = Answer(question=question, text=gen.text.strip(), tokens=gen.tokens, prompt_tokens=len(prompt),
               cached_tokens=f.tokens, ttft_s=ttft, fetch_s=t1 - t0, sources=f.source_counts(),
               edge=f.edge, bytes_moved=f.nbytes, exact=f.exact, wire_bytes=f.wire_bytes,
               extra={"rebuild_s": rebuild_s, "codecs": f.codecs})
    if check:
        base = model.generate(prompt, max_new_tokens=max_new_tokens)
        a.baseline_ttft_s, a.baseline_tokens = base.ttft_s, base.tokens
        a.identical = base.tokens == gen.tokens
        a.max_logit_diff = float((base.logits - gen.logits).abs().max())
    return a


def compared(kdn_s: float, baseline_s: float, baseline: str = "a full prefill") -> str:
    """Which side was faster, in plain words: 'KDN was 3.2x faster than a full prefill'."""
    if kdn_s <= 0 or baseline_s <= 0:
        raise ModelError(f"times must be positive, got KDN {kdn_s!r} s and baseline {baseline_s!r} s")
    if kdn_s < baseline_s:
        return f"KDN was {baseline_s / kdn_s:.1f}x faster than {baseline}"
    if kdn_s > baseline_s:
        return f"KDN was {kdn_s / baseline_s:.1f}x SLOWER than {baseline}"
    return f"KDN took as long as {baseline}"
