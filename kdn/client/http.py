"""A worker outside Ray reads an edge over HTTP and gets the very bytes a Ray client gets.

`EdgeHTTPClient(url)` speaks to one edge's HTTP server (kdn.edge.http). A fetch answer is
kdn.core.chunk frames back to back with an exact Content-Length, so the whole body is received
straight into ONE preallocated buffer (http.client's readinto: the socket's recv_into
writes into it, no intermediate bytes objects), made read-only, and cut into Chunks
without copying: each chunk's kv is a view of that buffer, verified by decode() (header
and payload checksums) before it is returned. That is the receive path of LMCache's own
KV server, the fastest peer measured on this machine; a bytes-per-chunk client (redis-py)
copies every payload twice more.

One keep-alive connection per client (so one client per thread); a connection the server
closed is reopened once and the (idempotent) request repeated. The receive buffer is written
by a later fetch only once nothing views it any more (no live Chunk of the answer it held:
kdn.core.buffers).
An edge bounds one answer: while it says X-KDN-More: 1, fetch() asks for the keys after
those received, so a long prefix arrives in a few answers (X-KDN-Sources is run-length
coded, kdn.core.wire). Only loopback edges are accepted unless allow_remote is set,
mirroring the server, which binds 127.0.0.1 unless told otherwise.

Errors split as on the Ray path (kdn.core.rpc): no answer (a refused or dropped connection, a
body cut short, a timeout) raises kdn.core.rpc.Unreachable, which a caller fails over on; an
answer that is a fault of the edge's own (a 5xx, a malformed reply, a chunk not asked for)
raises kdn.core.errors.RemoteError, surfaced; a 4xx is the caller's (BadRequest, AccessDenied).
"""
import collections
import http.client
import json
import functools
import select
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

import msgpack
import numpy as np

from kdn.core.buffers import KeptBuffers
from kdn.core.chunk import Encoded, codecs, decode, encode_parts, frame_size, header_bytes, read_header
from kdn.core.codecs import LOSSY
from kdn.core.wire import FRAMES_TYPE, ORIGIN_UNREACHABLE, unpack_sources
from kdn.core.errors import (AccessDenied, BadRequest, ChecksumMismatch, FrameError, KDNError, NetworkError,
                             NoLiveEdge, RemoteError)
from kdn.core.rpc import Unreachable
from kdn.core.keys import KEY_BYTES
from kdn.core.env import is_loopback
from kdn.core.interfaces import EdgeReads
from kdn.core.manifest import Manifest
from kdn.core.rpc import Stub
from kdn.client.reader import Fetched
MAX_RESPONSE_BYTES = 64 << 30
RECV_STEP = 1 << 20         # bytes received between looks for completed frames
SEND_STEP = 1 << 20         # bytes of a body sent between looks for an early answer


@dataclass
class _Page:
    """One fetch answer: an edge bounds its size and says whether more remains."""
    chunks: list
    sources: list
    codecs: list
    exact: list
    sizes: list                 # bytes of each frame received
    edge: str
    more: bool
    ring: int = 0               # the edge's membership version (X-KDN-Ring): readers follow it
    body_s: float = 0.0         # seconds from the answer's headers to its last byte: the link's share

    wire_bytes = property(lambda self: sum(self.sizes))


@dataclass
class _Answered:
    """An answer read whole before its request's body was all sent (_answer_before_body_end)."""
    status: int
    body: bytes

    def read(self) -> bytes:
        return self.body


class CorruptFrame:
    """A frame whose payload failed its checksum, standing for its chunk in a fetch answer:
    a Reader's check (decode) fails on it, so the holder is told (drop_corrupt) and the key
    asked for again, as over Ray. Its header was intact: key and ns are the edge's word."""

    def __init__(self, key: bytes, ns: bytes, error: str):
        self.key, self.ns, self.error = key, ns, error
        self.exact = True

    def decode(self):
        raise ChecksumMismatch(self.error)


