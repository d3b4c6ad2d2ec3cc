"""kdn/client/reader.py without Ray: a scripted view stands in for the network (its edges' replies).

What a reader guarantees whatever the edges answer: it continues while an edge says "more"
(with exactly the keys after those it received), verifies every chunk in one place (frame
checksums, manifest checksums for exact KV, only the frame for lossy KV), reports a corrupt
copy to the edge that holds it with its namespace and token and fetches it again, and never
returns KV that is not the published KV.
"""
import numpy as np
import pytest

from kdn.core.chunk import Chunk, Encoded
from kdn.core.errors import RemoteError
from kdn.core.interfaces import EdgeReads
from kdn.core.rpc import Stub
from kdn.core.manifest import Manifest
from kdn.client.publish import split_kv
from kdn.client.reader import MAX_CORRUPT_RETRIES, Reader

TENANT, FP, TOKEN = "acme", "synthetic-model", "read-token-of-acme-0123"


def _kv(n, seed=0):
    return np.random.default_rng(seed).standard_normal((2, 2, 2, n, 8)).astype(np.float32)


def _tokens(n, seed=0):
    return np.random.default_rng(seed + 1000).integers(0, 49152, n).tolist()


class ScriptedView:
    """A transport (kdn.client.view's nearest/at) whose nearest edge "e1" holds `held` (key -> object) and answers fetches with at
    most `per_reply` chunks, saying "more" when it stopped for that bound."""
    region, node_id = "us-east", "node-1"

    def __init__(self, manifests, held, per_reply=None, sources=None):
        self.manifests, self.held = manifests, held
        self.per_reply, self.sources = per_reply, sources or {}
        self.fetched, self.reported = [], []

    def nearest(self, timeout=5.0, resolve_refs=False):
        return Stub(EdgeReads, lambda m, a, k: self.edge(m, *a, resolve_refs=resolve_refs, **k), "e1")

    def at(self, edge, timeout=5.0):
        return Stub(EdgeReads, lambda m, a, k: self.edge_at(edge, m, *a, **k), edge)

    def edge(self, method, *args, resolve_refs=False, **kw):
        assert kw["token"] == TOKEN, "every read carries the reader's token"
        if method == "list_manifests":
            return [m.to_dict() for m in self.manifests], "e1", []
        assert method == "fetch" and resolve_refs and kw["node"] == self.node_id
        keys, ns = args[0], args[1]
        self.fetched.append(list(keys))
        out = []
        for k in keys:
            if k not in self.held or (self.per_reply and len(out) == self.per_reply):
                break
            out.append(self.held[k])
        more = bool(self.per_reply) and len(out) == self.per_reply and len(out) < len(keys)
        return ({"chunks": out, "sources": [self.sources.get(c.key, "local") for c in out],
                 "codecs": [c.codec for c in out], "wire": [c.nbytes for c in out],
                 "ring": 0, "more": more}, "e1", [])

    def edge_at(self, edge, method, *args, **kw):
        assert method == "drop_corrupt"
        self.reported.append((edge, list(args[0]), args[1], kw["token"]))
        for k in args[0]:          # the holder drops the bad copy; the next fetch finds a good one
            self.held[k] = self.good[k]
        return len(args[0])

    def follow(self, ring_version):
        pass


def _published(n_tokens=1280, seed=0):
    toks, kv = _tokens(n_tokens, seed), _kv(n_tokens, seed)
    m = Manifest.build("kb", TENANT, FP, [("d", toks)])
    chunks = split_kv(m, kv)
    m = Manifest.from_dict({**m.to_dict(), "sums": [c.digest() for c in chunks], "version": 1})
    return toks, kv, m, chunks


def _reader(view):
    return Reader(view, TENANT, FP, token=TOKEN)


def _corrupt(c: Chunk) -> Chunk:
    kv = np.array(c.kv, copy=True)
    kv.reshape(-1).view(np.uint8)[kv.nbytes // 2] ^= 0xFF
    return Chunk(c.key, c.ns, kv, c.dtype)


def test_a_bounded_reply_is_continued_with_the_keys_after_it():
    toks, kv, m, chunks = _published()
    view = ScriptedView([m], {c.key: c for c in chunks}, per_reply=2)
    f = _reader(view).fetch(toks, kb="kb")
    assert f.tokens == 1280 and len(f.chunks) == 5
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    keys = list(m.keys)
    assert view.fetched == [keys, keys[2:], keys[4:]], "each call asks for the keys not yet received"
    assert f.codecs == {"raw": 5} and f.wire_bytes == sum(c.nbytes for c in chunks) and f.exact


def test_a_long_prefix_is_asked_for_in_requests_an_edge_takes(monkeypatch):
    from kdn.client import reader as R
    monkeypatch.setattr(R, "MAX_FETCH_KEYS", 2)
    toks, kv, m, chunks = _published()
    view = ScriptedView([m], {c.key: c for c in chunks})
    f = _reader(view).fetch(toks, kb="kb")
    keys = list(m.keys)
    assert view.fetched == [keys[:2], keys[2:4], keys[4:]]
    assert f.tokens == 1280 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)


