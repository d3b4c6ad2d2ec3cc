"""KDN's HTTP client against a canned edge: it follows X-KDN-More to the end of a long
prefix, reads the run-length X-KDN-Sources of thousands of chunks, verifies every frame as
it arrives (whatever the read boundaries), and refuses headers and bodies that do not add
up."""
import http.client
import http.server
import threading

import msgpack
import numpy as np
import pytest

from kdn.core.chunk import Chunk, encode
from kdn.core.wire import pack_sources
from kdn.core.errors import ChecksumMismatch, RemoteError
from kdn.client import http as http_client
from kdn.client.http import EdgeHTTPClient
from kdn.core.keys import chunk_keys, namespace_digest

NS = namespace_digest("default", "client-unit")


def _chunks(n, tokens=1):
    keys = chunk_keys(range(n * tokens), NS, tokens)
    rng = np.random.default_rng(0)
    return [Chunk(k, NS, rng.standard_normal((1, 2, 1, tokens, 2)).astype(np.float32), "float32")
            for k in keys]


class Edge(http.server.BaseHTTPRequestHandler):
    """Answers POST /v1/fetch with at most `page` of the keys asked (all held), run-length or
    comma sources, and records the keys of each request."""
    protocol_version = "HTTP/1.1"
    chunks, page, old_sources, asked = {}, 2, False, []
    damage = None       # callable(body bytes) -> the bytes sent instead

    def do_POST(self):
        body = msgpack.unpackb(self.rfile.read(int(self.headers["Content-Length"])))
        keys = body["keys"]
        type(self).asked.append(keys)
        sent = [self.chunks[k] for k in keys[:self.page]]
        data = b"".join(encode(c) for c in sent)
        if self.damage is not None:
            data = self.damage(data)
        sources = ["local"] * len(sent)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-kdn-frames")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-KDN-Edge", "edge-c")
        self.send_header("X-KDN-Chunks", str(len(sent)))
        self.send_header("X-KDN-More", "1" if len(keys) > len(sent) else "0")
        self.send_header("X-KDN-Sources", ",".join(sources) if self.old_sources else pack_sources(sources))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass            # a client that hangs up (the LineTooLong case) is expected here


@pytest.fixture
def edge():
    handler = type("CannedEdge", (Edge,), {"chunks": {}, "asked": [], "damage": None})
    server = QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"
    yield handler
    server.shutdown()
    server.server_close()


def test_the_client_follows_more_to_the_end_of_the_prefix(edge):
    cs = _chunks(5)
    edge.chunks = {c.key: c for c in cs}
    keys = [c.key for c in cs]
    with EdgeHTTPClient(edge.url) as h:
        f = h.fetch(keys, NS)
        assert [len(a) for a in edge.asked] == [5, 3, 1], "each time the keys after those received"
        assert edge.asked[1] == keys[2:] and edge.asked[2] == keys[4:]
        assert [c.key for c in f.chunks] == keys and all(a.equal(b) for a, b in zip(f.chunks, cs))
        assert f.sources == ["local"] * 5 and f.edge == "edge-c" and f.codecs == {"raw": 5}
        assert f.wire_bytes == sum(len(encode(c)) for c in cs) == h.counters["bytes"]
        assert h.counters["fetches"] == 1 and h.counters["requests"] == 3
        assert h.stats()["codecs"] == {"raw": 5} and h.stats()["chunks"] == 5


def test_thousands_of_sources_fit_one_header_line(edge):
    cs = _chunks(12000)
    edge.chunks, edge.page = {c.key: c for c in cs}, 12000
    with EdgeHTTPClient(edge.url) as h:
        f = h.fetch([c.key for c in cs], NS)
        assert len(f.chunks) == 12000 and f.sources == ["local"] * 12000
    edge.old_sources = True          # the comma list of before: past http.client's line limit
    with EdgeHTTPClient(edge.url) as h, pytest.raises(http.client.LineTooLong):
        h.fetch([c.key for c in cs], NS)


