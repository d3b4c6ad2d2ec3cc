"""Which path a reader's fetch takes to an edge: the edge's HTTP frames or Ray.

Ray's object manager moves an object between nodes at about a third of what one TCP
connection carries between the same hosts (`kdn bench transport --hosts`), while an edge's
HTTP server sends verified frames at the socket's pace. So a reader whose edge is on another
Ray node (another host: LMCache's or SGLang's server reading another region's edge, `kdn bench
fetch` cross-node) fetches over that edge's HTTP frames; Ray stays the control plane (lookups,
membership, reports of corrupt copies) and carries what sits on the reader's own node, read
zero-copy from the shared store, which no socket beats. Edges pulling from each other use the
same rule (kdn/edge/dataplane.py).

mode (`data_plane`): kdn.core.dataplane's, as for edges.

An edge's address (its HTTP URL, Ray node and node address: EdgeAPI.data_address) is asked
once over Ray and kept (kdn.core.dataplane.Addresses); an edge without HTTP is asked again
after a while. An edge that listens on loopback is read over HTTP only from its own host. HTTP
carries only the fetches a reader can check as it would over Ray: frames in raw or a lossless
codec chosen for the link ("auto"), so a reader that accepts lossy codecs reads over Ray. An
edge that does not answer over HTTP is unreachable as over Ray (the caller fails over), and
its address is asked again next time.
"""
import collections
import threading
import time

from kdn.core.codecs import LOSSLESS
from kdn.core.dataplane import Addresses

IDLE_CONNECTIONS = 4         # keep-alive connections kept per (URL, token)


class ReaderPlane:
    """For one reader process: the URL to fetch an edge's frames from (url_of), or None for
    Ray, and a pool of keep-alive HTTP connections per (URL, token) that threads share."""

    def __init__(self, mode: str, node_id: str, node_ip: str, ask_address):
        self.addresses = Addresses(mode, node_id, node_ip)
        self.mode = self.addresses.mode
        self.ask_address = ask_address            # edge -> its data_address, or None (unreachable)
        self.counters = collections.Counter()
        self._idle = collections.defaultdict(list)
        self._lock = threading.Lock()

    def url_of(self, edge: str, accept) -> "str | None":
        """The URL to fetch from edge over HTTP, or None to use Ray."""
        if self.mode == "ray" or not set(accept) <= set(LOSSLESS):
            return None
        if self.addresses.stale(edge):
            got = self.ask_address(edge)
            if got is None:                       # unreachable now: Ray's call says so in turn
                return None
            self.addresses.note(edge, got)
        return self.addresses.url(edge)

    def forget(self, edge: str) -> None:
        """edge did not answer over HTTP: its address is asked again next time."""
        self.addresses.forget(edge)

    def fetch(self, url: str, timeout_s: float, token, keys, ns, region, accept, tenant=None,
              fingerprint=None) -> dict:
        """One fetch answer from url as the Ray transport's resolved reply
        (kdn.client.http.fetch_reply); Unreachable when the edge gives none within timeout_s
        (each wait on the socket). accept (lossless codecs only: url_of): the frames' forms,
        raw alone or what pays on the link."""
        from kdn.client.http import EdgeHTTPClient, fetch_reply
        with self._lock:
            idle = self._idle[(url, token)]
            client = idle.pop() if idle else None
        if client is None:
            client = EdgeHTTPClient(url, timeout_s=timeout_s, allow_remote=True, token=token)
        client.set_timeout(timeout_s)
        try:
            t0 = time.perf_counter()
            codec = "auto" if set(accept) >= set(LOSSLESS) else "raw"
            reply = fetch_reply(client, keys, ns, region, codec, tenant, fingerprint)
        except BaseException:        # a connection broken mid-answer is not reused: closed, re-raised
            client.close()
            raise
        self.counters["http_fetches"] += 1
        self.counters["http_bytes"] += sum(reply["wire"])
        self.counters["http_us"] += int((time.perf_counter() - t0) * 1e6)
        with self._lock:
            if len(self._idle[(url, token)]) < IDLE_CONNECTIONS:
                self._idle[(url, token)].append(client)
                client = None
        if client is not None:
            client.close()
        return reply

    def close(self) -> None:
        with self._lock:
            clients = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in clients:
            c.close()

    def stats(self) -> dict:
        return {"mode": self.mode, **self.counters, "http_edges": self.addresses.with_http()}
