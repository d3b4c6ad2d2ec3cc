"""HTTP on every edge: the same bytes as Ray, bounded answers, bad input refused, idle
connections closed.

One network for the module (its own name and origin directory) on the session's Ray cluster;
KV published through the Ray client is read back over HTTP by EdgeHTTPClient, a plain
http.client connection, and compared byte for byte. Every malformed request must get a 4xx
with a JSON message, and leave the edge healthy with nothing it stores changed. What an edge
decides alone (paging, codecs, corrupt copies, timeouts, refusals) is also tested against an
edge in this process (conftest: kit, serve), without Ray.
"""
import http.client
import socket
import time
import json
import uuid
from urllib.parse import urlsplit

import msgpack
import numpy as np
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from kdn.core.chunk import Chunk, encode
from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.keys import MAX_FETCH_KEYS
from kdn.edge.http import IDLE_S, MAX_BODY_BYTES, EdgeHTTP, is_loopback
from kdn.edge.reads import MAX_REPLY_BYTES
from kdn.core.wire import FRAMES_TYPE, unpack_sources
from kdn.core.errors import BadRequest, ChecksumMismatch, ManifestError, RemoteError
from kdn.client.http import EdgeHTTPClient, HTTPEdges
from kdn.client.reader import Reader
from kdn.core.keys import namespace_digest
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
        assert h["limits"] == {"max_body_bytes": MAX_BODY_BYTES, "max_keys": MAX_FETCH_KEYS,
                               "max_reply_bytes": MAX_REPLY_BYTES, "idle_s": IDLE_S}


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
        edges = HTTPEdges([url])
        f = Reader(edges, "default", FP).fetch(prompt)             # the one reader, over HTTP
        edges.close()
        assert f.edge == url and f.tokens == N_TOKENS and len(f.chunks) == 4
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
    assert headers["X-KDN-More"] == "0"
    sources = unpack_sources(headers["X-KDN-Sources"], 4)      # run-length coded
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
        Reader(HTTPEdges([url]), "default", FP).fetch(t["toks"], kb="missing")


# --- metrics ------------------------------------------------------------------------------
def _samples(text) -> dict:
    """{(sample name, sorted labels): value}, read with prometheus_client's own parser."""
    return {(x.name, tuple(sorted(x.labels.items()))): x.value
            for fam in text_string_to_metric_families(text) for x in fam.samples}


def test_metrics_parse_and_move_after_a_fetch(net):
    t = net.test
    h = EdgeHTTPClient(t["urls"]["us-east-0"])
    before = _samples(h.metrics())
    f = h.fetch(t["keys"], t["ns"])
    after = _samples(h.metrics())

    def moved(name, **labels):
        k = (name, tuple(sorted(labels.items())))
        return after.get(k, 0) - before.get(k, 0)

    assert moved("kdn_edge_http_fetch_seconds_count") == 1
    assert after[("kdn_edge_http_fetch_seconds_bucket", (("le", "+Inf"),))] == \
        after[("kdn_edge_http_fetch_seconds_count", ())]
    assert moved("kdn_edge_fetches_total") == 1
    assert moved("kdn_edge_bytes_served_total") == f.nbytes
    assert sum(moved("kdn_edge_chunks_served_total", source=s) for s in ("local", "peer", "origin")) == 4
    hits = sum(moved("kdn_edge_hits_total", tier=x) for x in ("main", "hot"))
    assert hits >= f.sources.count("local")
    assert moved("kdn_edge_http_bytes_sent_total") == f.wire_bytes > f.nbytes
    assert moved("kdn_edge_http_requests_total", endpoint="POST /v1/fetch", code="200") == 1
    assert moved("kdn_edge_http_frames_by_codec_total", codec="raw") == 4
    for name in ("kdn_edge_hot_copies", "kdn_edge_loads_total", "kdn_edge_loads_deduped_total"):
        assert (name, ()) in after


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
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0]] * (MAX_FETCH_KEYS + 1)}), 413,
         f"limit is {MAX_FETCH_KEYS}"),
        ("POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0]] * 128, "codec": "zstd"}), 400,
         "keys[1] repeats key"),
        ("POST", "/v1/lookup", pack({"ns": ns, "keys": keys + keys[:1]}), 400, "keys[4] repeats key"),
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
    metrics = _samples(h.metrics())
    assert metrics[("kdn_edge_http_requests_total", (("code", "400"), ("endpoint", "POST /v1/fetch")))] >= 6
    assert not [k for k in metrics if dict(k[1]).get("code", "").startswith("5")], "never a 500"
    # the client turns refusals into BadRequest with the server's message
    with pytest.raises(BadRequest, match="must name a region"):
        h.fetch(t["keys"], t["ns"], region="mars")


