"""KDN under LMCache: the L2 adapter checked by LMCache's own conformance check, unmodified,
and by what that check does not cover, on the real 3-region network (one edge per region).

LMCache's `basic_check --mode test_l2_adapter` runs in its own process (a second Ray driver,
as an LMCache server is) with 256 keys, and with 8 MiB objects; it prints its verdicts and
exits 0 whatever happens, so its table is read. Then, in this process, through LMCache's own
ObjectKey and TensorMemoryObj: a key stored in us-east loaded in ap-south from ap-south's
edge; two cache salts that cannot see each other's keys; an object whose bytes fail their
checksum reported not loaded; usage, delete and the three event fds; bad adapter_params
named; a load of the most keys one fetch may name; and last (it kills the network's eu-west
edge) an edge killed during a load.
"""
import json
import os
import re
import select
import subprocess
import sys
import time

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed: pip install -e '.[lmcache]' (the Makefile does)")
import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj  # noqa: E402

from kdn.integrations.lmcache import KDNL2Adapter, KDNL2AdapterConfig, host_key  # noqa: E402
from kdn.edge.forms import corrupted  # noqa: E402
from kdn.integrations.objects import object_key, pack  # noqa: E402
from kdn.core.errors import BadConfig  # noqa: E402

MODEL = "test-model"
WAIT_S = 60.0
ROW = re.compile(r"^\|\s*(LOOKUP \(absent\)|STORE|LOOKUP \(exist\)|LOAD)\s*\|.*?\|\s*(\d+)/(\d+)\s*\|\s*([\d.]+)%")


ADMIN = "admin-token-l2-0123456789"
READ = {"default": "read-default-0123456789", "tenant-a": "read-tenant-a-0123456789"}


@pytest.fixture(scope="module")
def net(small_network, ray_cluster):
    """Read tokens on: every read below carries its tenant's read token, never the admin's."""
    n = small_network(auth={"admin": ADMIN, "readers": READ})
    n.address = ray_cluster.address
    return n


def params(net, region, **extra):
    return {"network": net.name, "region": region, "address": net.address, "token": ADMIN,
            "read_tokens": READ, **extra}


def adapter_json(net, region) -> str:
    return json.dumps({"type": "plugin", "module_path": "kdn.integrations.lmcache",
                       "class_name": "KDNL2Adapter", "adapter_params": params(net, region)})


CHECKS = {"256-keys": (("--num-keys", "256"), 256),
          "8MiB-objects": (("--obj-size", str(2 << 20)), 5)}          # 8 MiB of float32


