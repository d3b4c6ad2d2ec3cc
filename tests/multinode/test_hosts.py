"""Regions on hosts with their own addresses (kdn.testing.netns): every region but the head's
runs its Ray node in its own Linux network namespace on a bridge this module creates, edges bind
their host's address, and KV crosses real (virtual) links. Skipped, with the reason, where
namespaces cannot be made (not root, no iproute2).

This module's driver leaves the session's loopback cluster for the host cluster and joins it
again afterwards (a process is one Ray cluster's driver at a time).
"""
import functools
import time
import uuid

import numpy as np
import pytest
import ray

from kdn.testing import netns

why = netns.available()
pytestmark = pytest.mark.skipif(why is not None, reason=f"namespaced hosts: {why}")

REGIONS = ("us-east", "eu-west", "ap-south")
FP = "synthetic-model"
ADMIN = "admin-token-hosts-0123456789"
ACME = "acme-read-token-0123456789"
AUTH = {"admin": ADMIN, "readers": {"acme": ACME}}


@pytest.fixture(scope="module")
def hosts():
    from kdn.client.join import init_ray
    before = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    if before:
        ray.shutdown()
    cluster = None
    try:
        cluster = netns.HostCluster(REGIONS, cpus=1, object_store_bytes=256 << 20)
        yield cluster
    finally:
        if cluster is not None:
            cluster.shutdown()
        if before:                   # the session's cluster again, for this worker's next modules
            init_ray(before)


def _start(cluster, tmp_path, name=None, **kw):
    from kdn.launch.cluster import start_network
    from kdn.placement.topology import Topology
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=128 << 20)
    return start_network(topo, tmp_path / "origin", network=name or f"h{uuid.uuid4().hex[:8]}",
                         http=True, auth=AUTH, edge_options={"http_host": "node"}, **kw)


def _publish(net, name, toks, kv):
    from kdn.client import Client
    Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP,
           admin_token=ADMIN).publish(name, [("d", toks)], kv)


def _http_reader(urls, timeout_s):
    """A reader over HTTP from this host (the head's), to the edges at urls in that order."""
    from kdn.client.http import HTTPEdges
    from kdn.client.reader import Reader
    edges = HTTPEdges(urls, token=ACME, allow_remote=True, timeout_s=timeout_s)
    return edges, Reader(edges, "acme", FP, token=ACME)


def _urls(net):
    return {name: ray.get(h.ping.remote(), timeout=30)["http"] for name, h in net.edges.items()}


@ray.remote(num_cpus=0)
def _worker_fetch(network, prompt, expected):
    """A worker on some region's host: its client takes the region from its node's label."""
    from kdn.client import Client
    cl = Client(network=network, tenant="acme", fingerprint=FP, token=ACME)
    f = cl.fetch(prompt)
    got = np.concatenate(f.kv_parts(), axis=3)
    return {"region": cl.region, "node_ip": ray.util.get_node_ip_address(), "edge": f.edge,
            "tokens": f.tokens, "equal": bool(np.array_equal(got, expected))}