# --- the client's receive path --------------------------------------------------------------
def test_client_verifies_frames_and_keys(net):
    from kdn.client.http import CorruptFrame, _Frames
    t = net.test
    h = EdgeHTTPClient(t["urls"]["us-east-0"])

    def frames(body: bytes, keys):
        got = _Frames(h.url, memoryview(body), keys, t["ns"])
        got.take(len(body))
        return got.done()

    chunks = [Chunk(k, t["ns"], np.ascontiguousarray(t["kv"][:, :, :, s:s + 256]), "float32")
              for k, s in zip(t["keys"][:2], (0, 256))]
    body = bytearray(b"".join(encode(c) for c in chunks))
    assert [c.key for c in frames(bytes(body), t["keys"])[0]] == t["keys"][:2]
    body[-100] ^= 1                                      # a flipped bit in the last payload
    got = frames(bytes(body), t["keys"])[0]
    assert got[0].key == t["keys"][0] and isinstance(got[1], CorruptFrame) and got[1].key == t["keys"][1]
    with pytest.raises(ChecksumMismatch, match="payload checksum mismatch"):
        got[1].decode()                                  # a Reader's check fails on it: reported
    body[-100] ^= 1
    with pytest.raises(RemoteError, match="not the key asked for"):
        frames(bytes(body), t["keys"][1:])


def _objects(obj, n_bytes, seed):
    """(namespace, keys, datas, their opaque chunks) of a cache layer's objects, for obj (an
    Objects, which then knows the namespace)."""
    from kdn.integrations.objects import pack
    ns = obj.namespace("default", f"http-objects-{seed}")
    rng = np.random.default_rng(seed)
    datas = [rng.integers(0, 256, n, dtype=np.uint8) for n in n_bytes]
    keys = [bytes([seed, i]) * 8 for i in range(len(datas))]
    return ns, keys, datas, [pack(k, ns, d) for k, d in zip(keys, datas)]


def _loaded(obj, ns, keys, datas) -> list:
    """Per key, whether a load of it gives exactly its bytes (the load verifies its checksum).
    Byte equality holds on any CPU: the bytes were stored and moved, never computed."""
    outs = [np.zeros(d.size, np.uint8) for d in datas]
    ok = obj.load(ns, keys, outs)
    return [bool(o) and np.array_equal(out, d) for o, out, d in zip(ok, outs, datas)]


def _store_counters(net, edge) -> dict:
    c = ray.get(net.edges[edge].stats.remote(), timeout=30)["counters"]
    return {k: c.get(k, 0) for k in ("store_http_writes", "store_http_objects", "store_acked_edge",
                                     "store_http_buffers_new", "store_http_buffers_reused")}


