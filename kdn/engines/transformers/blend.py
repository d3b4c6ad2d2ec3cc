"""Blended reuse: knowledge in any order, from per-document KV (segments) and a little recompute.

A prefix KB helps only a prompt that starts with the whole KB in its one order. RAG prompts
pick a few documents per question, in any order. The segments layout stores each document's
KV computed on its own from position 0; a worker builds any prompt `header + doc_a + doc_b +
... + question` from them (CacheBlend, EuroSys'25):

1. **Re-position.** RoPE rotates each key pair (i, i + head_dim/2) by angle pos * inv_freq, so a
   key stored at position p becomes the key at p + d by one more rotation by d * inv_freq
   (angles computed in float64; no attention scaling, which the stored key already carries).
   Values carry no position. Valid for RoPE types whose inv_freq does not depend on the
   sequence length (default, linear, llama3); others are refused.
2. **Select.** Re-positioned KV still misses attention *across* documents. Layers below
   `select_layer` (default 1) are recomputed for every context token (cheap: one layer of
   30); at `select_layer` the K/V of every token are recomputed and compared with the cached
   ones; the `share` of tokens with the largest deviation (L2 of K and V differences) is
   selected. Those layers' K/V are kept recomputed for every token.
3. **Recompute.** Only selected tokens go through the remaining layers; at each layer their
   fresh K/V replace the cached ones, and their queries attend to the whole blended context
   (causally, by position). share=0 is naive concatenation; share=1 is a full prefill.
4. The question is prefilled over the blended cache by the engine as usual, then greedy
   generation.

A segment's tokens are the document's text followed by SEPARATOR, tokenized on their own
(segment_tokens); the prompt is the concatenation of token lists (header, segments, then the
rest of the chat prompt), so a full prefill of the same ids is the reference. Segment KV is
a plain prefill from position 0, so a segment key names the same KV a prefix KB of the same
tokens would: content addressing stays consistent across layouts.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kdn.core.checks import check_number
from kdn.core.errors import BadRequest, ModelError, NetworkError
from kdn.core.keys import chunk_keys

SEPARATOR = "\n\n"          # ends every segment: documents read as paragraphs in any order
DEFAULT_SHARE = 0.15        # CacheBlend's operating point
SELECT_LAYER = 1
BLEND_FETCH_TIMEOUT_S = 30.0
POSITION_FREE_ROPE = {"default", "linear", "llama3"}   # inv_freq independent of the sequence
_MARK = "\x00kdn-blend-mark\x00"

# blends, blend_tokens, recomputed_tokens, blend_s, segments_published, segments_fetched,
# segment_fetch_s: of this process
counters = collections.Counter()


# --- prompt pieces ---------------------------------------------------------------------------
def _system_split(model) -> tuple:
    """(header text, trailer text): the system turn around its content."""
    text = model.knowledge_text(_MARK)
    head, mark, tail = text.partition(_MARK)
    if not mark:
        raise ModelError(f"{model.name}'s chat template does not place the system content verbatim")
    return head, tail


def header_tokens(model) -> list:
    """Tokens every blended prompt starts with: the opening of the system turn."""
    return model.encode(_system_split(model)[0])


def question_tokens(model, question: str) -> list:
    """Tokens after the documents: the close of the system turn, the user turn, the reply prompt."""
    return model.encode(_system_split(model)[1]) + model.question_tokens(question)


def segment_tokens(model, text: str) -> list:
    """A document's segment: its text plus SEPARATOR, tokenized on its own."""
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"a segment's document text must be a non-empty str, got {text!r:.60}")
    return model.encode(text + SEPARATOR)


def prompt_tokens(model, segments, question: str) -> list:
    """The full prompt a blend stands for: header + segments' tokens in order + question."""
    out = list(header_tokens(model))
    for toks in segments:
        out.extend(int(t) for t in toks)
    return out + question_tokens(model, question)


def segment_kv(model, tokens) -> np.ndarray:
    """KV [layers, 2, kv_heads, n, head_dim] of a segment prefilled alone from position 0."""
    return model.prefill(tokens).kv


