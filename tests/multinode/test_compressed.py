"""Compressed KV in the network: stored compressed at the origin and edges, sent per link.

A real 3-region Ray cluster on loopback (conftest), real actors, real codecs (kdn.core.codecs).
The KV is synthetic but shaped like a model's: float32 values with fp16 precision, so the
byte planes that carry no information compress (real SmolLM2 fp32 KV: 1.19x; this: ~2x).
"""
import pickle
import time

import numpy as np
import pytest
import ray

from kdn.core.chunk import Chunk, Encoded, as_chunk, encode
from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.transfer import check_accept
from kdn.core.errors import BadRequest, ChecksumMismatch
from kdn.client.http import EdgeHTTPClient
from kdn.core.keys import namespace_digest
from kdn.placement.topology import Topology

FP = "synthetic-model"
SHAPE = dict(layers=4, heads=4, head_dim=32)         # 1 MiB of fp32 KV per 256-token chunk
CHUNK_BYTES = 4 * 2 * 4 * 256 * 32 * 4


def model_like_kv(synth, n, seed=0):
    """fp32 KV holding fp16-precision values: what compresses in real KV, exaggerated."""
    return synth.kv(n, seed=seed, **SHAPE).astype(np.float16).astype(np.float32)


def _client(net, region="us-east", **kw):
    return Client(network=net.name, region=region, fingerprint=FP, **kw)


def _kv(f):
    return np.concatenate([c.kv for c in f.chunks], axis=3)


@ray.remote(num_cpus=0)
def _worker_fetch(network, prompt, accept=None):
    """A reader on some region's node: its client takes the region from the node's label."""
    cl = Client(network=network, fingerprint=FP, accept=accept)
    f = cl.fetch(prompt)
    return {"region": cl.region, "kv": _kv(f), "sources": f.sources, "codecs": f.codecs,
            "exact": f.exact, "wire_bytes": f.wire_bytes, "nbytes": f.nbytes, "edge": f.edge}


# --- the Encoded form -------------------------------------------------------------------------
def test_encoded_round_trips_pickles_and_reports_sizes(synth):
    kv = model_like_kv(synth, 256)
    c = Chunk(b"k" * 16, b"n" * 16, kv, "float32")
    e = Encoded.of(c, "zstd")
    assert e.exact and e.codec == "zstd" and e.raw == kv.nbytes and e.nbytes < 0.6 * kv.nbytes
    back = pickle.loads(pickle.dumps(e))
    assert back.decode().equal(c) and as_chunk(back).equal(c) and as_chunk(c) is c
    assert Encoded.from_frame(encode(c, "zstd")).decode().equal(c)
    lossy = Encoded.of(c, "q8z")
    assert not lossy.exact and lossy.nbytes < kv.nbytes / 3.5
    got = lossy.decode().kv
    assert not np.array_equal(got, kv) and np.abs(got - kv).max() < 0.05 * np.abs(kv).max()


def test_a_corrupt_encoded_frame_never_decodes(synth):
    c = Chunk(b"k" * 16, b"n" * 16, model_like_kv(synth, 256), "float32")
    e = Encoded.of(c, "zstd")
    frame = np.array(e.frame, copy=True)
    frame[-100] ^= 0x01
    bad = Encoded(e.key, e.ns, e.codec, e.dtype, e.raw, e.exact, frame)
    with pytest.raises(ChecksumMismatch):
        bad.decode()


# --- stored compressed ------------------------------------------------------------------------
def _one_edge_net(tmp_path, name, store_codec, origin_codec="raw"):
    topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=4 * CHUNK_BYTES)
    return start_network(topo, tmp_path / name, network=name, replicas=1,
                         edge_options={"store_codec": store_codec},
                         origin_options={"store_codec": origin_codec})


