"""One read at an edge, the same for Ray and HTTP: the longest prefix of keys, bounded.

fetch(keys) serves the longest prefix of keys the network holds: this edge's tiers first,
then pull-through (kdn/edge/pull.py), stopping at the first key nobody holds. Every served
chunk's namespace is checked against the asker's, so one tenant's key never returns another
tenant's KV. The caller's `shape` turns the prefix into what it sends (references for Ray,
frames for HTTP: kdn/edge/forms.py); a copy found corrupt there is dropped from the tiers and
the read is made once more (another replica or the origin) rather than answer short: the
one retry after corruption on the edge. Below memory, the disk tier (kdn/edge/disk.py) is
read for the keys memory lacks, in one worker-thread call, before anything is pulled; a disk
hit is promoted to memory (main when this edge owns the key, else hot). What a reply
brought from elsewhere and memory did not keep is queued for the disk tier (a CDN's fill:
the region's next reader finds it here), written after the reply by the edge's writer.

Bounds: a request names at most MAX_FETCH_KEYS distinct keys (a chain of prefix keys never
repeats one, so a repeat is refused); one reply carries at most max_reply_bytes of KV (the
sum of its chunks' raw sizes). Keys are loaded in rounds that fit that budget, so a request
never makes the edge load, hold or encode more than one reply's worth; a reply cut by the
bound says more=True and the reader asks again for the keys after the ones it got.
"""
import asyncio
import collections
import time

from kdn.core.errors import BadRequest
from kdn.core.keys import MAX_FETCH_KEYS, check_key
from kdn.core.names import DISK, LOCAL, source_kind

MAX_REPLY_BYTES = 1 << 30       # KV bytes one reply carries
FIRST_ROUND_KEYS = 64           # keys loaded at once before any chunk size is known
LOOKUP_TIMEOUT_S = 5.0


def check_keys(keys, limit: int = MAX_FETCH_KEYS, distinct: bool = True) -> list:
    """keys as a list of 16-byte keys, at most limit and (distinct) none repeated; BadRequest
    naming what is wrong."""
    if not isinstance(keys, (list, tuple)):
        raise BadRequest(f"keys must be a list of keys, got {type(keys).__name__}")
    if len(keys) > limit:
        raise BadRequest(f"{len(keys)} keys in one request; the limit is {limit}")
    keys = [check_key(k, f"keys[{i}]") for i, k in enumerate(keys)]
    if not distinct:
        return keys
    seen = set()
    for i, k in enumerate(keys):
        if k in seen:
            raise BadRequest(f"keys[{i}] repeats key {k.hex()}: a chain of prefix keys never "
                             f"repeats one")
        seen.add(k)
    return keys


