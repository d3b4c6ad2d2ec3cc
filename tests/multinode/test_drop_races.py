"""A drop wins over every load in flight (kdn/edge/tombstones.py), on the real 3-region network.

Readers keep loading while the origin removes what they load: LMCache adapters (the real
L2 adapter, kdn.integrations.lmcache) load 32 objects in a loop in every region while
`collect(object_ttl_s=0)` expires them; readers fetch a KB in every region while it is
deleted and collected. Once the drop has reached every edge, no edge holds any of those
keys, and storing the same keys again with other bytes loads those bytes, every key, in
every region: a pull-through, a refill, a hot copy, a peer's copy or a read repair that was
under way when the drop came never puts the old bytes back beside the new ones.

The edges are small (8 MiB) beside what is read (8-16 MiB a round in each region), so
reads pull through all the time and many are under way when a drop lands. Each race is
run again, on other keys, until the edges report having met one (a copy refused, an owner
behind its asker), at most MAX_ROUNDS times; each round is checked before the next one's
copies could evict what a lost race left. (Before kdn/edge/tombstones.py a round left copies
of collected keys on the edges about one time in two.)
"""
import importlib.util
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from kdn.core.errors import KDNError

ADMIN = "drop-races-admin-0123456789abcdef"
N = 32                  # objects (LMCache) a round
MAX_ROUNDS = 10         # races run until an edge refused a copy a drop overtook, at most this
FLOATS = 1 << 17        # an object's float32s: 512 KiB
RACE_S = 2.0            # loads go on this long after a collect: every edge's drop lands in it
SETTLE_S = 10.0         # every edge applies a drop at its next health ping (1 s)
AFTER_S = 0.5


@pytest.fixture(scope="module")
def net(small_network, ray_cluster):
    n = small_network(auth={"admin": ADMIN}, capacity_bytes=8 << 20)
    n.address = ray_cluster.address
    return n


def lmcache_helpers():
    """tests/integrations/test_lmcache.py's helpers (key, memobj, store, load, lookup), loaded
    by path (tests are not a package); skips where LMCache is not installed."""
    pytest.importorskip("lmcache", reason="LMCache is not installed: pip install -e '.[lmcache]'")
    path = Path(__file__).parents[1] / "integrations" / "test_lmcache.py"
    spec = importlib.util.spec_from_file_location("kdn_tests_lmcache_helpers", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Loops:
    """Each fn() again and again in a thread of its own, from `with` to its end: how many
    runs each made, and the KDNErrors they met (a read failed mid-race is kept, not hidden)."""

    def __init__(self, fns):
        self.fns, self.runs, self.errors = fns, [0] * len(fns), []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(len(fns))]

    def _run(self, i):
        while not self._stop.is_set():
            try:
                self.fns[i]()
            except KDNError as e:
                self.errors.append(e)
            self.runs[i] += 1

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(60)
        assert not any(t.is_alive() for t in self._threads), "a reader did not stop"


def races(net) -> int:
    """How often the edges met a drop racing a copy on its way in: copies refused
    (drops_refused_stale) and owners asked by an edge ahead of them (peer_get_behind)."""
    counters = [ray.get(h.stats.remote(token=ADMIN), timeout=30)["counters"] for h in net.edges.values()]
    return sum(c.get("drops_refused_stale", 0) + c.get("peer_get_behind", 0) for c in counters)


def held_by_edges(net, keys) -> dict:
    """edge -> how many of keys it holds (memory or disk)."""
    return {e: sum(ray.get(h.have.remote(keys, token=ADMIN), timeout=30))
            for e, h in net.edges.items()}


def wait_until_none_held(net, keys) -> dict:
    """Poll until no edge holds any of keys (SETTLE_S at most); then once more, AFTER_S
    later: what each edge still holds."""
    deadline = time.monotonic() + SETTLE_S
    while any(held_by_edges(net, keys).values()) and time.monotonic() < deadline:
        time.sleep(0.25)
    time.sleep(AFTER_S)
    return held_by_edges(net, keys)


