"""The origin's drop log: every key the store stopped holding, in order, so that an edge
which missed a drop (down, restarting, too slow for the broadcast) replays it before its
copy can stand beside other bytes put later under the same key.

A key means one byte string (kdn/origin/store.py). A host layer's delete (LMCache's eviction,
`delete_objects`) or a collect removes a key from the store; a later put of that key may
carry other bytes (another machine computed them). An edge still holding the old copy
would then serve a second byte string for one key. So every removal is appended here first,
durably, and only then done: each append is one object `drops/<start:016d>-<end:016d>`
holding the keys that took sequence numbers start .. end-1 (msgpack), beside `drops/log-id`,
a random id made when the log is first written. `head` is the number of keys ever logged.
Edges keep the (id, head) they have replayed up to (on their disk tier, so a restart keeps
it), and the origin's pings carry its own (kdn/edge/node.py: catch_up). An edge whose number is
behind fetches `since(n)` and drops those keys; one whose id differs (another store), whose
number is ahead (a store rebuilt), or which is behind what the log still keeps, drops every
copy it holds: a cache emptied is refilled from the origin, a stale copy would be served.

The log keeps about MAX_KEPT keys (whole appends, the newest always), so it never grows
without bound.

What the origin tells edges is the settled head (`settled`): read under the store's lock,
under which the store logs keys and deletes them, so every key logged before it is gone. An
edge at that head therefore reads, from the origin or from an owner at least as far, only
bytes no drop before it removed; and a push carries the settled head read before its
bytes, so an edge that applied a later drop of a key refuses the old bytes
(kdn/edge/tombstones.py).
"""
import os
import re
import threading

import msgpack

from kdn.core.errors import StoreError

PREFIX = "drops/"
ID = PREFIX + "log-id"
MAX_KEPT = 1 << 20              # keys kept for edges to replay (16 MiB of 16-byte keys)
_SEGMENT = re.compile(r"drops/(\d{16})-(\d{16})")


class DropLog:
    """An append-only, bounded log of removed keys in an kdn/origin/objects.py backend."""

    def __init__(self, objects, max_kept: int = MAX_KEPT):
        self.objects, self.max_kept = objects, max_kept
        self._lock = threading.Lock()
        self.segments = []                      # [(start, end)], oldest first
        for name, _ in objects.list(PREFIX):
            m = _SEGMENT.fullmatch(name)
            if m:
                self.segments.append((int(m.group(1)), int(m.group(2))))
        self.segments.sort()
        self.id = self._id()

    def _id(self) -> str:
        if self.objects.size(ID) is not None:
            return self.objects.get(ID).decode()
        made = os.urandom(8).hex()
        if not self.objects.put_new(ID, made.encode()):   # another origin process made one first
            return self.objects.get(ID).decode()
        return made

    @property
    def head(self) -> int:
        """How many keys were ever logged: the sequence number of the next one."""
        return self.segments[-1][1] if self.segments else 0

    @property
    def oldest(self) -> int:
        """The first sequence number still kept."""
        return self.segments[0][0] if self.segments else 0

    def state(self) -> dict:
        return {"log": self.id, "head": self.head}

    def append(self, keys) -> int:
        """Log keys durably (StoreError, nothing logged, if the write fails); the new head.
        The caller removes them only after this returns."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return self.head
        with self._lock:
            start = self.head
            end = start + len(keys)
            self.objects.put(_name(start, end), [msgpack.packb(keys)])
            self.segments.append((start, end))
            while len(self.segments) > 1 and end - self.segments[1][0] >= self.max_kept:
                old = self.segments.pop(0)
                self.objects.delete(_name(*old))
            return end

    def since(self, seq: int, upto: int = None) -> tuple:
        """(keys, head): the keys logged from sequence number seq up to head (upto, when
        given and lower: a settled head), oldest first; keys is None when the log no longer
        keeps them all, or never had seq (the caller starts over). StoreError when a segment
        cannot be read."""
        with self._lock:
            segments = list(self.segments)
        head = segments[-1][1] if segments else 0
        if upto is not None and upto < head:
            segments = [(a, b) for a, b in segments if a < upto]
            head = upto
        if seq == head:
            return [], head
        if seq > head or (segments and seq < segments[0][0]):
            return None, head
        out = []
        for start, end in segments:
            if end <= seq:
                continue
            name = _name(start, end)
            if self.objects.size(name) is None:     # trimmed meanwhile
                return None, head
            try:
                keys = msgpack.unpackb(self.objects.get(name))
            except (ValueError, msgpack.UnpackException) as e:
                raise StoreError(f"drop log segment {self.objects.where(name)} is unreadable: {e}") from None
            if not isinstance(keys, list) or len(keys) != end - start:
                raise StoreError(f"drop log segment {self.objects.where(name)} holds "
                                 f"{len(keys) if isinstance(keys, list) else type(keys).__name__} "
                                 f"keys, its name says {end - start}")
            out.extend(keys[max(0, seq - start):max(0, head - start)])
        return out, head


def settled(store) -> dict:
    """The drop log's state {"log", "head"} with no removal half done: kdn/origin/store.py logs
    keys and deletes them under its lock (collect, delete_objects), taken here, so every key
    logged before head is gone from the store (and bytes read after this are at least that
    new)."""
    with store._lock:
        return store.drops.state()


def _name(start: int, end: int) -> str:
    return f"{PREFIX}{start:016d}-{end:016d}"
