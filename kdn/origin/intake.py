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
(connect or a read waiting PULL_TIMEOUT_S, or the whole pull past PULL_DEADLINE_S, well
inside the edge's own wait for the call; the store after it is not bounded, and a call the
edge gave up on and sent again over Ray is deduplicated there), or answers with a fault of its
own (RemoteError, logged), the answer says so ({"pulled": None}) and the edge sends the batch
over Ray; its address is asked again later. A frame stands only if its bytes are those the edge acknowledged (the checksum it
sent for the key: the edge's server answers with the copy it holds, which may be another);
a key the edge no longer holds, whose frame arrived corrupt or with other bytes, is named in
the answer's "missing": the edge sends those over Ray. The pulls run in threads of their own
(THREADS), not the loop's default pool the origin's disk work uses.

Counters: objects_pulled_http (objects received), object_pull_http_bytes,
object_pull_http_us (the pulls' wall time), object_pull_http_calls, object_pull_http_missing,
object_pull_http_other (frames of other bytes than acknowledged), object_pull_http_failures
(an edge's server that did not answer in time).
"""
import asyncio
import collections
import concurrent.futures
import logging
import time

from kdn.core.chunk import Encoded
from kdn.core.dataplane import STREAMS, slices
from kdn.core.errors import KDNError
from kdn.core.rpc import Unreachable

log = logging.getLogger(__name__)

PULL_TIMEOUT_S = 5.0         # connect, or a socket read, waiting longer: the edge's server is not answering
PULL_DEADLINE_S = 12.0       # a whole pull (the edge waits 20 s for the call, kdn/edge/peers.py)
IDLE_CONNECTIONS = 2         # keep-alive connections kept per edge
THREADS = 8                  # slices pulled at once, across edges (STREAMS each)
_POOL = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="kdn-intake")


class Intake:
    """The origin's pulls of edges' acknowledged stores: `pull(edge, url, keys)` answers the
    verified objects per key (None where the edge did not send it intact), or None when the
    edge's server did not answer."""

    def __init__(self, token, streams: int = STREAMS):
        self.token, self.streams = token, max(1, int(streams))
        self.counters = collections.Counter()
        self._idle = collections.defaultdict(list)    # url -> idle EdgeHTTPClients

    async def pull(self, url: str, keys, sums):
        """Per key the Chunk pulled whose checksum is sums[i] (None otherwise: a key without
        one is not asked for), or None when the edge's server did not answer in time."""
        wanted = [(k, x) for k, x in zip(keys, sums) if x is not None]
        if not wanted:
            return [None] * len(keys)
        got = await self._pulled(url, [k for k, _ in wanted], [x for _, x in wanted])
        if got is None:
            return None
        by_key = {k: o for (k, _), o in zip(wanted, got)}
        return [by_key.get(k) for k in keys]

    async def _pulled(self, url: str, keys, sums):
        parts = slices(keys, self.streams)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        replies = await asyncio.gather(*(loop.run_in_executor(_POOL, self._pull, url, part, t0 + PULL_DEADLINE_S)
                                         for part in parts), return_exceptions=True)
        failed = [r for r in replies if isinstance(r, BaseException)]
        if failed or time.perf_counter() - t0 > PULL_DEADLINE_S:
            bug = next((r for r in failed if not isinstance(r, KDNError)), None)
            if bug is not None:
                raise bug
            if any(not isinstance(r, Unreachable) for r in failed):    # the edge's own fault or refusal
                log.warning("origin: a pull of stores from edge %s failed: %s", url,
                            next(r for r in failed if not isinstance(r, Unreachable)))
            self.counters["object_pull_http_failures"] += 1
            return None
        got = [o for objs, _ in replies for o in objs]
        out = await loop.run_in_executor(_POOL, _as_acknowledged, got, sums)
        self.counters["object_pull_http_calls"] += 1
        self.counters["objects_pulled_http"] += sum(o is not None for o in out)
        self.counters["object_pull_http_missing"] += sum(o is None for o in got)
        self.counters["object_pull_http_other"] += sum(g is not None and o is None for g, o in zip(got, out))
        self.counters["object_pull_http_bytes"] += sum(n for _, n in replies)
        self.counters["object_pull_http_us"] += int((time.perf_counter() - t0) * 1e6)
        return out

    def _pull(self, url: str, keys, deadline: float) -> tuple:
        """(object per key or None, bytes received) over one connection (a worker thread)."""
        from kdn.client.http import EdgeHTTPClient
        if time.perf_counter() > deadline:
            raise Unreachable(f"edge {url}: the pull of its stores ran past {PULL_DEADLINE_S} s")
        idle = self._idle[url]
        try:
            client = idle.pop()                 # (threads share the list: pop is atomic)
        except IndexError:                      # (no buffer kept between pulls: memory stays bounded)
            client = EdgeHTTPClient(url, timeout_s=PULL_TIMEOUT_S, allow_remote=True, token=self.token,
                                    reuse_buffer=False)
        done = False
        try:
            got, nbytes = client.peer_get(keys)
            done = True
        finally:
            if not done:                 # a connection broken mid-answer is not reused
                client.close()
        if len(idle) < IDLE_CONNECTIONS:
            idle.append(client)
        else:
            client.close()
        return got, nbytes

    def forget_all(self) -> None:
        """Close every kept connection (the membership changed: edges may be gone)."""
        for url in list(self._idle):
            self.forget(url)

    def forget(self, url: str) -> None:
        """Close the connections kept to url (its edge did not answer)."""
        for client in self._idle.pop(url, []):
            client.close()


def _as_acknowledged(objs, sums) -> list:
    """Each pulled object as a Chunk (a compressed frame decoded) if its checksum is the one
    acknowledged for its key, else None (other bytes, or no checksum to compare)."""
    out = []
    for obj, want in zip(objs, sums):
        if obj is None or want is None:
            out.append(None)
            continue
        chunk = obj.decode() if isinstance(obj, Encoded) else obj
        have = chunk._xxh if chunk._xxh is not None else chunk.digest()
        out.append(chunk if have == want else None)
    return out
