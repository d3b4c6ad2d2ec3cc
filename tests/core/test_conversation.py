"""kdn/core/conversation.py: namespaces by tenant, model, home edge and salt; keys of whole
chunks only; how far a re-rendered conversation reproduces the computed one; retention."""
import pytest

from kdn.core import conversation as C
from kdn.core.errors import BadRequest
from kdn.core.keys import chunk_keys, namespace_digest


def test_a_conversation_namespace_names_tenant_model_home_and_salt_and_is_never_the_kbs():
    base = C.conversation_namespace("acme", "fp", C.conversation_scope("us-east-0"))
    assert base != namespace_digest("acme", "fp")
    others = [C.conversation_namespace("beta", "fp", C.conversation_scope("us-east-0")),
              C.conversation_namespace("acme", "fp2", C.conversation_scope("us-east-0")),
              C.conversation_namespace("acme", "fp", C.conversation_scope("us-east-1")),
              C.conversation_namespace("acme", "fp", C.conversation_scope("us-east-0", "alice")),
              C.conversation_namespace("beta", "fp", C.conversation_scope("us-east-0", "alice"))]
    assert len({base, *others}) == 6                           # a copied salt in another tenant differs too
    assert C.home_of(C.conversation_scope("us-east-0", "alice")) == "us-east-0"
    assert "alice" not in C.conversation_scope("us-east-0", "alice")   # only the salt's digest travels


def test_a_claim_digests_to_its_namespace_and_nothing_else_does():
    scope = C.conversation_scope("e0", "s")
    ns = C.conversation_namespace("acme", "fp", scope)
    assert C.claims(("acme", "fp", scope), ns)
    assert not C.claims(("beta", "fp", scope), ns)
    assert not C.claims(("acme", "fp"), ns) and not C.claims(None, ns) and not C.claims(("a\0", "fp", scope), ns)


def test_only_whole_chunks_are_keyed_and_they_are_the_chain_of_the_one_key_rule():
    ns = C.conversation_namespace("acme", "fp", "e0")
    tokens = list(range(700))
    keys = C.conversation_keys(tokens, ns)
    assert len(keys) == 2 and keys == chunk_keys(tokens[:512], ns)
    assert C.conversation_keys(tokens[:255], ns) == []
    assert C.first_key(tokens[:255], "acme", "fp", 0) is None
    assert C.first_key(tokens, "acme", "fp", 1) == chunk_keys(tokens[:512], namespace_digest("acme", "fp"))[1]
    assert C.first_key(tokens, "acme", "fp", 2) is None


def test_reproduced_is_the_common_prefix_of_two_renderings():
    assert C.reproduced([1, 2, 3, 4], [1, 2, 3, 4, 5]) == 4
    assert C.reproduced([1, 2, 9, 4], [1, 2, 3, 4]) == 2
    assert C.reproduced([], [1]) == 0


def test_retention_maps_openais_values_within_the_tenants_bounds():
    assert C.retention_ttl(None, 1800) == 1800 and C.retention_ttl("in_memory", 60) == 60
    assert C.retention_ttl("24h", 1800) == 86400 and C.retention_ttl("24h", 1800, 3600) == 3600
    with pytest.raises(BadRequest, match="prompt_cache_retention must be one of in_memory, 24h, got '1h'"):
        C.retention_ttl("1h", 1800)


@pytest.mark.parametrize("bad", ["", 5, "x" * 1025])
def test_a_bad_salt_is_refused_naming_it(bad):
    with pytest.raises(BadRequest, match="cache_salt must be a non-empty string"):
        C.conversation_scope("e0", bad)


def test_a_tail_is_keyed_as_the_partial_chunk_of_the_one_key_rule():
    """tail_key(last whole chunk's key, tokens after it) is chunk_keys' key of that trailing
    partial chunk: one rule, so a tail is exact KV of exactly those tokens; a tail of other
    tokens or another length has another key."""
    ns = C.conversation_namespace("acme", "fp", "us-east-0")
    tokens = list(range(5000, 5000 + 2 * 256 + 40))
    keys = chunk_keys(tokens, ns)
    assert C.tail_key(keys[1], tokens[512:]) == keys[2]
    assert C.tail_key(keys[1], tokens[512:551]) != keys[2]
    assert C.tail_key(keys[1], tokens[513:553]) != keys[2]
    for bad in ([], list(range(256))):
        with pytest.raises(BadRequest, match="tail has 1 to 255 tokens"):
            C.tail_key(keys[1], bad)
