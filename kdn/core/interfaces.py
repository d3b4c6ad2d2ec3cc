"""The node interfaces: every method an edge or the origin answers to another process, once.

`EdgeAPI` and `OriginAPI` are typed protocols: the names, parameters and defaults a caller
may use, without the transport. A caller never names a method by a string: it holds a stub
(kdn.core.rpc.Stub, from `Actors.edge()` / `Actors.origin()` or a wrapper that fails over
across edges) whose attributes are these methods, and a call whose arguments do not fit the
signature here raises TypeError in the caller before anything is sent. `EdgeReads` is the
part a reader uses; the edge's HTTP client (kdn.client.http) answers it too, so one reader
(kdn.client.reader) runs over either transport.

Every method also takes `token=` (the admin token between nodes, a tenant's read token for
reads): the transport passes the one its caller holds, so it is not part of the signatures
here. `tests/core/test_interfaces.py` checks that each node class answers exactly these
methods with exactly these parameters (plus token), so the protocol and the actor cannot drift.
"""
from typing import Protocol


class EdgeReads(Protocol):
    """What a reader asks of an edge (over Ray or HTTP)."""

    async def list_manifests(self, tenant: str, fingerprint: str) -> list:
        """Manifests (as dicts) of one namespace: the origin's, else the edge's broadcast copy."""

    async def lookup(self, keys, ns: bytes) -> dict:
        """{"chunks": n, ...}: how long a prefix of keys the network holds; no KV moves."""

    async def fetch(self, keys, ns: bytes, region: str = None, resolve: bool = False,
                    node: str = None, accept=None, tenant: str = None,
                    fingerprint: str = None) -> dict:
        """The longest held prefix of keys: {"refs" or "chunks", "sources", "codecs", "wire",
        "more", "ring", "edge"}."""

    async def drop_corrupt(self, keys, ns: bytes) -> int:
        """A reader found these copies corrupt: the edge drops those that really are."""


