"""KDN under SGLang's HiCache: the storage backend built by SGLang's own factory (its `dynamic`
backend) and run through the cases of SGLang's own backend test (the wheel's
storage/mooncake_store/test_mooncake_store.py, whose MockHostKVCache is copied here: a CPU
host-pool stand-in), then the cases that test does not cover, on the real 3-region network:
pages stored in us-east read from ap-south's edge, two tenants that cannot see each other's
pages, batch_exists' consecutive-prefix answer, a corrupt page reported missing, bad extra
config named, and last (it kills eu-west's edge) an edge killed during a load.
"""
import uuid

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.hicache_storage",
                    reason="SGLang is not installed: see the Makefile's install step (.[sglang])")
import ray  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kdn.edge.forms import corrupted  # noqa: E402
from kdn.integrations.objects import object_key, pack  # noqa: E402
from kdn.integrations.sglang import KDNHiCacheStorage  # noqa: E402
from kdn.core.errors import BadConfig, BadKey  # noqa: E402

MODEL = "test-model"


ADMIN = "admin-token-hicache-0123456789"
READ = {"default": "read-default-0123456789", "tenant-a": "read-tenant-a-0123456789",
        "tenant-b": "read-tenant-b-0123456789"}


@pytest.fixture(scope="module")
def net(small_network, ray_cluster):
    """Read tokens on: every read below carries its tenant's read token, never the admin's."""
    n = small_network(auth={"admin": ADMIN, "readers": READ})
    n.address = ray_cluster.address
    return n


def make_config(net, *, is_mla_model=False, tp_rank=0, tp_size=1, region="eu-west", **extra):
    """SGLang's HiCacheStorageConfig as its mooncake test makes it, with KDN's extra config
    (the admin token for stores, the tenant's read token for reads)."""
    extra = {"token": ADMIN, "read_token": READ[extra.get("tenant", "default")], **extra}
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=is_mla_model, enable_storage_metrics=False, is_page_first_layout=True,
        model_name=MODEL,
        extra_config={"backend_name": "kdn", "module_path": "kdn.integrations.sglang",
                      "class_name": "KDNHiCacheStorage", "interface_v1": 1, "network": net.name,
                      "region": region, "address": net.address, **extra})


_BACKENDS = {}


def backend(net, **kw) -> KDNHiCacheStorage:
    """One backend per configuration for the module, built by SGLang's own factory."""
    k = tuple(sorted(kw.items()))
    if k not in _BACKENDS:
        b = StorageBackendFactory.create_backend("dynamic", make_config(net, **kw), None)
        assert isinstance(b, KDNHiCacheStorage)
        _BACKENDS[k] = b
    return _BACKENDS[k]


# --- copied from SGLang's test_mooncake_store.py (a CPU host-pool stand-in) -------------------
def create_mock_host_kv_cache(buffer_size, entries_per_page=2, page_elements=1, dtype=torch.float32):
    buffer = torch.randn(buffer_size, dtype=dtype)

    class MockHostKVCache:
        def __init__(self, buffer, entries_per_page, page_elements):
            self.kv_buffer = buffer
            self.layout = "page_first"
            self.page_size = 1
            self.entries_per_page = entries_per_page
            self.page_elements = page_elements

        def get_page_buffer_meta(self, indices):
            ptr_list, element_size_list = [], []
            for idx in indices:
                page_offset = int(idx) * self.entries_per_page * self.page_elements
                for entry_idx in range(self.entries_per_page):
                    offset = page_offset + entry_idx * self.page_elements
                    ptr_list.append(self.kv_buffer[offset:].data_ptr())
                    element_size_list.append(self.page_elements * self.kv_buffer.element_size())
            return ptr_list, element_size_list

    return MockHostKVCache(buffer, entries_per_page, page_elements), buffer


def test_single_operation(net):
    """SGLang's test_single_operation: set / exists / get by pointer and size."""
    store = backend(net)
    pool, buffer = create_mock_host_kv_cache(1 << 20, entries_per_page=2, page_elements=1024)
    store.register_mem_pool_host(pool)
    value_size = 1024 * buffer.element_size()
    key = str(uuid.uuid4())
    set_slice, get_slice = buffer[:1024], buffer[1024:2048]
    assert store.set(key, target_location=set_slice.data_ptr(), target_sizes=value_size) is True
    assert store.exists(key)
    assert store.get(key, target_location=get_slice.data_ptr(), target_sizes=value_size) is True
    assert torch.equal(set_slice, get_slice)


@pytest.mark.parametrize("is_mla_model, tp_rank, tp_size",
                         [(False, 0, 1), (True, 0, 1), (False, 1, 4), (True, 3, 8)])
