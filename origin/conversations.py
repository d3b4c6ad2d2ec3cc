"""Pinned conversations: a tenant's conversation KV kept durably at the origin, on an operator's word.

Conversation KV is soft state at its home edge (edge/conversations.py): an idle TTL, a byte
budget, and an edge that restarts or evicts loses it. An operator can pin a tenant's
conversations instead (a long-lived agent's context, like a KB): while the tenant is pinned,
each home edge also sends the chunks it keeps to the origin, which stores them as it stores
any chunk (origin/store.py: frames under their keys, written once, durable before the edge
is answered), and an edge that no longer holds a pinned conversation's chunk reads it back
from here (pull-through), so the next turn still finds its history.

What this module keeps, in the store's own objects (a directory or a bucket, so the origin
can restart anywhere):
- conversations/pinned.msgpack: the pinned tenants (a set, rewritten whole);
- conversations/<tenant digest>/<ns hex>/<digest of the keys>.keys: one record per batch an
  edge stored, the keys it holds, of one tenant and conversation namespace. A key is live
  while a record names it (ChunkStore.collect keeps it) and a read may only ask for keys a
  record of that tenant and namespace names: another tenant's read finds nothing.

Unpinning or dropping a tenant deletes its records and then the chunks they named
(ChunkStore.delete_conversation). That is not logged in the drop log: a conversation key
lives at one home edge, which kept its bytes first and sent them here, so its copy there
agrees with what was deleted and stays, under the tenant's TTL, as for any conversation
(an operator's drop empties the edges by itself). While a tenant is pinned, its home edges
read what the origin holds before keeping a worker's chunks under the same keys, so a key
keeps the one byte string it was first stored with even after the edge lost its copy.
Calls block on I/O (from a thread); one lock guards the pinned set and the records, whose
keys are also indexed in memory per (tenant, ns) as they are first read (one process owns
a store, so the index stays true).
"""
import threading

import msgpack
import xxhash

from kdn.core.errors import StoreError
from kdn.core.keys import KEY_BYTES

PREFIX = "conversations/"
PINS = PREFIX + "pinned.msgpack"
RECORD_SUFFIX = ".keys"


def tenant_dir(tenant: str) -> str:
    """Where a tenant's records live: the digest of its name (names never become paths)."""
    return f"{PREFIX}{xxhash.xxh3_64_hexdigest(tenant.encode('utf-8'))}/"


class PinnedConversations:
    """The pinned tenants and the keys each pinned conversation namespace holds (see module)."""

    def __init__(self, objects):
        self.objects = objects
        self._lock = threading.Lock()
        self.tenants = self._load()
        self._index = {}       # (tenant, ns) -> set of keys its records name, once read

    def _load(self) -> set:
        try:
            raw = self.objects.get(PINS)
        except FileNotFoundError:
            return set()
        try:
            tenants = msgpack.unpackb(raw)
        except (ValueError, msgpack.ExtraData) as e:
            raise StoreError(f"{self.objects.where(PINS)} is not a list of pinned tenants ({e}); "
                             "restore it or delete it (no tenant is then pinned)") from None
        if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
            raise StoreError(f"{self.objects.where(PINS)} is not a list of pinned tenants")
        return set(tenants)

    def pinned(self, tenant: str) -> bool:
        with self._lock:
            return tenant in self.tenants

    def set_pinned(self, tenant: str, pinned: bool) -> bool:
        """Pin or unpin tenant, durably; whether that changed anything."""
        with self._lock:
            if (tenant in self.tenants) == pinned:
                return False
            now = self.tenants | {tenant} if pinned else self.tenants - {tenant}
            self.objects.put(PINS, [msgpack.packb(sorted(now))])
            self.tenants = now
            return True

    def record(self, tenant: str, ns: bytes, keys) -> str:
        """Name keys as held for (tenant, ns), durably; the record's name."""
        keys = list(keys)
        body = b"".join(keys)
        name = f"{tenant_dir(tenant)}{ns.hex()}/{xxhash.xxh3_128_hexdigest(body)}{RECORD_SUFFIX}"
        with self._lock:
            self.objects.put(name, [msgpack.packb(keys)])
            if (tenant, ns) in self._index:
                self._index[(tenant, ns)].update(keys)
        return name

    def _records(self, prefix: str) -> list:
        return [n for n, _ in self.objects.list(prefix) if n.endswith(RECORD_SUFFIX)]

    def _read(self, name: str) -> list:
        try:
            keys = msgpack.unpackb(self.objects.get(name))
        except FileNotFoundError:
            return []
        except (ValueError, msgpack.ExtraData) as e:
            raise StoreError(f"conversation record {self.objects.where(name)} is unreadable ({e})") from None
        if not isinstance(keys, list) or not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
            raise StoreError(f"conversation record {self.objects.where(name)} is not a list of keys")
        return keys

    def keys_of(self, tenant: str, ns: bytes) -> set:
        """Every key the records of (tenant, ns) name."""
        with self._lock:
            known = self._index.get((tenant, ns))
            if known is None:
                known = set()
                for name in self._records(f"{tenant_dir(tenant)}{ns.hex()}/"):
                    known.update(self._read(name))
                self._index[(tenant, ns)] = known
            return set(known)

    def live(self) -> set:
        """Every key any record names (what collect must keep)."""
        out = set()
        for name in self._records(PREFIX):
            out.update(self._read(name))
        return out

    def listing(self, tenant: str) -> dict:
        """{ns hex: chunks held here} of a tenant's pinned conversations."""
        out = {}
        for name in self._records(tenant_dir(tenant)):
            ns = name.split("/")[-2]
            out[ns] = out.get(ns, 0) + len(self._read(name))
        return out

    def forget(self, tenant: str) -> dict:
        """Delete a tenant's records: {ns: keys they named} (for the caller to delete)."""
        gone = {}
        with self._lock:
            for name in self._records(tenant_dir(tenant)):
                gone.setdefault(bytes.fromhex(name.split("/")[-2]), set()).update(self._read(name))
                self.objects.delete(name)
            for ns in gone:
                self._index.pop((tenant, ns), None)
        return gone