def test_each_region_is_a_host_of_its_own_and_every_worker_reads_its_own_regions_edge(hosts, tmp_path, synth):
    net = _start(hosts, tmp_path)
    try:
        urls = _urls(net)
        for region in REGIONS:               # each edge listens on its host's address, not loopback
            assert urls[f"{region}-0"].startswith(f"http://{hosts.address_of(region)}:")
        toks, kv = synth.tokens(800, seed=11), synth.kv(800, seed=11)
        _publish(net, "hosted", toks, kv)
        # the origin's push: over its HTTP frames to the edges on other hosts, over Ray to the
        # one on its own node (us-east's, the head's)
        ray.get(net.origin.pushes_settled.remote(token=ADMIN), timeout=120)
        origin = ray.get(net.origin.stats.remote(token=ADMIN), timeout=30)
        assert origin["http"]["url"].startswith(f"http://{hosts.address_of('us-east')}:")
        got = {e: ray.get(h.stats.remote(token=ADMIN), timeout=30) for e, h in net.edges.items()}
        by_http = {e: s["data_plane"].get("origin_http_chunks", 0) for e, s in got.items()}
        held = {e: s["main"]["items"] for e, s in got.items()}
        assert by_http["us-east-0"] == 0 and all(by_http[e] == held[e] > 0 for e in ("eu-west-0", "ap-south-0")), (by_http, held)
        assert origin["counters"]["push_http_chunks"] == by_http["eu-west-0"] + by_http["ap-south-0"]
        assert origin["counters"]["chunks_pushed"] == sum(held.values())
        refs = [_worker_fetch.options(label_selector={"region": r}).remote(net.name, toks + [1, 2], kv)
                for r in REGIONS]
        for r, got in zip(REGIONS, ray.get(refs, timeout=120)):
            assert got["node_ip"] == hosts.address_of(r)
            assert got["region"] == r and got["edge"] == f"{r}-0"
            assert got["tokens"] == 800 and got["equal"]
        # what an edge lacked came from its peers on the other hosts over HTTP frames, not Ray
        planes = [ray.get(h.stats.remote(token=ADMIN), timeout=30)["data_plane"] for h in net.edges.values()]
        assert sum(p.get("peer_http_chunks", 0) for p in planes) > 0
        assert sum(p.get("peer_ray_pulls", 0) for p in planes) == 0
        assert all(p["mode"] == "auto" for p in planes)
    finally:
        from kdn.launch.cluster import stop_network
        stop_network(net)


def test_an_edge_refuses_to_listen_off_loopback_without_tokens(hosts, tmp_path):
    from kdn.core.errors import KDNError
    from kdn.launch.cluster import start_network
    from kdn.placement.topology import Topology
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=64 << 20)
    with pytest.raises(KDNError, match="off loopback, without .*read tokens"):
        start_network(topo, tmp_path / "o", network=f"h{uuid.uuid4().hex[:8]}", http=True,
                      auth={"admin": ADMIN}, edge_options={"http_host": "node"})


def test_a_reader_over_http_fails_over_once_when_a_host_is_cut_off_and_reads_no_wrong_byte(hosts, tmp_path, synth):
    net = _start(hosts, tmp_path)
    try:
        urls = _urls(net)
        toks, kv = synth.tokens(600, seed=12), synth.kv(600, seed=12)
        _publish(net, "cut", toks, kv)
        edges, reader = _http_reader([urls["eu-west-0"], urls["ap-south-0"]], 3.0)
        first = reader.fetch(toks)
        assert first.tokens == 600 and first.edge == urls["eu-west-0"]
        assert np.array_equal(np.concatenate(first.kv_parts(), axis=3), kv)
        hosts.hosts.cut("eu-west")                   # its link down: packets vanish, no reset
        try:
            t0 = time.monotonic()
            got = reader.fetch(toks)
            took = time.monotonic() - t0
        finally:
            hosts.hosts.cut("eu-west", down=False)
        assert got.tokens == 600 and got.edge == urls["ap-south-0"]
        assert np.array_equal(np.concatenate(got.kv_parts(), axis=3), kv)
        assert edges.counters["failovers"] == 1 and took < 30
    finally:
        from kdn.launch.cluster import stop_network
        stop_network(net)


