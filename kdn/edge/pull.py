"""Pull-through: how an edge gets the chunks it lacks, and which of them it keeps.

A batch of missing keys is loaded from the ring owners nearest first, then the origin — one
batched call per source per round, never one per chunk. Concurrent misses for one key share
one load (singleflight). A chunk the origin sends is verified against its manifest checksum
before anyone sees it; an owner found lacking a chunk is sent the origin's copy after the
reply is on its way (read repair).

Owners are asked through the data plane (kdn/edge/dataplane.py): HTTP frames from an owner
on another node, the copy held in this edge's process (or its node's store: pull_into) and
put into the store only if kept; Ray from one beside it.

What comes from elsewhere is kept when this edge owns it (it restarted empty: it refills
itself on the way through) or its region reads it hot (a hot copy). A peer's object that
came over Ray belongs to the peer and vanishes with it, so a kept copy is put into this
node's store as our own,
in this edge's store form; a copy that must be encoded to be kept is encoded in the
background, after the reply, one encode per key at a time.

A key the edge knows belongs to another namespace (its manifest says so, or the copy it
holds does) is never loaded for a reader of this one: such a load would tell the reader,
by its cost, that the key exists elsewhere.

A drop from the origin's log wins over a load in flight (kdn/edge/tombstones.py): a load is born
at the drop-log position this edge had applied when it started, asks owners only to answer
if they have applied as much (peer_get's drops=), and what a drop overtook meanwhile is
neither served nor kept, nor sent to an owner as a repair without its birth.
"""
import asyncio
import collections
import time

from kdn.edge.dataplane import PeerPulls
from kdn.edge.peers import PEER_READ_S
from kdn.edge.singleflight import Group
from kdn.edge.tiers import Held
from kdn.core.names import ORIGIN, peer_source
from kdn.core.rpc import failover_errors


def _received(held) -> bool:
    """Whether held is a peer's copy received over HTTP (kdn/edge/dataplane.py): in this
    process only, put into the node's store if kept."""
    return held.ref is None and held.src is not None and not held.carried


