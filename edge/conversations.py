"""The edge's conversation tier: soft KV of prompts workers computed, under budgets and an idle TTL.

A worker that answered a turn stores the conversation's new whole chunks here, at the
conversation's home edge (kdn.core.conversation). Unlike the main and hot tiers, this one is
bounded three ways, all in bytes and seconds:
- its own share of the edge's memory (`capacity`): conversations never evict a published
  KB's chunks, and under pressure they are what goes first (they are recomputable history,
  a KB is what an operator published);
- a budget per tenant: one tenant's agents cannot crowd out another's; a tenant over its
  budget loses its own least recently used chunks;
- an idle TTL per entry (the tenant's, or what the request's prompt_cache_retention asked
  for within it): every read renews it, and `sweep()` (each tick) and every read drop what
  has been idle longer. Nothing outlives its TTL here, and nothing of it is written anywhere
  else: no disk, no origin.
The first bytes stored under a key are kept: a second worker storing the same key (it
computed the same turns) changes nothing but the entry's recency.

One threading.Lock guards the maps and nothing inside it awaits, so it is safe from the
edge's event loop and its worker threads alike. Counters: conv_puts, conv_kept, conv_hits,
conv_misses, conv_expired, conv_evicted_budget, conv_evicted_capacity, conv_refused,
conv_dropped.
"""
import collections
import threading
import time
from dataclasses import dataclass

from kdn.core.conversation import (IDLE_TTL_S, MAX_TTL_S, TENANT_BUDGET_BYTES, check_budget, check_ttl,
                                   retention_ttl)


@dataclass
class _Entry:
    held: object        # edge/tiers.Held
    tenant: str
    ttl_s: float
    used: float         # monotonic time of the last put or read


