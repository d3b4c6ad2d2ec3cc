"""Hostile input against a real edge's HTTP API: every answer a 4xx with a message, nothing changed.

One network for the module on the session's 3-region Ray cluster, with HTTP on every edge and
replicas=3, so every edge owns every chunk of the one published KB: a fetch of it changes
nothing an edge stores (no pull-through, no hot copy), and any change after fuzzing is a bug.
The seeded driver (kdn.testing.fuzzer.Fuzzer) sends every kind of case over raw sockets; hypothesis
adds arbitrary msgpack bodies; a table pins the exact status and message of the sharpest
cases; slowloris connections must not stall anyone else. The tenant has a read token, so
wrong and absent tokens must be refused (403), never answered.
"""
import http.client
import json
import socket
import time
import uuid
from urllib.parse import urlsplit

import msgpack
import numpy as np
import pytest
import ray
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.keys import MAX_FETCH_KEYS
from kdn.edge.http import MAX_BODY_BYTES
from kdn.testing.fuzzer import KINDS, Case, Fuzzer, _request
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
TENANT, FP = "fuzz", "synthetic-fuzz"
ADMIN = "fuzz-admin-token-0123456789abcdef"
READ = "fuzz-read-token-0123456789abcdef"
N_TOKENS = 1000
EDGE = "eu-west-0"
IDLE_S = 3.0                 # the edges' idle connection bound


@pytest.fixture(scope="module")
def net(ray_cluster, tmp_path_factory):
    name = f"fuzz{uuid.uuid4().hex[:8]}"
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=64 << 20)
    n = start_network(topo, tmp_path_factory.mktemp("origin"), network=name, http=True,
                      replicas=len(REGIONS), auth={"admin": ADMIN, "readers": {TENANT: READ}},
                      edge_options={"http_idle_s": IDLE_S})
    rng = np.random.default_rng(5)
    toks = rng.integers(0, 49152, N_TOKENS).tolist()
    kv = rng.standard_normal((2, 2, 2, N_TOKENS, 8), dtype=np.float32)
    cl = Client(network=name, region="us-east", tenant=TENANT, fingerprint=FP, token=READ,
                admin_token=ADMIN)
    cl.publish("target", [("doc", toks)], kv)
    keys = list(cl.manifest("target").keys)
    digests = {k: xxhash.xxh3_64_intdigest(np.ascontiguousarray(kv[:, :, :, s:s + 256]).tobytes())
               for k, s in zip(keys, range(0, N_TOKENS, 256))}
    url = ray.get(n.edge(EDGE).ping.remote(), timeout=30)["http"]
    n.fuzz = {"url": url, "ns": cl.ns, "keys": keys, "digests": digests, "kv": kv}
    yield n
    stop_network(n)


def _fuzzer(net, seed=0, slow_s=0.3):
    f = net.fuzz
    return Fuzzer(f["url"], f["ns"], f["keys"], f["digests"], TENANT, FP, seed=seed,
                  slow_s=slow_s, regions=REGIONS, token=READ)


def _stored(net):
    st_ = ray.get(net.edge(EDGE).stats.remote(), timeout=30)
    return {t: (st_[t]["items"], st_[t]["bytes"]) for t in ("main", "hot")}


def _raw(url, method, path, body=None, headers=None, token=READ):
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=15)
    headers = dict(headers or {})
    if token:
        headers.setdefault("Authorization", f"Bearer {token}")
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type", ""), r.read()
    finally:
        conn.close()


def test_seeded_fuzz_of_every_kind_is_refused_cleanly_and_changes_nothing(net):
    fz = _fuzzer(net, seed=1)
    assert fz.check() == "", "the KB must be fetchable before fuzzing"
    before, stored = fz.state(), _stored(net)
    t0 = time.monotonic()
    rep = fz.run(cases=12 * len(KINDS)).to_dict()
    assert time.monotonic() - t0 < 40
    assert rep["problems"] == [], "\n".join(map(str, rep["problems"]))
    assert set(rep["cases"]) == set(KINDS) and rep["total"] == 12 * len(KINDS)
    assert not any(s.startswith("5") for s in rep["statuses"]), rep["statuses"]
    assert rep["statuses"].get("403", 0) >= 3, "wrong read tokens must have been refused"
    refused = sum(n for s, n in rep["statuses"].items() if s.startswith("4"))
    assert refused >= 8 * len(KINDS) and rep["statuses"].get("400", 0) > 50, rep["statuses"]
    assert rep["health_ms_max"] < 2000, "a slowloris connection must not stall /health"
    # still healthy, still the right bytes, nothing stored changed
    assert fz.check() == ""
    assert fz.state() == before and _stored(net) == stored
    status, _, metrics = _raw(net.fuzz["url"], "GET", "/metrics")
    assert status == 200 and b'code="500"' not in metrics


