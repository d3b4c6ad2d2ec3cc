"""An unmodified vLLM reads knowledge KV from KDN, end to end, on the real 3-region network.

Two vLLM engines (CPU build, SmolLM2-135M-Instruct, KDNConnector loaded by configuration),
each in a Ray actor on a region's node: one in us-east with role kv_both (it publishes the KV
vLLM computes), one in eu-west reading only. They are the only two engine start-ups of the
module. Every answer through KDN is compared with vLLM's own full prefill of the same prompt
(prefix cache skipped): the greedy tokens must be identical, for KBs of 644 tokens (the Bill
of Rights: two full chunks and a partial one) and 1,504 tokens (three documents: five full
chunks and a partial one), and the connector must report matching exactly what the KB covers.
(The README's KB of every bundled document, 4,520 tokens, goes through vLLM in its own vLLM
blocks, KDN_README_ALL=1 in tests/test_readme.py: the mechanics here are the same at a third of
the prefill.) Then tenants (a request's
cache salt reaches only its tenant) and faults (an edge killed during a stream of requests,
an edge hung, a corrupt copy): the answer is still the full prefill's, within a deadline.
Both engines keep conversations (`conversations`): a plain chat's next turn reads its history
from KDN, in the engine that answered it and in the other region's, token-identical to vLLM
alone.
"""
import os
import signal
import threading
import time

import pytest
import ray

try:
    import vllm  # noqa: F401
except (ImportError, RuntimeError) as e:   # a broken install (media packages built for another torch) raises RuntimeError
    pytest.skip(f"vLLM is not importable ({type(e).__name__}: {e}); install the vllm extra (README)",
                allow_module_level=True)

from kdn.launch.cluster import start_network, stop_network
from kdn.engines.vllm.run import EngineWorker
from kdn.cli.knowledge import bundled_documents
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
NEW_TOKENS = 12
DEADLINES = {"lookup_deadline_s": 2.0, "fetch_deadline_s": 4.0}
TENANTS = {"salt-acme": "acme", "salt-globex": "globex"}
THREE = ("constitution-article-iii", "bill-of-rights", "gettysburg-address")
Q = "Which amendment protects the freedom of speech, and what else does it protect?"


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=600 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("origin"), network="vllm-e2e",
                      edge_options={"fault_injection": True})
    yield n
    stop_network(n)


@pytest.fixture(scope="module")
def engines(net):
    """{region: EngineWorker actor}: us-east publishes (kv_both), eu-west reads, copying
    layer by layer beside the forward (us-east copies all layers first)."""
    cls = ray.remote(num_cpus=1)(EngineWorker)
    made = {}
    for region, role, layerwise in (("us-east", "kv_both", False), ("eu-west", "kv_consumer", True)):
        made[region] = cls.options(label_selector={"region": region}).remote(
            role, network=net.name, region=region, tenants=TENANTS, layerwise=layerwise,
            conversations=True, **DEADLINES)
    ray.get([a.fingerprint.remote() for a in made.values()], timeout=600)   # both started
    yield made
    for a in made.values():
        ray.kill(a)


@pytest.fixture(scope="module")
def published(net, engines):
    """KBs published through vLLM: bill (644 tokens), three (1,504: Article III, the Bill of
    Rights and the Gettysburg Address), acme's secret."""
    docs = dict(bundled_documents())
    pub = engines["us-east"]
    receipts = {
        "bill": ray.get(pub.publish.remote("bill", [("bill-of-rights", docs["bill-of-rights"])]), timeout=600),
        "three": ray.get(pub.publish.remote("three", [(n, docs[n]) for n in THREE]), timeout=900),
        "secret": ray.get(pub.publish.remote("secret", [("gettysburg", docs["gettysburg-address"])],
                                             salt="salt-acme"), timeout=600),
    }
    return receipts


def _args(net, region, tenant="default"):
    return {"network": net.name, "region": region, "tenant": tenant}


def _full(engine, prompt, salt=None):
    """vLLM's own full prefill of the prompt (its prefix cache, and so KDN, skipped)."""
    return ray.get(engine.generate.remote(prompt, NEW_TOKENS, salt=salt, full=True), timeout=600)