def test_an_owner_behind_a_capped_link_is_chosen_less_once_measured(hosts, tmp_path, synth):
    """us-east's edge pulls the keys eu-west-0 and ap-south-0 both own (neither its own). The
    topology declares eu-west nearer (55 ms against 80); eu-west's link is capped to 40 Mbit/s.
    The first KB comes from eu-west, as declared; its pull is measured, and every later KB
    comes from ap-south (measured too, then): the capped owner is chosen less. A reader's own
    choice of edge does the same with what its view measured."""
    from kdn.client import Client
    net = _start(hosts, tmp_path)
    try:
        pub = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, admin_token=ADMIN)
        kbs = []
        for i in range(4):        # 1 MiB chunks: a pull of a few outlasts the cap's burst
            toks, kv = synth.tokens(3072, seed=40 + i), synth.kv(3072, layers=4, heads=4, head_dim=32, seed=40 + i)
            pub.publish(f"capped-{i}", [("d", toks)], kv)
            kbs.append((toks, kv))
        ray.get(net.origin.pushes_settled.remote(token=ADMIN), timeout=120)
        hosts.hosts.cap("eu-west", "40mbit", burst="64kb")
        reader = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, token=ACME)
        pulled = []
        try:
            for toks, kv in kbs:
                f = reader.fetch(toks)
                assert f.edge == "us-east-0" and f.tokens == 3072
                assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
                pulled.append([s for s in f.sources if s.startswith("peer:")])
        finally:
            hosts.hosts.uncap("eu-west")
        assert pulled[0] and set(pulled[0]) == {"peer:eu-west-0"}        # declared nearer
        later = [s for p in pulled[1:] for s in p]
        assert later and set(later) == {"peer:ap-south-0"}               # measured faster
        stats = ray.get(net.edges["us-east-0"].stats.remote(token=ADMIN), timeout=30)
        links = stats["links"]
        assert links["eu-west-0"]["gbps"] < 0.01 < links["ap-south-0"]["gbps"]
        from kdn.cli.cluster import status_rows          # what `kdn status` prints of them
        shown = dict(part.split(" ", 1) for part in status_rows({"edges": [stats]})[0]["links (rtt, GB/s)"].split("; "))
        assert shown["eu-west-0"].endswith(" 0.00") and " ms " in shown["eu-west-0"], shown
        assert float(shown["ap-south-0"].split()[-1]) == round(links["ap-south-0"]["gbps"], 2) > 0, shown
        # a reader that declares itself in eu-west but runs here, behind eu-west's capped link:
        # its first reads go to eu-west's edge, as declared; once two were measured slow, the
        # next ones go to another region's edge (kdn/client/view.py: its own measured links)
        hosts.hosts.cap("eu-west", "40mbit", burst="64kb")
        misplaced = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=FP, token=ACME)
        try:
            got = []
            for toks, kv in kbs:         # (synthetic KV moved, not computed: equal bytes on any CPU)
                f = misplaced.fetch(toks)
                assert f.tokens == 3072 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)
                got.append(f.edge)
        finally:
            hosts.hosts.uncap("eu-west")
        assert got[:2] == ["eu-west-0"] * 2 and "eu-west-0" not in got[2:], got
        seen = misplaced.view.links.stats()
        assert seen["eu-west-0"]["gbps"] < 0.01 and seen["eu-west-0"]["transfers"] == 2, seen
        if got[2] != "us-east-0":                 # (the edge beside this reader is read over Ray: unmeasured)
            assert seen[got[2]]["gbps"] > 0.01, seen
    finally:
        from kdn.launch.cluster import stop_network
        stop_network(net)