def test_batch_operation(net, is_mla_model, tp_rank, tp_size):
    """SGLang's test_batch_operation: batch_set_v1, batch_exists, batch_get_v1, round trip."""
    value_elements, kv_num = 256, 13
    entries_per_page = 1 if is_mla_model else 2
    store = backend(net, is_mla_model=is_mla_model, tp_rank=tp_rank, tp_size=tp_size)
    pool, buffer = create_mock_host_kv_cache(1 << 20, entries_per_page=entries_per_page,
                                             page_elements=value_elements)
    store.register_mem_pool_host(pool)
    keys = ["test_" + str(uuid.uuid4()) for _ in range(kv_num)]
    set_slices = [buffer[i * value_elements:(i + 1) * value_elements]
                  for i in range(kv_num * entries_per_page)]
    assert all(store.batch_set_v1(keys, torch.arange(kv_num)))
    assert store.batch_exists(keys) == kv_num
    get_slices = [buffer[(kv_num * entries_per_page + i) * value_elements:
                         (kv_num * entries_per_page + i + 1) * value_elements]
                  for i in range(kv_num * entries_per_page)]
    assert all(store.batch_get_v1(keys, torch.arange(kv_num, 2 * kv_num)))
    for s, g in zip(set_slices, get_slices):
        assert torch.equal(s, g)


# --- what SGLang's test does not cover ---------------------------------------------------------
def test_tensor_values_round_trip(net):
    store = backend(net)
    keys = [str(uuid.uuid4()) for _ in range(3)]
    values = [torch.randn(4096) for _ in keys]
    assert store.batch_set(keys, values)
    outs = store.batch_get(keys, [torch.zeros(4096) for _ in keys])
    assert all(torch.equal(o, v) for o, v in zip(outs, values))
    assert store.get(str(uuid.uuid4()), torch.zeros(4096)) is None          # absent: None


def test_pages_stored_in_one_region_are_read_from_another_regions_edge(net):
    """Stored durable first (ack origin): another region reads them at once. (With the default,
    ack edge, it reads them once the origin holds them: tests/integrations/test_lmcache.py.)"""
    east, south = backend(net, region="us-east", ack="origin"), backend(net, region="ap-south")
    pool, buffer = create_mock_host_kv_cache(1 << 20, entries_per_page=2, page_elements=8192)
    east.register_mem_pool_host(pool)
    south.register_mem_pool_host(pool)
    keys = [uuid.uuid4().hex for _ in range(6)]
    assert all(east.batch_set_v1(keys, torch.arange(6)))
    assert south.batch_exists(keys) == 6
    assert all(south.batch_get_v1(keys, torch.arange(6, 12)))
    assert torch.equal(buffer[:6 * 2 * 8192], buffer[6 * 2 * 8192:12 * 2 * 8192])
    served = {k for k in south.objects.counters if k.startswith("from_edge:")}
    assert served == {"from_edge:ap-south-0"}, south.objects.counters


def test_pages_acknowledged_at_the_edge_are_read_there_at_once_and_elsewhere_once_durable(net):
    """The default (ack edge): us-east's edge answers the store, serves the pages at once, and
    the origin holds them after; then another region's edge serves them too."""
    from kdn.core.rpc import Actors
    east, south = backend(net, region="us-east"), backend(net, region="ap-south")
    assert east.objects.ack == "edge"
    pool, buffer = create_mock_host_kv_cache(1 << 20, entries_per_page=2, page_elements=8192)
    for b in (east, south):
        b.register_mem_pool_host(pool)
    edge = Actors(net.name, ADMIN).edge("us-east-0", 30, "sync")
    acked = east.objects.counters["acked_at_edge"]
    keys = [uuid.uuid4().hex for _ in range(4)]
    assert all(east.batch_set_v1(keys, torch.arange(4)))
    assert east.objects.counters["acked_at_edge"] - acked == 4 * 2      # an object per page entry (K, V)
    assert all(east.batch_get_v1(keys, torch.arange(4, 8)))               # at once, from its edge
    # the pages' bytes stored and read back, no arithmetic: equal on any CPU
    assert torch.equal(buffer[:4 * 2 * 8192], buffer[4 * 2 * 8192:8 * 2 * 8192])
    durable = edge.stores_durable(20.0)
    assert durable["durable"] and durable["backlog_objects"] == 0, durable
    assert south.batch_exists(keys) == 4
    assert all(south.batch_get_v1(keys, torch.arange(8, 12)))
    assert torch.equal(buffer[:4 * 2 * 8192], buffer[8 * 2 * 8192:12 * 2 * 8192])
    assert "from_edge:ap-south-0" in south.objects.counters, south.objects.counters