@pytest.mark.parametrize("codec", ["zstd", "q8z"])
def test_an_edge_storing_compressed_holds_more_chunks_and_serves_them(ray_cluster, tmp_path, synth,
                                                                      network_name, codec):
    toks, kv = synth.tokens(2048, seed=1), model_like_kv(synth, 2048, seed=1)   # 8 chunks, 8 MiB
    held = {}
    for store in ("raw", codec):
        net = _one_edge_net(tmp_path, f"{network_name}{store}", store, origin_codec="zstd")
        try:
            cl = _client(net)
            cl.publish("kb", [("d", toks)], kv)
            st = ray.get(net.edge("us-east-0").stats.remote(), timeout=30)
            held[store] = st["main"]["items"]
            assert st["store_codec"] == store
            assert st["main"]["bytes"] <= st["main"]["capacity"]
            if store != "raw":
                assert st["held_raw_bytes"] > st["main"]["capacity"], \
                    "a compressing edge holds more KV than its capacity in raw bytes"
            f = cl.fetch(toks + [1, 2, 3])
            assert f.tokens == 2048 and f.exact == (codec == "zstd" or store == "raw")
            if f.exact:
                assert np.array_equal(_kv(f), kv)
            else:
                assert np.abs(_kv(f) - kv).max() < 0.05 * np.abs(kv).max()
            ost = ray.get(net.origin.stats.remote(), timeout=30)
            assert ost["store"]["codec"] == "zstd" and ost["store"]["bytes"] < 0.7 * kv.nbytes
        finally:
            stop_network(net)
    assert held["raw"] == 3             # 3 MiB main tier, 1 MiB chunks
    assert held[codec] >= (5 if codec == "zstd" else 8), held


def test_origin_refuses_a_lossy_store_before_starting(ray_cluster, tmp_path, network_name):
    topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=4 * CHUNK_BYTES)
    with pytest.raises(BadRequest, match="lossy codec 'q4z'"):
        start_network(topo, tmp_path / "o", network=network_name,
                      origin_options={"store_codec": "q4z"})
    with pytest.raises(BadRequest, match="edge store codec must be one of"):
        start_network(topo, tmp_path / "o", network=network_name, edge_options={"store_codec": "gz"})


@pytest.mark.parametrize("codec", ["zstd", "q8z"])
def test_a_corrupt_compressed_copy_is_dropped_and_refetched(ray_cluster, tmp_path, synth,
                                                            network_name, codec):
    toks, kv = synth.tokens(768, seed=2), model_like_kv(synth, 768, seed=2)
    topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=64 * CHUNK_BYTES)
    net = start_network(topo, tmp_path / "o", network=network_name, replicas=1,
                        edge_options={"store_codec": codec, "fault_injection": True})
    try:
        cl = _client(net)
        cl.publish("kb", [("d", toks)], kv)
        keys, _ = cl.keys_for(toks, "kb")
        edge = net.edge("us-east-0")
        assert ray.get(edge.inject_corruption.remote(keys[1]), timeout=30)
        f = cl.fetch(toks)
        assert f.tokens == 768 and cl.counters["corrupt_chunks"] == 1, "the bad frame must be caught"
        if codec == "zstd":
            assert f.exact and np.array_equal(_kv(f), kv)
        else:
            assert not f.exact and np.abs(_kv(f) - kv).max() < 0.05 * np.abs(kv).max()
        st = ray.get(edge.stats.remote(), timeout=30)
        assert st["counters"]["corrupt_reported"] == 1 and st["counters"]["corrupt_detected"] >= 1
        deadline = time.time() + 30     # the edge refills a good copy from the origin (encoding
        while True:                     # it in the background, off the reader's time)
            f2 = cl.fetch(toks)
            if f2.codecs == {codec: 3} or time.time() > deadline:
                break
            time.sleep(0.1)
        assert cl.counters["corrupt_chunks"] == 1 and f2.codecs == {codec: 3}
    finally:
        stop_network(net)


# --- chosen per link --------------------------------------------------------------------------
def _thin_link_topology(edge_regions=("us-east", "eu-west")):
    """us-east and eu-west joined by a thin 20 MB/s link (a WAN); edges where asked."""
    regions = {"us-east": (0.2, 10.0), "eu-west": (0.2, 10.0)}
    links = {("us-east", "eu-west"): (40.0, 0.02)}
    edges = [(f"{r}-0", r, 64 * CHUNK_BYTES) for r in edge_regions]
    return Topology(regions, links, edges, "us-east", source="thin-link")