def test_the_service_answers_from_each_regions_host_with_the_kv_of_that_regions_edge(hosts, tmp_path, model,
                                                                                    monkeypatch):
    """`kdn serve` on the host cluster: one replica per region, placed on that region's host;
    each region's URL answers the model's own full prefill, the KB's KV read by the region's
    replica from its own region's edge (each edge counts the fetch). Its tokens are compared with
    the same read made here (KV fetched, question computed over it), bit for bit the same work
    on this CPU; a full prefill is compared with that read elsewhere (kdn query --check)."""
    import httpx
    from kdn.cli import main as kdn
    from kdn.cli.knowledge import bundled_documents
    from kdn.client import Client
    from kdn.client.publish import publish_documents
    from kdn.engines.transformers.model import MODEL_NAME
    from kdn.launch.cluster import free_ports, stop_network
    from kdn.engines.transformers.worker import answer
    from kdn.serve.chat import messages_tokens
    net = _start(hosts, tmp_path)
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)          # `kdn serve` reads the tokens here
    monkeypatch.setenv("KDN_READ_TOKENS", f"acme={ACME}")
    where = ["--address", hosts.address, "--network", net.name]
    try:
        pub = Client(network=net.name, region="us-east", tenant="acme", fingerprint=model.fingerprint,
                     admin_token=ADMIN)
        docs = dict(bundled_documents())
        receipt = publish_documents(pub, model, "rights", [("bill-of-rights", docs["bill-of-rights"])])
        ray.get(net.origin.pushes_settled.remote(token=ADMIN), timeout=120)
        messages = [{"role": "user", "content": "What does the Eighth Amendment forbid?"}]
        prompt = pub.manifest("rights").token_ids().tolist() + messages_tokens(model, messages)
        # the same read here (the KB's KV fetched, the question computed over it: the replicas'
        # kernels and shapes on this CPU), not a full prefill, which may differ in a last bit
        mine = answer(Client(network=net.name, region="us-east", tenant="acme", fingerprint=model.fingerprint,
                             token=ACME), model, "rights", messages[0]["content"], max_new_tokens=8)
        assert mine.prompt_tokens == len(prompt) and mine.cached_tokens == receipt["tokens"]
        want = model.tokenizer.decode(mine.tokens, skip_special_tokens=True)
        port = free_ports(1)[0]
        assert kdn(["serve", *where, "--regions", ",".join(REGIONS), "--port", str(port),
                    "--replica-cpus", "0", "--routers", "1"]) == 0
        from kdn.serve.app import service_info
        info = service_info(net.name)
        placed = {r: info["deployments"][r]["nodes"] for r in REGIONS}
        assert placed == {r: [hosts.address_of(r)] for r in REGIONS}, placed
        for region in REGIONS:
            edge = net.edges[f"{region}-0"]
            before = ray.get(edge.stats.remote(token=ADMIN), timeout=30)["counters"].get("fetches", 0)
            r = httpx.post(f"http://127.0.0.1:{port}/{region}/v1/chat/completions", timeout=300,
                           headers={"Authorization": f"Bearer {ACME}"},
                           json={"model": f"{MODEL_NAME}@rights", "messages": messages, "max_tokens": 8})
            assert r.status_code == 200, r.text
            body = r.json()
            assert r.headers["x-kdn-region"] == region and body["choices"][0]["message"]["content"] == want
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == receipt["tokens"]
            after = ray.get(edge.stats.remote(token=ADMIN), timeout=30)["counters"].get("fetches", 0)
            assert after > before, (region, before, after)
    finally:
        kdn(["serve", *where, "--down"])
        stop_network(net)


@pytest.fixture(scope="module")
def carrier(hosts, tmp_path_factory):
    """One network for the tests of bulk bytes between hosts below (each reads the deltas of
    the counters it checks, and its own keys)."""
    from kdn.launch.cluster import stop_network
    net = _start(hosts, tmp_path_factory.mktemp("carrier"))
    yield net
    stop_network(net)


def _stats(net, node):
    return ray.get((net.origin if node == "origin" else net.edges[node]).stats.remote(token=ADMIN), timeout=30)


def _grew(before: dict, after: dict, name: str) -> int:
    return after.get(name, 0) - before.get(name, 0)


def test_stores_acknowledged_on_another_host_reach_the_origin_over_that_edges_frames(carrier):
    """An edge's write-behind crosses hosts over the data plane: the origin is handed the keys
    over Ray and pulls the bytes from that edge's HTTP frames. The edge on the origin's own
    host hands its stores over by reference (Ray, one node). The origin holds the very bytes
    each edge acknowledged."""
    from kdn.core.keys import namespace_digest
    from kdn.integrations.objects import object_key, pack
    net = carrier
    before = {n: _stats(net, n) for n in ("origin", "eu-west-0", "us-east-0")}
    ns, rng, stored = namespace_digest("acme", "lmcache/hosts"), np.random.default_rng(5), []
    for region in ("eu-west", "us-east"):
        objs = [pack(object_key(ns, f"{region}-{i}".encode()), ns,
                     rng.integers(0, 255, 1 << 20, dtype=np.uint8)) for i in range(6)]
        edge = net.edges[f"{region}-0"]
        assert ray.get(edge.put_objects.remote(objs, token=ADMIN), timeout=60) == {
            "received": 6, "kept": 6, "pending": 6}
        assert ray.get(edge.stores_durable.remote(60.0, token=ADMIN), timeout=90)["durable"]
        stored += objs
    after = {n: _stats(net, n) for n in before}
    eu, us = (functools.partial(_grew, before[e]["stores"], after[e]["stores"]) for e in ("eu-west-0", "us-east-0"))
    assert eu("store_forwarded_http") == 6 and eu("store_forwarded_by_ref") == 0, after["eu-west-0"]["stores"]
    assert eu("store_forwarded_http_bytes") == sum(c.nbytes for c in stored[:6])
    assert us("store_forwarded_http") == 0 and us("store_forwarded_by_ref") == 6, after["us-east-0"]["stores"]
    assert us("store_forward_http_declined") == 1
    origin = functools.partial(_grew, before["origin"]["counters"], after["origin"]["counters"])
    assert origin("objects_pulled_http") == 6 and origin("object_pull_http_missing") == 0
    assert origin("objects_written") == 12
    back = ray.get(net.origin.get_chunks.remote([c.key for c in stored], token=ADMIN), timeout=60)
    assert [b.kv.tobytes() for b in back] == [c.kv.tobytes() for c in stored]    # the bytes acknowledged


