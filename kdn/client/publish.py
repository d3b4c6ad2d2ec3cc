"""Publishing: documents -> the model's knowledge tokens -> prefill -> chunks -> the origin.

Runs in the publisher's process (the CLI, a notebook), beside the engine; the origin only
stores what arrives. Knowledge goes where a real prompt puts it: the system turn of the
model's chat template, so every prompt a worker builds (knowledge + question) starts with
exactly these tokens. Each document's token range in that turn is found from the
tokenizer's character offsets, so the manifest says which chunks hold which document.

Prefill is paid only for what the network lacks, and KV moves only where a prefill needs it:
the publisher first asks the origin which of the new token stream's chunks it stores (a
lookup: keys out, checksums back). An unchanged KB is stored whole: its new version is
committed with nothing fetched, computed or sent. Otherwise it fetches the longest cached
prefix (exactly, with the admin token: an edited last document shares every chunk before the
edit), rebuilds the model's cache from it, prefills only the rest, and cuts and sends only
from the first chunk the origin lacks. The KV of a prefix depends only on the
tokens before it, so the reused part is what a fresh prefill computes (within the engine's
batch variance: kernels round by batch shape). Only chunks the origin lacks travel; where it
holds a chunk already, its stored checksum is adopted (a key means the bytes stored first),
and the manifest, with a checksum per chunk, is committed last.

Everything that can be refused is checked before any tokenizing or prefill: the KB's name,
the documents' sizes, and that the origin takes this publisher's admin token.
"""
import collections
import dataclasses
import sys
import time

import numpy as np

from kdn.core.checks import check_int
from kdn.core.chunk import cut
from kdn.core.errors import BadRequest
from kdn.client.documents import (MAX_KB_BYTES, MAX_KB_TOKENS, check_documents,  # noqa: F401
                                  check_kb_tokens, join_documents)
from kdn.core.keys import CHUNK_TOKENS, chunk_keys
from kdn.core.manifest import Manifest, check_name
from kdn.client.reader import Reader

BATCH_BYTES = 64 << 20        # chunks per put_chunks call: bounded in bytes ...
BATCH_CHUNKS = 1024           # ... and in count (the origin takes at most 4096 a call)
PUBLISH_TIMEOUT_S = 300.0
LOG_INTERVAL_S = 5.0          # a progress line this often when stderr is a log, not a terminal


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


# --- KV -> chunks --------------------------------------------------------------------------
def _kv_of(kv, tokens: int, where: str = ""):
    """kv if it is an array (numpy or torch) covering `tokens` tokens; BadRequest otherwise."""
    shape = getattr(kv, "shape", None)
    if not isinstance(kv, np.ndarray) and not type(kv).__module__.startswith("torch"):
        raise BadRequest(f"kv must be a numpy array or torch tensor, got {type(kv).__name__}")
    if len(shape) == 5 and shape[3] != tokens:
        raise BadRequest(f"kv covers {shape[3]} tokens but the documents have {tokens}{where}")
    return kv


def split_kv(m: Manifest, kv, dtype: str = None, from_chunk: int = 0) -> list:
    """The Chunks of manifest m, cut from kv (kdn.core.chunk.cut): for the prefix layout one
    array [layers, 2, heads, tokens, head_dim] of the KB's tokens from chunk from_chunk on
    (None when that is the end); for segments a list of them, one per document."""
    ct = m.chunk_tokens
    if m.layout == "prefix":
        if from_chunk == len(m.keys) and kv is None:
            return []
        where = f" from chunk {from_chunk} on" if from_chunk else ""
        return cut(_kv_of(kv, m.n_tokens - from_chunk * ct, where), m.keys[from_chunk:], m.ns, ct, dtype)
    if not isinstance(kv, (list, tuple)) or len(kv) != len(m.documents):
        raise BadRequest(f"the segments layout needs one kv array per document "
                         f"({len(m.documents)}), got {type(kv).__name__}")
    out = []
    for d, arr in zip(m.documents, kv):
        keys = m.keys[d.first_chunk:d.first_chunk + d.n_chunks]
        out.extend(cut(_kv_of(arr, d.tokens), keys, m.ns, ct, dtype))
    return out


