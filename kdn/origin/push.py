"""Pushes: the origin sends each committed chunk to its ring owners, and re-homes on change.

A KB version's targets are its chunks' ring owners (the KB's replica count) plus one edge
in each region it is pinned to. Each target is asked first which chunks it already holds,
then sent the rest in batches of at most PUSH_BATCH_BYTES, BATCHES_IN_FLIGHT at a time across
all edges. When the membership changes, every live chunk goes to owners that did not own it
before. A dead or slow edge is skipped (counted in edge_call_failures): it refills by
pull-through, and a publish never fails for it. Any other error from an edge raises.
Opaque objects (put_objects) are pushed the same way, in the background (kdn/origin/node.py).
Each batch carries the drop log's settled head read before its bytes (kdn/origin/drops.py), so
an edge that has applied a later drop of one of its keys does not keep the old bytes.

The bytes go over the data plane where that pays (the origin started with http_host): an edge
that serves HTTP on another Ray node, and that this origin's host reaches, is sent only the
keys over Ray (EdgeAPI.pull_chunks) and pulls the stored frames from the origin's own HTTP
server (kdn/origin/http.py) at a socket's pace, where Ray's object manager carries a third of
it; an edge on the origin's node gets them over Ray, zero-copy. An edge that does not reach
the origin's server gets the batch over Ray instead, and over Ray until its address is asked
again (kdn.core.dataplane.ADDRESS_RETRY_S).
"""
import asyncio
import collections
import contextlib
import functools
import time

from kdn.core.dataplane import NODE_HOST, Addresses
from kdn.core.errors import StoreError
from kdn.origin.drops import settled
from kdn.origin.overrides import kb_id
from kdn.core.interfaces import EdgeAPI
from kdn.core.rpc import Stub, Unreachable

PUSH_BATCH_BYTES = 64 << 20     # one put_chunks call carries at most this much
BATCHES_IN_FLIGHT = 4           # batches in flight at once, across all edges
BATCH_TIMEOUT_S = 30.0          # an edge that does not answer a batch in time is skipped
QUICK_TIMEOUT_S = 10.0          # for the small calls: have, membership, manifests


def outgoing(store, keys, each=map) -> list:
    """What goes to edges for keys: Chunks from a raw store; from a compressed one the stored
    frames as they are (kdn.core.chunk.Encoded: fewer bytes on the wire, no decoding here, and an
    edge storing the same codec keeps them without re-encoding). None where absent, corrupt or
    unreadable (never sent). Storage I/O: call it in a thread; each=store.map reads the keys
    several at once, which a bucket needs (each GET waits a round trip)."""
    def one(k):
        try:
            if store.codec == "raw":
                return store.get(k)
            e = store.get_encoded(k)   # a frame stored raw before the store was compressed
            return e.decode() if e.codec == "raw" else e   # goes as the Chunk it is
        except StoreError:
            return None
    return list(each(one, keys))