@ray.remote(num_cpus=0)
def _store_at_a_far_edge(network, region, datas):
    """A cache layer's stores acknowledged at `region`'s edge, from this host (another one):
    its namespace and keys, the view's data plane counters, and the refusal a wrong token gets."""
    from kdn.core.errors import AccessDenied
    from kdn.integrations.objects import Objects, object_key
    obj = Objects.connect(network, region, "hosts", admin_token=ADMIN)
    ns = obj.namespace("acme", "far-stores")
    keys = [object_key(ns, f"far-{i}".encode()) for i in range(len(datas))]
    sent = obj.store([(ns, k) for k in keys], datas)
    plane = obj.view.plane.stats()
    obj.close()
    wrong = Objects.connect(network, region, "hosts", admin_token="not-the-admin-token")
    try:
        wrong.store([(ns, object_key(ns, b"refused"))], datas[:1])
        refused = None
    except AccessDenied as e:
        refused = str(e)
    wrong.close()
    return {"sent": sent, "plane": plane, "refused": refused, "ns": ns, "keys": keys}


def test_stores_at_an_edge_on_another_host_go_over_its_http_server(carrier):
    """A cache layer's store acknowledged at an edge on another host than the writer's goes
    as frames to that edge's HTTP server (with the admin token, off loopback), not through Ray's
    object manager; a wrong token is refused; the origin ends up with the very bytes."""
    from kdn.integrations.objects import unpack_into
    net = carrier
    datas = [np.random.default_rng(23 + i).integers(0, 255, n, dtype=np.uint8)
             for i, n in enumerate((2 << 20, 700_000, 4096))]
    before = _stats(net, "eu-west-0")["counters"]
    got = ray.get(_store_at_a_far_edge.options(label_selector={"region": "ap-south"}).remote(
        net.name, "eu-west", datas), timeout=120)
    after = _stats(net, "eu-west-0")["counters"]
    assert got["sent"] == sum(d.size for d in datas)
    assert got["plane"]["http_puts"] == 1 and got["plane"]["http_put_bytes"] >= got["sent"], got["plane"]
    assert _grew(before, after, "store_http_objects") == 3 and _grew(before, after, "store_acked_edge") == 3
    assert got["refused"] is not None and "admin token" in got["refused"] and "403" in got["refused"], got
    assert ray.get(net.edges["eu-west-0"].stores_durable.remote(60.0, token=ADMIN), timeout=90)["durable"]
    back = ray.get(net.origin.get_chunks.remote(got["keys"], token=ADMIN), timeout=60)
    outs = [np.zeros(d.size, np.uint8) for d in datas]
    assert all(unpack_into(b, o) for b, o in zip(back, outs))
    assert all(np.array_equal(o, d) for o, d in zip(outs, datas))      # moved bytes, none computed