# --- to the origin -----------------------------------------------------------------------
class Publisher:
    """Publishes KBs of one namespace (tenant, model fingerprint) through `view` (kdn.client.view),
    with the network's admin token. Its reuse reads are exact (lossless codecs only) and carry
    the admin token, which may read every namespace, new ones included."""

    def __init__(self, view, tenant: str, fingerprint: str, chunk_tokens: int = CHUNK_TOKENS):
        self.view = view
        self.tenant, self.fingerprint, self.chunk_tokens = tenant, fingerprint, chunk_tokens
        self.reader = Reader(view, tenant, fingerprint, token=view.admin_token, accept=None,
                             chunk_tokens=chunk_tokens)
        self.ns = self.reader.ns
        self.counters = collections.Counter()   # publishes, sent_chunks, sent_bytes, adopted_chunks

    def stats(self) -> dict:
        return {"tenant": self.tenant, "counters": dict(self.counters)}

    def check_access(self) -> None:
        """AccessDenied now, not after a prefill, unless the origin takes this admin token."""
        self.view.origin().stored([])

    def reuse(self, tokens):
        """The longest prefix of `tokens` the network already holds, exact (kdn.client.reader.Fetched)."""
        return self.reader.fetch(tokens)

    def held_chunks(self, tokens) -> int:
        """How many of the chunks of `tokens` (a prefix KB's, on this publisher's grid) the
        origin stores, from the first on: a lookup, no KV moves."""
        sums = self.view.origin().stored(chunk_keys(tokens, self.ns, self.chunk_tokens))
        return next((i for i, s in enumerate(sums) if s is None), len(sums))

    def publish(self, kb: str, documents, kv, layout: str = "prefix", meta: dict = None,
                dtype: str = None, batch_bytes: int = BATCH_BYTES,
                timeout_s: float = PUBLISH_TIMEOUT_S, from_chunk: int = 0) -> dict:
        """Publish a KB version whose KV the caller computed; returns the origin's receipt.

        documents: [(doc name, token ids), ...] in order. kv: see split_kv(). Only chunks
        the origin lacks travel; the origin then pushes them to their owners. from_chunk (the
        prefix layout): kv covers the KB's tokens from that chunk on (None: from the end), and
        the origin must hold every chunk before it already (held_chunks): their KV is neither
        computed nor sent again, and their checksums are the origin's.
        """
        check_name(kb, "knowledge base name")
        m = Manifest.build(kb, self.tenant, self.fingerprint, documents, layout=layout,
                           chunk_tokens=self.chunk_tokens, meta=meta)
        check_int(from_chunk, "from_chunk", 0, len(m.keys))
        if from_chunk and layout != "prefix":
            raise BadRequest("from_chunk is for the prefix layout: a segments KB sends every document's KV")
        chunks = split_kv(m, kv, dtype, from_chunk)
        # Per-chunk checksums travel in the manifest: every reader verifies what it got
        # against them, whatever hops (disk, peers, object store) it crossed. A key means the
        # bytes stored first: where the origin already holds a chunk (or another publisher
        # stores it first, meanwhile), its checksum is adopted, never this publisher's own
        # (KV computed on another CPU or in another batch shape differs in the last bits).
        sums = self.view.origin(timeout_s).stored(list(m.keys))
        gone = next((i for i, x in enumerate(sums[:from_chunk]) if x is None), None)
        if gone is not None:
            raise BadRequest(f"the origin no longer holds chunk {gone} of {kb!r} (collected meanwhile): "
                             "publish again")
        missing = [i for i, x in enumerate(sums) if x is None]
        sent, sent_bytes, put_sums = self._send([chunks[i - from_chunk] for i in missing], batch_bytes,
                                                timeout_s)
        for i, x in zip(missing, put_sums):
            sums[i] = x
        adopted = sum(x != c.digest() for x, c in zip(sums[from_chunk:], chunks))
        m = dataclasses.replace(m, sums=tuple(sums))
        receipt = self.view.origin(timeout_s).commit(m.to_dict())
        receipt.update(sent_chunks=sent, sent_bytes=sent_bytes, adopted_chunks=adopted)
        self.counters.update(publishes=1, sent_chunks=sent, sent_bytes=sent_bytes,
                             adopted_chunks=adopted)
        self.reader.forget_manifests()
        return receipt

    def _send(self, chunks, batch_bytes: int, timeout_s: float) -> tuple:
        """(chunks, bytes, the stored checksum of each) sent to the origin, in batches bounded
        in bytes and count."""
        batch, size, sent, sent_bytes, sums = [], 0, 0, 0, []
        for i, c in enumerate(chunks):
            batch.append(c)
            size += c.nbytes
            if size >= batch_bytes or len(batch) >= BATCH_CHUNKS or i == len(chunks) - 1:
                sums += self.view.writes().put("chunks", batch, timeout_s)["sums"]
                sent, sent_bytes, batch, size = sent + len(batch), sent_bytes + size, [], 0
        return sent, sent_bytes, sums


