"""An edge over HTTP: the same lookups and fetches as its Ray methods, for workers outside Ray.

The server is aiohttp on the edge actor's own event loop. Ray builds every async actor's
loop with uvloop when uvloop is installed (ray._private.async_compat.get_new_event_loop,
RAY_USE_UVLOOP on by default), so the server runs on uvloop with no policy tricks, and a
fetch is a plain await of the edge's own read (kdn/edge/reads.py, the one the Ray path uses):
no thread hop, no second loop, no lock. A uvloop loop in a thread of the actor was measured
against it (64 MiB fetches of 2 MiB chunks) and gave nothing back: 2.4-3.5 GB/s against
2.5-3.3 GB/s, within the noise of a shared 2-core machine, because the GIL serializes the
two loops anyway and the bytes move in the kernel. /health reports the loop class.

A fetch answer is exactly kdn.core.chunk frames back to back (kdn/core/wire.py), the longest prefix
the edge holds, at most max_reply_bytes (X-KDN-More: 1 when the edge stopped there: ask
again for the keys after those received). The edge knows every frame before it answers, so
Content-Length is exact and the client receives the body into one preallocated buffer.
A raw frame goes out as its small header bytes and a memoryview of the chunk's KV: uvloop
sends what the socket takes and keeps a reference to the rest, so payloads are never copied
in user space. A fetch may ask for a codec (a kdn.core.codecs name, or "auto": what pays on the
link to the request's region; kdn/edge/forms.py chooses, as for Ray); X-KDN-Codec names the
codecs used. Encoding is CPU work: it runs in threads, ENCODERS at a time, so concurrent
requests cannot make the edge hold more than a few replies' worth of encoded frames.

Other edges pull over POST /v1/peer (kdn/edge/dataplane.py: the data plane between nodes):
with the network's admin token only, it answers peer_get as frames, one per key this edge
holds in the order asked (never pulling through), each in the form chosen for the link to
the asker's region, or X-KDN-Behind: 1 with no frames when the asker applied more of the
origin's drop log than this edge.

A writer on another node (LMCache's or SGLang's server storing at this region's edge,
`ack` "edge": kdn.integrations.objects) stores objects over POST /v1/objects: with the
network's admin token only, a body of raw frames (kdn.core.serving.FrameWrites: every frame
verified, a bad one refuses the whole body), kept exactly as put_objects over Ray keeps them
(kdn/edge/stores.py), its answer in msgpack.

A worker on another node reads the history of a conversation homed here over POST
/v1/conversation (kdn/client/history.py): with the tenant's read token (or the admin's), the
held prefix of its keys as frames, each as held, exactly as conversation_fetch answers over Ray.

Input is untrusted: bodies over max_body_bytes are refused before they are read (413), so
are requests over max_keys keys (413); a repeated key, bad gzip, a transfer coding other than
chunked, anything malformed is a 400; every error is JSON {"error", "message"}; only a fault
of the edge itself is a 500. With read tokens on (kdn.core.auth: a tenant is read with its token
unless the operator left it open), a read sent without a token is 401 and one with a wrong
token 403, each with the same message whether the namespace is locked or unknown. A connection that sends no complete request within idle_s
(slow headers, an idle keep-alive socket) is closed. The server binds 127.0.0.1 unless told
otherwise, and says loudly when it is not; given a port, it takes the same one again when
the edge restarts (an HTTP client pinned to the URL finds it there).
"""
import asyncio
import collections
import errno
import json
import logging
import os
import socket
import time

import msgpack
from aiohttp import http_exceptions, web


from kdn.core.chunk import codecs
from kdn.edge.metrics import EdgeMetrics
from kdn.core.wire import FRAMES_TYPE, MAX_SOURCE_RUNS, METRICS_TYPE, MSGPACK_TYPE, ORIGIN_UNREACHABLE, pack_sources
from kdn.core.env import is_loopback
from kdn.core.serving import FrameWrites, Served, bearer as _bearer, bind as _bind
from kdn.core.errors import AccessDenied, BadRequest, BadTokens, NetworkError
from kdn.core.keys import KEY_BYTES, MAX_FETCH_KEYS, namespace_digest
from kdn.edge.reads import check_keys
from kdn.edge.tiers import resolve_all

log = logging.getLogger("kdn.edge.http")

