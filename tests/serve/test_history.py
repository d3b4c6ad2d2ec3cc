"""Conversation KV end to end on a real 3-region network with the real model (kdn.serve.chat,
kdn.client.history, kdn/edge/conversations.py): a turn's KV is kept at its home edge after the
answer, the next turn reads it and computes only the rest with greedy tokens identical to a
full prefill, in another region too; tenants and salts never read each other's; an idle TTL
empties it."""
import time

import pytest

from kdn.client import Client
from kdn.client.publish import publish_documents
from kdn.core.errors import AccessDenied
from kdn.serve.chat import Chat, stream

ADMIN = "admin-secret-0123456789abcdef"
ACME, BETA = "acme-read-token-0123456789", "beta-read-token-0123456789"
TOOL = " ".join(f"Row {i}: sensor {i % 7} read {20 + i % 13} degrees at {i % 24}:00." for i in range(40))
KB_TEXT = " ".join(f"Section {i} of the handbook says badge {i} opens door {100 + i}." for i in range(30))


@pytest.fixture(scope="module")
def net(small_network, model):
    n = small_network(auth={"admin": ADMIN, "readers": {"acme": ACME, "beta": BETA}},
                      capacity_bytes=128 << 20, timeout_s=240)
    admin = Client(network=n.name, region="us-east", tenant="acme", fingerprint=model.fingerprint,
                   admin_token=ADMIN)
    publish_documents(admin, model, "handbook", [("handbook.md", KB_TEXT)])
    return n


def chat(net, model, tenant="acme", token=ACME, region="us-east"):
    return Chat(model, Client(network=net.name, region=region, tenant=tenant,
                              fingerprint=model.fingerprint, token=token))


def answer(c, turn, max_tokens=12):
    steps = list(c.stream(turn.prompt, turn.cache, turn.cached, max_tokens))
    return [s.token for s in steps if s.token is not None], "".join(s.text for s in steps)


def full_prefill(model, prompt, max_tokens=12):
    return [s.token for s in stream(model, prompt, None, 0, max_tokens) if s.token is not None]


def two_turns(c, manifest=None, salt=None):
    """Turn 1 answered and kept; the messages of turn 2 (history, answer, a new question)."""
    first = [{"role": "user", "content": "Here is the tool output:\n" + TOOL + "\nWhich sensor is warmest?"}]
    t1 = c.begin(manifest, first, 12, salt=salt)
    tokens, text = answer(c, t1)
    kept = c.keep(t1, tokens, text)
    second = first + [{"role": "assistant", "content": text},
                      {"role": "user", "content": "And which is coldest? One word."}]
    return t1, kept, second


def test_a_plain_chats_next_turn_reads_the_history_and_answers_as_a_full_prefill(net, model):
    c = chat(net, model)
    t1, kept, second = two_turns(c)
    assert t1.cached == 0 and kept["chunks"] == len(t1.prompt) // 256 >= 2
    t2 = c.begin(None, second, 12)
    assert t2.history.get("fetched") and t2.history["region"] == "us-east", (c.history.counters, c.counters)
    # the whole history the answer reproduces, its tail (the last partial chunk) too: only the
    # new turn is computed
    assert t2.history["tail"] > 0 and t2.cached == kept["tokens"] >= len(t1.prompt)
    tokens, _ = answer(c, t2)
    assert tokens == full_prefill(model, t2.prompt)
    assert c.counters["history_hits"] == 1 and c.counters["cached_tokens"] == t2.cached


def test_a_kbs_conversation_keeps_only_its_own_chunks_after_the_kbs(net, model):
    c = chat(net, model)
    m = c.client.manifest("handbook")
    t1, kept, second = two_turns(c, m)
    kb_whole = len(m.token_ids()) // 256
    assert t1.cached == len(m.token_ids())                       # the KB from KDN, as before
    assert kept["chunks"] == len(t1.prompt) // 256 - kb_whole >= 1
    t2 = c.begin(m, second, 12)
    assert t2.cached == kept["tokens"] >= len(t1.prompt) > len(m.token_ids())
    tokens, _ = answer(c, t2)
    assert tokens == full_prefill(model, t2.prompt)


