"""Pinned conversations at the origin (kdn/origin/conversations.py, ChunkStore's conversation calls):
a pinned tenant's chunks are stored and recorded durably, survive a reopen and collect(), are
read back only by their tenant and namespace, and an unpin or drop deletes them."""
import numpy as np
import pytest

from kdn.core.chunk import Chunk
from kdn.core.conversation import conversation_keys, conversation_namespace
from kdn.core.errors import StoreError
from kdn.origin.conversations import POLICIES, OriginConversations
from kdn.origin.store import ChunkStore


def conversation(tenant="acme", scope="us-east-0", n=3, chunk_tokens=16):
    ns = conversation_namespace(tenant, "fp-1", scope)
    keys = conversation_keys(list(range(100, 100 + n * chunk_tokens)), ns, chunk_tokens)
    return ns, [Chunk(k, ns, np.full((2, 2, 1, chunk_tokens, 4), i, np.float32), "float32")
                for i, k in enumerate(keys)]


def test_pins_and_records_are_durable_and_read_back_per_tenant_and_namespace(tmp_path):
    s = ChunkStore(tmp_path)
    ns, chunks = conversation()
    assert s.conversations.set_pinned("acme", True) and not s.conversations.set_pinned("acme", True)
    s.put_conversation("acme", ns, chunks[:2])
    s.put_conversation("acme", ns, chunks[2:])
    keys = [c.key for c in chunks]
    again = ChunkStore(tmp_path)                                 # a restarted origin
    assert again.conversations.tenants == {"acme"}
    assert again.conversation_prefix("acme", ns, keys) == keys
    assert again.conversations.listing("acme") == {ns.hex(): 3}
    assert again.conversation_prefix("beta", ns, keys) == []     # another tenant: nothing
    other_ns, _ = conversation(scope="us-east-1")
    assert again.conversation_prefix("acme", other_ns, keys) == []
    assert np.array_equal(again.get(keys[1]).kv, chunks[1].kv)
    # collect keeps what a record names, with no manifest naming it
    assert again.collect()["chunks"] == 0 and all(again.has(k) for k in keys)


def test_a_gap_ends_the_prefix_and_a_chunk_of_another_namespace_is_refused(tmp_path):
    s = ChunkStore(tmp_path)
    ns, chunks = conversation(n=4)
    s.conversations.set_pinned("acme", True)
    s.put_conversation("acme", ns, [chunks[0], chunks[2]])
    keys = [c.key for c in chunks]
    assert s.conversation_prefix("acme", ns, keys) == keys[:1]
    other_ns, other = conversation(tenant="beta")
    with pytest.raises(StoreError, match="namespace"):
        s.put_conversation("acme", ns, other[:1])
    assert not s.has(other[0].key)


def test_forgetting_a_tenant_deletes_its_chunks_logs_them_and_spares_the_others(tmp_path):
    s = ChunkStore(tmp_path)
    ns, chunks = conversation()
    beta_ns, beta = conversation(tenant="beta")
    s.conversations.set_pinned("acme", True)
    s.conversations.set_pinned("beta", True)
    s.put_conversation("acme", ns, chunks)
    s.put_conversation("beta", beta_ns, beta)
    head = s.drops.state()["head"]
    assert s.delete_conversation("acme") == 3
    assert s.conversations.policies["acme"]["epoch"] == 1      # its edges resend what they hold
    assert not any(s.has(c.key) for c in chunks) and all(s.has(c.key) for c in beta)
    assert s.drops.state()["head"] == head      # not logged: the home edge's copy is these bytes
    assert s.conversation_prefix("acme", ns, [c.key for c in chunks]) == []
    assert s.conversations.listing("acme") == {} and s.conversations.listing("beta") == {beta_ns.hex(): 3}
    assert s.delete_conversation("acme") == 0
    # beta's records still protect its chunks from collect; with them gone, collect takes them
    s.conversations.forget("beta")
    assert s.collect()["chunks"] == 3


def test_policies_are_checked_durable_and_an_unreadable_file_names_itself(tmp_path):
    from kdn.core.errors import BadRequest
    s = ChunkStore(tmp_path)
    assert s.conversations.set_policy("acme", ttl_s=600, budget_bytes=1 << 20) == {"ttl_s": 600.0,
                                                                                  "budget_bytes": 1 << 20}
    for bad in ({"ttl_s": 0}, {"budget_bytes": -1}, {"pinned": "yes"}, {"colour": 1}):
        with pytest.raises(BadRequest):
            s.conversations.set_policy("acme", **bad)
    s.conversations.set_policy("acme", pinned=True, max_ttl_s=3600)
    again = ChunkStore(tmp_path)                                 # a restarted origin
    assert again.conversations.policies == {"acme": {"ttl_s": 600.0, "budget_bytes": 1 << 20, "pinned": True,
                                                     "max_ttl_s": 3600.0}}
    assert again.conversations.tenants == {"acme"}
    s.objects.put(POLICIES, [b"\xc1 not msgpack"])
    with pytest.raises(StoreError, match="policies.msgpack"):
        OriginConversations(s.objects)
    import msgpack                  # well-formed, but a value no policy may have: named at start
    s.objects.put(POLICIES, [msgpack.packb({"acme": {"budget_bytes": -1}})])
    with pytest.raises(StoreError, match="policies.msgpack .*tenant 'acme'.*budget_bytes"):
        OriginConversations(s.objects)


def test_a_store_that_races_an_unpin_is_refused_and_its_chunks_are_collected(tmp_path):
    """The origin checked the tenant pinned, then an unpin deleted its records: the store
    records nothing after that (a record would keep the keys forever), and collect takes
    what it wrote."""
    from kdn.core.errors import BadRequest
    s = ChunkStore(tmp_path)
    ns, chunks = conversation()
    s.conversations.set_pinned("acme", True)
    s.put_conversation("acme", ns, chunks[:1])
    s.conversations.set_pinned("acme", False)
    assert s.delete_conversation("acme") == 1
    with pytest.raises(BadRequest, match="no longer pinned"):
        s.put_conversation("acme", ns, chunks[1:])
    assert s.conversations.listing("acme") == {}
    assert s.collect()["chunks"] == 2 and not any(s.has(c.key) for c in chunks)