@ray.remote(num_cpus=0)
def _wrong_token_store(network, region, n_bytes):
    """A store with a wrong admin token at `region`'s edge, from this host: the refusal, how
    long the store call took, and how many connections the writer's pool made."""
    from kdn.core.errors import AccessDenied
    from kdn.integrations.objects import Objects, object_key
    obj = Objects.connect(network, region, "hosts", admin_token="not-the-admin-token")
    ns = obj.namespace("acme", "slow-link")
    data = np.random.default_rng(29).integers(0, 255, n_bytes, dtype=np.uint8)
    t0 = time.monotonic()
    try:
        obj.store([(ns, object_key(ns, b"refused"))], [data])
        refused = None
    except AccessDenied as e:
        refused = str(e)
    took = time.monotonic() - t0
    obj.close()
    return {"refused": refused, "took_s": took}


def test_a_refused_store_on_a_slow_link_is_answered_at_once_not_after_its_body(carrier, hosts):
    """A store with a wrong token, 64 MiB at eu-west's edge behind a 30 Mbit/s link (18 s of
    body): the edge refuses it from its headers, and the writer reads that refusal as soon as
    it comes, stops sending, and raises the edge's 403. Before, the writer sent until the
    edge's server stopped draining the body (10 s) and reset the connection, took the reset
    for a dead edge, and went on to the origin: 20.8 s, the body sent twice."""
    net = carrier
    before = _stats(net, "eu-west-0")["counters"]
    hosts.hosts.cap("eu-west", "30mbit")
    try:
        got = ray.get(_wrong_token_store.options(label_selector={"region": "ap-south"}).remote(
            net.name, "eu-west", 64 << 20), timeout=120)
    finally:
        hosts.hosts.uncap("eu-west")
    assert got["refused"] is not None and "refused POST /v1/objects: 403" in got["refused"], got
    assert _urls(net)["eu-west-0"] in got["refused"]     # the edge on its host said so, not the origin
    assert got["took_s"] < 6, got                # the body alone takes 18 s on this link
    assert _grew(before, _stats(net, "eu-west-0")["counters"], "store_http_writes") == 0


@ray.remote(num_cpus=0)
def _write_from_host(network, toks, kv, ns, keys, datas):
    """A publisher and a cache layer's stores acknowledged at the origin, on some region's host:
    how their bytes went, and the view's own counters."""
    from kdn.client import Client
    from kdn.integrations.objects import Objects
    cl = Client(network=network, tenant="acme", fingerprint=FP, admin_token=ADMIN)
    receipt = cl.publish("written", [("d", toks)], kv)
    objects = Objects(cl.view, "hosts", admin_token=ADMIN, ack="origin")
    sent = objects.store([(ns, k) for k in keys], datas)
    return {"node_ip": ray.util.get_node_ip_address(), "publish": cl.view.writes().stats(),
            "objects": objects.stats()["origin_writes"], "sent": sent, "version": receipt["version"]}


def test_a_publish_and_stores_at_the_origin_from_another_host_go_over_its_http_server(carrier, hosts, synth):
    """Bulk writes from another host than the origin's go as frames to the origin's own HTTP
    server, verified there, not through Ray's object manager: a publish's chunks and a cache
    layer's objects acknowledged at the origin. The origin holds the very bytes, and a reader
    gets the published KV."""
    from kdn.client import Client
    from kdn.core.keys import namespace_digest
    from kdn.integrations.objects import object_key
    net = carrier
    toks, kv = synth.tokens(600, seed=17), synth.kv(600, seed=17)
    ns, rng = namespace_digest("acme", "hosts/written"), np.random.default_rng(17)
    datas = [rng.integers(0, 255, 300_000, dtype=np.uint8) for _ in range(4)]
    keys = [object_key(ns, f"w{i}".encode()) for i in range(4)]
    before = _stats(net, "origin")["http"]
    got = ray.get(_write_from_host.options(label_selector={"region": "ap-south"}).remote(
        net.name, toks, kv, ns, keys, datas), timeout=120)
    assert got["node_ip"] == hosts.address_of("ap-south")
    assert got["publish"]["http_writes"] >= 1 and got["publish"].get("ray_writes", 0) == 0, got
    assert got["objects"]["http_frames"] == 4 and got["objects"].get("ray_writes", 0) == 0, got
    http = functools.partial(_grew, before, _stats(net, "origin")["http"])
    assert http("ingest_chunks_frames") == got["publish"]["http_frames"] > 0
    assert http("ingest_objects_frames") == 4
    back = ray.get(net.origin.get_chunks.remote(keys, token=ADMIN), timeout=60)
    assert [b.kv[:-8].tobytes() for b in back] == [d.tobytes() for d in datas]    # less the trailer
    f = Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP, token=ACME).fetch(toks + [1])
    assert f.tokens == 600 and np.array_equal(np.concatenate(f.kv_parts(), axis=3), kv)   # moved, not computed