def test_sources_that_do_not_match_the_frames_are_refused(edge, monkeypatch):
    cs = _chunks(2)
    edge.chunks = {c.key: c for c in cs}
    send_header = edge.send_header

    def lying(self, name, value):
        send_header(self, name, "local*3" if name == "X-KDN-Sources" else value)

    monkeypatch.setattr(edge, "send_header", lying)
    with EdgeHTTPClient(edge.url) as h, pytest.raises(RemoteError, match="X-KDN-Sources entry"):
        h.fetch([c.key for c in cs], NS)


@pytest.mark.parametrize("step", [1, 7, 300, 1 << 20])
def test_frames_are_verified_as_they_arrive_whatever_the_read_boundaries(edge, monkeypatch, step):
    """Reads of `step` bytes cut prefixes, headers and payloads anywhere: every frame still
    decodes, equal to what was sent, and the chunks are read-only views of one buffer."""
    monkeypatch.setattr(http_client, "RECV_STEP", step)
    cs = _chunks(6, tokens=3)
    edge.chunks, edge.page = {c.key: c for c in cs}, 6
    with EdgeHTTPClient(edge.url) as h:
        f = h.fetch([c.key for c in cs], NS)
        assert [c.key for c in f.chunks] == [c.key for c in cs]
        assert all(a.equal(b) for a, b in zip(f.chunks, cs))
        assert all(not c.kv.flags.writeable for c in f.chunks)
        assert len({c.kv.base is not None for c in f.chunks}) == 1


def test_a_corrupt_frame_mid_body_fails_the_fetch_and_the_connection_serves_the_next(edge, monkeypatch):
    """A frame whose payload fails its checksum is known once it is all in; the rest of the
    body is still read (its framing holds), so the connection is clean for the next answer.
    fetch() raises; a Reader gets a CorruptFrame in its place and reports it (kdn.client.reader)."""
    monkeypatch.setattr(http_client, "RECV_STEP", 64)
    cs = _chunks(4, tokens=4)
    edge.chunks, edge.page = {c.key: c for c in cs}, 4
    sizes = [len(encode(c)) for c in cs]

    def flip_in_frame_2(data):
        at = sizes[0] + sizes[1] + sizes[2] - 3          # inside frame 2's payload
        return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]

    edge.damage = staticmethod(flip_in_frame_2)
    with EdgeHTTPClient(edge.url) as h:
        with pytest.raises(ChecksumMismatch, match="payload checksum mismatch"):
            h.fetch([c.key for c in cs], NS)
        edge.damage = None
        f = h.fetch([c.key for c in cs], NS)             # the same connection, a good answer
        assert all(a.equal(b) for a, b in zip(f.chunks, cs)) and h.counters["requests"] == 2
        assert h.counters["reconnects"] == 0


@pytest.mark.parametrize("cut,message", [
    (lambda sizes: sum(sizes) - 5, "frame 2 ends at byte"),            # inside its payload
    (lambda sizes: sizes[0] + sizes[1] + 10, "the body ends inside frame 2"),   # inside its prefix
])
def test_a_body_that_ends_inside_a_frame_is_refused(edge, cut, message):
    cs = _chunks(3, tokens=2)
    edge.chunks, edge.page = {c.key: c for c in cs}, 3
    at = cut([len(encode(c)) for c in cs])
    edge.damage = staticmethod(lambda data: data[:at])    # Content-Length says so, too
    with EdgeHTTPClient(edge.url) as h, pytest.raises(RemoteError, match=message):
        h.fetch([c.key for c in cs], NS)


class _Answer:
    """An HTTP answer's status and JSON body, as _refuse reads them."""

    def __init__(self, status, error, message):
        import json
        self.status, self._raw = status, json.dumps({"error": error, "message": message}).encode()

    def read(self):
        return self._raw


@pytest.mark.parametrize("status, error, raised", [
    (503, "origin_unreachable", "NetworkError"),      # a store the edge's origin did not take: as over Ray
    (503, "overloaded", "RemoteError"),               # any other fault of the node: its own
    (500, "internal", "RemoteError"),
    (403, "forbidden", "AccessDenied"),
    (400, "bad_request", "BadRequest")])
