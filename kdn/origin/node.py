"""The origin node: the Ray actor that is the network's authority, and its RPC surface.

Every published chunk and manifest lives in its store (kdn/origin/store.py); it keeps the
membership (kdn/origin/membership.py), watches its edges' health (kdn/origin/health.py) and pushes
chunks to their owners (kdn/origin/push.py). This module checks each call — the caller's token,
then every argument (BadRequest before anything changes) — and hands it to those parts.

Publishing is two steps from the publisher: `missing` + `put_chunks` (only the chunks the
origin lacks or holds corrupt: re-publishing an intact KB transfers nothing) and `commit`
(the manifest, written last, so a version is visible only once every chunk is durable),
after which the origin pushes each chunk to its ring owners. Disk work runs in threads so
a slow fsync never stalls the event loop that serves edges' pull-through reads. The origin
keeps nothing that is not in its store (a directory, or s3://bucket/prefix: kdn/origin/objects.py):
chunks, manifests, membership and overrides, so a restarted origin reopens all of them, and
over a bucket it may restart on any node. With store_codec="zstd" its disk holds
chunks losslessly compressed; lossy codecs are refused: the origin keeps the exact KV every
copy is checked against.

Every method takes `token=` (kdn.core.rpc's contract). All but ping, membership, stats and
data_address need the admin token; those answer anyone, but only the admin sees the operators'
overrides and quarantined manifests, which name tenants' KBs. The Ray cluster itself is the
operator's trust boundary: tenants outside it read over HTTP with their read tokens.
"""
import asyncio
import collections
import contextlib
import logging
import os
import time

from kdn.core.auth import Tokens
from kdn.core.checks import check_int, check_number
from kdn.core.chunk import Chunk, Encoded, check_objects
from kdn.core.emphasis import OVERRIDE_META, check_copy, copy_of, is_emphasized, own_manifests
from kdn.core.errors import BadRequest, KDNError, ManifestError, StoreError, VersionNotFound
from kdn.core.keys import MAX_KEYS_PER_CALL, MAX_TOKENS_PER_KB, check_key, namespace_digest
from kdn.core.manifest import Manifest, check_name
from kdn.core.names import check_node_name
from kdn.origin import overrides
from kdn.origin.drops import settled
from kdn.origin.health import PERIOD_S, Health
from kdn.origin.intake import Intake
from kdn.origin.membership import Membership, check_members
from kdn.origin.objects import open_objects
from kdn.origin.push import Pusher, outgoing
from kdn.origin.store import ChunkStore
from kdn.placement.topology import Topology
from kdn.core.rpc import Actors, Unreachable
from kdn.core.transfer import check_store_codec

log = logging.getLogger(__name__)

# A store that cannot be opened (a bucket briefly unreachable as the origin restarts) is tried
# again for about a minute: Ray never restarts an actor whose constructor raised.
OPEN_WAITS_S = (1, 2, 4, 8, 15, 30)
MAX_CHUNKS_PER_CALL = 4096       # limits on what one publish call may carry
MAX_BYTES_PER_CALL = 2 << 30
REF_READ_TIMEOUT_S = 60.0        # objects handed over by reference (put_object_refs) are read within this
OBJECT_PUSH_BACKLOG_BYTES = 2 << 30   # objects' bytes whose push is in flight at once
OBJECT_PUSH_QUEUE_BYTES = 8 << 30     # objects' bytes whose push is queued (keys held, not bytes)
# An object's push waits until the origin has taken in no object for PUSH_QUIET_S (a burst of
# stores is over), PUSH_DEFER_MAX_S after it was queued at most, or until a caller waits for the pushes
# (pushes_settled, delete_objects): the intake that makes edges' acknowledged stores durable,
# and frees their backlogs, goes first. On one 2-core host the pushes to two other edges took
# most of the CPU behind a burst of LMCache stores, their receiving edges most of that
# (docs/figures.md, session 37); owners that have no copy yet are served by pull-through.
PUSH_QUIET_S = 1.0
PUSH_DEFER_MAX_S = 10.0


def _keys(keys, what: str = "keys") -> list:
    if not isinstance(keys, (list, tuple)) or len(keys) > MAX_KEYS_PER_CALL:
        raise BadRequest(f"{what} must be a list of at most {MAX_KEYS_PER_CALL} keys, got "
                         f"{type(keys).__name__}" + (f" of {len(keys)}" if isinstance(keys, (list, tuple)) else ""))
    return [check_key(k, "a key") for k in keys]


def _ns(ns) -> bytes:
    return check_key(ns, "namespace digest")


def _name(value, what: str) -> str:
    """A tenant or KB name (a path component in the store), or BadRequest."""
    try:
        return check_name(value, what)
    except ManifestError as e:
        raise BadRequest(str(e)) from None


def _version(value, what: str = "version") -> int:
    return check_int(value, what, 1)


def _same_content(a: Manifest, b: Manifest) -> bool:
    return (a.keys == b.keys and a.layout == b.layout and a.chunk_tokens == b.chunk_tokens
            and [(d.name, d.start, d.end, d.digest) for d in a.documents]
            == [(d.name, d.start, d.end, d.digest) for d in b.documents] and a.meta == b.meta)


