"""kdn/publish.py: documents read and bounded, knowledge tokens cut per document, KV split into
chunks, only missing chunks sent, and everything refusable refused before any tokenizing.

The refusals are checked with a model that fails the test if it is ever asked to tokenize;
publishing runs against a real network (synthetic KV, so no model is needed for it).
"""
import io
import time

import numpy as np
import pytest

from kdn import publish as P
from kdn.client import Client
from kdn.cluster import start_network, stop_network
from kdn.errors import AccessDenied, BadRequest, ManifestError
from kdn.knowledge import bundled_documents
from kdn.manifest import Manifest
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
def test_read_documents_names_each_problem(tmp_path):
    good = tmp_path / "Good Doc.md"
    good.write_text("# Title\nSome text.\n", encoding="utf-8")
    twin = tmp_path / "sub"
    twin.mkdir()
    (twin / "Good Doc.txt").write_text("More text.", encoding="utf-8")
    assert P.read_documents([good, twin / "Good Doc.txt"]) == [
        ("Good-Doc", "# Title\nSome text.\n"), ("Good-Doc-2", "More text.")]
    cases = {"missing.md": None, "blob.bin": b"text", "latin.txt": "caf\xe9".encode("latin-1"),
             "empty.md": b"  \n\t"}
    for name, data in cases.items():
        if data is not None:
            (tmp_path / name).write_bytes(data)
    with pytest.raises(BadRequest, match="missing.md: no such file"):
        P.read_documents([good, tmp_path / "missing.md"])
    with pytest.raises(BadRequest, match="blob.bin: not a text or markdown file"):
        P.read_documents([tmp_path / "blob.bin"])
    with pytest.raises(BadRequest, match=r"latin.txt: not UTF-8 text \(unexpected end of data at byte 3\)"):
        P.read_documents([tmp_path / "latin.txt"])
    with pytest.raises(BadRequest, match="empty.md: the document is empty"):
        P.read_documents([tmp_path / "empty.md"])
    with pytest.raises(BadRequest, match="give at least one document"):
        P.read_documents([])


def test_too_much_text_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:                 # sparse: as large as declared, instantly
        f.truncate(P.MAX_KB_BYTES // 2 + 1)
    t0 = time.perf_counter()
    with pytest.raises(BadRequest, match=f"over the {P.MAX_KB_BYTES}-byte limit of one knowledge base"):
        P.read_documents([big, big])           # each file fits; together they do not
    assert time.perf_counter() - t0 < 0.5


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
    from kdn.model import load_model
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
