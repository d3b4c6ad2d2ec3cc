"""The form a chunk takes at an edge: verified on the way in, kept in the store form, sent in
the form that reaches its reader soonest. One place for the Ray path and HTTP alike.

Verification: every copy that enters a tier is checked against the checksum its manifest
records (kdn.core.chunk's verify: exact KV must hash to it; a lossy frame has only its own frame
checksums, because its KV is not the published KV by design). A copy that fails is never
kept, and never encoded lossy for a reader (a reader cannot check lossy KV against its
manifest, so it must never be encoded from wrong bytes).
The checksum found then goes with the copy into the node's store
(kdn.edge.tiers.Held.of): framing the sealed copy later, for a peer or a client, costs no
second pass over it, and every reader verifies each frame it receives.

Store form: with store_codec set, an edge keeps chunks as compressed frames (kdn.core.chunk.Encoded):
its byte capacity is charged the compressed size, so it holds more (zstd: lossless, ~1.2x on
fp32 KV; q8z/k4v3z: lossy, 3.9x/8.7x, an operator's choice; docs/figures.md). Lossy KV stays as it is:
expanding it restores nothing, and it must stay marked lossy.

Link form (kdn.core.transfer.choose_codec): on the reader's own node the stored form as it is (raw
stays zero-copy; a compressed form is decoded by the reader, which costs no more than
decoding it here); across a link the form that arrives soonest, counting encode and decode
time against the bytes saved at the topology's bandwidth. Lossy codecs go only to readers
that accept them (or when the edge already stores lossy KV).
"""
import asyncio
import collections

import numpy as np
import xxhash

from kdn.core.chunk import Chunk, Encoded, encode_parts
from kdn.core.codecs import LOSSLESS, LOSSY
from kdn.edge.peers import PEER_READ_S
from kdn.edge.tiers import Held
from kdn.core.errors import BadRequest, FrameError, TopologyError
from kdn.core.rpc import failover_errors
from kdn.core.transfer import PROFILE, check_store_codec, choose_codec



def link_codec(item, bandwidth_gbps, accept: tuple) -> str:
    """The form of one chunk (anything with codec, raw, dtype) that reaches a reader soonest
    over a link of bandwidth_gbps (None: the reader is beside this edge)."""
    if bandwidth_gbps is None or item.codec in LOSSY:
        # beside the edge: raw stays zero-copy and a compressed form is decoded by the reader;
        # lossy KV goes as it is (expanding it restores nothing, and it must stay marked lossy)
        return item.codec
    allowed = tuple(accept) + ((item.codec,) if item.codec != "raw" else ())
    try:
        return choose_codec(item.raw, bandwidth_gbps, same_node=False, dtype=item.dtype,
                            allowed=allowed, stored=item.codec)
    except BadRequest:       # a codec with no speed profile: as stored
        return item.codec


