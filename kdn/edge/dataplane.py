"""How an edge pulls chunks from a peer: KDN's HTTP frames over TCP, Ray where that pays.

Ray moves an object between nodes at about half of what one TCP connection carries between
the same hosts (`kdn bench transport --hosts`: 0.46x), so bulk KV between edges goes over
the peer's own HTTP server instead (POST /v1/peer, kdn/edge/http.py, with the network's
admin token): the frames are received straight into one buffer, each verified as soon as
its last byte is in, and kept in the edge's own memory (pull_into "process", the default: no
put at all for a reader over HTTP; a Ray reader gets the copy inside the fetch reply, and a
copy the edge keeps is put into the node's store after the reply), or put into this node's
object store (ray.put, PUTTERS at once) while the rest arrives (pull_into "store"). Measured
in one run, rep by rep (`kdn bench transport --hosts`): "process" 1.017 GB/s to a Ray reader
on the edge's host against 0.762 for "store" and 0.769 over Ray; its pull 1.588 GB/s. Ray stays
the control plane (membership, placement, who holds what) and carries
what sits beside the edge: an object on this edge's own node is read zero-copy from the
shared store, which no socket beats.

mode (the edge's `data_plane` option):
- "auto" (default): HTTP frames from a peer on another Ray node that serves HTTP; Ray else.
- "http": HTTP frames whenever the peer serves HTTP, on this node too (tests, benches).
- "ray": always Ray.

A peer's address (its HTTP URL and Ray node) is asked once over Ray (data_address) and
kept (kdn.core.dataplane.Addresses); a peer without HTTP is asked again after a while. A peer that listens on
loopback is pulled over HTTP only from its own host (its node's address is this edge's):
on another host that address is nobody's, so Ray carries its bytes. A batch wider than one
connection carries is split over `streams` parallel connections (contiguous slices of the
keys, each on its own keep-alive connection, received in a worker thread: the socket reads
release the GIL). A peer that does not answer (refused, reset, cut off, silent for
PEER_TIMEOUT_S) is unreachable, as on Ray: its address is forgotten, and the caller moves to
the next owner. Every connection receives into the edge's kept buffers (KEPT_PULL_BUFFERS,
at most KEPT_PULL_BYTES, kdn.core.buffers): memory an earlier pull used, once nothing views
it and the answer fills at least half of it, so a pull does not fault in new pages (an
answer under KEPT_PULL_MIN takes new memory: its faults cost little; counted per path:
<path>_buffers_reused, _new).
A corrupt frame costs only its key (fetched elsewhere). Each pull's bytes over its wall time
are noted in the edge's measured links (kdn/placement/links.py).
"""
import asyncio
import collections
import concurrent.futures
import time

from kdn.core.buffers import KeptBuffers
from kdn.core.dataplane import STREAMS, Addresses, slices
from kdn.core.errors import BadRequest
from kdn.core.rpc import Unreachable
from kdn.edge.peers import PEER_TIMEOUT_S
from kdn.edge.tiers import Held, _ray_initialized

ORIGIN = "origin"            # the origin's name as a node this edge pulls from (its pushes)
IDLE_CONNECTIONS = 4         # keep-alive connections kept per peer


INTO = ("process", "store")    # where a pulled copy lands (pull_into, the first the default)
# receive buffers kept for the next pulls, shared by all of an edge's connections (kdn.core.buffers)
KEPT_PULL_BUFFERS = 8
KEPT_PULL_BYTES = 256 << 20
KEPT_PULL_MIN = 1 << 20        # a smaller answer's buffer is not kept (its faults cost little)
PUTTERS = 4
_PUTTERS = concurrent.futures.ThreadPoolExecutor(PUTTERS, thread_name_prefix="kdn-peer-put")


def check_pull_into(into) -> str:
    if into not in INTO:
        raise BadRequest(f"pull_into must be one of {', '.join(INTO)}, got {into!r:.80}")
    return into


def _held_here(obj, peer: str) -> Held:
    """obj, received from peer, as a Held in this process (no reference yet: kdn/edge/pull.py)."""
    held = Held.here(obj)
    held.src = peer
    return held


