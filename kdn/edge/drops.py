"""How far an edge has replayed the origin's drop log (kdn/origin/drops.py), and the replay.

The origin logs every key it stops holding (a host's delete, a collect) and broadcasts the
drop; an edge that was down, restarting or too slow misses the broadcast, and a copy it
kept would stand beside other bytes stored later under the same key. So an edge keeps
(log id, head) of what it has replayed, in a small file on its disk tier (a restarted edge
keeps its disk, so it must remember; a memory-only edge restarts empty and keeps it in memory),
and `Replay.catch_up` brings it level with the origin: it is run when the edge starts and
whenever a ping from the origin carries another head:
- at the origin's head already: nothing;
- behind it: the keys logged since are dropped from every tier, and a store of them this
  edge acknowledged and has not yet made durable is not sent (kdn/edge/stores.py: a delete
  wins, as when its broadcast arrives);
- no position (a new edge, a lost or unreadable file): the copies its disk kept from before
  this process started are dropped (it cannot tell which are stale), then it starts at the
  head; copies received since came from this origin, whose drops reach a live edge;
- a position that does not follow (another log id: another store; a head ahead of the
  origin's: a store rebuilt; a number the log no longer keeps): every copy it holds is
  dropped. A cache emptied refills from the origin; a stale copy would be served. Stores
  acknowledged here and not yet durable still go to the origin: they are writes made since,
  not stale copies, and a reset cannot tell which keys were deleted.
An origin that does not answer changes nothing: the edge serves what it holds (an origin
outage is what edges outlast) and catches up at the next ping.

Each key dropped leaves a tombstone at its position in the log (kdn/edge/tombstones.py), set
before the first copy goes and the edge's position moved past it only once every copy is
gone, so a load in flight meanwhile (a pull, a disk read, a push) never puts the old bytes
back. A drop of every copy (a reset) first fences off everything in flight.
"""
import asyncio
import json
import logging
import os

from kdn.core.errors import BadRequest
from kdn.core.files import write_atomic
from kdn.edge.tombstones import check_state

log = logging.getLogger(__name__)

POSITION_FILE = "drops-replayed.json"
DROPS_TIMEOUT_S = 10.0


class Replay:
    """An edge's replay of the drop log: its position, where it keeps it, the catch-up."""

    def __init__(self, tiers, peers, directory=None, forget=None):
        self.tiers, self.peers = tiers, peers
        self.forget = forget or (lambda keys: None)   # keys -> a store of them not yet durable is not sent
        self.path = None if directory is None else os.path.join(directory, POSITION_FILE)
        self.seen = self._load()               # (log id, head) replayed, or None
        if self.seen is not None:
            tiers.tombs.start(*self.seen)
        self.from_before = set(self.tiers.held())   # copies its disk kept from an earlier life
        self._lock = asyncio.Lock()
        self._task = None                      # the catch-up running now, if any
        self.counters = {"drops_replayed": 0, "drops_resets": 0, "drops_catch_ups": 0,
                         "drops_failures": 0}

    def _load(self):
        if self.path is None:
            return None
        try:
            with open(self.path) as f:
                return check_state(json.load(f))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, BadRequest) as e:    # unreadable: start over, safely
            log.warning("edge drop-log position %s is unreadable (%s): replaying from scratch",
                        self.path, e)
            return None

    def _save(self) -> None:
        if self.path is not None:
            write_atomic(self.path, json.dumps({"log": self.seen[0], "head": self.seen[1]}).encode())

    def behind(self, state) -> bool:
        """Whether a ping's drop-log state is not what this edge has replayed."""
        return self.seen != check_state(state)

    def start(self) -> None:
        """Catch up in the background unless a catch-up is running (its failure is logged and
        counted as drops_failures; the next ping that finds this edge behind starts another)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.catch_up())
            self._task.add_done_callback(self._ended)

    def _ended(self, task) -> None:
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.counters["drops_failures"] += 1
            log.error("edge: catching up with the origin's drop log failed: %s: %s",
                      type(e).__name__, e, exc_info=e)

    async def catch_up(self) -> bool:
        """Level with the origin's drop log (see the module); False when the origin did not
        answer. One at a time: a second caller waits for the first, then finds it level."""
        async with self._lock:
            since = None if self.seen is None else self.seen[1]
            r = await self.peers.origin(DROPS_TIMEOUT_S).drops(since)
            if r is None:
                return False
            self.counters["drops_catch_ups"] += 1
            tombs = self.tiers.tombs
            if self.seen is None:
                # no position: only what the disk brought from before this process can be
                # stale; what came since came from this origin, whose drops reach a live edge
                keys = [k for k in self.tiers.held() if k in self.from_before]
                follows = not keys
                if follows:
                    tombs.start(r["log"], r["head"])
            else:
                follows = self.seen[0] == r["log"] and r["keys"] is not None
                keys = r["keys"] if follows else self.tiers.held()
            if not follows:
                self._reset(r, keys)
                tombs.fence()                  # whatever is in flight may be stale too
                self.counters["drops_replayed"] += await self.tiers.drop(keys, at=tombs.position)
                tombs.restart(r["log"], r["head"])
            else:
                if keys:
                    self.forget(keys)              # a delete wins over a store not yet durable, as broadcast
                    at = [tombs.local(since + i) for i in range(len(keys))]
                    self.counters["drops_replayed"] += await self.tiers.drop(keys, at=at)
                tombs.advance(r["log"], r["head"])     # only now: every copy of keys is gone
            self.seen = (r["log"], r["head"])
            self.from_before = set()
            await asyncio.to_thread(self._save)
            return True

    def _reset(self, r, keys) -> None:
        self.counters["drops_resets"] += 1
        log.warning("edge: the origin's drop log (%s at %d) does not follow from what this edge "
                    "replayed (%s): dropping the %d copies that may be stale", r["log"], r["head"],
                    self.seen, len(keys))