def test_chunks_cross_a_thin_link_compressed_and_stay_raw_beside_the_reader(
        ray_cluster, tmp_path, synth, network_name):
    toks, kv = synth.tokens(2048, seed=3), model_like_kv(synth, 2048, seed=3)
    net = start_network(_thin_link_topology(), tmp_path / "o", network=network_name, replicas=1)
    try:
        _client(net).publish("kb", [("d", toks)], kv)
        got = ray.get(_worker_fetch.options(label_selector={"region": "eu-west"})
                      .remote(net.name, toks), timeout=120)
        assert got["region"] == "eu-west" and got["edge"] == "eu-west-0"
        assert got["exact"] and np.array_equal(got["kv"], kv)
        far = sum(s == "peer:us-east-0" for s in got["sources"])
        near = sum(s == "local" for s in got["sources"])
        assert far and near and far + near == 8, got["sources"]
        # the edge beside the reader sends raw (zero-copy); the one across the link, zstd
        assert got["codecs"] == {"raw": near, "zstd": far}
        assert got["wire_bytes"] < got["nbytes"] - far * CHUNK_BYTES * 0.3
        far_edge = ray.get(net.edge("us-east-0").stats.remote(), timeout=30)["counters"]
        near_edge = ray.get(net.edge("eu-west-0").stats.remote(), timeout=30)["counters"]
        assert far_edge["transcoded"] == far and "transcoded" not in near_edge
        assert near_edge["sent_zstd"] == far and near_edge["sent_raw"] == near
    finally:
        stop_network(net)


def test_a_reader_that_accepts_a_lossy_codec_gets_it_over_a_thin_link(
        ray_cluster, tmp_path, synth, network_name):
    toks, kv = synth.tokens(1024, seed=4), model_like_kv(synth, 1024, seed=4)
    # eu-west has no edge: its readers are served from us-east, across the thin link
    net = start_network(_thin_link_topology(("us-east",)), tmp_path / "o", network=network_name,
                        replicas=1)
    try:
        _client(net).publish("kb", [("d", toks)], kv)
        where = {"region": "eu-west"}
        exact = ray.get(_worker_fetch.options(label_selector=where).remote(net.name, toks), timeout=120)
        assert exact["edge"] == "us-east-0" and exact["codecs"] == {"zstd": 4}
        assert exact["exact"] and np.array_equal(exact["kv"], kv)
        lossy = ray.get(_worker_fetch.options(label_selector=where).remote(net.name, toks, ["q8z"]),
                        timeout=120)
        assert lossy["codecs"] == {"q8z": 4} and not lossy["exact"]
        assert lossy["wire_bytes"] < kv.nbytes / 3.5
        assert np.abs(lossy["kv"] - kv).max() < 0.05 * np.abs(kv).max()
        # beside the edge (the driver runs on the us-east node) nothing is transcoded
        f = _client(net, accept=["q8z"]).fetch(toks)
        assert f.codecs == {"raw": 4} and f.exact and np.array_equal(_kv(f), kv)
    finally:
        stop_network(net)


def test_http_sends_a_stored_frame_as_it_is(ray_cluster, tmp_path, synth, network_name):
    toks, kv = synth.tokens(512, seed=5), model_like_kv(synth, 512, seed=5)
    topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=64 * CHUNK_BYTES)
    net = start_network(topo, tmp_path / "o", network=network_name, replicas=1, http=True,
                        edge_options={"store_codec": "zstd"})
    try:
        cl = _client(net)
        cl.publish("kb", [("d", toks)], kv)
        keys, _ = cl.keys_for(toks, "kb")
        url = ray.get(net.edge("us-east-0").ping.remote(), timeout=30)["http"]
        ns = namespace_digest("default", FP)
        with EdgeHTTPClient(url) as h:
            as_stored = h.fetch(keys, ns, codec="zstd")
            raw = h.fetch(keys, ns)
            auto = h.fetch(keys, ns, codec="auto")        # no region: beside the edge, as stored
        for f in (as_stored, raw, auto):
            assert f.exact and np.array_equal(_kv(f), kv)
        assert as_stored.codecs == auto.codecs == {"zstd": 2} and raw.codecs == {"raw": 2}
        assert as_stored.wire_bytes < 0.6 * raw.wire_bytes
    finally:
        stop_network(net)