def test_a_prefix_ends_where_the_network_holds_nothing_more():
    toks, kv, m, chunks = _published()
    view = ScriptedView([m], {c.key: c for c in chunks[:3]})
    f = _reader(view).fetch(toks, kb="kb")
    assert f.tokens == 768 and len(view.fetched) == 1, "no more: one call, a shorter prefix"
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv[:, :, :, :768])


def test_a_corrupt_copy_is_reported_to_its_holder_and_fetched_again():
    toks, kv, m, chunks = _published()
    held = {c.key: c for c in chunks}
    bad_key = chunks[3].key
    held[bad_key] = _corrupt(chunks[3])
    view = ScriptedView([m], held, sources={bad_key: "peer:eu-west-0"})
    view.good = {c.key: c for c in chunks}
    reader = _reader(view)
    f = reader.fetch(toks, kb="kb")
    assert f.tokens == 1280 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    # the copy came from a peer of the edge asked: the peer is told, with the namespace and token
    assert view.reported == [("eu-west-0", [bad_key], m.ns, TOKEN)]
    assert view.fetched[1] == list(m.keys)[3:], "the retry asks only from the corrupt chunk on"
    assert reader.counters["corrupt_chunks"] == 1


def test_a_copy_that_stays_corrupt_ends_the_prefix_before_it():
    toks, kv, m, chunks = _published()
    held = {c.key: c for c in chunks}
    held[chunks[2].key] = _corrupt(chunks[2])
    view = ScriptedView([m], held)
    view.good = dict(held)         # the holder keeps answering the corrupt copy
    reader = _reader(view)
    f = reader.fetch(toks, kb="kb")
    assert f.tokens == 512 and len(f.chunks) == 2
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv[:, :, :, :512])
    assert len(view.fetched) == MAX_CORRUPT_RETRIES + 1, "the first try and its retries"
    assert reader.counters["corrupt_chunks"] == MAX_CORRUPT_RETRIES + 1


def test_a_corrupt_frame_never_decodes_and_lossy_kv_is_flagged_not_checked_against_sums():
    toks, kv, m, chunks = _published()
    held = {c.key: Encoded.of(c, "q8") for c in chunks}
    frame = np.array(held[chunks[1].key].frame, copy=True)
    frame[-100] ^= 0xFF                                   # inside the payload
    e = held[chunks[1].key]
    held[e.key] = Encoded(e.key, e.ns, e.codec, e.dtype, e.raw, e.exact, frame)
    view = ScriptedView([m], held)
    view.good = {c.key: Encoded.of(c, "q8") for c in chunks}
    f = _reader(view).fetch(toks, kb="kb")
    assert f.tokens == 1280 and not f.exact and f.codecs == {"q8": 5}
    got = np.concatenate(f.kv_parts(), axis=3)
    assert not np.array_equal(got, kv) and np.abs(got - kv).max() < 0.05 * np.abs(kv).max()
    assert [keys for _, keys, _, _ in view.reported] == [[chunks[1].key]]


def test_an_edge_answering_another_chunk_is_an_error():
    toks, kv, m, chunks = _published()
    held = {c.key: c for c in chunks}
    held[chunks[1].key] = chunks[2]
    with pytest.raises(RemoteError, match="not the one asked for"):
        _reader(ScriptedView([m], held)).fetch(toks, kb="kb")


def test_fetch_keys_checks_the_manifest_it_is_given():
    toks, kv, m, chunks = _published()
    held = {c.key: c for c in chunks}
    held[chunks[0].key] = _corrupt(chunks[0])
    view = ScriptedView([], held)
    view.good = {c.key: c for c in chunks}
    f = _reader(view).fetch_keys(m.keys, manifest=m)
    assert f.tokens == 1280 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    assert len(view.reported) == 1
