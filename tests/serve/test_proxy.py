"""kdn/serve/proxy.py: the body bound Serve's HTTP proxy applies before our router sees a request.

The middleware runs over a real ASGI app here (an app that records what it read and answers
200); that Serve's proxy installs it and that oversized bodies leave every process small is
tests/serve/test_serve.py's (8 concurrent 300 MB bodies against the real service)."""
import asyncio
import json

from kdn.core.env import RAY_ENV
from kdn.serve.proxy import IMPORT_PATH, BoundedBodies, middlewares

LIMIT = 1000


def run(headers, pieces):
    """(messages sent to the client, bytes the app read, whether the app was called)."""
    read, sent, called = [], [], []

    async def app(scope, receive, send):
        called.append(True)
        while True:
            m = await receive()
            if m["type"] == "http.disconnect":
                break
            read.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    queue = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
             for i, p in enumerate(pieces)]

    async def receive():
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(BoundedBodies(app, LIMIT)(scope, receive, send))
    return sent, b"".join(read), bool(called)


def _status_and_error(sent):
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), body


def test_a_declared_length_over_the_limit_is_refused_before_the_app_reads_a_byte():
    sent, read, called = run({"content-length": str(LIMIT + 1)}, [b"x" * (LIMIT + 1)])
    status, headers, body = _status_and_error(sent)
    assert (status, called, read) == (413, False, b"")
    assert headers[b"connection"] == b"close"
    err = json.loads(body)["error"]
    assert err["code"] == "body_too_large" and f"{LIMIT + 1} bytes (Content-Length)" in err["message"]


def test_a_chunked_body_past_the_limit_stops_the_app_reading_and_gets_the_413_alone():
    sent, read, called = run({}, [b"y" * 600, b"y" * 600, b"y" * 600])
    status, headers, body = _status_and_error(sent)
    assert called and status == 413 and headers[b"connection"] == b"close"
    assert len(read) == 600, "the piece that passed the limit never reached the app"
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], \
        "the app's own answer is dropped"
    assert "still arriving" in json.loads(body)["error"]["message"]


def test_bodies_within_the_limit_pass_unchanged():
    sent, read, called = run({"content-length": str(LIMIT)}, [b"z" * 400, b"z" * 600])
    assert called and read == b"z" * LIMIT and _status_and_error(sent)[0] == 200
    sent, read, _ = run({}, [b"w" * 10])
    assert read == b"w" * 10 and _status_and_error(sent)[:1] == (200,)


def test_serves_proxy_is_told_to_install_it_and_takes_it_as_starlette_middleware():
    from starlette.middleware import Middleware
    assert RAY_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == IMPORT_PATH
    (m,) = middlewares()
    assert isinstance(m, Middleware) and m.cls is BoundedBodies
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    assert [x.cls for x in validate_http_proxy_callback_return(middlewares())] == [BoundedBodies]
