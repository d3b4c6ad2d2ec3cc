"""Which chunks get a hot copy in which region, decided from the demand each region shows.

More virtual nodes cannot fix a hot key: at Zipf 1.0 one chunk can carry more requests
than a whole edge's share, and every reader outside its owner's region pays a WAN trip
for it. groupcache answers with a hot cache filled by chance; here the edges report each
request (record) and the policy keeps, per (chunk, region), an exponentially decayed
request count, i.e. a rate with a half-life. decide() promotes a chunk into a region when
its rate there reaches `promote_rate`, demotes it when the rate falls below the lower
`demote_rate` (the gap is hysteresis: no flapping at the threshold), and never lets hot
copies take more than `hot_budget_fraction` of a region's edge bytes; when the budget is
full a candidate displaces the coldest copy only if it is `displace_ratio` times hotter.
A chunk is never promoted into a region that already holds one of its owners.

Operators override per knowledge base: pin it to regions (promoted there regardless of
demand, never demoted, counted against the budget first), set its replica count (read
by whoever pushes to ring owners), a TTL (a hot copy idle that long in a region is
demoted whatever its rate) and prefetch (push it to the pinned regions at publish).

decide() returns the changes and takes them as done; `drop()` tells the policy an edge
lost a copy on its own (eviction, restart).
"""
from __future__ import annotations

import bisect
import collections
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from kdn.core.checks import check_int
from kdn.core.errors import PlacementError

LN2 = math.log(2.0)


@dataclass
class Decision:
    """Hot-copy changes: (key, region) pairs to create and to drop."""
    promote: list = field(default_factory=list)
    demote: list = field(default_factory=list)

    def __bool__(self):
        return bool(self.promote or self.demote)


@dataclass(frozen=True)
class Override:
    """An operator's settings for one knowledge base."""
    kb: str
    pin_regions: tuple = ()
    replicas: int | None = None
    ttl_s: float | None = None
    prefetch: bool = False


class _Round:
    """One decide() call: its time, its Decision, each (key, region)'s last request, and
    the owner regions asked of owners_region so far (once per key per call)."""

    def __init__(self, now: float, out: Decision, owners_region, last: dict):
        self.now, self.out, self.last = now, out, last
        self._owners_region = owners_region
        self._owners: dict[bytes, frozenset] = {}

    def owner_regions(self, key: bytes) -> frozenset:
        if self._owners_region is None:
            return frozenset()
        o = self._owners.get(key)
        if o is None:
            r = self._owners_region(key)
            o = self._owners[key] = frozenset([r] if isinstance(r, str) else r)
        return o


