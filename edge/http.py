"""An edge over HTTP: the same lookups and fetches as its Ray methods, for workers outside Ray.

The server is aiohttp on the edge actor's own event loop. Ray builds every async actor's
loop with uvloop when uvloop is installed (ray._private.async_compat.get_new_event_loop,
RAY_USE_UVLOOP on by default), so the server runs on uvloop with no policy tricks, and a
fetch is a plain `await edge.fetch(...)`: no thread hop, no second loop, no lock. The other
design — a uvloop loop in a thread of the actor, fetches handed over with
run_coroutine_threadsafe — was measured against it (64 MiB fetches of 2 MiB chunks, same
client) and gave nothing back: 2.4-3.5 GB/s against 2.5-3.3 GB/s, within the noise of a
shared 2-core machine, because the GIL serializes the two loops anyway and the bytes move in
the kernel. /health reports the loop class, so a deployment can see which loop it got.

A fetch answer is exactly kdn.chunk frames back to back, the longest prefix the edge holds.
The edge knows every chunk before it answers, so Content-Length is exact and the client can
receive the body into one preallocated buffer. Each frame goes out as its small header
bytes and a memoryview of the chunk's KV (encode_parts): uvloop sends what the socket takes
and keeps a reference to the rest, so payloads are never copied in user space. Where each
chunk came from travels in X-KDN-Sources (comma list: local, peer:<edge>, origin).

A fetch may ask for a codec (field "codec": a kdn.codecs name, or "auto": the lossless
codec that pays on the link from this edge to the request's region, raw when none does
or no region is named); frames say their codec and the client decodes them, checksums
verified as always. X-KDN-Codec names the codec used (a comma list when chunks differ).
An edge that stores chunks compressed (store_codec) sends a stored frame as it is when its
codec is the one wanted, with no re-encoding; a lossy stored frame always goes as it is.

Input is untrusted: bodies over max_body_bytes are refused before they are read (413),
requests over max_keys keys are refused (413), anything malformed is a 400; every error is
JSON {"error", "message"}; only a fault of the edge itself is a 500. The server binds
127.0.0.1 unless told otherwise, and says loudly when it is not.

Metrics (GET /metrics, Prometheus text format 0.0.4) are written by hand from this edge's
own counters: one edge, one registry, nothing shared between edges of one process.
"""
import asyncio
import json
import logging
import socket
import time

import msgpack
import xxhash
from aiohttp import web

from kdn.chunk import Chunk, Encoded, as_chunk, codecs, encode_parts
from kdn.codecs import LOSSLESS
from kdn.transfer import choose_codec
from kdn.env import is_loopback
from kdn.errors import AccessDenied, BadRequest, BadTokens, FrameError
from kdn.keys import KEY_BYTES, namespace_digest

log = logging.getLogger("kdn.edge.http")

MAX_BODY_BYTES = 1 << 20        # a lookup/fetch body: 16384 keys take ~300 KiB of msgpack
MAX_KEYS = 16384                # 4M tokens at 256 tokens per chunk
FRAMES_TYPE = "application/x-kdn-frames"
MSGPACK_TYPE = "application/msgpack"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)
ENDPOINTS = ("GET /health", "GET /v1/kbs", "POST /v1/lookup", "POST /v1/fetch", "GET /metrics")


BODY_TIMEOUT_S = 10.0        # longest wait for a request body once its headers arrived

class RequestError(Exception):
    """A client's mistake: answered with this status and a JSON message."""

    def __init__(self, status: int, error: str, message: str):
        super().__init__(message)
        self.status, self.error, self.message = status, error, message


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float):
        self.sum += seconds
        self.count += 1
        for i, b in enumerate(self.buckets):
            if seconds <= b:
                self.counts[i] += 1
                break

    def lines(self, name: str) -> list:
        out, acc = [], 0
        for b, n in zip(self.buckets, self.counts):
            acc += n
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.9g}",
                f"{name}_count {self.count}"]
        return out


def _label(value) -> str:
    """A Prometheus label value, escaped as the text format requires."""
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _json_default(value):
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _json(data, status: int = 200) -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        body=json.dumps(data, default=_json_default).encode())