# --- RoPE re-positioning ---------------------------------------------------------------------
def _rotary(model):
    rot = getattr(getattr(model.hf, "model", None), "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise ModelError(f"{model.name} has no rotary embedding KDN can re-position")
    kind = getattr(rot, "rope_type", "default")
    if kind not in POSITION_FREE_ROPE:
        raise ModelError(f"RoPE type {kind!r} of {model.name} depends on the sequence length; keys "
                         f"cannot be moved by rotation (supported: {', '.join(sorted(POSITION_FREE_ROPE))})")
    return rot


def rotation(model, delta: int) -> tuple:
    """(cos, sin), each [head_dim] in the model's dtype, rotating a key by `delta` positions."""
    inv = _rotary(model).inv_freq.detach().to("cpu", torch.float64)
    ang = float(delta) * inv
    emb = torch.cat((ang, ang))
    return emb.cos().to(model.hf.dtype), emb.sin().to(model.hf.dtype)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(model, keys, delta: int, out=None) -> torch.Tensor:
    """Keys [..., tokens, head_dim] at positions p moved to p + delta (HF rotate_half layout).

    Pair (x1, x2) = (k[..., :half], k[..., half:]) turns by the pair's angle:
    (x1 cos - x2 sin, x2 cos + x1 sin). Written half by half into `out` (e.g. a slice of the
    cache buffer), with no temporaries of the full size.
    """
    keys = torch.as_tensor(keys)
    if out is None:
        out = torch.empty(keys.shape, dtype=model.hf.dtype)
    if delta == 0:
        return out.copy_(keys)
    cos, sin = rotation(model, delta)
    half = keys.shape[-1] // 2
    c, s = cos[:half], sin[:half]
    x1, x2 = keys[..., :half].to(c.dtype), keys[..., half:].to(c.dtype)
    lo, hi = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=lo)
    lo.sub_(x2 * s)
    torch.mul(x2, c, out=hi)
    hi.add_(x1 * s)
    return out


# --- blending --------------------------------------------------------------------------------
@dataclass
class Blended:
    cache: object               # engine cache holding the context's blended KV
    context_tokens: int         # header + segments
    selected: np.ndarray        # positions recomputed through every layer
    share: float
    seconds: dict               # place (rotate + copy), select, recompute, total

    def kv(self, model) -> np.ndarray:
        """The blended context KV (the cache may have grown past it since: generate extends it)."""
        return model.kv_from_cache(self.cache, 0, self.context_tokens)


def check_share(share) -> float:
    return check_number(share, "recompute share", 0, 1)


def _kv_part(model, kv, n: int, what: str) -> torch.Tensor:
    t = model.kv_tensor(kv, 0)
    if t.shape[3] != n:
        raise BadRequest(f"{what} has KV for {t.shape[3]} tokens but {n} tokens")
    return t


def _attend(attn, q, k, v, mask=None):
    """q [1, qh, n, hd] over k, v [1, kvh, T, hd], then the output projection.

    mask None: causal self-attention (n == T). Else an additive float mask [n, T]: the
    queries are selected tokens, each reading the keys at or before its position. (Splitting the queries into
    blocks that read only their key prefix measured no faster on CPU.)
    """
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=attn.scaling, enable_gqa=q.shape[1] != k.shape[1])
    return attn.o_proj(out.transpose(1, 2).reshape(1, q.shape[2], -1))


def _project(layer, x, cos, sin, hd):
    """Queries, keys (RoPE applied) and values of hidden states x [1, n, D]."""
    a, n = layer.self_attn, x.shape[1]
    q = a.q_proj(x).view(1, n, -1, hd).transpose(1, 2)
    k = a.k_proj(x).view(1, n, -1, hd).transpose(1, 2)
    v = a.v_proj(x).view(1, n, -1, hd).transpose(1, 2)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v


def blend(model, header, segments, share: float = DEFAULT_SHARE, select_layer: int = SELECT_LAYER) -> Blended:
    """Blend cached segments into one context cache: header + segments in the given order.

    header: token ids computed fresh (they open every prompt: a few tokens). segments:
    [(token ids, kv [layers, 2, kv_heads, n, head_dim] computed from position 0)]. share:
    fraction of context tokens recomputed through every layer (0 = naive concatenation).
    """
    share = check_share(share)
    if not isinstance(select_layer, int) or not 0 <= select_layer < model.layers:
        raise BadRequest(f"select_layer must be an int in [0, {model.layers}), got {select_layer!r}")
    if not segments:
        raise BadRequest("a blend needs at least one segment")
    t0 = time.perf_counter()
    head_ids = model.check_tokens(header, "header tokens")
    seg_ids = [model.check_tokens(toks, f"segment {i} tokens") for i, (toks, _) in enumerate(segments)]
    parts = [_kv_part(model, kv, len(ids), f"segment {i}") for i, ((_, kv), ids) in enumerate(zip(segments, seg_ids))]
    ids = head_ids + [t for s in seg_ids for t in s]
    with torch.inference_mode():
        buf = _place(model, head_ids, parts, len(ids))
        t_place = time.perf_counter()
        idx, state = _select(model, ids, buf, share, select_layer)
        t_select = time.perf_counter()
        if len(idx):
            _recompute(model, buf, idx, select_layer, *state)
        cache = model.new_cache()
        model.fill_cache(cache, buf)
    t_end = time.perf_counter()
    counters["blends"] += 1
    counters["blend_tokens"] += len(ids)
    counters["recomputed_tokens"] += len(idx)
    counters["blend_s"] += t_end - t0
    return Blended(cache=cache, context_tokens=len(ids), selected=idx.numpy(), share=share,
                   seconds={"place": t_place - t0, "select": t_select - t_place,
                            "recompute": t_end - t_select, "total": t_end - t0})