class ReplicationPolicy:
    """Demand-driven hot copies per region, with hysteresis, a byte budget and overrides."""

    def __init__(self, half_life_s: float = 300.0, promote_rate: float = 1 / 60,
                 demote_rate: float | None = None, hot_budget_fraction: float = 0.25,
                 displace_ratio: float = 2.0, forget_below: float = 0.05,
                 region_capacity_bytes: dict[str, int] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        """Rates are requests per second in one region. demote_rate defaults to a tenth of
        promote_rate. Demand below `forget_below` decayed requests is forgotten (memory)."""
        if not half_life_s > 0:
            raise PlacementError(f"half_life_s must be > 0, got {half_life_s!r}")
        if not promote_rate > 0:
            raise PlacementError(f"promote_rate must be > 0, got {promote_rate!r}")
        demote_rate = promote_rate / 10 if demote_rate is None else demote_rate
        if not 0 <= demote_rate <= promote_rate:
            raise PlacementError(f"demote_rate must be in [0, promote_rate={promote_rate}], got {demote_rate!r}")
        if not 0 <= hot_budget_fraction <= 1:
            raise PlacementError(f"hot_budget_fraction must be in [0, 1], got {hot_budget_fraction!r}")
        if not displace_ratio >= 1:
            raise PlacementError(f"displace_ratio must be >= 1, got {displace_ratio!r}")
        self.half_life_s = float(half_life_s)
        self.promote_rate = float(promote_rate)
        self.demote_rate = float(demote_rate)
        self.hot_budget_fraction = float(hot_budget_fraction)
        self.displace_ratio = float(displace_ratio)
        self.forget_below = float(forget_below)
        self.region_capacity_bytes = dict(region_capacity_bytes or {})
        self.clock = clock
        self._k = LN2 / self.half_life_s
        self._demand: dict[tuple[bytes, str], list] = {}   # (key, region) -> [count, t_last]
        self._size: dict[bytes, int] = {}
        self._kb: dict[bytes, str] = {}
        self._kb_keys: dict[str, set] = {}
        self._hot: dict[str, dict[bytes, float]] = {}     # region -> key -> promoted at
        self._hot_bytes: dict[str, int] = {}
        self._overrides: dict[str, Override] = {}
        self.counters = collections.Counter(
            records=0, decisions=0, promotions=0, demotions=0, displaced=0, pinned=0,
            budget_refused=0, redundant=0, cold=0, expired=0, dropped=0, forgotten=0)

    # --- input -----------------------------------------------------------------------
    def _learn(self, key: bytes, nbytes: int, kb: str | None):
        if not isinstance(key, (bytes, bytearray)):
            raise PlacementError(f"keys must be bytes, got {type(key).__name__}")
        check_int(nbytes, "nbytes", 0, error=PlacementError)
        self._size[key] = nbytes
        if kb is not None and self._kb.get(key) != kb:
            self._kb[key] = kb
            self._kb_keys.setdefault(kb, set()).add(key)

    def record(self, key: bytes, region: str, nbytes: int, now: float | None = None,
               kb: str | None = None) -> None:
        """One request for key from a reader in region (nbytes: the chunk's size)."""
        now = self.clock() if now is None else now
        self._learn(key, nbytes, kb)
        d = self._demand.get((key, region))
        if d is None:
            self._demand[(key, region)] = [1.0, now]
        else:
            dt = now - d[1]
            d[0] = d[0] * math.exp(-self._k * dt) + 1.0 if dt > 0 else d[0] + 1.0
            if dt > 0:
                d[1] = now
        self.counters["records"] += 1

    def register(self, kb: str, keys: Iterable[bytes], nbytes) -> None:
        """Tell the policy a knowledge base's chunks (sizes: one int, or one per key) so pins
        and prefetch cover chunks nobody has requested yet."""
        keys = list(keys)
        sizes = [nbytes] * len(keys) if isinstance(nbytes, int) else list(nbytes)
        if len(sizes) != len(keys):
            raise PlacementError(f"register({kb!r}): {len(sizes)} sizes for {len(keys)} keys")
        for k, n in zip(keys, sizes):
            self._learn(k, n, kb)

    def drop(self, key: bytes, region: str) -> None:
        """An edge lost its hot copy of key (eviction, restart): forget it was there."""
        hot = self._hot.get(region)
        if hot is not None and key in hot:
            del hot[key]
            self._hot_bytes[region] -= self._size.get(key, 0)
            self.counters["dropped"] += 1

    # --- operator controls -----------------------------------------------------------
    def set_override(self, kb: str, pin_regions: Iterable[str] = (), replicas: int | None = None,
                     ttl_s: float | None = None, prefetch: bool = False) -> Override:
        if not isinstance(kb, str) or not kb:
            raise PlacementError(f"override needs a knowledge-base name, got {kb!r}")
        if replicas is not None:
            check_int(replicas, f"override {kb!r}: replicas", 1, error=PlacementError)
        if ttl_s is not None and not (isinstance(ttl_s, (int, float)) and ttl_s > 0):
            raise PlacementError(f"override {kb!r}: ttl_s must be > 0 seconds, got {ttl_s!r}")
        pins = tuple(sorted(set(pin_regions)))
        if prefetch and not pins:
            raise PlacementError(f"override {kb!r}: prefetch needs pin_regions to prefetch into")
        o = Override(kb, pins, replicas, None if ttl_s is None else float(ttl_s), bool(prefetch))
        self._overrides[kb] = o
        return o

    def clear_override(self, kb: str) -> None:
        self._overrides.pop(kb, None)

    def override(self, kb: str) -> Override | None:
        return self._overrides.get(kb)

    def replicas(self, kb: str | None, default: int = 1) -> int:
        o = self._overrides.get(kb) if kb is not None else None
        return o.replicas if o is not None and o.replicas is not None else default

    def prefetch_keys(self, kb: str) -> dict[str, list[bytes]]:
        """Region -> the KB's known chunks to push there now (prefetch overrides only)."""
        o = self._overrides.get(kb)
        if o is None or not o.prefetch:
            return {}
        keys = sorted(self._kb_keys.get(kb, ()))
        return {r: keys for r in o.pin_regions}

    # --- queries ---------------------------------------------------------------------
    def _rate_of(self, d, now) -> float:
        dt = max(0.0, now - d[1])
        return d[0] * math.exp(-self._k * dt) * self._k

    def rate(self, key: bytes, region: str, now: float | None = None) -> float:
        """Requests per second for key in region, decayed to now."""
        d = self._demand.get((key, region))
        return 0.0 if d is None else self._rate_of(d, self.clock() if now is None else now)

    def hot(self, region: str) -> set:
        return set(self._hot.get(region, ()))

    def hot_bytes(self, region: str | None = None):
        return dict(self._hot_bytes) if region is None else self._hot_bytes.get(region, 0)

    def budget(self, region: str, region_capacity_bytes: dict | None = None) -> float:
        caps = region_capacity_bytes if region_capacity_bytes is not None else self.region_capacity_bytes
        cap = caps.get(region)
        return math.inf if cap is None else self.hot_budget_fraction * cap

    # --- the decision ----------------------------------------------------------------
    def decide(self, now: float | None = None, region_capacity_bytes: dict[str, int] | None = None,
               owners_region: Callable[[bytes], Iterable[str] | str] | None = None) -> Decision:
        """Promote and demote hot copies for every region from the demand seen so far.

        region_capacity_bytes: region -> its edges' total bytes (budget = fraction of it;
        a region not listed has no byte limit). owners_region(key): region(s) of the key's
        ring owners, where a hot copy would be redundant.
        """
        now = self.clock() if now is None else now
        self.counters["decisions"] += 1
        rates, last = self._rates(now)
        pins = self._pins()
        rnd = _Round(now, Decision(), owners_region, last)
        for region in sorted(set(rates) | set(self._hot) | set(pins)):
            self._decide_region(rnd, region, rates.get(region, {}), pins.get(region, set()),
                                self.budget(region, region_capacity_bytes))
        return rnd.out

    def _rates(self, now: float) -> tuple:
        """(region -> key -> request rate, (key, region) -> time of its last request); demand
        decayed to nothing (and not held hot) is forgotten."""
        rates: dict[str, dict[bytes, float]] = {}
        last: dict[tuple, float] = {}
        forget = self.forget_below * self._k
        for (key, region), d in list(self._demand.items()):
            r = self._rate_of(d, now)
            if r < forget and key not in self._hot.get(region, ()):
                del self._demand[(key, region)]
                self.counters["forgotten"] += 1
                continue
            rates.setdefault(region, {})[key] = r
            last[(key, region)] = d[1]
        return rates, last

    def _pins(self) -> dict:
        """region -> the keys operators pin there."""
        pins: dict[str, set] = {}
        for kb, o in self._overrides.items():
            for reg in o.pin_regions:
                pins.setdefault(reg, set()).update(self._kb_keys.get(kb, ()))
        return pins

    def _demote(self, rnd: _Round, key: bytes, region: str, why: str) -> None:
        del self._hot[region][key]
        self._hot_bytes[region] -= self._size.get(key, 0)
        rnd.out.demote.append((key, region))
        self.counters["demotions"] += 1
        self.counters[why] += 1

    def _promote(self, rnd: _Round, key: bytes, region: str) -> None:
        self._hot.setdefault(region, {})[key] = rnd.now
        self._hot_bytes[region] = self._hot_bytes.get(region, 0) + self._size.get(key, 0)
        rnd.out.promote.append((key, region))
        self.counters["promotions"] += 1

    def _idle_past_ttl(self, rnd: _Round, key: bytes, region: str) -> bool:
        o = self._overrides.get(self._kb.get(key))
        return o is not None and o.ttl_s is not None and rnd.now - rnd.last.get((key, region), rnd.now) > o.ttl_s

    def _decide_region(self, rnd: _Round, region: str, rr: dict, pinned: set, budget: float) -> None:
        """One region's changes: drops, pins, shedding over budget, then promotions."""
        hot = self._hot.setdefault(region, {})
        # 1. drop copies that are redundant, cold, or idle past their KB's TTL
        for key in sorted(hot):
            if region in rnd.owner_regions(key):
                self._demote(rnd, key, region, "redundant")
            elif key in pinned:
                continue
            elif rr.get(key, 0.0) < self.demote_rate:
                self._demote(rnd, key, region, "cold")
            elif self._idle_past_ttl(rnd, key, region):
                self._demote(rnd, key, region, "expired")
        # 2. pins: always, first
        for key in sorted(pinned):
            if key not in hot and region not in rnd.owner_regions(key):
                self._promote(rnd, key, region)
                self.counters["pinned"] += 1
        # 3. over budget (capacity shrank, pins grew): shed the coldest unpinned copies
        if self._hot_bytes.get(region, 0) > budget:
            for key in sorted((k for k in hot if k not in pinned), key=lambda k: (rr.get(k, 0.0), k)):
                if self._hot_bytes[region] <= budget:
                    break
                self._demote(rnd, key, region, "displaced")
        self._promote_hottest(rnd, region, rr, pinned, budget)

    def _promote_hottest(self, rnd: _Round, region: str, rr: dict, pinned: set, budget: float) -> None:
        """4. candidates hottest first: fit in the budget, or displace much colder copies."""
        hot = self._hot[region]
        cands = sorted(((r, k) for k, r in rr.items() if r >= self.promote_rate and k not in hot),
                       key=lambda t: (-t[0], t[1]))
        victims = sorted((rr.get(k, 0.0), k) for k in hot if k not in pinned)   # coldest first
        for r, key in cands:
            if region in rnd.owner_regions(key) or self._idle_past_ttl(rnd, key, region):
                continue
            size = self._size.get(key, 0)
            need = self._hot_bytes.get(region, 0) + size - budget
            if need > 0:
                freed, n = 0, 0
                for vr, vk in victims:
                    if freed >= need or vr * self.displace_ratio >= r:
                        break
                    freed += self._size.get(vk, 0)
                    n += 1
                if freed < need:
                    self.counters["budget_refused"] += 1
                    continue
                for vr, vk in victims[:n]:
                    self._demote(rnd, vk, region, "displaced")
                del victims[:n]
            self._promote(rnd, key, region)
            bisect.insort(victims, (r, key))

    def stats(self) -> dict:
        return {**self.counters, "tracked": len(self._demand), "keys": len(self._size),
                "overrides": len(self._overrides),
                "hot_copies": {r: len(h) for r, h in self._hot.items() if h},
                "hot_bytes": {r: b for r, b in self._hot_bytes.items() if b}}
