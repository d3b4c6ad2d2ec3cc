"""What every KDN HTTP server shares (an edge's, kdn/edge/http.py; the origin's,
kdn/origin/http.py): its listening socket, serving an aiohttp app on it, its base URL, the
caller's bearer token, and bulk writes received as bodies of raw frames (FrameWrites: the
origin's POST /v1/chunks and /v1/objects, an edge's POST /v1/objects)."""
import asyncio
import collections
import contextlib
import socket
import time

from aiohttp import web

from kdn.core.buffers import KeptBuffers
from kdn.core.chunk import decode, frame_size, read_header
from kdn.core.dtypes import OPAQUE
from kdn.core.errors import BadRequest, FrameError
from kdn.core.wire import FRAMES_TYPE

MAX_INGEST_BYTES = 512 << 20  # one write's body (a publisher's batch is 64 MiB, an object store's 256)
MAX_INGEST_FRAMES = 4096      # frames in one write (the nodes' MAX_CHUNKS_PER_CALL)
INGESTS_AT_ONCE = 2           # write bodies a server holds at once (each up to MAX_INGEST_BYTES); the rest wait
INGEST_READ_S = 30.0          # a write whose body sends nothing for this long is dropped
KEPT_BODY_BYTES = 512 << 20   # receive buffers a server keeps for its next writes, at most (two
                              # object stores' batches): new memory costs a page fault per 4 KiB
                              # as the body lands (37-87 ms of a 64 MiB write on a 2-core VM)
KEPT_BODIES = 8               # and at most this many of them
KEPT_BODY_MIN = 1 << 20       # a smaller body's buffer is not kept (its faults cost little)


class Served:
    """The serving half of a KDN HTTP server (a subclass sets host and port, and binds):
    serve() runs an app on a bound socket, stop() closes it, url tells where."""
    host, port, _runner = "127.0.0.1", None, None

    async def serve(self, app, sock: socket.socket, keepalive_s: float) -> None:
        """Serve app on sock; keepalive_s: a connection with no complete request for this
        long (slow headers, an idle keep-alive) is closed."""
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=keepalive_s)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return base_url(self.host, self.port)


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) (port 0: any free one), SO_REUSEADDR set; OSError as bind's."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def base_url(host: str, port: int) -> str:
    """http://host:port, an IPv6 host in brackets."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def bearer(request):
    """The token of a request's `Authorization: Bearer <token>` header (None without one)."""
    h = request.headers.get("Authorization", "")
    return h[7:].strip() if h[:7].lower() == "bearer " else None


def frames_of(buf, most: int, raw_objects: bool = False) -> list:
    """The chunks of a body of frames back to back (views of buf), each frame's header checked
    and its checksum verified; BadRequest naming the first that is not a whole, intact frame,
    or when there are more than `most`. raw_objects: every frame must be an opaque object
    stored raw, refused from its header before anything is decoded (an edge's writes: no
    compressed frame is inflated only to be refused)."""
    out, off, mv = [], 0, memoryview(buf)
    while off < len(mv):
        if len(out) == most:
            raise BadRequest(f"the body holds more than {most} frames: split it")
        try:
            header, start = read_header(mv[off:])
            end = off + frame_size(header, start)
            if end > len(mv):
                raise BadRequest(f"frame {len(out)} runs past the body's end ({end} > {len(mv)} bytes)")
            if raw_objects and (header["dtype"] != OPAQUE or header["codec"] != "raw"):
                raise BadRequest(f"frame {len(out)} is not an opaque object stored raw (dtype "
                                 f"{header['dtype']!r:.40}, codec {header['codec']!r:.40}): this "
                                 f"endpoint takes only those")
            out.append(decode(mv[off:end], verify=True))
        except FrameError as e:
            raise BadRequest(f"frame {len(out)} (at byte {off}) is not an intact frame: {e}") from None
        off = end
    return out


