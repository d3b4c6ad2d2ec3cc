"""Eviction policies for the edge's byte-bounded chunk cache: which chunk goes when it is full.

A policy only orders keys; the cache (kdn/edge/cache.py) owns the values, the byte budget and the
lock. The contract is four calls: `insert(key, size)` when a chunk arrives, `touch(key)` on a
hit, `remove(key)` when the cache drops a chunk for its own reasons (discard, pin), and
`evict()` which picks a victim, forgets it and returns its key (None when nothing is left).
Pinned chunks are simply not in the policy, so a policy never has to step over them.

Two policies, because edge traffic is skewed and full of one-hit wonders:
- LRU: the classic; a hit moves the chunk to the most-recent end, the victim is the least
  recent. Every hit reorders a list, and one scan of cold chunks flushes the hot ones.
- S3-FIFO (Yang et al., SOSP'23): three FIFO queues, no reordering on hits. New chunks enter
  a small FIFO (~10% of the bytes); a chunk that is hit while there (2-bit frequency counter)
  is moved to the main FIFO when it reaches the tail, the others are evicted at once and
  remembered (keys only) in a ghost FIFO. A chunk inserted while its key is a ghost goes
  straight to main. Main evicts from its tail, but a chunk with frequency > 0 is reinserted at
  the head with its frequency decremented (lazy promotion, CLOCK-like). One-hit wonders
  therefore leave quickly through the small queue instead of pushing hot chunks out.
"""
from collections import Counter, OrderedDict

from kdn.core.errors import CacheError


class LRU:
    """Least-recently-used order over keys (an OrderedDict: oldest first)."""

    name = "lru"

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self._order: "OrderedDict[object, int]" = OrderedDict()
        self.counters = Counter()     # LRU counts nothing of its own; the cache counts hits

    def insert(self, key, size: int) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def touch(self, key) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key) -> None:
        self._order.pop(key, None)

    def evict(self):
        if not self._order:
            return None
        key, _ = self._order.popitem(last=False)
        return key

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key) -> bool:
        return key in self._order


class S3FIFO:
    """S3-FIFO: small FIFO (probation), main FIFO (lazy promotion), ghost FIFO (keys only).

    Sizes are bytes, so the 10% small-queue share and the ghost's memory are byte budgets.
    `move_threshold` is how many hits a chunk needs while in the small queue to be moved to
    main (1: hit at least once after insertion).
    """

    name = "s3fifo"
    MAX_FREQ = 3  # 2-bit counter

    def __init__(self, capacity_bytes: int, small_ratio: float = 0.1, move_threshold: int = 1):
        if not 0.0 < small_ratio < 1.0:
            raise CacheError(f"S3-FIFO small_ratio must be in (0, 1), got {small_ratio!r}")
        self.capacity = capacity_bytes
        self.small_target = max(1, int(capacity_bytes * small_ratio))
        self.ghost_capacity = max(1, capacity_bytes - self.small_target)
        self.move_threshold = move_threshold
        self._small: "OrderedDict[object, int]" = OrderedDict()  # head = last, tail = first
        self._main: "OrderedDict[object, int]" = OrderedDict()
        self._ghost: "OrderedDict[object, int]" = OrderedDict()
        self._freq: dict = {}
        self.small_bytes = 0
        self.main_bytes = 0
        self.ghost_bytes = 0
        # promotions: small -> main moves; ghost_hits: inserts that went straight to main
        self.counters = Counter()

    def insert(self, key, size: int) -> None:
        self.remove(key)
        self._freq[key] = 0
        if key in self._ghost:
            self.ghost_bytes -= self._ghost.pop(key)
            self.counters["ghost_hits"] += 1
            self._main[key] = size
            self.main_bytes += size
        else:
            self._small[key] = size
            self.small_bytes += size

    def touch(self, key) -> None:
        f = self._freq.get(key)
        if f is not None and f < self.MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            self.small_bytes -= self._small.pop(key)
        else:
            self.main_bytes -= self._main.pop(key)

    def evict(self):
        # Evict from small while it holds its share (or main has nothing); else from main.
        if self._small and (self.small_bytes >= self.small_target or not self._main):
            key = self._evict_small()
            if key is not None:
                return key
        return self._evict_main()

    def _evict_small(self):
        while self._small:
            key, size = self._small.popitem(last=False)
            self.small_bytes -= size
            if self._freq[key] >= self.move_threshold:
                self._main[key] = size
                self.main_bytes += size
                self.counters["promotions"] += 1
                continue
            del self._freq[key]
            self._remember(key, size)
            return key
        return None

    def _evict_main(self):
        while self._main:
            key, size = self._main.popitem(last=False)
            f = self._freq[key]
            if f > 0:
                self._freq[key] = f - 1
                self._main[key] = size  # reinsert at head
                continue
            self.main_bytes -= size
            del self._freq[key]
            return key
        return None

    def _remember(self, key, size: int) -> None:
        self._ghost[key] = size
        self.ghost_bytes += size
        while self.ghost_bytes > self.ghost_capacity and self._ghost:
            _, s = self._ghost.popitem(last=False)
            self.ghost_bytes -= s

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key) -> bool:
        return key in self._freq


def policy_stats(policy) -> dict:
    """A policy's name, size and counters (the cache adds them to its own stats)."""
    return {"policy": policy.name, "policy_items": len(policy), **policy.counters}


POLICIES = {LRU.name: LRU, S3FIFO.name: S3FIFO}


def make_policy(name: str, capacity_bytes: int):
    """The policy called `name` for a cache of `capacity_bytes`; CacheError lists the choices."""
    cls = POLICIES.get(name)
    if cls is None:
        raise CacheError(f"unknown eviction policy {name!r}; choose one of: {', '.join(POLICIES)}")
    return cls(capacity_bytes)