def _cases(ns, keys):
    pack = msgpack.packb
    b31 = (2**31).to_bytes(4, "big")
    valid = pack({"ns": ns, "keys": keys})
    return [  # (what, method, path, body, extra headers, status, words in the JSON message)
        ("array32 of 2**31", "POST", "/v1/fetch", b"\xdd" + b31, {}, 400, "not valid msgpack"),
        ("bin32 of 2 GiB for ns", "POST", "/v1/fetch", b"\x82\xa2ns\xc6" + b31, {}, 400, "not valid msgpack"),
        ("map32 of 2**31", "POST", "/v1/lookup", b"\xdf" + b31, {}, 400, "not valid msgpack"),
        ("truncated", "POST", "/v1/fetch", valid[:-7], {}, 400, "not valid msgpack"),
        ("trailing garbage", "POST", "/v1/fetch", valid + b"\x00", {}, 400, "not valid msgpack"),
        ("ext type key", "POST", "/v1/fetch", pack({"ns": ns, "keys": [msgpack.ExtType(1, b"k" * 16)]}),
         {}, 400, "not valid msgpack"),
        ("int map key", "POST", "/v1/fetch", pack({1: ns, "keys": keys}), {}, 400, "not valid msgpack"),
        ("nil body", "POST", "/v1/fetch", pack(None), {}, 400, "must be a msgpack map"),
        ("keys as map", "POST", "/v1/fetch", pack({"ns": ns, "keys": {"a": 1}}), {}, 400,
         "'keys' must be a list"),
        ("17-byte key", "POST", "/v1/lookup", pack({"ns": ns, "keys": [keys[0] + b"x"]}), {}, 400,
         "keys[0] must be 16 bytes"),
        ("int key", "POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0], 7]}), {}, 400,
         "keys[1] must be 16 bytes"),
        ("dtype field", "POST", "/v1/fetch", pack({"ns": ns, "keys": keys, "dtype": "float128"}), {}, 400,
         "unknown field(s) dtype"),
        ("region path trick", "POST", "/v1/fetch", pack({"ns": ns, "keys": keys, "region": "../us-east"}),
         {}, 400, "must name a region"),
        ("too many keys", "POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0]] * (MAX_FETCH_KEYS + 1)}), {},
         413, f"limit is {MAX_FETCH_KEYS}"),
        ("oversized body", "POST", "/v1/fetch", b"\x00" * (MAX_BODY_BYTES + 1), {}, 413,
         f"limit of {MAX_BODY_BYTES} bytes"),
        ("json content type", "POST", "/v1/fetch", json.dumps({"ns": ns.hex()}).encode(),
         {"Content-Type": "application/json"}, 400, "not valid msgpack"),
        ("dot-dot path", "GET", "/%2e%2e/%2e%2e/etc/passwd", None, {}, 404, "no endpoint"),
        ("NUL in path", "GET", "/v1/fetch%00", None, {}, 404, "no endpoint"),
        ("NUL in tenant", "GET", "/v1/kbs?tenant=a%00b&fingerprint=x", None, {}, 400, "must not contain NUL"),
        ("long tenant", "GET", "/v1/kbs?tenant=" + "a" * 2000 + "&fingerprint=x", None, {}, 400,
         "at most 1024 characters"),
        ("PUT fetch", "PUT", "/v1/fetch", valid, {}, 405, "use POST"),
        ("one key 16384 times", "POST", "/v1/fetch", pack({"ns": ns, "keys": [keys[0]] * MAX_FETCH_KEYS,
                                                           "codec": "zstd"}), {}, 400, "keys[1] repeats key"),
        ("a repeat at the end", "POST", "/v1/lookup", pack({"ns": ns, "keys": keys + keys[-1:]}), {}, 400,
         "keys[4] repeats key"),
        ("bad gzip", "POST", "/v1/fetch", b"\x1f\x8b not gzip at all", {"Content-Encoding": "gzip"}, 400,
         "request body cannot be read"),
    ]


def test_sharp_cases_get_their_exact_status_and_message(net):
    f = net.fuzz
    stored = _stored(net)
    for what, method, path, body, headers, status, words in _cases(f["ns"], f["keys"]):
        got, ctype, raw = _raw(f["url"], method, path, body, headers)
        assert got == status, f"{what}: {got} {raw[:200]!r}"
        assert ctype.startswith("application/json"), what
        doc = json.loads(raw)
        assert doc["status"] == status and words in doc["message"], (what, doc)
    assert _stored(net) == stored