def test_publishing_through_vllm_stores_the_kv_vllm_computed(published):
    bill, three = published["bill"], published["three"]
    assert (bill["tokens"], bill["chunks"], bill["version"], bill["engine"]) == (644, 3, 1, "vllm")
    assert (three["tokens"], three["chunks"]) == (1504, 6)
    assert three["sent_chunks"] == 6 and three["documents"] == list(THREE)


@pytest.mark.parametrize("kb,tokens", [("bill", 644), ("three", 1504)])
def test_answers_through_kdn_are_token_identical_to_vllm_alone_in_two_regions(net, engines, published,
                                                                              kb, tokens):
    east, west = engines["us-east"], engines["eu-west"]
    a = ray.get(east.query.remote(_args(net, "us-east"), kb, Q, max_tokens=NEW_TOKENS,
                                  forget_local=True), timeout=900)
    assert a["identical"], f"{kb}: {a['tokens']} != {a['baseline_tokens']}"
    b = ray.get(west.query.remote(_args(net, "eu-west"), kb, Q, max_tokens=NEW_TOKENS,
                                  forget_local=True, check=False), timeout=900)
    assert b["tokens"] == a["baseline_tokens"], "vLLM in another region, KV from its own edge"
    for got, edge in ((a, "us-east-0"), (b, "eu-west-0")):
        k = got["kdn"]
        # the whole KB, its trailing partial chunk included, and nothing of the question
        assert (k["held"], k["local"], k["external"], k["loaded"]) == (tokens, 0, tokens, tokens), k
        assert k["kb"] == kb and k["edge"] == edge and k["error"] is None
    assert a["prompt_tokens"] > tokens


def test_vllm_prefix_cache_keeps_working_beside_kdn(net, engines, published):
    west = engines["eu-west"]
    prompt = ray.get(west.prompt.remote(_args(net, "eu-west"), "bill", Q))
    first = ray.get(west.generate.remote(prompt, NEW_TOKENS, forget_local=True), timeout=600)
    again = ray.get(west.generate.remote(prompt, NEW_TOKENS), timeout=600)
    assert first["kdn"]["external"] == 644
    # the second time vLLM's own blocks hold the KB (5 full blocks of 128): KDN has 4 tokens
    # left to add, below min_tokens, so vLLM computes them with the question
    assert (again["kdn"]["local"], again["kdn"]["external"]) == (640, 0)
    assert again["tokens"] == first["tokens"] == _full(west, prompt)["tokens"]


def test_a_cache_salt_reads_only_its_own_tenant(net, engines, published):
    west = engines["eu-west"]
    prompt = ray.get(west.prompt.remote(_args(net, "eu-west", "acme"), "secret", Q))
    acme = ray.get(west.generate.remote(prompt, NEW_TOKENS, salt="salt-acme", forget_local=True))
    assert acme["kdn"]["tenant"] == "acme" and acme["kdn"]["held"] == 348
    for salt, tenant in (("salt-globex", "globex"), (None, "default"), ("salt-unknown", None)):
        other = ray.get(west.generate.remote(prompt, NEW_TOKENS, salt=salt, forget_local=True))
        assert other["kdn"]["tenant"] == tenant
        assert other["kdn"].get("held", 0) == 0 and other["kdn"].get("external", 0) == 0, salt
        assert other["tokens"] == acme["tokens"], "without the KV, vLLM computes the same answer"
    assert acme["tokens"] == _full(west, prompt, salt="salt-acme")["tokens"]


