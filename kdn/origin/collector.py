"""The origin's collector: what no committed version, publisher or pinned conversation needs
goes (one job of kdn/origin/store.py's ChunkStore, beside its chunks and its registry).

collect() deletes chunks no committed version references and no publisher is still putting
(pending, kdn/origin/chunks.py), logging every key in the drop log first (kdn/origin/drops.py)
for edges that miss the drop. Other cache layers' objects (LMCache's, SGLang's: opaque chunks,
kdn.integrations.objects) no manifest will ever name: collect() tells them by their frame
header (dtype "opaque") and keeps them, across restarts, unless an object TTL is given;
delete_objects() removes a namespace's objects by key (the host layer's delete). A pinned
tenant's conversation chunks are live while its records name them (kdn/origin/conversations.py);
put_conversation() and delete_conversation() keep those records and their chunks together.
The store's lock serialises collection with commits and retirements.
"""
from __future__ import annotations

import time

from kdn.core.chunk import MAX_HEADER, Chunk, read_header
from kdn.core.checks import check_number
from kdn.core.dtypes import OPAQUE
from kdn.core.errors import FrameError, ManifestError, StoreError
from kdn.origin.chunks import chunk_key, chunk_name, ns_digest

_GONE = object()                  # collect(): the chunk vanished while it looked


class Collector:
    """Collection over `chunks` and `registry` (the store's), logging to `drops`, keeping
    `conversations`' chunks."""

    objects = property(lambda self: self.chunks.objects)    # the chunks' backend, always

    def __init__(self, chunks, registry, drops, conversations):
        self.chunks, self.registry = chunks, registry
        self.drops, self.conversations = drops, conversations
        self._lock = chunks._lock

    def collect(self, object_ttl_s: "float | None" = None, now: "float | None" = None) -> dict:
        """Delete chunks no committed version references (and no publisher is still putting).

        Opaque objects (put_objects: no manifest names them) are live: they stay, unless
        object_ttl_s is given, when those written more than object_ttl_s seconds before now
        go too. Refused (ManifestError, nothing deleted) while a quarantined manifest exists:
        its chunks cannot be told apart, and restoring the file must find them still there."""
        if object_ttl_s is not None:
            object_ttl_s = check_number(object_ttl_s, "object_ttl_s", 0, error=StoreError)
        now = time.time() if now is None else now
        with self._lock:
            live = self.chunks.pending() | self.conversations.live()
            for m in self.registry.manifests():
                live.update(m.keys)
            held = self.registry.quarantined()
            if held:
                raise ManifestError(f"collect refused: {len(held)} quarantined manifest file(s) "
                                    f"({', '.join(held[:3])}) may reference chunks; restore or "
                                    f"delete them under {self.objects.where('manifests')} first")
            unnamed = [(k, n) for k, n in self.chunks.chunk_objects() if k not in live]
            # read in the I/O threads, which never take the lock held here
            kinds = self.chunks.map(lambda kn: self._object_age(kn[0], now), unnamed)
            n = size = kept = expired = 0
            doomed = []
            for (key, nbytes), age in zip(unnamed, kinds):
                if age is _GONE:
                    continue
                if age is not None:                  # an opaque object, written age s ago
                    if object_ttl_s is None or age <= object_ttl_s:
                        kept += 1
                        continue
                    expired += 1
                doomed.append((key, nbytes))
            self.drops.append([k for k, _ in doomed])   # logged before any is gone
            for key, nbytes in doomed:
                if self.objects.delete(chunk_name(key)):
                    size += nbytes
                    n += 1
                    self.chunks.deleted(key, nbytes)
            return dict(chunks=n, bytes=size, objects_kept=kept, objects_expired=expired)

    def _object_age(self, key: bytes, now: float):
        """Seconds since the opaque object under key was written; None when the chunk is not
        an intact opaque frame's header (garbage like any unreferenced chunk); _GONE when it
        vanished meanwhile. An unreadable one raises (StoreError, OSError): never deleted on
        a guess."""
        name = chunk_name(key)
        try:
            header, _ = read_header(self.objects.head(name, 8 + MAX_HEADER))
            if header["dtype"] != OPAQUE:
                return None
            when = self.objects.modified(name)
        except FileNotFoundError:
            return _GONE
        except FrameError:
            return None
        return _GONE if when is None else max(0.0, now - when)

    def put_conversation(self, tenant: str, ns: bytes, chunks) -> list:
        """Store a pinned conversation's chunks (Chunks of namespace ns) durably and record them
        for (tenant, ns): [(written, sum)] in order. The keys are live (collect keeps them) from
        the put on: pending until the record is written, the record's after. BadRequest when
        the tenant is no longer pinned (kdn/origin/conversations.py record)."""
        ns = ns_digest(ns)
        bad = next((c for c in chunks if not isinstance(c, Chunk) or c.opaque or c.ns != ns), None)
        if bad is not None:
            raise StoreError(f"put_conversation() takes Chunks of namespace {ns.hex()}, got {bad!r:.80}")
        try:
            results = self.chunks.put_chunks(chunks)
            self.conversations.record(tenant, ns, [chunk_key(c.key) for c in chunks])
        finally:     # recorded, or refused (an unpin raced it: collect takes the chunks)
            self.chunks.release(c.key for c in chunks)
        return results

    def conversation_prefix(self, tenant: str, ns: bytes, keys) -> list:
        """The longest prefix of keys that records of (tenant, ns) name: another tenant's or
        namespace's keys are never among them."""
        named = self.conversations.keys_of(tenant, ns_digest(ns))
        keys = [chunk_key(k) for k in keys]
        return keys[:next((i for i, k in enumerate(keys) if k not in named), len(keys))]

    def delete_conversation(self, tenant: str) -> int:
        """Forget a tenant's pinned conversations and delete their chunks, each checked to be
        of the recorded namespace by its frame header. Not logged in the drop log: the home
        edge's copy is the bytes these were (kdn/origin/conversations.py). How many were deleted."""
        n = 0
        with self._lock:
            for ns, keys in self.conversations.forget(tenant).items():
                keys = sorted(keys - self.chunks.pending())
                mine = [k for k, k_ns in zip(keys, self.chunks.map(self.chunks.ns_of, keys)) if k_ns == ns]
                n += sum(self.chunks.delete_chunk(k) for k in mine)
        return n

    def delete_objects(self, keys, ns: bytes) -> tuple:
        """Delete the opaque objects of namespace ns under keys (a host layer's own delete);
        a key that is another thing here (a KB's chunk, another namespace's object) is left
        alone. (the keys deleted, the keys not stored here at all). Both are logged as drops:
        a key this origin never got may still be held by edges, a store not durable yet that
        its writer withdrew from an edge's backlog before this delete (kdn/edge/stores.py,
        WriteBehind.withdraw) and that a reader in its region pulled from that edge."""
        ns = ns_digest(ns)
        keys = list(dict.fromkeys(chunk_key(k) for k in keys))

        def kind(k):
            try:
                header, _ = read_header(self.objects.head(chunk_name(k), 8 + MAX_HEADER))
            except FileNotFoundError:
                return "absent"
            except FrameError:
                return "other"
            return "ours" if header["dtype"] == OPAQUE and header["ns"] == ns else "other"
        with self._lock:
            kinds = self.chunks.map(kind, keys)
            mine = [k for k, m in zip(keys, kinds) if m == "ours"]
            absent = [k for k, m in zip(keys, kinds) if m == "absent"]
            self.drops.append(mine + absent)         # logged before any is gone
            gone = [k for k in mine if self.chunks.delete_chunk(k)]
        return gone, absent
