"""Stores acknowledged at the edge: another cache layer's objects kept here at once, made
durable at the origin after (write-behind).

LMCache and SGLang store objects (kdn.integrations.objects) either through the origin, which
answers once they are durable, or, with `ack = "edge"`, through their region's nearest edge:
it verifies the objects, keeps them pinned, answers, and sends them to the origin in the
background (the origin's one fsync batch a call, then its push to the ring owners). A key this
edge owns on the ring is kept in its main tier, where the copy stays once durable; any other
in its hot tier (a quarter of the edge's memory), where it is an ordinary hot copy once
durable. Once the origin has them they are unpinned. Where this edge
serves HTTP, the origin is handed only the keys and pulls the bytes from this edge's frames
(OriginAPI.pull_objects, kdn/origin/intake.py: the data plane between nodes); else, or what
it did not take that way, goes over Ray.

The answer waits for no copy: each object is kept as it arrived (Held.arrival: a view into
the caller's argument in this node's object store, which Ray keeps while this process maps
it, the caller gone or not), and put into an object of this node's own right after the
answer, in a worker thread (adopted, kdn/edge/arrivals.py: the copy into fresh store memory
that the answer used to wait for), then handed to the origin as a reference. A store of a
key this edge holds already as its own object, with the same checksum, keeps that copy (one
key, one byte string). The
copy of a key this edge owns on the ring belongs in its main tier (the origin pushes nothing
to an owner that holds the key): it is kept there from the start, pinned until durable, while
the store pins fill at most MAIN_PIN_SHARE of that tier (the rest is for the operator's pinned
KBs); else in the hot tier, and moved to main once durable. A copy still an arrival when
durable (its copy into the store refused) is never a main copy: it goes to the hot tier.

What the edge has acknowledged and the origin does not hold yet is the backlog, bounded by
`backlog_bytes`: a store that would pass the bound waits, in its arrival order, until the
origin has made room (what it held landed), for `backlog_wait_s` at most, and is then
acknowledged here like the others; one that finds no room in that time (the origin slow or
down), is larger than the bound itself, or finds the bound's worth of stores waiting before
it is sent to the origin and acknowledged once durable there (its answer's `pending` does not
count it). Either way memory stays bounded and a slow
origin slows its writers instead of losing their bytes; waiting for room sends the bytes once,
by the backlog's way, where sending them past it put a second stream into the origin beside
the backlog's (kdn bench l2: docs/figures.md, session 37). An origin that
does not answer, or refuses a batch (an error it raised on purpose: its disk full), is tried
again (FORWARD_RETRY_S apart); nothing in the backlog is dropped.
The risk, said in the README: an edge that dies with a backlog loses those objects (the host
recomputes them on its next miss: never a wrong byte), and until they are durable only this
edge serves them (another region's load misses them).

Counters (objects): store_acked_edge, store_acked_origin (answered once durable at the origin,
of which store_origin_backlog_full: the backlog would have passed its bound and no room came
in backlog_wait_s (or the store is larger than the bound, or the line of stores waiting for
room holds the bound's worth already), and
store_origin_no_room: this edge's memory could not hold them pinned, or a drop of the key came
first; the rest failed this edge's check, counted as corrupt_detected), store_forwarded (of which
store_forwarded_http, with store_forwarded_http_bytes: pulled by the origin from this edge's
frames; store_forwarded_by_ref: handed to the origin as references into this node's object
store, so the copy kept here is the one the origin reads and the arriving bytes are freed at
once), store_forward_http_declined (batches the origin would not pull over HTTP: over Ray),
store_forward_retries (of which store_forward_errors: batches the origin refused, its disk
full say: tried again like one it did not answer), store_forgotten (deleted before sent; of which
store_withdrawn: taken out ahead of a host's delete, withdraw()), store_deleted_again (deleted
while on their way), store_adopted and store_adopt_us (arrivals made this node's own, the
time it took), store_adopt_errors (copies the object store refused: those stay arrivals),
store_held_already (a copy held here kept instead of the arrival); stores written to this
edge's HTTP server by writers on other nodes (POST /v1/objects, kdn/edge/http.py):
store_http_writes, store_http_objects, store_http_bytes, store_http_receive_us (receiving and
verifying their frames), store_http_keep_us (then keeping them, as put does); a store of a key whose
earlier copy waits in the backlog, answered by that copy and not sent: store_queued_already
(the same bytes), store_kept_first (other bytes: a key keeps its first bytes, here as at the
origin), store_queued_unchecked (copies without a checksum to compare);
store_origin_kept_other (copies let go once durable because the origin answered that it holds
other bytes under their keys: a key held here as durable and stored again with other bytes,
or one the origin took from another writer first; readers then get the origin's bytes);
store_kept_as_main (copies of keys this edge owns kept in its main tier: stored there, or
moved there once durable); store_backlog_waits and store_backlog_wait_us (stores that waited
for room in the backlog, the time they waited); the
backlog's objects and bytes in stats() (`kdn status`, /metrics).
"""
import asyncio
import collections
import logging
import time