class EdgeAPI(EdgeReads, Protocol):
    """An edge node (kdn.edge.node.EdgeNode), as the origin, its peers, clients and operators
    call it."""

    async def ping(self, drops=None, conversation_policies=None) -> dict:
        """Alive; the origin's heartbeat carries its drop-log state and conversation policies."""

    async def start_http(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Serve over HTTP too; the base URL."""

    async def membership(self) -> dict:
        """The membership this edge routes by."""

    async def set_membership(self, m: dict) -> int:
        """Route by membership m (the origin's); its version."""

    async def have(self, keys, ns: bytes = None) -> list:
        """Per key, whether this edge holds it (given ns: under that namespace)."""

    async def holds(self, keys, ns: bytes, tenant: str = None, fingerprint: str = None) -> list:
        """Per key, whether the network holds it under ns."""

    async def put_chunks(self, chunks, role: str = "main", pin: bool = False, ttl_s=None,
                         drops=None) -> int:
        """Keep chunks the origin pushes (main) or warms (hot); how many were kept."""

    async def pull_chunks(self, url: str, keys, role: str = "main", pin: bool = False, ttl_s=None,
                          drops=None, origin_ip: str = None) -> dict:
        """put_chunks of chunks pulled from the origin's frames at url: {"pulled", "kept"};
        {"pulled": None} when url is not reached from here."""

    async def put_objects(self, chunks) -> dict:
        """Keep another cache layer's objects here, durable at the origin after (write-behind):
        {"received", "kept", "pending"}."""

    async def stores_durable(self, timeout_s: float = 60.0) -> dict:
        """Wait until the stores answered here are durable at the origin: the backlog's stats."""

    async def withdraw_stores(self, keys, timeout_s: float = 60.0) -> dict:
        """Before a delete of keys at the origin: their stores answered here not sent yet are
        not sent, those on their way have landed: {"withdrawn", "settled", "backlog_objects"}."""

    async def pin_keys(self, keys) -> int:
        """Pin chunks held here; how many."""

    async def set_ttl(self, keys, ttl_s) -> int:
        """Held chunks of keys expire ttl_s from now; how many."""

    async def drop(self, keys, drops=None) -> int:
        """Drop keys from every tier; how many were held."""

    async def add_manifest(self, m: dict) -> None:
        """Keep a committed manifest's broadcast copy."""

    async def drop_manifest(self, ns, name, version) -> None:
        """Forget a retired version's broadcast copy."""

    async def data_address(self) -> dict:
        """{"url", "node", "ip"}: where peers and readers on other nodes read this edge's
        frames over HTTP (None: they do not; kdn.core.dataplane), its Ray node and that node's
        address. No token needed."""

    async def peer_get(self, keys, region: str = None, drops=None) -> list:
        """What this edge holds of keys (None elsewhere), in the form for the asker's region."""

    async def inject_corruption(self, key, stale_checksum: bool = False) -> bool:
        """Tests only (edge option fault_injection): corrupt a held copy (stale_checksum: it
        keeps the checksum of its good bytes, as a copy gone bad after its arrival check)."""

    async def put_conversation(self, chunks, tenant: str, fingerprint: str, scope: str,
                               retention: str = None, head=None, tail=None) -> int:
        """Keep a conversation's chunks (and its tail) homed here; how many were kept."""

    async def conversation_lookup(self, keys, ns: bytes, tenant: str, fingerprint: str,
                                  scope: str) -> int:
        """How long a prefix of a conversation's keys this edge holds."""

    async def conversation_find(self, keys, ns: bytes, tenant: str, fingerprint: str,
                                scope: str) -> dict:
        """{"held": n, "tails": [[n, key]]}: the held prefix and the tails after it."""

    async def conversation_fetch(self, keys, ns: bytes, tenant: str, fingerprint: str,
                                 scope: str) -> dict:
        """{"refs", "bytes"}: the held prefix of a conversation's keys."""

    async def conversations_of(self, tenant: str) -> dict:
        """A tenant's conversations here and its settings."""

    async def drop_conversations(self, tenant: str) -> int:
        """Drop a tenant's conversation chunks here; how many."""

    async def set_conversation_policy(self, tenant: str, ttl_s=None, budget_bytes=None,
                                      max_ttl_s=None, pinned=None) -> dict:
        """A tenant's conversation TTL, budget and pinning here."""

    async def stats(self) -> dict:
        """Counters, tiers and settings."""


class OriginAPI(Protocol):
    """The origin node (kdn.origin.node.OriginNode), as edges, publishers and operators call it."""

    async def ping(self) -> dict:
        """Alive."""

    async def membership(self) -> dict:
        """Members, topology and version: what placement is computed from."""

    async def stats(self) -> dict:
        """Counters, store and membership."""

    async def set_members(self, members) -> dict:
        """Replace the membership [(name, region, weight)]; re-home moved keys."""

    async def add_edge(self, name: str, region: str, weight: float = 1.0) -> dict:
        """Add an edge to the membership."""

    async def remove_edge(self, name: str) -> dict:
        """Remove an edge from the membership."""

    async def stored(self, keys) -> list:
        """Per key, the checksum of what is stored under it (None where absent or corrupt)."""

    async def has(self, keys, ns: bytes = None) -> list:
        """Per key, whether it is stored intact (given ns: under that namespace)."""

    async def put_chunks(self, chunks) -> dict:
        """Store published chunks."""

    async def put_objects(self, chunks) -> dict:
        """Store another cache layer's opaque objects durably."""

    async def put_object_refs(self, refs) -> dict:
        """put_objects for objects already in Ray's object store, handed over by reference (an
        edge's write-behind: no copy is made to send them)."""

    async def data_address(self) -> dict:
        """Where clients on other nodes write over HTTP: {"url" (None: no server), "node", "ip"}."""

    async def pull_objects(self, edge: str, keys, sums=None) -> dict:
        """put_objects of keys' objects pulled from edge's HTTP frames (its write-behind over
        the data plane), each only if of its checksum in sums: with "pulled" and "missing";
        {"pulled": None} when the origin reads edge over Ray."""

    async def pushes_settled(self) -> dict:
        """Wait for the pushes queued so far; their counters."""

    async def delete_objects(self, keys, ns: bytes) -> dict:
        """Delete opaque objects of namespace ns."""

    async def commit(self, manifest: dict, push: bool = True) -> dict:
        """Commit a manifest whose chunks are stored; push to owners; a receipt."""

    async def get_chunks(self, keys) -> list:
        """Chunks for keys (None where absent or corrupt)."""

    async def manifests(self, ns: bytes = None, name: str = None, own: bool = False) -> list:
        """Committed manifests (of namespace ns, of KB name)."""

    async def manifest(self, ns: bytes, name: str, version: int = None) -> dict:
        """One committed manifest (the latest version unless named)."""

    async def delete_version(self, ns: bytes, name: str, version: int) -> dict:
        """Retire a KB version."""

    async def drops(self, since: int = None) -> dict:
        """The drop log, for an edge catching up."""

    async def collect(self, object_ttl_s: float = None) -> dict:
        """Delete chunks no committed version names."""

    async def set_override(self, tenant: str, kb: str, pin_regions=None, replicas=None,
                           ttl_s=None, prefetch=None, emphasis=None) -> dict:
        """Per-KB operator settings, applied at once."""

    async def warm(self, tenant: str, kb: str, region: str, version: int = None) -> dict:
        """Copy a KB's chunks into every edge of region now."""

    async def auth_config(self) -> dict:
        """The token configuration, for an edge an operator adds."""

    async def set_conversation_policy(self, tenant: str, ttl_s=None, budget_bytes=None,
                                      max_ttl_s=None, pinned=None) -> dict:
        """A tenant's conversation policy, durably."""

    async def pinned_conversations(self, tenant: str = None) -> dict:
        """Pinned tenants and, given one, its conversation chunks kept here."""

    async def put_conversation(self, tenant: str, ns: bytes, chunks) -> dict:
        """A pinned tenant's conversation chunks, stored durably."""

    async def conversation_chunks(self, tenant: str, ns: bytes, keys) -> list:
        """The longest stored prefix of a pinned conversation's keys."""

    async def drop_conversations(self, tenant: str) -> dict:
        """Delete a tenant's pinned conversation KV here."""


def methods(api) -> dict:
    """name -> the protocol's function, for every method api declares (its bases' too)."""
    out = {}
    for cls in reversed(api.__mro__):
        if cls is object or cls is Protocol or not getattr(cls, "_is_protocol", False):
            continue
        out.update({n: f for n, f in vars(cls).items() if callable(f) and not n.startswith("_")})
    return out
