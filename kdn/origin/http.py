"""The origin's HTTP server: its stored frames, which an edge on another node pulls a push
from, and the bulk writes of clients on other nodes.

A push to an edge on another Ray node than the origin goes over the data plane
(kdn/origin/push.py): the origin's call over Ray (EdgeAPI.pull_chunks) names the keys and
this server's URL, and the edge receives the stored frames over TCP straight into one buffer,
each verified as its last byte arrives (kdn/edge/dataplane.py), at about a socket's pace where
Ray's object manager carries a third of it (`kdn bench transport --hosts`).

POST /v1/peer answers as an edge's does (kdn/edge/http.py), so the edge's own peer client
reads it: with the network's admin token only (401 without a token, 403 with another), a
msgpack map {"keys": [16-byte keys]} (at most MAX_KEYS keys), answered by the stored frame of
each key the store holds, in the order asked, as stored (a compressed store's frames stay
compressed); an absent chunk is left out (the edge gets it by pull-through). The frames are
streamed as they are read from the store, each read while the one before is sent; the edge
verifies every frame as it arrives (a corrupt one costs only its key there). A frame that
vanished or changed size after its size was announced ends the answer short: the edge then
takes the push over Ray.
POST /v1/chunks and POST /v1/objects take a client's bulk writes from another node (a
publisher's put_chunks, a cache layer's put_objects acknowledged here: kdn/client/ingest.py),
where Ray's object manager would carry a third of a socket's pace: with the admin token only,
a body of raw frames back to back, received and verified by kdn.core.serving.FrameWrites
(a bad frame refuses the whole body: 400 naming it, nothing stored; its bounds there), then
stored as the same call over Ray would (OriginNode.put_chunks / put_objects: durable before
the answer); the answer is that call's, in msgpack.
GET /health answers anyone. Anything malformed is a 400, every error JSON {"error",
"message", "status"}. The server binds 127.0.0.1 unless told the node's address ("node") or
another (host "node", kdn.core.dataplane.NODE_HOST, is resolved by the caller), and off
loopback only with an admin token.
"""
import asyncio
import collections
import functools
import json
import logging
import time

import msgpack
from aiohttp import web

from kdn.core.env import is_loopback
from kdn.core.errors import AccessDenied, BadRequest, KDNError
from kdn.core.serving import FrameWrites, Served, bearer as _bearer, bind
from kdn.core.keys import KEY_BYTES
from kdn.core.wire import FRAMES_TYPE, MSGPACK_TYPE

log = logging.getLogger(__name__)

MAX_KEYS = 4096               # keys one pull may name (a push batch is at most 64 MiB of chunks)
INGEST = ("chunks", "objects")    # POST /v1/<what>: put_chunks, put_objects
MAX_PULL_BYTES = MAX_KEYS * (KEY_BYTES + 2) + 64     # the largest body of a pull
KEEPALIVE_S = 75.0            # an idle keep-alive connection is closed after this


def _error(status: int, error: str, message: str) -> web.Response:
    return web.Response(status=status, content_type="application/json",
                        text=json.dumps({"error": error, "message": message, "status": status}))


def check_pull_keys(body) -> list:
    """The keys of a pull's msgpack body; BadRequest naming what is wrong."""
    if not isinstance(body, dict) or set(body) - {"keys", "region", "drops"}:
        raise BadRequest("the body must be a msgpack map {\"keys\": [16-byte keys]}")
    keys = body.get("keys")
    if not isinstance(keys, list) or not keys or len(keys) > MAX_KEYS:
        raise BadRequest(f"keys must be a list of 1 to {MAX_KEYS} keys")
    if not all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys):
        raise BadRequest(f"every key must be {KEY_BYTES} bytes")
    if len(set(keys)) != len(keys):
        raise BadRequest("a key is named twice")
    return keys


