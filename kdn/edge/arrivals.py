"""Arrivals: objects an edge keeps as they arrived, before they are its node's own.

An edge answers some writes before it has copied their bytes into its node's object store:
another cache layer's stores (kdn/edge/stores.py: a view into the caller's argument, or into
the HTTP body they came in) and the origin's pushes (EdgeNode.pull_chunks: views into the
buffer it received them in over HTTP; put_chunks: into the Ray call's argument). Each is a
Held with `arrived` set (Held.arrival); adopting it puts its bytes into this node's store
(ray.put, in a worker thread) and drops the view, so
the memory it came in can go and a Ray reader on this node maps it instead of being sent a
copy. Adoption happens right after the answer (later), before a fetch answers a Ray reader
with one (adopt), and before the write-behind hands one to the origin.

One lock for all of them, so an arrival is put once whoever asks first (a peer asking over
Ray gets a reference, too: EdgeNode.peer_get). `later` runs on the edge's tasks after the
reply (Peers.later: one that fails is counted, as after_reply_errors, and logged; its
arrivals are adopted by the next who asks) and counts the bytes they still hold
(pending_bytes): a push that would pass a bound adopts at once instead
(EdgeNode._adopt_pushes), so arrivals never pile up in this process's memory faster than the
store takes them.

Counters, per kind of arrival (Held.arrived: "store", "pushes"), whoever adopted it:
<kind>_adopted, <kind>_adopt_us (the time the copies took), <kind>_adopt_errors (copies the
object store refused: those stay in this process, as a copy of their own).
"""
import asyncio
import collections
import logging
import time

from kdn.edge.tiers import own_copy

log = logging.getLogger("kdn.edge")


def _put_all(objs) -> list:
    """Each object put into this node's store (from a worker thread): (its reference, None), or
    (None, a copy of its own in this process's memory) where the store refused it (full, or
    out of disk to spill to): that one stays an arrival, sent to the origin by value and
    answered to readers by value, but no longer a view into the body or the call argument it
    came in, which would keep all of that memory for one object (an HTTP body holds up to
    MAX_INGEST_BYTES of objects)."""
    import ray
    import ray.exceptions as rex
    out = []
    for obj in objs:
        try:
            out.append((ray.put(obj), None))
        except (rex.ObjectStoreFullError, rex.OutOfDiskError) as e:
            log.warning("edge: an arrival stays in this process's memory: the object store refused its copy (%s)", e)
            out.append((None, obj if _owns_bytes(obj) else own_copy(obj)))    # (copied once: a retry
    return out                                                                  # finds it its own)


def _owns_bytes(obj) -> bool:
    """Whether a Chunk's or Encoded's bytes are an array of their own, a view of nothing else."""
    arr = obj.kv if hasattr(obj, "kv") else obj.frame
    return arr.flags.owndata


class Arrivals:
    """Adoption of one edge's arrivals (see the module): adopt now, or later."""

    def __init__(self, after_reply):
        """after_reply(coro, what): runs coro after the current reply (Peers.later)."""
        self.counters = collections.Counter()
        self.pending_bytes = 0                 # bytes of arrivals handed to `later`, not adopted yet
        self._lock = asyncio.Lock()
        self._after_reply = after_reply

    async def adopt(self, helds) -> None:
        """Those of helds still arrivals put into this node's store as its own objects, in
        one worker-thread call (a Held another caller adopted first is left as it is)."""
        async with self._lock:
            todo = [h for h in helds if h.arrived]
            if not todo:
                return
            kinds = [h.arrived for h in todo]
            t0 = time.perf_counter()
            refs = await asyncio.to_thread(_put_all, [h.obj for h in todo])
            us = int((time.perf_counter() - t0) * 1e6)
            for h, (ref, copy) in zip(todo, refs):
                if ref is not None:
                    h.adopt(ref)             # on the loop: readers never see it half set
                else:
                    h.obj = copy             # the same bytes, and checksum; the buffer can go
            for kind in set(kinds):
                mine = [r for k, (r, _) in zip(kinds, refs) if k == kind]
                n = sum(r is not None for r in mine)
                self.counters[f"{kind}_adopted"] += n
                self.counters[f"{kind}_adopt_us"] += us * len(mine) // len(todo)
                if n < len(mine):
                    self.counters[f"{kind}_adopt_errors"] += len(mine) - n

    def later(self, helds) -> None:
        """Adopt helds in a task of this loop, after the caller has answered."""
        helds = [h for h in helds if h.arrived]
        if not helds:
            return
        nbytes = sum(h.nbytes for h in helds)
        self.pending_bytes += nbytes

        async def run():
            try:
                await self.adopt(helds)
            finally:
                self.pending_bytes -= nbytes

        self._after_reply(run(), "copying arrivals into the node's store")