def test_a_corrupt_copy_is_never_encoded_lossy_for_a_reader(ray_cluster, tmp_path, synth, network_name):
    """A lossy frame cannot be checked against the manifest: the edge checks before encoding."""
    toks, kv = synth.tokens(1024, seed=6), model_like_kv(synth, 1024, seed=6)
    net = start_network(_thin_link_topology(("us-east",)), tmp_path / "o", network=network_name,
                        replicas=1, edge_options={"fault_injection": True})
    try:
        cl = _client(net)
        cl.publish("kb", [("d", toks)], kv)
        keys, _ = cl.keys_for(toks, "kb")
        edge = net.edge("us-east-0")
        assert ray.get(edge.inject_corruption.remote(keys[1]), timeout=30)
        got = ray.get(_worker_fetch.options(label_selector={"region": "eu-west"})
                      .remote(net.name, toks, ["q8z"]), timeout=120)
        assert got["codecs"] == {"q8z": 4} and got["sources"][1] == "origin", got["sources"]
        assert np.abs(got["kv"] - kv).max() < 0.05 * np.abs(kv).max()
        st = ray.get(edge.stats.remote(), timeout=30)["counters"]
        assert st["corrupt_dropped"] == 1 and st["corrupt_detected"] >= 1
    finally:
        stop_network(net)


def test_http_never_sends_a_corrupt_stored_frame(ray_cluster, tmp_path, synth, network_name):
    toks, kv = synth.tokens(512, seed=7), model_like_kv(synth, 512, seed=7)
    topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=64 * CHUNK_BYTES)
    net = start_network(topo, tmp_path / "o", network=network_name, replicas=1, http=True,
                        edge_options={"store_codec": "zstd", "fault_injection": True})
    try:
        cl = _client(net)
        cl.publish("kb", [("d", toks)], kv)
        keys, _ = cl.keys_for(toks, "kb")
        edge = net.edge("us-east-0")
        url = ray.get(edge.ping.remote(), timeout=30)["http"]
        assert ray.get(edge.inject_corruption.remote(keys[1]), timeout=30)
        ns = namespace_digest("default", FP)
        with EdgeHTTPClient(url) as h:
            got = h.fetch(keys, ns, codec="zstd")      # the bad copy dropped, refetched
        assert len(got.chunks) == 2 and got.exact and np.array_equal(_kv(got), kv)
        assert got.sources == ["local", "origin"]
        assert ray.get(edge.stats.remote(), timeout=30)["counters"]["corrupt_dropped"] == 1
    finally:
        stop_network(net)


def test_a_lossy_codec_that_kept_the_raw_bytes_is_exact():
    kv = np.full((2, 2, 2, 256, 8), np.inf, np.float32)      # not quantizable: stored raw
    e = Encoded.of(Chunk(b"k" * 16, b"n" * 16, kv, "float32"), "q8z")
    assert e.codec == "q8z" and e.exact and e.nbytes > kv.nbytes
    assert np.array_equal(e.decode().kv, kv)


def test_accept_must_be_a_list_of_names():
    for bad in (5, "q8z", (c for c in ["q8z"]), [1]):
        with pytest.raises(BadRequest, match="accept must be a list of codec names"):
            check_accept(bad)


def test_a_compressed_origin_sends_its_stored_frames(ray_cluster, tmp_path, synth, network_name):
    """Origin zstd, edges zstd: frames go out as stored and are kept without re-encoding;
    an edge storing raw decodes them; readers get the exact KV either way."""
    toks, kv = synth.tokens(1024, seed=8), model_like_kv(synth, 1024, seed=8)
    for store in ("zstd", "raw"):
        net = _one_edge_net(tmp_path, f"{network_name}{store}", store, origin_codec="zstd")
        try:
            cl = _client(net)
            cl.publish("kb", [("d", toks)], kv)
            st = ray.get(net.edge("us-east-0").stats.remote(), timeout=30)
            assert st["counters"].get("stored_encoded", 0) == 0, "nothing re-encoded at the edge"
            f = cl.fetch(toks)
            assert f.exact and np.array_equal(_kv(f), kv)
            if store == "zstd":     # all 4 fit compressed; they arrived and stay as stored
                assert st["main"]["items"] == 4 and f.codecs == {"zstd": 4}
                assert f.sources == ["local"] * 4
            else:                   # 3 fit raw; the 4th comes from the origin as its frame
                assert st["main"]["items"] == 3 and f.codecs == {"raw": 3, "zstd": 1}
                assert f.sources.count("origin") == 1
        finally:
            stop_network(net)