class OriginHTTP(Served):
    """The origin's HTTP server over `store` (kdn.origin.store.ChunkStore); start() binds,
    url tells where, stop() closes."""

    def __init__(self, store, tokens, host: str = "127.0.0.1", port: int = 0, ingest: dict = None):
        """ingest: what -> the origin's coroutine storing a list of Chunks (INGEST; None: no
        writes served)."""
        if not is_loopback(host) and tokens.admin is None:
            raise BadRequest(f"the origin will not serve its frames on {host}, off loopback, without an "
                             "admin token: anyone who reaches the address would read every chunk")
        self.store, self.tokens, self.host, self.port_wanted = store, tokens, host, int(port)
        self.ingest = dict(ingest or {})
        self.port, self._runner = None, None
        self.counters = collections.Counter()
        # POST /v1/chunks, /v1/objects; its buffers counted as ingest_buffers_reused, _new
        self.writes = FrameWrites(counters=self.counters, prefix="ingest_")
        self.app = web.Application(middlewares=[self._errors], client_max_size=MAX_PULL_BYTES)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_post("/v1/peer", self._peer)
        for what in self.ingest:
            self.app.router.add_post(f"/v1/{what}", functools.partial(self._write, what))

    async def start(self) -> str:
        if self._runner is None:
            sock = bind(self.host, self.port_wanted)
            self.port = sock.getsockname()[1]
            if not is_loopback(self.host):
                log.warning("KDN origin serves its frames on %s:%d, off loopback (admin token required)",
                            self.host, self.port)
            await self.serve(self.app, sock, KEEPALIVE_S)
        return self.url

    @web.middleware
    async def _errors(self, request, handler):
        try:
            resp = await handler(request)
        except AccessDenied as e:
            resp = _error(401 if _bearer(request) is None else 403, "access_denied", str(e))
        except BadRequest as e:
            resp = _error(400, "bad_request", str(e))
        except web.HTTPRequestEntityTooLarge as e:
            resp = _error(413, "body_too_large", e.text or f"a request body is at most {MAX_PULL_BYTES} bytes")
        except web.HTTPRequestTimeout as e:
            resp = _error(408, "body_timeout", e.text)
        except web.HTTPMethodNotAllowed:
            resp = _error(405, "method_not_allowed", f"{request.method} is not allowed on {request.path}")
        except web.HTTPNotFound:
            resp = _error(404, "not_found", f"no endpoint {request.method} {request.path:.200}; "
                                            "endpoints: GET /health, POST /v1/peer"
                                            + "".join(f", POST /v1/{w}" for w in self.ingest))
        except KDNError as e:           # the store's own fault (kdn.core.errors.StoreError): said, not hidden
            log.warning("origin: %s %s failed: %s", request.method, request.path, e)
            resp = _error(500, "store_error", str(e))
        self.counters[f"status_{resp.status}"] += 1
        return resp

    async def _health(self, request):
        return web.json_response({"role": "origin", "chunks": self.store.chunk_count})

    async def _write(self, what: str, request):
        """A client's chunks (what "chunks") or objects ("objects") as frames: stored, then the
        storing call's answer in msgpack."""
        self.tokens.check_admin(_bearer(request), f"POST /v1/{what}")
        async with self.writes.received(request, f"POST /v1/{what}") as (chunks, n, receive_s):
            t1 = time.perf_counter()
            answer = await self.ingest[what](chunks)
        # the write's time here: receiving and verifying its frames, then storing them (durable)
        self.counters[f"ingest_{what}_receive_us"] += int(receive_s * 1e6)
        self.counters[f"ingest_{what}_store_us"] += int((time.perf_counter() - t1) * 1e6)
        self.counters[f"ingest_{what}_calls"] += 1
        self.counters[f"ingest_{what}_frames"] += len(chunks)
        self.counters[f"ingest_{what}_bytes"] += n
        return web.Response(body=msgpack.packb(answer, use_bin_type=True), content_type=MSGPACK_TYPE)

    async def _peer(self, request):
        self.tokens.check_admin(_bearer(request), "POST /v1/peer")
        if request.content_length is not None and request.content_length > MAX_PULL_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_PULL_BYTES, actual_size=request.content_length)
        raw = await request.read()
        try:
            body = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_array_len=MAX_KEYS + 1,
                                   max_map_len=4, max_str_len=256, max_bin_len=1024, max_ext_len=0)
        except (ValueError, TypeError, msgpack.UnpackException) as e:
            raise BadRequest(f"the body is not valid msgpack: {type(e).__name__}") from None
        keys = check_pull_keys(body)
        sizes = await asyncio.to_thread(self.store.map, self.store.size_of, keys)    # 0: absent
        held = [(k, n) for k, n in zip(keys, sizes) if n]
        total = sum(n for _, n in held)
        resp = web.StreamResponse(status=200, headers={"X-KDN-Edge": "origin", "X-KDN-Behind": "0"})
        resp.content_type = FRAMES_TYPE
        resp.content_length = total
        await resp.prepare(request)
        reading = asyncio.ensure_future(asyncio.to_thread(self.store.read_frame, held[0][0])) if held else None
        try:
            for i, (key, n) in enumerate(held):
                frame = await reading
                reading = (asyncio.ensure_future(asyncio.to_thread(self.store.read_frame, held[i + 1][0]))
                           if i + 1 < len(held) else None)
                if frame is None or len(frame) != n:      # gone or rewritten since its size was read
                    self.counters["answers_cut_short"] += 1
                    resp.force_close()
                    log.warning("origin: chunk %s changed while it was sent; the pull is cut short", key.hex())
                    return resp
                await resp.write(frame)
                self.counters["frames_sent"] += 1
                self.counters["bytes_sent"] += n
        finally:
            if reading is not None:
                reading.cancel()
        await resp.write_eof()
        return resp
