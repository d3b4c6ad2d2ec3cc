"""What an edge holds: two byte-bounded memory tiers of chunks in Ray's object store.

"main" holds the chunks the ring assigns this edge (pushed by the origin at publish, or
refilled on the way through); "hot" holds copies of chunks owned elsewhere that this region
reads often (groupcache's hot cache: a hot copy avoids hammering one owner, and the hot
tier's size is the budget that keeps copies from crowding out main chunks).

A chunk enters a tier once, put into this node's object store, and the tiers hold references
(`Held`): a fetch hands those references out, so a worker on this node maps the KV with no
copy and one elsewhere pulls it straight from this node's store. An object under INLINE_BYTES
(LMCache's or SGLang's small objects, a tail) is kept in the edge's own memory instead, a
copy of its own: a put into the store costs ~0.7 ms an object whatever its size, and Ray
carries an object that small inside the reply anyway (its max_direct_call_object_size is
100 KiB), so it rides in the fetch's answer, a peer's and the origin's hand-over by value. Evicting a reference frees
the object once no reader still holds it. An operator's TTL makes chunks expire (checked on
every read and swept each tick); a pin takes a chunk out of eviction.

Beneath them, when the edge has one, the disk tier (kdn/edge/disk.py): a chunk evicted from
memory is queued and written there by the edge's writer task (drain_write_backs), never on
a reader's time; a disk hit (from_disk) is read in a worker thread, verified and put into
this node's store there (one chunk's buffer at a time), then promoted to memory. The queue is bounded in bytes: past the bound a victim
is not written (counted), so a slow disk never holds memory hostage.

A drop from the origin's log (kdn/edge/drops.py) wins over every copy on its way in: each copy
carries its birth and every way into a tier checks it against the drops' tombstones
(kdn/edge/tombstones.py): put, a disk read's promotion, a write-back (checked and written
under the same lock as a drop's deletion of the files, so a write never lands after it).
"""
import asyncio
import collections
import time

from kdn.edge.cache import ChunkCache
from kdn.edge.tombstones import Tombstones
from kdn.core.errors import PinCapacityError

ROLES = ("main", "hot")
INLINE_BYTES = 64 << 10       # objects smaller than this are kept in the edge's heap (see above)