class FrameWrites:
    """A server's bulk writes: bodies of raw frames back to back (FRAMES_TYPE, a Content-Length
    of at most MAX_INGEST_BYTES, at most MAX_INGEST_FRAMES frames), each received into one
    buffer as it arrives, then every frame checked and its checksum verified (a bad one refuses
    the whole body: BadRequest naming it, nothing stored). At most INGESTS_AT_ONCE bodies are
    held at once (the rest wait) while they are received and stored; a body that sends
    nothing for INGEST_READ_S is dropped (408). The caller checks the token first and stores
    the chunks inside `received`. A store that keeps views of the chunks (an edge keeps the
    objects it acknowledged as they arrived until it has copied them into its node's object
    store, or into memory of its own where that store refuses them, kdn/edge/stores.py) keeps
    the body's memory past its slot, bounded there by what that store may keep. raw_objects: frames_of's.

    A body lands in a buffer kept from the writes before once no chunk of theirs is viewed any
    more (_buffer; within KEPT_BODIES and KEPT_BODY_BYTES), so the bytes of a stream of writes do not
    fault in new memory page by page."""

    def __init__(self, raw_objects: bool = False, counters=None, prefix: str = "write_"):
        self._slots = None          # made in the server's loop, on first use
        self.raw_objects = raw_objects
        self._kept = None           # bodies' buffers, reused once nothing views them (_buffer)
        # the server's counters: <prefix>buffers_reused, <prefix>buffers_new
        self.counters = collections.Counter() if counters is None else counters
        self.prefix = prefix

    def _buffer(self, n: int):
        """A writable n-byte buffer for a body: a kept one that nothing views any more and that
        n fills at least half of, else new memory, kept for the next writes (from
        KEPT_BODY_MIN bytes up, within KEPT_BODIES and KEPT_BODY_BYTES: kdn.core.buffers).
        Only the server's loop calls this, so two bodies never get the same buffer."""
        if self._kept is None:
            self._kept = KeptBuffers(KEPT_BODIES, KEPT_BODY_BYTES, KEPT_BODY_MIN, fill=0.5)
        buf, reused = self._kept.take(n)
        self.counters[self.prefix + ("buffers_reused" if reused else "buffers_new")] += 1
        return buf

    @contextlib.asynccontextmanager
    async def received(self, request, what: str):
        """(chunks, body bytes, seconds spent receiving and verifying them) of request, a write
        to what ("POST /v1/objects"), while its slot is held."""
        if request.content_type != FRAMES_TYPE:
            raise BadRequest(f"{what} takes {FRAMES_TYPE}, got {request.content_type!r:.80}")
        n = request.content_length
        if n is None:
            raise BadRequest(f"{what} needs a Content-Length")
        if n > MAX_INGEST_BYTES:
            raise web.HTTPRequestEntityTooLarge(max_size=MAX_INGEST_BYTES, actual_size=n,
                                                text=f"{what} takes at most {MAX_INGEST_BYTES} bytes, "
                                                     f"got {n}: split it")
        if self._slots is None:
            self._slots = asyncio.Semaphore(INGESTS_AT_ONCE)
        async with self._slots:
            buf, got, t0 = memoryview(self._buffer(n)), 0, time.perf_counter()
            while got < n:                                   # as it arrives, into one buffer
                try:
                    piece = await asyncio.wait_for(request.content.readany(), INGEST_READ_S)
                except asyncio.TimeoutError:
                    raise web.HTTPRequestTimeout(text=f"{what}: the body sent nothing for "
                                                      f"{INGEST_READ_S:.0f} s") from None
                if not piece:
                    raise BadRequest(f"the body ended after {got} of its {n} bytes")
                if got + len(piece) > n:
                    raise BadRequest(f"the body runs past its Content-Length of {n} bytes")
                buf[got:got + len(piece)] = piece
                got += len(piece)
            chunks = await asyncio.to_thread(frames_of, buf.toreadonly(), MAX_INGEST_FRAMES,
                                             self.raw_objects)
            del buf                     # the chunks' views alone keep the buffer from reuse
            yield chunks, n, time.perf_counter() - t0