MAX_BODY_BYTES = 1 << 20        # a lookup/fetch body: 16384 keys take ~300 KiB of msgpack
BODY_TIMEOUT_S = 10.0           # longest wait for a request body once its headers arrived
IDLE_S = 15.0                   # a connection without a complete request for this long is closed
BIND_RETRY_S = 10.0             # a restarted edge waits this long for its old port to be free
ENCODERS = 2                    # fetch answers encoded at once (each holds its frames in memory)
FRAME_OVERHEAD = 256            # a frame's bytes beyond its payload, about (its header)
ENDPOINTS = ("GET /health", "GET /v1/kbs", "POST /v1/lookup", "POST /v1/fetch", "POST /v1/peer",
             "POST /v1/conversation", "POST /v1/objects", "GET /metrics")


class RequestError(Exception):
    """A client's mistake: answered with this status and a JSON message."""

    def __init__(self, status: int, error: str, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.error, self.message, self.close = status, error, message, close


def _json_default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _json(data, status: int = 200) -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        body=json.dumps(data, default=_json_default).encode())


def _error(status: int, error: str, message: str) -> web.Response:
    return _json({"error": error, "message": message, "status": status}, status)


class EdgeHTTP(Served):
    """HTTP endpoints of one EdgeNode; start() binds, port tells where, stop() closes."""

    def __init__(self, edge, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = MAX_BODY_BYTES, max_keys: int = MAX_FETCH_KEYS, idle_s: float = None):
        self.edge = edge
        self.host, self.port_wanted = host, int(port)
        self.max_body_bytes, self.max_keys = int(max_body_bytes), int(max_keys)
        self.idle_s = IDLE_S if idle_s is None else float(idle_s)
        self.port = None
        self.loop_class = None
        self.counters = collections.Counter()    # bytes_sent, frames_sent, frames_<codec>, aborted
        self.requests = collections.Counter()    # (endpoint, status) -> requests
        self.metrics = EdgeMetrics(edge, self)
        self._encoders = None
        self._runner = None
        # POST /v1/objects; its buffers counted beside the stores' (store_http_buffers_*)
        self.writes = FrameWrites(raw_objects=True, counters=edge.stores.counters, prefix="store_http_")
        self.app = web.Application(middlewares=[self._errors], client_max_size=self.max_body_bytes)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/kbs", self._kbs)
        self.app.router.add_post("/v1/lookup", self._lookup)
        self.app.router.add_post("/v1/fetch", self._fetch)
        self.app.router.add_post("/v1/peer", self._peer)
        self.app.router.add_post("/v1/conversation", self._conversation)
        self.app.router.add_post("/v1/objects", self._objects)
        self.app.router.add_get("/metrics", self._metrics)

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> int:
        if self._runner is not None:
            return self.port
        sock = await self._bind()
        self.port = sock.getsockname()[1]
        if not is_loopback(self.host):
            log.warning("!!! KDN edge %s serves HTTP on %s:%d, NOT loopback: anyone who can reach "
                        "this address can read every tenant's KV it holds. Put it behind a "
                        "firewall or an authenticating proxy. !!!", self.edge.name, self.host,
                        self.port)
        self.loop_class = type(asyncio.get_running_loop()).__module__.split(".")[0]
        self._encoders = asyncio.Semaphore(ENCODERS)
        # a socket with no complete request within idle_s (slow headers, idle keep-alive) is closed
        await self.serve(self.app, sock, self.idle_s)
        return self.port

    async def _bind(self) -> socket.socket:
        """The listening socket; a given port that is still taken (the process this edge
        restarted from is letting it go) is tried again for BIND_RETRY_S."""
        deadline = time.monotonic() + BIND_RETRY_S
        while True:
            try:
                return _bind(self.host, self.port_wanted)
            except OSError as e:
                if e.errno != errno.EADDRINUSE or not self.port_wanted or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.25)

    # --- errors and accounting ------------------------------------------------------------
    @web.middleware
    async def _errors(self, request, handler):
        route = request.match_info.route.resource
        endpoint = f"{request.method} {route.canonical}" if route is not None else "other"
        try:
            self._check_transfer_coding(request)
            resp = await handler(request)
        except RequestError as e:
            resp = _error(e.status, e.error, e.message)
            if e.close:
                resp.force_close()
        except web.HTTPMethodNotAllowed as e:
            allowed = ", ".join(sorted(e.allowed_methods))
            resp = _error(405, "method_not_allowed",
                          f"{request.method} is not allowed on {request.path}; use {allowed}")
        except web.HTTPNotFound:
            resp = _error(404, "not_found", f"no endpoint {request.method} {request.path:.200}; "
                                            f"endpoints: {', '.join(ENDPOINTS)}")
        except web.HTTPRequestEntityTooLarge as e:    # a write's bound says itself (FrameWrites)
            resp = _error(413, "body_too_large", e.text if request.path == "/v1/objects" else
                          f"request body is larger than the limit of {self.max_body_bytes} bytes: {e.text}")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = _error(e.status, e.reason.lower().replace(" ", "_"), e.text or e.reason)
        except AccessDenied as e:     # no token at all is 401; a wrong one 403 (either way
            if _bearer(request):      # the same words for a locked and an unknown namespace)
                resp = _error(403, "forbidden", str(e))
            else:
                resp = _error(401, "unauthorized", f"no read token sent (Authorization: Bearer "
                                                   f"<token>): {e}")
                resp.headers["WWW-Authenticate"] = "Bearer"
        except (BadRequest, BadTokens) as e:
            resp = _error(400, "bad_request", str(e))
        except (ConnectionResetError, asyncio.CancelledError):
            self.counters["aborted"] += 1
            raise
        except Exception as e:  # noqa: BLE001 - the edge's own fault: a 500 that says what
            log.exception("edge %s: %s %s failed", self.edge.name, request.method, request.path)
            resp = _error(500, "internal", f"edge {self.edge.name} failed: {type(e).__name__}")
        self.requests[(endpoint, resp.status)] += 1
        return resp

    @staticmethod
    def _check_transfer_coding(request) -> None:
        """Only chunked is a transfer coding here: anything else (gzip, chunked) is refused
        before the body is read, rather than guessed at."""
        te = request.headers.get("Transfer-Encoding")
        if te is not None and [c.strip().lower() for c in te.split(",")] != ["chunked"]:
            raise RequestError(400, "bad_transfer_encoding", f"Transfer-Encoding {te[:80]!r} is not "
                               f"supported: send Content-Length, or Transfer-Encoding: chunked")

    # --- request bodies -------------------------------------------------------------------
    async def _body(self, request, allowed: set) -> dict:
        declared = request.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise RequestError(413, "body_too_large", f"request body of {declared} bytes is over the "
                                                      f"limit of {self.max_body_bytes} bytes")
        try:   # a body that trickles in (slowloris) is cut off, not waited for forever
            raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RequestError(408, "body_timeout", f"the request body did not arrive within "
                                                    f"{BODY_TIMEOUT_S:.0f} s") from None
        except (web.RequestPayloadError, http_exceptions.HttpProcessingError) as e:
            # bad gzip or a broken chunk: nothing more of this body can be read (not even to
            # drain it), so the answer closes the connection
            request.content.feed_eof()
            raise RequestError(400, "bad_body", f"request body cannot be read: "
                                                f"{' '.join(str(e).split())[:200]}", close=True) from None
        if not raw:
            raise RequestError(400, "bad_request", "request body is empty; send a msgpack map "
                                                   "{\"ns\": 16 bytes, \"keys\": [16-byte keys]}")
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=True,
                                   max_array_len=self.max_keys + 1, max_map_len=16,
                                   max_str_len=1024, max_bin_len=1024, max_ext_len=0)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise RequestError(400, "bad_msgpack", f"request body is not valid msgpack: "
                                                   f"{type(e).__name__}: {e}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "bad_request", f"request body must be a msgpack map, "
                                                   f"got {type(body).__name__}")
        unknown = sorted(str(k) for k in body if k not in allowed)
        if unknown:
            raise RequestError(400, "bad_request", f"unknown field(s) {', '.join(unknown)}; "
                                                   f"allowed: {', '.join(sorted(allowed))}")
        return body

    def _keys(self, body) -> tuple:
        ns = body.get("ns")
        if not isinstance(ns, bytes) or len(ns) != KEY_BYTES:
            shown = f"{len(ns)} bytes" if isinstance(ns, bytes) else type(ns).__name__
            raise RequestError(400, "bad_request", f"field 'ns' must be {KEY_BYTES} bytes "
                                                   f"(msgpack bin), got {shown}")
        return ns, self._key_list(body)

    def _key_list(self, body) -> list:
        keys = body.get("keys")
        if not isinstance(keys, list):
            raise RequestError(400, "bad_request", f"field 'keys' must be a list of {KEY_BYTES}-byte "
                                                   f"keys, got {type(keys).__name__}")
        if len(keys) > self.max_keys:
            raise RequestError(413, "too_many_keys", f"{len(keys)} keys in one request; the limit "
                                                     f"is {self.max_keys}")
        for i, k in enumerate(keys):
            if not isinstance(k, bytes) or len(k) != KEY_BYTES:
                shown = f"{len(k)} bytes" if isinstance(k, bytes) else type(k).__name__
                raise RequestError(400, "bad_key", f"keys[{i}] must be {KEY_BYTES} bytes "
                                                   f"(msgpack bin), got {shown}")
        return keys

    def _region(self, body):
        region = body.get("region")
        regions = self.edge.members.topology.regions
        if region is not None and (not isinstance(region, str) or region not in regions):
            raise RequestError(400, "bad_region", f"field 'region' must name a region of the "
                                                  f"network ({', '.join(regions)}), got {region!r:.80}")
        return region

    @staticmethod
    def _claim(body) -> tuple:
        """(tenant, fingerprint) that ns digests, for objects no manifest names
        (kdn.integrations.objects; kdn/edge/catalog.py checks it), or (None, None)."""
        claim = body.get("tenant"), body.get("fingerprint")
        if claim != (None, None) and not all(isinstance(v, str) and 0 < len(v) <= 256 for v in claim):
            raise RequestError(400, "bad_claim", "fields 'tenant' and 'fingerprint' go together, "
                                                 "each a string of 1 to 256 characters")
        return claim

    @staticmethod
    def _codec(body) -> str:
        codec = body.get("codec", "raw")
        if not isinstance(codec, str) or (codec != "auto" and codec not in codecs()):
            raise RequestError(400, "bad_codec", f"field 'codec' must be 'auto' or one of "
                                                 f"{', '.join(codecs())}, got {codec!r:.80}")
        return codec

    # --- endpoints ------------------------------------------------------------------------
    async def _health(self, request):
        e = self.edge
        main, hot = e.tiers.main.stats(), e.tiers.hot.stats()
        return _json({"ok": True, "edge": e.name, "region": e.region, "network": e.network,
                      "ring": e.members.version, "chunks": main["items"] + hot["items"],
                      "bytes": main["bytes"] + hot["bytes"], "hot_copies": hot["items"],
                      "loop": self.loop_class, "pid": os.getpid(),
                      "uptime_s": round(time.time() - e.started, 3),
                      "limits": {"max_body_bytes": self.max_body_bytes, "max_keys": self.max_keys,
                                 "max_reply_bytes": e.reads.max_reply_bytes, "idle_s": self.idle_s}})

    async def _kbs(self, request):
        tenant, fingerprint = request.query.get("tenant"), request.query.get("fingerprint")
        if not tenant or not fingerprint:
            raise RequestError(400, "bad_request", "GET /v1/kbs needs query parameters tenant "
                                                   "and fingerprint")
        if len(tenant) > 1024 or len(fingerprint) > 1024:
            raise RequestError(400, "bad_request", "tenant and fingerprint are at most 1024 "
                                                   "characters each")
        ns = namespace_digest(tenant, fingerprint)        # BadRequest (400) for a bad name
        manifests = await self.edge.list_manifests(tenant, fingerprint, token=_bearer(request))
        return _json({"tenant": tenant, "fingerprint": fingerprint, "ns": ns.hex(),
                      "manifests": manifests})

    async def _lookup(self, request):
        ns, keys = self._keys(await self._body(request, {"ns", "keys"}))
        got = await self.edge.lookup(keys, ns, token=_bearer(request))
        return _json({"chunks": got["chunks"], "local": got.get("local"), "keys": len(keys),
                      "edge": self.edge.name})

    async def _fetch(self, request):
        body = await self._body(request, {"ns", "keys", "region", "codec", "tenant", "fingerprint"})
        ns, keys = self._keys(body)
        region, asked, claim = self._region(body), self._codec(body), self._claim(body)
        t0 = time.perf_counter()
        got = await self.edge.reads.fetch(keys, ns, region, _bearer(request),
                                          lambda helds, sources: self._frames(helds, sources, region, asked),
                                          claim=claim)
        parts = [p for frame, _ in got["out"] for p in frame]
        used = [codec for _, codec in got["out"]]
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        resp = web.StreamResponse(status=200, headers={
            "X-KDN-Edge": self.edge.name, "X-KDN-Region": self.edge.region,
            "X-KDN-Chunks": str(len(used)), "X-KDN-Ring": str(self.edge.members.version),
            "X-KDN-Sources": pack_sources(got["sources"]), "X-KDN-More": str(int(got["more"])),
            "X-KDN-Codec": ",".join(sorted(set(used))) or asked})
        resp.content_type = FRAMES_TYPE
        resp.content_length = total
        await resp.prepare(request)
        self.counters["bytes_sent"] += total            # committed (an abort is counted apart)
        self.counters["frames_sent"] += len(used)
        self.counters.update("frames_" + c for c in used)
        for p in parts:
            if len(p):
                await resp.write(p)
        await resp.write_eof()
        self.metrics.fetch_seconds.observe(time.perf_counter() - t0)
        return resp

    async def _peer(self, request):
        """Another edge's pull (the data plane, kdn/edge/dataplane.py): peer_get's answer as
        frames, one per key held, in the order asked, each in the form peer_get chose for the
        link to the asker's region; X-KDN-Behind: 1 (and no frames) when this edge applied
        less of the drop log than the asker. Only with the network's admin token."""
        self.edge.tokens.check_admin(_bearer(request), "POST /v1/peer")
        body = await self._body(request, {"keys", "region", "drops"})
        keys, region = check_keys(self._key_list(body)), self._region(body)
        held = await self.edge.peer_held(keys, region, body.get("drops"), token=_bearer(request))
        parts = [] if held is None else await self._peer_frames([h for h in held if h is not None])
        return await self._send_frames(request, parts, "peer_bytes_sent", {
            "X-KDN-Edge": self.edge.name, "X-KDN-Behind": str(int(held is None)),
            "X-KDN-Ring": str(self.edge.members.version)})

    async def _send_frames(self, request, parts, counter: str, headers: dict):
        """An answer of frame parts (bytes and views, sent as they are), its length exact;
        its bytes counted under counter."""
        total = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        resp = web.StreamResponse(status=200, headers=headers)
        resp.content_type = FRAMES_TYPE
        resp.content_length = total
        await resp.prepare(request)
        self.counters[counter] += total
        for p in parts:
            if len(p):
                await resp.write(p)
        await resp.write_eof()
        return resp

    async def _conversation(self, request):
        """A worker's read of a conversation homed here from another node (kdn/client/history.py):
        conversation_fetch's held prefix of its keys as frames, in order, each as held; with
        the tenant's read token (or the admin's), as over Ray. A copy failing its checks ends
        the answer (the worker recomputes from there)."""
        body = await self._body(request, {"keys", "ns", "tenant", "fingerprint", "scope"})
        ns, keys = self._keys(body)
        tenant, fingerprint = self._claim(body)
        scope = body.get("scope")
        if tenant is None or not isinstance(scope, str) or not 0 < len(scope) <= 1024:
            raise RequestError(400, "bad_claim", "fields 'tenant', 'fingerprint' and 'scope' name the "
                                                 "conversation: strings, each of 1 to 256 characters "
                                                 "(scope up to 1024)")
        helds = await self.edge.conversation_prefix(check_keys(keys), ns, tenant, fingerprint, scope,
                                                    token=_bearer(request))
        forms, objs = self.edge.forms, await resolve_all(helds)
        want = [o.codec for o in objs]
        if forms.nothing_to_compute(objs, want):
            got, bad = forms.frames(objs, want)
        else:
            async with self._encoders:
                got, bad = await asyncio.to_thread(forms.frames, objs, want)
        if bad is not None:
            self.counters["conversation_corrupt_ended"] += 1
        return await self._send_frames(request, [p for frame in got for p in frame], "conversation_bytes_sent",
                                       {"X-KDN-Edge": self.edge.name})

    async def _objects(self, request):
        """A writer's objects from another node, as frames: kept as put_objects over Ray keeps
        them, its answer in msgpack. Only with the network's admin token, checked before the
        body is read."""
        token = _bearer(request)
        self.edge.tokens.check_admin(token, "POST /v1/objects")
        async with self.writes.received(request, "POST /v1/objects") as (chunks, n, receive_s):
            t1 = time.perf_counter()
            try:
                answer = await self.edge.put_objects(chunks, token=token)
            except NetworkError as e:    # some had to wait for the origin, which did not answer:
                raise RequestError(503, ORIGIN_UNREACHABLE, str(e)) from None   # the writer's NetworkError
        counted = self.edge.stores.counters     # beside the stores' own (kdn/edge/stores.py)
        counted["store_http_writes"] += 1
        counted["store_http_objects"] += len(chunks)
        counted["store_http_bytes"] += n
        counted["store_http_receive_us"] += int(receive_s * 1e6)
        counted["store_http_keep_us"] += int((time.perf_counter() - t1) * 1e6)
        return web.Response(body=msgpack.packb(answer, use_bin_type=True), content_type=MSGPACK_TYPE)

    async def _peer_frames(self, helds) -> list:
        """The frame parts of helds, each in its own form; a copy failing its checks is left
        out and dropped here (counted: peer_corrupt_skipped): the asker gets it elsewhere."""
        forms = self.edge.forms
        objs = await resolve_all(helds)
        want = [o.codec for o in objs]
        corrupt = []

        def frame_all():
            parts, i = [], 0
            while i < len(objs):
                got, bad = forms.frames(objs[i:], want[i:])
                parts += [p for frame in got for p in frame]
                if bad is None:
                    break
                corrupt.append(objs[i + bad].key)
                i += bad + 1
            return parts
        if forms.nothing_to_compute(objs, want):
            parts = frame_all()
        else:
            async with self._encoders:
                parts = await asyncio.to_thread(frame_all)
        if corrupt:
            self.edge.counters["peer_corrupt_skipped"] += len(corrupt)
            await self.edge.tiers.drop(corrupt)
        return parts

    async def _frames(self, helds, sources, region, asked) -> tuple:
        """The `shape` of an HTTP fetch (kdn/edge/reads.py): [(frame parts, codec)] per chunk.

        The answer stops where its frames could pass max_reply_bytes or its sources header
        MAX_SOURCE_RUNS runs (the reader asks again); a stored frame that fails its checks
        ends it as corrupt."""
        forms = self.edge.forms
        objs = await resolve_all(helds)
        want = forms.frame_codecs(objs, region, asked)
        n = self._fitting(objs, sources)
        if forms.nothing_to_compute(objs[:n], want[:n]):   # views, known hashes: on the loop
            parts, bad = forms.frames(objs[:n], want[:n])
        else:
            async with self._encoders:
                parts, bad = await asyncio.to_thread(forms.frames, objs[:n], want[:n])
        if bad is not None:
            return list(zip(parts, want)), len(parts), True
        out = self._within_bytes(list(zip(parts, want)))
        return out, len(out), False

    def _within_bytes(self, frames) -> list:
        """The leading frames whose bytes stay within max_reply_bytes (at least one)."""
        total = 0
        for i, (parts, _) in enumerate(frames):
            total += sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
            if i and total > self.edge.reads.max_reply_bytes:
                return frames[:i]
        return frames

    def _fitting(self, objs, sources) -> int:
        """How many chunks one answer takes, estimated before any is encoded: at least one;
        frames about within max_reply_bytes and sources within MAX_SOURCE_RUNS runs."""
        limit, total, runs = self.edge.reads.max_reply_bytes, 0, 0
        for i, o in enumerate(objs):
            total += max(o.raw, o.nbytes) + FRAME_OVERHEAD
            runs += i == 0 or sources[i] != sources[i - 1]
            if i and (total > limit or runs > MAX_SOURCE_RUNS):
                return i
        return len(objs)

    async def _metrics(self, request):
        return web.Response(body=self.metrics.exposition(), headers={"Content-Type": METRICS_TYPE})

    def exposition(self) -> str:
        """This edge's metrics in the Prometheus text format."""
        return self.metrics.exposition().decode()