class Conversations:
    """Conversation chunks of every tenant at one edge (see the module)."""

    def __init__(self, capacity_bytes: int, default_ttl_s: float = IDLE_TTL_S,
                 default_budget_bytes: int = TENANT_BUDGET_BYTES, clock=time.monotonic):
        self.capacity = check_budget(capacity_bytes, "conversation capacity")
        self.default_ttl_s = check_ttl(default_ttl_s)
        self.default_budget = check_budget(default_budget_bytes)
        self.clock = clock
        self._lock = threading.Lock()
        self._entries = collections.OrderedDict()   # key -> _Entry, least recently used first
        self._tenant_bytes = collections.Counter()
        self._bytes = 0
        self.policies = {}      # tenant -> {"ttl_s": float, "budget_bytes": int} set by an operator
        self.counters = collections.Counter()
        self.on_drop = None     # called with each key that leaves (the edge's KV events)

    # --- the operator's settings -------------------------------------------------------------
    def ttl_of(self, tenant: str) -> float:
        return self.policies.get(tenant, {}).get("ttl_s", self.default_ttl_s)

    def budget_of(self, tenant: str) -> int:
        return self.policies.get(tenant, {}).get("budget_bytes", self.default_budget)

    def max_ttl_of(self, tenant: str) -> float:
        return self.policies.get(tenant, {}).get("max_ttl_s", MAX_TTL_S)

    def policy_of(self, tenant: str) -> dict:
        return {"tenant": tenant, "ttl_s": self.ttl_of(tenant), "max_ttl_s": self.max_ttl_of(tenant),
                "budget_bytes": self.budget_of(tenant)}

    def set_policy(self, tenant: str, ttl_s=None, budget_bytes=None, max_ttl_s=None) -> dict:
        """Set a tenant's idle TTL, longest TTL a request may ask for, and/or byte budget; each
        applies at once to what is held (a smaller budget evicts now, a shorter TTL or maximum
        expires now what has been idle longer)."""
        ttl_s = None if ttl_s is None else check_ttl(ttl_s)
        max_ttl_s = None if max_ttl_s is None else check_ttl(max_ttl_s, "conversation max TTL")
        budget_bytes = None if budget_bytes is None else check_budget(budget_bytes)
        with self._lock:
            p = self.policies.setdefault(tenant, {})
            if max_ttl_s is not None:
                p["max_ttl_s"] = max_ttl_s
            if ttl_s is not None:
                p["ttl_s"] = ttl_s
            cap = self.max_ttl_of(tenant)
            p["ttl_s"] = min(self.ttl_of(tenant), cap)
            for e in self._entries.values():
                if e.tenant == tenant:
                    e.ttl_s = self.ttl_of(tenant) if ttl_s is not None else min(e.ttl_s, cap)
            if budget_bytes is not None:
                p["budget_bytes"] = budget_bytes
            gone = self._fit(tenant, 0)
        self._dropped(gone)
        self.sweep()
        return self.policy_of(tenant)

    # --- reads and writes --------------------------------------------------------------------
    def get(self, key, ns: bytes = None):
        """The Held for key (renewing its idle TTL), or None when absent, expired or (given
        ns) of another namespace, which counts and renews nothing."""
        gone = []
        with self._lock:
            e = self._entries.get(key)
            if e is not None and self.clock() - e.used > e.ttl_s:
                gone.append(self._remove(key, "conv_expired"))
                e = None
            if e is None or (ns is not None and e.held.ns != ns):
                self.counters["conv_misses"] += 1
                held = None
            else:
                e.used = self.clock()
                self._entries.move_to_end(key)
                self.counters["conv_hits"] += 1
                held = e.held
        self._dropped(gone)
        return held

    def peek(self, key):
        """The Held for key if held and not expired; no counting, no renewal."""
        with self._lock:
            e = self._entries.get(key)
            return None if e is None or self.clock() - e.used > e.ttl_s else e.held

    def __contains__(self, key) -> bool:
        return self.peek(key) is not None

    def put_prefix(self, tenant: str, items, retention: str = None) -> int:
        """put() each (key, held) of a conversation's consecutive chunks, the last first, so the
        earlier a chunk the more recent it is: eviction then takes a conversation's tail
        before its head (a prefix is worth nothing without its start). How many are held."""
        items = list(items)
        for k, h in reversed(items):
            self.put(tenant, k, h, retention)
        return next((i for i, (k, _) in enumerate(items) if k not in self), len(items))

    def get_prefix(self, keys, ns: bytes) -> list:
        """The Helds of the longest held prefix of keys (a conversation's consecutive chunks),
        each renewed, the last first (see put_prefix)."""
        n = next((i for i, k in enumerate(keys) if self.peek(k) is None), len(keys))
        got = [self.get(k, ns) for k in reversed(keys[:n])][::-1]
        return got[:next((i for i, h in enumerate(got) if h is None), len(got))]

    def put(self, tenant: str, key, held, retention: str = None) -> bool:
        """Keep held for tenant, idle for as long as retention asks within the tenant's bounds
        (kdn.core.conversation.retention_ttl); False when refused (larger than the tenant's
        budget or the tier). A key already held keeps its first bytes and is only renewed."""
        ttl_s = retention_ttl(retention, self.ttl_of(tenant), self.max_ttl_of(tenant))
        with self._lock:
            self.counters["conv_puts"] += 1
            e = self._entries.get(key)
            if e is not None:
                e.used, e.ttl_s = self.clock(), max(e.ttl_s, ttl_s)
                self._entries.move_to_end(key)
                return True
            if held.nbytes > min(self.capacity, self.budget_of(tenant)):
                self.counters["conv_refused"] += 1
                return False
            gone = self._fit(tenant, held.nbytes)
            self._entries[key] = _Entry(held, tenant, ttl_s, self.clock())
            self._tenant_bytes[tenant] += held.nbytes
            self._bytes += held.nbytes
            self.counters["conv_kept"] += 1
        self._dropped(gone)
        return True

    def _fit(self, tenant: str, nbytes: int) -> list:
        """Make room for nbytes of tenant's: its own oldest over its budget, then anyone's
        oldest over the tier's capacity. Under the lock; the keys removed."""
        gone = []
        budget = self.budget_of(tenant)
        if self._tenant_bytes[tenant] + nbytes > budget:
            for k in [k for k, e in self._entries.items() if e.tenant == tenant]:
                if self._tenant_bytes[tenant] + nbytes <= budget:
                    break
                gone.append(self._remove(k, "conv_evicted_budget"))
        while self._entries and self._bytes + nbytes > self.capacity:
            gone.append(self._remove(next(iter(self._entries)), "conv_evicted_capacity"))
        return gone

    def _remove(self, key, counter: str):
        e = self._entries.pop(key)
        self._tenant_bytes[e.tenant] -= e.held.nbytes
        if self._tenant_bytes[e.tenant] <= 0:
            del self._tenant_bytes[e.tenant]
        self._bytes -= e.held.nbytes
        self.counters[counter] += 1
        return key

    def _dropped(self, keys) -> None:
        if self.on_drop is not None:
            for k in keys:
                self.on_drop(k)

    def sweep(self) -> int:
        """Drop every entry idle past its TTL; how many went."""
        now = self.clock()
        with self._lock:
            gone = [self._remove(k, "conv_expired") for k, e in list(self._entries.items())
                    if now - e.used > e.ttl_s]
        self._dropped(gone)
        return len(gone)

    def drop(self, keys) -> int:
        """Drop these keys if held (the origin's drops reach every tier)."""
        with self._lock:
            gone = [self._remove(k, "conv_dropped") for k in keys if k in self._entries]
        self._dropped(gone)
        return len(gone)

    def drop_tenant(self, tenant: str, ns: bytes = None) -> int:
        """Drop a tenant's conversation KV (given ns, of that one conversation namespace)."""
        with self._lock:
            gone = [self._remove(k, "conv_dropped") for k, e in list(self._entries.items())
                    if e.tenant == tenant and (ns is None or e.held.ns == ns)]
        self._dropped(gone)
        return len(gone)

    # --- what an operator sees ---------------------------------------------------------------
    def listing(self, tenant: str) -> list:
        """A tenant's conversations here: per namespace, chunks, bytes and seconds idle."""
        now = self.clock()
        by_ns = {}
        with self._lock:
            for e in self._entries.values():
                if e.tenant == tenant:
                    d = by_ns.setdefault(e.held.ns, {"ns": e.held.ns.hex(), "chunks": 0, "bytes": 0,
                                                     "idle_s": now - e.used, "ttl_s": e.ttl_s})
                    d["chunks"] += 1
                    d["bytes"] += e.held.nbytes
                    d["idle_s"] = min(d["idle_s"], now - e.used)
        return sorted(by_ns.values(), key=lambda d: d["idle_s"])

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict:
        with self._lock:
            return {"bytes": self._bytes, "capacity": self.capacity, "chunks": len(self._entries),
                    "tenant_bytes": dict(self._tenant_bytes),
                    "policies": {t: dict(p) for t, p in self.policies.items()},
                    **self.counters}