def test_two_tenants_cannot_see_each_others_pages(net):
    a, b = backend(net, tenant="tenant-a"), backend(net, tenant="tenant-b")
    pool, buffer = create_mock_host_kv_cache(1 << 16, entries_per_page=2, page_elements=256)
    a.register_mem_pool_host(pool)
    b.register_mem_pool_host(pool)
    keys = [uuid.uuid4().hex for _ in range(3)]
    assert all(a.batch_set_v1(keys, torch.arange(3)))
    assert a.batch_exists(keys) == 3 and b.batch_exists(keys) == 0
    before = buffer.clone()
    assert b.batch_get_v1(keys, torch.arange(3, 6)) == [False] * 3
    assert torch.equal(buffer[:6 * 512], before[:6 * 512])               # nothing written
    assert not b.exists(keys[0])


def test_batch_exists_is_the_consecutive_hit_prefix(net):
    store = backend(net)
    pool, _ = create_mock_host_kv_cache(1 << 16, entries_per_page=2, page_elements=64)
    store.register_mem_pool_host(pool)
    keys = [uuid.uuid4().hex for _ in range(5)]
    assert all(store.batch_set_v1([keys[i] for i in (0, 1, 3, 4)], torch.tensor([0, 1, 3, 4])))
    assert store.batch_exists(keys) == 2                # keys[2] is missing: the prefix ends
    assert store.batch_exists(keys[3:]) == 2
    assert store.batch_exists([]) == 0


def test_a_corrupt_page_is_reported_missing(net):
    store = backend(net)
    pool, buffer = create_mock_host_kv_cache(1 << 16, entries_per_page=1, page_elements=256)
    store.register_mem_pool_host(pool)
    key = uuid.uuid4().hex
    kdn_key = object_key(store.ns, f"{key}_{store.suffix}_0".encode())
    bad = corrupted(pack(kdn_key, store.ns, np.zeros(1024, np.uint8)))     # a byte flipped
    store.objects.view.origin().put_objects([bad])
    assert store.batch_get_v1([key], torch.tensor([1])) == [False]


def test_reads_need_the_read_token_and_stores_the_admin_token(net, caplog):
    writer = backend(net, read_token=None)                  # the admin token only
    reader = backend(net, token=None)                       # the read token only
    wrong = backend(net, token=None, read_token="not-the-read-token-0")
    pool, buffer = create_mock_host_kv_cache(1 << 16, entries_per_page=2, page_elements=256)
    for b in (writer, reader, wrong):
        b.register_mem_pool_host(pool)
    keys = [uuid.uuid4().hex for _ in range(3)]
    assert all(writer.batch_set_v1(keys, torch.arange(3)))
    assert reader.batch_exists(keys) == 3                   # no admin token needed to read
    assert all(reader.batch_get_v1(keys, torch.arange(3, 6)))
    # bytes stored and read back, no arithmetic: equal on any CPU
    assert torch.equal(buffer[:3 * 512], buffer[3 * 512:6 * 512])
    caplog.set_level("ERROR", logger="kdn.integrations.sglang")
    assert writer.batch_exists(keys) == 0                   # the admin token never reads
    assert wrong.batch_get_v1(keys, torch.arange(6, 9)) == [False] * 3
    assert reader.batch_set_v1([uuid.uuid4().hex], torch.arange(1)) == [False]   # no admin token
    assert (writer.objects.counters["refused"], wrong.objects.counters["refused"],
            reader.objects.counters["refused"]) == (1, 1, 1)
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "(no read token given" in logged and "(a wrong read token given" in logged
    assert "stores need the network's admin token (the `token` setting)" in logged


@pytest.mark.parametrize("extra, field", [({"netwrk": "x"}, "netwrk"), ({"region": 3}, "region"),
                                          ({"tenant": None}, "tenant"), ({"read_token": ""}, "read_token"),
                                          ({"ack": "later"}, "ack")])
def test_bad_extra_config_names_the_field(net, extra, field):
    cfg = make_config(net)
    cfg.extra_config.update(extra)
    with pytest.raises(BadConfig, match=f"'{field}'"):
        StorageBackendFactory.create_backend("dynamic", cfg, None)
    cfg = make_config(net)
    cfg.model_name = None
    with pytest.raises(BadConfig, match="'model'"):
        KDNHiCacheStorage(cfg, {})


class MemoryObjects:
    """kdn.integrations.objects.Objects in a dict: what the backend would store, by KDN key."""

    def __init__(self):
        self.stored, self.counters = {}, {"refused": 0}

    def namespace(self, tenant, model):
        return f"{tenant}/{model}".encode().ljust(16, b"\0")

    def store(self, ns_keys, datas):
        for (_, k), d in zip(ns_keys, datas, strict=True):
            self.stored[k] = bytes(d)

    def lookup(self, ns, keys):
        return [k in self.stored for k in keys]

    def load(self, ns, keys, outs):
        for k, out in zip(keys, outs, strict=True):
            if k in self.stored:
                out[:] = self.stored[k]
        return [k in self.stored for k in keys]


