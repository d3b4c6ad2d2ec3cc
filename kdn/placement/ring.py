"""Which edges own a chunk: weighted rendezvous hashing, spread across regions, bounded loads.

Every edge gets a score for every key, `-ln(u) / weight` with `u` a uniform draw from the
64-bit mix of the key's xxh3 digest and the edge's name digest; the edge with the lowest
score owns the key, the next lowest is its second choice, and so on (highest-random-weight
hashing, Thaler & Ravishankar 1998, weighted as in Schindelhauer & Schomaker 2005). Scores
depend only on the key and the edge, so adding an edge moves exactly the keys it now wins
(its weight share) and removing one moves exactly the keys it owned: nobody else's ranking
changes. Hashing is xxh3, never Python's `hash` builtin, and with equal weights the ranking is
pure 64-bit integer arithmetic, so every process on every machine computes the same owners
(with unequal weights it goes through one float log per score, IEEE-exact in practice).

Why rendezvous rather than a ring of virtual nodes (measured by `kdn bench placement
--ring`, 16 edges, 1M keys): rendezvous balances to max/mean 1.01 and a join moves 1/17 of
the keys, all to the newcomer; a virtual-node ring is at 1.24 with 100 points per edge and
1.06 with 1000 (16,000 points to keep in step). Its cost is O(edges) per key instead of
O(log points), but the scoring is one vectorized numpy pass (well under a microsecond per
key at tens of edges), the second, third ... choices come for free in the same ranking, and
weights are exact shares rather than point counts. Past a few hundred edges a ring would
win on lookup cost; KDN runs tens of edges.

`owners(key, r)` keeps the first choice pure (the hash winner) and then prefers edges in
regions not yet used, so r replicas survive a region outage when there are r regions.
`assign_bounded` is consistent hashing with bounded loads (Mirrokni, Thorup and
Zadimoghaddam 2018): each key walks its own ranking to the first edge with room under
`c * mean` (capacity-weighted), heaviest keys first, so a Zipf-hot key cannot overload its
winner while every other key stays on its first choice when it can.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import xxhash

from kdn.core.checks import check_number
from kdn.core.errors import PlacementError

_BATCH = 65536                         # keys scored per numpy pass (bounds temporary memory)
_M1 = np.uint64(0xFF51AFD7ED558CCD)    # murmur3 fmix64 constants
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S33 = np.uint64(33)
_S11 = np.uint64(11)


@dataclass(frozen=True)
class Edge:
    """One edge node: its unique name, its region, and its weight (relative capacity)."""
    name: str
    region: str
    weight: float = 1.0


def key_hashes(keys) -> np.ndarray:
    """The 64-bit xxh3 digest of each key (bytes), as a uint64 array."""
    keys = list(keys)
    try:
        return np.fromiter(map(xxhash.xxh3_64_intdigest, keys), dtype=np.uint64,
                           count=len(keys))
    except TypeError as e:
        bad = next(k for k in keys if not isinstance(k, (bytes, bytearray, memoryview)))
        raise PlacementError(f"keys must be bytes, got {type(bad).__name__} {bad!r:.60}") from e


def _fmix64(k: np.ndarray) -> np.ndarray:
    k = k ^ (k >> _S33)
    k = k * _M1
    k = k ^ (k >> _S33)
    k = k * _M2
    return k ^ (k >> _S33)


class Ring:
    """The set of live edges and, for any key, their order of preference for it.

    `Ring(edges)` or `Ring(topology=topo)` (edges, regions and capacity weights taken from
    the topology). Membership changes with add()/remove(); `version` counts changes and
    `digest()` names the membership so two processes can tell whether they agree.
    """

    def __init__(self, edges: Iterable[Edge] = (), topology=None):
        self.topology = topology
        self._edges: dict[str, Edge] = {}
        self.version = 0
        self.lookups = 0           # keys ranked by owners()/owners_batch()
        self.bounded_runs = 0      # assign_bounded() calls
        self.bounded_spilled = 0   # keys that did not get their first choice
        self.bounded_over = 0      # keys that fit nowhere under the bound (heavier than it)
        edges = list(edges)
        if not edges and topology is not None:
            edges = list(topology.edges)
        for e in edges:
            self._add(e)
        self._rebuild()

    # --- membership ------------------------------------------------------------------
    def _add(self, edge: Edge) -> None:
        if not isinstance(edge, Edge):
            raise PlacementError(f"ring members must be Edge, got {type(edge).__name__} {edge!r:.60}")
        if not edge.name or not isinstance(edge.name, str):
            raise PlacementError(f"edge name must be a non-empty string, got {edge.name!r}")
        if not isinstance(edge.region, str) or not edge.region:
            raise PlacementError(f"edge {edge.name!r}: region must be a non-empty string, got {edge.region!r}")
        check_number(edge.weight, f"edge {edge.name!r}: weight", 0, open_lo=True, error=PlacementError)
        if edge.name in self._edges:
            raise PlacementError(f"edge {edge.name!r} is already on the ring")
        self._edges[edge.name] = edge

    def _rebuild(self) -> None:
        es = sorted(self._edges.values(), key=lambda e: e.name)
        self._list = es
        self._names = np.array([e.name for e in es], dtype=object)
        self._seeds = np.array([xxhash.xxh3_64_intdigest(e.name.encode()) for e in es],
                               dtype=np.uint64)
        self._weights = np.array([float(e.weight) for e in es], dtype=np.float64)
        self._uniform = len(set(self._weights.tolist())) <= 1
        regions = sorted({e.region for e in es})
        self._region_names = regions
        rix = {r: i for i, r in enumerate(regions)}
        self._region_idx = np.array([rix[e.region] for e in es], dtype=np.int32)
        self._index = {e.name: i for i, e in enumerate(es)}

    def add(self, edge: Edge) -> None:
        """Add an edge; it takes over exactly the keys whose ranking it now tops."""
        self._add(edge)
        self.version += 1
        self._rebuild()

    def remove(self, name: str) -> Edge:
        """Remove an edge by name and return it; only the keys it owned move."""
        if name not in self._edges:
            raise PlacementError(f"edge {name!r} is not on the ring (members: {sorted(self._edges)})")
        e = self._edges.pop(name)
        self.version += 1
        self._rebuild()
        return e

    @property
    def edges(self) -> list[Edge]:
        return list(self._list)

    @property
    def regions(self) -> list[str]:
        return list(self._region_names)

    def region_of(self, name: str) -> str:
        if name not in self._edges:
            raise PlacementError(f"edge {name!r} is not on the ring")
        return self._edges[name].region

    def __len__(self) -> int:
        return len(self._edges)

    def __contains__(self, name) -> bool:
        return name in self._edges

    def __repr__(self) -> str:
        return f"Ring({len(self)} edges, {len(self._region_names)} regions, version {self.version})"

    def digest(self) -> str:
        """A stable hex digest of the membership (names, regions, weights), same in every process."""
        h = xxhash.xxh3_128()
        for e in self._list:
            h.update(f"{e.name}\x00{e.region}\x00{float(e.weight)!r}\x01".encode())
        return h.hexdigest()

    # --- ranking ---------------------------------------------------------------------
    def _need_edges(self):
        if not self._edges:
            raise PlacementError("the ring has no edges")

    def _order(self, h: np.ndarray, cols: np.ndarray | None = None, full: bool = True) -> np.ndarray:
        """Edge indices in preference order for each key hash (rows), or the winner only.

        With equal weights the ranking is the integer mix itself (exact on every machine);
        with weights it is -ln(u)/w, u the top 53 bits of the mix as a uniform in (0, 1).
        """
        seeds = self._seeds if cols is None else self._seeds[cols]
        mix = _fmix64(h[:, None] ^ seeds[None, :])
        uniform = self._uniform if cols is None else len(set(self._weights[cols].tolist())) <= 1
        if uniform:
            if not full:
                out = np.argmax(mix, axis=1)
            else:
                out = np.argsort(~mix, axis=1, kind="stable")
        else:
            w = self._weights if cols is None else self._weights[cols]
            u = ((mix >> _S11).astype(np.float64) + 0.5) * (1.0 / 9007199254740992.0)
            score = -np.log(u) / w[None, :]
            out = np.argmin(score, axis=1) if not full else np.argsort(score, axis=1, kind="stable")
        return out if cols is None else cols[out]

    def _spread(self, order: np.ndarray, r: int) -> np.ndarray:
        """First r of each row, taking the first edge of each unused region before repeats."""
        if r == 1:
            return order[:, :1]
        reg = self._region_idx[order]
        first = np.zeros(order.shape, dtype=bool)
        first[:, 0] = True
        for g in range(len(self._region_names)):
            m = reg == g
            first |= m & (np.cumsum(m, axis=1) == 1)
        pick = np.argsort(~first, axis=1, kind="stable")[:, :r]
        return np.take_along_axis(order, pick, axis=1)

    def _owner_idx(self, h: np.ndarray, r: int) -> np.ndarray:
        n = len(self._list)
        r = min(max(int(r), 1), n)
        if r == 1:
            return self._order(h, full=False)[:, None]
        return self._spread(self._order(h), r)

    def owners(self, key: bytes, r: int = 1) -> list[str]:
        """r distinct edge names for key in preference order (all edges if r >= len)."""
        return self.owners_batch([key], r)[0]

    def owner(self, key: bytes) -> str:
        return self.owners_batch([key], 1)[0][0]

    def owners_batch(self, keys: list[bytes], r: int = 1) -> list[list[str]]:
        """owners() for many keys in vectorized passes: the fast path for a fetch or a push."""
        self._need_edges()
        if r < 1:
            raise PlacementError(f"r must be >= 1, got {r!r}")
        h = key_hashes(keys)
        self.lookups += len(h)
        out: list[list[str]] = []
        for s in range(0, len(h), _BATCH):
            idx = self._owner_idx(h[s:s + _BATCH], r)
            out.extend(self._names[idx].tolist())
        return out

    def owner_indices(self, keys: list[bytes], r: int = 1) -> np.ndarray:
        """Like owners_batch but as an (m, r) int array of positions in `edges` (benchmarks)."""
        self._need_edges()
        h = key_hashes(keys)
        self.lookups += len(h)
        parts = [self._owner_idx(h[s:s + _BATCH], r) for s in range(0, len(h), _BATCH)]
        return np.concatenate(parts) if parts else np.zeros((0, min(r, len(self))), dtype=np.int64)

    def owners_in(self, key: bytes, region: str, r: int = 1) -> list[str]:
        """The key's ranking restricted to one region's edges: where a region keeps its hot copy."""
        cols = np.flatnonzero(self._region_idx == self._region_names.index(region)) \
            if region in self._region_names else np.zeros(0, dtype=np.int64)
        if len(cols) == 0:
            raise PlacementError(f"no edge of the ring is in region {region!r} (regions: {self._region_names})")
        order = self._order(key_hashes([key]), cols=cols)
        return self._names[order[0, :max(1, r)]].tolist()

    def nearest(self, key: bytes, reader_region: str, r: int = 1, nbytes: int = 0,
                queue_bytes: dict | None = None) -> list[str]:
        """The key's r owners ordered nearest-first for a reader (needs a topology for times;
        without one, owners in the reader's region first, then preference order)."""
        own = self.owners(key, r)
        if self.topology is not None:
            return self.topology.rank_sources(
                reader_region, [(n, self._edges[n].region) for n in own], nbytes, queue_bytes)
        return sorted(own, key=lambda n: self._edges[n].region != reader_region)

    # --- bounded loads ---------------------------------------------------------------
    def assign_bounded(self, keys: list[bytes], c: float = 1.25,
                       loads: list[float] | None = None) -> dict[bytes, str]:
        """One owner per key such that no edge carries more than c times its share of the load.

        An edge's bound is c * total_load * weight / total_weight (rounded up for unit
        loads). Keys are placed heaviest first, ties by key digest (so the result depends on
        the key set, not the list order); each key takes the first edge of its ranking with
        room. A key heavier than every remaining room goes to the edge it overloads least
        (counted in stats()['bounded_over']). Duplicate keys are merged, loads summed.
        """
        self._need_edges()
        check_number(c, "bounded-load factor c", 1, error=PlacementError)
        keys = list(keys)
        if loads is None:
            w = np.ones(len(keys), dtype=np.float64)
        else:
            w = np.asarray(loads, dtype=np.float64)
            if w.shape != (len(keys),):
                raise PlacementError(f"loads has {w.size} entries for {len(keys)} keys")
            if not np.all(np.isfinite(w)) or (w < 0).any():
                raise PlacementError("loads must be finite and >= 0")
        if len(set(keys)) != len(keys):
            merged: dict[bytes, float] = {}
            for k, x in zip(keys, w.tolist()):
                merged[k] = merged.get(k, 0.0) + x
            keys, w = list(merged), np.array(list(merged.values()), dtype=np.float64)
        self.bounded_runs += 1
        if not keys:
            return {}
        h = key_hashes(keys)
        total = float(w.sum())
        share = self._weights / self._weights.sum()
        cap = c * total * share
        if loads is None:
            cap = np.ceil(cap - 1e-9)
        cap = cap.tolist()
        seq = np.lexsort((h, -w))                   # heaviest first, then by digest
        hs, ws = h[seq], w[seq].tolist()
        order = np.concatenate([self._order(hs[s:s + _BATCH]) for s in range(0, len(hs), _BATCH)])
        first = order[:, 0].tolist()
        load = [0.0] * len(self._list)
        choice = [0] * len(seq)
        spilled = over = 0
        for i, (f, x) in enumerate(zip(first, ws)):
            if load[f] + x <= cap[f]:
                load[f] += x
                choice[i] = f
                continue
            spilled += 1
            best = None
            for j in order[i].tolist():
                if load[j] + x <= cap[j]:
                    best = j
                    break
            if best is None:
                over += 1
                best = min(range(len(load)), key=lambda j: ((load[j] + x) / cap[j] if cap[j] else math.inf, j))
            load[best] += x
            choice[i] = best
        self.bounded_spilled += spilled
        self.bounded_over += over
        self._last_bounded = {"keys": len(keys), "spilled": spilled, "over": over,
                              "max_over_bound": max(l / b for l, b in zip(load, cap) if b) if total else 0.0}
        names = self._names[np.array(choice, dtype=np.int64)].tolist()
        ks = [keys[i] for i in seq.tolist()]
        return dict(zip(ks, names))

    def stats(self) -> dict:
        out = {"edges": len(self), "regions": len(self._region_names), "version": self.version,
               "lookups": self.lookups, "bounded_runs": self.bounded_runs,
               "bounded_spilled": self.bounded_spilled, "bounded_over": self.bounded_over}
        if hasattr(self, "_last_bounded"):
            out["last_bounded"] = dict(self._last_bounded)
        return out
