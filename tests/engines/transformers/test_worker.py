"""Workers on a real 3-region network with the real model: KDN never changes what the model says.

Knowledge is published with SmolLM2-135M-Instruct through the origin (publish_documents:
prefill only what the network lacks), then workers in different regions answer questions
with `answer(check=True)`: the knowledge's KV comes from their nearest edge, only the
question is computed, and the greedy tokens must equal a plain full prefill's. Knowledge
bases are small (≈500-1,000 tokens) and answers short, to keep this module fast on 2 cores:
one whose token length is not a multiple of the 256-token chunk (it ends in a partial
chunk) and one that is exactly 512 tokens (it ends on a chunk boundary).
"""
import uuid

import pytest

from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.keys import CHUNK_TOKENS
from kdn.cli.knowledge import bundled_documents
from kdn.client.publish import knowledge_documents, publish_documents
from kdn.placement.topology import Topology
from kdn.core.errors import ModelError
from kdn.engines.transformers.worker import answer

REGIONS = ("us-east", "eu-west", "ap-south")
NEW_TOKENS = 10
SOURCES = {"local", "peer", "origin"}


# `model`: tests/conftest.py (the real model, one intra-op thread)


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("worker-origin"), network=f"w{uuid.uuid4().hex[:8]}")
    yield n
    stop_network(n)


def _exactly(model, text: str, n_tokens: int) -> str:
    """The longest word prefix of text whose knowledge turn is n_tokens long (padded with '.')."""
    words = text.split(" ")
    for n in range(len(words), 0, -1):
        cut = " ".join(words[:n])
        size = len(model.knowledge_tokens(cut))
        if size == n_tokens:
            return cut
        if size < n_tokens:
            while len(model.knowledge_tokens(cut)) < n_tokens:
                cut += "."
            if len(model.knowledge_tokens(cut)) == n_tokens:
                return cut
            break
    raise AssertionError(f"cannot cut the text to a {n_tokens}-token knowledge turn")


@pytest.fixture(scope="module")
def kbs(model):
    """name -> documents: 'rights' (a partial last chunk) and 'courts' (exactly 512 tokens)."""
    docs = dict(bundled_documents())
    return {
        "rights": [("bill-of-rights", docs["bill-of-rights"])],
        "courts": [("article-iii", _exactly(model, docs["constitution-article-iii"], 2 * CHUNK_TOKENS))],
    }


@pytest.fixture(scope="module")
def published(model, net, kbs):
    """Each KB published once from us-east: name -> receipt."""
    cl = Client(network=net.name, region="us-east", fingerprint=model.fingerprint)
    seen = {}
    out = {}
    for name, docs in kbs.items():
        seen[name] = []
        out[name] = publish_documents(cl, model, name, docs,
                                      progress=lambda done, total, s=seen[name]: s.append((done, total)))
        out[name]["progress"] = seen[name]
    return out


def _check_answer(model, a, region, kb_tokens, n_chunks, question):
    assert a.identical is True, (f"KDN answer {a.tokens} differs from the full prefill's "
                                 f"{a.baseline_tokens} ({question!r} in {region})")
    assert a.tokens == a.baseline_tokens and len(a.tokens) >= 1 and a.text
    assert a.max_logit_diff < 1e-3
    assert a.cached_tokens == kb_tokens
    assert a.prompt_tokens == kb_tokens + len(model.question_tokens(question))
    assert a.edge == f"{region}-0", "a worker is served by the edge of its own region"
    assert set(a.sources) <= SOURCES and sum(a.sources.values()) == n_chunks
    assert a.bytes_moved == kb_tokens * model.kv_bytes_per_token
    assert 0 < a.fetch_s < a.ttft_s and a.baseline_ttft_s > 0
    assert a.extra["rebuild_s"] >= 0