def test_path_tricks_in_names_list_nothing_and_only_the_read_token_reads(net):
    f = net.fuzz
    for tenant in ("..%2F..%2Fetc%2Fpasswd", "%2e%2e", "fuzz%2F..%2Ffuzz", "fuzz%20", "FUZZ"):
        got, _, raw = _raw(f["url"], "GET", f"/v1/kbs?tenant={tenant}&fingerprint={FP}")
        # read tokens are on: a tenant without one is nobody's to read, whatever its name (the
        # request carries the fuzz tenant's token, which reads no other tenant: 403)
        assert got == 403 and "read token" in json.loads(raw)["message"], (tenant, got, raw[:200])
    got, _, raw = _raw(f["url"], "GET", f"/v1/kbs?tenant={TENANT}&fingerprint={FP}")
    assert [m["name"] for m in json.loads(raw)["manifests"]] == ["target"]
    body = msgpack.packb({"ns": f["ns"], "keys": f["keys"]})
    wrong = (None, "Bearer wrong", "Bearer ", "Basic Zm9vOmJhcg==", READ, "Bearer " + READ[:-1],
             "Bearer " + READ.upper(), "Bearer " + "A" * 4000)
    for token in wrong:
        headers = {"Authorization": token} if token is not None else {"X-KDN-Token": READ}
        for method, path, b in (("POST", "/v1/fetch", body), ("POST", "/v1/lookup", body),
                                ("GET", f"/v1/kbs?tenant={TENANT}&fingerprint={FP}", None)):
            got, ctype, raw = _raw(f["url"], method, path, b, headers, token=None)
            # no bearer token at all (none, another scheme, no scheme): 401; a wrong one: 403
            want = 401 if token is None or not token.startswith("Bearer ") or token == "Bearer " \
                else 403
            assert got == want and ctype.startswith("application/json"), (token, path, got, raw[:200])
            assert "read token" in json.loads(raw)["message"], (token, path)
    # the read token (and the admin token) read exactly the published bytes
    fz = _fuzzer(net)
    for token in (READ, ADMIN):
        case = Case("auth_tokens", token[:8], _request("POST", "/v1/fetch", fz.hostport, body,
                    {"Authorization": f"Bearer {token}"}), path="/v1/fetch", keys=f["keys"],
                    ok_statuses=(200,))
        reply = fz.send(case)
        assert reply.status == 200 and reply.headers["x-kdn-chunks"] == "4"
        assert fz.judge(case, reply) == ""


def test_huge_declared_content_length_is_refused_without_reading(net):
    fz = _fuzzer(net)
    for declared in (MAX_BODY_BYTES + 1, 2**40, 2**63 - 1):
        case = fz._post("huge_lengths", str(declared), "/v1/fetch", b"\x80", content_length=declared)
        t0 = time.monotonic()
        reply = fz.send(case)
        assert time.monotonic() - t0 < 5, "the 413 must not wait for a body that never comes"
        assert reply.status == 413 and f"{declared} bytes is over the limit" in json.loads(reply.body)["message"]


def test_slowloris_connections_do_not_stall_health_or_fetches(net):
    f = net.fuzz
    u = urlsplit(f["url"])
    body = msgpack.packb({"ns": f["ns"], "keys": f["keys"]})
    partial = _request("POST", "/v1/fetch", f"{u.hostname}:{u.port}", body)[:-len(body) // 2]
    socks = []
    try:
        for i in range(20):
            s = socket.create_connection((u.hostname, u.port), timeout=5)
            s.sendall(partial if i % 2 else b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            socks.append(s)
        fz = _fuzzer(net)
        t0 = time.monotonic()
        assert fz.health()["ok"] is True
        assert fz.check() == ""
        assert time.monotonic() - t0 < 3, "20 stalled connections must not block other clients"
    finally:
        for s in socks:
            s.close()
    assert _fuzzer(net).check() == ""


def test_repeated_keys_cost_nothing_and_idle_connections_are_closed(net):
    """Issue 13.2: 128 copies of one key once made an edge encode and hold 128 frames."""
    f = net.fuzz
    body = msgpack.packb({"ns": f["ns"], "keys": [f["keys"][0]] * 128, "codec": "zstd"})
    t0 = time.monotonic()
    got, _, raw = _raw(f["url"], "POST", "/v1/fetch", body)
    assert got == 400 and "repeats key" in json.loads(raw)["message"]
    assert time.monotonic() - t0 < 1
    idle = _fuzzer(net).idle(4, wait_s=IDLE_S + 4)
    assert idle["closed"] == 4 and idle["open"] == 0 and idle["seconds"] <= IDLE_S + 2, idle


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
    | st.text(max_size=40) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(
        st.sampled_from(["ns", "keys", "region", "x", ""]) | st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(obj=json_values, path=st.sampled_from(["/v1/fetch", "/v1/lookup"]), cut=st.integers(0, 3))
def test_arbitrary_msgpack_bodies_get_a_4xx_with_a_message(net, obj, path, cut):
    f = net.fuzz
    body = msgpack.packb(obj, use_bin_type=True)
    if cut and len(body) > cut:
        body = body[:-cut]                     # truncated
    fz = _fuzzer(net)
    case = fz._post("wrong_types", repr(obj)[:80], path, body, keys=None, ok=(200,))
    reply = fz.send(case)
    assert reply is not None and reply.status != 500
    assert fz.judge(case, reply) == ""
    if reply.status == 200:         # only a well-formed request of 16-byte keys is answered
        assert isinstance(obj, dict) and isinstance(obj.get("ns"), bytes) and len(obj["ns"]) == 16
    else:
        assert 400 <= reply.status < 500 and json.loads(reply.body)["message"]
