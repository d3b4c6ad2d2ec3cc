"""Tenants' conversation policies, and pinned conversations: KV kept durably at the origin.

Conversation KV is soft state at its home edge (kdn/edge/conversations.py): an idle TTL, a byte
budget, and an edge that restarts or evicts loses it. An operator can pin a tenant's
conversations instead (a long-lived agent's context, like a KB): while the tenant is pinned,
each home edge also sends the chunks it keeps to the origin, which stores them as it stores
any chunk (kdn/origin/store.py: frames under their keys, written once, durable before the edge
is answered), and an edge that no longer holds a pinned conversation's chunk reads it back
from here (pull-through), so the next turn still finds its history.

What this module keeps, in the store's own objects (a directory or a bucket, so the origin
can restart anywhere):
- conversations/policies.msgpack: each tenant's conversation policy as an operator set it
  (idle TTL, longest TTL a request may ask for, byte budget per edge, pinned), and the
  tenant's epoch, which counts its deletions here (an edge that sees it change forgets which
  of its chunks it had sent), rewritten whole. The origin's health pings carry it, so every edge, a restarted one too, applies it
  within a second (kdn/edge/conversations.py keeps what it applies in memory only);
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
Calls block on I/O (from a thread). The policies are an immutable dict, replaced whole under
one lock, so the event loop reads them without waiting on a write; another lock guards the
records, whose keys are also indexed in memory per (tenant, ns) as they are first read (one
process owns a store, so the index stays true). A record is written only while its tenant is
pinned, checked under that lock: a store racing an unpin is refused, never recorded after
the unpin deleted the tenant's records.
"""
import threading

import msgpack
import xxhash

from kdn.core.conversation import check_budget, check_ttl
from kdn.core.errors import BadRequest, StoreError
from kdn.core.keys import KEY_BYTES

PREFIX = "conversations/"
POLICIES = PREFIX + "policies.msgpack"
FIELDS = {"ttl_s": check_ttl, "max_ttl_s": check_ttl, "budget_bytes": check_budget, "pinned": None}
EPOCH = "epoch"     # kept beside the fields, set here only (forget)
RECORD_SUFFIX = ".keys"


def tenant_dir(tenant: str) -> str:
    """Where a tenant's records live: the 128-bit digest of its name (names never become paths,
    and two tenants never share a folder)."""
    return f"{PREFIX}{xxhash.xxh3_128_hexdigest(tenant.encode('utf-8'))}/"


def _checked(field: str, value):
    """value checked for a policy field; BadRequest naming it."""
    if field in ("pinned",):
        if not isinstance(value, bool):
            raise BadRequest(f"pinned must be True or False, got {value!r:.40}")
        return value
    if field == EPOCH:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise BadRequest(f"epoch must be a count, got {value!r:.40}")
        return value
    return FIELDS[field](value, f"conversation {field}")


class OriginConversations:
    """The tenants' policies and the keys each pinned conversation namespace holds (see module)."""

    def __init__(self, objects):
        self.objects = objects
        self._lock = threading.Lock()          # the records and their index
        self._policy_lock = threading.Lock()   # writers of the policies
        self.policies = self._load()    # tenant -> {field: value}: replaced whole, never changed
        self._index = {}       # (tenant, ns) -> set of keys its records name, once read

    def _load(self) -> dict:
        try:
            raw = self.objects.get(POLICIES)
        except FileNotFoundError:
            return {}
        bad = f"{self.objects.where(POLICIES)} is not the tenants' conversation policies"
        try:
            policies = msgpack.unpackb(raw)
        except (ValueError, msgpack.ExtraData) as e:
            raise StoreError(f"{bad} ({e}); restore it or delete it (every tenant then has the "
                             "defaults, none pinned)") from None
        if not isinstance(policies, dict) or not all(
                isinstance(t, str) and isinstance(p, dict) and set(p) <= {*FIELDS, EPOCH}
                for t, p in policies.items()):
            raise StoreError(bad)
        for t, p in policies.items():
            for k, v in p.items():
                try:
                    _checked(k, v)
                except BadRequest as e:
                    raise StoreError(f"{bad}: tenant {t!r:.64}: {e}") from None
        return policies

    @property
    def tenants(self) -> set:
        """The pinned tenants."""
        return {t for t, p in self.policies.items() if p.get("pinned")}

    def pinned(self, tenant: str) -> bool:
        return bool(self.policies.get(tenant, {}).get("pinned"))

    def set_policy(self, tenant: str, **fields) -> dict:
        """Set these fields of tenant's policy (None: leave as is), durably; BadRequest naming
        a bad value before anything changes. The tenant's whole policy as it is now."""
        unknown = set(fields) - set(FIELDS)
        if unknown:
            raise BadRequest(f"a conversation policy has no {', '.join(sorted(unknown))}")
        policy = self._update(tenant, {k: _checked(k, v) for k, v in fields.items() if v is not None})
        policy.pop(EPOCH, None)
        return policy

    def _update(self, tenant: str, checked: dict) -> dict:
        with self._policy_lock:
            now = {**self.policies, tenant: {**self.policies.get(tenant, {}), **checked}}
            if now != self.policies:
                self.objects.put(POLICIES, [msgpack.packb(now)])
                self.policies = now
            return dict(self.policies.get(tenant, {}))

    def set_pinned(self, tenant: str, pinned: bool) -> bool:
        """Pin or unpin tenant, durably; whether that changed anything."""
        was = self.pinned(tenant)
        self.set_policy(tenant, pinned=pinned)
        return was != pinned

    def record(self, tenant: str, ns: bytes, keys) -> str:
        """Name keys as held for (tenant, ns), durably; the record's name. BadRequest when the
        tenant is not pinned (an unpin raced the store: its chunks are left to collect)."""
        keys = list(keys)
        body = b"".join(keys)
        name = f"{tenant_dir(tenant)}{ns.hex()}/{xxhash.xxh3_128_hexdigest(body)}{RECORD_SUFFIX}"
        with self._lock:
            if not self.pinned(tenant):
                raise BadRequest(f"tenant {tenant!r:.64} is no longer pinned: its chunks were not kept")
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
        """Delete a tenant's records: {ns: keys they named} (for the caller to delete). The
        tenant's epoch moves on first, so its edges resend what they hold."""
        self._update(tenant, {EPOCH: self.policies.get(tenant, {}).get(EPOCH, 0) + 1})
        gone = {}
        with self._lock:
            for name in self._records(tenant_dir(tenant)):
                gone.setdefault(bytes.fromhex(name.split("/")[-2]), set()).update(self._read(name))
                self.objects.delete(name)
            for ns in gone:
                self._index.pop((tenant, ns), None)
        return gone
