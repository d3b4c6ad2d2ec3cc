"""The edge's conversation tier: soft KV of prompts workers computed, under budgets and an idle TTL.

A worker that answered a turn stores the conversation's new whole chunks here, at the
conversation's home edge (kdn.core.conversation). Unlike the main and hot tiers, this one is
bounded three ways, all in bytes and seconds:
- its own share of the edge's memory (`capacity`), and with a disk tier (`disk`, an
  kdn/edge/disk.DiskTier of its own) a share of the edge's disk: conversations never evict a
  published KB's chunks, and under pressure they are what goes first (they are recomputable
  history, a KB is what an operator published). Memory's least recently used chunks move to
  the disk rather than go (memory then disk); a read of a chunk on disk brings it back to
  memory, the file kept, so moving it out again writes nothing. What the disk's own capacity
  evicts is gone;
- a budget per tenant, memory and disk together: one tenant's agents cannot crowd out
  another's; a tenant over its budget loses its own least recently used chunks;
- an idle TTL per entry (the tenant's, or what the request's prompt_cache_retention asked
  for within it): every read renews it, and `sweep()` (each tick) and every read drop what
  has been idle longer, from memory and from disk alike. Nothing outlives its TTL in any tier,
  and nothing of it is written anywhere else (the origin only for a tenant an operator
  pinned, below). The disk's files hold no
  tenant and no idle time, so an edge that starts wipes its conversation disk rather than
  keep what it cannot age.
The first bytes stored under a key are kept: a second worker storing the same key (it
computed the same turns) changes nothing but the entry's recency.

One threading.Lock guards the maps and nothing inside it awaits or touches the disk, so it is
safe from the edge's event loop and its worker threads alike; with a disk, call put, get,
get_prefix, put_prefix, sweep and the drops from a worker thread (they read and write files).
Counters: conv_puts, conv_kept, conv_hits, conv_misses, conv_expired, conv_evicted_budget,
conv_evicted_capacity, conv_refused, conv_dropped, conv_spilled (moved to disk),
conv_disk_hits (read back from disk).

A conversation's tail (its trailing partial chunk: kdn.core.conversation.tail_key) is held
the same way, under its own key, and indexed by the whole chunk before it (tails_after).

A pinned tenant's chunks (kdn/origin/conversations.py) are held here the same way, under the
same TTL and budget; the edge (kdn/edge/node.py) also sends them to the origin, which keeps
them durably, and reads them back from there when this tier no longer holds them.
"""
import collections
import threading
import time
from dataclasses import dataclass

from kdn.core.conversation import (IDLE_TTL_S, MAX_TTL_S, TENANT_BUDGET_BYTES, check_budget, check_ttl,
                                   retention_ttl)


@dataclass
class _Entry:
    held: object        # kdn/edge/tiers.Held in memory, or None: on disk only
    tenant: str
    ns: bytes
    nbytes: int
    ttl_s: float
    used: float         # monotonic time of the last put or read
    disk: bool = False  # a file of it is in the disk tier
    at_origin: bool = False   # a pinned tenant's chunk the origin holds too (kdn/origin/conversations.py)
    after: bytes = None       # a tail (a trailing partial chunk): the key of the whole chunk before it
    tokens: int = 0           # a tail's tokens


def held_object(held):
    """The Chunk or Encoded a Held stands for (read from the object store if not held here).
    From a worker thread."""
    if held.obj is not None or held.ref is None:
        return held.obj
    import ray
    return ray.get(held.ref)


def _kept(obj):
    from kdn.edge.tiers import Held
    return Held.kept(obj)