class Held:
    """A chunk in the object store (a Chunk or an Encoded frame): its reference plus what
    routing needs without fetching it. nbytes is what holding it costs, raw its KV's size;
    own is False for a peer's object (it vanishes with the peer). born: for a copy on its way
    in, the drop-log position its bytes are at least as new as (kdn/edge/tombstones.py; None:
    made here, never older than a drop)."""
    __slots__ = ("ref", "key", "ns", "nbytes", "raw", "codec", "dtype", "own", "obj", "born", "src", "links",
                 "xxh", "carried", "arrived")

    def __init__(self, ref, key: bytes, ns: bytes, nbytes: int, raw: int, codec: str = "raw",
                 dtype: str = "float32", own: bool = True):
        self.ref, self.key, self.ns, self.nbytes, self.raw = ref, key, ns, nbytes, raw
        self.codec, self.dtype, self.own = codec, dtype, own
        self.obj = None        # the object itself, once this process has read it (HTTP)
        self.born = None
        self.src = self.links = None   # a peer's object (over Ray) or copy (over HTTP): the peer;
                                       # links: where a Ray object's transfer is noted
        self.xxh = None        # a raw chunk's KV checksum, computed when it was verified here
        self.carried = False   # a peer's object carried in its Ray answer (from_wire): unverified
        self.arrived = False   # obj is a view into memory not this node's own: its kind (Held.arrival)

    @classmethod
    def of(cls, obj) -> "Held":
        """Put a Chunk or an Encoded into this node's object store. ray.put copies the bytes:
        call it from a worker thread (asyncio.to_thread), never on the event loop.

        A chunk verified before the put (its checksum known: kdn/edge/forms.py) keeps that
        checksum here, so the sealed copy is not hashed again to be framed or checked
        (_with_sum). Every reader of a frame still verifies it, so a copy gone bad in this
        store reaches nobody: a peer or client finds the mismatch and fetches elsewhere."""
        import ray
        held = cls(ray.put(obj), obj.key, obj.ns, obj.nbytes, obj.raw, obj.codec, obj.dtype)
        held.xxh = getattr(obj, "_xxh", None)
        return held

    @classmethod
    def kept(cls, obj) -> "Held":
        """obj kept by this node: Held.of inside Ray, Held.here outside it (an edge in a unit
        test) and for an object under INLINE_BYTES (a read-only copy of its own: obj may be a
        view into a larger buffer it must not pin). From a worker thread, like Held.of."""
        if not _ray_initialized():
            return cls.here(obj)
        return cls.here(own_copy(obj)) if obj.nbytes < INLINE_BYTES else cls.of(obj)

    @classmethod
    def arrival(cls, obj, kind: str = "store") -> "Held":
        """obj as it arrived, held with no copy: a read-only view into a Ray call's argument
        in this node's store (Ray keeps that memory while a process maps it, even once the
        caller has freed it or exited: tests/edge/test_arrivals.py), or into the buffer an
        HTTP body or answer was received into, so a write is acknowledged without a copy
        into fresh memory on the writer's time; it is put into an object of this node's own
        later (kdn/edge/arrivals.py). `arrived` says its kind ("store": a cache layer's
        store; "pushes": the origin's push), which its adoption is counted under. Inside Ray,
        and from INLINE_BYTES up (a smaller one is copied: Held.kept); elsewhere the same
        as Held.kept."""
        if not _ray_initialized() or obj.nbytes < INLINE_BYTES:
            return cls.kept(obj)
        held = cls.here(obj)
        held.xxh, held.arrived = getattr(obj, "_xxh", None), kind
        return held

    def adopt(self, ref) -> None:
        """An arrival become this node's own object: ref, the reference of its copy (ray.put
        of obj, made in a worker thread); the view into the caller's memory is dropped. On the
        event loop, so no reader sees the fields half set."""
        self.ref, self.obj, self.arrived = ref, None, False

    @classmethod
    def here(cls, obj) -> "Held":
        """obj held by this process, with no reference: an edge outside Ray (unit tests), or
        a copy received from a peer over HTTP (kdn/edge/dataplane.py), put into the node's
        store only if it is kept."""
        held = cls(None, obj.key, obj.ns, obj.nbytes, obj.raw, obj.codec, obj.dtype)
        held.obj = obj
        return held

    async def resolve(self):
        """The object itself, read once (a zero-copy view) and kept, so the checksum computed
        by its first check serves every later one. A peer's object too: its Held lives for
        one load (shared by every reader that joined it, and the copy kept of it)."""
        if self.obj is None:
            t0 = time.perf_counter()
            self.obj = _with_sum(await self.ref, self.xxh)
            if self.links is not None:         # a peer's bytes crossed the link: measured
                self.links.transfer(self.src, self.nbytes, time.perf_counter() - t0)
        return self.obj

    def wire(self) -> tuple:
        """What crosses to another edge (peer_get): the reference and its description (the
        object itself where this process holds it with no reference: INLINE_BYTES)."""
        return (self.ref if self.ref is not None else self.obj, self.key, self.ns, self.nbytes, self.raw,
                self.codec, self.dtype)

    @classmethod
    def from_wire(cls, w, src: str = None, links=None) -> "Held":
        """A peer's object as peer_get described it; src: the peer, links: where the time its
        bytes take to arrive is noted (kdn/placement/links.py). An object carried in the answer (under
        INLINE_BYTES) has no reference: kept, it is verified and copied like any peer's object."""
        held = cls(*w, own=False)
        held.src, held.links = src, links
        if _is_object(w[0]):
            held.ref, held.obj, held.carried = None, w[0], True
        return held


