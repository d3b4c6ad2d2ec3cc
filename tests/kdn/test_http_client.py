"""KDN's HTTP client against a canned edge: it follows X-KDN-More to the end of a long
prefix, reads the run-length X-KDN-Sources of thousands of chunks, verifies every frame,
and refuses headers that do not add up."""
import http.client
import http.server
import threading

import msgpack
import numpy as np
import pytest

from kdn.chunk import Chunk, encode
from kdn.edge.wire import pack_sources
from kdn.errors import NetworkError
from kdn.http_client import EdgeHTTPClient
from kdn.keys import chunk_keys, namespace_digest

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

    def do_POST(self):
        body = msgpack.unpackb(self.rfile.read(int(self.headers["Content-Length"])))
        keys = body["keys"]
        type(self).asked.append(keys)
        sent = [self.chunks[k] for k in keys[:self.page]]
        data = b"".join(encode(c) for c in sent)
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
    handler = type("CannedEdge", (Edge,), {"chunks": {}, "asked": []})
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
    with EdgeHTTPClient(edge.url) as h, pytest.raises(NetworkError, match="X-KDN-Sources entry"):
        h.fetch([c.key for c in cs], NS)