def _bearer(request):
    """The token of an `Authorization: Bearer <token>` header (None without one)."""
    h = request.headers.get("Authorization", "")
    return h[7:].strip() if h[:7].lower() == "bearer " else None


def _error(status: int, error: str, message: str) -> web.Response:
    return _json({"error": error, "message": message, "status": status}, status)


class EdgeHTTP:
    """HTTP endpoints of one EdgeNode; start() binds, port tells where, stop() closes."""

    def __init__(self, edge, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = MAX_BODY_BYTES, max_keys: int = MAX_KEYS):
        self.edge = edge
        self.host, self.port_wanted = host, int(port)
        self.max_body_bytes, self.max_keys = int(max_body_bytes), int(max_keys)
        self.port = None
        self.loop_class = None
        self.requests = {}            # (endpoint, status) -> count
        self.bytes_sent = 0           # frame bytes written to fetch answers
        self.frames_sent = 0
        self.frames_by_codec = {}     # codec -> frames sent encoded with it
        self.aborted = 0              # fetch answers cut short (the client went away)
        self.fetch_latency = Histogram()
        self._runner = None
        self.app = web.Application(middlewares=[self._errors], client_max_size=self.max_body_bytes)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/v1/kbs", self._kbs)
        self.app.router.add_post("/v1/lookup", self._lookup)
        self.app.router.add_post("/v1/fetch", self._fetch)
        self.app.router.add_get("/metrics", self._metrics)

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> int:
        if self._runner is not None:
            return self.port
        family, kind, proto, _, addr = socket.getaddrinfo(
            self.host, self.port_wanted, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        if not is_loopback(self.host):
            log.warning("!!! KDN edge %s serves HTTP on %s:%d, NOT loopback: anyone who can reach "
                        "this address can read every tenant's KV it holds. Put it behind a "
                        "firewall or an authenticating proxy. !!!", self.edge.name, self.host,
                        self.port)
        self.loop_class = type(asyncio.get_running_loop()).__module__.split(".")[0]
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # --- errors and accounting ------------------------------------------------------------
    @web.middleware
    async def _errors(self, request, handler):
        route = request.match_info.route.resource
        endpoint = f"{request.method} {route.canonical}" if route is not None else "other"
        try:
            resp = await handler(request)
        except RequestError as e:
            resp = _error(e.status, e.error, e.message)
        except web.HTTPMethodNotAllowed as e:
            allowed = ", ".join(sorted(e.allowed_methods))
            resp = _error(405, "method_not_allowed",
                          f"{request.method} is not allowed on {request.path}; use {allowed}")
        except web.HTTPNotFound:
            resp = _error(404, "not_found", f"no endpoint {request.method} {request.path:.200}; "
                                            f"endpoints: {', '.join(ENDPOINTS)}")
        except web.HTTPRequestEntityTooLarge as e:
            resp = _error(413, "body_too_large",
                          f"request body is larger than the limit of {self.max_body_bytes} bytes: {e.text}")
        except web.HTTPException as e:
            if e.status < 400:
                raise
            resp = _error(e.status, e.reason.lower().replace(" ", "_"), e.text or e.reason)
        except AccessDenied as e:
            resp = _error(403, "forbidden", str(e))
        except (BadRequest, BadTokens) as e:
            resp = _error(400, "bad_request", str(e))
        except (ConnectionResetError, asyncio.CancelledError):
            self.aborted += 1
            raise
        except Exception as e:  # noqa: BLE001 - the edge's own fault: a 500 that says what
            log.exception("edge %s: %s %s failed", self.edge.name, request.method, request.path)
            resp = _error(500, "internal", f"edge {self.edge.name} failed: {type(e).__name__}: {e}")
        key = (endpoint, resp.status)
        self.requests[key] = self.requests.get(key, 0) + 1
        return resp

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
        return ns, keys

    # --- endpoints ------------------------------------------------------------------------
    async def _health(self, request):
        e = self.edge
        return _json({"ok": True, "edge": e.name, "region": e.region, "network": e.network,
                      "ring": e.members_version, "chunks": len(e.main) + len(e.hot),
                      "bytes": e.main.stats()["bytes"] + e.hot.stats()["bytes"],
                      "hot_copies": len(e.hot), "loop": self.loop_class,
                      "uptime_s": round(time.time() - e.started, 3),
                      "limits": {"max_body_bytes": self.max_body_bytes, "max_keys": self.max_keys}})

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
        body = await self._body(request, {"ns", "keys", "region", "codec"})
        ns, keys = self._keys(body)
        region = body.get("region")
        if region is not None and (not isinstance(region, str)
                                   or region not in self.edge.topology.regions):
            raise RequestError(400, "bad_region", f"field 'region' must name a region of the "
                                                  f"network ({', '.join(self.edge.topology.regions)}), "
                                                  f"got {region!r:.80}")
        codec = body.get("codec", "raw")
        if not isinstance(codec, str) or (codec != "auto" and codec not in codecs()):
            raise RequestError(400, "bad_codec", f"field 'codec' must be 'auto' or one of "
                                                 f"{', '.join(codecs())}, got {codec!r:.80}")
        t0 = time.perf_counter()
        for attempt in (1, 2):
            reply, parts, want = await self._frames_for(keys, ns, region, codec, _bearer(request))
            if len(parts) == len(reply["chunks"]) or attempt == 2:
                break
            # a corrupt stored copy was found and dropped: once more, from a replica or the origin
        asked = codec
        total = sum(len(prefix) + payload.nbytes for prefix, payload in parts)
        for w in want:
            self.frames_by_codec[w] = self.frames_by_codec.get(w, 0) + 1
        used = sorted(set(want))
        codec = used[0] if len(used) == 1 else ",".join(used) if used else asked
        resp = web.StreamResponse(status=200, headers={
            "X-KDN-Edge": self.edge.name, "X-KDN-Region": self.edge.region,
            "X-KDN-Chunks": str(len(parts)), "X-KDN-Ring": str(reply.get("ring", 0)),
            "X-KDN-Sources": ",".join(reply["sources"]), "X-KDN-Codec": codec})
        resp.content_type = FRAMES_TYPE
        resp.content_length = total
        await resp.prepare(request)
        for prefix, payload in parts:
            if prefix:
                await resp.write(prefix)
            await resp.write(payload)
        await resp.write_eof()
        self.bytes_sent += total
        self.frames_sent += len(parts)
        self.fetch_latency.observe(time.perf_counter() - t0)
        return resp

    async def _frames_for(self, keys, ns, region, asked, token) -> tuple:
        """(the edge's reply, [prefix, payload] per frame, codec per frame) for a fetch.

        Each chunk's form: a frame the edge stores compressed goes out as it is when that is
        the codec wanted, and always when it is lossy (expanding it would restore nothing).
        A stored frame that fails its checksum is dropped from the tiers and ends the frames.
        """
        reply = await self.edge.fetch(keys, ns, region, resolve=True, token=token)
        objs = reply["chunks"]
        want = [self._link_codec(o, region) if asked == "auto" else asked for o in objs]
        want = [o.codec if isinstance(o, Encoded) and (not o.exact or w == o.codec) else w
                for o, w in zip(objs, want)]
        if all(w == "raw" and isinstance(o, Chunk) for o, w in zip(objs, want)):
            parts = []
            for c in objs:
                if c._xxh is None and not c.kv.flags.writeable:
                    # The KV is immutable (a view of Ray's object store): hash it once, not per fetch.
                    object.__setattr__(c, "_xxh", xxhash.xxh3_64_intdigest(memoryview(c.kv).cast("B")))
                parts.append(encode_parts(c))
            return reply, parts, want

        def build():   # decoding and compressing are CPU work: off the event loop
            out = []
            for o, w in zip(objs, want):
                try:
                    if isinstance(o, Encoded) and o.codec == w:
                        o.verify()     # one hash pass: a corrupt stored frame never leaves
                        out.append([b"", memoryview(o.frame).cast("B")])
                    else:
                        out.append(encode_parts(as_chunk(o), w))
                except FrameError:
                    break
            return out
        parts = await asyncio.to_thread(build)
        if len(parts) < len(objs):
            bad = objs[len(parts)].key
            self.edge.main.discard(bad)
            self.edge.hot.discard(bad)
            self.edge.counters["corrupt_dropped"] += 1
            reply["sources"] = reply["sources"][:len(parts)]
        return reply, parts, want[:len(parts)]

    def _link_codec(self, obj, region) -> str:
        """The form (raw, or a lossless codec, or the stored one) that delivers one chunk to
        `region` soonest (kdn.codecs). A client that names no region is taken to be beside
        the edge: the stored form."""
        stored = obj.codec if isinstance(obj, Encoded) else "raw"
        if region is None:
            return stored
        raw = obj.raw if isinstance(obj, Encoded) else obj.nbytes
        bandwidth = self.edge.topology.bandwidth_gbps(self.edge.region, region)
        allowed = LOSSLESS + ((stored,) if stored != "raw" else ())
        try:
            return choose_codec(raw, bandwidth, same_node=False, dtype=obj.dtype, allowed=allowed,
                                stored=stored)
        except BadRequest:       # a codec with no speed profile: as stored
            return stored

    async def _metrics(self, request):
        return web.Response(text=self.exposition(), content_type="text/plain",
                            charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})

    def exposition(self) -> str:
        """This edge's metrics in the Prometheus text format."""
        e, c = self.edge, self.edge.counters
        main, hot = e.main.stats(), e.hot.stats()
        out = []

        def family(name, kind, help_, samples):
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                lab = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                out.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")

        family("kdn_edge_info", "gauge", "This edge: name and region.",
               [({"edge": e.name, "region": e.region, "loop": self.loop_class}, 1)])
        family("kdn_edge_hits_total", "counter", "Chunks served from this edge's own tiers.",
               [({"tier": "main"}, c.get("main_hits", 0)), ({"tier": "hot"}, c.get("hot_hits", 0))])
        family("kdn_edge_chunks_served_total", "counter", "Chunks served, by where they came from.",
               [({"source": s}, c.get("served_" + s, 0)) for s in ("local", "peer", "origin")])
        family("kdn_edge_bytes_served_total", "counter", "KV bytes served over any transport.",
               [({}, c.get("bytes_served", 0))])
        family("kdn_edge_fetches_total", "counter", "Fetch requests over any transport.",
               [({}, c.get("fetches", 0))])
        family("kdn_edge_hot_promoted_total", "counter", "Chunks copied into the hot tier.",
               [({}, c.get("hot_promoted", 0))])
        family("kdn_edge_hot_copies", "gauge", "Chunks held in the hot tier.", [({}, len(e.hot))])
        family("kdn_edge_chunks", "gauge", "Chunks held, by tier.",
               [({"tier": "main"}, main["items"]), ({"tier": "hot"}, hot["items"])])
        family("kdn_edge_bytes", "gauge", "KV bytes held, by tier.",
               [({"tier": "main"}, main["bytes"]), ({"tier": "hot"}, hot["bytes"])])
        family("kdn_edge_capacity_bytes", "gauge", "Byte capacity, by tier.",
               [({"tier": "main"}, main["capacity"]), ({"tier": "hot"}, hot["capacity"])])
        family("kdn_edge_evictions_total", "counter", "Chunks evicted, by tier.",
               [({"tier": "main"}, main["evictions"]), ({"tier": "hot"}, hot["evictions"])])
        family("kdn_edge_http_requests_total", "counter", "HTTP requests by endpoint and status.",
               [({"endpoint": ep, "code": code}, n) for (ep, code), n in sorted(self.requests.items())])
        family("kdn_edge_http_bytes_sent_total", "counter", "Frame bytes sent in HTTP fetch answers.",
               [({}, self.bytes_sent)])
        family("kdn_edge_http_frames_sent_total", "counter", "Frames sent in HTTP fetch answers.",
               [({}, self.frames_sent)])
        family("kdn_edge_http_frames_by_codec_total", "counter",
               "Frames sent in HTTP fetch answers, by codec.",
               [({"codec": k}, n) for k, n in sorted(self.frames_by_codec.items())])
        family("kdn_edge_http_fetch_aborted_total", "counter", "HTTP answers cut short by the client.",
               [({}, self.aborted)])
        out.append("# HELP kdn_edge_http_fetch_seconds HTTP fetch latency: edge fetch plus sending the body.")
        out.append("# TYPE kdn_edge_http_fetch_seconds histogram")
        out += self.fetch_latency.lines("kdn_edge_http_fetch_seconds")
        return "\n".join(out) + "\n"