from kdn.core.chunk import check_objects
from kdn.core.errors import KDNError, NetworkError
from kdn.edge.arrivals import Arrivals

log = logging.getLogger("kdn.edge")

BACKLOG_BYTES = 1 << 30       # acknowledged here, not yet durable at the origin
FORWARD_BATCH_BYTES = 64 << 20
FORWARD_RETRY_S = 1.0
HTTP_RETRY_S = 30.0           # an origin that reads this edge over Ray is asked to pull again after this
MAX_OBJECTS_PER_CALL = 4096
MAIN_PIN_SHARE = 0.5          # of the main tier, at most, pinned by stores not yet durable
BACKLOG_WAIT_S = 5.0          # a store past the backlog's bound waits this long at most for room


class WriteBehind:
    """One edge's objects acknowledged before they are durable, and their way to the origin."""

    def __init__(self, tiers, forms, peers, backlog_bytes: int = BACKLOG_BYTES, owns=None,
                 name: str = None, serves_http=None, backlog_wait_s: float = BACKLOG_WAIT_S,
                 arrivals: Arrivals = None):
        """name and serves_http (whether this edge's frames may be read over HTTP now): the
        origin is asked to pull the backlog from those frames (OriginAPI.pull_objects);
        arrivals: the edge's (kdn/edge/arrivals.py), which adopts the stores kept as they arrived."""
        self.tiers, self.forms, self.peers = tiers, forms, peers
        self.arrivals = arrivals or Arrivals(peers.later)
        self.name, self.serves_http = name, serves_http or (lambda: False)
        self._ray_until = 0.0                  # the origin reads none of this edge's frames before
        self.owns = owns or (lambda keys: [False] * len(keys))   # keys -> whether this edge is a ring owner
        self.backlog_bytes = int(backlog_bytes)
        self.backlog_wait_s = float(backlog_wait_s)
        self._reserved = 0                     # bytes of puts let into the backlog, not queued yet
        self._waiters = collections.deque()    # [future, bytes] of puts waiting for room, in order
        self._queue = collections.deque()      # copies kept here (Held) not yet at the origin, oldest first
        self._pending = 0                       # their bytes
        self._pinned = {}                      # key -> the tier ("hot", "main") pinning it until durable
        self._queued = collections.Counter()   # key -> its copies in the queue
        self._flight = {}                      # key -> ns of the batch on its way to the origin
        self._flight_ids = set()               # its chunks (a key may wait again behind it)
        self._redelete = collections.defaultdict(set)   # ns -> keys deleted while in flight
        self._wake = None
        self._task = None
        self.counters = collections.Counter()

    async def put(self, chunks) -> dict:
        """Keep opaque chunks here and acknowledge them (durable at the origin later); a put
        that would take the backlog past its bound waits for room first (_room_for); what
        this edge cannot hold pinned in memory, or finds no room in time, is acknowledged
        once the origin holds it. {"received", "kept", "pending": how many
        were acknowledged before they are durable}; NetworkError when the origin had to take
        some and did not answer (those are not stored; the rest stay on their way)."""
        check_objects(chunks, MAX_OBJECTS_PER_CALL, "put_objects")
        first = {}                             # each key once; one waiting in the backlog
        for c in chunks:                       # already is answered by that copy (_again)
            first.setdefault(c.key, c)
        n = sum(c.nbytes for k, c in first.items() if k not in self._queued)
        early = await self._room_for(n)
        try:
            kept, pinned, riding, failed = await self._keep(chunks, pin=early)
            ahead = list(pinned.values())          # in the call's order, each key once
            if ahead:
                self._queue.extend(ahead)
                self._queued.update(c.key for c in ahead)
                self._pending += sum(c.nbytes for c in ahead)
                self.counters["store_acked_edge"] += sum(c.key in pinned for c in chunks)
                self._start()
                self.arrivals.later(ahead)
                self._wake.set()
        finally:
            if early:                          # queued (counted in _pending) or not kept
                self._reserved -= n
                self._grant()
        now = [c for c in chunks if c.key not in pinned and c.key not in riding]
        if now:
            if await self.peers.origin().put_objects(now) is None:
                raise NetworkError(f"{len(now)} of {len(chunks)} objects could not be acknowledged at the "
                                   "edge (its backlog of stores not yet durable is full, or its memory "
                                   "would not hold them) and the origin did not answer: those are not stored durably")
            self.counters["store_acked_origin"] += len(now)
            why = "store_origin_backlog_full" if not early else "store_origin_no_room"
            self.counters[why] += sum(c.key not in failed for c in now)
        return {"received": len(chunks), "kept": kept,
                "pending": sum(c.key in pinned or c.key in riding for c in chunks)}

    async def _room_for(self, n: int) -> bool:
        """Whether a put of n bytes may be acknowledged here: at once while the backlog (and
        what puts before it were let in) leaves room for it and no put waits before it; else
        once the origin has made room, waiting in line, for backlog_wait_s at most. False past
        that, for a put larger than the bound itself, and when the puts waiting already hold
        the bound's worth of bytes (their arguments are memory too). A True reserves n bytes
        until the caller releases them (put's finally)."""
        if n == 0 or not self._waiters and self._pending + self._reserved + n <= self.backlog_bytes:
            self._reserved += n
            return True
        if (n > self.backlog_bytes or self.backlog_wait_s <= 0
                or sum(w[1] for w in self._waiters) + n > self.backlog_bytes):
            return False                       # never fits, no wait, or a full line: the origin
        loop = asyncio.get_running_loop()
        entry = [loop.create_future(), n]
        self._waiters.append(entry)
        t0 = time.perf_counter()
        try:
            await asyncio.wait({entry[0]}, timeout=self.backlog_wait_s)
        except asyncio.CancelledError:         # its caller gone: out of the line, room given back
            if entry[0].done() and not entry[0].cancelled():
                self._reserved -= n
            raise
        finally:
            granted = entry[0].done() and not entry[0].cancelled()
            if not entry[0].done():
                entry[0].cancel()
            if entry in self._waiters:
                self._waiters.remove(entry)
            self.counters["store_backlog_waits"] += 1
            self.counters["store_backlog_wait_us"] += int((time.perf_counter() - t0) * 1e6)
            self._grant()                      # whoever waited behind it may fit now
        return granted

    def _grant(self) -> None:
        """Let waiting puts in, in their order, while the backlog has room for the first."""
        while self._waiters:
            fut, n = self._waiters[0]
            if fut.done():                     # gave up (timed out or cancelled)
                self._waiters.popleft()
                continue
            if self._pending + self._reserved + n > self.backlog_bytes:
                return
            self._waiters.popleft()
            self._reserved += n
            fut.set_result(True)

    async def _keep(self, chunks, pin: bool) -> tuple:
        """Keep verified copies (main tier or hot, _role), pinned while not durable when pin: (how many
        were kept, {key: its copy (Held)} for the keys to queue for the origin, the keys whose
        copy waits in the backlog already and answers for them, the keys that failed the check)."""
        stored = await self.forms.to_store(list(chunks), arrival="store" if pin else None)
        born, hot, n, pinned, stray = self.tiers.tombs.birth(), self.tiers.tier("hot"), 0, {}, []
        riding, failed = set(), set()
        mine = self.owns([c.key for c in chunks]) if pin else [False] * len(chunks)
        for c, held, owner in zip(chunks, stored, mine):
            if held is None:                 # failed verification: not kept (the origin
                failed.add(c.key)            # verifies and refuses it too)
                continue
            held = self._held_already(c.key, held)
            held.born = born
            if held is self.tiers.main.peek(c.key):      # held in main already: kept there (a
                n += 1                                   # second entry in hot would count it
                if pin:                                  # twice); the queue's reference keeps it
                    pinned[c.key] = held                 # until durable
                continue
            if c.key in pinned:              # the same key twice in one call: its first copy
                n += 1                       # answers (a key keeps its first bytes)
                continue
            if c.key in self._queued and self._again(c.key, self.tiers.peek(c.key), held):
                riding.add(c.key)                # the copy waiting (hot or main) stays, and answers for it
                n += 1
                continue
            role = self._role(c.key, held, owner and pin)
            tier = self.tiers.tier(role)
            was = tier.is_pinned(c.key)
            if self.tiers.put(role, c.key, held, pin=pin):
                n += 1
                if role == "main":
                    self.counters["store_kept_as_main"] += 1
                    if hot.peek(c.key) is not None and not hot.is_pinned(c.key):
                        hot.discard(c.key)       # an older copy: main's answers for the key now
                if pin and not was and tier.is_pinned(c.key):    # a pin that did not fit: not early
                    self._pinned[c.key] = role
                    pinned[c.key] = held
                else:
                    stray.append(held)
        if stray:     # kept, not in the backlog (the origin answers for them): this node's own
            await self.arrivals.adopt(stray)          # now, and an owner's in its main tier
            for held, mine in zip(stray, self.owns([h.key for h in stray])):
                if mine and not held.arrived and hot.peek(held.key) is held and not hot.is_pinned(held.key):
                    self._as_main(held)
        return n, pinned, riding, failed

    def _role(self, key, held, owner_pin: bool) -> str:
        """Where a store's copy is kept: "main" for a key this edge owns, to pin until durable
        (owner_pin), that main holds no copy of and whose store pins stay within MAIN_PIN_SHARE
        of main; else "hot" (a quarter of the edge's memory)."""
        main = self.tiers.main
        if not owner_pin or main.peek(key) is not None:
            return "hot"
        return "main" if main.pinned_bytes() + held.nbytes <= MAIN_PIN_SHARE * main.capacity else "hot"

    def _again(self, key, waiting, held) -> bool:
        """Whether a store of key, whose copy `waiting` is in the backlog and held here, is
        answered by that copy: always, as the origin answers a key it holds (a key keeps its
        first bytes: kdn/origin/chunks.py), so this edge and the origin end with the same
        bytes and nothing more is sent. Counted: store_queued_already (the same bytes again),
        store_kept_first (other bytes: refused in effect, as at the origin)."""
        if waiting is None:
            return False
        if waiting.xxh is None or held.xxh is None:      # no checksum to compare (Held.here)
            self.counters["store_queued_unchecked"] += 1
            return True
        same = waiting.ns == held.ns and waiting.codec == held.codec and waiting.xxh == held.xxh
        self.counters["store_queued_already" if same else "store_kept_first"] += 1
        if not same:
            log.warning("edge: a store of key %s brought other bytes than its copy waiting for the "
                        "origin: the first bytes are kept, as the origin keeps them", key.hex()[:16])
        return True

    def _held_already(self, key, held):
        """The copy of key this edge holds already, in place of an arrival with the same
        checksum (one key, one byte string) where that copy is this node's own object: a store
        of what is held makes no copy, and readers keep their reference. Else held (also for a
        key in the backlog: each queued copy stays its own entry, as forget() counts them)."""
        old = self.tiers.peek(key)
        if (held.arrived and old is not None and key not in self._queued and old.ref is not None
                and old.own and not old.arrived and old.ns == held.ns and old.codec == held.codec
                and old.xxh is not None and old.xxh == held.xxh):
            self.counters["store_held_already"] += 1
            return old
        return held

    def _start(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()     # of this loop (a test runs several, one at a time)
            self._task = asyncio.get_running_loop().create_task(self._forward())

    async def _forward(self) -> None:
        """Send the backlog to the origin, oldest first, a batch a call; retry what it does
        not answer; unpin what it holds."""
        tries = 0
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch, size = [], 0
            for c in self._queue:
                if batch and (size + c.nbytes > FORWARD_BATCH_BYTES or len(batch) == MAX_OBJECTS_PER_CALL):
                    break
                batch.append(c)
                size += c.nbytes
            self._flight = {c.key: c.ns for c in batch}
            self._flight_ids = {id(c) for c in batch}
            try:
                await self.arrivals.adopt([c for c in batch if c.arrived])
                try:
                    got = await self._send(batch, by_ref=not tries % 2)
                    if got is not None:      # still in flight here: a delete meanwhile is redone,
                        await self._delete_again()    # never taken out of the queue under the pops
                except KDNError as e:        # the origin refused (its disk full: StoreError): again later
                    log.warning("edge: the origin refused a batch of %d stores (%s); trying again", len(batch), e)
                    self.counters["store_forward_errors"] += 1
                    got = None
                if got is None:              # unreachable (counted by Peers) or refused: try again
                    self.counters["store_forward_retries"] += 1
                    tries += 1
                    await asyncio.sleep(FORWARD_RETRY_S)
                    continue
                tries = 0
                self._landed(batch, got)
            finally:
                self._flight, self._flight_ids = {}, set()

    def _landed(self, batch, got) -> None:
        """The batch at the head of the queue is durable at the origin (its answer got): out of
        the queue, unpinned, kept as main where this edge owns the key, let go where the origin
        keeps other bytes under it."""
        hot = self.tiers.tier("hot")
        other, wrong = set(got.get("kept_other") or ()), []
        for c, mine in zip(batch, self.owns([c.key for c in batch])):
            self._queue.popleft()
            self._pending -= c.nbytes
            self._queued[c.key] -= 1
            if self._queued[c.key] <= 0:
                del self._queued[c.key]
            role = self._pinned.pop(c.key, None) if c.key not in self._queued else None
            if role == "main":
                main = self.tiers.main
                if main.is_pinned(c.key):        # not dropped meanwhile: it stays there
                    main.unpin(c.key)
                    cur = main.peek(c.key)
                    if cur is not None and cur.arrived and c.key not in other:   # never adopted:
                        main.discard(c.key)      # the caller's memory, not an owner's copy
                        self.tiers.put("hot", c.key, cur)
            elif role == "hot":
                if c.key in hot:         # not dropped meanwhile
                    hot.unpin(c.key)
                    cur = hot.peek(c.key)        # this copy, or one stored again meanwhile
                    if mine and not cur.arrived and c.key not in other:
                        self._as_main(cur)
            if c.key in other:      # the origin keeps other bytes under it: this copy goes,
                for tier in (hot, self.tiers.main):     # wherever it is (not another copy)
                    if tier.peek(c.key) is c and tier.discard(c.key):
                        wrong.append(c.key)
                        self.tiers.note(c.key)
        self._grant()
        if wrong:
            self.counters["store_origin_kept_other"] += len(wrong)
            log.warning("edge: the origin holds other bytes under %d key(s) stored here (first "
                        "%s): a key keeps its first bytes, so this edge's copies are let go and "
                        "its readers get the origin's", len(wrong), wrong[0].hex()[:16])
        self.counters["store_forwarded"] += len(batch)

    async def _send(self, batch, by_ref: bool):
        """The origin's answer to a batch of the backlog (copies kept here: Held), None when it
        is unreachable. First, where this edge serves HTTP, the origin is asked to pull the
        batch from its frames (the data plane: kdn/origin/intake.py), each key once with the
        checksum of the copy queued here (the origin takes a frame only of those bytes: the
        edge may hold another copy of the key in its main tier); what it did not take that way
        (it reads this edge over Ray: same node, out of reach, no answer, a refusal; asked again
        after HTTP_RETRY_S) goes over Ray. by_ref: handed over as references into this node's object
        store (the origin reads them, no copy made to send them); else, or for copies this
        process holds outside the store (those under INLINE_BYTES), their bytes: a mixed batch
        goes in several calls, answered when all are. A failed hand-over's retry sends every
        one's bytes over Ray."""
        answers = []
        first = {}                           # each key once, with the checksum of its queued copy
        for h in batch:                      # (a copy with none known, Held.here's, goes over Ray)
            if h.xxh is not None:
                first.setdefault(h.key, h)
        if (first and by_ref and self.name is not None and self.serves_http()
                and time.monotonic() >= self._ray_until):
            try:
                got = await self.peers.origin().pull_objects(self.name, list(first),
                                                             [h.xxh for h in first.values()])
            except KDNError as e:            # refused (a bug, a stale origin): Ray takes the batch
                log.warning("edge: the origin refused to pull stores from this edge's frames (%s); "
                            "they go over Ray", e)
                got = {"pulled": None}
            if got is None or got.get("pulled") is None:     # unreachable or declined: Ray for a while
                self._ray_until = time.monotonic() + HTTP_RETRY_S
                self.counters["store_forward_http_declined"] += 1
                if got is None:
                    return None
            else:
                missing = set(got.get("missing") or ())
                taken = {k for k in first if k not in missing}
                self.counters["store_forwarded_http"] += len(taken)
                self.counters["store_forwarded_http_bytes"] += sum(first[k].nbytes for k in taken)
                answers.append(got)
                batch = [h for h in batch if h.key not in taken]
        refs = [h for h in batch if by_ref and h.ref is not None]
        values = [h for h in batch if not (by_ref and h.ref is not None)]
        if refs:
            got = await self.peers.origin().put_object_refs([h.ref for h in refs])
            if got is None:
                return None
            self.counters["store_forwarded_by_ref"] += len(refs)
            answers.append(got)
        if values:      # what the origin already took by reference is deduplicated if resent
            got = await self.peers.origin().put_objects([await h.resolve() for h in values])
            if got is None:
                return None
            answers.append(got)
        if not answers:
            return {"received": 0, "written": 0, "pushing": 0, "kept_other": []}
        merged = {k: sum(a.get(k, 0) for a in answers) for k in ("received", "written", "pushing")}
        merged["kept_other"] = [k for a in answers for k in a.get("kept_other") or ()]
        return merged

    def _as_main(self, held) -> None:
        """A durable copy of a key this edge owns on the ring moves from the hot tier to main,
        where the origin's push would have put it (the push sends nothing to an owner that
        holds the key): evicted with the hot copies, the owner would hold nothing."""
        if self.tiers.main.peek(held.key) is held or self.tiers.put("main", held.key, held):
            self.tiers.tier("hot").discard(held.key)
            self.counters["store_kept_as_main"] += 1

    def forget(self, keys) -> None:
        """Keys deleted (the origin's drop): what of them waits here is not sent; what is on
        its way is deleted again once it lands (it would stand at the origin after the delete)."""
        keys = set(keys)
        if not keys or not (self._queued.keys() & keys or self._flight.keys() & keys):
            return
        for k in keys & self._flight.keys():
            self._redelete[self._flight[k]].add(k)
        self._unqueue(keys)

    async def withdraw(self, keys, timeout_s: float) -> dict:
        """Keys about to be deleted at the origin (a host's eviction: kdn.integrations.objects):
        what of them waits in the backlog is not sent, and what is on its way is waited for
        until it has landed (at most timeout_s), so the delete that follows finds every copy
        this edge acknowledged and none lands after it. The rest of the backlog goes on as it
        was: an eviction waits for at most one batch on its way, not for everything
        acknowledged before it. A copy still on its way at the deadline (the origin slow or
        down) is deleted again once it lands, as forget() does. {"withdrawn": the keys of which
        a copy was taken out of the queue, "settled": whether none is on its way any more,
        "backlog_objects": what the backlog holds after it}."""
        keys = set(keys)
        out = self._unqueue(keys)
        for c in out:          # never to be durable: let go here too, not left pinned (the
            for tier in (self.tiers.tier("hot"), self.tiers.main):     # origin's delete drops
                if tier.peek(c.key) is c and tier.discard(c.key):       # any other copy)
                    self.tiers.note(c.key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._flight.keys() & keys and loop.time() < deadline:
            await asyncio.sleep(0.01)
        late = self._flight.keys() & keys
        for k in late:
            self._redelete[self._flight[k]].add(k)
        self.counters["store_withdrawn"] += len(out)
        return {"withdrawn": len({c.key for c in out}), "settled": not late, "backlog_objects": len(self._queue)}

    def _unqueue(self, keys: set) -> list:
        """The queued copies of keys that are not on their way, taken out of the backlog
        (counted: store_forgotten)."""
        if not self._queued.keys() & keys:
            return []
        kept, out = collections.deque(), []
        for c in self._queue:
            if c.key in keys and id(c) not in self._flight_ids:
                self._pending -= c.nbytes
                self._queued[c.key] -= 1
                if self._queued[c.key] <= 0:
                    del self._queued[c.key]
                self._pinned.pop(c.key, None)
                self.counters["store_forgotten"] += 1
                out.append(c)
            else:
                kept.append(c)
        self._queue = kept
        self._grant()
        return out

    async def _delete_again(self) -> None:
        while self._redelete:
            ns, keys = self._redelete.popitem()
            while await self.peers.origin().delete_objects(sorted(keys), ns) is None:
                self.counters["store_forward_retries"] += 1         # unreachable: again, until it answers
                await asyncio.sleep(FORWARD_RETRY_S)
            self.counters["store_deleted_again"] += len(keys)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until the backlog is durable at the origin (tests, shutdown); whether it is."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._queue and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return not self._queue

    def stats(self) -> dict:
        return {"backlog_objects": len(self._queue), "backlog_bytes": self._pending,
                "backlog_limit_bytes": self.backlog_bytes, **self.counters,
                **{k: v for k, v in self.arrivals.counters.items() if k.startswith("store_")}}
