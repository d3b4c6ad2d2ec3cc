"""Which path a reader's fetch takes to an edge: the edge's HTTP frames or Ray.

Ray's object manager moves an object between nodes at about a third of what one TCP
connection carries between the same hosts (`kdn bench transport --hosts`), while an edge's
HTTP server sends verified frames at the socket's pace. So a reader whose edge is on another
Ray node (another host: LMCache's or SGLang's server reading another region's edge, `kdn bench
fetch` cross-node) fetches over that edge's HTTP frames; Ray stays the control plane (lookups,
membership, reports of corrupt copies) and carries what sits on the reader's own node, read
zero-copy from the shared store, which no socket beats. Edges pulling from each other use the
same rule (kdn/edge/dataplane.py), and so does a cache layer's store acknowledged at an edge
on another node (put_objects: its objects written as frames to the edge's server, POST
/v1/objects; kdn.client.view), on this pool's connections.

mode (`data_plane`): kdn.core.dataplane's, as for edges.

An edge's address (its HTTP URL, Ray node and node address: EdgeAPI.data_address) is asked
once over Ray and kept (kdn.core.dataplane.Addresses); an edge without HTTP is asked again
after a while. An edge that listens on loopback is read over HTTP only from its own host. HTTP
carries only the fetches a reader can check as it would over Ray: frames in raw or a lossless
codec chosen for the link ("auto"), so a reader that accepts lossy codecs reads over Ray. An
edge that does not answer over HTTP is unreachable as over Ray (the caller fails over), and
its address is asked again next time.

A fetch of STREAM_MIN_KEYS keys or more is split over `streams` parallel connections
(contiguous slices of its keys, as an edge's pulls from a peer are), so one connection's pace
is not the ceiling where a link carries more than one stream. The answers are joined in key
order; where a slice's answer is short of its keys (an edge bounds each answer, "more", or
stops at a key it does not hold), the slices after it are left out, so the reader gets a
prefix of its keys, as from one answer.
"""
import collections
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kdn.core.codecs import LOSSLESS
from kdn.core.dataplane import STREAMS, Addresses, slices

IDLE_CONNECTIONS = 4         # keep-alive connections kept per (URL, token)