async def resolve_all(helds) -> list:
    """Each Held's object (Held.resolve), this node's own objects read with one ray.get in a
    worker thread: awaiting each reference on the event loop costs ~1 ms apiece, longer than
    framing a 2 MiB chunk. A peer's objects are awaited one by one (each one's arrival is
    timed for the link it crossed)."""
    batch = [h for h in helds if h.obj is None and h.ref is not None and h.links is None]
    if len(batch) > 1:
        import ray
        for h, obj in zip(batch, await asyncio.to_thread(ray.get, [h.ref for h in batch])):
            h.obj = _with_sum(obj, h.xxh)
    return list(await asyncio.gather(*(h.resolve() for h in helds)))


def _is_object(x) -> bool:
    """Whether x is a chunk itself (carried in an answer), not a reference to one."""
    from kdn.core.chunk import Chunk, Encoded
    return isinstance(x, (Chunk, Encoded))


def own_copy(obj):
    """A Chunk or Encoded with read-only bytes of its own (its checksum, if known, carried)."""
    from kdn.core.chunk import Chunk, Encoded
    if isinstance(obj, Encoded):
        frame = obj.frame.copy()
        frame.flags.writeable = False
        return Encoded(obj.key, obj.ns, obj.codec, obj.dtype, obj.raw, obj.exact, frame)
    kv = obj.kv.copy()
    kv.flags.writeable = False
    out = Chunk(obj.key, obj.ns, kv, obj.dtype)
    if obj._xxh is not None:
        object.__setattr__(out, "_xxh", obj._xxh)
    return out


def _with_sum(obj, xxh):
    """obj (read from this node's store) with the checksum its chunk had when put (Held.of):
    only on a sealed, read-only chunk, which nothing in this process can change."""
    if xxh is not None and getattr(obj, "_xxh", 0) is None and not obj.kv.flags.writeable:
        object.__setattr__(obj, "_xxh", xxh)
    return obj


WRITE_BACK_QUEUE_BYTES = 1 << 30      # victims waiting for the disk, at most