class Pull:
    def __init__(self, name: str, region: str, membership, tiers, forms, peers, catalog, demand,
                 pulls=None):
        self.name, self.region = name, region
        self.membership, self.tiers, self.forms = membership, tiers, forms
        self.peers, self.catalog, self.demand = peers, catalog, demand
        self.pulls = pulls or PeerPulls(peers, None, "ray")   # how owners' chunks come over
        self.loads = Group()
        self.counters = collections.Counter()
        self._keeping = set()      # keys being encoded to be kept

    # --- loading ----------------------------------------------------------------------------
    async def load(self, keys, ns: bytes) -> list:
        """(Held, source) per key, None where nobody holds it (for a reader of ns) or the copy
        loaded is older than a drop of its key applied meanwhile."""
        mine = [k for k in keys if self._may_load(k, ns)]
        got = dict(zip(mine, await self.loads.do_many(mine, self._load_batch))) if mine else {}
        return [None if (g := got.get(k)) is None or self.tiers.tombs.stale(k, g[0].born) else g
                for k in keys]

    def _may_load(self, key, ns: bytes) -> bool:
        known = self.catalog.ns_of(key)
        held = self.tiers.peek(key) or self.tiers.on_disk(key)
        return (known is None or known == ns) and (held is None or held.ns == ns)

    async def _load_batch(self, keys) -> dict:
        """key -> (Held, source) for the keys some owner or the origin holds, each Held born
        at the drop-log position applied when the load started."""
        born, drops = self.tiers.tombs.birth(), self.tiers.tombs.state()
        result, lacking = await self._from_owners(keys, drops)
        pending = [k for k in keys if k not in result]
        if pending:
            from_origin = await self._from_origin(pending)
            result.update((k, (h, ORIGIN)) for k, (_, h) in from_origin.items())
            self._repair(lacking, {k: c for k, (c, _) in from_origin.items()}, drops)
        for held, _ in result.values():
            held.born = born
        return result

    async def _from_owners(self, keys, drops=None) -> tuple:
        """({key: (Held, source)}, {owner: [keys it should have had]}): round r asks each
        key's r-th nearest owner, all owners of a round at once. drops: the drop-log state
        this edge applied; an owner that applied less answers nothing (kdn/edge/node.py)."""
        ranked = self.membership.sources(keys, self.name, self.region, self.peers.links)
        result, lacking = {}, collections.defaultdict(list)
        pending, rnd = list(keys), 0
        while pending and any(len(ranked[k]) > rnd for k in pending):
            groups = collections.defaultdict(list)
            for k in pending:
                if len(ranked[k]) > rnd:
                    groups[ranked[k][rnd]].append(k)
            replies = await asyncio.gather(*(self.pulls.get(e, ks, self.region, drops)
                                             for e, ks in groups.items()))
            for (e, ks), got in zip(groups.items(), replies):
                if got is None:          # unreachable: its keys go to the next owner
                    continue
                for k, held in zip(ks, got):
                    if held is not None:
                        result[k] = (held, peer_source(e))
                    else:
                        lacking[e].append(k)
            pending = [k for k in pending if k not in result]
            rnd += 1
        return result, lacking

    async def _from_origin(self, keys) -> dict:
        """key -> (the origin's verified copy (Chunk or Encoded), a Held of it in this node's
        store)."""
        t0 = time.perf_counter()
        got = await self.peers.origin().get_chunks(keys) or [None] * len(keys)
        pairs = [(k, c) for k, c in zip(keys, got) if c is not None and c.key == k]
        if pairs:                  # the answer carries the bytes: the call's time moved them
            self.peers.links.transfer("origin", sum(c.nbytes for _, c in pairs), time.perf_counter() - t0)

        def verified():       # hashing (decoding, for a frame) and ray.put's copy: off the loop
            return {k: (c, Held.kept(c)) for k, c in pairs if self.forms.intact(c)}
        return await asyncio.to_thread(verified) if pairs else {}

    def _repair(self, lacking: dict, from_origin: dict, drops=None) -> None:
        """Send owners the origin's copies of chunks they lacked, after the reply; drops: the
        drop-log state the load started at, their birth for the owner."""
        for e, ks in lacking.items():
            repair = [from_origin[k] for k in ks if k in from_origin]
            if repair:
                self.counters["repairs_sent"] += len(repair)
                self.peers.later(self.peers.edge(e).put_chunks(repair, drops=drops),
                                 f"read repair of {e}")

    # --- keeping ----------------------------------------------------------------------------
    async def keep(self, items) -> None:
        """Keep (key, Held, reader region) that came from elsewhere where this edge owns the
        key (main: a refill) or its region reads it hot (a hot copy)."""
        later = []
        for (key, held, region), owners in zip(items, self.membership.owners([k for k, _, _ in items])):
            if self.name in owners:
                role, counter = "main", "refilled"
            elif region == self.region and key in self.demand.hot(region):
                role, counter = "hot", "hot_promoted"
            else:
                continue
            if self.forms.store_codec != "raw" or held.codec != "raw" or _received(held):
                if key not in self._keeping and key not in self.tiers.tier(role):
                    self._keeping.add(key)                      # one encode per key at a time
                    later.append((key, held, role, counter))    # not on the reader's time
                continue
            await self._keep_one(key, held, role, counter)
        if later:
            self.peers.later(self._keep_encoded(later), "keeping encoded copies")

    async def _keep_encoded(self, items) -> None:
        for key, held, role, counter in items:
            try:
                await self._keep_one(key, held, role, counter)
            finally:
                self._keeping.discard(key)

    async def _keep_one(self, key, held, role: str, counter: str) -> None:
        held = await self.own_copy(held)
        if held is not None and self.tiers.put(role, key, held):
            self.counters[counter] += 1

    async def own_copy(self, held):
        """held as this node's own object in this edge's store form (a peer's object vanishes
        with the peer), born when held was; None when it cannot be read in time or fails
        verification."""
        if held.own and held.codec == self.forms.store_codec and not _received(held):
            return held
        if _received(held):           # received over HTTP: put into this node's store, born as held
            kept = await asyncio.to_thread(Held.kept, held.obj)
            kept.born = held.born
            if held.codec == self.forms.store_codec:
                return kept
            held = kept
        try:
            obj = await asyncio.wait_for(held.resolve(), PEER_READ_S)
        except failover_errors():      # the peer went away: nothing to keep
            return None
        mine = (await self.forms.to_store([obj]))[0]
        if mine is not None:
            mine.born = held.born
        return mine

    async def promote(self, keys) -> None:
        """Copy chunks the replication policy made hot in this region into the hot tier."""
        got = await self.loads.do_many(keys, self._load_batch)
        for k, g in zip(keys, got):
            if g is None:
                continue
            held = await self.own_copy(g[0])
            if held is not None and self.tiers.put("hot", k, held):
                self.counters["hot_promoted"] += 1

    def stats(self) -> dict:
        return {"loads": self.loads.stats(), "keeping": len(self._keeping), **self.counters}
