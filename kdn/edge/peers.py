"""An edge's calls to the other edges and to the origin, with the admin token.

Calls go through kdn.core.rpc.Actors, which fails over only when a node is dead, restarting,
missing or too slow: then a call of `origin()` or `edge(name)` (stubs of kdn.core.interfaces)
answers None and counts peer_failures or origin_failures, and
the caller moves to its next source. Anything else (a remote KDNError, a wrong signature) is
a bug or a refusal and raises: a broad except here once hid a membership refresh that never
ran. Work sent after a reply (read repair) runs as a task this object keeps until it ends;
a failure there is counted (after_reply_errors) and logged, never lost.
"""
import asyncio
import collections
import logging
import time

from kdn.core.interfaces import EdgeAPI, OriginAPI
from kdn.placement.links import Links
from kdn.core.names import ORIGIN_NODE
from kdn.core.rpc import Actors, Stub, Unreachable

log = logging.getLogger("kdn.edge")

def link_name(node) -> str:
    """A node's name in `links`: an edge's own, "origin" for the origin."""
    return "origin" if node is ORIGIN_NODE else str(node)


PEER_TIMEOUT_S = 5.0      # a peer that does not answer in time is skipped (next owner, then origin)
ORIGIN_TIMEOUT_S = 20.0
PEER_READ_S = 5.0         # a peer's object must arrive within this: else a reply sends it as the
                          # peer sent it (kdn.edge.forms), and a copy to keep is not kept (pull)


class Peers:
    def __init__(self, network: str, admin_token: str = None, edge: str = "?"):
        self.actors = Actors(network, admin_token)
        self.name = edge                # whose calls these are (for the log)
        self.counters = collections.Counter()
        self.links = Links()       # what this edge measured of its links to each node
        self._tasks = set()        # work sent after a reply, referenced till done

    def origin(self, timeout: float = ORIGIN_TIMEOUT_S) -> OriginAPI:
        """The origin's interface; a call answers None when the origin is unreachable."""
        return Stub(OriginAPI, lambda m, a, k: self.ask(ORIGIN_NODE, m, *a, timeout=timeout, **k),
                    "the origin")

    def edge(self, name: str, timeout: float = PEER_TIMEOUT_S) -> EdgeAPI:
        """Edge name's interface; a call answers None when that edge is unreachable."""
        return Stub(EdgeAPI, lambda m, a, k: self.ask(name, m, *a, timeout=timeout, **k),
                    f"edge {name!r}")

    async def ask(self, node, method, *args, timeout: float, **kw):
        """node's answer to method, None when node is unreachable: the transport under the
        stubs (callers call origin() and edge(); a test stands in for the network here).
        Each answered call's time is noted in `links` (its round trip, kdn/placement/links.py)."""
        t0 = time.perf_counter()
        try:
            got = await self.actors.call(node, method, *args, timeout=timeout, **kw)
        except Unreachable:
            self.counters["origin_failures" if node is ORIGIN_NODE else "peer_failures"] += 1
            return None
        self.links.call(link_name(node), time.perf_counter() - t0)
        return got

    def later(self, coro, what: str) -> None:
        """Run coro after the current reply; count and log it if it fails."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._done(t, what))

    def _done(self, task, what: str) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        e = task.exception()
        if e is not None:
            self.counters["after_reply_errors"] += 1
            log.error("edge %s: %s failed: %s: %s", self.name, what, type(e).__name__, e,
                      exc_info=e)

    def stats(self) -> dict:
        return {"pending": len(self._tasks), **self.counters}