class ReaderPlane:
    """For one reader process: the URL to fetch an edge's frames from (url_of), or None for
    Ray, and a pool of keep-alive HTTP connections per (URL, token) that threads share."""

    def __init__(self, mode: str, node_id: str, node_ip: str, ask_address, streams: int = STREAMS):
        self.addresses = Addresses(mode, node_id, node_ip)
        self.mode = self.addresses.mode
        self.ask_address = ask_address            # edge -> its data_address, or None (unreachable)
        self.streams = max(1, int(streams))
        self.counters = collections.Counter()
        self._idle = collections.defaultdict(list)
        self._lock = threading.Lock()
        self._pool = None                         # threads for a fetch's other slices, made on first use

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
        (kdn.client.http.fetch_reply), its keys' slices over parallel connections (see the
        module); Unreachable when the edge gives none within timeout_s (each wait on the
        socket). accept (lossless codecs only: url_of): the frames' forms, raw alone or what
        pays on the link."""
        parts = slices(keys, self.streams)
        t0 = time.perf_counter()
        if len(parts) == 1:
            reply = self._fetch(url, timeout_s, token, parts[0], ns, region, accept, tenant, fingerprint)
        else:
            with self._lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=4 * (self.streams - 1),
                                                    thread_name_prefix="kdn-fetch")
                pool = self._pool
            others = [pool.submit(self._fetch, url, timeout_s, token, part, ns, region, accept, tenant,
                                  fingerprint) for part in parts[1:]]
            try:      # a slice Unreachable: the whole fetch is (the caller fails over)
                replies = [self._fetch(url, timeout_s, token, parts[0], ns, region, accept, tenant, fingerprint)]
                replies += [f.result() for f in others]
            finally:  # after a failure the slices not started yet are dropped (a done one is untouched)
                for f in others:
                    f.cancel()
            reply = join_replies(replies, [len(p) for p in parts])
        with self._lock:
            self.counters["http_fetches"] += 1
            self.counters["http_streams"] += len(parts)
            self.counters["http_split_fetches"] += len(parts) > 1
            self.counters["http_bytes"] += sum(reply["wire"])
            self.counters["http_us"] += int((time.perf_counter() - t0) * 1e6)
        return reply

    def _fetch(self, url: str, timeout_s: float, token, keys, ns, region, accept, tenant, fingerprint) -> dict:
        """One slice's answer over one keep-alive connection."""
        from kdn.client.http import fetch_reply
        codec = "auto" if set(accept) >= set(LOSSLESS) else "raw"
        return self.on_connection(url, timeout_s, token,
                                   lambda client: fetch_reply(client, keys, ns, region, codec, tenant, fingerprint))

    def conversation(self, url: str, timeout_s: float, token, keys, ns, tenant, fingerprint, scope) -> tuple:
        """(objects, wire bytes): a conversation's held prefix at its home edge over HTTP (see
        EdgeHTTPClient.conversation_get), on one keep-alive connection; Unreachable when the
        edge gives none within timeout_s."""
        t0 = time.perf_counter()
        objs, nbytes = self.on_connection(url, timeout_s, token, lambda client: client.conversation_get(
            keys, ns, tenant, fingerprint, scope))
        with self._lock:
            self.counters["http_conversation_fetches"] += 1
            self.counters["http_conversation_bytes"] += nbytes
            self.counters["http_conversation_us"] += int((time.perf_counter() - t0) * 1e6)
        return objs, nbytes

    def put_objects(self, url: str, timeout_s: float, token, chunks) -> dict:
        """An edge's put_objects answer to chunks written to its HTTP server as raw frames
        (POST /v1/objects: EdgeHTTPClient.put_frames), on one keep-alive connection;
        Unreachable when the edge gives none within timeout_s."""
        t0 = time.perf_counter()
        got = self.on_connection(url, timeout_s, token, lambda client: client.put_frames("objects", chunks))
        with self._lock:
            self.counters["http_puts"] += 1
            self.counters["http_put_bytes"] += sum(c.nbytes for c in chunks)
            self.counters["http_put_us"] += int((time.perf_counter() - t0) * 1e6)
        return got

    def on_connection(self, url: str, timeout_s: float, token, call):
        """call(client) on a keep-alive connection to url from the pool (a fetch's, a
        conversation read's, an edge write's, an origin write's: kdn/client/ingest.py) (made if none is idle),
        given back after it unless the call failed (a connection broken mid-answer is closed)."""
        from kdn.client.http import EdgeHTTPClient
        with self._lock:
            idle = self._idle[(url, token)]
            client = idle.pop() if idle else None
        if client is None:
            client = EdgeHTTPClient(url, timeout_s=timeout_s, allow_remote=True, token=token)
        client.set_timeout(timeout_s)
        try:
            reply = call(client)
        except BaseException:        # a connection broken mid-answer is not reused: closed, re-raised
            client.close()
            raise
        with self._lock:
            if len(self._idle[(url, token)]) < IDLE_CONNECTIONS:
                self._idle[(url, token)].append(client)
                client = None
        if client is not None:
            client.close()
        return reply

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
            clients = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for c in clients:
            c.close()

    def stats(self) -> dict:
        return {"mode": self.mode, "streams": self.streams, **self.counters, "http_edges": self.addresses.with_http()}


def join_replies(replies, asked) -> dict:
    """The answers to a fetch's key slices (asked[i] keys in slice i), in order, as one: each
    list joined up to and including the first answer short of its slice, cut by the edge's
    bound ("more": the reader asks for the rest) or at a key the edge does not hold (the
    prefix ends there, as an answer to all the keys at once would); "move_s" the longest of
    the kept slices' (they moved side by side)."""
    names = ("chunks", "sources", "codecs", "wire", "exact")
    out = dict(replies[0], **{name: list(replies[0][name]) for name in names})
    kept = [replies[0]]
    short = out["more"] or len(out["chunks"]) < asked[0]
    for r, n in zip(replies[1:], asked[1:]):
        if short:
            break
        for name in names:
            out[name] += r[name]
        out["more"], out["ring"] = r["more"], max(out["ring"], r["ring"])
        kept.append(r)
        short = r["more"] or len(r["chunks"]) < n
    out["move_s"] = max(r.get("move_s", 0.0) for r in kept)
    return out
