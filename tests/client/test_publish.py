"""kdn/client/publish.py: documents read and bounded, knowledge tokens cut per document, KV split into
chunks, only missing chunks sent, and everything refusable refused before any tokenizing.

The refusals are checked with a model that fails the test if it is ever asked to tokenize;
publishing runs against a real network (synthetic KV, so no model is needed for it).
"""
import io
import time

import numpy as np
import pytest

from kdn.client import publish as P
from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.errors import AccessDenied, BadRequest, ManifestError
from kdn.cli.knowledge import bundled_documents
from kdn.core.manifest import Manifest
from kdn.placement.topology import Topology

FP = "synthetic-model"
ADMIN = "admin-secret-0123456789abcdef"
READER_A = "a-read-token-0123456789"


class Untouchable:
    """A model that must not be used: the refusal comes before any tokenizing or prefill."""
    fingerprint = FP

    def __getattr__(self, name):
        raise AssertionError(f"the model was asked for {name!r} before the input was checked")


# --- documents -----------------------------------------------------------------------------
def test_a_50_mb_text_is_refused_in_well_under_a_second_without_tokenizing():
    text = "word " * (10 << 20)                # 50 MiB
    t0 = time.perf_counter()
    with pytest.raises(BadRequest, match="over the .*-byte limit of one knowledge base"):
        P.publish_documents(Untouchable(), Untouchable(), "big", [("a", text[:1000]), ("b", text)])
    assert time.perf_counter() - t0 < 0.5


def test_bad_names_and_documents_are_refused_before_tokenizing():
    for kb in ("../etc", "", "a/b", None):
        with pytest.raises(ManifestError, match="knowledge base name must match"):
            P.publish_documents(Untouchable(), Untouchable(), kb, [("d", "text")])
    for docs, msg in (([], "at least one document"), ([("d", "  ")], "is empty"),
                      ([("d", b"bytes")], "pair of str"), (["text"], "pair of str")):
        with pytest.raises(BadRequest, match=msg):
            P.publish_documents(Untouchable(), Untouchable(), "kb", docs)


def test_knowledge_documents_cut_the_system_turn_at_document_boundaries():
    from kdn.engines.transformers.model import load_model
    model = load_model()
    docs = list(bundled_documents())[-2:]
    named = P.knowledge_documents(model, docs)
    text, spans = P.join_documents(docs)
    assert [n for n, _ in named] == [n for n, _ in docs]
    assert [t for _, ts in named for t in ts] == model.knowledge_tokens(text)
    first, second = named[0][1], named[1][1]
    # the first document opens the system turn, the second begins with its own text
    assert model.tokenizer.decode(first).startswith("<|im_start|>system\n" + docs[0][1][:20])
    assert model.tokenizer.decode(second).lstrip().startswith(docs[1][1][:20].lstrip())
    assert spans[1][1] == len(docs[0][1]) + 2


def test_progress_bar_writes_tokens_done_into_a_log():
    out = io.StringIO()                       # not a terminal: no redraw per update
    show = P.progress_bar("prefill", file=out)
    for done in range(256, 2049, 256):
        show(done, 2048)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and 1 <= len(lines) <= 3, "a line now and then, not one per chunk"
    assert lines[-1].startswith("prefill: 100%") and "2.05k/2.05k" in lines[-1] and "tok" in lines[-1]


# --- KV -> chunks --------------------------------------------------------------------------
def test_split_kv_cuts_prefix_and_segments_and_refuses_wrong_shapes(synth):
    toks = synth.tokens(600, seed=3)
    kv = synth.kv(600, seed=3)
    m = Manifest.build("kb", "t", FP, [("d", toks)])
    chunks = P.split_kv(m, kv)
    assert [c.tokens for c in chunks] == [256, 256, 88] and [c.key for c in chunks] == list(m.keys)
    assert np.array_equal(np.concatenate([c.kv for c in chunks], axis=3), kv)
    import torch
    assert all(a.equal(b) for a, b in zip(P.split_kv(m, torch.from_numpy(kv)), chunks))
    with pytest.raises(BadRequest, match="kv covers 599 tokens but the documents have 600"):
        P.split_kv(m, kv[:, :, :, :599])
    with pytest.raises(BadRequest, match="numpy array or torch tensor"):
        P.split_kv(m, kv.tolist())
    segs = Manifest.build("kb", "t", FP, [("a", toks[:300]), ("b", toks[300:])], layout="segments")
    parts = P.split_kv(segs, [kv[:, :, :, :300], kv[:, :, :, 300:]])
    assert [c.tokens for c in parts] == [256, 44, 256, 44]
    with pytest.raises(BadRequest, match="one kv array per document"):
        P.split_kv(segs, kv)