def test_a_replica_continues_from_its_own_engine_cache_unless_an_edge_holds_more(net, model):
    """Chat.conversation_kv (what a kdn serve replica keeps): the next turn on the replica that
    answered the last one starts from the exact tokens it left (no partial chunk recomputed,
    nothing fetched), answers as a full prefill does, and still sends the new whole chunks to
    the home edge; a replica whose cache is behind what the edge holds reads the edge."""
    from kdn.serve.router import EngineKV
    Client(network=net.name, region="us-east", tenant="acme", admin_token=ADMIN).drop_conversations()
    a, b = chat(net, model), chat(net, model)      # (the edges' 64 MiB for conversations: ~5 chunks)
    a.conversation_kv, b.conversation_kv = EngineKV(1 << 30), EngineKV(1 << 30)
    first = [{"role": "user", "content": "Tool output:\n" + TOOL + "\nWhich sensor is warmest? (local)"}]
    t1 = a.begin(None, first, 12, salt="local", conversation="open:local")
    tokens, text = answer(a, t1)
    kept = a.keep(t1, tokens, text)
    assert len(a.conversation_kv.entries) == 1 and kept["chunks"] >= 2
    second = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "And the coldest?"}]
    t2 = a.begin(None, second, 12, salt="local", conversation="open:local")
    assert t2.history.get("engine") and a.counters["conversation_engine_hits"] == 1
    assert kept["tokens"] // 256 * 256 < t2.cached < len(t2.prompt), "past the last whole chunk: the exact tokens"
    tokens2, text2 = answer(a, t2)
    assert tokens2 == full_prefill(model, t2.prompt)
    a.keep(t2, tokens2, text2)                  # only whole chunks no edge holds are sent
    assert a.history.held_here(t2.prompt, 0, "local") == len(t2.prompt) // 256, "the edge has them all"
    # another salt or another conversation name finds nothing of it on this replica
    assert not a.begin(None, second, 12, salt="other", conversation="open:local").history.get("engine")
    # b answers turn 3 (from the edge); a's cache of turn 2 is then behind the edge's
    third = second + [{"role": "assistant", "content": text2},
                      {"role": "user", "content": "More output:\n" + TOOL + "\nWhy?"}]
    t3 = b.begin(None, third, 12, salt="local", conversation="open:local")
    assert t3.history.get("fetched") and not t3.history.get("engine")
    tokens3, text3 = answer(b, t3)
    b.keep(t3, tokens3, text3)
    fourth = third + [{"role": "assistant", "content": text3}, {"role": "user", "content": "Sure?"}]
    t4 = a.begin(None, fourth, 12, salt="local", conversation="open:local")
    assert b.history.counters["stored_chunks"] >= 2                 # b's turn added chunks: a is behind
    assert t4.history.get("fetched") and a.counters["conversation_engine_behind"] == 1
    tokens4, text4 = answer(a, t4)
    assert tokens4 == full_prefill(model, t4.prompt)
    # an operator's drop at the edges lets go of the replica's copy too
    a.keep(t4, tokens4, text4)
    assert len(a.conversation_kv.entries) == 1
    Client(network=net.name, region="us-east", tenant="acme", admin_token=ADMIN).drop_conversations()
    t5 = a.begin(None, fourth, 12, salt="local", conversation="open:local")
    assert t5.cached == 0 and a.counters["conversation_engine_gone"] == 1


