"""Emphasis: KV edited on purpose so the model attends more to the documents an operator trusts.

The construction: a token whose cached K and V entries appear k times in the cache gets
exactly k times its softmax weight from every query of every head in every layer, i.e. +log k
on its attention logit (softmax counts each copy; the copies carry the position already
rotated into K, so nothing about where the token sits changes). An integer weight per
document is therefore an exact logit bias with no engine change: the engine is handed a
cache longer than the prompt it holds, and the tokens after the KB keep the positions of
the unedited sequence (explicit position ids: `positions()`). A weight of 1 everywhere is
no edit at all: the KB's own KV, today's answer bit for bit.

Only a document's own text is weighted: the system turn's opening tokens (the attention
sink at position 0 among them) and its closing tokens are never duplicated. Tokens before
the first edited one keep their places, so the chunks before it are the KB's own chunks.

Two other edits are kept for comparison (`kdn bench emphasis`): scaling the span's values
by k (more of its content in each head's output, attention unchanged) and scaling its keys
(sharper attention within the span). Emphasized KV is never exact: whoever holds it keeps
it apart from the KB's KV (`edit_salt` names an edit; kdn.serve.chat applies one per request).
"""

import numpy as np
import xxhash

from kdn.core.errors import BadRequest

METHODS = ("duplicate", "vscale", "kscale")
_PROBE = "kdn-probe-knowledge"


def _frame(model) -> tuple:
    """(opening, closing) tokens of the system turn around its text."""
    rendered = model.knowledge_text(_PROBE)
    at = rendered.find(_PROBE)
    return model.encode(rendered[:at]), model.encode(rendered[at + len(_PROBE):])


def document_spans(model, documents) -> list:
    """[(name, start, end)] token spans of each document's text in the knowledge tokens.

    documents: [(name, token ids)] as kdn.client.publish.knowledge_documents makes them, or a
    manifest's Documents. The first one's span leaves out the system turn's opening tokens,
    the last one's its closing tokens, when they are there token for token."""
    rows, at = [], 0
    for d in documents:
        if hasattr(d, "start"):
            rows.append([d.name, d.start, d.end, None])
        else:
            name, toks = d
            rows.append([name, at, at + len(toks), list(toks)])
            at += len(toks)
    if not rows:
        return []
    head, tail = _frame(model)
    first, last = rows[0], rows[-1]
    if first[3] is None or first[3][:len(head)] == head:
        first[1] = min(first[1] + len(head), first[2])
    if last[3] is None or (len(tail) and last[3][-len(tail):] == tail):
        last[2] = max(last[2] - len(tail), last[1])
    return [(n, a, b) for n, a, b, _ in rows]


def token_weights(spans, weights: dict, n_tokens: int) -> np.ndarray:
    """int64 [n_tokens]: each knowledge token's weight (1 outside weighted spans)."""
    w = np.ones(n_tokens, dtype=np.int64)
    for name, a, b in spans:
        if name in weights:
            w[a:b] = weights[name]
    return w


def edit_salt(kb: str, version, weights: dict, method: str = "duplicate") -> bytes:
    """16 bytes naming one edit of one KB version: what keeps its KV apart from the KB's."""
    text = "\0".join([method, str(kb), str(version), *(f"{n}={weights[n]}" for n in sorted(weights))])
    return xxhash.xxh3_128_digest(b"kdn-emphasis\0" + text.encode())


def edit(kv, repeats, method: str = "duplicate"):
    """kv [layers, 2, kv_heads, tokens, head_dim] (numpy or torch) edited by per-token int
    weights `repeats` [tokens]. duplicate: token t's K and V entries appear repeats[t] times
    (adjacent copies; the result has sum(repeats) tokens). vscale/kscale: the span's values /
    keys multiplied by the weight, any positive float (same length). All ones: kv itself, untouched."""
    if method not in METHODS:
        raise BadRequest(f"emphasis method must be one of {', '.join(METHODS)}, got {method!r:.40}")
    repeats = np.asarray(repeats)
    if repeats.shape != (kv.shape[3],):
        raise BadRequest(f"{repeats.shape[0] if repeats.ndim else 0} weights for {kv.shape[3]} KV tokens")
    if method == "duplicate" and (repeats.dtype.kind not in "iu" or (repeats < 1).any()):
        raise BadRequest("duplicate emphasis needs positive integer weights")
    if (repeats <= 0).any():
        raise BadRequest("emphasis factors must be positive")
    if (repeats == 1).all():
        return kv
    if method == "duplicate":
        if isinstance(kv, np.ndarray):
            return np.repeat(kv, repeats, axis=3)
        import torch
        return torch.repeat_interleave(kv, torch.from_numpy(repeats), dim=3)
    side = 1 if method == "vscale" else 0
    out = kv.copy() if isinstance(kv, np.ndarray) else kv.clone()
    scale = repeats.astype(np.float32)
    if not isinstance(kv, np.ndarray):
        import torch
        scale = torch.from_numpy(scale).to(kv.dtype)
    out[:, side] *= scale[:, None]                      # [layers, kv_heads, tokens, head_dim] * [tokens, 1]
    return out


def extra_tokens(repeats, method: str = "duplicate") -> int:
    """How many more cache entries than tokens an edit makes."""
    return int(np.sum(np.asarray(repeats) - 1)) if method == "duplicate" else 0


def first_edited(repeats) -> "int | None":
    """Index of the first token the edit touches (chunks before it are the KB's own), None if none."""
    hit = np.flatnonzero(np.asarray(repeats) != 1)
    return int(hit[0]) if hit.size else None


def positions(start: int, n: int):
    """Position ids [1, n] for n tokens whose first sits at `start` in the unedited sequence."""
    import torch
    return torch.arange(start, start + n, dtype=torch.long).unsqueeze(0)


def forward(model, ids, cache, position: int, extra: int):
    """Logits of the last of ids run after `cache`; with extra > 0 the cache holds `extra` more
    entries than tokens and ids get explicit positions from `position` (extra == 0: the engine's
    own path, unchanged)."""
    import torch
    ids_t = torch.tensor([list(ids)], dtype=torch.long)
    kwargs = model.cache_kwargs(cache)
    if model._keep_arg:
        kwargs[model._keep_arg] = 1
    if extra:
        kwargs["position_ids"] = positions(position, len(ids))
    with torch.inference_mode():
        return model.hf(input_ids=ids_t, **kwargs).logits[0, -1]