def test_objects_written_over_http_are_kept_as_over_ray_and_a_bad_body_keeps_nothing(net):
    """POST /v1/objects: a body with one bad frame, or a frame that is no object, is refused
    whole naming it and leaves nothing stored; a good one is answered as put_objects over
    Ray is, and its bytes load back exactly (compared: moved, never computed)."""
    from kdn.integrations.objects import Objects
    edge = "eu-west-0"
    url, head = net.test["urls"][edge], {"Content-Type": FRAMES_TYPE}
    obj = Objects.connect(net.name, "eu-west", "lmcache")
    ns, keys, datas, chunks = _objects(obj, (70_000, 1 << 20, 333), seed=41)
    frames = [bytearray(encode(c)) for c in chunks]
    frames[1][-5] ^= 0xFF                                              # a payload byte flipped
    status, _, body = _raw(url, "POST", "/v1/objects", b"".join(frames), head)
    assert status == 400 and "frame 1 " in json.loads(body)["message"] and "checksum" in json.loads(body)["message"]
    kv = Chunk(net.test["keys"][0], net.test["ns"], _make_kv(8), "float32")   # a KB's chunk
    status, _, body = _raw(url, "POST", "/v1/objects", encode(chunks[0]) + encode(kv), head)
    assert status == 400 and "opaque" in json.loads(body)["message"], body
    status, _, body = _raw(url, "POST", "/v1/objects", bytes(encode(chunks[0])), {"Content-Type": "text/plain"})
    assert status == 400 and FRAMES_TYPE in json.loads(body)["message"]
    status, _, body = _raw(url, "POST", "/v1/objects", encode(chunks[0]) + encode(chunks[1], "zstd"), head)
    assert status == 400 and "frame 1 is not an opaque object stored raw" in json.loads(body)["message"], body
    try:
        assert obj.lookup(ns, keys) == [False] * 3                     # nothing of any body was kept
        before = _store_counters(net, edge)
        got = EdgeHTTPClient(url, allow_remote=True).put_frames("objects", chunks)
        assert got == {"received": 3, "kept": 3, "pending": 3}, got
        after = _store_counters(net, edge)
        assert after["store_http_writes"] - before["store_http_writes"] == 1
        assert after["store_http_objects"] - before["store_http_objects"] == 3
        assert after["store_acked_edge"] - before["store_acked_edge"] == 3
        assert _loaded(obj, ns, keys, datas) == [True] * 3
        assert ray.get(net.edges[edge].stores_durable.remote(30.0), timeout=60)["durable"]
        # more bodies of the same size: each lands in a body's buffer once nothing views it,
        # and every object of every body, the first's included, loads back exactly
        more = [_objects(obj, (70_000, 1 << 20, 333), seed=50 + i) for i in range(3)]
        for _, _, _, cs in more:
            assert EdgeHTTPClient(url, allow_remote=True).put_frames("objects", cs)["kept"] == 3
            assert ray.get(net.edges[edge].stores_durable.remote(30.0), timeout=60)["durable"]
        end = _store_counters(net, edge)
        took = {k: end[f"store_http_buffers_{k}"] - before[f"store_http_buffers_{k}"] for k in ("new", "reused")}
        assert took["new"] + took["reused"] == 4 and took["reused"] >= 1, took
        for ns_i, keys_i, datas_i, _ in [(ns, keys, datas, None)] + more:
            assert _loaded(obj, ns_i, keys_i, datas_i) == [True] * 3
    finally:
        obj.close()


def test_a_store_at_an_edge_on_another_node_goes_over_its_frames_and_one_on_this_node_over_ray(net):
    """Objects (LMCache's and SGLang's store path, ack "edge") from this process: to the edge
    of a region on another Ray node over that edge's HTTP server, to the edge on this
    process's own node over Ray (zero-copy there); the same bytes load back either way."""
    from kdn.integrations.objects import Objects
    here = ray.get_runtime_context().get_node_id()
    nodes = {e: ray.get(h.stats.remote(), timeout=30)["node_id"] for e, h in net.edges.items()}
    far = next(e for e, n in nodes.items() if n != here)
    near = next(e for e, n in nodes.items() if n == here)
    for edge, seed, over_http in ((far, 42, True), (near, 43, False)):
        obj = Objects.connect(net.name, edge.rsplit("-", 1)[0], "lmcache")
        try:
            ns, keys, datas, _ = _objects(obj, (3 << 20, 1 << 20, 5000), seed=seed)
            before = _store_counters(net, edge)
            assert obj.store(list(zip([ns] * 3, keys)), datas) == sum(d.size for d in datas)
            after = _store_counters(net, edge)
            plane = obj.view.plane.stats()
            assert plane.get("http_puts", 0) == int(over_http), (edge, plane)
            assert after["store_http_objects"] - before["store_http_objects"] == (3 if over_http else 0)
            assert after["store_acked_edge"] - before["store_acked_edge"] == 3
            assert _loaded(obj, ns, keys, datas) == [True] * 3
        finally:
            obj.close()