@ray.remote(num_cpus=0)
def _keep_conversation(network, toks, kv):
    """A worker on some region's host keeps a conversation's whole chunks at its home edge there."""
    from kdn.client import Client
    from kdn.client.history import History
    cl = Client(network=network, tenant="acme", fingerprint=FP, token=ACME)
    return History(cl.view, "acme", FP, token=ACME).store(toks, kv, 0, 0)


def test_a_conversation_kept_on_one_host_is_read_from_another_over_its_home_edges_frames(carrier, synth):
    """A conversation's next turn in another region reads its history from the home edge on
    the other host over that edge's HTTP frames (POST /v1/conversation, the tenant's read
    token), not Ray's object manager: the bytes kept, verified."""
    from kdn.client import Client
    from kdn.client.history import History
    net = carrier
    toks, kv = synth.tokens(700, seed=19), synth.kv(700, seed=19)
    before = _stats(net, "ap-south-0")["counters"]
    kept = ray.get(_keep_conversation.options(label_selector={"region": "ap-south"}).remote(
        net.name, toks, kv), timeout=120)
    assert kept["edge"] == "ap-south-0" and kept["chunks"] == 2
    history = History(Client(network=net.name, region="us-east", tenant="acme", fingerprint=FP,
                             token=ACME).view, "acme", FP, token=ACME)   # here: us-east's host
    found = history.find(toks + [7], 0, hints=["ap-south"])
    assert (found.edge, found.held) == ("ap-south-0", 2)
    chunks = history.fetch(found)
    assert history.counters["fetches_http"] == 1 and "fetch_unreachable" not in history.counters
    assert history.view.plane.stats()["http_conversation_fetches"] == 1
    # the KV moved, not computed: the very bytes kept, on any CPU
    assert np.array_equal(np.concatenate([c.kv for c in chunks], axis=3), kv[:, :, :, :512])
    assert _grew(before, _stats(net, "ap-south-0")["counters"], "conversation_chunks_served") == 2


def test_a_killed_host_costs_its_readers_one_failover(hosts, tmp_path, synth):
    """Last in the module: the host's node is gone for good. Its origin serves its frames on
    loopback, which only its own host reaches: the edges on the other hosts say so and get its
    pushes over Ray, the published bytes all the same."""
    net = _start(hosts, tmp_path, origin_options={"http_host": "127.0.0.1"})
    urls = _urls(net)
    toks, kv = synth.tokens(700, seed=13), synth.kv(700, seed=13)
    _publish(net, "killed", toks, kv)
    ray.get(net.origin.pushes_settled.remote(token=ADMIN), timeout=120)
    counters = ray.get(net.origin.stats.remote(token=ADMIN), timeout=30)["counters"]
    assert counters.get("push_http_chunks", 0) == 0 and counters["push_ray_chunks"] > 0
    assert counters["push_http_unreached"] >= 1
    edges, reader = _http_reader([urls["ap-south-0"], urls["us-east-0"]], 5.0)
    first = reader.fetch(toks)
    assert first.edge == urls["ap-south-0"] and np.array_equal(np.concatenate(first.kv_parts(), axis=3), kv)
    hosts.kill("ap-south")
    got = reader.fetch(toks)
    assert got.tokens == 700 and got.edge == urls["us-east-0"]
    assert np.array_equal(np.concatenate(got.kv_parts(), axis=3), kv)
    assert edges.counters["failovers"] == 1
