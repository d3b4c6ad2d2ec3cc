"""What an edge knows of the published knowledge bases, and who may read which namespace.

The origin broadcasts every committed manifest to every edge, so reads survive an origin
outage. From them an edge knows each chunk's namespace and checksum (what verification
compares against) and each namespace's tenant (what a read token is checked against).

Read auth: with read tokens configured, a read of a namespace needs its tenant's read token
or the admin token. The admin passes even for a namespace nothing is published under yet (a
publisher's reuse fetch of a brand-new KB gets an empty prefix, not a refusal). Anyone else
asking for a namespace the edge does not know makes it ask the origin at most once per
LEARN_PERIOD_S, whoever asks, and is refused with the same message as a wrong token: the
answer tells a stranger neither that a namespace exists nor what lives in it.
"""
import asyncio
import collections
import time

from kdn.core.errors import AccessDenied, BadRequest
from kdn.core.keys import namespace_digest

LEARN_PERIOD_S = 2.0       # the origin is asked about unknown namespaces at most this often
LIST_TIMEOUT_S = 5.0


class Catalog:
    def __init__(self, tokens, peers):
        self.tokens, self.peers = tokens, peers
        self.manifests = {}        # (tenant, fingerprint, name, version) -> manifest dict
        self.chunks = {}           # key -> (namespace, xxh3_64 of its KV or None)
        self.ns_tenant = {}        # namespace digest -> tenant
        self.counters = collections.Counter()
        self._learning = None      # the origin call in flight for unknown namespaces
        self._learned_at = -LEARN_PERIOD_S
        self.on_add = None         # told of every manifest added (the KV-event publisher)

    # --- manifests --------------------------------------------------------------------------
    def add(self, m: dict) -> None:
        ns = namespace_digest(m["tenant"], m["fingerprint"])
        self.manifests[(m["tenant"], m["fingerprint"], m["name"], m["version"])] = m
        self.ns_tenant[ns] = m["tenant"]
        sums = m.get("sums") or [None] * len(m.get("keys", ()))
        for k, s in zip(m.get("keys", ()), sums):
            self.chunks[k] = (ns, s)
        if self.on_add is not None:
            self.on_add(m)

    def drop(self, ns: bytes, name: str, version: int) -> int:
        """Forget one version's manifest (its chunks' checksums stay: other versions share them)."""
        gone = [k for k in self.manifests if k[2] == name and k[3] == version
                and namespace_digest(k[0], k[1]) == ns]
        for k in gone:
            del self.manifests[k]
        return len(gone)

    def sum_of(self, key):
        """The checksum a manifest records for key (None when none names it)."""
        return self.chunks.get(key, (None, None))[1]

    def ns_of(self, key):
        return self.chunks.get(key, (None, None))[0]

    def listed(self, tenant: str, fingerprint: str) -> list:
        return [m for (t, f, _, _), m in self.manifests.items() if t == tenant and f == fingerprint]

    async def list(self, tenant: str, fingerprint: str, token) -> list:
        """Manifests of one namespace: from the origin when it answers, else the broadcast copy."""
        self.tokens.check_read(tenant, token, "listing knowledge bases")
        got = await self.peers.origin(LIST_TIMEOUT_S).manifests(namespace_digest(tenant, fingerprint))
        if got is None:
            return self.listed(tenant, fingerprint)
        for m in got:
            self.add(m)
        return got

    # --- read auth --------------------------------------------------------------------------
    async def check_read(self, ns: bytes, token, what: str, claim=None) -> None:
        """AccessDenied unless token may read namespace ns (see the module docstring).

        claim: the (tenant, fingerprint) the reader says ns digests, for a namespace no
        manifest names (another cache layer's objects): a claim that digests to ns is a
        fact, so its tenant is the one checked, and remembered once a token passes."""
        if not self.tokens.readers or self.tokens.is_admin(token):
            return
        tenant = self.ns_tenant.get(ns)
        claimed = tenant is None and _digests(claim, ns)
        if claimed:
            tenant = claim[0]
        elif tenant is None:
            await self._learn()
            tenant = self.ns_tenant.get(ns)
        try:
            if tenant is None:
                raise AccessDenied(what)
            self.tokens.check_read(tenant, token, what)
        except AccessDenied:
            self.counters["reads_refused"] += 1
            raise AccessDenied(f"{what}: refused: reading this namespace needs its tenant's read "
                               f"token (missing or wrong), or nothing is published under it") from None
        if claimed:
            self.ns_tenant[ns] = tenant

    async def _learn(self) -> None:
        """Ask the origin for every manifest, at most once per LEARN_PERIOD_S (concurrent
        askers share the one call)."""
        if self._learning is None:
            if time.monotonic() - self._learned_at < LEARN_PERIOD_S:
                return
            self._learned_at = time.monotonic()
            self._learning = asyncio.ensure_future(self._ask_origin())
        try:
            await asyncio.shield(self._learning)
        finally:
            if self._learning is not None and self._learning.done():
                self._learning = None

    async def refresh(self) -> None:
        """Learn every manifest the origin has (a restarted edge, for what its disk holds)."""
        await self._ask_origin()

    async def _ask_origin(self) -> None:
        self.counters["manifest_refreshes"] += 1
        for m in await self.peers.origin(LIST_TIMEOUT_S).manifests() or []:
            self.add(m)

    def stats(self) -> dict:
        return {"manifests": len(self.manifests), "namespaces": len(self.ns_tenant),
                "keys": len(self.chunks), **self.counters}


def _digests(claim, ns: bytes) -> bool:
    """Whether claim is a (tenant, fingerprint) pair whose namespace digest is ns."""
    if not (isinstance(claim, (tuple, list)) and len(claim) == 2
            and all(isinstance(x, str) and x for x in claim)):
        return False
    try:
        return namespace_digest(claim[0], claim[1]) == ns
    except BadRequest:            # a NUL or unencodable name: digests nothing
        return False