def test_receive_buffer_is_reused_only_when_no_chunk_views_it(net):
    t = net.test
    h = EdgeHTTPClient(t["urls"]["us-east-0"])
    first = h.fetch(t["keys"], t["ns"])
    kept = np.concatenate(first.kv_parts(), axis=3)
    second = h.fetch(t["keys"], t["ns"])            # first's chunks view buffer 1: a new one
    assert h.counters["buffers_reused"] == 0
    del second                                      # nothing views buffer 2 any more
    third = h.fetch(t["keys"][:3], t["ns"])         # so it is written again
    assert h.counters["buffers_reused"] == 1
    assert np.array_equal(np.concatenate(first.kv_parts(), axis=3), kept), "a live chunk changed"
    assert np.array_equal(np.concatenate(third.kv_parts(), axis=3), t["kv"][:, :, :, :768])


def test_clients_sharing_kept_buffers_reuse_each_others_once_free(net):
    """An edge's pulling connections share their receive buffers (kdn/edge/dataplane.py):
    a buffer one client received into is written by another once nothing views it, never
    while a chunk of it lives."""
    from kdn.core.buffers import KeptBuffers
    t = net.test
    shared = KeptBuffers(2, 64 << 20)
    a, b = (EdgeHTTPClient(t["urls"]["us-east-0"], buffers=shared) for _ in range(2))
    want = np.concatenate(a.fetch(t["keys"], t["ns"]).kv_parts(), axis=3)   # a's buffer, free again
    first = a.fetch(t["keys"], t["ns"])             # into that buffer again; its chunks live
    second = b.fetch(t["keys"], t["ns"])            # so b takes new memory
    assert (a.counters["buffers_reused"], b.counters["buffers_new"]) == (1, 1)
    del second                                      # b's buffer free: a takes it
    third = a.fetch(t["keys"][:3], t["ns"])
    assert a.counters["buffers_reused"] == 2 and shared.nbytes <= 64 << 20
    assert np.array_equal(np.concatenate(first.kv_parts(), axis=3), want), "a live chunk changed"
    assert np.array_equal(np.concatenate(third.kv_parts(), axis=3), t["kv"][:, :, :, :768])


