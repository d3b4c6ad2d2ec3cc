"""Emphasized KV in the network: kept apart from the KB's exact KV, served only to who asks.

An edit (kdn.engines.kv_edit: a KB version, its document weights) names a namespace of its own,
(tenant, "<model fingerprint>~emphasis-<salt>"), the salt an xxh3-128 of (method, KB,
version, weights): every key of edited KV is chained from that namespace, so a reader of
the KB (who computes keys under the model's fingerprint) can neither name nor list it, two
tenants' edits of the same KB never share a key, and two different edits never collide.
Only the edited chunks are stored there: the edited token stream from the chunk holding the
first edited token on (the variant's manifest, named like the KB, holds those token ids
with the duplicates, and its meta says what it is, `exact: False`). The chunks before it
are the KB's own and are read from the KB. The variant belongs to the KB version it edits:
operators' listings and "latest version" lookups never take it for the KB
(kdn.core.emphasis.is_emphasized), and retiring that version retires it too.

`publish_emphasis` (the operator, with the admin token) stores an edit of a published KB,
computed from the KB's stored exact KV, so a variant is the same bytes a worker would edit
locally. `emphasized_kv` (a worker) reads the KB's chunks before the edit and the variant's
chunks, or, where no one published that edit, fetches the KB and edits it in its own memory
(nothing is stored). Its answer is always flagged exact=False.
"""
import time
from dataclasses import dataclass, field

import numpy as np

from kdn.engines import kv_edit as E
from kdn.core.emphasis import check_weights, emphasis_fingerprint
from kdn.core.errors import BadRequest, ManifestError
from kdn.client.reader import Reader


@dataclass
class Plan:
    """One edit of one KB version, ready to apply."""
    manifest: object          # the KB's Manifest
    weights: dict             # {document: int weight}, weight-1 entries dropped
    repeats: np.ndarray       # int64 [KB tokens]
    first: "int | None"       # first edited token, None: no edit
    chunk: int                # index of the first chunk the edit changes (KB chunks before it)
    salt: bytes

    @property
    def extra(self) -> int:
        return E.extra_tokens(self.repeats)

    def fingerprint(self, fingerprint: str) -> str:
        return variant_fingerprint(fingerprint, self.salt)

    def tail_tokens(self) -> list:
        """Token ids of the edited stream from the first edited chunk on (the variant's tokens)."""
        ids = self.manifest.token_ids()
        return np.repeat(ids, self.repeats)[self.chunk * self.manifest.chunk_tokens:].tolist()


def variant_fingerprint(fingerprint: str, salt: bytes) -> str:
    """The fingerprint part of an edit's namespace: never a model's own
    (kdn.core.emphasis.emphasis_fingerprint; is_emphasized tells it from a model's)."""
    return emphasis_fingerprint(fingerprint, salt)


def plan(model, manifest, weights) -> Plan:
    """The edit `weights` ({document: int}) makes of `manifest`; BadRequest naming a bad weight
    or a document the KB does not have."""
    if manifest.layout != "prefix":
        raise BadRequest(f"emphasis needs a 'prefix' knowledge base; {manifest.name!r} is "
                         f"{manifest.layout!r}")
    w = check_weights(weights, [d.name for d in manifest.documents])
    if w and len(manifest.token_ids()) != manifest.n_tokens:
        raise BadRequest(f"knowledge base {manifest.name!r} version {manifest.version} was published "
                         "without its token ids; republish it to emphasize it")
    spans = E.document_spans(model, manifest.documents) if w else []
    reps = E.token_weights(spans, w, manifest.n_tokens)
    first = E.first_edited(reps)
    chunk = 0 if first is None else first // manifest.chunk_tokens
    return Plan(manifest, w, reps, first, chunk, E.edit_salt(manifest.name, manifest.version, w))


@dataclass
class Emphasized:
    """Edited KV of a KB (a list of parts [layers, 2, heads, tokens, hd], concatenated in order)."""
    parts: list
    tokens: int               # KB tokens they stand for (positions the question starts at)
    extra: int                # cache entries beyond `tokens` (the duplicates)
    source: str               # "network" (the variant was published) or "local" (edited here)
    kb_chunks: int            # chunks read from the KB itself
    variant_chunks: int       # chunks read from the variant
    seconds: float
    exact: bool = False       # edited KV is never exact
    counts: dict = field(default_factory=dict)
    weights: dict = field(default_factory=dict)   # the edit: {document: weight}, weight-1 entries dropped


