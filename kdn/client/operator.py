"""Operator calls: placement overrides, warming, deleting versions, growing and shrinking the
ring, and the status of every node.

They need the network's admin token but no model: an override names a tenant's KB, not a
namespace, so `kdn status` and `kdn pin` work from a process that never loads a model. The
origin decides and applies every override (it holds the membership and the manifests);
these calls only carry them there, retried while the origin restarts (kdn.client.view). Status
asks every node at once and reports one that does not answer in time as down.
"""
import time

from kdn.core.checks import check_int
from kdn.core.emphasis import is_emphasized, model_of
from kdn.core.errors import BadRequest, NetworkError, VersionNotFound
from kdn.core.keys import namespace_digest
from kdn.placement.topology import Topology
from kdn.core.interfaces import EdgeAPI
from kdn.core.rpc import Stub, Unreachable

OVERRIDE_TIMEOUT_S = 120.0    # an override moves chunks between edges before it answers
RING_TIMEOUT_S = 300.0        # adding or removing an edge re-homes its keys first
EDGE_START_TIMEOUT_S = 60.0
STATUS_TIMEOUT_S = 3.0
MANIFESTS_TIMEOUT_S = 30.0    # every committed manifest, to find which model has a version


class Operator:
    """Operator controls of one network, for KBs of `tenant`, through `view` (kdn.client.view)."""

    def __init__(self, view, tenant: str):
        self.view, self.tenant = view, tenant

    # --- overrides -------------------------------------------------------------------------
    def pin(self, kb: str, regions) -> dict:
        """Keep a copy of every chunk of `kb` in each of `regions` (besides its ring owners)."""
        if not isinstance(regions, (list, tuple)) or not all(isinstance(r, str) for r in regions):
            raise BadRequest(f"pin takes a list of region names, got {regions!r:.80}")
        return self._override(kb, pin_regions=list(regions))

    def set_replicas(self, kb: str, n: int) -> dict:
        return self._override(kb, replicas=n)

    def set_ttl(self, kb: str, seconds: float) -> dict:
        """Chunks of `kb` expire from edges `seconds` after they arrive (those held now too)."""
        return self._override(kb, ttl_s=seconds)

    def set_emphasis(self, kb: str, weights: dict) -> dict:
        """Answers over `kb` attend more to these documents ({document: integer weight},
        kdn.core.emphasis) unless a request names its own; {} clears it. Readers see it within
        a manifest listing's lifetime (kdn.client.reader.MANIFEST_TTL_S); it applies to later
        versions too, for the documents they still have."""
        if not isinstance(weights, dict):
            raise BadRequest(f"set_emphasis takes {{document: integer weight}}, got {type(weights).__name__}")
        return self._override(kb, emphasis=weights)

    def _override(self, kb: str, **setting) -> dict:
        return self.view.origin(OVERRIDE_TIMEOUT_S).set_override(self.tenant, kb, **setting)

    def warm(self, kb: str, region: str) -> dict:
        """Copy every chunk of `kb` to the edges of `region` now (before its readers ask)."""
        return self.view.origin(OVERRIDE_TIMEOUT_S).warm(self.tenant, kb, region)

    def delete(self, kb: str, version: int, fingerprint: str = None) -> dict:
        """Retire one version of this tenant's KB (its chunks are collected later).

        A KB is versioned per model, so `kb@v3` is one version under each model fingerprint
        that published it. With no fingerprint, the one model that has this version is meant:
        VersionNotFound when none has it, BadRequest naming the models when several do. Its
        emphasized copies (kdn.core.emphasis) are never a model's version: they are retired with
        it ({"deleted", "emphasized_copies": how many}), and their fingerprints are refused here.
        """
        version = check_int(version, "version", 1)
        if fingerprint is not None and is_emphasized(fingerprint):
            raise BadRequest(f"fingerprint {fingerprint!r:.200} is an emphasized copy's, not a model's: "
                             f"delete the KB version under its model ({model_of(fingerprint)!r:.120}), "
                             "and its emphasized copies go with it")
        if fingerprint is None:
            fps = sorted({m["fingerprint"] for m in self.view.origin(MANIFESTS_TIMEOUT_S).manifests(name=kb, own=True)
                          if (m["tenant"], m["name"], m["version"]) == (self.tenant, kb, version)})
            if not fps:
                raise VersionNotFound(f"KB {kb!r} of tenant {self.tenant!r} has no version {version}")
            if len(fps) > 1:
                raise BadRequest(f"{kb}@v{version} of tenant {self.tenant!r} exists under {len(fps)} "
                                 f"models ({', '.join(fps)}): name the one to delete (fingerprint=)")
            fingerprint = fps[0]
        return self.view.origin().delete_version(namespace_digest(self.tenant, fingerprint), kb, version)

    def collect(self, object_ttl_s: float = None) -> dict:
        """Delete the origin's chunks no committed version names (of every tenant). Other
        cache layers' objects (LMCache's, SGLang's) stay, unless written more than
        object_ttl_s seconds ago."""
        return self.view.origin(OVERRIDE_TIMEOUT_S).collect(object_ttl_s=object_ttl_s)

    # --- conversations (kdn/edge/conversations.py) -----------------------------------------------
    def conversations(self, tenant: str = None) -> list:
        """Per edge, a tenant's conversation KV there (per conversation namespace: chunks,
        bytes, seconds idle) and its settings; an edge that does not answer is {"down": True}."""
        return self._every_edge().conversations_of(tenant or self.tenant)

    def drop_conversations(self, tenant: str = None) -> dict:
        """Drop a tenant's conversation KV on every edge and, of a pinned tenant, at the origin:
        {edge: chunks dropped, or None if down}, and {"origin": chunks deleted there}."""
        tenant = tenant or self.tenant
        # the origin first: an edge's lookup between the two would pull its copies back
        origin = self.view.origin(OVERRIDE_TIMEOUT_S).drop_conversations(tenant)["deleted"]
        out = {r["edge"]: r.get("value") for r in self._every_edge().drop_conversations(tenant)}
        out["origin"] = origin
        return out

    def pin_conversations(self, tenant: str = None, pinned: bool = True) -> dict:
        """Keep a tenant's conversation KV at the origin too (kdn/origin/conversations.py: a
        long-lived agent's context survives its home edge's restart, eviction and TTL), or
        with pinned=False no longer (the origin's copies are deleted; the edges keep theirs
        under the tenant's TTL). Takes effect for the chunks stored from now on (and the starts of
        the conversations they extend). The origin records it durably, then every edge hears
        it (here at once; an edge down now, with the origin's next ping once it is back).
        {"tenant", "pinned", "deleted": chunks deleted at the origin, "edges": [per edge]}."""
        tenant = tenant or self.tenant
        if not isinstance(pinned, bool):
            raise BadRequest(f"pinned must be True or False, got {pinned!r:.40}")
        got = self.view.origin(OVERRIDE_TIMEOUT_S).set_conversation_policy(tenant, pinned=pinned)
        return {"tenant": tenant, "pinned": pinned, "deleted": got["deleted"],
                "edges": self._every_edge().set_conversation_policy(tenant, pinned=pinned)}

    def pinned_conversations(self, tenant: str = None) -> dict:
        """What the origin keeps of a tenant's conversations: {"pinned": bool, "chunks": {ns hex: n}}."""
        tenant = tenant or self.tenant
        got = self.view.origin().pinned_conversations(tenant)
        return {"pinned": tenant in got["tenants"], "chunks": got["chunks"]}

    def set_conversation_policy(self, tenant: str = None, ttl_s: float = None, budget_bytes: int = None,
                                max_ttl_s: float = None) -> list:
        """A tenant's idle TTL, the longest TTL a request may ask for (prompt_cache_retention
        "24h") and byte budget per edge. The origin keeps it (kdn/origin/conversations.py), then
        every edge applies it at once to what it holds; an edge down now, or restarted later,
        applies it with the origin's next health ping. [per edge: its settings now]."""
        if ttl_s is None and budget_bytes is None and max_ttl_s is None:
            raise BadRequest("set_conversation_policy: name ttl_s, budget_bytes or max_ttl_s")
        tenant = tenant or self.tenant
        self.view.origin(OVERRIDE_TIMEOUT_S).set_conversation_policy(
            tenant, ttl_s=ttl_s, budget_bytes=budget_bytes, max_ttl_s=max_ttl_s)
        return self._every_edge().set_conversation_policy(
            tenant, ttl_s=ttl_s, budget_bytes=budget_bytes, max_ttl_s=max_ttl_s)

    def _every_edge(self) -> EdgeAPI:
        """Every edge of the ring, in order, with the admin token: a call answers one entry
        per edge (an edge that does not answer is reported down); the first refusal (a bad
        value) raises."""
        def send(method, args, kw):
            out = []
            for e in self.view.ring.edges:
                try:
                    got = self.view.actors.call_sync(e.name, method, *args, token=self.view.admin_token,
                                                     timeout=STATUS_TIMEOUT_S, **kw)
                except Unreachable:
                    out.append({"edge": e.name, "region": e.region, "down": True})
                    continue
                out.append(got if isinstance(got, dict) else {"edge": e.name, "region": e.region, "value": got})
            return out
        return Stub(EdgeAPI, send, "every edge")

    # --- ring ----------------------------------------------------------------------------
    def add_edge(self, name: str, region: str, capacity_bytes: int = 2 << 30, **edge_options) -> dict:
        """Start an edge actor in `region` and add it to the ring (keys move to it)."""
        from kdn.launch.cluster import start_edge
        topo = Topology.from_dict(self.view.membership["topology"])
        edge = topo.add_edge(name, region, int(capacity_bytes))
        auth = self.view.origin().auth_config()
        # detached: the edge belongs to the network, not to this process (stop_network kills it)
        start_edge(self.view.network, edge, topo, capacity_bytes=capacity_bytes, detached=True,
                   auth=auth, replicas=self.view.membership.get("replicas", 2), **edge_options)
        self.view.at(name, EDGE_START_TIMEOUT_S).ping()
        m = self.view.origin(RING_TIMEOUT_S).add_edge(name, region, edge.weight)
        self.view.refresh()
        return m

    def remove_edge(self, name: str, kill: bool = True) -> dict:
        """Take an edge out of the ring (its keys re-homed first), then stop it."""
        import ray
        m = self.view.origin(RING_TIMEOUT_S).remove_edge(name)
        if kill:
            try:
                ray.kill(self.view.actors.handle(name), no_restart=True)
            except Unreachable:
                pass                 # no actor by that name: already gone
        self.view.actors.forget(name)
        self.view.refresh()
        return m

    # --- status --------------------------------------------------------------------------
    def status(self, timeout_s: float = STATUS_TIMEOUT_S) -> dict:
        """Origin and every edge's stats; a node that does not answer in time is reported down."""
        out = {"network": self.view.network, "region": self.view.region, "edges": []}
        asked = {e.name: self._ask_stats(e.name) for e in self.view.ring.edges}
        try:
            out["origin"] = self.view.origin(timeout_s).stats()
        except NetworkError as e:
            out["origin"] = {"unreachable": str(e)}
        deadline = time.monotonic() + timeout_s
        for e in self.view.ring.edges:
            st = None
            if asked[e.name] is not None:
                try:
                    st = self.view.actors.get_sync(e.name, asked[e.name],
                                                   timeout=max(0.1, deadline - time.monotonic()))
                except Unreachable:
                    pass
            out["edges"].append(st or {"name": e.name, "region": e.region, "down": True})
        return out

    def _ask_stats(self, edge: str):
        """An edge's stats call in flight (all edges are asked at once), None if it has no actor."""
        try:
            return self.view.actors.stub(edge, how="start").stats(token=self.view.admin_token)
        except Unreachable:
            return None