# --- an edge in this process (no Ray) -----------------------------------------------------------
def _post(url, path, body, headers=None, token=None):
    headers = dict(headers or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return _raw(url, "POST", path, body, headers)


def test_a_long_fetch_comes_in_bounded_answers_the_client_follows(kit, serve):
    cs = kit.make_chunks(7)
    edge = kit.local_edge(cs, max_reply_bytes=3 * cs[0].raw)
    server = serve(edge)
    body = msgpack.packb({"ns": kit.NS, "keys": [c.key for c in cs]})
    status, headers, raw = _post(server.url, "/v1/fetch", body)
    assert status == 200 and headers["X-KDN-More"] == "1"
    assert int(headers["Content-Length"]) == len(raw) <= 3 * cs[0].raw, "never past the bound"
    n = int(headers["X-KDN-Chunks"])
    assert 1 <= n < 7 and unpack_sources(headers["X-KDN-Sources"], 7) == ["local"] * n
    with EdgeHTTPClient(server.url) as h:
        f = h.fetch([c.key for c in cs], kit.NS)
        assert [c.key for c in f.chunks] == [c.key for c in cs] and f.sources == ["local"] * 7
        assert all(a.equal(b) for a, b in zip(f.chunks, cs))
        assert h.counters["requests"] >= 3 and f.wire_bytes == h.counters["bytes"]


@pytest.mark.parametrize("codec,region,used", [
    (None, None, "raw"), ("zstd", None, "zstd"), ("q8z", None, "q8z"),
    ("auto", "far", "zstd"), ("auto", "here", "raw"), ("auto", None, "raw")])
def test_http_fetch_negotiates_the_codec(kit, serve, codec, region, used):
    cs = kit.make_chunks(3)
    server = serve(kit.local_edge(cs, topology=kit.topology(slow_gbps=0.01)))
    with EdgeHTTPClient(server.url) as client:
        got = client.fetch([c.key for c in cs], kit.NS, region=region, codec=codec)
        assert got.codecs == {used: 3} and client.stats()["codecs"] == {used: 3}
    for a, b in zip(got.chunks, cs):
        if used.startswith("q"):
            assert np.abs(a.kv - b.kv).max() <= np.ptp(b.kv) / 255
        else:
            assert a.equal(b)
    assert (got.wire_bytes < got.nbytes) == (used != "raw")
    assert server.counters["frames_" + used] == 3
    status, _, raw = _post(server.url, "/v1/fetch", msgpack.packb({"ns": kit.NS, "keys": [cs[0].key],
                                                                    "codec": "lzma"}))
    assert status == 400 and "field 'codec' must be 'auto' or one of" in json.loads(raw)["message"]


def test_a_corrupt_copy_is_never_sent_and_is_fetched_again_once(kit, serve, monkeypatch):
    from kdn.edge.forms import corrupted
    from kdn.edge.tiers import Held
    cs = kit.make_chunks(3)
    edge = kit.local_edge([cs[0], corrupted(cs[1]), cs[2]])
    edge.catalog.add({"tenant": "default", "fingerprint": "edge-unit", "name": "kb", "version": 1,
                      "keys": [c.key for c in cs], "sums": [c.digest() for c in cs]})
    monkeypatch.setattr(Held, "of", classmethod(lambda cls, obj: kit.held(obj)))

    async def ask(node, method, *args, timeout=None, **kw):        # owners lack it; the origin has it
        return [c for c in cs if c.key in args[0]] if method == "get_chunks" else None

    edge.peers.ask = ask
    server = serve(edge)
    with EdgeHTTPClient(server.url) as h:
        f = h.fetch([c.key for c in cs], kit.NS)
    assert f.sources == ["local", "origin", "local"] and all(a.equal(b) for a, b in zip(f.chunks, cs))
    c = edge.all_counters()
    assert c["corrupt_dropped"] == 1 and c["corrupt_detected"] == 1 and c["fetches"] == 1


def test_bad_gzip_and_transfer_codings_are_400s(kit, serve):
    import gzip
    cs = kit.make_chunks(1)
    server = serve(kit.local_edge(cs))
    body = msgpack.packb({"ns": kit.NS, "keys": [cs[0].key]})
    status, _, raw = _post(server.url, "/v1/fetch", gzip.compress(body), {"Content-Encoding": "gzip"})
    assert status == 200, "good gzip is read"
    for what, data in [("garbage", b"\x1f\x8b not gzip at all"), ("truncated", gzip.compress(body)[:12])]:
        status, headers, raw = _post(server.url, "/v1/fetch", data, {"Content-Encoding": "gzip"})
        assert status == 400 and json.loads(raw)["message"], (what, raw[:200])
    u = urlsplit(server.url)
    for te in ("gzip, chunked", "chunked, gzip", "gzip"):
        with socket.create_connection((u.hostname, u.port), timeout=10) as s:
            chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
            s.sendall(b"POST /v1/fetch HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                      b"Transfer-Encoding: " + te.encode() + b"\r\n\r\n" + chunked)
            answer = b"".join(iter(lambda: s.recv(65536), b""))
        assert answer.split(b" ", 2)[1] == b"400", (te, answer[:200])   # ours, or the parser's
    metrics = _samples(server.exposition())
    assert not [k for k in metrics if dict(k[1]).get("code", "").startswith("5")]


def test_slow_headers_and_idle_sockets_are_closed_within_the_bound(kit, serve):
    server = serve(kit.local_edge([]), idle_s=1.0)
    u = urlsplit(server.url)
    socks = [socket.create_connection((u.hostname, u.port), timeout=10) for _ in range(3)]
    t0 = time.monotonic()
    socks[0].sendall(b"GET /hea")                        # half a request line
    socks[1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")   # headers that never end
    closed = []                                          # socks[2] sends nothing at all
    for s in socks:
        closed.append(s.recv(65536) == b"" and time.monotonic() - t0)
        s.close()
    assert all(closed) and max(closed) < 1.0 + 2.0, closed
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:   # keep-alive, then idle
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        t1 = time.monotonic()
        assert s.recv(65536) == b"" and time.monotonic() - t1 < 1.0 + 2.0


def test_a_stranger_cannot_tell_a_namespace_exists_from_the_refusal(kit, serve):
    cs = kit.make_chunks(1)
    auth = {"admin": "admin-token-0123456789abcdef", "readers": {"default": "read-token-0123456789"}}
    edge = kit.local_edge(cs, auth=auth)
    edge.catalog.add({"tenant": "default", "fingerprint": "edge-unit", "name": "kb", "version": 1,
                      "keys": [cs[0].key], "sums": [cs[0].digest()]})
    asked = []

    async def ask(node, method, *args, timeout=None, **kw):
        asked.append(method)
        return []

    edge.peers.ask = ask
    server = serve(edge)
    for token, want in ((None, 401), ("wrong-token-0123456789", 403)):   # missing 401, wrong 403
        answers = []
        for ns in (kit.NS, namespace_digest("nobody", "x"), namespace_digest("nobody", "y")):
            status, _, raw = _post(server.url, "/v1/fetch", msgpack.packb({"ns": ns, "keys": [cs[0].key]}),
                                   token=token)
            answers.append((status, json.loads(raw)["message"]))
        assert len(set(answers)) == 1 and answers[0][0] == want, answers
    assert asked == ["manifests"], "unknown namespaces ask the origin once a period, not per request"
    status, _, _ = _post(server.url, "/v1/fetch", msgpack.packb({"ns": kit.NS, "keys": [cs[0].key]}),
                         token="read-token-0123456789")
    assert status == 200


@pytest.mark.parametrize("readers, open_default", [
    ({"acme": "acme-token-0123456789"}, False),                 # default has no token: closed
    ({"acme": "acme-token-0123456789", "default": "read-token-0123456789"}, False),
    ({"acme": "acme-token-0123456789", "default": "*"}, True),  # the operator left it open
])
def test_read_tokens_missing_401_wrong_403_right_200(kit, serve, readers, open_default):
    """The default tenant (a KB published without --tenant) with read tokens on: no token
    401, a wrong one 403, the right one 200, on fetch and on /v1/kbs; `default=*` opens it."""
    cs = kit.make_chunks(1)
    edge = kit.local_edge(cs, auth={"admin": "admin-token-0123456789abcdef", "readers": readers})
    edge.catalog.add({"tenant": "default", "fingerprint": "edge-unit", "name": "kb", "version": 1,
                      "keys": [cs[0].key], "sums": [cs[0].digest()]})

    async def ask(node, method, *args, timeout=None, **kw):          # the origin: not reached
        return None
    edge.peers.ask = ask
    server = serve(edge)
    right = readers.get("default", "admin-token-0123456789abcdef")    # no token of its own: the admin's
    right = "sk-anything-at-all" if right == "*" else right
    body = msgpack.packb({"ns": kit.NS, "keys": [cs[0].key]})
    kbs = "/v1/kbs?tenant=default&fingerprint=edge-unit"
    for token, want in ((None, 401), ("wrong-token-0123456789", 403), ("acme-token-0123456789", 403),
                        (right, 200)):
        want = 200 if open_default else want
        status, headers, raw = _post(server.url, "/v1/fetch", body, token=token)
        assert status == want, (token, raw[:200])
        if status == 200:
            assert headers["X-KDN-Chunks"] == "1"
        else:
            assert "read token" in json.loads(raw)["message"]
            assert (headers.get("WWW-Authenticate") == "Bearer") == (status == 401)
        status, _, raw = _raw(server.url, "GET", kbs, headers={"Authorization": f"Bearer {token}"} if token else {})
        assert status == want, (token, raw[:200])
        if status == 200:
            assert [m["name"] for m in json.loads(raw)["manifests"]] == ["kb"]
