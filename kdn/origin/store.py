"""The origin's durable store: one objects backend (a directory or an S3 bucket,
kdn/origin/objects.py), three jobs, each its own class:

- chunks (kdn/origin/chunks.py, `Chunks`): content-addressed frames, every read verified, a
  key meaning the bytes stored first, forever;
- the KB manifest registry (kdn/origin/registry.py, `Registry`): versions committed once
  every chunk is stored, never reused, retired or quarantined, listed;
- the collector (kdn/origin/collector.py, `Collector`): what no version, publisher or pinned
  conversation needs goes, logged in the drop log first.

`ChunkStore` is the chunks with the other two beside them, sharing one lock and one set of
counters: the origin node (kdn/origin/node.py) holds one. One process owns a store. Inside it,
the lock serialises manifest commits, retirements and collection; chunk writes run outside it.
Calls block on I/O: an async caller runs them in a thread (asyncio.to_thread).
"""
from __future__ import annotations

import collections
import threading

from kdn.core.files import make_dirs
from kdn.origin.chunks import Chunks
from kdn.origin.collector import Collector
from kdn.origin.conversations import OriginConversations
from kdn.origin.drops import DropLog
from kdn.origin.objects import LocalObjects, open_objects
from kdn.origin.registry import Registry

# Counted from the start (0 until they happen), so stats() always names them.
COUNTERS = ("reads", "writes", "deduplicated", "repaired", "corrupt_detected",
            "cleaned_partials", "manifests_quarantined", "commit_conflicts", "sums_refused",
            "repairs_refused")


class ChunkStore(Chunks):
    """Chunks (as verified frames) and KB manifests in one backend: a root directory, an
    s3://bucket/prefix, or an origin.objects backend; `registry` and `collector` beside."""

    def __init__(self, root, fsync: bool = True, codec: str = "raw"):
        objects = open_objects(root, fsync=fsync)
        if isinstance(objects, LocalObjects):
            for d in ("chunks", "manifests"):
                make_dirs(objects.path(d))
        counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        counters["cleaned_partials"] = objects.clean_partials()
        super().__init__(objects, threading.RLock(), counters, codec)
        self.root = objects.where()
        self.fsync = fsync
        # every key removed is logged here first, for edges that miss the drop (kdn/origin/drops.py)
        self.drops = DropLog(objects)
        # pinned tenants' conversation KV and the records naming its keys (kdn/origin/conversations.py)
        self.conversations = OriginConversations(objects)
        self.registry = Registry(self)
        self.collector = Collector(self, self.registry, self.drops, self.conversations)

    # --- manifests (Registry) --------------------------------------------------------------
    def commit(self, manifest):
        return self.registry.commit(manifest)

    def manifest(self, ns: bytes, name: str, version: "int | None" = None):
        return self.registry.manifest(ns, name, version)

    def manifests(self, ns: "bytes | None" = None, name: "str | None" = None) -> list:
        return self.registry.manifests(ns, name)

    def quarantined(self) -> list:
        return self.registry.quarantined()

    def delete_version(self, ns: bytes, name: str, version: int) -> list:
        return self.registry.delete_version(ns, name, version)

    def kbs(self) -> list:
        return self.registry.kbs()

    # --- collection (Collector) ------------------------------------------------------------
    def collect(self, object_ttl_s: "float | None" = None, now: "float | None" = None) -> dict:
        return self.collector.collect(object_ttl_s, now)

    def delete_objects(self, keys, ns: bytes) -> tuple:
        return self.collector.delete_objects(keys, ns)

    def put_conversation(self, tenant: str, ns: bytes, chunks) -> list:
        return self.collector.put_conversation(tenant, ns, chunks)

    def conversation_prefix(self, tenant: str, ns: bytes, keys) -> list:
        return self.collector.conversation_prefix(tenant, ns, keys)

    def delete_conversation(self, tenant: str) -> int:
        return self.collector.delete_conversation(tenant)

    def stats(self) -> dict:
        """versions: the KBs' committed versions; emphasized_copies: the emphasized copies of
        them (kdn.core.emphasis), counted apart: a copy is not a KB version."""
        versions, copies = self.registry.versions_and_copies()
        with self._lock:
            return dict(chunks=self._count, bytes=self._bytes, versions=versions,
                        emphasized_copies=copies, codec=self.codec, pending=len(self._pending),
                        backend=self.objects.where(), **self.counters)