class Reads:
    def __init__(self, name: str, region: str, membership, tiers, pull, peers, catalog, demand,
                 max_reply_bytes: int = MAX_REPLY_BYTES):
        self.name, self.region = name, region
        self.membership, self.tiers, self.pull, self.peers = membership, tiers, pull, peers
        self.catalog, self.demand = catalog, demand
        self.max_reply_bytes = int(max_reply_bytes)
        self.counters = collections.Counter()

    def _checked(self, keys, ns, region) -> tuple:
        keys, ns = check_keys(keys), check_key(ns, "ns")
        if region is not None and region not in self.membership.topology.regions:
            raise BadRequest(f"region must be one of {', '.join(self.membership.topology.regions)}, "
                             f"got {region!r:.80}")
        return keys, ns, region or self.region

    # --- fetch ------------------------------------------------------------------------------
    async def fetch(self, keys, ns: bytes, region: str, token, shape, claim=None) -> dict:
        """{"out", "sources", "more"}: the longest held prefix of keys (at most one reply's
        worth), as `shape` made it.

        shape(helds, sources) is async and returns (out, n, corrupt): what to send for the
        first n chunks, and whether chunk n was found corrupt (else n < len(helds) means the
        reply was bounded there).
        """
        keys, ns, region = self._checked(keys, ns, region)
        await self.catalog.check_read(ns, token, "fetch", claim)
        t0 = time.perf_counter()
        for attempt in (1, 2):
            helds, sources, more = await self._prefix(keys, ns)
            out, n, corrupt = await shape(helds, sources)
            if not corrupt:
                more = more or n < len(helds)
                break
            await self.tiers.drop([helds[n].key])   # (a peer's copy: the reader reports it there)
            self.counters["corrupt_dropped"] += 1
            more = False                         # a second corrupt copy: answer the prefix before it
        await self._served(keys[:n], helds[:n], sources[:n], region)
        self.counters["fetch_us"] += int((time.perf_counter() - t0) * 1e6)
        return {"out": out[:n], "sources": sources[:n], "more": more}

    async def _prefix(self, keys, ns: bytes) -> tuple:
        """(helds, sources, more): the held prefix of keys, up to max_reply_bytes of KV."""
        found = [None] * len(keys)
        for i, k in enumerate(keys):
            held = self.tiers.get(k, ns)
            if held is not None:
                found[i] = (held, LOCAL)
        if self.tiers.disk is not None and not all(found):
            await self._from_disk(keys, ns, found)
        helds, sources, spent = [], [], 0
        for i, k in enumerate(keys):
            if found[i] is None:
                batch = self._round(found, i, spent, helds)
                if not batch:                    # the next chunk would not fit this reply
                    return helds, sources, True
                for j, got in zip(batch, await self.pull.load([keys[j] for j in batch], ns)):
                    found[j] = got
                if found[i] is None:
                    break
            held, source = found[i]
            if held.ns != ns or held.key != k:
                self.counters["namespace_refused"] += 1
                break
            if helds and spent + held.raw > self.max_reply_bytes:
                return helds, sources, True
            helds.append(held)
            sources.append(source)
            spent += held.raw
        return helds, sources, False

    async def _from_disk(self, keys, ns, found) -> None:
        """Fill found[i] from the disk tier for keys memory lacks, as far as one reply's
        budget goes (sizes from the disk index: no I/O for what would not be sent)."""
        want, left = [], self.max_reply_bytes
        for i, k in enumerate(keys):
            if found[i] is not None:
                left -= found[i][0].raw
            else:
                rec = self.tiers.on_disk(k, ns)
                if rec is not None:
                    if rec.raw > left and (want or i):
                        break
                    want.append(i)
                    left -= rec.raw
            if left <= 0:
                break
        got = await self.read_disk([keys[i] for i in want], ns)
        for i, held in zip(want, got):
            if held is not None:
                found[i] = (held, DISK)

    async def read_disk(self, keys, ns) -> list:
        """Held per key from the disk tier (None where absent), promoted to memory: main
        where this edge owns the key, else hot."""
        if not keys:
            return []
        roles = ["main" if self.name in owners else "hot" for owners in self.membership.owners(keys)]
        return await self.tiers.from_disk(keys, ns, roles)

    def _round(self, found, i: int, spent: int, helds) -> list:
        """Indices of the missing keys from i on to load at once: as many as fit what is left
        of the reply's budget (chunk size estimated from those already seen; none when the
        first would not fit after the chunks already in the reply)."""
        est = max([h.raw for h in helds] + [f[0].raw for f in found if f is not None], default=0)
        batch, left = [], self.max_reply_bytes - spent
        for j in range(i, len(found)):
            if found[j] is not None:
                left -= found[j][0].raw
            elif est and left < est and (batch or helds):
                break
            elif not est and len(batch) >= FIRST_ROUND_KEYS:
                break
            else:
                batch.append(j)
                left -= est
            if left < 0:
                break
        return batch

    async def _served(self, keys, helds, sources, region) -> None:
        """Count what a reply serves, record demand, keep what came from elsewhere."""
        keep = []
        for k, h, s in zip(keys, helds, sources):
            self.demand.record(k, region, h.nbytes)
            self.counters["served_" + source_kind(s)] += 1
            if s not in (LOCAL, DISK):           # this edge's own tiers already hold it
                keep.append((k, h, region))
        if keep:
            await self.pull.keep(keep)
            if self.tiers.disk is not None:     # a fill: what memory did not keep goes to disk
                for k, h, _ in keep:
                    if self.tiers.peek(k) is None and self.tiers.write_back(h, verify=not h.own,
                                                                             born=h.born):
                        self.counters["disk_filled"] += 1
        self.counters["fetches"] += 1
        self.counters["chunks_served"] += len(helds)
        self.counters["bytes_served"] += sum(h.raw for h in helds)

    # --- lookup -----------------------------------------------------------------------------
    async def lookup(self, keys, ns: bytes, token) -> dict:
        """{"chunks": how long a prefix of keys the network holds, "local": how many of them
        this edge holds}; no KV moves."""
        keys, ns, _ = self._checked(keys, ns, None)
        await self.catalog.check_read(ns, token, "lookup")
        here = [self.tiers.holds(k, ns) for k in keys]
        n = next((i for i, h in enumerate(here) if not h), len(keys))
        if n < len(keys):
            rest = keys[n:]
            got = await self.peers.origin(LOOKUP_TIMEOUT_S).has(rest, ns)
            if got is None:              # the origin is down: ask the owners
                got = await self._owners_have(rest, ns)
            n += next((i for i, h in enumerate(got) if not h), len(got))
        return {"chunks": n, "local": sum(here[:n]), "edge": self.name}

    async def holds(self, keys, ns: bytes, token, claim=None) -> list:
        """Per key, whether the network holds it under ns (this edge, else the origin, else
        while the origin is down the other owners); no KV moves. For keys no manifest names
        (objects): a reader with its tenant's read token asks here, never the origin."""
        keys, ns = check_keys(keys, distinct=False), check_key(ns, "ns")
        await self.catalog.check_read(ns, token, "holds", claim)
        held = [self.tiers.holds(k, ns) for k in keys]
        rest = [i for i, h in enumerate(held) if not h]
        if rest:
            asked = [keys[i] for i in rest]
            got = await self.peers.origin(LOOKUP_TIMEOUT_S).has(asked, ns)
            if got is None:              # the origin is down: ask the owners
                got = await self._owners_have(asked, ns)
            for i, h in zip(rest, got):
                held[i] = bool(h)
        self.counters["holds_asked"] += len(keys)
        return held

    async def _owners_have(self, keys, ns) -> list:
        """Whether some other owner holds each key (one call per owner)."""
        asked = collections.defaultdict(list)
        for k, owners in zip(keys, self.membership.owners(keys)):
            for o in owners:
                if o != self.name:
                    asked[o].append(k)
        replies = await asyncio.gather(*(self.peers.edge(o, LOOKUP_TIMEOUT_S).have(ks, ns)
                                         for o, ks in asked.items()))
        held = {k for ks, got in zip(asked.values(), replies) for k, h in zip(ks, got or ()) if h}
        return [k in held for k in keys]

    def stats(self) -> dict:
        return dict(self.counters)
