"""The edge's memory tier: a byte-bounded map from chunk key to chunk, with pinning.

Capacity is counted in bytes, not entries, because chunks of different models differ in size
by orders of magnitude. When a new chunk does not fit, the eviction policy (kdn/edge/eviction.py,
LRU or S3-FIFO) names victims until it does. Pinned chunks (a KB an operator pins in a
region) are taken out of the policy, so they are never victims; their total may not exceed
the capacity, and a pin that would is refused before anything changes. A chunk bigger than
the whole cache is refused and counted, rather than flushing everything for nothing.
One threading.Lock guards everything and nothing inside it awaits, so the cache is safe from
an async actor's event loop and from worker threads alike. Counters (gets, hits, misses,
puts, evictions, rejected) are a Counter, exported by stats() with the sizes. on_evict(key,
value), when given, is told of each victim after the lock is released (the edge writes its
memory tiers' victims to its disk tier, and the disk tier deletes its victims' files).
"""
import collections
import threading

from kdn.core.checks import check_int
from kdn.edge.eviction import make_policy, policy_stats
from kdn.core.errors import CacheError, PinCapacityError


def _size_of(value, nbytes):
    if nbytes is None:
        nbytes = getattr(value, "nbytes", None)
        if nbytes is None:
            raise CacheError(f"cannot size a {type(value).__name__} value: pass nbytes")
    return check_int(nbytes, "nbytes", 0, error=CacheError)


class ChunkCache:
    """Byte-bounded key -> value cache with a pluggable eviction policy and pinning."""

    def __init__(self, capacity_bytes: int, policy: str = "lru", on_evict=None):
        self.capacity = check_int(capacity_bytes, "capacity_bytes", 1, error=CacheError)
        self._policy = make_policy(policy, capacity_bytes)
        self._lock = threading.Lock()
        self._entries: dict = {}  # key -> (value, nbytes)
        self._pinned: set = set()
        self._bytes = 0
        self._pinned_bytes = 0
        self._on_evict = on_evict
        self.counters = collections.Counter()

    @property
    def policy(self) -> str:
        return self._policy.name

    # --- reads -------------------------------------------------------------------------
    def get(self, key, accept=None):
        """The value for key or None; counts a hit or miss and tells the policy of the hit.

        accept(value) -> bool, when given, decides whether the value answers this caller: one
        it refuses (a chunk of another namespace) is a miss, and its recency is not touched.
        """
        with self._lock:
            self.counters["gets"] += 1
            entry = self._entries.get(key)
            if entry is None or (accept is not None and not accept(entry[0])):
                self.counters["misses"] += 1
                return None
            self.counters["hits"] += 1
            if key not in self._pinned:
                self._policy.touch(key)
            return entry[0]

    def peek(self, key):
        """The value for key or None, without counting or changing recency."""
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry[0]

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def values(self) -> list:
        """The values held (a snapshot)."""
        with self._lock:
            return [v for v, _ in self._entries.values()]

    def keys(self) -> list:
        with self._lock:
            return list(self._entries)

    # --- writes ------------------------------------------------------------------------
    def put(self, key, value, nbytes: int | None = None, pin: bool = False) -> bool:
        """Store value under key, evicting by policy to make room; True when stored.

        A value that cannot fit even after evicting every unpinned chunk is refused (False,
        counted as rejected) and nothing is evicted. With pin=True the value is pinned; if the
        pinned total would exceed the capacity, PinCapacityError and nothing changes.
        """
        size = _size_of(value, nbytes)
        victims = []
        try:
            with self._lock:
                return self._put(key, value, size, pin, victims)
        finally:
            if self._on_evict is not None:
                for victim in victims:
                    self._on_evict(*victim)

    def _put(self, key, value, size: int, pin: bool, victims: list) -> bool:
        self.counters["puts"] += 1
        old = self._entries.get(key)
        old_size = old[1] if old is not None else 0
        was_pinned = key in self._pinned
        pinned_after = self._pinned_bytes - (old_size if was_pinned else 0)
        if pin or was_pinned:
            if pinned_after + size > self.capacity:
                if pin:
                    raise PinCapacityError(
                        f"cannot pin {size} bytes: {pinned_after} of {self.capacity} bytes "
                        f"are already pinned ({self.capacity - pinned_after} free for pins)")
                self.counters["rejected"] += 1
                return False
        elif pinned_after + size > self.capacity:
            self.counters["rejected"] += 1
            return False
        # It fits once unpinned chunks make room: drop the old entry, then evict.
        if old is not None:
            self._drop(key)
        while self._bytes + size > self.capacity:
            victim = self._policy.evict()
            if victim is None:  # cannot happen given the check above; stay consistent
                self.counters["rejected"] += 1
                return False
            gone, gone_size = self._entries.pop(victim)
            self._bytes -= gone_size
            victims.append((victim, gone))
            self.counters["evictions"] += 1
        self._entries[key] = (value, size)
        self._bytes += size
        if pin or was_pinned:
            self._pinned.add(key)
            self._pinned_bytes += size
        else:
            self._policy.insert(key, size)
        return True

    def pin(self, key) -> None:
        """Make key's cached chunk unevictable; CacheError if it is not cached.

        This always fits: the chunk's bytes already count against the capacity, so pinned
        bytes stay within it. Pinning what is not yet cached goes through put(pin=True),
        which is where PinCapacityError is raised.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise CacheError(f"cannot pin {key!r}: not in the cache")
            if key in self._pinned:
                return
            size = entry[1]
            self._policy.remove(key)
            self._pinned.add(key)
            self._pinned_bytes += size

    def is_pinned(self, key) -> bool:
        with self._lock:
            return key in self._pinned

    def pinned_bytes(self) -> int:
        with self._lock:
            return self._pinned_bytes

    def unpin(self, key) -> None:
        """Make key's chunk evictable again (it re-enters the policy as newly inserted)."""
        with self._lock:
            if key not in self._entries:
                raise CacheError(f"cannot unpin {key!r}: not in the cache")
            if key not in self._pinned:
                return
            self._pinned.discard(key)
            size = self._entries[key][1]
            self._pinned_bytes -= size
            self._policy.insert(key, size)

    def discard(self, key) -> bool:
        """Remove key (pinned or not); True if it was there. Not counted as an eviction."""
        with self._lock:
            if key not in self._entries:
                return False
            self._drop(key)
            return True

    def _drop(self, key) -> None:
        value, size = self._entries.pop(key)
        self._bytes -= size
        if key in self._pinned:
            self._pinned.discard(key)
            self._pinned_bytes -= size
        else:
            self._policy.remove(key)

    # --- counters ----------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            c = {k: self.counters[k] for k in ("gets", "hits", "misses", "puts", "evictions",
                                                "rejected")}
            return dict(c, hit_ratio=c["hits"] / c["gets"] if c["gets"] else 0.0,
                        bytes=self._bytes, items=len(self._entries),
                        pinned_bytes=self._pinned_bytes, pinned_items=len(self._pinned),
                        capacity=self.capacity, **policy_stats(self._policy))