@pytest.fixture(scope="module")
def basic_checks(net) -> dict:
    """LMCache's conformance check, each case in its own process (both at once: most of a
    run is the process starting): {case: {phase: (passed, total, rate)}}."""
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    procs = {case: subprocess.Popen(
        [sys.executable, "-m", "lmcache.v1.basic_check", "--mode", "test_l2_adapter", "--model", MODEL,
         "--l2-adapter", adapter_json(net, "eu-west"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for case, (args, _) in CHECKS.items()}
    out = {}
    for case, proc in procs.items():
        text, _ = proc.communicate(timeout=300)
        rows = {}
        for line in text.splitlines():
            m = ROW.match(line.strip())
            if m:
                rows[m[1]] = (int(m[2]), int(m[3]), float(m[4]))
        assert len(rows) == 4, f"no verdict table in basic_check's output:\n{text[-4000:]}"
        out[case] = rows
    return out


@pytest.mark.parametrize("case", list(CHECKS))
def test_lmcache_basic_check_passes_every_phase(basic_checks, case):
    n = CHECKS[case][1]
    assert basic_checks[case] == {phase: (n, n, 100.0) for phase in
                                  ("LOOKUP (absent)", "STORE", "LOOKUP (exist)", "LOAD")}, basic_checks[case]


# --- in-process cases, through LMCache's own types -------------------------------------------
def key(i, salt="", model=MODEL):
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(0xC0FFEE00 + i), model_name=model,
                     kv_rank=0, cache_salt=salt)


def memobj(n_floats, fill=None, seed=0):
    data = torch.empty(n_floats, dtype=torch.float32)
    if fill is None:
        data.copy_(torch.from_numpy(np.random.default_rng(seed).standard_normal(n_floats, np.float32)))
    else:
        data.fill_(fill)
    meta = MemoryObjMetadata(shape=torch.Size([n_floats]), dtype=torch.float32, address=data.data_ptr(),
                             phy_size=n_floats * 4, fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(data, meta, parent_allocator=None)


def wait(fd, query, task_id):
    """The task's result, waiting on its event fd as LMCache's controllers do."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = query(task_id)
        if got is not None:
            return got
        select.select([fd], [], [], 0.2)
        try:
            os.read(fd, 8)
        except BlockingIOError:
            pass
    raise AssertionError(f"task {task_id} did not complete in {WAIT_S} s")


def store(a, keys, objs):
    tid = a.submit_store_task(keys, objs)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid]
        select.select([a.get_store_event_fd()], [], [], 0.2)
    raise AssertionError("store did not complete")


def lookup(a, keys) -> list:
    bm = wait(a.get_lookup_and_lock_event_fd(), a.query_lookup_and_lock_result,
              a.submit_lookup_and_lock_task(keys, {}))
    return [bool(bm.test(i)) for i in range(len(keys))]


def load(a, keys, objs) -> list:
    bm = wait(a.get_load_event_fd(), a.query_load_result, a.submit_load_task(keys, objs))
    return [bool(bm.test(i)) for i in range(len(keys))]


@pytest.fixture(scope="module")
def adapters(net):
    made = {}

    def make(region, **extra):
        if (region, json.dumps(extra, sort_keys=True)) not in made:
            made[(region, json.dumps(extra, sort_keys=True))] = KDNL2Adapter(
                KDNL2AdapterConfig.from_dict(params(net, region, **extra)))
        return made[(region, json.dumps(extra, sort_keys=True))]
    yield make
    for a in made.values():
        a.close()


def test_stored_in_one_region_is_loaded_from_another_regions_edge(adapters):
    """Acknowledged once durable at the origin (ack origin): at once visible everywhere."""
    east, south = adapters("us-east", ack="origin"), adapters("ap-south")
    keys = [key(i) for i in range(4)]
    objs = [memobj(1 << 18, seed=i) for i in range(4)]           # 1 MiB each
    assert store(east, keys, objs) == 4 << 20          # L2StoreResult: bytes sent, -1 failed
    assert lookup(south, keys) == [True] * 4
    outs = [memobj(1 << 18, fill=0.0) for _ in keys]
    assert load(south, keys, outs) == [True] * 4
    for o, want in zip(outs, objs):
        assert bytes(o.byte_array) == bytes(want.byte_array)
    served = {k for k in south.objects.counters if k.startswith("from_edge:")}
    assert served == {"from_edge:ap-south-0"}, south.objects.counters    # its own region's edge
    south.submit_unlock(keys)


def test_a_store_acknowledged_at_the_edge_is_served_there_at_once_and_everywhere_once_durable(adapters, net):
    """The default (ack edge): the region's edge answers the store and serves it at once; the
    origin holds it after, then another region's edge serves it too."""
    from kdn.core.rpc import Actors
    east, south = adapters("us-east"), adapters("ap-south")
    keys = [key(700 + i) for i in range(3)]
    objs = [memobj(1 << 16, seed=700 + i) for i in range(3)]
    from kdn.bench.l2 import acks_note, served, served_note, store_acks
    edge = Actors(net.name, ADMIN).edge("us-east-0", 30, "sync")
    before, acks = edge.stats()["stores"], store_acks(net, ADMIN)
    assert store(east, keys, objs) == 3 << 18
    assert east.objects.counters["acked_at_edge"] == 3
    now = store_acks(net, ADMIN)                   # what `kdn bench l2` reports of a row's stores
    assert (now["edge"] - acks["edge"], now["origin"] - acks["origin"]) == (3, 0), (acks, now)
    assert now["backlog"] - acks["backlog"] == now["room"] - acks["room"] == 0
    assert acks_note(acks, now, 1.0).startswith("; stores answered at the edge 3 of 3, all durable 1.0 s after the row")
    zero = dict.fromkeys(now, 0)                   # a row whose edges ran out of room: the reasons named
    assert acks_note(zero, {"edge": 118, "origin": 74, "backlog": 60, "room": 13, "adopted": 118,
                            "adopt_us": 2_500_000}, 2.0) == (
        "; stores answered at the edge 118 of 192 (74 once durable at the origin: 60 past the backlog's "
        "bound, 13 not held pinned in memory, 1 failed the edge's check), all durable 2.0 s after the row; "
        "the edges copied 118 arrivals into their object stores in 2.5 s")
    assert acks_note(zero, {**zero, "edge": 192, "waits": 40, "wait_us": 3_200_000}, 1.0) == (
        "; stores answered at the edge 192 of 192; 40 waited for room in the backlog, 3.2 s in all, "
        "all durable 1.0 s after the row")
    assert acks_note({**zero, "filled": 3 << 30, "filling": True}, {**zero, "edge": 1}, 1.0).endswith(
        "; the edges had allocated 3.0 GiB of their object stores ahead when the row began, and were still at it")
    outs = [memobj(1 << 16, fill=0.0) for _ in keys]
    was = served(net, "us-east", ADMIN)
    assert load(east, keys, outs) == [True] * 3                    # from us-east's edge, at once
    assert all(bytes(o.byte_array) == bytes(w.byte_array) for o, w in zip(outs, objs))
    now = served(net, "us-east", ADMIN)            # what `kdn bench l2` says of a row's loads
    assert served_note(was, now) == "; its edge served 3 local", (was, now)
    assert served_note(was, {**now, "origin": now["origin"] + 2, "repairs": now["repairs"] + 4}) == \
        "; its edge served 3 local, 2 origin, and sent 4 read repairs"
    durable = edge.stores_durable(20.0)           # waits for the backlog (admin)
    assert durable["durable"] and durable["backlog_objects"] == 0, durable
    # answered with no copy (kept as they arrived), made the edge's own objects after, and
    # handed to the origin as references to those, not sent again as bytes
    after = edge.stats()["stores"]
    assert after["store_adopted"] - before.get("store_adopted", 0) == 3, after
    assert after["store_forwarded_by_ref"] - before.get("store_forwarded_by_ref", 0) == 3, after
    copied = store_acks(net, ADMIN)               # the bench's count of those copies, and their time
    assert copied["adopted"] - acks["adopted"] == 3 and copied["adopt_us"] > acks["adopt_us"], (acks, copied)
    ns = east.objects.namespace("default", MODEL)
    held = east.objects.view.origin().get_chunks([object_key(ns, host_key(k)) for k in keys])
    assert [c.kv[:-8].tobytes() for c in held] == [bytes(o.byte_array) for o in objs]    # durable
    outs = [memobj(1 << 16, fill=0.0) for _ in keys]
    assert load(south, keys, outs) == [True] * 3
    assert all(bytes(o.byte_array) == bytes(w.byte_array) for o, w in zip(outs, objs))
    # stored again: the edge keeps the copies it holds (same checksums), copies nothing
    assert store(east, keys, objs) == 3 << 18
    again = edge.stats()["stores"]
    assert again["store_held_already"] - after.get("store_held_already", 0) == 3, again
    assert again["store_adopted"] == after["store_adopted"], again
    outs = [memobj(1 << 16, fill=0.0) for _ in keys]
    assert load(east, keys, outs) == [True] * 3
    assert all(bytes(o.byte_array) == bytes(w.byte_array) for o, w in zip(outs, objs))
    east.submit_unlock(keys)


def test_keys_durable_and_stored_again_with_other_bytes_load_the_first_bytes_everywhere(adapters, net):
    """A key keeps its first bytes, also through an edge's write-behind: keys durable at the
    origin, stored again through the same edge with other bytes (another batch shape computes
    other KV for the same prefix), are acknowledged there; once the edge's backlog reaches the
    origin, which keeps its bytes and says so (kept_other), the edge lets its copies go, and
    every region loads the first bytes, that edge included."""
    from kdn.core.rpc import Actors
    east, south = adapters("us-east"), adapters("ap-south")
    keys = [key(800 + i) for i in range(3)]
    first = [memobj(1 << 16, seed=800 + i) for i in range(3)]
    other = [memobj(1 << 16, seed=900 + i) for i in range(3)]
    edge = Actors(net.name, ADMIN).edge("us-east-0", 30, "sync")
    assert store(east, keys, first) == 3 << 18
    assert edge.stores_durable(20.0)["durable"]
    before = edge.stats()["stores"].get("store_origin_kept_other", 0)
    assert store(east, keys, other) == 3 << 18            # acknowledged at the edge, as any store
    assert edge.stores_durable(20.0)["durable"]
    assert edge.stats()["stores"]["store_origin_kept_other"] - before == 3
    for reader in (east, south):
        outs = [memobj(1 << 16, fill=0.0) for _ in keys]
        assert load(reader, keys, outs) == [True] * 3
        assert [bytes(o.byte_array) for o in outs] == [bytes(w.byte_array) for w in first]
    ns = east.objects.namespace("default", MODEL)
    held = east.objects.view.origin().get_chunks([object_key(ns, host_key(k)) for k in keys])
    assert [c.kv[:-8].tobytes() for c in held] == [bytes(o.byte_array) for o in first]
    east.submit_unlock(keys)
    south.submit_unlock(keys)


def test_two_cache_salts_cannot_see_each_others_keys(adapters):
    a = adapters("eu-west", tenants={"alice": "tenant-a"})
    alice = [key(100 + i, salt="alice") for i in range(3)]
    bob = [key(100 + i, salt="bob") for i in range(3)]          # the same chunk hashes
    plain = [key(100 + i) for i in range(3)]
    objs = [memobj(1024, seed=50 + i) for i in range(3)]
    assert store(a, alice, objs) >= 0
    assert lookup(a, alice) == [True] * 3
    assert lookup(a, bob) == [False] * 3 and lookup(a, plain) == [False] * 3
    outs = [memobj(1024, fill=7.0) for _ in bob]
    assert load(a, bob, outs) == [False] * 3
    assert all(bytes(o.byte_array) == np.full(1024, 7.0, np.float32).tobytes() for o in outs)
    usage = a.get_usage()
    assert dict(usage.bytes_by_cache_salt) == {"alice": 3 * 4096}


def test_an_object_failing_its_checksum_is_reported_not_loaded(adapters):
    a = adapters("eu-west")
    k = key(200)
    ns = a.objects.namespace("default", MODEL)
    bad = corrupted(pack(object_key(ns, host_key(k)), ns, np.arange(4096, dtype=np.uint8)))
    a.objects.view.origin().put_objects([bad])
    assert lookup(a, [k]) == [True]
    out = memobj(1024, fill=1.0)
    assert load(a, [k], [out]) == [False]
    assert a.objects.counters["load_rejected"] >= 1


def test_usage_delete_and_distinct_event_fds(adapters):
    a = adapters("us-east")
    fds = {a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd()}
    assert len(fds) == 3
    before = a.get_usage().total_bytes_used
    keys = [key(300 + i) for i in range(2)]
    assert store(a, keys, [memobj(256, seed=i) for i in range(2)]) >= 0
    assert store(a, keys, [memobj(256, seed=i) for i in range(2)]) >= 0     # again: counted once
    assert a.get_usage().total_bytes_used == before + 2 * 1024
    a.delete(keys)                                  # from the network, not only the accounting
    assert a.get_usage().total_bytes_used == before
    # each deleted at the origin, or taken out of the edge's backlog before it got there
    assert lookup(a, keys) == [False, False]
    assert a.objects.counters["deleted"] + a.objects.counters["delete_withdrawn"] == 2, a.objects.counters
    assert a.report_status()["is_healthy"] is True


def test_the_origins_collect_keeps_stored_objects(adapters, net):
    """collect removes what no KB names, but objects are live until deleted or past a TTL."""
    from kdn.client.operator import Operator
    a = adapters("ap-south", ack="origin")
    keys = [key(600 + i) for i in range(2)]
    objs = [memobj(1 << 16, seed=600 + i) for i in range(2)]
    assert store(a, keys, objs) >= 0
    got = Operator(a.objects.view, "default").collect()
    assert got["objects_kept"] >= 2 and got["objects_expired"] == 0
    ns = a.objects.namespace("default", MODEL)
    served = a.objects.view.origin().get_chunks([object_key(ns, host_key(k)) for k in keys])
    assert [c.kv[:-8].tobytes() for c in served] == [bytes(o.byte_array) for o in objs]


def test_reads_carry_the_read_token_writes_the_admin_token_and_a_wrong_one_is_named(adapters, caplog):
    writer = adapters("us-east", read_tokens=None)             # the admin token only
    reader = adapters("us-east", token=None)                   # read tokens only
    wrong = adapters("us-east", token=None, read_tokens=None, read_token="not-the-read-token-0")
    keys = [key(500 + i) for i in range(3)]
    objs = [memobj(1 << 16, seed=500 + i) for i in range(3)]
    assert store(writer, keys, objs) == 3 << 18
    assert lookup(reader, keys) == [True] * 3                  # no admin token needed to read
    outs = [memobj(1 << 16, fill=0.0) for _ in keys]
    assert load(reader, keys, outs) == [True] * 3
    assert all(bytes(o.byte_array) == bytes(w.byte_array) for o, w in zip(outs, objs))
    caplog.set_level("ERROR", logger="kdn.integrations.lmcache")
    assert lookup(writer, keys) == [False] * 3                 # the admin token never reads
    assert writer.counters["lookup_refused"] == 1
    assert load(wrong, keys, [memobj(1 << 16) for _ in keys]) == [False] * 3
    assert wrong.counters["load_refused"] == 1
    assert store(reader, [key(510)], [memobj(64)]) == -1       # no admin token: failed
    assert reader.counters["store_refused"] == 1
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "tenant 'default' (no read token given" in logged and "(a wrong read token" in logged
    assert "stores need the network's admin token (the `token` setting)" in logged


@pytest.mark.parametrize("bad, field", [({"netwrok": "kdn"}, "netwrok"), ({"region": 5}, "region"),
                                        ({"tenants": {"s": ""}}, "tenants"), ({"token": ["x"]}, "token"),
                                        ({"read_tokens": {"t": 5}}, "read_tokens"),
                                        ({"read_token": ""}, "read_token"),
                                        ({"capacity_bytes": -1}, "capacity_bytes"),
                                        ({"prefault": "yes"}, "prefault"), ({"ack": "later"}, "ack")])
def test_bad_adapter_params_name_the_field(bad, field):
    with pytest.raises(BadConfig, match=f"'{field}'"):
        KDNL2AdapterConfig.from_dict(bad)
    assert issubclass(BadConfig, ValueError)       # what LMCache's config loader reports


def test_lmcache_plugin_loader_builds_the_adapter_and_reports_bad_params(net):
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
    cfg = PluginL2AdapterConfig.from_dict(json.loads(adapter_json(net, "eu-west")))
    a = create_l2_adapter(cfg)
    try:
        assert isinstance(a, KDNL2Adapter) and a.objects.view.region == "eu-west"
        # the object store's pages are mapped ahead of loads by default (kdn.core.prefault)
        deadline = time.monotonic() + 10
        while a.stats()["objects"]["prefault"]["passes"] < 1:
            assert time.monotonic() < deadline, a.stats()["objects"]["prefault"]
            time.sleep(0.05)
        assert a.stats()["objects"]["prefault"]["stopped_why"] is None
    finally:
        a.close()
    assert not a.stats()["objects"]["prefault"]["running"], "close() stops its thread"
    cfg.adapter_params = {"network": net.name, "regoin": "eu-west"}
    with pytest.raises(BadConfig, match="'regoin'"):
        create_l2_adapter(cfg)


def test_a_load_of_the_documented_maximum_loads_every_key(adapters, net):
    """MAX_FETCH_KEYS (16,384: the README's bound on one fetch) small objects, every edge
    healthy: every key loads, with its bytes. A deadline that did not grow with the keys
    (4 s) had every edge time out on them and LMCache recompute everything. The objects are
    put straight into the loading region's edge (what the origin's push does, without the
    origin's file a key, ~2 ms each here: a store of 16,384 through it takes most of a minute)."""
    from kdn.core.keys import MAX_FETCH_KEYS
    a = adapters("eu-west")
    n, floats = MAX_FETCH_KEYS, 4                               # 16 bytes an object
    keys = [key(1_000_000 + i) for i in range(n)]
    datas = [np.full(floats, i, np.float32) for i in range(n)]
    t0 = time.monotonic()
    chunks = [pack(kdn_key, ns, d) for (ns, kdn_key), d in zip(a._ns_keys(keys), datas)]
    edge = net.edge("eu-west-0")
    for part in (chunks[s:s + 4096] for s in range(0, n, 4096)):
        assert ray.get(edge.put_chunks.remote(part, token=ADMIN)) == len(part)
    t1 = time.monotonic()
    assert lookup(a, keys) == [True] * n                        # in batches too
    t2 = time.monotonic()
    outs = [memobj(floats, fill=-1.0) for _ in keys]
    c = a.objects.counters
    no_edge = c["load_no_edge"]
    got = load(a, keys, outs)
    print(f"seeded in {t1 - t0:.1f} s, looked up in {t2 - t1:.1f} s, loaded in "
          f"{time.monotonic() - t2:.1f} s: {dict(c)}")
    assert sum(got) == n, (sum(got), dict(c))
    assert all(bytes(o.byte_array) == d.tobytes() for o, d in zip(outs, datas)), "wrong bytes loaded"
    assert c["load_no_edge"] == no_edge, dict(c)
    a.submit_unlock(keys)


def test_an_edge_killed_during_a_load_never_yields_wrong_bytes(net, adapters):
    """Last in the module: it kills eu-west's edge. The load either fails over to the next
    edge or reports keys not loaded; whatever it reports loaded is the stored bytes. (Stored
    durable first: an edge that dies with stores it acknowledged loses them, README.)"""
    a = adapters("eu-west", ack="origin")
    keys = [key(400 + i) for i in range(6)]
    objs = [memobj(2 << 20, seed=400 + i) for i in range(6)]     # 8 MiB each
    assert store(a, keys, objs) >= 0
    outs = [memobj(2 << 20, fill=0.0) for _ in keys]
    tid = a.submit_load_task(keys, outs)
    ray.kill(net.edge("eu-west-0"), no_restart=True)
    bm = wait(a.get_load_event_fd(), a.query_load_result, tid)
    for i, (o, want) in enumerate(zip(outs, objs)):
        if bm.test(i):
            assert bytes(o.byte_array) == bytes(want.byte_array), f"key {i} loaded wrong bytes"
    again = [memobj(2 << 20, fill=0.0) for _ in keys]             # the next edge serves them all
    assert load(a, keys, again) == [True] * 6
    assert all(bytes(o.byte_array) == bytes(w.byte_array) for o, w in zip(again, objs))
    assert a.objects.counters["load_failovers"] >= 1