def _place(model, head_ids, parts, total: int) -> torch.Tensor:
    """The context's KV buffer [layers, 2, 1, kv_heads, total, head_dim]: the header computed
    fresh, each segment's keys rotated to where it lands (values carry no position)."""
    buf = torch.empty((model.layers, 2, 1, model.kv_heads, total, model.head_dim), dtype=model.hf.dtype)
    buf[:, :, 0, :, :len(head_ids)].copy_(model.kv_tensor(model.prefill(head_ids).kv, 0))
    at = len(head_ids)
    for p in parts:
        n = p.shape[3]
        rotate_keys(model, p[:, 0], at, out=buf[:, 0, 0, :, at:at + n])
        buf[:, 1, 0, :, at:at + n].copy_(p[:, 1])
        at += n
    return buf


def _select(model, ids, buf, share: float, select_layer: int) -> tuple:
    """(selected positions, state for _recompute): layers below select_layer computed exactly
    for every token (into buf), then at select_layer the `share` of tokens whose fresh K/V
    deviate most from the placed ones; that layer's K/V are kept fresh for every token."""
    inner, hd, total = model.hf.model, model.head_dim, len(ids)
    h = inner.embed_tokens(torch.tensor([ids], dtype=torch.long))             # [1, total, D]
    cos, sin = inner.rotary_emb(h, torch.arange(total).unsqueeze(0))
    for li in range(select_layer):
        layer = inner.layers[li]
        q, k, v = _project(layer, layer.input_layernorm(h), cos, sin, hd)
        buf[li, 0, 0].copy_(k[0])
        buf[li, 1, 0].copy_(v[0])
        h = h + _attend(layer.self_attn, q, k, v)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    layer = inner.layers[select_layer]
    q, k, v = _project(layer, layer.input_layernorm(h), cos, sin, hd)
    dev = ((k[0] - buf[select_layer, 0, 0]).pow(2).sum(dim=(0, 2))
           + (v[0] - buf[select_layer, 1, 0]).pow(2).sum(dim=(0, 2)))              # [total]
    n_sel = min(total, math.ceil(share * total - 1e-9))
    idx = torch.topk(dev, n_sel).indices.sort().values if n_sel else torch.empty(0, dtype=torch.long)
    buf[select_layer, 0, 0].copy_(k[0])
    buf[select_layer, 1, 0].copy_(v[0])
    return idx, (h, q, cos, sin)


def _recompute(model, buf, idx, select_layer: int, h, q, cos, sin) -> None:
    """Selected tokens through the layers from select_layer on, attending to the blended
    context (causally, by position); their fresh K/V replace the placed ones in buf."""
    inner, hd, total = model.hf.model, model.head_dim, buf.shape[4]
    later = torch.arange(total).unsqueeze(0) > idx.unsqueeze(1)                 # [n_sel, total]
    mask = torch.zeros(later.shape, dtype=model.hf.dtype).masked_fill_(later, float("-inf"))
    h = h[:, idx]
    cos_s, sin_s = cos[:, idx], sin[:, idx]
    layer = inner.layers[select_layer]
    h = h + _attend(layer.self_attn, q[:, :, idx], buf[select_layer, 0], buf[select_layer, 1], mask)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    for li in range(select_layer + 1, model.layers):
        layer = inner.layers[li]
        q, k, v = _project(layer, layer.input_layernorm(h), cos_s, sin_s, hd)
        kb, vb = buf[li, 0], buf[li, 1]
        kb[:, :, idx] = k
        vb[:, :, idx] = v
        h = h + _attend(layer.self_attn, q, kb, vb, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))


