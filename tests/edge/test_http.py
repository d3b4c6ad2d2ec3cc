"""HTTP on every edge, on a real 3-region network: the same bytes as Ray, and bad input refused.

One network for the module (its own name and origin directory) on the session's Ray cluster;
KV published through the Ray client is read back over HTTP by EdgeHTTPClient, a plain
http.client connection, and compared byte for byte. Every malformed request must get a 4xx
with a JSON message, and leave the edge healthy with nothing it stores changed.
"""
import http.client
import json
import re
import uuid
from urllib.parse import urlsplit

import msgpack
import numpy as np
import pytest
import ray

from kdn.chunk import Chunk, encode
from kdn.client import Client
from kdn.cluster import start_network, stop_network
from kdn.edge.http import MAX_BODY_BYTES, MAX_KEYS, EdgeHTTP, is_loopback
from kdn.errors import BadRequest, ChecksumMismatch, ManifestError, NetworkError
from kdn.http_client import EdgeHTTPClient
from kdn.keys import namespace_digest
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
FP = "synthetic-http"
N_TOKENS = 1000                    # 3 full chunks and a partial one of 232 tokens


def _make_kv(n_tokens, layers=2, heads=2, head_dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((layers, 2, heads, n_tokens, head_dim)).astype(np.float32)


def _make_tokens(n, seed=0):
    return np.random.default_rng(seed + 1000).integers(0, 49152, n).tolist()


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    name = f"http{uuid.uuid4().hex[:8]}"
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("origin"), network=name, http=True)
    toks, kv = _make_tokens(N_TOKENS), _make_kv(N_TOKENS)
    cl = Client(network=name, region="us-east", fingerprint=FP)
    cl.publish("handbook", [("part1", toks[:600]), ("part2", toks[600:])], kv)
    urls = {e: ray.get(h.ping.remote(), timeout=30)["http"] for e, h in n.edges.items()}
    n.test = {"toks": toks, "kv": kv, "client": cl, "urls": urls, "ns": cl.ns,
              "keys": list(cl.manifest("handbook").keys)}
    yield n
    stop_network(n)