class OriginNode:
    def __init__(self, network: str, root: str, topology: dict, replicas: int = 2, auth: dict = None,
                 store_codec: str = "raw", actors=None, store_env: dict = None, http_host: str = None):
        """root: a directory or s3://bucket/prefix; store_env: the AWS_* settings that reach
        the bucket (default: this process's environment). actors: how to call edges
        (kdn.core.rpc.Actors of the network by default; tests pass stand-ins with its
        call/try_call/forget). http_host: where it serves its stored frames to the edges on
        other nodes it pushes to ("node": its Ray node's address; kdn/origin/http.py), None:
        its pushes go over Ray."""
        self.network = network
        self.tokens = Tokens.from_dict(auth)
        self.objects = open_objects(root, env=store_env)
        self.root = self.objects.where()
        self.topology = Topology.from_dict(topology)
        codec = check_store_codec(store_codec, "origin")
        for wait in (*OPEN_WAITS_S, None):
            try:
                self.store = ChunkStore(self.objects.child("store"), codec=codec)
                # the record behind the `membership` RPC (an attribute of that name would hide the method)
                self.roster = Membership(self.objects, self.topology, max(1, int(replicas)))
                break
            except StoreError as e:
                if wait is None:
                    raise
                log.warning("origin of network %r: cannot open its store yet (%s); again in %g s",
                            network, e, wait)
                time.sleep(wait)
        self.actors = actors if actors is not None else Actors(network, token=self.tokens.admin)
        # each ping carries the drop log's head: an edge behind it replays (kdn/origin/drops.py)
        # and the tenants' conversation policies (kdn/origin/conversations.py)
        self.health = Health(self.actors, beat=lambda: {
            "drops": self.store.drops.state(), "conversation_policies": self.store.conversations.policies})
        if http_host is not None and (not isinstance(http_host, str) or not http_host):
            raise BadRequest(f"http_host must be an address or \"node\", got {http_host!r:.80}")
        self.pusher = Pusher(self.store, self.actors, self.roster, self.tokens, http_host)
        self.intake = Intake(self.tokens.admin)      # edges' write-behind over their frames
        # clients' bulk writes over the origin's HTTP server (kdn/origin/http.py), which checked the token
        self.pusher.ingest = {"chunks": lambda cs: self.put_chunks(cs, token=self.tokens.admin),
                              "objects": lambda cs: self.put_objects(cs, token=self.tokens.admin)}
        self.counters = collections.Counter(chunks_received=0, chunks_written=0, versions_committed=0,
                                            chunks_served=0, rehomed_chunks=0, health_errors=0)
        self.started = time.time()
        self._changing = asyncio.Lock()   # one membership change (and its re-homing) at a time
        self._watch_task = None
        self.watch_failure = None         # set when the health watch died of a bug
        self._pushes = set()              # object pushes in flight (put_objects)
        self._push_backlog = 0            # their bytes
        self._push_queue = collections.deque()   # (keys, bytes, objects, seq, when) not started yet
        self._push_queued = 0             # their bytes
        self._push_seq = 0                # the next queued push's number
        self._push_started = 0            # pushes numbered below this have started
        self._hurried = 0                 # pushes numbered below this start without waiting
        self._push_worker = None          # the task starting them (_push_loop)
        self._intaking = 0                # object stores being taken in now
        self._intake_at = 0.0             # when the last one ended (time.monotonic)

    # --- lifecycle and health ----------------------------------------------------------
    def _start_background(self):
        if self._watch_task is None:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())
            self._watch_task.add_done_callback(self._watch_ended)

    async def _watch(self):
        """Each period: ping every edge; take the dead out of the ring, let the living back."""
        while True:
            await asyncio.sleep(PERIOD_S)
            try:
                await self._health_round()
            except (KDNError, OSError):   # a refusal, a full disk when saving: next period
                self.counters["health_errors"] += 1
                log.exception("origin of network %r: health round failed", self.network)

    def _watch_ended(self, task) -> None:
        """Anything else is a bug: it ends the watch, and says so in stats and the log."""
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.watch_failure = f"{type(e).__name__}: {e}"
            log.error("origin of network %r: health watch died", self.network, exc_info=e)

    async def _health_round(self):
        if self.roster.recovering:
            async with self._changing:
                await self._recover_version()
        version = self.roster.version
        keep = await self.health.round(self.roster.members)
        if keep is not None:
            async with self._changing:
                if self.roster.version == version:   # else an operator changed it meanwhile
                    await self._apply_members(keep)

    async def _recover_version(self):
        """After an unreadable membership file: number the next version above every version
        an edge holds (edges ignore an older one), once any edge answers. The caller holds
        _changing, so no membership is saved under a number edges would ignore."""
        if not self.roster.recovering:
            return
        replies = await self.pusher.every_edge().membership()
        seen = [r["version"] for r in replies if isinstance(r, dict)]
        if seen or not self.roster.members:
            await asyncio.to_thread(self.roster.save, version=max(seen, default=0) + 1)
            await self._broadcast_membership()
            self.roster.recovering = False       # only once the edges have the new version

    def _is_admin(self, token) -> bool:
        """The admin, or anyone on an open network (no admin token: a one-user cluster)."""
        return self.tokens.admin is None or self.tokens.is_admin(token)

    async def ping(self, token=None) -> dict:
        self._start_background()
        await self.pusher.http_url()      # serving its frames from the first ping (start_network's)
        return {"role": "origin", "network": self.network, "members": self.roster.version,
                "pid": os.getpid()}

    async def membership(self, token=None) -> dict:
        """What clients and edges compute placement from (they never ask per request); the
        same for every caller (operators' overrides are in stats, for the admin)."""
        self._start_background()
        return self.roster.view()

    async def stats(self, token=None) -> dict:
        counters = collections.Counter()
        for part in (self, self.pusher, self.intake, self.health, self.roster):
            counters.update(part.counters)
        m = self.roster
        out = {"role": "origin", "network": self.network, "members": len(m.members),
               "down": sorted(self.health.down), "membership_version": m.version,
               "membership_quarantined": m.quarantined is not None, "membership_recovering": m.recovering,
               "uptime_s": time.time() - self.started, "store": await asyncio.to_thread(self.store.stats),
               "counters": dict(counters), "override_count": len(m.overrides),
               "watch_failure": self.watch_failure,
               "http": None if self.pusher.http is None else {"url": self.pusher.http.url,
                                                              **self.pusher.http.counters}}
        if self._is_admin(token):
            out["overrides"] = m.overrides
            out["quarantined_manifests"] = await asyncio.to_thread(self.store.quarantined)
            out["kbs"] = await asyncio.to_thread(self.store.kbs)   # their own versions, no copies
        return out

    # --- membership --------------------------------------------------------------------
    async def set_members(self, members, token=None) -> dict:
        """Replace the membership (list of (name, region, weight)); re-home keys that moved.
        Everything is checked first: a bad list changes nothing."""
        self.tokens.check_admin(token, "set_members")
        members = check_members(members, self.topology.regions)
        self._start_background()
        async with self._changing:
            view = await self._apply_members(self.health.in_ring(members))
        self.health.keep_only(m[0] for m in members)
        self.intake.forget_all()         # no connection kept to an edge that left
        return view

    async def _apply_members(self, members) -> dict:
        """Save, broadcast and re-home a new membership (the caller holds _changing)."""
        await self._recover_version()
        if members != self.roster.members:
            old = self.roster.ring
            await asyncio.to_thread(self.roster.save, members=members)
            await self._broadcast_membership()
            self.counters["rehomed_chunks"] += await self.pusher.rehome(old)
        else:
            await self._broadcast_membership()
        return self.roster.view()

    async def _broadcast_membership(self):
        await self.pusher.every_edge().set_membership(self.roster.view())

    async def add_edge(self, name: str, region: str, weight: float = 1.0, token=None) -> dict:
        self.tokens.check_admin(token, "add_edge")
        check_node_name(name)
        if name in self.roster.names():
            raise BadRequest(f"edge {name!r} is already a member")
        return await self.set_members(self.roster.members + [(name, region, weight)], token=token)

    async def remove_edge(self, name: str, token=None) -> dict:
        self.tokens.check_admin(token, "remove_edge")
        check_node_name(name)
        if self.health.forget(name):
            return self.roster.view()
        names = self.roster.names()
        if name not in names:
            raise BadRequest(f"edge {name!r} is not a member (members: {names})")
        self.actors.forget(name)
        return await self.set_members([m for m in self.roster.members if m[0] != name], token=token)

    # --- publish -----------------------------------------------------------------------
    async def stored(self, keys, token=None) -> list:
        """Per key, the checksum of the KV stored under it (None where absent or corrupt): a
        publisher sends only the None ones and records these checksums in its manifest, since
        a key means the bytes stored first (its own KV may differ in the last bits). Reads
        and verifies every stored chunk of keys: 200 MB took 14 ms from the page cache (a
        cold disk reads at its own speed)."""
        self.tokens.check_admin(token, "publish (stored)")
        keys = _keys(keys)
        return await self._each(self.store.sum_of, keys)

    async def has(self, keys, ns: bytes = None, token=None) -> list:
        """Which keys are stored intact; given ns, which are stored under that namespace by
        their frame headers only. That is the edges' lookup hint, reachable by any reader:
        it must not read whole KBs off disk (get_chunks still never serves a corrupt copy)."""
        self.tokens.check_admin(token, "has")
        keys = _keys(keys)
        if ns is None:
            return await self._each(self.store.has, keys)
        ns = _ns(ns)
        return [k_ns == ns for k_ns in await self._each(self.store.ns_of, keys)]

    async def put_chunks(self, chunks, token=None) -> dict:
        self.tokens.check_admin(token, "publish (put_chunks)")
        if not isinstance(chunks, (list, tuple)) or len(chunks) > MAX_CHUNKS_PER_CALL:
            raise BadRequest(f"put_chunks takes a list of at most {MAX_CHUNKS_PER_CALL} chunks, got "
                             f"{len(chunks) if isinstance(chunks, (list, tuple)) else type(chunks).__name__}")
        bad = next((i for i, c in enumerate(chunks) if not isinstance(c, Chunk)), None)
        if bad is not None:
            raise BadRequest(f"put_chunks: item {bad} is a {type(chunks[bad]).__name__}, not a Chunk")
        if sum(c.nbytes for c in chunks) > MAX_BYTES_PER_CALL:
            raise BadRequest(f"put_chunks carries more than {MAX_BYTES_PER_CALL} bytes: split it")
        results = await asyncio.to_thread(self.store.put_chunks, chunks)    # one fsync batch
        written = sum(w for w, _ in results)
        self.counters["chunks_received"] += len(chunks)
        self.counters["chunks_written"] += written
        # sums: the checksum now stored under each key, the chunk's own or (deduplicated) the
        # one stored first, which the publisher's manifest must carry
        return {"received": len(chunks), "written": written, "sums": [x for _, x in results]}

    async def put_objects(self, chunks, token=None) -> dict:
        """Store opaque chunks (another cache layer's objects, kdn.integrations.objects) durably: no
        manifest names them, so storing is their commit, and the answer comes once they are
        (one fsync batch per call). Their push to the ring owners follows in the background
        (`_push_objects`); until an owner has one, an edge's pull-through reads it here.
        {"received", "written", "pushing": objects whose push was queued, "kept_other": the keys
        held here already with other bytes, which a key keeps (its first ones): an edge that
        acknowledged such a store lets its own copy go (kdn/edge/stores.py)}."""
        self.tokens.check_admin(token, "put_objects")
        check_objects(chunks, MAX_CHUNKS_PER_CALL, "put_objects")
        if sum(c.nbytes for c in chunks) > MAX_BYTES_PER_CALL:
            raise BadRequest(f"put_objects carries more than {MAX_BYTES_PER_CALL} bytes: split it")
        def put():            # in a worker thread: the writes, the fsync and the checksums
            done = self.store.put_objects(chunks)
            return done, [c.key for c, (w, stored) in zip(chunks, done) if not w and stored != c.digest()]
        with self._intake():
            results, other = await asyncio.to_thread(put)
        new = [c for c, (w, _) in zip(chunks, results) if w]
        self.counters["objects_received"] += len(chunks)
        self.counters["objects_written"] += len(new)
        self.counters["objects_kept_other"] += len(other)
        # only what was written: a deduplicated key's owners were sent it when it was
        return {"received": len(chunks), "written": len(new),
                "pushing": self._push_objects(new) if new else 0, "kept_other": other}

    async def put_object_refs(self, refs, token=None) -> dict:
        """put_objects of objects an edge keeps in Ray's object store, handed over by reference
        (its write-behind, kdn/edge/stores.py): read here with no copy on the edge's node, pulled
        once from another. Unreachable when they cannot be read within REF_READ_TIMEOUT_S (the
        edge or its node is gone, or too slow): the caller tries again, or sends the bytes."""
        import ray
        import ray.exceptions as rex
        self.tokens.check_admin(token, "put_object_refs")
        if (not isinstance(refs, (list, tuple)) or len(refs) > MAX_CHUNKS_PER_CALL
                or not all(isinstance(r, ray.ObjectRef) for r in refs)):
            raise BadRequest(f"put_object_refs takes a list of at most {MAX_CHUNKS_PER_CALL} object "
                             f"references, got {type(refs).__name__}")
        t0 = time.perf_counter()
        try:
            with self._intake():
                chunks = await asyncio.to_thread(ray.get, list(refs), timeout=REF_READ_TIMEOUT_S)
        except (rex.GetTimeoutError, rex.ObjectLostError) as e:
            self.counters["object_ref_failures"] += 1
            raise Unreachable(f"put_object_refs: the objects handed over could not be read "
                              f"({type(e).__name__})") from None
        # the pace of Ray's path, beside object_pull_http_* (kdn/origin/intake.py)
        self.counters["object_refs_read"] += len(chunks)
        self.counters["object_ref_bytes"] += sum(c.nbytes for c in chunks if isinstance(c, Chunk))
        self.counters["object_ref_us"] += int((time.perf_counter() - t0) * 1e6)
        return await self.put_objects(chunks, token=token)

    async def data_address(self, token=None) -> dict:
        """Where a client on another node writes its chunks and objects over HTTP
        (kdn/client/ingest.py): {"url": the origin's HTTP base URL (its server started now), or
        None when it serves none (no http_host), "node": its Ray node id, "ip": its node's
        address, "max_write_bytes": the most one write's body may carry}. No token: an address is no secret, and the server checks every request's."""
        import ray
        from kdn.core.serving import MAX_INGEST_BYTES
        on_ray = ray.is_initialized()
        return {"url": await self.pusher.http_url(),
                "node": ray.get_runtime_context().get_node_id() if on_ray else None,
                "ip": ray.util.get_node_ip_address() if on_ray else None, "max_write_bytes": MAX_INGEST_BYTES}

    async def pull_objects(self, edge: str, keys, sums=None, token=None) -> dict:
        """put_objects of the objects of keys pulled from edge's own HTTP frames (its
        write-behind over the data plane, kdn/origin/intake.py): put_objects' answer, with
        "pulled" (objects received intact) and "missing" (the keys that were not: the edge
        sends those over Ray); {"pulled": None} when this origin does not read edge over HTTP
        (no data plane here, the edge not a member, on this node or out of reach, or its server
        did not answer within intake.PULL_DEADLINE_S): the edge sends the batch over Ray.
        sums: per key the checksum (xxh3_64) of the copy the edge acknowledged, None where it
        has none: a frame of other bytes (the edge holds another copy of the key), or one with
        no checksum to compare, is missing, so only the bytes acknowledged are stored."""
        self.tokens.check_admin(token, "pull_objects")
        check_node_name(edge)
        keys = _keys(keys)
        if len(set(keys)) != len(keys):
            raise BadRequest("pull_objects: a key is named twice")
        if sums is None:
            sums = [None] * len(keys)
        if (not isinstance(sums, (list, tuple)) or len(sums) != len(keys)
                or not all(x is None or (type(x) is int and 0 <= x < 1 << 64) for x in sums)):
            raise BadRequest("pull_objects: sums must be a list of one 64-bit checksum (or None) per key")
        # an edge out of the ring (taken out as down, removed) may still hold a backlog: over Ray
        url = await self.pusher.edge_url(edge) if edge in {m[0] for m in self.roster.members} else None
        if url is None:
            return {"pulled": None}
        with self._intake():
            got = await self.intake.pull(url, keys, sums)
        if got is None:              # its server did not answer: asked for its address again later
            self.pusher.data.forget(edge)
            self.intake.forget(url)
            return {"pulled": None}
        objs = [o for o in got if o is not None]
        answer = await self.put_objects(objs, token=token) if objs else {
            "received": 0, "written": 0, "pushing": 0, "kept_other": []}
        return {**answer, "pulled": len(objs), "missing": [k for k, o in zip(keys, got) if o is None]}

    def _push_objects(self, chunks) -> int:
        """Queue the push of chunks to their owners; how many were queued. A queued push holds
        their keys only (it reads the bytes from the store when it runs); the queue waits while
        the intake is busy (_push_loop). Bounded: past OBJECT_PUSH_QUEUE_BYTES of objects
        queued, a batch is not pushed (counted in object_pushes_skipped: owners get it by
        pull-through when read). A push that fails of what no failover expects is counted
        (object_push_errors) and logged."""
        n = sum(c.nbytes for c in chunks)
        if self._push_queued + n > OBJECT_PUSH_QUEUE_BYTES:
            self.counters["object_pushes_skipped"] += len(chunks)
            return 0
        self._push_queue.append((list(dict.fromkeys(c.key for c in chunks)), n, len(chunks),
                                 self._push_seq, time.monotonic()))
        self._push_seq += 1
        self._push_queued += n
        self._push_worker_running()
        return len(chunks)

    def _push_worker_running(self) -> None:
        """The task starting the queued pushes (_push_loop), started where none runs on this
        loop (it ends when the queue is empty; a test's loop may have gone with it)."""
        loop = asyncio.get_running_loop()
        w = self._push_worker
        if w is None or w.done() or w.get_loop() is not loop:
            self._push_worker = loop.create_task(self._push_loop())

    async def _push_loop(self) -> None:
        """Start the queued pushes in order: each once no object has been taken in for
        PUSH_QUIET_S (PUSH_DEFER_MAX_S after it was queued at most; at once where a caller
        waits for it: pushes_settled, delete_objects) and while the pushes in flight leave
        OBJECT_PUSH_BACKLOG_BYTES room for it. Counted: object_pushes_deferred and
        object_push_defer_us (pushes started over 10 ms after they were queued, and how long
        after)."""
        while self._push_queue:
            keys, n, count, seq, queued_at = self._push_queue[0]
            while seq >= self._hurried:
                now = time.monotonic()
                left = PUSH_QUIET_S if self._intaking else self._intake_at + PUSH_QUIET_S - now
                if left <= 0 or now - queued_at >= PUSH_DEFER_MAX_S:
                    break
                await asyncio.sleep(min(left, queued_at + PUSH_DEFER_MAX_S - now, 0.05))
            while self._pushes and self._push_backlog + n > OBJECT_PUSH_BACKLOG_BYTES:
                await asyncio.wait(set(self._pushes), return_when=asyncio.FIRST_COMPLETED)
            late = time.monotonic() - queued_at
            if late > 0.01:
                self.counters["object_pushes_deferred"] += 1
                self.counters["object_push_defer_us"] += int(late * 1e6)
            self._push_queue.popleft()
            self._push_queued -= n
            self._push_started = seq + 1
            self._start_push(keys, n, count)

    def _start_push(self, keys, n: int, count: int) -> None:
        self._push_backlog += n
        task = asyncio.get_running_loop().create_task(self.pusher.push_objects(keys))
        self._pushes.add(task)

        def done(t):
            self._pushes.discard(t)
            self._push_backlog -= n
            if t.cancelled():
                return
            if t.exception() is not None:
                self.counters["object_push_errors"] += 1
                log.error("origin of network %r: pushing %d objects failed", self.network,
                          count, exc_info=t.exception())
            else:
                self.counters["objects_pushed"] += count
        task.add_done_callback(done)

    @contextlib.contextmanager
    def _intake(self):
        """An object store being taken in (pulled from an edge, read from its node, written,
        made durable): the queued pushes wait (_push_loop)."""
        self._intaking += 1
        try:
            yield
        finally:
            self._intaking -= 1
            self._intake_at = time.monotonic()

    async def _pushes_so_far(self) -> None:
        """Start every push queued so far now, and wait until they (and any in flight) land."""
        mark = self._push_seq
        self._hurried = max(self._hurried, mark)
        while self._push_started < mark:
            self._push_worker_running()
            await asyncio.sleep(0.01)
        await asyncio.gather(*list(self._pushes), return_exceptions=True)

    async def pushes_settled(self, token=None) -> dict:
        """Wait for the object pushes queued so far (waiting ones start now); their counters
        (for tests and operators)."""
        self.tokens.check_admin(token, "pushes_settled")
        await self._pushes_so_far()
        return {k: self.counters[k] for k in ("objects_pushed", "object_pushes_skipped",
                                              "object_push_errors")}

    async def delete_objects(self, keys, ns: bytes, token=None) -> dict:
        """Delete opaque objects of namespace ns (a host layer's delete: LMCache's eviction)
        from the store, then ask every edge to drop them, and the keys not stored here at all
        (a store its writer withdrew from an edge's backlog first may have copies at edges of
        its region: kdn.origin.collector). A key that is another thing here (a KB's chunk) is
        left alone. {"deleted": how many were stored here, "dropped": edge -> copies it dropped}."""
        self.tokens.check_admin(token, "delete_objects")
        keys, ns = _keys(keys), _ns(ns)
        # pushes queued and in flight first (waiting ones start now): one landing after the
        # drop would bring a copy back
        await self._pushes_so_far()
        gone, absent = await asyncio.to_thread(self.store.delete_objects, keys, ns)
        self.counters["objects_deleted"] += len(gone)
        drop = gone + absent
        # with the log's settled head: a copy on its way into an edge read before it is refused
        at = await asyncio.to_thread(settled, self.store) if drop else None
        dropped = await self.pusher.every_edge().drop(drop, drops=at) if drop else []
        return {"deleted": len(gone), "dropped": dict(zip(self.roster.names(), dropped))}

    async def commit(self, manifest: dict, push: bool = True, token=None) -> dict:
        """Commit a manifest (all its chunks must be stored), push to owners, return a receipt."""
        self.tokens.check_admin(token, "publish (commit)")
        m = Manifest.from_dict(manifest) if isinstance(manifest, dict) else manifest
        if not isinstance(m, Manifest):
            raise BadRequest(f"commit takes a manifest, got {type(manifest).__name__}")
        if not isinstance(push, bool):
            raise BadRequest(f"push must be True or False, got {push!r:.40}")
        if OVERRIDE_META in m.meta:
            raise BadRequest(f"manifest meta key {OVERRIDE_META!r} is the origin's (an operator's "
                             "emphasis override, set with set_override): a publisher cannot set it")
        if m.n_tokens > MAX_TOKENS_PER_KB:
            raise BadRequest(f"KB {m.name!r} has {m.n_tokens} tokens; the limit is {MAX_TOKENS_PER_KB}")
        check_copy(m)          # an emphasized copy names the KB version it edits: retired with it
        if is_emphasized(m):
            await asyncio.to_thread(self._edited_version, m)
        t0 = time.perf_counter()
        latest = await asyncio.to_thread(self._latest, m.ns, m.name)
        if latest is not None and _same_content(latest, m):
            committed, unchanged = latest, True    # publishing unchanged knowledge: no new version
        else:
            committed, unchanged = await asyncio.to_thread(self.store.commit, m), False
            self.counters["versions_committed"] += 1
        await self.pusher.every_edge().add_manifest(self._listed(committed))
        placement, pushed = await self.pusher.push(committed) if push else ({}, {})
        return {"kb": committed.name, "tenant": committed.tenant, "version": committed.version,
                "unchanged": unchanged, "chunks": len(committed.keys), "tokens": committed.n_tokens,
                "bytes": await asyncio.to_thread(self._bytes_of, committed.keys),
                "placement": placement, "pushed": pushed, "seconds": time.perf_counter() - t0}

    async def _each(self, fn, items) -> list:
        """[fn(x) for x in items] off the event loop, several at once (the store's map)."""
        return await asyncio.to_thread(self.store.map, fn, items)

    def _edited_version(self, copy: Manifest) -> None:
        """BadRequest unless the KB version an emphasized copy edits is committed (a copy of no
        version would never be retired)."""
        fp, kb, version = copy_of(copy)
        try:
            self.store.manifest(namespace_digest(copy.tenant, fp), kb, version)
        except VersionNotFound:
            raise BadRequest(f"{copy.label()} is an emphasized copy of {kb}@v{version} under model "
                             f"{fp!r:.120}, which is not committed") from None

    def _latest(self, ns, name):
        try:
            return self.store.manifest(ns, name)
        except VersionNotFound:
            return None

    def _bytes_of(self, keys) -> int:
        return sum(self.store.map(self.store.size_of, list(set(keys))))

    # --- reads (edges' pull-through, operators) ----------------------------------------
    async def get_chunks(self, keys, token=None) -> list:
        """Chunks for `keys` (None where absent or found corrupt: a corrupt copy is never served);
        Encoded frames where the store is compressed."""
        self.tokens.check_admin(token, "get_chunks")
        keys = _keys(keys)
        chunks = await asyncio.to_thread(outgoing, self.store, keys, self.store.map)
        self.counters["chunks_served"] += sum(c is not None for c in chunks)
        return chunks

    async def manifests(self, ns: bytes = None, name: str = None, own: bool = False, token=None) -> list:
        """Committed manifests, of namespace ns (else of all), of KBs called name (else of all).
        Emphasized copies (kdn.core.emphasis) are listed too, for edges, unless own=True: an
        operator's listing, where only the KBs' own manifests are meant."""
        self.tokens.check_admin(token, "manifests")
        ns = None if ns is None else _ns(ns)
        name = None if name is None else _name(name, "KB name")
        if not isinstance(own, bool):
            raise BadRequest(f"own must be True or False, got {own!r:.40}")
        ms = await asyncio.to_thread(self.store.manifests, ns, name)
        return [self._listed(m) for m in (own_manifests(ms) if own else ms)]

    async def manifest(self, ns: bytes, name: str, version: int = None, token=None) -> dict:
        self.tokens.check_admin(token, "manifest")
        ns, name = _ns(ns), _name(name, "KB name")
        version = None if version is None else _version(version)
        return self._listed(await asyncio.to_thread(self.store.manifest, ns, name, version))

    def _listed(self, m: Manifest) -> dict:
        """A manifest as readers get it: as stored, plus in its meta the KB's emphasis override
        where an operator set one (kdn.core.emphasis.OVERRIDE_META). Never on an emphasized
        copy's manifest (its KV is edited already)."""
        d = m.to_dict()
        w = self.roster.overrides.get(overrides.kb_id(m.tenant, m.name), {}).get("emphasis")
        if w and not is_emphasized(m):
            d["meta"] = {**d["meta"], OVERRIDE_META: w}
        return d

    async def delete_version(self, ns: bytes, name: str, version: int, token=None) -> dict:
        """Retire a KB version, and its emphasized copies with it (kdn/origin/store.py:
        ChunkStore.delete_version); edges forget each manifest. {"deleted": "name@vN",
        "emphasized_copies": how many copies went with it}."""
        self.tokens.check_admin(token, "delete_version")
        ns, name, version = _ns(ns), _name(name, "KB name"), _version(version)
        copies = await asyncio.to_thread(self.store.delete_version, ns, name, version)
        for c in copies:
            await self.pusher.every_edge().drop_manifest(c.ns, c.name, c.version)
        await self.pusher.every_edge().drop_manifest(ns, name, version)
        return {"deleted": f"{name}@v{version}", "emphasized_copies": len(copies)}

    async def drops(self, since: int = None, token=None) -> dict:
        """The drop log (kdn/origin/drops.py) for an edge catching up: its id ("log"), its settled
        head (every key logged before it is gone from the store), and the keys logged from
        sequence number since up to it ("keys"; None when since is None or the log no longer
        keeps it: the edge then starts over)."""
        self.tokens.check_admin(token, "drops")
        log = self.store.drops
        since = None if since is None else check_int(since, "since", 0)
        state = await asyncio.to_thread(settled, self.store)
        if since is None:
            return {**state, "keys": None}
        keys, head = await asyncio.to_thread(log.since, since, state["head"])
        return {"log": log.id, "head": head, "keys": keys}

    async def collect(self, object_ttl_s: float = None, token=None) -> dict:
        """Delete chunks no committed version names; opaque objects stay unless written more
        than object_ttl_s seconds ago (kdn/origin/store.py: ChunkStore.collect)."""
        self.tokens.check_admin(token, "collect")
        if object_ttl_s is not None:
            object_ttl_s = check_number(object_ttl_s, "object_ttl_s", 0)
        return await asyncio.to_thread(self.store.collect, object_ttl_s)

    # --- operator controls -------------------------------------------------------------
    async def _manifests_of(self, tenant: str, kb: str) -> list:
        """Every committed manifest of a tenant's KB under any model fingerprint, its emphasized
        copies (kdn.core.emphasis) included."""
        return [m for m in await asyncio.to_thread(self.store.manifests, None, kb) if m.tenant == tenant]

    async def _versions_of(self, tenant: str, kb: str) -> list:
        """Every committed version of a tenant's KB, under any model fingerprint: the KB's own
        manifests, never its emphasized copies (same name and versions, derived fingerprints)."""
        return own_manifests(await self._manifests_of(tenant, kb))

    async def set_override(self, tenant: str, kb: str, pin_regions=None, replicas=None, ttl_s=None,
                           prefetch=None, emphasis=None, token=None) -> dict:
        """Per-KB operator settings, applied at once: the latest version is pushed and pinned,
        and a TTL starts now for the KB's chunks edges already hold. An emphasis (alone) moves
        nothing: readers see it in the manifests listed from now on (kdn.core.emphasis)."""
        self.tokens.check_admin(token, "operator control (set_override)")
        tenant, kb = _name(tenant, "tenant"), _name(kb, "KB name")
        key = overrides.kb_id(tenant, kb)
        n_edges = len(self.roster.members) + len(self.health.down)

        def change(documents=None):
            return overrides.updated(self.roster.overrides.get(key, {}), self.topology.regions, n_edges,
                                     pin_regions=pin_regions, replicas=replicas, ttl_s=ttl_s,
                                     prefetch=prefetch, emphasis=emphasis, documents=documents)

        change()                                   # bad values: BadRequest before anything else
        stored = await self._manifests_of(tenant, kb)
        versions = own_manifests(stored)
        if not versions:
            raise ManifestError(f"no committed knowledge base {tenant}/{kb}")
        latest = max(versions, key=lambda m: m.version)
        names = [d.name for d in latest.documents]
        change(names)                              # emphasis names the latest version's documents
        async with self._changing:                 # on the overrides as they are now
            ov = change(names)
            await asyncio.to_thread(self.roster.save, overrides={**self.roster.overrides, key: ov})
        out = {"kb": kb, "override": ov, "placement": {}, "pushed": {}}
        if any(v is not None for v in (pin_regions, replicas, ttl_s, prefetch)):
            await self._broadcast_membership()
            out["placement"], out["pushed"] = await self.pusher.push(latest)
        if ttl_s is not None:                      # its emphasized copies' chunks too, as pushes do
            keys = list(dict.fromkeys(k for m in stored for k in m.keys))
            held = await self.pusher.every_edge().set_ttl(keys, ov["ttl_s"])
            out["ttl_set"] = dict(zip(self.roster.names(), held))
        return out

    async def warm(self, tenant: str, kb: str, region: str, version: int = None, token=None) -> dict:
        """Copy a KB's chunks into every edge of `region` now, as hot copies (prefetch)."""
        self.tokens.check_admin(token, "operator control (warm)")
        tenant, kb = _name(tenant, "tenant"), _name(kb, "KB name")
        if not isinstance(region, str) or region not in self.topology.regions:
            raise BadRequest(f"region {region!r:.60} is not one of {', '.join(self.topology.regions)}")
        version = None if version is None else _version(version)
        ms = [m for m in await self._versions_of(tenant, kb) if version is None or m.version == version]
        if not ms:
            raise ManifestError(f"no committed knowledge base {tenant}/{kb}"
                                + (f" version {version}" if version else ""))
        edges = self.roster.edges_in(region)
        if not edges:
            raise BadRequest(f"no edge in region {region!r}")
        m = max(ms, key=lambda m: m.version)
        sent = await self.pusher.warm(m, edges)
        return {"kb": kb, "version": m.version, "region": region, "sent": sent}

    async def auth_config(self, token=None) -> dict:
        """The token configuration, for an edge an operator adds (admin only)."""
        self.tokens.check_admin(token, "auth_config")
        return self.tokens.to_dict()

    # --- pinned conversations (kdn/origin/conversations.py) -------------------------------------
    async def set_conversation_policy(self, tenant: str, ttl_s=None, budget_bytes=None, max_ttl_s=None,
                                      pinned=None, token=None) -> dict:
        """A tenant's conversation policy (kdn/origin/conversations.py), durably: its idle TTL, the
        longest TTL a request may ask for, its byte budget per edge (None: left as is), and
        whether its conversation KV is pinned here (its home edges send what they keep) or
        not (its chunks here are deleted; edges keep theirs under the tenant's TTL). Every
        edge applies it with the next health ping. {"tenant", "policy", "deleted": chunks}."""
        self.tokens.check_admin(token, "set_conversation_policy")
        tenant = _name(tenant, "tenant")
        policy = await asyncio.to_thread(self.store.conversations.set_policy, tenant, ttl_s=ttl_s,
                                         budget_bytes=budget_bytes, max_ttl_s=max_ttl_s, pinned=pinned)
        deleted = await asyncio.to_thread(self.store.delete_conversation, tenant) if pinned is False else 0
        return {"tenant": tenant, "policy": policy, "deleted": deleted}

    async def pinned_conversations(self, tenant: str = None, token=None) -> dict:
        """{"tenants": pinned tenants} and, given tenant, {"chunks": {ns hex: chunks kept here}}."""
        self.tokens.check_admin(token, "pinned_conversations")
        out = {"tenants": sorted(self.store.conversations.tenants)}
        if tenant is not None:
            out["chunks"] = await asyncio.to_thread(self.store.conversations.listing, _name(tenant, "tenant"))
        return out

    async def put_conversation(self, tenant: str, ns: bytes, chunks, token=None) -> dict:
        """A home edge's chunks of a pinned tenant's conversation, stored durably before the
        answer (kdn/origin/store.py: put_conversation). BadRequest for a tenant not pinned, or
        chunks that are not exact Chunks of ns. {"received", "written", "differ": the keys
        held here under other bytes (the edge kept a worker's after it lost this copy; it
        takes these instead)}."""
        self.tokens.check_admin(token, "put_conversation")
        tenant, ns = _name(tenant, "tenant"), _ns(ns)
        if not self.store.conversations.pinned(tenant):
            raise BadRequest(f"tenant {tenant!r} has no pinned conversations: pin it first")
        if not isinstance(chunks, (list, tuple)) or len(chunks) > MAX_CHUNKS_PER_CALL:
            raise BadRequest(f"put_conversation takes a list of at most {MAX_CHUNKS_PER_CALL} chunks")
        chunks = [c.decode() if isinstance(c, Encoded) and c.exact else c for c in chunks]
        bad = next((c for c in chunks if not isinstance(c, Chunk) or c.opaque or c.ns != ns), None)
        if bad is not None:
            raise BadRequest(f"put_conversation takes exact chunks of namespace {ns.hex()}, got "
                             f"{type(bad).__name__}")
        if sum(c.nbytes for c in chunks) > MAX_BYTES_PER_CALL:
            raise BadRequest(f"put_conversation carries more than {MAX_BYTES_PER_CALL} bytes: split it")

        def put():
            results = self.store.put_conversation(tenant, ns, chunks)
            return results, [c.key for c, (w, s) in zip(chunks, results) if not w and s != c.digest()]
        results, differ = await asyncio.to_thread(put)
        written = sum(w for w, _ in results)
        self.counters["conversation_chunks_received"] += len(chunks)
        self.counters["chunks_written"] += written
        return {"received": len(chunks), "written": written, "differ": differ}

    async def conversation_chunks(self, tenant: str, ns: bytes, keys, token=None) -> list:
        """Chunks of the longest prefix of keys that tenant's pinned conversation namespace ns
        holds here (an edge's pull-through; [] when none), stopping at the first unreadable and
        before the reply would pass MAX_BYTES_PER_CALL (the edge asks again for the rest)."""
        self.tokens.check_admin(token, "conversation_chunks")
        tenant, ns, keys = _name(tenant, "tenant"), _ns(ns), _keys(keys)

        def read():
            named = self.store.conversation_prefix(tenant, ns, keys)
            out, size = [], 0
            for i in range(0, len(named), 64):     # read no further than the reply carries
                for c in outgoing(self.store, named[i:i + 64], self.store.map):
                    if c is None or (out and size + c.nbytes > MAX_BYTES_PER_CALL):
                        return out
                    out.append(c)
                    size += c.nbytes
            return out
        chunks = await asyncio.to_thread(read)
        self.counters["chunks_served"] += len(chunks)
        return chunks

    async def drop_conversations(self, tenant: str, token=None) -> dict:
        """Delete a tenant's pinned conversation KV here (it stays pinned: later turns are kept
        again). {"tenant", "deleted": chunks}."""
        self.tokens.check_admin(token, "drop_conversations")
        tenant = _name(tenant, "tenant")
        return {"tenant": tenant, "deleted": await asyncio.to_thread(self.store.delete_conversation, tenant)}
