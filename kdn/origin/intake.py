"""An edge's write-behind taken by the origin over the data plane: the objects pulled from the
edge's HTTP frames.

An edge that acknowledged stores (kdn/edge/stores.py) hands their keys to the origin over Ray
(OriginAPI.pull_objects), and the origin pulls the bytes from the edge's own server (POST
/v1/peer, kdn/edge/http.py, with the network's admin token): the frames come over TCP straight
into one buffer, each verified as its last byte is in (kdn.client.http), at about a socket's
pace where Ray's object manager, pulling the references the edge would hand over instead,
carries a third of it (`kdn bench transport --hosts`). A batch of STREAM_MIN_KEYS keys or more
goes over STREAMS parallel connections (contiguous slices, kdn.core.dataplane.slices), each
received in a worker thread; idle connections are kept per edge for the next batch.

This path is taken where the origin's pushes take the data plane (the origin was started with
http_host) and the edge serves HTTP on another Ray node that this host reaches (the same
address book as the pushes: Pusher.edge_url). Else, or when the edge's server does not answer
(its address is then asked again later), the answer says so ({"pulled": None}) and the edge
sends the batch over Ray. A key the edge no longer holds, or whose frame arrived corrupt, is
named in the answer's "missing": the edge sends those over Ray.

Counters: objects_pulled_http (objects received), object_pull_http_bytes,
object_pull_http_us (the pulls' wall time), object_pull_http_calls, object_pull_http_missing,
object_pull_http_failures (an edge's server that did not answer).
"""
import asyncio
import collections
import time

from kdn.core.dataplane import STREAMS, slices
from kdn.core.rpc import Unreachable

PULL_TIMEOUT_S = 30.0        # a socket read that waits longer: the edge's server is not answering
IDLE_CONNECTIONS = 2         # keep-alive connections kept per edge


class Intake:
    """The origin's pulls of edges' acknowledged stores: `pull(edge, url, keys)` answers the
    verified objects per key (None where the edge did not send it intact), or None when the
    edge's server did not answer."""

    def __init__(self, token, streams: int = STREAMS):
        self.token, self.streams = token, max(1, int(streams))
        self.counters = collections.Counter()
        self._idle = collections.defaultdict(list)    # url -> idle EdgeHTTPClients

    async def pull(self, url: str, keys):
        parts = slices(keys, self.streams)
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(asyncio.to_thread(self._pull, url, part) for part in parts),
                                       return_exceptions=True)
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed:
            if any(not isinstance(r, Unreachable) for r in failed):    # a bug or a refusal
                raise next(r for r in failed if not isinstance(r, Unreachable))
            self.counters["object_pull_http_failures"] += 1
            return None
        out = [o for objs, _ in replies for o in objs]
        self.counters["object_pull_http_calls"] += 1
        self.counters["objects_pulled_http"] += sum(o is not None for o in out)
        self.counters["object_pull_http_missing"] += sum(o is None for o in out)
        self.counters["object_pull_http_bytes"] += sum(n for _, n in replies)
        self.counters["object_pull_http_us"] += int((time.perf_counter() - t0) * 1e6)
        return out

    def _pull(self, url: str, keys) -> tuple:
        """(object per key or None, bytes received) over one connection (a worker thread)."""
        from kdn.client.http import EdgeHTTPClient
        idle = self._idle[url]
        try:
            client = idle.pop()                 # (threads share the list: pop is atomic)
        except IndexError:
            client = EdgeHTTPClient(url, timeout_s=PULL_TIMEOUT_S, allow_remote=True, token=self.token)
        try:
            got, nbytes = client.peer_get(keys)
        except BaseException:
            client.close()
            raise
        if len(idle) < IDLE_CONNECTIONS:
            idle.append(client)
        else:
            client.close()
        return got, nbytes

    def forget(self, url: str) -> None:
        """Close the connections kept to url (its edge did not answer)."""
        for client in self._idle.pop(url, []):
            client.close()