class Tiers:
    """main and hot ChunkCaches of Held, with TTL expiry and pins; a DiskTier beneath them."""

    def __init__(self, capacity_bytes: int, policy: str = "s3fifo", hot_fraction: float = 0.25,
                 disk=None, write_back_queue_bytes: int = WRITE_BACK_QUEUE_BYTES):
        self.capacity = int(capacity_bytes)
        hot_bytes = max(1, int(self.capacity * hot_fraction))
        self.main = ChunkCache(self.capacity - hot_bytes, policy, on_evict=self._evicted)
        self.hot = ChunkCache(hot_bytes, "lru", on_evict=self._evicted)   # copies: recency is all that matters
        self.disk = disk           # kdn/edge/disk.py DiskTier, or None
        self.expiry = {}           # key -> monotonic deadline (a KB's TTL, set by an operator)
        self.pending = collections.OrderedDict()   # key -> (Held, verify first, born): to the disk
        self.pending_bytes = 0
        self.write_back_queue_bytes = int(write_back_queue_bytes)
        self.counters = collections.Counter()
        self.observer = None       # note(key) when what holds key may have changed (kdn/edge/events.py)
        self.tombs = Tombstones()  # the origin's drops, against copies on their way in
        self._disk_turn = asyncio.Lock()   # a write-back's check and write; a drop's deletes

    def note(self, key) -> None:
        """Tell the observer (the edge's KV-event publisher, when it has one) key changed."""
        if self.observer is not None:
            self.observer(key)

    def tier(self, role: str) -> ChunkCache:
        return self.hot if role == "hot" else self.main

    # --- reads ------------------------------------------------------------------------------
    def get(self, key, ns: bytes = None):
        """The Held for key (main first, then hot), counting the hit; None when absent, expired
        or (given ns) held under another namespace: that is a miss for this reader, and it
        counts and touches nothing that would tell the reader the key exists."""
        if self._expired(key):
            return None
        accept = None if ns is None else (lambda h: h.ns == ns)
        for role in ROLES:
            held = self.tier(role).get(key, accept)
            if held is not None:
                self.counters[role + "_hits"] += 1
                return held
        queued = self.pending.get(key)          # a victim on its way to the disk: still ours
        if queued is not None and queued[0].own and (accept is None or accept(queued[0])):
            self.counters["write_back_queue_hits"] += 1
            return queued[0]
        return None

    def held(self) -> list:
        """Every key held in memory (main, hot) or on disk, listed once each."""
        disk = [] if self.disk is None else self.disk.index.keys()
        return list(dict.fromkeys(self.main.keys() + self.hot.keys() + disk))

    def peek(self, key):
        """The Held for key in either tier, without counting or changing recency."""
        return self.main.peek(key) or self.hot.peek(key)

    def holds(self, key, ns: bytes = None) -> bool:
        """Whether key is held, in memory or on disk (given ns: held under that namespace)."""
        held = self.peek(key)
        if held is not None:
            return ns is None or held.ns == ns
        return self.on_disk(key, ns) is not None

    def on_disk(self, key, ns: bytes = None):
        """The disk Record for key (given ns: under that namespace) unless expired; no I/O."""
        if self.disk is None or self._expired(key):
            return None
        return self.disk.record(key, ns)

    async def from_disk(self, keys, ns: bytes, roles) -> list:
        """Held per key read from the disk tier (None where absent or found bad), each put
        into this node's store and promoted to memory tier roles[i]."""
        if self.disk is None or not keys:
            return [None] * len(keys)
        born = self.tombs.birth()   # a drop while the files are read: they are not used
        def load():         # each chunk read, verified and put in the store, then let go
            return [None if obj is None else Held.kept(obj)
                    for obj in (self.disk.read(k, ns) for k in keys)]
        out = await asyncio.to_thread(load)
        for i, (key, held, role) in enumerate(zip(keys, out, roles)):
            if held is not None and self.tombs.stale(key, born):
                out[i] = None
            elif held is not None:
                self.counters["disk_hits"] += 1
                self.counters["disk_promoted"] += self.tier(role).put(key, held)
                self.note(key)
        return out

    def values(self) -> list:
        return self.main.values() + self.hot.values()

    def __len__(self) -> int:
        return len(self.main) + len(self.hot)

    # --- writes -----------------------------------------------------------------------------
    def put(self, role: str, key, held, pin: bool = False) -> bool:
        """Keep held in tier `role`; a pin that does not fit is kept unpinned rather than not
        at all (and counted). A copy older than a drop of its key is not kept (False)."""
        tier = self.tier(role)
        if held is not tier.peek(key) and self.tombs.stale(key, held.born):
            return False
        try:
            if pin:
                try:
                    return tier.put(key, held, pin=True)
                except PinCapacityError:
                    self.counters["pin_refused"] += 1
            return tier.put(key, held)
        finally:
            self.note(key)

    def pin(self, keys) -> int:
        """Pin the chunks of keys this edge holds (a hot copy moves to main); how many."""
        n = 0
        for k in keys:
            held = self.peek(k)
            if held is None:
                continue
            try:
                if k in self.main:
                    self.main.pin(k)
                else:
                    self.main.put(k, held, pin=True)
                    self.hot.discard(k)
                n += 1
            except PinCapacityError:
                self.counters["pin_refused"] += 1
        return n

    async def drop(self, keys, at=None) -> int:
        """Remove keys from every tier, the disk too: its files are deleted in one worker-thread
        call (file I/O never runs on the event loop), then memory lets go of them, so a reader
        meanwhile finds them in memory, never a disk record about to vanish. How many were held.
        at: the drop's position in the origin's log (one for all keys, or one per key): its
        tombstones are set first, so no copy on its way in outlives the drop."""
        keys = list(keys)
        if at is not None:
            self.tombs.dropped(keys, at)
        for k in keys:
            self._unqueue(k)                  # a victim on its way to the disk: not written now
        on_disk = [False] * len(keys)
        if self.disk is not None:
            async with self._disk_turn:       # after a write-back in progress, never before it
                if any(k in self.disk for k in keys):
                    on_disk = await asyncio.to_thread(lambda: [self.disk.discard(k) for k in keys])
        n = 0
        for k, disk in zip(keys, on_disk):
            n += self.main.discard(k) | self.hot.discard(k) | disk
            self._unqueue(k)                  # evicted to the queue while the files went
            self.expiry.pop(k, None)
            self.note(k)
        return n

    # --- write-back to the disk tier ----------------------------------------------------------
    def _evicted(self, key, held) -> None:
        """A memory tier's victim: queue it for the disk (ChunkCache's on_evict)."""
        self.note(key)
        if self.disk is not None and held.own and not self._expired(key):
            self.write_back(held, born=self.tombs.birth())    # held until now: as new as that

    def write_back(self, held, verify: bool = False, born=None) -> bool:
        """Queue held to be written to the disk tier (verify: check it first, a copy that
        came from a peer; born: its birth, kdn/edge/tombstones.py); False when it is not queued
        (held already, the queue is full, or a drop overtook it)."""
        if self.disk is None or held.key in self.pending or held.key in self.disk:
            return False
        if self.tombs.stale(held.key, born):
            return False
        if self.pending_bytes + held.nbytes > self.write_back_queue_bytes:
            self.counters["disk_write_back_dropped_busy"] += 1
            return False
        self.pending[held.key] = (held, verify, born)
        self.pending_bytes += held.nbytes
        self.counters["disk_write_back_queued"] += 1
        return True

    def _unqueue(self, key):
        item = self.pending.pop(key, None)
        if item is not None:
            self.pending_bytes -= item[0].nbytes
        return item

    async def drain_write_backs(self, intact) -> int:
        """Write every queued victim to the disk tier (in a worker thread); how many written.
        intact(obj) -> bool checks a copy queued with verify. A full device drops the write
        (the disk tier counts it); another disk error is counted here and raised. A copy a
        drop overtook is not written: checked and written in the drop's lock on the files."""
        n = 0
        while self.pending:
            key = next(iter(self.pending))
            held, verify, born = self._unqueue(key)
            obj = await held.resolve()
            if verify and not await asyncio.to_thread(intact, obj):
                self.counters["disk_write_back_refused"] += 1
                continue
            async with self._disk_turn:
                if self.tombs.stale(key, born):
                    continue
                try:
                    n += await asyncio.to_thread(self.disk.write, obj)
                except OSError:
                    self.counters["disk_write_back_errors"] += 1
                    raise
        return n

    # --- TTL --------------------------------------------------------------------------------
    def set_ttl(self, keys, ttl_s: float) -> int:
        """Chunks of keys held now expire ttl_s seconds from now; how many are held."""
        deadline = time.monotonic() + float(ttl_s)
        n = 0
        for k in keys:
            if self.holds(k):
                self.expiry[k] = deadline
                n += 1
        return n

    def expire_later(self, key, ttl_s: float) -> None:
        self.expiry[key] = time.monotonic() + float(ttl_s)

    def _expired(self, key) -> bool:
        deadline = self.expiry.get(key)
        return deadline is not None and deadline <= time.monotonic()

    async def sweep(self) -> int:
        """Drop every chunk whose TTL has passed (their files in one worker-thread call); how
        many. Tombstones past their time go too (kdn/edge/tombstones.py)."""
        now = time.monotonic()
        gone = [k for k, t in self.expiry.items() if t <= now]
        if gone:
            await self.drop(gone)
        self.tombs.expire()
        self.counters["ttl_expired"] += len(gone)
        return len(gone)

    def stats(self) -> dict:
        disk = None if self.disk is None else dict(
            self.disk.stats(), hits=self.counters["disk_hits"],
            write_back_queued=len(self.pending), write_back_queued_bytes=self.pending_bytes)
        return {"main": self.main.stats(), "hot": self.hot.stats(), "disk": disk,
                "held_raw_bytes": sum(h.raw for h in self.values()), "hot_copies": len(self.hot),
                "expiring": len(self.expiry), "drops": self.tombs.stats(),
                "counters": dict(self.counters)}


def _ray_initialized() -> bool:
    import ray
    return ray.is_initialized()