def offline_backend():
    """The backend over MemoryObjects: no network, keys checked as on one."""
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=MODEL,
        extra_config={"backend_name": "kdn", "module_path": "kdn.integrations.sglang",
                      "class_name": "KDNHiCacheStorage"})
    store = KDNHiCacheStorage(cfg, {}, objects=MemoryObjects())
    pool, _ = create_mock_host_kv_cache(1 << 12, entries_per_page=2, page_elements=16)
    store.register_mem_pool_host(pool)
    return store


@pytest.mark.parametrize("key", [None, 7, b"abc", "", ["a"], 1.5])
def test_a_key_that_is_not_a_str_is_refused_by_every_call_and_nothing_is_stored(key):
    """set(None, v) once answered True and stored the value under "None". Every call taking
    keys refuses such a key with BadKey (a TypeError, as SGLang's own backends raise for a
    caller's mistake), naming the call and the key, before anything moves."""
    store = offline_backend()
    value = torch.arange(8, dtype=torch.float32)
    out = torch.zeros(8)
    calls = {"set": lambda: store.set(key, value),
             "get": lambda: store.get(key, out),
             "exists": lambda: store.exists(key),
             "batch_set": lambda: store.batch_set(["ok", key], [value, value]),
             "batch_get": lambda: store.batch_get(["ok", key], [out, out]),
             "batch_exists": lambda: store.batch_exists(["ok", key]),
             "batch_set_v1": lambda: store.batch_set_v1(["ok", key], torch.arange(2)),
             "batch_get_v1": lambda: store.batch_get_v1(["ok", key], torch.arange(2))}
    for call, do in calls.items():
        with pytest.raises(BadKey) as e:
            do()
        assert isinstance(e.value, TypeError)
        where = "the key" if call in ("set", "get", "exists") else "keys[1]"
        assert str(e.value).startswith(f"KDN HiCache {call}: {where} must be a non-empty str (a page hash), "
                                       f"got {key!r:.60}"), str(e.value)
    assert store.objects.stored == {}, "nothing was stored"


def test_batches_must_be_lists_with_a_value_per_key():
    store = offline_backend()
    value = torch.arange(8, dtype=torch.float32)
    with pytest.raises(BadKey, match="KDN HiCache batch_exists: keys must be a list of str, got str"):
        store.batch_exists("abc")
    with pytest.raises(BadKey, match="KDN HiCache batch_set: 2 keys but 1 values"):
        store.batch_set(["a", "b"], [value])
    with pytest.raises(BadKey, match="KDN HiCache batch_get: 1 keys but 2 target_locations"):
        store.batch_get(["a"], [torch.zeros(8), torch.zeros(8)])
    assert store.objects.stored == {}
    # str keys, as SGLang gives them, still work
    assert store.set("page-0", value) is True and store.exists("page-0") and not store.exists("page-1")
    out = torch.zeros(8)
    assert store.get("page-0", out) is out and torch.equal(out, value)
    assert store.batch_set_v1(["p1", "p2"], torch.arange(2)) == [True, True]
    assert store.batch_exists(["p1", "p2", "p3"]) == 2


def test_an_edge_killed_during_a_load_never_yields_wrong_pages(net):
    """Last in the module: it kills eu-west's edge. (Stored durable first: an edge that dies
    with stores it acknowledged loses them, README.)"""
    import threading
    store = backend(net, ack="origin")
    pool, buffer = create_mock_host_kv_cache(24 << 20, entries_per_page=2, page_elements=1 << 20)
    store.register_mem_pool_host(pool)                    # 8 MiB a page (2 entries of 4 MiB)
    keys = [uuid.uuid4().hex for _ in range(6)]
    assert all(store.batch_set_v1(keys, torch.arange(6)))
    want = buffer[:6 * 2 * (1 << 20)].clone()
    dst = slice(6 * 2 * (1 << 20), 12 * 2 * (1 << 20))
    buffer[dst] = 0
    got = {}
    t = threading.Thread(target=lambda: got.update(ok=store.batch_get_v1(keys, torch.arange(6, 12))))
    t.start()
    ray.kill(net.edge("eu-west-0"), no_restart=True)
    t.join(60)
    page = 2 * (1 << 20)
    for i, ok in enumerate(got["ok"]):
        if ok:
            assert torch.equal(buffer[dst][i * page:(i + 1) * page], want[i * page:(i + 1) * page])
    buffer[dst] = 0
    assert all(store.batch_get_v1(keys, torch.arange(6, 12)))           # the next edge serves
    assert torch.equal(buffer[dst], want)
    assert store.objects.counters["load_failovers"] >= 1