def test_another_region_reads_the_history_across_and_answers_the_same(net, model):
    home = chat(net, model, region="us-east")
    _, kept, second = two_turns(home, salt="across")
    away = chat(net, model, region="ap-south")
    t2 = away.begin(None, second, 12, salt="across", hints=("us-east",))
    assert t2.history == {"region": "us-east", "edge": kept["edge"], "fetched": True,
                          "chunks": kept["chunks"], "tail": kept["tokens"] % 256}
    assert t2.history["tail"] > 0 and t2.cached == kept["tokens"]
    tokens, text = answer(away, t2)
    assert tokens == full_prefill(model, t2.prompt)
    # the conversation moved: its whole history is kept at this region's home now, so the
    # next turn here reads all of it from its own region
    moved = away.keep(t2, tokens, text)
    assert moved["chunks"] >= kept["chunks"] and moved["edge"].startswith("ap-south")
    third = second + [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks."}]
    t3 = away.begin(None, third, 12, salt="across", hints=("us-east",))
    assert t3.history["region"] == "ap-south" and t3.cached == moved["tokens"] >= t2.cached


def test_no_tenant_and_no_salt_reads_another_ones_history(net, model):
    acme = chat(net, model)
    _, kept, second = two_turns(acme, salt="alice")
    assert kept["chunks"] >= 2
    assert chat(net, model).begin(None, second, 12, salt="alice").cached == kept["tokens"]
    assert chat(net, model).begin(None, second, 12, salt="bob").cached == 0          # another salt
    assert chat(net, model).begin(None, second, 12).cached == 0                       # no salt
    beta = chat(net, model, tenant="beta", token=BETA)
    assert beta.begin(None, second, 12, salt="alice").cached == 0    # a copied salt, another token
    # beta's token naming acme's conversation is refused by the home edge itself
    found = acme.history.find(second and acme.begin(None, second, 12, salt="alice").prompt, 0, "alice")
    with pytest.raises(AccessDenied):
        beta.client.view.at(found.edge).conversation_lookup(found.keys, found.ns, "acme", model.fingerprint, found.scope, token=BETA)


def test_an_idle_ttl_empties_the_home_edge(net, model):
    c = chat(net, model)
    _, kept, second = two_turns(c, salt="short-lived")
    view = c.client.view
    view.at(kept["edge"]).set_conversation_policy("acme", ttl_s=1.0, token=ADMIN)
    time.sleep(2.5)                                                  # past the TTL; the edge sweeps each second
    held = view.at(kept["edge"]).conversations_of("acme", token=ADMIN)
    assert held["conversations"] == [] and held["policy"]["ttl_s"] == 1.0
    assert chat(net, model).begin(None, second, 12, salt="short-lived").cached == 0
    view.at(kept["edge"]).set_conversation_policy("acme", ttl_s=1800.0, token=ADMIN)




def test_a_pinned_tenants_conversation_outlives_its_home_edges_copy(net, model):
    """Client.pin_conversations (kdn/origin/conversations.py): pinned midway, the home edge sends
    the origin the new chunks and the conversation's start; when the edge no longer holds
    them (its TTL, an eviction or a restart: here an edge-level drop) the next turn still reads
    the whole history, pulled back from the origin, and answers as a full prefill. Another
    tenant's copied salt reads nothing; unpinning deletes the origin's copies."""
    ops = Client(network=net.name, region="us-east", tenant="beta", admin_token=ADMIN)
    c = chat(net, model, tenant="beta", token=BETA)
    t1, kept1, second = two_turns(c, salt="agent-7")                 # kept before the pin: edge only
    second[-1] = {"role": "user", "content": "More output:\n" + TOOL + "\nAnd now?"}   # whole chunks more
    assert ops.pinned_conversations() == {"pinned": False, "chunks": {}}
    pinned = ops.pin_conversations()
    assert pinned["pinned"] and all(e["pinned"] for e in pinned["edges"])
    try:
        t2 = c.begin(None, second, 12, salt="agent-7")
        tokens2, text2 = answer(c, t2)
        kept2 = c.keep(t2, tokens2, text2)
        assert kept2["chunks"] >= 1 and kept2["edge"] == kept1["edge"], (kept2, c.history.counters, t2.history)
        whole = kept1["chunks"] + kept2["chunks"]
        assert sum(ops.pinned_conversations()["chunks"].values()) == whole   # the start went too
        ops.view.at(kept1["edge"]).drop_conversations("beta", token=ADMIN)   # the edge's copy only
        assert ops.view.at(kept1["edge"]).conversations_of("beta", token=ADMIN)["conversations"] == []
        third = second + [{"role": "assistant", "content": text2}, {"role": "user", "content": "Which is next?"}]
        t3 = c.begin(None, third, 12, salt="agent-7")
        home = ops.view.at(kept1["edge"])
        for _ in range(40):     # on a loaded machine the origin's read may outlast the lookup's
            if t3.cached == whole * 256:    # wait: the pull goes on and lands for the next turn
                break
            assert home.stats(token=ADMIN)["counters"].get("conversation_pull_late", 0) >= 1, t3.history
            time.sleep(0.5)
            t3 = c.begin(None, third, 12, salt="agent-7")
        assert t3.history.get("fetched") and t3.cached == whole * 256, (t3.history, c.history.counters)
        tokens3, _ = answer(c, t3)
        assert tokens3 == full_prefill(model, t3.prompt)
        assert chat(net, model).begin(None, third, 12, salt="agent-7").cached == 0    # acme, copied salt
    finally:
        unpinned = ops.pin_conversations(pinned=False)
    assert not unpinned["pinned"] and unpinned["deleted"] == whole
    assert ops.pinned_conversations() == {"pinned": False, "chunks": {}}
    ops.drop_conversations()


def test_an_operator_lists_sets_and_drops_a_tenants_conversations(net, model, ray_cluster, kdn_cli,
                                                                   monkeypatch):
    """Python (Client.conversations, set_conversation_policy, drop_conversations) and the CLI
    (`kdn conversations`): the chunks kept are listed at their home edge, a budget and TTL
    apply on every edge, a drop empties them, and a bad value is refused before anything."""
    import json
    c = chat(net, model)
    _, kept, second = two_turns(c, salt="operated")
    ops = Client(network=net.name, region="us-east", tenant="acme", admin_token=ADMIN)
    home = next(e for e in ops.conversations() if e["edge"] == kept["edge"])
    assert sum(cv["chunks"] for cv in home["conversations"]) >= kept["chunks"]
    set_ = ops.set_conversation_policy(ttl_s=600, budget_bytes=512 << 20)
    assert {e["edge"] for e in set_} == set(net.edges) and all(e["ttl_s"] == 600 for e in set_)
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    where = ["--address", ray_cluster.address, "--network", net.name, "--tenant", "acme"]
    rc, out = kdn_cli("conversations", *where, "--json")
    assert rc == 0 and all(e["policy"]["budget_bytes"] == 512 << 20 for e in json.loads(out)["edges"])
    assert json.loads(out)["origin"] == {"pinned": False, "chunks": {}}
    rc, out = kdn_cli("status", "--address", ray_cluster.address, "--network", net.name)
    assert "conversation KV by tenant: acme " in out and "conversations" in out, out
    rc, out = kdn_cli("conversations", *where, "--drop")
    assert rc == 0 and out.startswith("dropped ") and "conversation chunks of tenant 'acme'" in out
    assert all(e["conversations"] == [] for e in ops.conversations())
    assert chat(net, model).begin(None, second, 12, salt="operated").cached == 0
    assert kdn_cli("conversations", *where, "--budget", "lots")[0] == 2
    ops.set_conversation_policy(ttl_s=1800, budget_bytes=1 << 30)
    rc, out = kdn_cli("conversations", *where, "--pin")
    assert rc == 0 and "tenant 'acme': conversation KV pinned at the origin" in out
    assert "pinned at the origin: yes, 0 chunks in 0 namespaces" in out
    rc, out = kdn_cli("conversations", *where, "--unpin", "--json")
    assert rc == 0 and json.loads(out.splitlines()[-1])["origin"] == {"pinned": False, "chunks": {}}
    assert not any(e["policy"]["pinned"] for e in json.loads(out.splitlines()[-1])["edges"])
    with pytest.raises(SystemExit) as refused:                  # argparse: one or the other
        kdn_cli("conversations", *where, "--pin", "--unpin")
    assert refused.value.code == 2