def generate_blended(model, segments, question: str, share: float = DEFAULT_SHARE,
                     max_new_tokens: int = 32, select_layer: int = SELECT_LAYER):
    """Greedy answer to `question` over blended segments [(tokens, kv)], in the given order.

    Returns (Generation, Blended). The Generation's ttft_s counts the blend too: it is the
    time from having the segments' KV to the first new token.
    """
    t0 = time.perf_counter()
    blended = blend(model, header_tokens(model), segments, share=share, select_layer=select_layer)
    tokens = prompt_tokens(model, [s for s, _ in segments], question)
    gen = model.generate(tokens, cache=blended.cache, cached_tokens=blended.context_tokens,
                         max_new_tokens=max_new_tokens)
    ttft = blended.seconds["total"] + gen.ttft_s
    return dataclasses.replace(gen, ttft_s=ttft, total_s=time.perf_counter() - t0), blended


# --- segments on the network -----------------------------------------------------------------
def publish_segments(client, model, kb: str, documents, meta: dict = None, progress=None) -> dict:
    """Publish documents [(name, text)] as a segments KB: each one's KV from position 0.

    Returns the origin's receipt plus "segment_tokens": {name: token count}.
    """
    docs = list(documents)
    if not docs:
        raise BadRequest(f"KB {kb!r}: no documents to publish")
    named, kvs = [], []
    for i, item in enumerate(docs):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise BadRequest(f"documents[{i}] must be a (name, text) pair, got {item!r:.80}")
        name, text = item
        toks = segment_tokens(model, text)
        named.append((name, toks))
        kvs.append(segment_kv(model, toks))
        if progress is not None:
            progress(i + 1, len(docs))
    info = {"segment_separator": SEPARATOR, "segment_positions": "from 0"}
    receipt = client.publish(kb, named, kvs, layout="segments", meta={**info, **(meta or {})})
    counters["segments_published"] += len(named)
    receipt["segment_tokens"] = {n: len(t) for n, t in named}
    return receipt


@dataclass
class SegmentFetch:
    kv: np.ndarray      # [layers, 2, kv_heads, tokens, head_dim], positions 0..tokens-1
    keys: list
    sources: list
    edge: str
    seconds: float
    exact: bool = True  # False when some chunk came through a lossy codec (kdn.core.codecs)


def _fetch_keys(client, keys, what: str, manifest=None) -> SegmentFetch:
    """All of `keys` from the nearest live edge (a segment is useful only whole), verified
    by the client (against `manifest`'s checksums, else those of every KB it lists)."""
    keys = list(keys)
    if not keys:
        raise BadRequest(f"{what} has no chunks")
    got = client.fetch_keys(keys, manifest=manifest, timeout_s=BLEND_FETCH_TIMEOUT_S)
    if len(got.chunks) < len(keys):
        raise NetworkError(f"{what}: the network holds {len(got.chunks)} of its {len(keys)} "
                           "chunks (not published under this tenant and model, or lost)")
    kv = got.chunks[0].kv if len(got.chunks) == 1 else np.concatenate(got.kv_parts(), axis=3)
    counters["segments_fetched"] += 1
    counters["segment_fetch_s"] += got.seconds
    return SegmentFetch(kv=kv, keys=keys, sources=list(got.sources), edge=got.edge,
                        seconds=got.seconds, exact=got.exact)


def fetch_segment(client, tokens) -> SegmentFetch:
    """A segment's KV by its tokens (the worker computes the keys itself, as for prefixes)."""
    keys = chunk_keys(tokens, client.ns, client.chunk_tokens)
    return _fetch_keys(client, keys, f"segment of {len(keys)} chunk(s)")


def fetch_document(client, kb: str, name: str) -> SegmentFetch:
    """One document's KV from a segments KB, by name (ManifestError if the KB lacks it)."""
    m = client.manifest(kb)
    if m.layout != "segments":
        raise BadRequest(f"KB {m.label()} has the {m.layout} layout; blending needs segments")
    return _fetch_keys(client, m.document_keys(name), f"document {name!r} of {m.label()}", m)


def answer_from_network(client, model, documents, question: str, share: float = DEFAULT_SHARE,
                        max_new_tokens: int = 32):
    """Fetch each document (text, in prompt order) as a segment, blend, answer.

    Returns (Generation, Blended, [SegmentFetch]); the Generation's ttft_s includes the fetches.
    """
    share = check_share(share)
    t0 = time.perf_counter()
    toks = [segment_tokens(model, text) for text in documents]
    got = [fetch_segment(client, t) for t in toks]
    fetch_s = time.perf_counter() - t0
    gen, blended = generate_blended(model, [(t, f.kv) for t, f in zip(toks, got)], question,
                                    share=share, max_new_tokens=max_new_tokens)
    return dataclasses.replace(gen, ttft_s=gen.ttft_s + fetch_s), blended, got