class Pusher:
    """Calls from the origin to its edges: pushes, warm copies, broadcasts."""

    def __init__(self, store, actors, membership, tokens=None, http_host: str = None):
        """http_host: where the origin serves its frames to edges on other nodes ("node": its
        Ray node's address; kdn/origin/http.py), None: every push goes over Ray."""
        self.store, self.actors, self.membership = store, actors, membership
        self.tokens, self.http_host = tokens, http_host
        self.ingest = None           # what -> the origin's store call its HTTP server takes writes for
        self.http, self.data, self._http_lock = None, None, asyncio.Lock()
        self.counters = collections.Counter(chunks_pushed=0, edge_call_failures=0)
        self._in_flight = {}         # path -> (batches in flight on it, busy counted up to: _busy)

    async def http_url(self):
        """The URL of the origin's frames server, started on first use; None without one."""
        if self.http_host is None:
            return None
        if self.http is not None:
            return self.http.url
        async with self._http_lock:
            if self.http is None:
                import ray
                from kdn.origin.http import OriginHTTP
                on_ray = ray.is_initialized()
                ip = ray.util.get_node_ip_address() if on_ray else None
                http = OriginHTTP(self.store, self.tokens, ip if self.http_host == NODE_HOST else self.http_host,
                                  ingest=self.ingest)
                await http.start()
                self.http = http
                self.data = Addresses("auto", ray.get_runtime_context().get_node_id() if on_ray else None, ip)
        return self.http.url

    async def _pull_url(self, edge: str):
        """The origin's URL when edge takes a push by pulling it over HTTP (it serves HTTP on
        another Ray node that this host reaches), else None: over Ray."""
        url = await self.http_url()
        if url is None or self.data.node_id is None:
            return None
        if self.data.stale(edge):
            got = await self.edge(edge, QUICK_TIMEOUT_S).data_address()
            if got is None:
                return None
            self.data.note(edge, got)
        return url if self.data.url(edge) is not None else None

    async def edge_url(self, edge: str):
        """edge's own HTTP URL when the origin reads its frames (its write-behind:
        kdn/origin/intake.py): as for a push, where edge serves HTTP on another Ray node that
        this host reaches and this origin takes the data plane; else None (over Ray)."""
        return None if await self._pull_url(edge) is None else self.data.url(edge)

    def edge(self, edge: str, timeout: float = BATCH_TIMEOUT_S) -> EdgeAPI:
        """edge's interface; a call answers None when it is dead, restarting or too slow (counted)."""
        return Stub(EdgeAPI, functools.partial(self._call, edge, timeout), f"edge {edge!r}")

    def every_edge(self, timeout: float = QUICK_TIMEOUT_S) -> EdgeAPI:
        """Every member edge's interface at once: a call answers [answer or None] per edge."""
        async def send(method, args, kw):
            return await asyncio.gather(*(self._call(n, timeout, method, args, dict(kw))
                                          for n in self.membership.names()))
        return Stub(EdgeAPI, send, "every edge")

    async def _call(self, edge, timeout, method, args, kw):
        try:
            return await self.actors.call(edge, method, *args, timeout=timeout, **kw)
        except Unreachable:
            self.counters["edge_call_failures"] += 1
            return None

    def _override(self, m) -> dict:
        return self.membership.overrides.get(kb_id(m.tenant, m.name), {})

    def _replicas(self, m) -> int:
        return int(self._override(m).get("replicas") or self.membership.replicas)

    def _pinned_edges(self, m) -> set:
        return {n for region in self._override(m).get("pin_regions", ())
                for n in self.membership.edges_in(region)}

    def targets(self, m) -> dict:
        """edge -> [keys]: ring owners (replica count per KB override) plus, per pinned region,
        its first edge (which holds the whole KB)."""
        ring = self.membership.ring
        targets = collections.defaultdict(list)
        if len(ring):
            for k, owners in zip(m.keys, ring.owners_batch(list(m.keys), self._replicas(m))):
                for o in owners:
                    targets[o].append(k)
        for region in self._override(m).get("pin_regions", ()):
            edges = self.membership.edges_in(region)
            if edges:
                held = set(targets[edges[0]])
                targets[edges[0]].extend(k for k in m.keys if k not in held)
        return dict(targets)

    async def push(self, m) -> tuple:
        """Send m's chunks to its targets; (edge -> chunks it is meant to hold, edge -> sent)."""
        ov, pinned = self._override(m), self._pinned_edges(m)
        sem = asyncio.Semaphore(BATCHES_IN_FLIGHT)
        targets = self.targets(m)
        pushed = {}

        async def push_to(edge, keys):
            have = await self.edge(edge, QUICK_TIMEOUT_S).have(keys)
            if have is None:
                pushed[edge] = 0
                return
            if edge in pinned:   # chunks it already holds get pinned where they are
                await self.edge(edge).pin_keys([k for k, h in zip(keys, have) if h])
            pushed[edge] = await self.send(edge, [k for k, h in zip(keys, have) if not h], sem,
                                           role="main", pin=edge in pinned, ttl_s=ov.get("ttl_s"))

        await asyncio.gather(*(push_to(e, ks) for e, ks in targets.items()))
        self.counters["chunks_pushed"] += sum(pushed.values())
        return {e: len(ks) for e, ks in targets.items()}, pushed

    async def push_objects(self, keys) -> dict:
        """Send chunks no KB names (opaque objects) to their ring owners, asking each owner
        first what it holds; edge -> chunks sent. Read back from the store (the page cache),
        not held from the call that stored them: a backlog of pushes then pins nothing in
        Ray's object store."""
        ring, targets = self.membership.ring, collections.defaultdict(list)
        if len(ring):
            for k, owners in zip(keys, ring.owners_batch(list(keys), self.membership.replicas)):
                for o in owners:
                    targets[o].append(k)
        sem, pushed = asyncio.Semaphore(BATCHES_IN_FLIGHT), {}

        async def push_to(edge, keys):
            have = await self.edge(edge, QUICK_TIMEOUT_S).have(keys)
            pushed[edge] = 0 if have is None else \
                await self.send(edge, [k for k, h in zip(keys, have) if not h], sem)

        await asyncio.gather(*(push_to(e, ks) for e, ks in targets.items()))
        self.counters["chunks_pushed"] += sum(pushed.values())
        return pushed

    async def send(self, edge, keys, sem, role="main", pin=False, ttl_s=None) -> int:
        """Send chunks to an edge in batches of at most PUSH_BATCH_BYTES; returns chunks sent."""
        def read(batch):       # the settled head first: the bytes read after are that new
            return settled(self.store), outgoing(self.store, batch, self.store.map)

        async def flush(batch, nbytes):
            async with sem:
                url = await self._pull_url(edge)
                if url is not None:       # the keys over Ray, the bytes over the data plane
                    t0 = time.perf_counter()
                    with self._busy("http"):
                        drops = await asyncio.to_thread(settled, self.store)
                        got = await self.edge(edge).pull_chunks(url, batch, role=role, pin=pin, ttl_s=ttl_s,
                                                                drops=drops, origin_ip=self.data.node_ip)
                    if got is None:       # dead or too slow (counted): it refills by pull-through
                        return 0
                    if got["pulled"] is not None:
                        self._timed("http", got["pulled"], nbytes, t0)
                        return len(batch)
                    self.counters["push_http_unreached"] += 1       # over Ray, until asked again
                    self.data.note(edge, {"url": None})
                t0 = time.perf_counter()
                with self._busy("ray"):
                    drops, chunks = await asyncio.to_thread(read, batch)
                    ok = await self.edge(edge).put_chunks(chunks, role=role, pin=pin, ttl_s=ttl_s, drops=drops)
                if ok is None:
                    return 0
                self._timed("ray", len(batch), nbytes, t0)
                return len(batch)

        jobs, batch, size = [], [], 0
        sizes = await asyncio.to_thread(self.store.map, self.store.size_of, keys)   # off the loop:
        for k, n in zip(keys, sizes):                                           # a HEAD each in a bucket
            batch.append(k)
            size += n
            if size >= PUSH_BATCH_BYTES:
                jobs.append(flush(batch, size))
                batch, size = [], 0
        if batch:
            jobs.append(flush(batch, size))
        return sum(await asyncio.gather(*jobs))

    def _timed(self, path: str, chunks: int, nbytes: int, t0: float) -> None:
        """A batch the edge holds now, sent over path ("http": pulled from the origin's frames;
        "ray"): its chunks, its stored bytes and the microseconds from the call to the answer
        (push_<path>_chunks/_bytes/_us; _us adds up each batch's own time, so where batches
        overlap the path's pace is bytes over push_<path>_busy_us: _busy)."""
        self.counters[f"push_{path}_chunks"] += chunks
        self.counters[f"push_{path}_bytes"] += nbytes
        self.counters[f"push_{path}_us"] += int((time.perf_counter() - t0) * 1e6)

    @contextlib.contextmanager
    def _busy(self, path: str):
        """Counts the wall time path has at least one batch in flight (push_<path>_busy_us):
        BATCHES_IN_FLIGHT batches share the path, so each batch's own time (push_<path>_us)
        adds up to more than the time the bytes took (`kdn status`, `kdn bench transport`).
        Added whenever a batch starts or ends, so the counter keeps up with the bytes during a
        long run of batches. A batch the edge does not answer (dead or past BATCH_TIMEOUT_S)
        counts too: the path was taken for that time. On the event loop only."""
        n, mark = self._in_flight.get(path, (0, None))
        now = time.perf_counter()
        if n:
            self.counters[f"push_{path}_busy_us"] += int((now - mark) * 1e6)
        self._in_flight[path] = (n + 1, now)
        try:
            yield
        finally:
            n, mark = self._in_flight.pop(path)
            now = time.perf_counter()
            self.counters[f"push_{path}_busy_us"] += int((now - mark) * 1e6)
            if n > 1:
                self._in_flight[path] = (n - 1, now)

    async def rehome(self, old_ring) -> int:
        """After a membership change, send every live chunk to owners that did not own it."""
        if not len(old_ring):
            return 0
        moved = 0
        sem = asyncio.Semaphore(BATCHES_IN_FLIGHT)
        for m in await asyncio.to_thread(self.store.manifests):
            old = old_ring.owners_batch(list(m.keys), self._replicas(m))
            old_owners = {k: set(o) for k, o in zip(m.keys, old)}
            jobs = [self.send(edge, new, sem) for edge, keys in self.targets(m).items()
                    if (new := [k for k in keys if edge not in old_owners[k]])]
            moved += sum(await asyncio.gather(*jobs))
        return moved

    async def warm(self, m, edges) -> dict:
        """Copy m's chunks into each of edges as hot copies; edge -> chunks sent."""
        sem = asyncio.Semaphore(BATCHES_IN_FLIGHT)
        sent = {}
        for e in edges:
            have = await self.edge(e, QUICK_TIMEOUT_S).have(list(m.keys)) or [False] * len(m.keys)
            sent[e] = await self.send(e, [k for k, h in zip(m.keys, have) if not h], sem, role="hot")
        return sent
