"""kdn.engines.sources: what a connector asks the network (match, fetch), over Ray and over
HTTP, on a real 3-region network with synthetic KV; tenants by salt; deadlines."""
import time

import numpy as np
import pytest
import ray

from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.engines.sources import NO_MATCH, Deadline, HTTPSource, RaySource, Tenant, Tenants
from kdn.core.errors import BadRequest, NetworkError
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
FP = "synthetic-model"


def test_salts_map_to_tenants_and_nothing_else():
    t = Tenants.from_config({"tenant": "default", "token": None,
                             "tenants": {"s1": "acme", "s2": {"tenant": "globex", "token": "t" * 16}}})
    assert t.of(None) == Tenant("default") and t.of("s1") == Tenant("acme")
    assert t.of("s2") == Tenant("globex", "t" * 16)
    assert t.of("unknown") is None, "an unknown salt must never fall back to the default tenant"
    with pytest.raises(BadRequest, match=r"tenants\['s3'\]"):
        Tenants.from_config({"tenants": {"s3": 7}})


def test_a_deadline_gives_up_waiting_not_the_caller():
    d = Deadline()
    assert d.run(1.0, lambda x: x + 1, 1) == 2
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        d.run(0.2, time.sleep, 3)
    assert time.monotonic() - t0 < 1.0


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("origin"), network="srcs", http=True)
    yield n
    stop_network(n)


@pytest.fixture(scope="module")
def kb(net):
    """A 644-token KB (two full chunks and a partial one) of tenant acme, and its KV."""
    rng = np.random.default_rng(11)
    toks = rng.integers(0, 49152, 644).tolist()
    kv = rng.standard_normal((2, 2, 2, 644, 8)).astype(np.float32)
    Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP).publish(
        "handbook", [("a", toks[:300]), ("b", toks[300:])], kv)
    return toks, kv


def _urls(net, region):
    return [ray.get(net.edge(e).ping.remote(), timeout=30)["http"]
            for e in net.topology.edges_in(region)]


def _sources(net, tenant="acme"):
    return [RaySource(net.name, "eu-west", Tenant(tenant), FP),
            HTTPSource(_urls(net, "eu-west") + _urls(net, "us-east"), Tenant(tenant), FP)]


def test_a_prompt_that_starts_with_the_kb_matches_all_of_it_trailing_chunk_included(net, kb):
    toks, kv = kb
    question = [7, 8, 9] * 11
    for src in _sources(net):
        m = src.match(toks + question)
        assert (m.tokens, len(m.keys), m.kb, m.version) == (644, 3, "handbook", 1), type(src)
        chunks, info = src.fetch(m.kb, m.version, m.keys[1:], timeout_s=10)
        assert info["edge"] is not None
        assert [c.tokens for c in chunks] == [256, 132]
        got = np.concatenate([c.kv for c in chunks], axis=3)
        assert np.array_equal(got, kv[:, :, :, 256:]), type(src)


def test_another_tenant_and_another_prompt_match_nothing(net, kb):
    toks, _ = kb
    for src in _sources(net, tenant="globex"):
        assert src.match(toks + [1, 2, 3]) == NO_MATCH
    for src in _sources(net):
        assert src.match(list(reversed(toks))) == NO_MATCH


def test_a_kb_published_a_moment_ago_is_found_at_once(net, kb):
    srcs = _sources(net)
    rng = np.random.default_rng(12)
    toks = rng.integers(0, 49152, 300).tolist()
    for src in srcs:
        assert src.match(toks + [1]) == NO_MATCH           # lists (and caches) the KBs
    Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP).publish(
        "fresh", [("d", toks)], rng.standard_normal((2, 2, 2, 300, 8)).astype(np.float32))
    time.sleep(1.1)                                         # past REFRESH_ON_MISS_S
    for src in srcs:
        assert src.match(toks + [1]).tokens == 300, type(src)


def test_http_fails_over_past_a_dead_url_and_says_so_when_none_answers(net, kb):
    toks, _ = kb
    src = HTTPSource(["http://127.0.0.1:9"] + _urls(net, "eu-west"), Tenant("acme"), FP)
    assert src.match(toks + [1]).tokens == 644 and src.edges.counters["failovers"] >= 1
    with pytest.raises(NetworkError, match="no edge answered"):
        HTTPSource(["http://127.0.0.1:9"], Tenant("acme"), FP).match(toks)


def test_http_surfaces_an_edge_that_answers_with_a_fault_instead_of_failing_over(net, kb):
    """A 5xx is a fault of that edge's own (a bug, a broken disk), not a dead edge: it
    surfaces as RemoteError, and the next edge is not tried as if the first were down."""
    import http.server
    import threading
    from kdn.core.errors import RemoteError

    class Broken(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = b'{"message": "a bug (a test\'s)"}'
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        do_POST = do_GET

        def log_message(self, *a):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Broken)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        toks, _ = kb
        src = HTTPSource([f"http://127.0.0.1:{server.server_port}"] + _urls(net, "eu-west"), Tenant("acme"), FP)
        with pytest.raises(RemoteError, match="500 a bug"):
            src.match(toks + [1])
        assert src.edges.counters["failovers"] == 0
    finally:
        server.shutdown()
        server.server_close()
