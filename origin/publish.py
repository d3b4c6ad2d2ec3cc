"""Publishing documents: text -> the model's knowledge tokens -> prefill -> chunks -> the origin.

Knowledge goes where a real prompt puts it: the system turn of the model's chat template, so
every prompt a worker builds (knowledge + question) starts with exactly these tokens. The
documents are joined into that one turn; each document's token range in it is found from
the tokenizer's character offsets, so the manifest can say which chunks hold which document.

Prefill is paid only for what the network lacks: the publisher first fetches the longest
cached prefix of the new token stream (an unchanged KB is cached whole, a KB with an edited
last document shares every chunk before the edit), rebuilds the model's cache from it, and
prefills only the rest, chunk by chunk with a progress callback. The KV of a prefix depends
only on the tokens before it, so the reused part is exactly what a fresh prefill computes.
Only chunks the origin lacks travel; the origin stores them durably, commits the manifest
last and pushes to the ring owners. Runs in the publisher's process (the CLI, a notebook).
"""
import re
import time
from pathlib import Path

import numpy as np

from kdn.errors import BadRequest

MAX_DOCUMENT_BYTES = 64 << 20
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")


def read_documents(paths) -> list:
    """[(name, text)] from text/markdown files; clear errors for missing, binary or empty files."""
    docs, names = [], set()
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise BadRequest(f"{p}: no such file")
        if path.suffix.lower() not in TEXT_SUFFIXES:
            raise BadRequest(f"{p}: not a text or markdown file (expected one of {', '.join(TEXT_SUFFIXES)})")
        if path.stat().st_size > MAX_DOCUMENT_BYTES:
            raise BadRequest(f"{p}: {path.stat().st_size} bytes is over the {MAX_DOCUMENT_BYTES}-byte limit")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise BadRequest(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not text.strip():
            raise BadRequest(f"{p}: the document is empty")
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.") or "document"
        base, i = name, 2
        while name in names:
            name, i = f"{base}-{i}", i + 1
        names.add(name)
        docs.append((name, text))
    if not docs:
        raise BadRequest("nothing to publish: give at least one document")
    return docs


def join_documents(documents) -> tuple:
    """(knowledge text, [(name, char start, char end)]) with documents separated by a blank line."""
    parts, spans, pos = [], [], 0
    for i, (name, text) in enumerate(documents):
        if i:
            parts.append("\n\n")
            pos += 2
        parts.append(text)
        spans.append((name, pos, pos + len(text)))
        pos += len(text)
    return "".join(parts), spans


def knowledge_documents(model, documents) -> list:
    """[(name, token ids)] whose concatenation is exactly model.knowledge_tokens(joined text).

    The first document also carries the system turn's opening tokens, the last its closing
    ones, so nothing of the prompt is left outside a document.
    """
    text, spans = join_documents(documents)
    tokens = model.knowledge_tokens(text)
    rendered = model.knowledge_text(text)
    at = rendered.find(text)
    enc = model.tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    if ids != tokens or at < 0:   # a tokenizer without offsets: one document holding everything
        return [("+".join(n for n, _ in documents)[:1000], tokens)]
    cuts = [0]
    for _, start, _ in spans[1:]:
        c = at + start
        cuts.append(next((i for i, (a, _) in enumerate(offsets) if a >= c), len(ids)))
    cuts.append(len(ids))
    return [(name, ids[a:b]) for (name, _, _), a, b in zip(spans, cuts, cuts[1:])]


def publish_documents(client, model, kb: str, documents, progress=None, meta=None) -> dict:
    """Prefill (only what the network lacks) and publish documents as KB `kb`; returns the receipt."""
    if client.fingerprint != model.fingerprint:
        raise BadRequest(f"the client is connected for model {client.fingerprint!r} but the model is "
                         f"{model.fingerprint!r}: KV is only ever published under its own model")
    docs = knowledge_documents(model, documents)
    tokens = [t for _, toks in docs for t in toks]
    t0 = time.perf_counter()
    reused = client.fetch(tokens)
    cache = model.cache_from_kv(reused.kv_parts()) if reused.tokens else None
    t1 = time.perf_counter()
    parts = [np.concatenate(reused.kv_parts(), axis=3)] if reused.tokens else []
    if reused.tokens < len(tokens):
        pre = model.prefill(tokens[reused.tokens:], past=cache, chunk_tokens=client.chunk_tokens,
                            progress=progress)
        parts.append(pre.kv)
    elif progress:
        progress(len(tokens), len(tokens))
    prefill_s = time.perf_counter() - t1
    kv = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=3)
    receipt = client.publish(kb, docs, kv, meta=meta)
    receipt.update(tokens=len(tokens), reused_tokens=reused.tokens,
                   prefilled_tokens=len(tokens) - reused.tokens, prefill_s=prefill_s,
                   total_s=time.perf_counter() - t0, documents=[n for n, _ in docs])
    return receipt


def progress_bar(prefix: str = "prefill", width: int = 30, file=None):
    """A progress callback printing a one-line bar (tokens done / total) to stderr."""
    import sys
    out = file or sys.stderr
    start = time.perf_counter()

    def show(done, total):
        frac = done / total if total else 1.0
        bar = "#" * int(width * frac) + "-" * (width - int(width * frac))
        rate = done / max(1e-9, time.perf_counter() - start)
        out.write(f"\r{prefix} [{bar}] {done}/{total} tokens  {rate:,.0f} tok/s")
        if done >= total:
            out.write("\n")
        out.flush()
    return show