class Conversations:
    """Conversation chunks of every tenant at one edge (see the module)."""

    def __init__(self, capacity_bytes: int, default_ttl_s: float = IDLE_TTL_S,
                 default_budget_bytes: int = TENANT_BUDGET_BYTES, clock=time.monotonic, disk=None,
                 keep=_kept):
        self.capacity = check_budget(capacity_bytes, "conversation capacity")
        self.default_ttl_s = check_ttl(default_ttl_s)
        self.default_budget = check_budget(default_budget_bytes)
        self.clock = clock
        self.disk = disk        # kdn/edge/disk.DiskTier of this tier's own, or None: memory only
        self.keep = keep        # obj -> Held, for a chunk read back from disk
        self._lock = threading.Lock()
        self._entries = collections.OrderedDict()   # key -> _Entry, least recently used first
        self._tenant_bytes = collections.Counter()  # memory and disk
        self._bytes = 0                             # in memory
        self._spilling = {}                         # key -> Held on its way to disk (still readable)
        self._tails = {}                            # key of a whole chunk -> {tail key: its tokens}
        self.policies = {}      # tenant -> {"ttl_s": float, "budget_bytes": int} set by an operator
        self.pinned = frozenset()   # tenants the origin keeps conversations of (its pings say which)
        self._epochs = {}           # pinned tenant -> its epoch at the origin
        self.counters = collections.Counter()
        self.on_drop = None     # called with each key that leaves (the edge's KV events)
        if disk is not None:
            disk.on_change = self._disk_changed

    # --- the operator's settings -------------------------------------------------------------
    def ttl_of(self, tenant: str) -> float:
        return self.policies.get(tenant, {}).get("ttl_s", self.default_ttl_s)

    def budget_of(self, tenant: str) -> int:
        return self.policies.get(tenant, {}).get("budget_bytes", self.default_budget)

    def max_ttl_of(self, tenant: str) -> float:
        return self.policies.get(tenant, {}).get("max_ttl_s", MAX_TTL_S)

    def policy_of(self, tenant: str) -> dict:
        return {"tenant": tenant, "ttl_s": self.ttl_of(tenant), "max_ttl_s": self.max_ttl_of(tenant),
                "budget_bytes": self.budget_of(tenant), "pinned": tenant in self.pinned}

    def differs(self, tenant: str, ttl_s=None, budget_bytes=None, max_ttl_s=None) -> bool:
        """Whether set_policy(tenant, these) would change the tenant's settings here (None:
        not set; the TTL as set_policy caps it by the maximum)."""
        cap = self.max_ttl_of(tenant) if max_ttl_s is None else max_ttl_s
        return ((max_ttl_s is not None and self.max_ttl_of(tenant) != max_ttl_s)
                or (budget_bytes is not None and self.budget_of(tenant) != budget_bytes)
                or (ttl_s is not None and self.ttl_of(tenant) != min(ttl_s, cap)))

    # --- pinned tenants (kdn/origin/conversations.py) -------------------------------------------
    def set_pinned(self, tenants) -> None:
        """The tenants whose conversations the origin keeps (the origin's pings, an operator):
        their names, or {tenant: epoch} (kdn/origin/conversations.py: it moves on with each
        deletion there). A tenant no longer pinned, or whose epoch moved on, has its chunks
        marked as not at the origin: pinned again, they are sent again."""
        epochs = dict(tenants) if isinstance(tenants, dict) else {t: self._epochs.get(t, 0) for t in tenants}
        stale = {t for t, e in self._epochs.items() if epochs.get(t) != e}
        with self._lock:
            self.pinned, self._epochs = frozenset(epochs), epochs
            if stale:
                for e in self._entries.values():
                    if e.tenant in stale:
                        e.at_origin = False

    def epoch_of(self, tenant: str):
        """A pinned tenant's epoch at the origin (its pings say), None when not pinned."""
        return self._epochs.get(tenant) if tenant in self.pinned else None

    def not_at_origin(self, keys) -> list:
        """Those of keys held here that the origin does not hold yet, in order."""
        with self._lock:
            return [k for k in keys if (e := self._live(k)) is not None and not e.at_origin]

    def mark_at_origin(self, keys) -> None:
        with self._lock:
            for k in keys:
                e = self._entries.get(k)
                if e is not None:
                    e.at_origin = True

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
            gone, spill = self._fit(tenant, 0)
        self._after(gone, spill)
        self.sweep()
        return self.policy_of(tenant)

    # --- reads and writes --------------------------------------------------------------------
    def _live(self, key):
        """The entry of key if held and not expired (under the lock)."""
        e = self._entries.get(key)
        return None if e is None or self.clock() - e.used > e.ttl_s else e

    def get(self, key, ns: bytes = None):
        """The Held for key (renewing its idle TTL; read back from disk into memory if only
        there), or None when absent, expired or (given ns) of another namespace, which counts
        and renews nothing."""
        gone, held = [], None
        with self._lock:
            e = self._entries.get(key)
            if e is not None and self.clock() - e.used > e.ttl_s:
                gone.append(self._remove(key, "conv_expired"))
                e = None
            if e is None or (ns is not None and e.ns != ns):
                self.counters["conv_misses"] += 1
                e = None
            else:
                e.used = self.clock()
                self._entries.move_to_end(key)
                held = e.held or self._spilling.get(key)
                if held is not None:
                    self.counters["conv_hits"] += 1
        self._after(gone, [])
        if e is None or held is not None:
            return held
        return self._from_disk(key, e)

    def _from_disk(self, key, entry):
        """Read an entry only on disk back into memory; None (a miss) when the file is gone."""
        obj = self.disk.read(key, entry.ns) if self.disk is not None else None
        held = None if obj is None else self.keep(obj)
        gone, spill = [], []
        with self._lock:
            if self._entries.get(key) is not entry:       # dropped or expired meanwhile
                held = None
            elif held is None:                            # its file went (the disk's capacity)
                gone.append(self._remove(key, "conv_evicted_capacity"))
            elif entry.held is None:
                gone, spill = self._fit(entry.tenant, entry.nbytes, memory_only=True)
                entry.held = held
                self._bytes += entry.nbytes
            else:
                held = entry.held                          # another reader brought it back first
            self.counters["conv_misses" if held is None else "conv_hits"] += 1
            self.counters["conv_disk_hits"] += held is not None
        self._after(gone, spill)
        return held

    def peek(self, key):
        """The Held for key if held in memory and not expired; no counting, no renewal."""
        with self._lock:
            e = self._live(key)
            return None if e is None else e.held or self._spilling.get(key)

    def __contains__(self, key) -> bool:
        """Held here, in memory or on disk, and not expired."""
        with self._lock:
            return self._live(key) is not None

    def put_prefix(self, tenant: str, items, retention: str = None, head=()) -> int:
        """put() each (key, held) of a conversation's consecutive chunks, the last first, each
        then placed before head (the keys of the conversation's chunks before these, which
        they extend; renewed too, those of this tenant and namespace only), so that the earlier
        a chunk the more recent it is: eviction takes a conversation's tail before its head (a
        prefix is worth nothing without its start), during these puts too. held may be None
        for a key already held (it is renewed). How many are held."""
        items = list(items)
        nss = {h.ns for _, h in items if h is not None}
        for k, h in reversed(items):
            self.put(tenant, k, h, retention)
            with self._lock:
                for hk in reversed(head):        # the first chunk the most recent
                    e = self._live(hk)
                    if e is not None and e.tenant == tenant and e.ns in nss:
                        e.used = self.clock()
                        self._entries.move_to_end(hk)
        return next((i for i, (k, _) in enumerate(items) if k not in self), len(items))

    def get_prefix(self, keys, ns: bytes) -> list:
        """The Helds of the longest held prefix of keys (a conversation's consecutive chunks),
        each renewed, the last first (see put_prefix)."""
        n = next((i for i, k in enumerate(keys) if k not in self), len(keys))
        got = [self.get(k, ns) for k in reversed(keys[:n])][::-1]
        return got[:next((i for i, h in enumerate(got) if h is None), len(got))]

    def tails_after(self, key) -> list:
        """[(tokens, tail key)] of the tails held after the whole chunk key, longest first."""
        with self._lock:
            got = [(n, k) for k, n in self._tails.get(key, {}).items() if self._live(k) is not None]
        return sorted(got, reverse=True)

    def drop_tails_after(self, keys) -> int:
        """Drop the tails held after these whole chunks (a longer conversation now holds the
        chunk each was the start of); how many."""
        with self._lock:
            gone = [self._remove(k, "conv_dropped") for after in keys
                    for k in list(self._tails.get(after, ())) if k in self._entries]
        self._after(gone, [])
        return len(gone)

    def put(self, tenant: str, key, held, retention: str = None, after=None, tokens: int = 0) -> bool:
        """Keep held for tenant, idle for as long as retention asks within the tenant's bounds
        (kdn.core.conversation.retention_ttl); False when refused (larger than the tenant's
        budget or the tier) or when held is None and key is not held. A key already held keeps
        its first bytes and is only renewed. after, tokens: held is a conversation's tail, of
        that many tokens after the whole chunk whose key is after (tails_after lists it)."""
        ttl_s = retention_ttl(retention, self.ttl_of(tenant), self.max_ttl_of(tenant))
        with self._lock:
            self.counters["conv_puts"] += 1
            e = self._live(key)
            if e is not None:
                e.used, e.ttl_s = self.clock(), max(e.ttl_s, ttl_s)
                self._entries.move_to_end(key)
                return True
            if held is None:
                return False
            if held.nbytes > min(self.capacity, self.budget_of(tenant)):
                self.counters["conv_refused"] += 1
                return False
            gone = [self._remove(key, "conv_expired")] if key in self._entries else []
            more, spill = self._fit(tenant, held.nbytes)
            self._entries[key] = _Entry(held, tenant, held.ns, held.nbytes, ttl_s, self.clock(),
                                        after=after, tokens=tokens if after is not None else 0)
            if after is not None:
                self._tails.setdefault(after, {})[key] = tokens
            self._tenant_bytes[tenant] += held.nbytes
            self._bytes += held.nbytes
            self.counters["conv_kept"] += 1
        self._after(gone + more, spill)
        return True

    def _fit(self, tenant: str, nbytes: int, memory_only: bool = False) -> tuple:
        """Make room for nbytes of tenant's: its own oldest over its budget (unless
        memory_only: a chunk read back from disk is counted already), then anyone's oldest in
        memory over the tier's capacity, moved to disk where there is one.
        Under the lock; (keys removed, [(key, held)] to write to disk)."""
        gone, spill = [], []
        budget = self.budget_of(tenant)
        if not memory_only and self._tenant_bytes[tenant] + nbytes > budget:
            for k in [k for k, e in self._entries.items() if e.tenant == tenant]:
                if self._tenant_bytes[tenant] + nbytes <= budget:
                    break
                gone.append(self._remove(k, "conv_evicted_budget"))
        if self._bytes + nbytes > self.capacity:
            for k in [k for k, e in self._entries.items() if e.held is not None]:
                if self._bytes + nbytes <= self.capacity:
                    break
                e = self._entries[k]
                if self.disk is None:
                    gone.append(self._remove(k, "conv_evicted_capacity"))
                    continue
                if not e.disk:
                    self._spilling[k] = e.held
                    spill.append((k, e.held))
                e.held = None
                self._bytes -= e.nbytes
                self.counters["conv_spilled"] += 1
        return gone, spill

    def _remove(self, key, counter: str):
        e = self._entries.pop(key)
        if e.after is not None:
            tails = self._tails.get(e.after, {})
            tails.pop(key, None)
            if not tails:
                self._tails.pop(e.after, None)
        self._tenant_bytes[e.tenant] -= e.nbytes
        if self._tenant_bytes[e.tenant] <= 0:
            del self._tenant_bytes[e.tenant]
        if e.held is not None:
            self._bytes -= e.nbytes
        self.counters[counter] += 1
        return key

    def _after(self, gone, spill) -> None:
        """Outside the lock: write what moved to disk, delete the files of what left, tell
        on_drop. A chunk whose write the disk refuses (full, too large, an I/O error) or whose
        file its capacity evicted before it was marked is gone. Whatever a write raises, every
        chunk of spill leaves _spilling and the rest is still done."""
        try:
            for i, (k, held) in enumerate(spill):
                try:
                    self.disk.write(held_object(held))
                except OSError:                   # counted by the disk tier; the chunk is lost
                    pass
                finally:
                    with self._lock:
                        self._spilling.pop(k, None)
                        on_disk = k in self.disk
                        e = self._entries.get(k)
                        if e is None:
                            if on_disk:
                                gone.append(k)    # dropped while it was written: its file goes too
                        elif e.held is None and not on_disk:
                            gone.append(self._remove(k, "conv_evicted_capacity"))
                        else:
                            e.disk = on_disk
        finally:
            with self._lock:
                for k, _ in spill:
                    self._spilling.pop(k, None)
                gone = list(dict.fromkeys(gone))
                files = [k for k in gone if k not in self._entries]   # (put again meanwhile: its own)
            if self.disk is not None:
                for k in files:
                    self.disk.discard(k)
            if self.on_drop is not None:
                for k in gone:
                    self.on_drop(k)

    def _disk_changed(self, key) -> None:
        """The disk tier wrote, evicted or discarded key: an entry whose file the disk's own
        capacity evicted is gone if memory does not hold it."""
        if key in self.disk:
            return
        gone = []
        with self._lock:
            e = self._entries.get(key)
            if e is not None and e.disk and key not in self._spilling:
                e.disk = False
                if e.held is None:
                    gone.append(self._remove(key, "conv_evicted_capacity"))
        if gone and self.on_drop is not None:
            self.on_drop(key)

    def sweep(self) -> int:
        """Drop every entry idle past its TTL, in memory and on disk; how many went."""
        now = self.clock()
        with self._lock:
            gone = [self._remove(k, "conv_expired") for k, e in list(self._entries.items())
                    if now - e.used > e.ttl_s]
        self._after(gone, [])
        return len(gone)

    def drop(self, keys) -> int:
        """Drop these keys if held (the origin's drops reach every tier)."""
        with self._lock:
            gone = [self._remove(k, "conv_dropped") for k in keys if k in self._entries]
        self._after(gone, [])
        return len(gone)

    def drop_tenant(self, tenant: str, ns: bytes = None) -> int:
        """Drop a tenant's conversation KV (given ns, of that one conversation namespace)."""
        with self._lock:
            gone = [self._remove(k, "conv_dropped") for k, e in list(self._entries.items())
                    if e.tenant == tenant and (ns is None or e.ns == ns)]
        self._after(gone, [])
        return len(gone)

    # --- what an operator sees ---------------------------------------------------------------
    def listing(self, tenant: str) -> list:
        """A tenant's conversations here: per namespace, chunks, bytes (on_disk: of them only
        on disk) and seconds idle."""
        now = self.clock()
        by_ns = {}
        with self._lock:
            for e in self._entries.values():
                if e.tenant == tenant:
                    d = by_ns.setdefault(e.ns, {"ns": e.ns.hex(), "chunks": 0, "bytes": 0, "on_disk": 0,
                                                "idle_s": now - e.used, "ttl_s": e.ttl_s})
                    d["chunks"] += 1
                    d["bytes"] += e.nbytes
                    d["on_disk"] += 0 if e.held is not None else e.nbytes
                    d["idle_s"] = min(d["idle_s"], now - e.used)
        return sorted(by_ns.values(), key=lambda d: d["idle_s"])

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)

    def snapshot(self) -> dict:
        """The counters, copied under the lock (worker threads update them)."""
        with self._lock:
            return dict(self.counters)

    def stats(self) -> dict:
        with self._lock:
            out = {"bytes": self._bytes, "capacity": self.capacity, "chunks": len(self._entries),
                   "tenant_bytes": dict(self._tenant_bytes),
                   "policies": {t: dict(p) for t, p in self.policies.items()},
                   "disk_bytes": sum(e.nbytes for e in self._entries.values() if e.held is None),
                   **self.counters}
        if self.disk is not None:
            out["disk_capacity"] = self.disk.capacity
        return out