# --- to the origin -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    import uuid
    topo = Topology.default_local(["us-east", "eu-west"], edges_per_region=1, capacity_bytes=128 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("publish-origin"), network=f"p{uuid.uuid4().hex[:8]}",
                      auth={"admin": ADMIN, "readers": {"a": READER_A}})
    yield n
    stop_network(n)


def test_publish_sends_only_missing_chunks_and_an_unchanged_kb_makes_no_version(net, synth):
    cl = Client(network=net.name, region="eu-west", tenant="b", fingerprint=FP, admin_token=ADMIN)
    toks, kv = synth.tokens(1000, seed=4), synth.kv(1000, seed=4)
    r = cl.publish("kb", [("d", toks)], kv)
    assert (r["version"], r["unchanged"], r["chunks"], r["sent_chunks"]) == (1, False, 4, 4)
    assert r["sent_bytes"] == kv.nbytes
    again = cl.publish("kb", [("d", toks)], kv)
    assert (again["version"], again["unchanged"], again["sent_chunks"]) == (1, True, 0)
    more = toks + synth.tokens(300, seed=5)
    kv2 = np.concatenate([kv, synth.kv(300, seed=5)], axis=3)
    r2 = cl.publish("kb", [("d", more)], kv2)
    # the first three chunks are shared with v1; v1's partial fourth is not: three new ones
    assert (r2["version"], r2["chunks"], r2["sent_chunks"]) == (2, 6, 3)
    f = cl.fetch(more, kb="kb")
    assert f.tokens == 1300 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv2)
    counters = cl.stats()["counters"]
    assert (counters["publishes"], counters["sent_chunks"], counters["fetches"]) == (3, 7, 1)


def test_a_publish_from_a_held_chunk_sends_only_the_kv_after_it(net, synth):
    """from_chunk: the origin holds every chunk before it, so the caller computes, cuts and
    sends only the KV after it (publish_documents: an unchanged KB sends none at all)."""
    cl = Client(network=net.name, region="eu-west", tenant="f", fingerprint=FP, admin_token=ADMIN)
    toks, kv = synth.tokens(1000, seed=14), synth.kv(1000, seed=14)
    cl.publish("kb", [("d", toks)], kv)
    assert cl.publisher.held_chunks(toks) == 4
    again = cl.publish("kb", [("d", toks)], None, from_chunk=4)
    assert (again["unchanged"], again["sent_chunks"]) == (True, 0)
    more = toks + synth.tokens(300, seed=15)
    assert cl.publisher.held_chunks(more) == 3          # v1's partial fourth chunk is not v2's
    tail = np.concatenate([kv, synth.kv(300, seed=15)], axis=3)[:, :, :, 768:]
    r = cl.publish("kb", [("d", more)], tail, from_chunk=3)
    assert (r["version"], r["chunks"], r["sent_chunks"], r["sent_bytes"]) == (2, 6, 3, tail.nbytes)
    f = cl.fetch(more, kb="kb")
    assert f.tokens == 1300 and np.array_equal(np.concatenate(f.kv_parts(), axis=3)[:, :, :, 768:], tail)
    with pytest.raises(BadRequest, match="kv covers 300 tokens but the documents have 532 from chunk 3 on"):
        cl.publish("kb", [("d", more)], tail[:, :, :, :300], from_chunk=3)
    other = synth.tokens(600, seed=16)             # nothing of it is stored
    with pytest.raises(BadRequest, match="no longer holds chunk 0"):
        cl.publish("other", [("d", other)], synth.kv(600, seed=16)[:, :, :, 256:], from_chunk=1)


def _perturbed(kv):
    """The same KV off in its last bits, as another CPU, GPU or batch shape computes it."""
    other = kv.copy()
    other.reshape(-1)[::97] = np.nextafter(other.reshape(-1)[::97], np.float32(np.inf))
    return other