def test_kv_published_by_the_other_engine_is_never_read(net, engines, published):
    """vLLM reads under its own fingerprint: transformers-published KV of the same weights
    is in another namespace (cross-engine agreement is measured by kdn bench vllm --cross)."""
    from kdn.client import Client
    from kdn.engines.transformers.model import load_model
    from kdn.client.publish import publish_documents
    model = load_model()
    docs = dict(bundled_documents())
    cl = Client(network=net.name, region="us-east", fingerprint=model.fingerprint)
    publish_documents(cl, model, "tf-gettysburg", [("g", docs["gettysburg-address"])])
    west = engines["eu-west"]
    assert ray.get(west.fingerprint.remote()) != model.fingerprint
    prompt = cl.manifest("tf-gettysburg").token_ids().tolist() + model.question_tokens(Q)
    got = ray.get(west.generate.remote(prompt, NEW_TOKENS, forget_local=True), timeout=600)
    k = got["kdn"]
    # no KB matched; what KDN holds of the prompt, if anything, is vLLM's own conversation KV
    # (an earlier test's prompt began with the same document, and its answer was kept)
    assert k.get("kb") is None and k.get("held", 0) == 256 * k.get("history", {}).get("chunks", 0), k


def test_a_corrupt_copy_at_the_edges_is_refetched_and_the_answer_is_unchanged(net, engines, published):
    from kdn.client import Client
    west = engines["eu-west"]
    fp = ray.get(west.fingerprint.remote())
    m = Client(network=net.name, region="eu-west", fingerprint=fp).manifest("bill")
    prompt = ray.get(west.prompt.remote(_args(net, "eu-west"), "bill", Q))
    want = _full(west, prompt)["tokens"]
    edges = [net.edge(e) for e in ("us-east-0", "eu-west-0", "ap-south-0")]
    hit = [e for e in edges if ray.get(e.inject_corruption.remote(m.keys[1]))]
    assert hit, "some edge holds the KB's second chunk"
    r = ray.get(west.generate.remote(prompt, NEW_TOKENS, forget_local=True), timeout=120)
    assert r["tokens"] == want and r["kdn"]["loaded"] == 644
    reported = sum(ray.get(e.stats.remote())["counters"].get("corrupt_reported", 0) for e in hit)
    assert reported >= 1, "the reader caught a corrupt copy and told its holder"


def _pid(net, edge):
    return ray.get(net.edge(edge).ping.remote(), timeout=30)["pid"]


def test_an_edge_killed_during_a_stream_of_requests_changes_no_answer(net, engines, published):
    west = engines["eu-west"]
    prompt = ray.get(west.prompt.remote(_args(net, "eu-west"), "bill", Q))
    want = _full(west, prompt)["tokens"]
    got, errors, stop = [], [], threading.Event()

    def stream():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = ray.get(west.generate.remote(prompt, NEW_TOKENS, forget_local=True), timeout=120)
                got.append((r, t0, time.monotonic() - t0))
            except Exception as e:  # noqa: BLE001 - counted: the test asserts there are none
                errors.append(repr(e))

    t = threading.Thread(target=stream)
    t.start()
    while not got and t.is_alive():
        time.sleep(0.1)
    time.sleep(0.3)                                            # a request is in flight
    killed = time.monotonic()
    os.kill(_pid(net, "eu-west-0"), signal.SIGKILL)            # a crash, not a polite stop
    time.sleep(8.0)
    stop.set()
    t.join(180)
    assert errors == []
    after = [(r, s) for r, t0, s in got if t0 + s > killed]    # in flight at the kill, or later
    assert len(after) >= 2, f"only {len(after)} requests ran across the kill"
    assert all(r["tokens"] == want for r, _, _ in got), "every answer is the full prefill's"
    assert max(s for _, s in after) < 30, "no request waits for Ray's node-death detection"
    # each one either loaded the KB (from the restarted edge or another) or computed it
    assert all(r["kdn"].get("loaded", 0) in (0, 644) or r["kdn"].get("failed_from") is not None
               for r, _ in after)


def test_a_hung_edge_costs_at_most_the_deadline_and_the_answer_is_unchanged(net, engines, published):
    west = engines["eu-west"]
    prompt = ray.get(west.prompt.remote(_args(net, "eu-west"), "bill", Q))
    want = _full(west, prompt)["tokens"]
    pid = _pid(net, "eu-west-0")
    os.kill(pid, signal.SIGSTOP)                               # alive to Ray, answers nothing
    try:
        t0 = time.monotonic()
        r = ray.get(west.generate.remote(prompt, NEW_TOKENS, forget_local=True), timeout=120)
        took = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r["tokens"] == want
    # the lookup gives up after its 2 s deadline (vLLM computes the prompt), or another edge
    # answers after the stopped one times out; never a hang
    assert took < 2.0 + 4.0 + 20, took
    assert r["kdn"].get("held", 0) == 0 or r["kdn"].get("edge") != "eu-west-0"


