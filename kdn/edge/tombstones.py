"""Tombstones: the origin's drops an edge has applied, so that no load in flight puts back
the bytes a drop removed.

The origin logs every key it removes (kdn/origin/drops.py), and the key may then be stored again
with other bytes. A drop reaches an edge (kdn/edge/drops.py's catch-up, the origin's broadcast)
while copies of the key may be on their way in: a pull from an owner or the origin, a hot
promotion, a disk read, an encode kept after the reply, a write-back, a push from the
origin, a repair sent by another edge. So every copy carries its birth: the drop-log
position its bytes are known to be at least as new as. A load's birth is the position this
edge had applied when the load started, because every source it asks is at least there: the
origin answers only drops whose keys are gone (kdn/origin/node.py: drops), and an owner behind
the asker answers nothing (kdn/edge/node.py: peer_get). A push's birth is the origin's position
when it read the bytes; a repair's, that of the load that fetched them.

A drop leaves a tombstone per key: the key's position in the log. A copy whose key's
tombstone is at or past its birth (the drop came after its bytes were read), or whose
birth is below the floor, is stale: never kept, never served, counted (drops_refused_stale).
So a drop wins over every load in flight, and a key's new bytes, stored after its drop and
so born past it, are never shadowed by the old ones.

Positions are local: the log's sequence numbers plus an offset that grows whenever what this
edge replayed stops following the log (another log, a rebuilt store, a lost position), so
they only ever increase; the floor then rises to the new position (anything in flight may be
stale). Bounded: a tombstone goes KEEP_S after its drop once this edge's position has passed
it, and the floor rises past it, so a load slower than that is refused, never trusted.
"""
import collections
import time

from kdn.core.checks import check_int
from kdn.core.errors import BadRequest

KEEP_S = 60.0        # past every load's deadline (the origin's 20 s, a push batch's 30 s)


def check_state(state) -> tuple:
    """(log id, head) of a drop-log state {'log': str, 'head': int >= 0}, or BadRequest."""
    if not isinstance(state, dict) or not isinstance(state.get("log"), str):
        raise BadRequest(f"drops must be {{'log': str, 'head': int >= 0}}, got {state!r:.80}")
    return state["log"], check_int(state.get("head"), "drops head", 0,
                                   note="drops must be {'log': str, 'head': int >= 0}")


class Tombstones:
    """An edge's applied position in the drop log, the drops' tombstones and the floor."""

    def __init__(self, keep_s: float = KEEP_S, clock=time.monotonic):
        self.keep_s, self.clock = float(keep_s), clock
        self.log = None                 # the log positions count in (None: none applied yet)
        self.offset = 0                 # local position = the log's sequence number + offset
        self.position = 0               # every drop before it is applied here
        self.floor = 0                  # a copy born before it is stale
        self.at = {}                    # key -> local position of its latest drop
        self._order = collections.deque()   # (deadline, highest position, keys), drop order
        self.counters = collections.Counter(drops_refused_stale=0)

    def __len__(self) -> int:
        return len(self.at)

    # --- births -----------------------------------------------------------------------------
    def birth(self) -> int:
        """A load's birth: the position applied now (take it before the load starts)."""
        return self.position

    def born_at(self, state):
        """The birth of bytes the origin read at its drop-log state (a push, a repair): None
        without a state (a caller that knows none: trusted as new); below every drop when the
        state is of a log this edge does not follow."""
        if state is None:
            return None
        log, head = check_state(state)
        if self.log is None:              # not caught up yet: the first catch-up decides
            return self.position
        return head + self.offset if log == self.log else -1

    def stale(self, key, born) -> bool:
        """Whether a copy of key born at `born` predates a drop applied here (counted)."""
        if born is None or (born >= self.floor and self.at.get(key, -1) < born):
            return False
        self.counters["drops_refused_stale"] += 1
        return True

    # --- the owners' check ------------------------------------------------------------------
    def state(self):
        """{'log', 'head'} applied here, for the owners a load asks; None before any."""
        return None if self.log is None else {"log": self.log, "head": self.position - self.offset}

    def behind(self, state) -> bool:
        """Whether this edge has applied less of the log than `state` (an asker's) says: its
        copies may then be older than drops the asker applied."""
        if state is None:
            return False
        log, head = check_state(state)
        return self.log != log or self.position - self.offset < head

    # --- drops ------------------------------------------------------------------------------
    def local(self, seq: int) -> int:
        """The local position of the log's sequence number seq."""
        return seq + self.offset

    def drop_position(self, state) -> int:
        """Where a broadcast drop of keys logged before state's head lands: the last of those
        sequence numbers (at or past each key's own); this edge's position when state is of
        a log it does not follow (every copy in flight is then older)."""
        log, head = check_state(state)
        return self.local(head - 1) if log == self.log and head else self.position

    def dropped(self, keys, at) -> None:
        """Tombstones for keys: at is one local position for all, or one per key."""
        keys = list(keys)
        if not keys:
            return
        at = [at] * len(keys) if isinstance(at, int) else list(at)
        for k, p in zip(keys, at):
            if p > self.at.get(k, -1):
                self.at[k] = p
        self._order.append((self.clock() + self.keep_s, max(at), keys))

    def expire(self) -> int:
        """Forget tombstones older than keep_s that this edge's position has passed, raising
        the floor past them; how many keys went."""
        now, n = self.clock(), 0
        while self._order and self._order[0][0] <= now and self._order[0][1] < self.position:
            _, p, keys = self._order.popleft()
            self.floor = max(self.floor, p + 1)
            for k in keys:
                if self.at.get(k, p + 1) <= p:
                    del self.at[k]
                    n += 1
        return n

    # --- where this edge is in the log ------------------------------------------------------
    def start(self, log: str, head: int) -> None:
        """The first position this edge knows (its file, its first catch-up): copies in
        flight came from this origin, whose drops from here on reach it."""
        self.log = log
        self.offset = max(self.offset, self.position - head)
        self.position = head + self.offset

    def advance(self, log: str, head: int) -> None:
        """Every drop before the log's head is applied (their keys are gone from the tiers)."""
        if log != self.log:
            raise ValueError(f"advance in log {log}, positions count in {self.log}")
        self.position = max(self.position, head + self.offset)

    def fence(self) -> None:
        """Every copy in flight now is stale (a reset begins): the position steps on, the
        head it stands for stays, the floor rises to it."""
        self.offset += 1
        self.position += 1
        self.floor = self.position

    def restart(self, log: str, head: int) -> None:
        """Follow log from head on, above every position used so far: the floor rises to it
        and every tombstone falls under it."""
        self.log = log
        self.offset = self.position + 1 - head
        self.position = self.floor = head + self.offset
        self.at.clear()
        self._order.clear()

    def stats(self) -> dict:
        return {**(self.state() or {"log": None, "head": None}), "position": self.position,
                "floor": self.floor, "tombstones": len(self.at)}