def test_a_collect_racing_lmcache_loads_leaves_no_copy_and_new_bytes_load_everywhere(net):
    """Rounds, each of N other keys: stored, loaded in a loop in every region, expired by
    a collect under the loads, after which no edge holds any of them. Then each key stored
    again with other bytes loads those bytes in every region."""
    from kdn.client.operator import Operator
    from kdn.integrations.lmcache import KDNL2Adapter, KDNL2AdapterConfig, host_key
    from kdn.integrations.objects import object_key
    h = lmcache_helpers()
    adapters = {r: KDNL2Adapter(KDNL2AdapterConfig.from_dict(
        {"network": net.name, "region": r, "address": net.address, "token": ADMIN}))
        for r in ("us-east", "eu-west", "ap-south")}
    try:
        east, west = adapters["us-east"], adapters["eu-west"]
        view = east.objects.view
        ns = east.objects.namespace("default", h.MODEL)
        rounds = []
        now = {"keys": []}                               # what the loops load

        def reads(a):
            keys = now["keys"]
            if not keys:
                time.sleep(0.01)
                return
            h.load(a, keys, [h.memobj(FLOATS, fill=0.0) for _ in keys])
        with Loops([lambda a=a: reads(a) for a in adapters.values()]) as loops:
            for r in range(MAX_ROUNDS):
                seen = races(net)
                keys = [h.key(9000 + 100 * r + i) for i in range(N)]
                rounds.append(keys)
                old = [h.memobj(FLOATS, seed=1000 * r + i) for i in range(N)]
                assert h.store(east, keys, old) == N * FLOATS * 4
                view.origin().pushes_settled()
                now["keys"] = keys
                time.sleep(1.0)                          # loads in every region, copies made
                got = Operator(view, "default").collect(object_ttl_s=0)
                assert got["objects_expired"] >= N, got
                time.sleep(RACE_S)                       # every edge's drop lands under the loads
                # before the next round's objects evict what a lost race left
                left = wait_until_none_held(net, [object_key(ns, host_key(k)) for k in keys])
                assert not any(left.values()), f"round {r}: collected objects still held: {left}"
                for a in adapters.values():
                    assert h.lookup(a, keys) == [False] * N
                if races(net) > seen:                    # a race was met (and lost by none)
                    break
        assert min(loops.runs) >= 2 * len(rounds), loops.runs

        keys = [k for ks in rounds for k in ks]
        new = [h.memobj(FLOATS, seed=50_000 + i) for i in range(len(keys))]   # other bytes
        assert h.store(west, keys, new) == len(keys) * FLOATS * 4
        view.origin().pushes_settled()
        for r, a in adapters.items():
            outs = [h.memobj(FLOATS, fill=0.0) for _ in keys]
            assert h.load(a, keys, outs) == [True] * len(keys), r
            stale = [i for i, (o, w) in enumerate(zip(outs, new)) if bytes(o.byte_array) != bytes(w.byte_array)]
            assert not stale, f"{r}: keys {stale} loaded bytes other than those stored last"
    finally:
        for a in adapters.values():
            a.close()


def test_a_kb_deleted_and_collected_under_readers_leaves_no_copy_and_a_republish_reads_its_bytes(
        net, synth):
    """Rounds, each of another KB: published, read in a loop in every region, deleted and
    collected under the reads, after which no edge holds any of its chunks and no reader
    gets one. Then each KB republished with other bytes reads those bytes in every region."""
    from kdn.client import Client
    clients = {r: Client(network=net.name, region=r, tenant="default", fingerprint="drop-races",
                         admin_token=ADMIN) for r in ("us-east", "eu-west", "ap-south")}
    cl = clients["us-east"]
    kv = {"heads": 4, "head_dim": 16}                        # 256 KiB a 256-token chunk
    tokens = []
    now = {}                                                 # what the loops read

    def reads(c):                        # every chunk, past any that nobody holds (as
        if not now:                      # LMCache's loads do): one batch at the edge
            time.sleep(0.01)
            return
        todo = now["keys"]
        while todo:
            got = c.fetch_keys(todo, now["m"])
            todo = todo[len(got.chunks) + 1:]
    with Loops([lambda c=c: reads(c) for c in clients.values()]) as loops:
        for r in range(MAX_ROUNDS):
            seen = races(net)
            toks = synth.tokens(N * 256, seed=7 + r)
            tokens.append(toks)
            cl.publish(f"raced{r}", [("d", toks)], synth.kv(len(toks), seed=r, **kv))
            m = cl.manifest(f"raced{r}")
            now.update(keys=list(m.keys), m=m)
            time.sleep(1.0)                                  # reads in every region
            cl.delete(f"raced{r}", 1)
            got = cl.collect()
            assert got["chunks"] >= len(m.keys), got
            time.sleep(RACE_S)
            left = wait_until_none_held(net, list(m.keys))
            assert not any(left.values()), f"round {r}: chunks of a collected KB still held: {left}"
            for region, c in clients.items():
                assert c.fetch_keys(list(m.keys), m).chunks == [], f"{region} still serves it"
            if races(net) > seen:                            # a race was met (and lost by none)
                break
    assert min(loops.runs) >= 2 * len(tokens), loops.runs

    for r, toks in enumerate(tokens):
        other = synth.kv(len(toks), seed=100 + r, **kv)      # the same keys, other bytes
        cl.publish(f"raced{r}", [("d", toks)], other)
        for region, c in clients.items():
            f = c.fetch(toks, f"raced{r}")
            assert f.tokens == len(toks), (region, f.tokens)
            assert np.array_equal(np.concatenate(f.kv_parts(), axis=3), other), region