def publish_documents(client, model, kb: str, documents, progress=None, meta=None) -> dict:
    """Prefill (only what the network lacks) and publish documents [(name, text)] as KB `kb`
    through client (kdn.client.Client); returns the receipt."""
    check_name(kb, "knowledge base name")
    docs = check_documents(documents)
    publisher = client.publisher
    if publisher.fingerprint != model.fingerprint:
        raise BadRequest(f"the client is connected for model {publisher.fingerprint!r} but the model is "
                         f"{model.fingerprint!r}: KV is only ever published under its own model")
    named, tokens, held, t0 = _held_of(client, model, kb, docs)
    ct = publisher.chunk_tokens
    if held * ct >= len(tokens):                   # every chunk stored already (an unchanged KB)
        return _commit_held(client, kb, named, held, meta, progress, t0)
    # the longest held prefix, which the prefill continues from (an old version's trailing
    # partial chunk included: a KB that grew continues from its last token)
    reused = publisher.reuse(tokens)
    cache = model.cache_from_kv(reused.kv_parts(), len(tokens) - reused.tokens) if reused.tokens else None
    t1 = time.perf_counter()
    computed = []
    if reused.tokens < len(tokens):
        computed = [model.prefill(tokens[reused.tokens:], past=cache, chunk_tokens=ct, progress=progress).kv]
    elif progress:
        progress(len(tokens), len(tokens))
    prefill_s = time.perf_counter() - t1
    # sent from the first chunk the origin lacks or the prefill computed, whichever comes
    # first: the fetched chunks before it are neither concatenated nor cut again
    start = min(held, reused.tokens // ct)
    parts = reused.kv_parts()[start:] + computed
    kv = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=3)
    receipt = client.publish(kb, named, kv, meta=meta, from_chunk=start)
    receipt.update(tokens=len(tokens), reused_tokens=reused.tokens,
                   prefilled_tokens=len(tokens) - reused.tokens, prefill_s=prefill_s,
                   fetched_bytes=reused.nbytes, total_s=time.perf_counter() - t0,
                   documents=[n for n, _ in named])
    return receipt


def _held_of(client, text, kb: str, docs) -> tuple:
    """(the checked documents' [(name, token ids)], their tokens, how many of their chunks the
    origin holds from the first on, when the lookup began), after checking the admin token
    and the KB's length; text: the model or its Text."""
    client.publisher.check_access()
    named = knowledge_documents(text, docs)
    tokens = [t for _, toks in named for t in toks]
    check_kb_tokens(kb, len(tokens))
    t0 = time.perf_counter()
    return named, tokens, client.publisher.held_chunks(tokens), t0     # a lookup: no KV moves


def _commit_held(client, kb: str, named, held: int, meta, progress, t0: float) -> dict:
    """Commit a KB whose every chunk the origin holds (held of them: an unchanged KB): its
    receipt, no KV computed or moved."""
    tokens = sum(len(toks) for _, toks in named)
    if progress:
        progress(tokens, tokens)
    receipt = client.publish(kb, named, None, meta=meta, from_chunk=held)
    receipt.update(tokens=tokens, reused_tokens=tokens, prefilled_tokens=0, prefill_s=0.0,
                   fetched_bytes=0, total_s=time.perf_counter() - t0, documents=[n for n, _ in named])
    return receipt


def publish_if_held(client, text, kb: str, documents, progress=None, meta=None) -> "dict | None":
    """publish_documents' receipt where the origin holds every chunk of the documents already
    (an unchanged KB), with text only (kdn.engines.transformers.prompts.Text: the model's
    tokenizer and chat template, no weights) and client connected for the model's
    fingerprint; None where a chunk is missing (the model must compute it)."""
    check_name(kb, "knowledge base name")
    named, tokens, held, t0 = _held_of(client, text, kb, check_documents(documents))
    if held * client.publisher.chunk_tokens < len(tokens):
        return None
    return _commit_held(client, kb, named, held, meta, progress, t0)


def progress_bar(prefix: str = "prefill", file=None):
    """A progress callback(done, total) showing a tqdm bar of tokens prefilled (stderr).

    On a terminal the bar redraws in place; into a log tqdm writes a line of its own every
    LOG_INTERVAL_S (no carriage returns, no line per chunk).
    """
    from tqdm import tqdm
    out = file or sys.stderr
    tty = hasattr(out, "isatty") and out.isatty()
    bar = None

    def show(done, total):
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=prefix, unit="tok", unit_scale=True,
                       file=out if tty else _LogLines(out), dynamic_ncols=tty, ascii=not tty,
                       mininterval=0.1 if tty else LOG_INTERVAL_S)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
    return show


class _LogLines:
    """A log file as tqdm's terminal: each status it draws becomes one line."""

    def __init__(self, out):
        self.out = out

    def write(self, s: str) -> None:
        s = s.replace("\r", "").rstrip()
        if s:
            self.out.write(s + "\n")

    def flush(self) -> None:
        self.out.flush()