def test_a_refusal_is_raised_as_the_ray_path_raises_it(status, error, raised):
    from kdn.core import errors
    from kdn.core.rpc import Unreachable
    client = EdgeHTTPClient("http://127.0.0.1:1")
    with pytest.raises(errors.KDNError) as got:
        client._refuse(_Answer(status, error, "the words"), "POST", "/v1/objects")
    assert type(got.value).__name__ == raised and "the words" in str(got.value)
    assert not isinstance(got.value, Unreachable)          # none of these is a failover


class _EarlyRefuser:
    """A server that reads a request's headers and a little of its body, writes `answer`
    (None: nothing) and closes with the rest of the body unread, which resets the
    connection under a client still sending: what an aiohttp server does to a body it
    refused before reading once its lingering time is over (a slow link). Counts the
    connections."""

    def __init__(self, answer):
        import socket
        self.answer, self.connections = answer, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        import socket
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    piece = conn.recv(65536)
                    if not piece:
                        break
                    data += piece
                if self.answer is not None:
                    conn.sendall(self.answer)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")  # close = reset

    def close(self):
        self.sock.close()


def _refusal(status, reason, error, message) -> bytes:
    import json
    body = json.dumps({"error": error, "message": message, "status": status}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@pytest.mark.parametrize("answer, raised, match", [
    (_refusal(408, "Request Timeout", "request_timeout", "the body sent nothing for 30 s"), "Unreachable",
     "timed out waiting for the body"),               # the link stalled: a failover, as a timeout here
    (_refusal(200, "OK", "ok", "no"), "RemoteError", "answered POST /v1/objects with 200 before its body"),
    (_refusal(413, "Request Entity Too Large", "body_too_large", "split it"), "BadRequest", "413 split it")])
def test_an_answer_before_the_body_says_what_it_is(answer, raised, match):
    from kdn.core import errors
    from kdn.core.rpc import Unreachable
    server = _EarlyRefuser(answer)
    try:
        client = EdgeHTTPClient(server.url, timeout_s=10)
        with pytest.raises((errors.KDNError, Unreachable), match=match) as got:
            client.put_frames("objects", _big_objects(32 << 20))
        assert type(got.value).__name__ == raised and server.connections == 1
    finally:
        server.close()


def _big_objects(n_bytes):
    """Opaque objects whose frames make a body far larger than a socket's buffers."""
    from kdn.core.chunk import OPAQUE
    return [Chunk(bytes([i]) * 16, NS, np.full(8 << 20, i, np.uint8), OPAQUE) for i in range(n_bytes >> 23)]


def test_a_refusal_answered_before_the_body_was_read_is_raised_as_the_refusal_and_not_sent_again():
    """A wrong token on a 64 MiB store, refused before the body is read: the client's send
    fails on the reset, and it raises the server's 403 as AccessDenied (the Ray path's
    refusal), not Unreachable (a failover to the next node as if this one were down), and
    sends the body once, not twice. A connection reset with no answer at all is still
    Unreachable after one reconnect, as before."""
    from kdn.core.errors import AccessDenied
    from kdn.core.rpc import Unreachable
    server = _EarlyRefuser(_refusal(403, "Forbidden", "forbidden", "POST /v1/objects needs the network's admin token"))
    try:
        client = EdgeHTTPClient(server.url, timeout_s=10, token="not-the-admin-token")
        with pytest.raises(AccessDenied, match="403 POST /v1/objects needs the network's admin token") as got:
            client.put_frames("objects", _big_objects(64 << 20))
        assert not isinstance(got.value, Unreachable)
        assert server.connections == 1, "the body is not sent again"
        assert client.stats()["answered_before_body_end"] == 1 and client._conn is None
    finally:
        server.close()
    silent = _EarlyRefuser(None)
    try:
        client = EdgeHTTPClient(silent.url, timeout_s=10)
        with pytest.raises(Unreachable, match="closed the connection on POST /v1/objects"):
            client.put_frames("objects", _big_objects(64 << 20))
        assert silent.connections == 2 and client.stats().get("answered_before_body_end", 0) == 0
    finally:
        silent.close()
