"""The catalog: manifests, checksums, and who may read which namespace (same refusal for a
wrong token and an unknown namespace; the origin asked at most once a period)."""
import asyncio

import pytest

from kdn.core.auth import Tokens
from kdn.edge.catalog import LEARN_PERIOD_S, Catalog
from kdn.edge.peers import Peers
from kdn.core.errors import AccessDenied
from kdn.core.keys import namespace_digest

ADMIN = "admin-token-0123456789abcdef"
ACME = "acme-read-token-0123456789"


class Origin:
    """Stands in for Peers: answers `manifests` from a list, records each ask."""

    def __init__(self, manifests=()):
        self.manifests, self.asked = list(manifests), []

    origin, edge = Peers.origin, Peers.edge        # stubs over ask(), as an edge's Peers has

    async def ask(self, node, method, *args, timeout=None, **kw):
        self.asked.append((node, method) + args)
        await asyncio.sleep(0.01)
        if method == "manifests":
            ns = args[0] if args else None
            return [m for m in self.manifests
                    if ns is None or namespace_digest(m["tenant"], m["fingerprint"]) == ns]
        raise AssertionError(method)


def _manifest(tenant, name="kb", version=1, keys=(b"k" * 16,), sums=(7,)):
    return {"tenant": tenant, "fingerprint": "fp", "name": name, "version": version,
            "keys": list(keys), "sums": list(sums)}


def _catalog(origin=None, readers=None, admin=ADMIN):
    return Catalog(Tokens(admin, readers if readers is not None else {"acme": ACME}), origin or Origin())


def test_manifests_give_checksums_namespaces_and_tenants():
    c = _catalog()
    c.add(_manifest("acme"))
    ns = namespace_digest("acme", "fp")
    assert c.sum_of(b"k" * 16) == 7 and c.ns_of(b"k" * 16) == ns and c.sum_of(b"x" * 16) is None
    assert c.listed("acme", "fp")[0]["name"] == "kb" and c.listed("other", "fp") == []
    assert c.drop(ns, "kb", 1) == 1 and c.listed("acme", "fp") == []
    assert c.sum_of(b"k" * 16) == 7, "checksums stay: another version may share the chunk"


def test_the_admin_reads_a_namespace_nothing_is_published_under_yet():
    """A publisher's reuse fetch of a brand-new KB (issue 13.1): no AccessDenied."""
    origin = Origin()
    c = _catalog(origin)
    asyncio.run(c.check_read(namespace_digest("gamma", "fp"), ADMIN, "fetch"))
    assert origin.asked == [], "the admin needs no lookup"


def test_a_wrong_token_and_an_unknown_namespace_get_the_same_refusal():
    c = _catalog(Origin([_manifest("acme")]))
    messages = []
    for ns, token in [(namespace_digest("acme", "fp"), None),
                      (namespace_digest("acme", "fp"), "wrong-token-0123456789"),
                      (namespace_digest("nobody", "fp"), None),
                      (namespace_digest("nobody", "fp"), ACME)]:
        with pytest.raises(AccessDenied) as e:
            asyncio.run(c.check_read(ns, token, "fetch"))
        messages.append(str(e.value))
    assert len(set(messages)) == 1 and "read token" in messages[0]
    assert c.counters["reads_refused"] == 4
    asyncio.run(c.check_read(namespace_digest("acme", "fp"), ACME, "fetch"))
    asyncio.run(c.check_read(namespace_digest("acme", "fp"), ADMIN, "fetch"))


def test_unknown_namespaces_ask_the_origin_at_most_once_a_period():
    origin = Origin()
    c = _catalog(origin)

    async def many():
        return await asyncio.gather(*(c.check_read(namespace_digest(f"t{i}", "fp"), None, "fetch")
                                      for i in range(20)), return_exceptions=True)

    got = asyncio.run(many())
    assert all(isinstance(r, AccessDenied) for r in got)
    assert asyncio.run(many()) and len(origin.asked) == 1, origin.asked
    assert c.counters["manifest_refreshes"] == 1
    c._learned_at -= LEARN_PERIOD_S            # a period later: one more ask
    origin.manifests.append(_manifest("t3"))
    with pytest.raises(AccessDenied):          # t3 has no read token: nobody's to read without one
        asyncio.run(c.check_read(namespace_digest("t3", "fp"), None, "fetch"))
    assert len(origin.asked) == 2


def test_without_read_tokens_everyone_reads_and_without_an_admin_token_nobody_is_admin():
    origin = Origin()
    asyncio.run(_catalog(origin, readers={}).check_read(namespace_digest("x", "fp"), None, "fetch"))
    c = _catalog(origin, admin=None)
    assert not c.tokens.is_admin(None) and not c.tokens.is_admin(ADMIN)
    with pytest.raises(AccessDenied):
        asyncio.run(c.check_read(namespace_digest("x", "fp"), None, "fetch"))


def test_listing_checks_the_tenant_and_falls_back_to_the_broadcast_copy():
    class Down(Origin):
        async def ask(self, *a, **kw):
            return None
    c = _catalog(Down())
    c.add(_manifest("acme"))
    assert [m["name"] for m in asyncio.run(c.list("acme", "fp", ACME))] == ["kb"]
    with pytest.raises(AccessDenied, match="read token"):
        asyncio.run(c.list("acme", "fp", None))
    up = _catalog(Origin([_manifest("acme", version=2)]))
    assert [m["version"] for m in asyncio.run(up.list("acme", "fp", ACME))] == [2]
    assert up.listed("acme", "fp")[0]["version"] == 2, "what the origin lists is kept"


def test_a_claim_that_digests_to_the_namespace_names_its_tenant_without_a_manifest():
    """Objects of another cache layer (no manifest): the reader names (tenant, fingerprint);
    a claim is checked by its digest, and still needs that tenant's read token."""
    origin = Origin()
    c = _catalog(origin)
    ns = namespace_digest("acme", "lmcache/m")
    asyncio.run(c.check_read(ns, ACME, "fetch", ("acme", "lmcache/m")))
    assert origin.asked == [] and c.ns_tenant[ns] == "acme"      # learned, no origin call
    other = namespace_digest("acme", "lmcache/other")
    for claim, token in [(("acme", "lmcache/m"), ACME),           # digests another namespace
                         (("acme", "lmcache/other"), None),       # the right claim, no token
                         (("beta", "lmcache/other"), ACME),       # a lie: digests nothing here
                         (("acme\0", "x"), ACME), ("acme", ACME)]:  # malformed
        with pytest.raises(AccessDenied, match="read token"):
            asyncio.run(c.check_read(other, token, "fetch", claim))
    assert other not in c.ns_tenant
