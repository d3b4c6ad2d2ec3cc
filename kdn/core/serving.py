"""What every KDN HTTP server shares (an edge's, kdn/edge/http.py; the origin's,
kdn/origin/http.py): its listening socket, serving an aiohttp app on it, its base URL and the
caller's bearer token."""
import socket

from aiohttp import web


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
