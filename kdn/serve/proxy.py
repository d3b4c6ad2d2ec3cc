"""What Ray Serve's HTTP proxy lets through to `kdn serve`'s router: bodies bounded in the proxy.

Serve's proxy (Ray 2.60) reads a request's body off the socket as fast as it arrives, into
an unbounded queue, until the response is complete; the router (kdn/serve/app.py) reads that
queue. So a body the router refuses after 8 MiB has by then filled the proxy with whatever
the client sent meanwhile (8 concurrent 300 MB chunked bodies: +113 MiB in the proxy).
This ASGI middleware runs inside the proxy, in front of it: Serve installs it from
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH (`kdn.serve.proxy:middlewares`, which kdn.core.env sets
before Ray starts, so every proxy of a cluster KDN starts has it). A declared Content-Length
over the limit is answered 413 before the proxy reads a byte of the body; a body without one
is counted as the proxy reads it, and once past the limit the proxy is told the client left
(it stops reading and cancels the request) and the client gets the 413, with
`Connection: close`. The router keeps its own check (`kdn.serve.api.read_body`) for a
cluster started without this environment.
"""
import json

from kdn.serve.api import MAX_CHAT_BODY_BYTES, body_too_large

IMPORT_PATH = "kdn.serve.proxy:middlewares"     # RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH


class BoundedBodies:
    """ASGI middleware: HTTP request bodies of at most `limit` bytes reach the app."""

    def __init__(self, app, limit: int = MAX_CHAT_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"").strip()
        if declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(send, f"{int(declared)} bytes (Content-Length)")
        state = {"seen": 0, "started": False, "ours": False}

        async def counted():
            if state["ours"]:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                state["seen"] += len(message.get("body", b""))
                if state["seen"] > self.limit:
                    if not state["started"]:      # else the app answered already: just stop
                        state["ours"] = True
                        await self._refuse(send, f"over {self.limit} bytes (it was still arriving)")
                    return {"type": "http.disconnect"}
            return message

        async def guarded(message):
            if state["ours"]:                     # our 413 is the answer; the app's is dropped
                return
            if message["type"] == "http.response.start":
                state["started"] = True
            await send(message)

        await self.app(scope, counted, guarded)

    async def _refuse(self, send, size_text: str) -> None:
        e = body_too_large(size_text, self.limit)
        body = json.dumps(e.body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in e.headers().items()]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def middlewares() -> list:
    """Serve's proxy callback: the Starlette middlewares its proxy applies."""
    from starlette.middleware import Middleware
    return [Middleware(BoundedBodies)]
