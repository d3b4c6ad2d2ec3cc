"""Which edges answer: the origin pings every edge each period and keeps the dead out of the ring.

An edge that misses `down_after` pings in a row is taken out of the membership (its keys
re-home to their next owners) and remembered as down; it rejoins when it answers again.
A crashed Ray node takes ~15 s to be declared dead; this takes ~down_after periods and
needs no Ray state. A ping fails over like any call (kdn.core.rpc): only a dead, missing or
slow edge counts as a miss; any other error is a bug and raises.
"""
import asyncio
import collections

PERIOD_S = 1.0           # every edge is pinged this often ...
PING_TIMEOUT_S = 1.0     # ... and must answer within this
DOWN_AFTER = 5           # consecutive misses before its keys are re-homed (a restart takes ~2 s)


class Health:
    """Misses per edge and the edges taken out for them: name -> (region, weight)."""

    def __init__(self, actors, down_after: int = DOWN_AFTER, timeout_s: float = PING_TIMEOUT_S,
                 beat=None):
        self.actors = actors
        self.beat = beat or dict      # () -> what each ping carries (keyword arguments)
        self.down_after, self.timeout_s = down_after, timeout_s
        self.down = {}
        self.misses = collections.Counter()
        self.counters = collections.Counter(pings_missed=0, edges_marked_down=0, edges_back=0)

    async def round(self, members) -> "list | None":
        """Ping members and down edges; the membership to apply now, or None when none changed."""
        names = [m[0] for m in members] + list(self.down)
        beat = self.beat()
        replies = await asyncio.gather(*(self.actors.edge(n, self.timeout_s, "try").ping(**beat)
                                         for n in names))
        alive = {n for n, r in zip(names, replies) if r is not None}
        for n in names:
            self.misses[n] = 0 if n in alive else self.misses[n] + 1
        self.counters["pings_missed"] += len(names) - len(alive)
        gone = [m for m in members if self.misses[m[0]] >= self.down_after]
        back = [(n, *self.down[n]) for n in self.down if n in alive]
        if not gone and not back:
            return None
        for n, r, w in gone:
            self.down[n] = (r, w)
        for n, _, _ in back:
            del self.down[n]
        self.counters["edges_marked_down"] += len(gone)
        self.counters["edges_back"] += len(back)
        keep = [m for m in members if m not in gone] + back
        return keep or None      # every edge silent: keep routing to them rather than to nobody

    def in_ring(self, members) -> list:
        """Of an operator's membership, the edges to route to: those not down (a down edge it
        names rejoins when it answers)."""
        return [m for m in members if m[0] not in self.down]

    def keep_only(self, names) -> None:
        """Stop watching the down edges an operator's membership left out."""
        names = set(names)
        self.down = {n: v for n, v in self.down.items() if n in names}

    def forget(self, name: str) -> bool:
        """Stop watching a down edge an operator removed; whether it was down."""
        self.misses.pop(name, None)
        return self.down.pop(name, None) is not None