def _raw(url, method, path, body=None, headers=None):
    """(status, headers, body bytes) of one request on a fresh plain connection."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _metric(text, name, labels=""):
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} missing from /metrics"
    return float(m.group(1))


def _edge_state(net, edge):
    st = ray.get(net.edges[edge].stats.remote(), timeout=30)
    return {t: (st[t]["items"], st[t]["bytes"]) for t in ("main", "hot")}


# --- binding and health -------------------------------------------------------------------
def test_every_edge_serves_http_on_loopback_with_uvloop(net):
    urls = net.test["urls"]
    assert set(urls) == {f"{r}-0" for r in REGIONS}
    for edge, url in urls.items():
        assert urlsplit(url).hostname == "127.0.0.1"
        h = EdgeHTTPClient(url).health()
        assert h["ok"] is True and h["edge"] == edge and h["region"] == edge[:-2]
        assert h["loop"] == "uvloop", "Ray's async actor loop should be uvloop"
        assert h["limits"] == {"max_body_bytes": MAX_BODY_BYTES, "max_keys": MAX_KEYS}


def test_loopback_is_the_default_and_other_hosts_are_recognised():
    assert EdgeHTTP.__init__.__defaults__[0] == "127.0.0.1"
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "10.1.2.3", "::", "example.org"))
    with pytest.raises(BadRequest, match="not on loopback"):
        EdgeHTTPClient("http://10.1.2.3:8080")
    with pytest.raises(BadRequest, match="http://HOST:PORT"):
        EdgeHTTPClient("https://127.0.0.1:8080")


# --- the same bytes -----------------------------------------------------------------------
def test_fetch_over_http_returns_exactly_the_published_bytes_from_every_edge(net):
    t = net.test
    prompt = t["toks"] + _make_tokens(40, seed=7)          # knowledge + a question
    ray_f = t["client"].fetch(prompt)
    for edge, url in t["urls"].items():
        with EdgeHTTPClient(url) as h:
            f = h.fetch_tokens(prompt, "default", FP)
        assert f.edge == edge and f.tokens == N_TOKENS and len(f.chunks) == 4
        assert f.kb.name == "handbook" and f.keys == t["keys"]
        got = np.concatenate(f.kv_parts(), axis=3)
        assert got.dtype == np.float32 and np.array_equal(got, t["kv"])
        assert all(a.equal(b) for a, b in zip(f.chunks, ray_f.chunks)), "HTTP and Ray differ"
        assert len(f.sources) == 4
        assert all(s in ("local", "origin") or s.startswith("peer:") for s in f.sources)
        assert not f.chunks[0].kv.flags.writeable, "received chunks must be read-only views"


def test_fetch_answer_is_concatenated_frames_with_sources_header(net):
    t = net.test
    url = t["urls"]["eu-west-0"]
    body = msgpack.packb({"ns": t["ns"], "keys": t["keys"], "region": "eu-west"})
    status, headers, raw = _raw(url, "POST", "/v1/fetch", body)
    assert status == 200 and headers["Content-Type"] == "application/x-kdn-frames"
    assert int(headers["Content-Length"]) == len(raw)
    assert headers["X-KDN-Edge"] == "eu-west-0" and headers["X-KDN-Chunks"] == "4"
    sources = headers["X-KDN-Sources"].split(",")
    assert len(sources) == 4
    chunks = [Chunk(k, t["ns"], np.ascontiguousarray(t["kv"][:, :, :, s:s + 256]), "float32")
              for k, s in zip(t["keys"], range(0, N_TOKENS, 256))]
    assert raw == b"".join(encode(c) for c in chunks), "the body must be exactly the codec frames"


def test_fetch_stops_at_the_first_unknown_key_and_lookup_agrees(net):
    t = net.test
    h = EdgeHTTPClient(t["urls"]["ap-south-0"])
    unknown = bytes(range(16))
    keys = t["keys"][:2] + [unknown] + t["keys"][2:]
    f = h.fetch(keys, t["ns"])
    assert len(f.chunks) == 2 and f.keys == t["keys"][:2]
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), t["kv"][:, :, :, :512])
    assert h.lookup(keys, t["ns"])["chunks"] == 2
    assert h.lookup(t["keys"], t["ns"])["chunks"] == 4
    # another namespace reads nothing, even with the right keys
    assert h.fetch(t["keys"], namespace_digest("other-tenant", FP)).chunks == []


def test_kbs_lists_the_namespace_manifests_with_hex_keys(net):
    t = net.test
    url = t["urls"]["us-east-0"]
    status, _, raw = _raw(url, "GET", f"/v1/kbs?tenant=default&fingerprint={FP}")
    assert status == 200
    doc = json.loads(raw)
    assert doc["ns"] == t["ns"].hex()
    (m,) = doc["manifests"]
    assert m["name"] == "handbook" and m["version"] == 1 and m["n_tokens"] == N_TOKENS
    assert m["keys"] == [k.hex() for k in t["keys"]]
    h = EdgeHTTPClient(url)
    (man,) = h.kbs("default", FP)
    assert list(man.keys) == t["keys"] and [d.name for d in man.documents] == ["part1", "part2"]
    assert h.kbs("nobody", FP) == []
    with pytest.raises(ManifestError, match="no knowledge base 'missing'"):
        h.fetch_tokens(t["toks"], "default", FP, kb="missing")


# --- metrics ------------------------------------------------------------------------------
def test_metrics_expose_the_counters_and_move_after_a_fetch(net):
    t = net.test
    h = EdgeHTTPClient(t["urls"]["us-east-0"])
    before = h.metrics()
    for name in ("kdn_edge_hits_total", "kdn_edge_bytes_served_total", "kdn_edge_hot_copies",
                 "kdn_edge_chunks", "kdn_edge_bytes", "kdn_edge_http_fetch_seconds"):
        assert f"# TYPE {name} " in before
    assert '# TYPE kdn_edge_http_fetch_seconds histogram' in before
    f = h.fetch(t["keys"], t["ns"])
    after = h.metrics()
    assert _metric(after, "kdn_edge_http_fetch_seconds_count") == \
        _metric(before, "kdn_edge_http_fetch_seconds_count") + 1
    assert _metric(after, "kdn_edge_http_fetch_seconds_bucket", '{le="+Inf"}') == \
        _metric(after, "kdn_edge_http_fetch_seconds_count")
    assert _metric(after, "kdn_edge_bytes_served_total") == \
        _metric(before, "kdn_edge_bytes_served_total") + f.nbytes
    served = sum(_metric(after, "kdn_edge_chunks_served_total", f'{{source="{s}"}}') -
                 _metric(before, "kdn_edge_chunks_served_total", f'{{source="{s}"}}')
                 for s in ("local", "peer", "origin"))
    assert served == 4
    hits = sum(_metric(after, "kdn_edge_hits_total", f'{{tier="{x}"}}') for x in ("main", "hot"))
    assert hits >= f.sources.count("local")
    assert _metric(after, "kdn_edge_http_bytes_sent_total") - \
        _metric(before, "kdn_edge_http_bytes_sent_total") > f.nbytes
    assert _metric(after, "kdn_edge_http_requests_total", '{endpoint="POST /v1/fetch",code="200"}') >= 1


# --- bad input ----------------------------------------------------------------------------
def _bad_requests(t):
    ns, keys = t["ns"], t["keys"]
    pack = msgpack.packb
    return [  # (method, path, body, status, words in the message)
        ("POST", "/v1/fetch", b"\xc1\xff not msgpack", 400, "not valid msgpack"),
        ("POST", "/v1/fetch", b"", 400, "body is empty"),
        ("POST", "/v1/fetch", pack([1, 2]), 400, "must be a msgpack map"),
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0], b"short"]}), 400, "keys[1] must be 16 bytes"),
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": ["a" * 16]}), 400, "keys[0] must be 16 bytes"),
        ("POST", "/v1/lookup", pack({"ns": b"x" * 15, "keys": keys}), 400, "'ns' must be 16 bytes"),
        ("POST", "/v1/lookup", pack({"ns": ns, "keys": keys[0]}), 400, "'keys' must be a list"),
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": keys, "evil": 1}), 400, "unknown field(s) evil"),
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": keys, "region": "mars"}), 400, "must name a region"),
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0]] * (MAX_KEYS + 1)}), 413,
         f"limit is {MAX_KEYS}"),
        ("POST", "/v1/fetch", b"\x00" * (MAX_BODY_BYTES + 1), 413, f"limit of {MAX_BODY_BYTES} bytes"),
        ("GET", "/v1/kbs?tenant=default", None, 400, "tenant and fingerprint"),
        ("GET", "/v1/kbs?tenant=a%00b&fingerprint=x", None, 400, "must not contain NUL"),
        ("GET", "/v1/nothing", None, 404, "no endpoint GET /v1/nothing"),
        ("GET", "/v1/fetch", None, 405, "use POST"),
        ("DELETE", "/health", None, 405, "DELETE is not allowed on /health"),
    ]


def test_bad_input_gets_a_4xx_with_a_json_message_and_changes_nothing(net):
    t = net.test
    url = t["urls"]["eu-west-0"]
    state = _edge_state(net, "eu-west-0")
    for method, path, body, status, words in _bad_requests(t):
        got, headers, raw = _raw(url, method, path, body)
        assert got == status, f"{method} {path}: {got} {raw[:200]!r}"
        assert headers["Content-Type"].startswith("application/json")
        doc = json.loads(raw)
        assert doc["status"] == status and words in doc["message"], (path, doc)
    h = EdgeHTTPClient(url)
    assert h.health()["ok"] is True
    assert _edge_state(net, "eu-west-0") == state, "a refused request must not change the edge"
    f = h.fetch(t["keys"], t["ns"])
    assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), t["kv"])
    metrics = h.metrics()
    assert _metric(metrics, "kdn_edge_http_requests_total", '{endpoint="POST /v1/fetch",code="400"}') >= 5
    assert 'code="500"' not in metrics, "bad input must never be a 500"
    # the client turns refusals into BadRequest with the server's message
    with pytest.raises(BadRequest, match="must name a region"):
        h.fetch(t["keys"], t["ns"], region="mars")


# --- the client's receive path --------------------------------------------------------------
def test_client_verifies_frames_and_keys(net):
    t = net.test
    h = EdgeHTTPClient(t["urls"]["us-east-0"])
    chunks = [Chunk(k, t["ns"], np.ascontiguousarray(t["kv"][:, :, :, s:s + 256]), "float32")
              for k, s in zip(t["keys"][:2], (0, 256))]
    body = bytearray(b"".join(encode(c) for c in chunks))
    assert [c.key for c in h._frames(memoryview(bytes(body)), t["keys"], t["ns"])[0]] == t["keys"][:2]
    body[-100] ^= 1                                      # a flipped bit in the last payload
    with pytest.raises(ChecksumMismatch, match="payload checksum mismatch"):
        h._frames(memoryview(bytes(body)), t["keys"], t["ns"])
    body[-100] ^= 1
    with pytest.raises(NetworkError, match="not the key asked for"):
        h._frames(memoryview(bytes(body)), t["keys"][1:], t["ns"])


def test_receive_buffer_is_reused_only_when_no_chunk_views_it(net):
    t = net.test
    h = EdgeHTTPClient(t["urls"]["us-east-0"])
    first = h.fetch(t["keys"], t["ns"])
    kept = np.concatenate(first.kv_parts(), axis=3)
    second = h.fetch(t["keys"], t["ns"])            # first's chunks view buffer 1: a new one
    assert h.stats["buffers_reused"] == 0
    del second                                      # nothing views buffer 2 any more
    third = h.fetch(t["keys"][:3], t["ns"])         # so it is written again
    assert h.stats["buffers_reused"] == 1
    assert np.array_equal(np.concatenate(first.kv_parts(), axis=3), kept), "a live chunk changed"
    assert np.array_equal(np.concatenate(third.kv_parts(), axis=3), t["kv"][:, :, :, :768])