def test_a_key_means_the_bytes_stored_first_and_later_publishers_adopt_them(net, synth):
    toks, kv = synth.tokens(1000, seed=11), synth.kv(1000, seed=11)
    first = Client(network=net.name, region="us-east", tenant="c", fingerprint=FP, admin_token=ADMIN)
    r1 = first.publish("x", [("d", toks)], kv)
    assert (r1["sent_chunks"], r1["adopted_chunks"]) == (4, 0)
    # a second publisher (another machine) computed other bytes for the same keys
    second = Client(network=net.name, region="eu-west", tenant="c", fingerprint=FP, admin_token=ADMIN)
    r2 = second.publish("y", [("d", toks)], _perturbed(kv))
    assert (r2["sent_chunks"], r2["adopted_chunks"]) == (0, 4)
    mx, my = first.manifest("x"), second.manifest("y")
    assert my.keys == mx.keys and my.sums == mx.sums, "its manifest names the stored bytes"
    reader = Client(network=net.name, region="eu-west", tenant="c", fingerprint=FP, token=ADMIN)
    for kb in ("x", "y"):
        f = reader.fetch(toks, kb=kb)
        assert f.tokens == 1000 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
    assert reader.stats()["counters"].get("corrupt_chunks", 0) == 0
    edges = first.status()["edges"]
    assert sum(e["counters"].get("corrupt_reported", 0) for e in edges) == 0


def test_publishers_racing_on_one_key_commit_the_same_bytes(net, synth):
    import threading
    toks, kv = synth.tokens(1300, seed=12), synth.kv(1300, seed=12)
    kvs = [kv, _perturbed(kv)]
    receipts, barrier = {}, threading.Barrier(2)

    def publish(i):
        cl = Client(network=net.name, region=("us-east", "eu-west")[i], tenant="d", fingerprint=FP,
                    admin_token=ADMIN)
        barrier.wait()
        receipts[i] = cl.publish(f"race{i}", [("d", toks)], kvs[i])

    ts = [threading.Thread(target=publish, args=(i,)) for i in range(2)]
    [t.start() for t in ts]
    [t.join(timeout=120) for t in ts]
    assert sorted(receipts) == [0, 1]
    assert receipts[0]["sent_chunks"] + receipts[1]["sent_chunks"] >= 5
    cl = Client(network=net.name, region="us-east", tenant="d", fingerprint=FP, admin_token=ADMIN)
    m0, m1 = cl.manifest("race0"), cl.manifest("race1")
    assert m0.sums == m1.sums, "one key, one byte string, whoever stored it first"
    got = [cl.fetch(toks, kb=f"race{i}") for i in range(2)]
    assert all(f.tokens == 1300 for f in got)
    a, b = (np.concatenate(f.kv_parts(), axis=3) for f in got)
    assert np.array_equal(a, b) and cl.stats()["counters"].get("corrupt_chunks", 0) == 0


def test_a_manifest_with_other_checksums_than_the_stored_chunks_is_refused(net, synth):
    import dataclasses
    toks, kv = synth.tokens(600, seed=13), synth.kv(600, seed=13)
    cl = Client(network=net.name, region="us-east", tenant="e", fingerprint=FP, admin_token=ADMIN)
    cl.publish("kb", [("d", toks)], kv)
    m = cl.manifest("kb")
    forged = dataclasses.replace(m, name="forged", version=None, sums=(m.sums[0] ^ 1,) + m.sums[1:])
    with pytest.raises(ManifestError, match="a key means the bytes stored first"):
        cl.publisher.view.origin(60).commit(forged.to_dict())
    assert [x.name for x in cl.manifests(refresh=True)] == ["kb"]


def test_the_reuse_read_of_a_new_namespace_uses_the_admin_token(net, synth):
    # Read tokens are on (tenant "a" has one); nothing is published for tenant "a" yet.
    # The publisher's reuse fetch must answer "nothing cached", not AccessDenied.
    cl = Client(network=net.name, region="us-east", tenant="a", fingerprint=FP, admin_token=ADMIN)
    got = cl.publisher.reuse(synth.tokens(600, seed=6))
    assert got.tokens == 0 and got.chunks == []


def test_a_wrong_admin_token_is_refused_before_tokenizing(net):
    cl = Client(network=net.name, region="us-east", tenant="b", fingerprint=FP, admin_token="w" * 30)
    with pytest.raises(AccessDenied, match="admin token"):
        P.publish_documents(cl, Untouchable(), "kb", [("d", "Some knowledge.")])


def test_a_client_without_the_models_fingerprint_cannot_publish(net):
    cl = Client(network=net.name, region="us-east", tenant="b", admin_token=ADMIN)

    class Model:
        fingerprint = FP
    with pytest.raises(BadRequest, match="fingerprint=model.fingerprint"):
        P.publish_documents(cl, Model(), "kb", [("d", "Some knowledge.")])