class EdgeHTTPClient:
    """lookup / fetch / kbs / health against one edge's HTTP server."""

    def __init__(self, base_url: str, timeout_s: float = 30.0, allow_remote: bool = False,
                 max_response_bytes: int = MAX_RESPONSE_BYTES, reuse_buffer: bool = True,
                 token: str = None, buffers: KeptBuffers = None):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname or u.port is None:
            raise BadRequest(f"an edge URL is http://HOST:PORT, got {base_url!r}")
        if not allow_remote and not is_loopback(u.hostname):
            raise BadRequest(f"edge URL {base_url!r} is not on loopback; pass allow_remote=True "
                             f"to read an edge on another machine")
        self.url = base_url.rstrip("/")
        self.token = token          # sent as `Authorization: Bearer` (a tenant's read token)
        self.host, self.port = u.hostname, u.port
        self.timeout_s = float(timeout_s)
        self.max_response_bytes = int(max_response_bytes)
        self._conn = None
        self.reuse_buffer = reuse_buffer
        # the receive buffer, reused once nothing views it (_receive_buffer); or buffers
        # shared with other clients (an edge's pulling connections: kdn/edge/dataplane.py)
        self._buffers = KeptBuffers(1, self.max_response_bytes) if buffers is None else buffers
        # requests, reconnects, fetches, chunks, bytes (received), kv_bytes, buffers_reused, _new
        self.counters = collections.Counter()
        self.codecs = collections.Counter()      # codec -> frames received in it

    def stats(self) -> dict:
        return {**self.counters, "codecs": dict(self.codecs)}

    # --- plumbing -----------------------------------------------------------------------
    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def set_timeout(self, timeout_s: float) -> None:
        """The longest wait on the socket from now on (connect, each read), this connection's
        and the next's."""
        self.timeout_s = float(timeout_s)
        if self._conn is not None and self._conn.sock is not None:
            self._conn.sock.settimeout(self.timeout_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _request(self, method: str, path: str, body=None, content_type: str = None):
        """(response, connection) with the status line and headers read, the body not yet.
        body: bytes, or a list of buffers sent one after the other (no join copy)."""
        headers = {"Content-Type": content_type} if content_type else {}
        if isinstance(body, list):
            headers["Content-Length"] = str(sum(memoryview(b).nbytes for b in body))
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
            try:
                try:
                    answered = self._send(method, path, body, headers)
                except (ConnectionResetError, BrokenPipeError):
                    answered = True       # closed under the body: perhaps after an answer
                if answered:
                    early = self._answer_before_body_end()
                    if early is not None:             # a refusal, not a lost connection
                        self._early(early, method, path)
                    raise ConnectionResetError("closed before the whole body was sent")
                resp = self._conn.getresponse()
                self.counters["requests"] += 1
                return resp
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                    http.client.CannotSendRequest, http.client.BadStatusLine) as e:
                self.close()
                if attempt:
                    raise Unreachable(f"edge {self.url} closed the connection on "
                                       f"{method} {path}: {e}") from None
                self.counters["reconnects"] += 1
            except OSError as e:
                self.close()
                raise Unreachable(f"edge {self.url} unreachable on {method} {path}: {e}") from None

    def _send(self, method: str, path: str, body, headers: dict) -> bool:
        """Send a request; True when the server answered (or closed) before a body of buffers
        was all sent. Such a body goes SEND_STEP bytes at a time, with a look for an answer
        between them: a server refuses a write (a wrong token, a body it will not take) as
        soon as it has the headers, and a writer on a slow link would otherwise send the
        whole body before it reads the refusal (what a 64 MiB store on a 30 Mbit/s link took,
        docs/figures.md)."""
        conn = self._conn
        if not isinstance(body, list):
            conn.request(method, path, body=body, headers=headers)
            return False
        conn.putrequest(method, path)
        for name, value in headers.items():
            conn.putheader(name, value)
        conn.endheaders()
        sock, answer = conn.sock, select.poll()      # poll: no limit on the fd's number
        answer.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        for part in body:
            mv = memoryview(part).cast("B")
            for start in range(0, mv.nbytes, SEND_STEP):
                if answer.poll(0):
                    return True
                try:
                    sock.sendall(mv[start:start + SEND_STEP])
                except TimeoutError:       # a server that answered and stopped reading
                    if answer.poll(0):
                        return True
                    raise
        return False

    def _answer_before_body_end(self):
        """The answer a server gave before it read the whole body (a refusal: a wrong token, a
        body it will not take). Sending the rest would only be refused again, and an
        Unreachable would fail the caller over as if the node were down. It is read even
        where the connection was reset under the body (a server that stops reading a slow
        body closes with bytes of it unread, which resets the connection): Linux hands out
        what arrived before the reset. None when there is no answer to read (a keep-alive
        connection the server had closed before this request: the caller reconnects). The
        connection is closed either way: its request was never completed."""
        answered = None
        if self._conn.sock is not None:            # None: the connect itself failed
            try:
                resp = self._conn.getresponse()
                answered = _Answered(resp.status, resp.read())
            except (http.client.HTTPException, OSError):
                answered = None
        self.close()
        if answered is not None:
            self.counters["answered_before_body_end"] += 1
        return answered

    def _early(self, resp, method, path):
        """Raise what an answer given before the request's body was all sent says: a refusal
        as _refuse raises it; a 408 (the server stopped waiting for the body: the link
        stalled) as Unreachable, as a timeout here is; anything below 400 as the protocol
        error it is (no server answers a write before it has read it)."""
        if resp.status == 408:
            raise Unreachable(f"edge {self.url} timed out waiting for the body of {method} {path}: "
                              f"{resp.read()[:200].decode('utf-8', 'replace')}")
        if resp.status < 400:
            raise RemoteError(f"edge {self.url} answered {method} {path} with {resp.status} before "
                              f"its body was sent")
        self._refuse(resp, method, path)

    def _refuse(self, resp, method, path):
        raw = resp.read()
        try:
            body = json.loads(raw)
            message, error = body["message"], body.get("error")
        except (ValueError, KeyError, TypeError, AttributeError):
            message, error = raw[:200].decode("utf-8", "replace"), None
        if resp.status == 503 and error == ORIGIN_UNREACHABLE:   # as over Ray: not a failover
            raise NetworkError(f"edge {self.url} answered {method} {path}: {message}")
        if resp.status in (401, 403):
            raise AccessDenied(f"edge {self.url} refused {method} {path}: {resp.status} {message}")
        if 400 <= resp.status < 500:
            raise BadRequest(f"edge {self.url} refused {method} {path}: {resp.status} {message}")
        raise RemoteError(f"edge {self.url} failed {method} {path}: {resp.status} {message}")

    def _json(self, method, path, body=None, content_type=None):
        resp = self._request(method, path, body, content_type)
        if resp.status != 200:
            self._refuse(resp, method, path)
        try:
            return json.loads(resp.read())
        except ValueError as e:
            raise RemoteError(f"edge {self.url} answered {path} with invalid JSON: {e}") from None

    @staticmethod
    def _keys_body(keys, ns, region=None, codec=None, claim=None) -> bytes:
        ks = [bytes(k) for k in keys]
        if not isinstance(ns, (bytes, bytearray)) or len(ns) != KEY_BYTES \
                or any(len(k) != KEY_BYTES for k in ks):
            raise BadRequest(f"ns and every key must be {KEY_BYTES} bytes")
        body = {"ns": bytes(ns), "keys": ks}
        if region is not None:
            body["region"] = region
        if codec is not None:
            if codec != "auto" and codec not in codecs():
                raise BadRequest(f"codec {codec!r} is not 'auto' or one of {', '.join(codecs())}")
            body["codec"] = codec
        if claim is not None:               # (tenant, fingerprint): a namespace no manifest names
            body["tenant"], body["fingerprint"] = claim
        return msgpack.packb(body, use_bin_type=True)

    # --- endpoints ----------------------------------------------------------------------
    def health(self) -> dict:
        return self._json("GET", "/health")

    def metrics(self) -> str:
        resp = self._request("GET", "/metrics")
        if resp.status != 200:
            self._refuse(resp, "GET", "/metrics")
        return resp.read().decode("utf-8")

    def list_manifests(self, tenant: str, fingerprint: str) -> list:
        """Committed KB manifests of the namespace (tenant, fingerprint), as dicts (what the
        Ray transport answers: keys and tokens as bytes)."""
        got = self._json("GET", "/v1/kbs?" + urlencode({"tenant": tenant, "fingerprint": fingerprint}))
        return [dict(d, keys=[bytes.fromhex(k) for k in d["keys"]],
                     tokens=bytes.fromhex(d.get("tokens") or "")) for d in got["manifests"]]

    def kbs(self, tenant: str, fingerprint: str) -> list:
        """list_manifests() as Manifests."""
        return [Manifest.from_dict(d) for d in self.list_manifests(tenant, fingerprint)]

    def lookup(self, keys, ns: bytes) -> dict:
        """{"chunks": n, ...}: how long a prefix of keys the network holds; no KV moves."""
        return self._json("POST", "/v1/lookup", self._keys_body(keys, ns), "application/msgpack")

    def fetch(self, keys, ns: bytes, region: str = None, codec: str = None) -> Fetched:
        """The longest held prefix of keys as verified Chunks (views of the received buffers).

        codec: how the edge should encode the frames (a kdn.core.codecs name, or "auto": what
        pays on the link to `region`); None asks for raw. Compressed frames decode into
        fresh arrays; raw ones stay views of the receive buffer. An edge bounds one answer
        (X-KDN-More: 1); the rest is asked for with the keys after those received.
        """
        t0 = time.perf_counter()
        keys = [bytes(k) for k in keys]
        pages = [self.fetch_page(keys, ns, region, codec)]
        got = len(pages[0].chunks)
        while pages[-1].more and pages[-1].chunks and got < len(keys):
            pages.append(self.fetch_page(keys[got:], ns, region, codec))
            got += len(pages[-1].chunks)
        chunks = [c for p in pages for c in p.chunks]
        bad = next((c for c in chunks if isinstance(c, CorruptFrame)), None)
        if bad is not None:
            raise ChecksumMismatch(bad.error)
        used = collections.Counter(c for p in pages for c in p.codecs)
        self.counters["fetches"] += 1
        self.counters["chunks"] += len(chunks)
        self.counters["kv_bytes"] += sum(c.nbytes for c in chunks)
        self.codecs.update(used)
        return Fetched(keys=keys[:len(chunks)], chunks=chunks,
                       sources=[s for p in pages for s in p.sources],
                       tokens=sum(c.tokens for c in chunks), nbytes=sum(c.nbytes for c in chunks),
                       edge=pages[-1].edge, seconds=time.perf_counter() - t0,
                       exact=all(e for p in pages for e in p.exact),
                       wire_bytes=sum(p.wire_bytes for p in pages), codecs=dict(used))

    def fetch_page(self, keys, ns, region, codec, claim=None) -> "_Page":
        """One fetch answer: its verified chunks and what its headers say. claim: the
        (tenant, fingerprint) ns digests, for objects no manifest names
        (kdn.integrations.objects): the edge checks the token against that tenant."""
        resp = self._request("POST", "/v1/fetch", self._keys_body(keys, ns, region, codec, claim),
                             "application/msgpack")
        if resp.status != 200:
            self._refuse(resp, "POST", "/v1/fetch")
        t0 = time.perf_counter()
        buf, (chunks, used, exact, sizes) = self._receive(resp, lambda mv: _Frames(self.url, mv, keys, ns))
        body_s = time.perf_counter() - t0
        try:
            sources = unpack_sources(resp.getheader("X-KDN-Sources"), len(keys))
        except BadRequest as e:
            raise RemoteError(f"edge {self.url}: {e}") from None
        if len(sources) != len(chunks) or resp.getheader("X-KDN-Chunks") != str(len(chunks)):
            raise RemoteError(f"edge {self.url} sent {len(chunks)} frames but headers say "
                               f"{resp.getheader('X-KDN-Chunks')} chunks from {len(sources)} sources")
        self.counters["bytes"] += buf.nbytes
        try:
            ring = int(resp.getheader("X-KDN-Ring") or 0)
        except ValueError:
            raise RemoteError(f"edge {self.url} sent X-KDN-Ring {resp.getheader('X-KDN-Ring')!r:.40}, "
                              f"not a number") from None
        return _Page(chunks, sources, used, exact, sizes, resp.getheader("X-KDN-Edge"),
                     resp.getheader("X-KDN-More") == "1", ring, body_s)

    def put_frames(self, what: str, chunks) -> dict:
        """Chunks written to the origin's HTTP server (POST /v1/chunks: a publisher's
        put_chunks; /v1/objects: put_objects; kdn/origin/http.py), or objects to an edge's
        (POST /v1/objects: put_objects, kdn/edge/http.py), as raw frames, each header and
        payload sent as they are, with the network's admin token (this client's token): the
        node's answer, as its call over Ray gives it."""
        parts = [p for c in chunks for p in encode_parts(c)]
        path = f"/v1/{what}"
        resp = self._request("POST", path, parts, FRAMES_TYPE)
        if resp.status != 200:
            self._refuse(resp, "POST", path)
        try:
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            self.close()
            raise Unreachable(f"{self.url}: the answer to POST {path} broke off: {e}") from None
        try:
            return msgpack.unpackb(raw, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise RemoteError(f"{self.url} answered POST {path} with no msgpack map: {type(e).__name__}") from None

    def conversation_get(self, keys, ns: bytes, tenant: str, fingerprint: str, scope: str) -> tuple:
        """(objects, wire bytes): the held prefix of a conversation's keys at its home edge (POST
        /v1/conversation, with this client's token: the tenant's read token), as
        conversation_fetch answers over Ray: per key the verified object (a Chunk, or an
        Encoded in its codec) up to the first the edge does not hold, None from there (and
        for a frame that arrived corrupt)."""
        keys = [bytes(k) for k in keys]
        body = {"keys": keys, "ns": bytes(ns), "tenant": tenant, "fingerprint": fingerprint, "scope": scope}
        resp = self._request("POST", "/v1/conversation", msgpack.packb(body, use_bin_type=True),
                             "application/msgpack")
        if resp.status != 200:
            self._refuse(resp, "POST", "/v1/conversation")
        made = []
        buf, (objs, corrupt) = self._receive(
            resp, lambda mv: made.append(_PeerFrames(self.url, mv, keys)) or made[0])
        self.counters["bytes"] += buf.nbytes
        self.counters["conversation_corrupt"] += corrupt
        return objs, buf.nbytes

    def peer_get(self, keys, region: str = None, drops=None, keep=None) -> tuple:
        """(objects, wire bytes): what this edge holds of keys, asked by another edge with the
        network's admin token (this client's token); never cascades.

        Per key, the verified object (a Chunk for a raw frame, else an Encoded: views of the
        receive buffer) or None where the edge lacks it or its frame arrived corrupt; all None
        when the edge applied less of the origin's drop log than `drops` (the asker's state).
        region: the asker's, for the form each chunk crosses the link in. keep(obj), when
        given, runs on each object as soon as its frame is verified, while the rest of the
        body arrives, and what it returns stands in the list for the object.
        """
        keys = [bytes(k) for k in keys]
        if any(len(k) != KEY_BYTES for k in keys):
            raise BadRequest(f"every key must be {KEY_BYTES} bytes")
        self.peer_corrupt_keys = []
        body = {"keys": keys}
        if region is not None:
            body["region"] = region
        if drops is not None:
            body["drops"] = drops
        t0 = time.perf_counter()
        resp = self._request("POST", "/v1/peer", msgpack.packb(body, use_bin_type=True),
                             "application/msgpack")
        self.counters["peer_wait_us"] += int((time.perf_counter() - t0) * 1e6)   # the peer's work
        if resp.status != 200:
            self._refuse(resp, "POST", "/v1/peer")
        if resp.getheader("X-KDN-Behind") == "1":
            resp.read()
            self.counters["peer_behind"] += 1
            return [None] * len(keys), 0
        made = []
        buf, (objs, corrupt) = self._receive(
            resp, lambda mv: made.append(_PeerFrames(self.url, mv, keys, keep)) or made[0])
        self.counters["bytes"] += buf.nbytes
        self.counters["peer_corrupt"] += corrupt
        self.peer_corrupt_keys = made[0].corrupt_keys     # the asker tells the peer (drop_corrupt)
        return objs, buf.nbytes

    def _receive(self, resp, frames_of) -> tuple:
        """(buffer, what the frames parser made): the whole body of resp received into one
        buffer (its exact Content-Length), each frame verified as soon as its last byte is in;
        frames_of(read-only view of the buffer) makes the parser (_Frames, _PeerFrames).

        The body is read RECV_STEP bytes at a time straight into the buffer (readinto: the
        socket's recv_into writes there); between reads, the frames completed so far are
        decoded and their checksums checked while the kernel goes on receiving the rest,
        so verifying overlaps the transfer and reads bytes still in the CPU's cache.
        """
        n = resp.length
        if n is None:
            resp.close()
            self.close()
            raise RemoteError(f"edge {self.url} answered a fetch without Content-Length")
        if n > self.max_response_bytes:
            self.close()
            raise RemoteError(f"edge {self.url} answers {n} bytes, over max_response_bytes "
                               f"{self.max_response_bytes}")
        if n == 0:
            resp.read()        # an empty body: read, so the connection takes the next request
        buf = self._receive_buffer(n)
        view = memoryview(buf)
        frames = frames_of(view.toreadonly())     # chunks are read-only views
        got = 0
        try:
            while got < n:
                r = resp.readinto(view[got:min(n, got + RECV_STEP)])
                if not r:
                    break
                got += r
                frames.take(got)
        except OSError as e:
            self.close()
            raise Unreachable(f"edge {self.url}: fetch body broken after {got} of {n} bytes: "
                               f"{e}") from None
        except KDNError:
            self.close()            # the rest of a bad body must not be read as the next answer
            raise
        if got != n:
            self.close()
            raise Unreachable(f"edge {self.url}: fetch body ended after {got} of {n} bytes")
        buf.flags.writeable = False
        return buf, frames.done()

    def _receive_buffer(self, n: int) -> np.ndarray:
        """A writable n-byte buffer: one this client received into before, if nothing (no
        chunk) views it any more and it holds n, else new memory (kdn.core.buffers).

        A fresh 64 MiB buffer costs its page faults on every fetch, about as long as the
        copy out of the socket itself. One is kept, unless the client was given buffers to
        share: while its answer's chunks live (an edge keeps a push's objects as views until
        it has put them into its node's store), the next answers land in new memory
        (measured: docs/figures.md, session 43).
        """
        if not self.reuse_buffer:
            return np.empty(max(n, 1), np.uint8)[:n]
        buf, reused = self._buffers.take(n)
        self.counters["buffers_reused" if reused else "buffers_new"] += 1
        return buf


class HTTPEdges:
    """The HTTP transport of a reader (kdn.client.reader.Reader): edges' HTTP servers in the
    order given (nearest first), answering the reader's part of the edge interface
    (kdn.core.interfaces.EdgeReads) as the Ray transport (kdn.client.view) does.

    A call goes to the first edge that answers; one that gets no answer (Unreachable) is
    failed over, one that answers with a fault of its own (RemoteError) or a refusal raises.
    Each thread has its own connections (a client is one connection). codec: how edges
    encode frames (None: raw; "auto": what pays on the link to `region`).
    """
    node_id = None              # a Ray node id (edges over HTTP send frames, never references)

    def __init__(self, urls, token: str = None, region: str = None, codec: str = None,
                 allow_remote: bool = False, timeout_s: float = 30.0):
        if not urls:
            raise BadRequest("the http transport needs at least one edge URL")
        self.urls, self.token, self.region, self.codec = list(urls), token, region, codec
        self.allow_remote, self.timeout_s = allow_remote, timeout_s
        self._local = threading.local()
        self.counters = collections.Counter()      # failovers

    def clients(self) -> list:
        """This thread's clients, one per URL (made on first use)."""
        if not hasattr(self._local, "clients"):
            self._local.clients = [EdgeHTTPClient(u, timeout_s=self.timeout_s, token=self.token,
                                                  allow_remote=self.allow_remote) for u in self.urls]
        return self._local.clients

    def close(self) -> None:
        for c in getattr(self._local, "clients", ()):
            c.close()

    def nearest(self, timeout: float = None, resolve_refs: bool = False) -> EdgeReads:
        """Each call answered by the first edge that answers: (reply, edge URL, [URLs that
        failed]); NoLiveEdge when none does. (timeout: each connection times out on its own.)"""
        return Stub(EdgeReads, self._first_answer, "the nearest edge")

    def at(self, url: str, timeout: float = None) -> EdgeReads:
        """One edge's answers (Unreachable when it gives none)."""
        client = next((c for c in self.clients() if c.url == url), None)
        if client is None:          # a peer an edge named as a chunk's source: not reachable here
            raise Unreachable(f"{url!r} is not one of this reader's edge URLs")
        return Stub(EdgeReads, functools.partial(self._answer, client), f"edge {url}")

    def follow(self, ring_version: int) -> None:
        """Edges over HTTP are named by URL, not placed by the ring: nothing to re-read."""

    def _first_answer(self, method, args, kw) -> tuple:
        failed, errors = [], []
        for c in self.clients():
            try:
                return self._answer(c, method, args, kw), c.url, failed
            except Unreachable as e:
                self.counters["failovers"] += 1
                failed.append(c.url)
                errors.append(str(e))
        raise NoLiveEdge("no edge answered " + method + ": " + "; ".join(errors))

    def _answer(self, client, method, args, kw):
        kw = dict(kw)
        kw.pop("token", None)       # each client carries this transport's token
        return getattr(self, "_" + method)(client, *args, **kw)

    @staticmethod
    def _list_manifests(client, tenant, fingerprint):
        return client.list_manifests(tenant, fingerprint)

    @staticmethod
    def _lookup(client, keys, ns):
        return client.lookup(keys, ns)

    def _fetch(self, client, keys, ns, region=None, resolve=False, node=None, accept=None,
               tenant=None, fingerprint=None) -> dict:
        return fetch_reply(client, keys, ns, region, self.codec, tenant, fingerprint)

    @staticmethod
    def _drop_corrupt(client, keys, ns) -> int:
        return 0                    # an edge's HTTP server takes no reports: it serves only
                                    # copies whose stored frame checks (kdn/edge/http.py)


def fetch_reply(client, keys, ns, region, codec, tenant=None, fingerprint=None) -> dict:
    """One HTTP fetch answer as the Ray transport's fetch reply (resolved): what a Reader
    takes from either transport. tenant and fingerprint name a namespace no manifest names."""
    claim = None if tenant is None and fingerprint is None else (tenant, fingerprint)
    p = client.fetch_page(keys, ns, region, codec, claim)
    return {"chunks": p.chunks, "sources": p.sources, "codecs": p.codecs, "wire": p.sizes,
            "exact": p.exact, "more": p.more, "edge": p.edge, "ring": p.ring, "move_s": p.body_s}


class _Frames:
    """The frames of one fetch body, decoded and verified as they complete."""

    def __init__(self, url: str, mv: memoryview, keys, ns: bytes):
        self.url, self.mv, self.keys, self.ns = url, mv, keys, ns
        self.chunks, self.used, self.exact, self.sizes = [], [], [], []
        self.off = 0                # where the next frame starts
        self.header = None          # (header, payload offset) of the frame at off, once read

    def take(self, got: int) -> None:
        """Decode every frame that ends within the first `got` bytes received."""
        while self.off < got:
            if self.header is None:
                need = header_bytes(self.mv[self.off:got])
                if need is None or self.off + need > got:
                    return          # its header is not all in yet
                self.header = read_header(self.mv[self.off:got])
            header, poff = self.header
            end = self.off + frame_size(header, poff)
            if end > len(self.mv):
                raise RemoteError(f"edge {self.url}: frame {len(self.chunks)} ends at byte {end}, "
                                   f"after the {len(self.mv)}-byte body")
            if end > got:
                return
            self.frame(self.mv[self.off:end], header)
            self.off, self.header = end, None

    def frame(self, mv, header) -> None:
        """One whole frame, its header read: decoded (its payload checksum verified too); one
        whose payload fails its checksum stands as a CorruptFrame (the reader reports it)."""
        try:
            chunk = decode(mv)
        except ChecksumMismatch as e:
            chunk = CorruptFrame(header["key"], header["ns"], str(e))
        i = len(self.chunks)
        if i >= len(self.keys) or chunk.key != self.keys[i] or chunk.ns != self.ns:
            raise RemoteError(f"edge {self.url} sent frame {i} for key {chunk.key.hex()}, "
                               f"not the key asked for")
        self.chunks.append(chunk)
        self.used.append(header["codec"])
        self.exact.append(header["codec"] not in LOSSY or header["nbytes"] == header["raw"])
        self.sizes.append(len(mv))

    def done(self) -> tuple:
        """(chunks, codecs, exact flags, frame sizes) once the whole body is in."""
        if self.off != len(self.mv):
            raise RemoteError(f"edge {self.url}: the body ends inside frame {len(self.chunks)} "
                               f"(byte {self.off} of {len(self.mv)})")
        return self.chunks, self.used, self.exact, self.sizes


class _PeerFrames(_Frames):
    """The frames of a peer answer (POST /v1/peer): one per key the edge holds, in the order
    asked, of any namespace (the asker checks each chunk's against its reader's). A raw frame
    becomes a Chunk, any other an Encoded kept in its codec (the asking edge stores or
    forwards it as sent), each verified; a corrupt one stands as None (fetched elsewhere)."""

    def __init__(self, url: str, mv: memoryview, keys, keep=None):
        super().__init__(url, mv, keys, None)
        self.index = {k: i for i, k in enumerate(keys)}
        self.out, self.keep, self.next, self.corrupt = [None] * len(keys), keep, 0, 0
        self.corrupt_keys = []      # (key, ns) of each frame that failed its checks

    def frame(self, mv, header) -> None:
        i = self.index.get(header["key"], -1)
        if i < self.next:
            raise RemoteError(f"edge {self.url} sent a frame for key {header['key'].hex()}, "
                               f"not asked for or out of order")
        self.next = i + 1
        try:
            if header["codec"] == "raw":
                obj = decode(mv)
            else:
                obj = Encoded.from_frame(mv)
                obj.check_frame()
        except FrameError:
            self.corrupt += 1
            self.corrupt_keys.append((header["key"], header["ns"]))
            return
        self.out[i] = obj if self.keep is None else self.keep(obj)

    def done(self) -> tuple:
        """(objects per key, corrupt frames) once the whole body is in."""
        if self.off != len(self.mv):
            raise RemoteError(f"edge {self.url}: the body ends inside a frame "
                               f"(byte {self.off} of {len(self.mv)})")
        return self.out, self.corrupt