class PeerPulls:
    """peer_get over the data plane: `get(peer, keys, region, drops)` answers per key a Held
    in this node's store (HTTP) or the peer's (Ray), or None; None when the peer is
    unreachable."""

    def __init__(self, peers, node_id, mode: str = "auto", node_ip: str = None, streams: int = STREAMS,
                 into: str = INTO[0]):
        self.peers, self.node_id = peers, node_id
        self.addresses = Addresses(mode, node_id, node_ip)
        self.mode, self.streams = self.addresses.mode, max(1, int(streams))
        self.into = check_pull_into(into)
        self.counters = collections.Counter()
        self._idle = collections.defaultdict(list)    # url -> idle EdgeHTTPClients
        # every pull's answer lands in a buffer an earlier one used once nothing views it (a
        # push's copies view theirs until they are in the node's store), whichever connection
        self.buffers = KeptBuffers(KEPT_PULL_BUFFERS, KEPT_PULL_BYTES, KEPT_PULL_MIN, fill=0.5)

    async def get(self, peer: str, keys, region: str, drops):
        url = await self._url(peer)
        if url is None:
            got = await self.peers.edge(peer).peer_get(keys, region=region, drops=drops)
            if got is None:
                return None
            self.counters["peer_ray_pulls"] += 1
            return [None if w is None or w[1] != k else Held.from_wire(w, peer, self.peers.links)
                    for k, w in zip(keys, got)]
        return await self._http(peer, url, keys, region, drops)

    async def from_origin(self, url: str, keys):
        """The origin's stored frames of keys over HTTP (a push this edge takes by pulling:
        kdn/origin/http.py): per key the verified object (a Chunk, or an Encoded as stored)
        or None (not held there intact, or corrupt on the way: the edge pulls it through
        later); None when the origin's server does not answer. The pull's pace is noted as
        the link to the origin."""
        got = await self._http(ORIGIN, url, keys, None, None, into="process", counter="origin_http")
        return None if got is None else [None if h is None else h.obj for h in got]

    async def _url(self, peer: str):
        """The peer's URL when this pull goes over HTTP, else None (Ray)."""
        if self.mode == "ray" or (self.mode == "auto" and self.node_id is None):
            return None                     # (no node id: an edge outside Ray, in a unit test)
        if self.addresses.stale(peer):
            got = await self.peers.edge(peer).data_address()
            if got is None:                 # unreachable now: Ray's call says so in turn
                return None
            self.addresses.note(peer, got)
        return self.addresses.url(peer)

    async def _http(self, peer: str, url: str, keys, region: str, drops, into: str = None,
                    counter: str = "peer_http"):
        parts = slices(keys, self.streams)
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(asyncio.to_thread(self._pull, peer, url, part, region, drops,
                                                           into or self.into, counter)
                                         for part in parts), return_exceptions=True)
        seconds = time.perf_counter() - t0
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            self.addresses.forget(peer)
            unreachable = [r for r in failed if isinstance(r, Unreachable)]
            if len(unreachable) < len(failed):      # not a lost peer: a bug or a refusal
                raise next(r for r in failed if not isinstance(r, Unreachable))
            self.counters[f"{counter}_failures"] += 1
            if peer != ORIGIN:
                self.peers.counters["peer_failures"] += 1
            return None
        for *_, counts in replies:          # the connections' counts, added here on the loop
            self.counters.update(counts)
        bad = [bad for _, _, corrupt, _ in replies for bad in corrupt]
        if peer != ORIGIN:                  # the origin verified what it sent: none to tell
            await self._report_corrupt(peer, bad)
        else:
            self.counters["origin_http_corrupt"] += len(bad)
        out = [h for objs, *_ in replies for h in objs]
        nbytes = sum(b for _, b, *_ in replies)
        self.peers.links.transfer(peer, nbytes, seconds)
        self.counters[f"{counter}_pulls"] += 1
        self.counters[f"{counter}_streams"] += len(parts)
        self.counters[f"{counter}_chunks"] += sum(h is not None for h in out)
        self.counters[f"{counter}_bytes"] += nbytes
        self.counters[f"{counter}_us"] += int(seconds * 1e6)
        return out

    async def _report_corrupt(self, peer: str, bad) -> None:
        """Tell peer which of its copies arrived corrupt ([(key, ns)]): it rereads them and
        drops the bad ones (drop_corrupt), so the next pull does not carry them again. The
        keys themselves are fetched elsewhere by the caller."""
        if not bad:
            return
        self.counters["peer_http_corrupt"] += len(bad)
        by_ns = collections.defaultdict(list)
        for key, ns in bad:
            by_ns[ns].append(key)
        for ns, keys in by_ns.items():      # (a dead peer answers None: it holds nothing)
            await self.peers.edge(peer).drop_corrupt(keys, ns)

    def _pull(self, peer: str, url: str, keys, region: str, drops, into: str, counter: str) -> tuple:
        """(Held per key or None, bytes received, [(key, ns)] of corrupt frames, counts for
        this edge's counters) over one connection (a worker thread: the caller adds the
        counts on the loop)."""
        from kdn.client.http import EdgeHTTPClient
        idle = self._idle[url]
        try:
            client = idle.pop()                 # (threads share the list: pop is atomic)
        except IndexError:
            client = EdgeHTTPClient(url, timeout_s=PEER_TIMEOUT_S, allow_remote=True,
                                    token=self.peers.actors.token, buffers=self.buffers)
        store = into == "store" and _ray_initialized()
        try:
            # "store": each object into this node's store as soon as its frame is verified,
            # PUTTERS at once beside the receiving thread (a ray.put costs ~1 ms beyond its copy)
            got, nbytes = client.peer_get(keys, region=region, drops=drops,
                                          keep=(lambda obj: _PUTTERS.submit(Held.kept, obj)) if store else None)
            if store:
                got = [None if f is None else f.result() for f in got]
        except BaseException:
            client.close()
            raise
        counts = {f"{counter}_wait_us": client.counters.pop("peer_wait_us", 0),
                  **{f"{counter}_{k}": client.counters.pop(k, 0)      # received into memory used
                     for k in ("buffers_reused", "buffers_new")}}     # before, or new
        if len(idle) < IDLE_CONNECTIONS:
            idle.append(client)
        else:
            client.close()
        corrupt = client.peer_corrupt_keys
        if store:
            return got, nbytes, corrupt, counts
        # "process": held here, a Ray reader gets them in the reply, a kept copy is put into
        # this node's store after the reply (kdn/edge/pull.py own_copy)
        return [None if o is None else _held_here(o, peer) for o in got], nbytes, corrupt, counts

    def stats(self) -> dict:
        return {"mode": self.mode, "streams": self.streams,
                "http_peers": self.addresses.with_http(), "buffers_kept_bytes": self.buffers.nbytes,
                **self.counters}