# --- conversations ----------------------------------------------------------------------
TOOL = " ".join(f"Row {i}: sensor {i % 7} read {20 + i % 13} degrees at {i % 24}:00." for i in range(40))
FIRST = [{"role": "user", "content": "Here is the tool output:\n" + TOOL + "\nWhich sensor is warmest?"}]


@pytest.fixture(scope="module")
def conversation(engines):
    """Turn 1 of a plain chat answered by us-east's engine (its prefix cache emptied first),
    and kept; the messages of turn 2, and vLLM's own full prefill of turn 2's prompt."""
    east = engines["us-east"]
    t1 = ray.get(east.converse.remote(FIRST, NEW_TOKENS, forget_local=True), timeout=600)
    second = FIRST + [{"role": "assistant", "content": t1["text"]},
                      {"role": "user", "content": "And which is coldest? One word."}]
    full = ray.get(east.converse.remote(second, NEW_TOKENS, full=True), timeout=600)
    return t1, second, full


def test_a_plain_chats_next_turn_reads_its_history_from_kdn_and_answers_as_vllm_alone(engines, conversation):
    t1, second, full = conversation
    whole = len(t1["prompt"]) // 256
    computed = len(t1["prompt"]) + len(t1["tokens"]) - 1      # the last token sampled has no KV
    assert whole >= 3 and t1["kdn"]["keep"] == {"from_chunk": 0, "chunks": computed // 256}, t1["kdn"]
    assert t1["limit"] >= len(t1["prompt"]), "the next prompt reproduces the prompt and the answer"
    assert t1["kept"]["chunks"] == min(t1["limit"], computed) // 256 >= whole, t1["kept"]
    assert t1["kept"]["edge"] == "us-east-0" and t1["kept"]["held"] == 0
    east = engines["us-east"]
    t2 = ray.get(east.converse.remote(second, NEW_TOKENS, forget_local=True), timeout=600)
    k = t2["kdn"]
    assert k["local"] == 0 and k["loaded"] == k["external"] >= whole * 256, k
    assert k["history"] == {"region": "us-east", "edge": "us-east-0", "chunks": k["history"]["chunks"],
                            "fetched": True} and k["history"]["chunks"] >= whole, k
    assert t2["cached"] == k["loaded"] and t2["tokens"] == full["tokens"]
    # turn 2 kept only the chunks after the ones turn 1 left at the home edge
    assert t2["kept"]["held"] == k["history"]["chunks"], t2["kept"]
    # vLLM's own prefix cache still serves the engine that computed it: nothing asked of KDN
    again = ray.get(east.converse.remote(second, 1), timeout=600)
    assert again["kdn"]["local"] >= whole * 256 and again["kdn"]["external"] == 0
    assert "history" not in again["kdn"]


def test_a_conversation_kept_by_one_vllm_engine_is_read_by_another_in_another_region(engines, conversation):
    t1, second, full = conversation
    west = engines["eu-west"]
    t2 = ray.get(west.converse.remote(second, NEW_TOKENS, forget_local=True,
                                      conversation={"hints": ["us-east"]}), timeout=600)
    k = t2["kdn"]
    assert k["history"]["region"] == "us-east" and k["history"]["fetched"], k
    assert k["loaded"] >= len(t1["prompt"]) // 256 * 256 and k["history_from"] == "us-east-0", k
    assert t2["tokens"] == full["tokens"]
    assert t2["kept"]["edge"] == "eu-west-0" and t2["kept"]["held"] == 0, f"kept at home in eu-west: {t2['kept']}"
    # a salt narrows it: neither KDN's conversation nor vLLM's own cache is shared across salts
    other = ray.get(west.converse.remote(second, 1, salt="|someone-else"), timeout=600)
    assert other["kdn"]["local"] == 0 and other["kdn"].get("external", 0) == 0, other["kdn"]
