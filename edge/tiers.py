"""What an edge holds: two byte-bounded memory tiers of chunks in Ray's object store.

"main" holds the chunks the ring assigns this edge (pushed by the origin at publish, or
refilled on the way through); "hot" holds copies of chunks owned elsewhere that this region
reads often (groupcache's hot cache: a hot copy avoids hammering one owner, and the hot
tier's size is the budget that keeps copies from crowding out main chunks).

A chunk enters a tier once, put into this node's object store, and the tiers hold references
(`Held`): a fetch hands those references out, so a worker on this node maps the KV with no
copy and one elsewhere pulls it straight from this node's store. Evicting a reference frees
the object once no reader still holds it. An operator's TTL makes chunks expire (checked on
every read and swept each tick); a pin takes a chunk out of eviction.
"""
import collections
import time

from kdn.edge.cache import ChunkCache
from kdn.errors import PinCapacityError

ROLES = ("main", "hot")


class Held:
    """A chunk in the object store (a Chunk or an Encoded frame): its reference plus what
    routing needs without fetching it. nbytes is what holding it costs, raw its KV's size;
    own is False for a peer's object (it vanishes with the peer)."""
    __slots__ = ("ref", "key", "ns", "nbytes", "raw", "codec", "dtype", "own", "obj")

    def __init__(self, ref, key: bytes, ns: bytes, nbytes: int, raw: int, codec: str = "raw",
                 dtype: str = "float32", own: bool = True):
        self.ref, self.key, self.ns, self.nbytes, self.raw = ref, key, ns, nbytes, raw
        self.codec, self.dtype, self.own = codec, dtype, own
        self.obj = None        # the object itself, once this process has read it (HTTP)

    @classmethod
    def of(cls, obj) -> "Held":
        """Put a Chunk or an Encoded into this node's object store."""
        import ray
        return cls(ray.put(obj), obj.key, obj.ns, obj.nbytes, obj.raw, obj.codec, obj.dtype)

    async def resolve(self):
        """The object itself; our own objects are read once (a zero-copy view) and kept."""
        if self.obj is not None:
            return self.obj
        obj = await self.ref
        if self.own:
            self.obj = obj
        return obj

    def wire(self) -> tuple:
        """What crosses to another edge (peer_get): the reference and its description."""
        return (self.ref, self.key, self.ns, self.nbytes, self.raw, self.codec, self.dtype)

    @classmethod
    def from_wire(cls, w) -> "Held":
        return cls(*w, own=False)


class Tiers:
    """main and hot ChunkCaches of Held, with TTL expiry and pins."""

    def __init__(self, capacity_bytes: int, policy: str = "s3fifo", hot_fraction: float = 0.25):
        self.capacity = int(capacity_bytes)
        hot_bytes = max(1, int(self.capacity * hot_fraction))
        self.main = ChunkCache(self.capacity - hot_bytes, policy)
        self.hot = ChunkCache(hot_bytes, "lru")   # copies: recency is all that matters
        self.expiry = {}           # key -> monotonic deadline (a KB's TTL, set by an operator)
        self.counters = collections.Counter()

    def tier(self, role: str) -> ChunkCache:
        return self.hot if role == "hot" else self.main

    # --- reads ------------------------------------------------------------------------------
    def get(self, key, ns: bytes = None):
        """The Held for key (main first, then hot), counting the hit; None when absent, expired
        or (given ns) held under another namespace: that is a miss for this reader, and it
        counts and touches nothing that would tell the reader the key exists."""
        if self._expired(key):
            return None
        accept = None if ns is None else (lambda h: h.ns == ns)
        for role in ROLES:
            held = self.tier(role).get(key, accept)
            if held is not None:
                self.counters[role + "_hits"] += 1
                return held
        return None

    def peek(self, key):
        """The Held for key in either tier, without counting or changing recency."""
        return self.main.peek(key) or self.hot.peek(key)

    def holds(self, key, ns: bytes = None) -> bool:
        """Whether key is held (given ns: held under that namespace)."""
        held = self.peek(key)
        return held is not None and (ns is None or held.ns == ns)

    def values(self) -> list:
        return self.main.values() + self.hot.values()

    def __len__(self) -> int:
        return len(self.main) + len(self.hot)

    # --- writes -----------------------------------------------------------------------------
    def put(self, role: str, key, held, pin: bool = False) -> bool:
        """Keep held in tier `role`; a pin that does not fit is kept unpinned rather than not
        at all (and counted)."""
        tier = self.tier(role)
        if pin:
            try:
                return tier.put(key, held, pin=True)
            except PinCapacityError:
                self.counters["pin_refused"] += 1
        return tier.put(key, held)

    def pin(self, keys) -> int:
        """Pin the chunks of keys this edge holds (a hot copy moves to main); how many."""
        n = 0
        for k in keys:
            held = self.peek(k)
            if held is None:
                continue
            try:
                if k in self.main:
                    self.main.pin(k)
                else:
                    self.main.put(k, held, pin=True)
                    self.hot.discard(k)
                n += 1
            except PinCapacityError:
                self.counters["pin_refused"] += 1
        return n

    def drop(self, key) -> bool:
        """Remove key from both tiers; True if it was held."""
        dropped = self.main.discard(key) | self.hot.discard(key)
        self.expiry.pop(key, None)
        return dropped

    # --- TTL --------------------------------------------------------------------------------
    def set_ttl(self, keys, ttl_s: float) -> int:
        """Chunks of keys held now expire ttl_s seconds from now; how many are held."""
        deadline = time.monotonic() + float(ttl_s)
        n = 0
        for k in keys:
            if self.holds(k):
                self.expiry[k] = deadline
                n += 1
        return n

    def expire_later(self, key, ttl_s: float) -> None:
        self.expiry[key] = time.monotonic() + float(ttl_s)

    def _expired(self, key) -> bool:
        deadline = self.expiry.get(key)
        return deadline is not None and deadline <= time.monotonic()

    def sweep(self) -> int:
        """Drop every chunk whose TTL has passed; how many."""
        now = time.monotonic()
        gone = [k for k, t in self.expiry.items() if t <= now]
        for k in gone:
            self.drop(k)
        self.counters["ttl_expired"] += len(gone)
        return len(gone)

    def stats(self) -> dict:
        return {"main": self.main.stats(), "hot": self.hot.stats(),
                "held_raw_bytes": sum(h.raw for h in self.values()), "hot_copies": len(self.hot),
                "expiring": len(self.expiry), "counters": dict(self.counters)}