def test_first_publish_prefills_every_token_once(model, kbs, published):
    rights, courts = published["rights"], published["courts"]
    n_rights = len(model.knowledge_tokens(kbs["rights"][0][1]))
    assert rights["tokens"] == n_rights and n_rights % CHUNK_TOKENS != 0 and 300 < n_rights < 1200
    assert courts["tokens"] == 2 * CHUNK_TOKENS
    for r, n in ((rights, n_rights), (courts, 2 * CHUNK_TOKENS)):
        assert r["version"] == 1 and not r["unchanged"]
        assert r["prefilled_tokens"] == n and r["reused_tokens"] == 0
        assert r["chunks"] == -(-n // CHUNK_TOKENS) == r["sent_chunks"]
        kv_bytes = n * model.kv_bytes_per_token                 # stored as frames: KV + headers
        assert kv_bytes < r["bytes"] <= kv_bytes + 1024 * r["chunks"]
        assert r["progress"][-1] == (n, n)                  # progress reported to the end
        assert [d for d, _ in r["progress"]] == sorted(d for d, _ in r["progress"])


@pytest.mark.parametrize("kb,region,question", [
    ("rights", "us-east", "What does the Eighth Amendment forbid?"),
    ("rights", "ap-south", "What does the First Amendment say about freedom of speech?"),
    ("courts", "ap-south", "How many witnesses are needed to convict a person of treason?"),
    ("courts", "us-east", "Who holds the judicial power of the United States?"),
])
def test_answers_are_token_identical_to_a_full_prefill_in_every_region(model, net, published,
                                                                       kb, region, question):
    r = published[kb]
    cl = Client(network=net.name, region=region, fingerprint=model.fingerprint)
    a = answer(cl, model, kb, question, max_new_tokens=NEW_TOKENS, check=True, version=r["version"])
    _check_answer(model, a, region, r["tokens"], r["chunks"], question)


@pytest.fixture(scope="module")
def republished(model, net, kbs, published):
    """'rights' published again unchanged, then with a document appended (version 2)."""
    cl = Client(network=net.name, region="us-east", fingerprint=model.fingerprint)
    again = publish_documents(cl, model, "rights", kbs["rights"])
    docs = dict(bundled_documents())
    longer = kbs["rights"] + [("gettysburg-address", docs["gettysburg-address"])]
    v2 = publish_documents(cl, model, "rights", longer)
    return {"again": again, "v2": v2, "longer": longer}


def test_republishing_unchanged_knowledge_costs_no_prefill(published, republished):
    first, again = published["rights"], republished["again"]
    assert again["unchanged"] is True and again["version"] == first["version"]
    assert again["prefilled_tokens"] == 0 and again["reused_tokens"] == first["tokens"]
    assert again["sent_chunks"] == 0 and again["sent_bytes"] == 0
    assert again["fetched_bytes"] == 0, "a lookup at the origin: no KV fetched to find nothing new"


def test_appending_a_document_reuses_the_prefix_and_stays_exact(model, net, published, republished):
    first, v2, longer = published["rights"], republished["v2"], republished["longer"]
    full_chunks = first["tokens"] // CHUNK_TOKENS * CHUNK_TOKENS   # v1's partial chunk changes
    assert v2["version"] == first["version"] + 1 and not v2["unchanged"]
    assert v2["tokens"] == len(model.knowledge_tokens(longer[0][1] + "\n\n" + longer[1][1]))
    assert v2["reused_tokens"] == full_chunks > 0
    assert v2["prefilled_tokens"] == v2["tokens"] - full_chunks
    assert v2["sent_chunks"] == v2["chunks"] - full_chunks // CHUNK_TOKENS
    # what the prefill continues from, and nothing more, was fetched
    assert v2["fetched_bytes"] == full_chunks * model.kv_bytes_per_token
    assert v2["documents"] == ["bill-of-rights", "gettysburg-address"]

    question = "Who gave the Gettysburg Address?"
    worker = Client(network=net.name, region="eu-west", fingerprint=model.fingerprint)
    a = answer(worker, model, "rights", question, max_new_tokens=NEW_TOKENS, check=True)
    _check_answer(model, a, "eu-west", v2["tokens"], v2["chunks"], question)


def test_an_older_version_is_still_served_whole(model, net, published, republished):
    first = published["rights"]
    question = "What does the Second Amendment protect?"
    worker = Client(network=net.name, region="eu-west", fingerprint=model.fingerprint)
    old = answer(worker, model, "rights", question, max_new_tokens=NEW_TOKENS, check=True,
                 version=first["version"])
    assert old.identical is True          # exact either way: only the reuse is lost
    _check_answer(model, old, "eu-west", first["tokens"], first["chunks"], question)


def test_a_publisher_that_computed_other_bytes_adopts_the_stored_ones(model, net, kbs, published):
    """The same knowledge computed in another batch shape (here the whole KB in one forward
    pass, not 256-token chunks; on another CPU or a GPU, any prefill) has other bytes under the
    same keys. The second publisher sends nothing, its manifest adopts the stored checksums, and
    a reader of its KB takes every token from KDN with no copy reported corrupt."""
    import numpy as np
    import xxhash
    named = knowledge_documents(model, kbs["rights"])
    tokens = [t for _, toks in named for t in toks]
    one_pass = model.prefill(tokens, chunk_tokens=len(tokens)).kv
    cl = Client(network=net.name, region="us-east", fingerprint=model.fingerprint)
    stored = cl.manifest("rights", published["rights"]["version"])
    ours = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(one_pass[:, :, :, s:s + CHUNK_TOKENS]))
            for s in range(0, len(tokens), CHUNK_TOKENS)]
    differ = sum(a != b for a, b in zip(ours, stored.sums))
    print(f"\none forward pass vs 256-token chunks: {differ} of {len(ours)} chunks differ in bytes")
    r = cl.publish("rights-one-pass", named, one_pass)
    assert (r["sent_chunks"], r["adopted_chunks"]) == (0, differ)
    assert cl.manifest("rights-one-pass").sums == stored.sums
    question = "What does the Fourth Amendment protect against?"
    worker = Client(network=net.name, region="ap-south", fingerprint=model.fingerprint)
    a = answer(worker, model, "rights-one-pass", question, max_new_tokens=NEW_TOKENS, check=True)
    _check_answer(model, a, "ap-south", len(tokens), len(ours), question)
    assert worker.stats()["counters"].get("corrupt_chunks", 0) == 0
    assert sum(e["counters"].get("corrupt_reported", 0) for e in cl.status()["edges"]) == 0


@pytest.mark.parametrize("kdn_s,base_s,words", [
    (0.5, 2.0, "KDN was 4.0x faster than a full prefill"),
    (2.0, 1.0, "KDN was 2.0x SLOWER than a full prefill"),
    (1.0, 1.0, "KDN took as long as a full prefill"),
])
def test_comparisons_say_which_side_was_faster_in_plain_words(kdn_s, base_s, words):
    from kdn.engines.transformers.worker import compared
    assert compared(kdn_s, base_s) == words
    with pytest.raises(ModelError, match="must be positive"):
        compared(0.0, base_s)