class Forms:
    """Verification and re-encoding for one edge: sums(key) is the manifest checksum of a
    key (None when no manifest names it); store_codec how this edge keeps chunks."""

    def __init__(self, store_codec: str, sums, topology, region: str):
        self.store_codec = check_store_codec(store_codec, "edge")
        self.sums = sums
        self.topology, self.region = topology, region   # topology: a callable (it changes)
        self.counters = collections.Counter()

    # --- verification -----------------------------------------------------------------------
    def intact(self, obj, reread: bool = False) -> bool:
        """Whether obj's bytes are the ones named (see the module docstring); counts failures.
        reread: hash the bytes now, not trusting a checksum found earlier (a reader reported
        them corrupt). CPU work (a hash, or a decode): from a worker thread."""
        if isinstance(obj, Chunk):
            if reread:
                obj = Chunk(obj.key, obj.ns, obj.kv, obj.dtype)    # a view: no checksum known
            _hash_once(obj)          # an immutable chunk is hashed once, whoever checks it next
        try:
            obj.verify(self.sums(obj.key))
            return True
        except FrameError:
            self.counters["corrupt_detected"] += 1
            return False

    def chunk_of(self, obj):
        """obj decoded (a Chunk) when intact, else None: one decode serves both the check and
        whatever is made of the KV next."""
        if isinstance(obj, Chunk):
            _hash_once(obj)
        try:
            chunk = obj.decode()
            if obj.exact:
                chunk.verify(self.sums(obj.key))
            return chunk
        except FrameError:
            self.counters["corrupt_detected"] += 1
            return None

    # --- store form -------------------------------------------------------------------------
    def store_form(self, obj):
        """obj verified and in the form this edge keeps; None if it fails. CPU work: from a
        worker thread (to_store)."""
        if obj.codec == self.store_codec or not obj.exact:
            return obj if self.intact(obj) else None     # kept as it is
        chunk = self.chunk_of(obj)
        if chunk is None or self.store_codec == "raw" or (chunk.opaque and self.store_codec in LOSSY):
            return chunk                 # opaque bytes are never kept lossy
        self.counters["stored_encoded"] += 1
        return Encoded.of(chunk, self.store_codec)

    async def to_store(self, objs, arrival: str = None) -> list:
        """A Held per obj, verified, in the store form and put into this node's store (None
        where it fails): hashing, coding and ray.put's copy in one worker-thread call.
        arrival: the kind of arrivals objs are (a Ray call's arguments, or views into a
        received buffer), kept as they arrived where their form is kept (no copy:
        Held.arrival; the caller adopts them later, kdn/edge/arrivals.py)."""
        def kept():
            out = []
            for o, form in zip(objs, map(self.store_form, objs)):
                if form is None:
                    out.append(None)
                elif arrival and form is o:
                    out.append(Held.arrival(form, arrival))
                else:
                    out.append(Held.kept(form))
            return out
        return await asyncio.to_thread(kept) if objs else []

    # --- link form (Ray path) -------------------------------------------------------------
    def bandwidth(self, region: str, same_node: bool):
        """The link's bandwidth from this edge to a reader in region (None: beside it)."""
        if same_node or region is None:
            return None
        try:
            return self.topology().bandwidth_gbps(self.region, region)
        except TopologyError:    # a region the topology does not know: send as stored
            return None

    async def link_forms(self, helds, region: str, same_node: bool, accept: tuple,
                         budget_s: float = None) -> tuple:
        """(helds, n): helds re-encoded where the link to the reader wants another form than
        stored, and n, how many may be sent — a copy found corrupt while re-encoding ends the
        prefix there (the caller drops it).

        A peer's object is left as the peer sent it: the peer chose its form for the link from
        its region to this one (peer_get), which is the reader's, and re-encoding it here
        would first pull it over that link. budget_s bounds the estimated encode time (a peer
        answering within a timeout); chunks past it go as stored.
        """
        bw = self.bandwidth(region, same_node)
        want = [link_codec(h, bw, accept) if h.own else h.codec for h in helds]
        todo = self._within(helds, want, [i for i, (h, c) in enumerate(zip(helds, want))
                                          if c != h.codec], budget_s)
        if not todo:
            return helds, len(helds)
        try:
            objs = await asyncio.wait_for(asyncio.gather(*(helds[i].resolve() for i in todo)), PEER_READ_S)
        except failover_errors():     # a peer's object lost or slow: send the forms we have
            return helds, len(helds)
        made, bad = await asyncio.to_thread(self._transcode, objs, [want[i] for i in todo])
        out = list(helds)
        for i, held in zip(todo, made):
            out[i] = held
        self.counters["transcoded"] += len(made)
        return out, len(out) if bad is None else todo[bad]

    @staticmethod
    def _within(helds, want, todo, budget_s) -> list:
        if budget_s is None:
            return todo
        spent, fits = 0.0, []
        for i in todo:
            spent += helds[i].raw / (PROFILE.get(want[i], PROFILE["zstd"])["encode_gbps"] * 1e9)
            if spent <= budget_s:
                fits.append(i)
        return fits

    def _transcode(self, objs, codecs) -> tuple:
        """([a Held of each obj in its codec, put into this node's store], index of the first
        corrupt one or None). From a worker thread."""
        out = []
        for obj, codec in zip(objs, codecs):
            chunk = self.chunk_of(obj)
            if chunk is None:
                return out, len(out)
            out.append(Held.kept(chunk if codec == "raw" else Encoded.of(chunk, codec)))
        return out, None

    # --- link form (HTTP) -------------------------------------------------------------------
    def frame_codecs(self, objs, region: str, asked: str) -> list:
        """The codec each frame of an HTTP answer goes in: `asked`, or with "auto" what pays on
        the link to region (no region: beside the edge, as stored); lossy KV always as stored."""
        if asked == "auto":
            bw = self.bandwidth(region, same_node=False)
            return [link_codec(o, bw, LOSSLESS) for o in objs]
        return [o.codec if not o.exact else asked for o in objs]

    def frames(self, objs, codecs) -> tuple:
        """([prefix, payload] per frame, index of the first corrupt object or None). CPU work
        (hashing, coding) unless nothing_to_compute(): from a thread then."""
        out = []
        for obj, codec in zip(objs, codecs):
            parts = self._frame(obj, codec)
            if parts is None:
                return out, len(out)
            out.append(parts)
        return out, None

    def nothing_to_compute(self, objs, codecs) -> bool:
        """Whether framing objs costs no hashing or coding: every frame raw from a raw chunk
        whose checksum is already known (frames() may then run on the event loop)."""
        return all(c == "raw" and o.codec == "raw" and o._xxh is not None for o, c in zip(objs, codecs))

    def _frame(self, obj, codec):
        if obj.codec == codec and codec != "raw":
            if not self.intact(obj):                  # a corrupt stored frame never leaves
                return None
            return [b"", memoryview(obj.frame).cast("B")]
        if obj.codec == "raw" and codec == "raw":
            _hash_once(obj)
            return encode_parts(obj) if self.intact(obj) else None
        chunk = self.chunk_of(obj)
        return None if chunk is None else encode_parts(chunk, codec)


def _hash_once(chunk: Chunk) -> None:
    """Remember the xxh3 of an immutable chunk's KV (a view of the object store): verifying it
    and framing it then cost no hashing on the next fetch."""
    if chunk._xxh is None and not chunk.kv.flags.writeable:
        object.__setattr__(chunk, "_xxh", xxhash.xxh3_64_intdigest(memoryview(chunk.kv).cast("B")))


def corrupted(obj):
    """A copy of obj with one payload byte flipped (fault injection, tests only)."""
    if isinstance(obj, Encoded):
        frame = np.array(obj.frame, copy=True)
        frame[-max(1, (frame.nbytes - 4096) // 2)] ^= 0xFF       # inside the payload
        return Encoded(obj.key, obj.ns, obj.codec, obj.dtype, obj.raw, obj.exact, frame)
    kv = np.array(obj.kv, copy=True)
    kv.reshape(-1).view(np.uint8)[kv.nbytes // 2] ^= 0xFF
    return Chunk(obj.key, obj.ns, kv, obj.dtype)