def _variant_reader(client, p: Plan) -> Reader:
    r = client.reader
    return Reader(r.view, r.tenant, p.fingerprint(r.fingerprint), token=r.token, accept=None,
                  chunk_tokens=r.chunk_tokens)


def _kb_kv(client, model, m) -> np.ndarray:
    """The KB's whole KV, exact: fetched, and the rest (chunks no one holds) prefilled."""
    ids = m.token_ids().tolist()
    f = client.fetch(ids, kb=m.name, version=m.version)
    parts = list(f.kv_parts())
    if f.tokens < len(ids):
        cache = model.cache_from_kv(parts, len(ids) - f.tokens) if f.tokens else None
        parts.append(model.prefill(ids[f.tokens:], past=cache, chunk_tokens=m.chunk_tokens).kv)
    return np.concatenate(parts, axis=3) if len(parts) > 1 else parts[0]


def emphasized_kv(client, model, manifest, weights) -> "Emphasized | None":
    """The KB's KV edited by `weights` (None when the weights edit nothing: read the KB as
    always). The edit's variant if published, else the KB's KV edited here."""
    t0 = time.perf_counter()
    p = plan(model, manifest, weights)
    if p.first is None:
        return None
    n = manifest.n_tokens
    variant = _variant_reader(client, p)
    try:
        vm = variant.manifest(manifest.name)
    except ManifestError:                       # no one published this edit: edit here
        vm = None
    if vm is not None:
        kb_part = []
        if p.chunk:
            f = client.fetch_keys(manifest.keys[:p.chunk], manifest)
            kb_part = list(f.kv_parts()) if len(f.chunks) == p.chunk else None
        if kb_part is not None:
            g = variant.fetch(vm.token_ids().tolist(), kb=vm.name)
            if g.tokens == vm.n_tokens:
                return Emphasized(kb_part + list(g.kv_parts()), n, p.extra, "network", p.chunk,
                                  len(g.chunks), time.perf_counter() - t0, weights=p.weights)
    kv = E.edit(_kb_kv(client, model, manifest), p.repeats)
    return Emphasized([kv], n, p.extra, "local", len(manifest.keys), 0, time.perf_counter() - t0,
                      weights=p.weights)


def publish_emphasis(client, model, kb: str, weights, version: int = None) -> dict:
    """Store the edit `weights` of the published KB `kb` (its latest version unless named) under
    its own namespace (see the module); only the edited chunks travel. Admin token needed."""
    m = client.manifest(kb, version)
    p = plan(model, m, weights)
    if p.first is None:
        return {"kb": kb, "version": m.version, "of_version": m.version, "weights": {}, "sent_chunks": 0,
                "sent_bytes": 0, "note": "every weight is 1: the KB itself is its emphasis"}
    from kdn.client.publish import Publisher
    pub = client.publisher
    pub.check_access()
    ids = m.token_ids().tolist()
    full = pub.reuse(ids)                       # the KB's stored exact KV (admin read)
    if full.tokens != len(ids):
        raise BadRequest(f"the network holds {full.tokens} of knowledge base {kb!r}'s {len(ids)} "
                         "tokens; warm or republish it before emphasizing it")
    kv = np.concatenate(full.kv_parts(), axis=3) if len(full.chunks) > 1 else full.kv_parts()[0]
    tail = E.edit(kv, p.repeats)[:, :, :, p.chunk * m.chunk_tokens:]
    variant = Publisher(pub.view, pub.tenant, p.fingerprint(pub.fingerprint), pub.chunk_tokens)
    meta = {"emphasis": p.weights, "of": {"kb": kb, "version": m.version}, "exact": False,
            "kb_chunks": p.chunk}
    receipt = variant.publish(kb, [("emphasized", p.tail_tokens())], np.ascontiguousarray(tail), meta=meta)
    receipt.update(weights=p.weights, of_version=m.version, kb_chunks=p.chunk, extra_tokens=p.extra,
                   namespace_fingerprint=variant.fingerprint)
    return receipt
