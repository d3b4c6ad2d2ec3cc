"""kdn/edge/conversations.py: the conversation tier's budgets per tenant, its own capacity, the idle
TTL renewed by reads, first bytes kept, the operator's settings applied at once."""
import pytest

from kdn.core.errors import BadRequest
from kdn.edge.conversations import Conversations


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Held:                       # what the tier needs of kdn/edge/tiers.Held
    def __init__(self, key, ns=b"n" * 16, nbytes=100, tag=""):
        self.key, self.ns, self.nbytes, self.tag = key, ns, nbytes, tag


def key(i):
    return i.to_bytes(16, "big")


def tier(**kw):
    clock = Clock()
    return Conversations(kw.pop("capacity", 1000), clock=clock, **kw), clock


def test_a_tenant_over_its_budget_loses_its_own_oldest_chunks_and_nobody_elses():
    c, _ = tier(capacity=10_000, default_budget_bytes=300)
    for i in range(3):
        assert c.put("a", key(i), Held(key(i)))
    assert c.put("b", key(100), Held(key(100)))
    assert c.put("a", key(3), Held(key(3)))                  # a is at its 300: its oldest goes
    assert [k for k in (key(0), key(1), key(2), key(3)) if k in c] == [key(1), key(2), key(3)]
    assert key(100) in c
    s = c.stats()
    assert s["tenant_bytes"] == {"a": 300, "b": 100} and s["conv_evicted_budget"] == 1


def test_the_tiers_capacity_evicts_the_least_recently_used_of_anyone():
    c, clock = tier(capacity=300)
    c.put("a", key(1), Held(key(1)))
    clock.t += 1
    c.put("b", key(2), Held(key(2)))
    clock.t += 1
    c.put("a", key(3), Held(key(3)))
    assert c.get(key(1)) is not None                           # read: now the most recent
    c.put("b", key(4), Held(key(4)))
    assert key(2) not in c and all(k in c for k in (key(1), key(3), key(4)))
    assert c.stats()["conv_evicted_capacity"] == 1 and c.stats()["bytes"] == 300


def test_an_idle_ttl_expires_chunks_and_every_read_renews_it():
    c, clock = tier(default_ttl_s=60)
    c.put("a", key(1), Held(key(1)))
    c.put("a", key(2), Held(key(2)))
    clock.t += 50
    assert c.get(key(1)) is not None                           # renewed at t+50
    clock.t += 20                                              # key 2 idle 70 s, key 1 idle 20 s
    assert c.get(key(2)) is None and c.peek(key(1)) is not None
    clock.t += 41
    assert c.sweep() == 1 and c.stats()["chunks"] == 0 and c.stats()["bytes"] == 0
    assert c.stats()["conv_expired"] == 2


def test_retention_asks_within_the_tenants_bounds():
    c, clock = tier(default_ttl_s=60)
    c.set_policy("a", max_ttl_s=600)
    c.put("a", key(1), Held(key(1)), "24h")                   # a day, capped at the tenant's 600 s
    c.put("a", key(2), Held(key(2)), "in_memory")             # the tenant's 60 s
    clock.t += 300
    assert key(1) in c and key(2) not in c
    clock.t += 301
    assert key(1) not in c
    with pytest.raises(BadRequest, match="prompt_cache_retention must be one of in_memory, 24h"):
        c.put("a", key(3), Held(key(3)), "forever")
    assert key(3) not in c


def test_the_first_bytes_stored_under_a_key_are_kept():
    c, _ = tier()
    first, second = Held(key(1), tag="first"), Held(key(1), tag="second")
    assert c.put("a", key(1), first) and c.put("a", key(1), second)
    assert c.get(key(1)).tag == "first" and c.stats()["bytes"] == 100


def test_a_read_of_another_namespace_is_a_miss_that_renews_nothing():
    c, clock = tier(default_ttl_s=60)
    c.put("a", key(1), Held(key(1), ns=b"a" * 16))
    clock.t += 59
    assert c.get(key(1), ns=b"b" * 16) is None
    clock.t += 2
    assert c.get(key(1), ns=b"a" * 16) is None                 # not renewed by the other's read


def test_the_operators_settings_apply_at_once_and_bad_ones_are_refused():
    c, clock = tier(capacity=10_000, default_ttl_s=600)
    for i in range(5):
        c.put("a", key(i), Held(key(i)))
    assert c.set_policy("a", budget_bytes=200)["budget_bytes"] == 200
    assert c.stats()["tenant_bytes"] == {"a": 200}             # the three oldest went now
    clock.t += 100
    c.set_policy("a", ttl_s=50)                                # idle 100 s > 50 s: expired now
    assert c.stats()["chunks"] == 0
    for bad in ({"ttl_s": 0}, {"ttl_s": float("nan")}, {"budget_bytes": -1}, {"max_ttl_s": 10 ** 9}):
        with pytest.raises(BadRequest):
            c.set_policy("a", **bad)
    assert c.policy_of("a") == {"tenant": "a", "ttl_s": 50, "max_ttl_s": 86400.0, "budget_bytes": 200,
                                "pinned": False}


def test_a_chunk_larger_than_the_budget_is_refused_not_flushing_everything():
    c, _ = tier(capacity=10_000, default_budget_bytes=250)
    c.put("a", key(1), Held(key(1)))
    assert not c.put("a", key(2), Held(key(2), nbytes=300))
    assert key(1) in c and c.stats()["conv_refused"] == 1


def test_listing_and_dropping_a_tenants_conversations():
    c, clock = tier(capacity=10_000)
    c.put("a", key(1), Held(key(1), ns=b"x" * 16))
    c.put("a", key(2), Held(key(2), ns=b"x" * 16))
    clock.t += 5
    c.put("a", key(3), Held(key(3), ns=b"y" * 16))
    c.put("b", key(4), Held(key(4)))
    got = c.listing("a")
    assert [(d["ns"], d["chunks"], d["bytes"]) for d in got] == [(b"y".hex() * 16, 1, 100), (b"x".hex() * 16, 2, 200)]
    assert got[1]["idle_s"] == 5
    dropped = []
    c.on_drop = dropped.append
    assert c.drop_tenant("a") == 3 and sorted(dropped) == [key(1), key(2), key(3)]
    assert c.listing("a") == [] and key(4) in c


def test_a_conversation_loses_its_tail_before_its_head():
    c, _ = tier(capacity=300)
    assert c.put_prefix("a", [(key(i), Held(key(i))) for i in range(4)]) == 3   # the first fit last
    assert [i for i in range(4) if key(i) in c] == [0, 1, 2]
    got = c.get_prefix([key(0), key(1), key(2), key(3)], b"n" * 16)
    assert [h.key for h in got] == [key(0), key(1), key(2)]
    c.put("a", key(9), Held(key(9)))                             # room: the tail goes again
    assert [i for i in range(3) if key(i) in c] == [0, 1]


# --- the edge's RPCs over the tier (a real EdgeNode outside Ray: the `kit` fixture) ----------
ADMIN, ACME, BETA = "admin-0123456789abcdef", "acme-0123456789abcdef", "beta-0123456789abcdef"
AUTH = {"admin": ADMIN, "readers": {"acme": ACME, "beta": BETA}}


def conversation(kit, n=3, tenant="acme", salt=None, home="here-0"):
    from kdn.core.conversation import conversation_namespace, conversation_scope
    scope = conversation_scope(home, salt)
    ns = conversation_namespace(tenant, "fp", scope)
    return scope, ns, kit.make_chunks(n, ns=ns)


def test_a_worker_keeps_a_conversation_at_its_home_edge_and_reads_it_back(kit):
    import asyncio
    from kdn.edge.metrics import EdgeMetrics  # noqa: F401 - exported below
    edge = kit.local_edge([], auth=AUTH)
    scope, ns, chunks = conversation(kit)
    keys = [c.key for c in chunks]
    assert asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME)) == 3
    assert asyncio.run(edge.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME)) == 3
    got = asyncio.run(edge.conversation_fetch(keys + [bytes(16)], ns, "acme", "fp", scope, token=ACME))
    objs = [resolved(o) for o in got["refs"]]      # references where this process runs Ray
    assert [o.key for o in objs] == keys and got["bytes"] == sum(c.nbytes for c in chunks)
    assert all(o.kv.tobytes() == c.kv.tobytes() for o, c in zip(objs, chunks))
    m = samples(edge)
    assert m[("kdn_edge_conversation_bytes", (("tenant", "acme"),))] == got["bytes"]
    assert m[("kdn_edge_conversation_reads_total", (("outcome", "hit"),))] == 3
    listed = asyncio.run(edge.conversations_of("acme", token=ACME))
    assert listed["conversations"][0]["chunks"] == 3 and listed["policy"]["ttl_s"] == 1800.0


def test_another_tenants_token_a_foreign_namespace_or_home_is_refused_and_nothing_is_stored(kit):
    import asyncio
    from kdn.core.errors import AccessDenied, BadRequest
    edge = kit.local_edge([], auth=AUTH)
    scope, ns, chunks = conversation(kit)
    keys = [c.key for c in chunks]
    with pytest.raises(AccessDenied):
        asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=BETA))
    with pytest.raises(AccessDenied):
        asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope))
    with pytest.raises(BadRequest, match="of another namespace"):   # chunks keyed for beta's claim
        asyncio.run(edge.put_conversation(chunks, "beta", "fp", scope, token=BETA))
    away_scope, _, away = conversation(kit, home="far-0")
    with pytest.raises(BadRequest, match="the conversation's home is edge 'far-0', not 'here-0'"):
        asyncio.run(edge.put_conversation(away, "acme", "fp", away_scope, token=ACME))
    with pytest.raises(BadRequest, match="prompt_cache_retention must be one of"):
        asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, "1w", token=ACME))
    assert edge.conversations.stats()["chunks"] == 0
    asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME))
    with pytest.raises(AccessDenied):                               # beta reading acme's
        asyncio.run(edge.conversation_fetch(keys, ns, "acme", "fp", scope, token=BETA))
    with pytest.raises(BadRequest, match="ns is not the namespace"):
        asyncio.run(edge.conversation_fetch(keys, ns, "beta", "fp", scope, token=BETA))
    with pytest.raises(AccessDenied):
        asyncio.run(edge.drop_conversations("acme", token=ACME))    # an operator's call
    assert asyncio.run(edge.drop_conversations("acme", token=ADMIN)) == 3


def samples(edge) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    from kdn.edge.metrics import EdgeMetrics
    text = EdgeMetrics(edge).exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_worker_on_another_node_reads_the_history_over_http_as_over_ray(kit, serve, loop):
    """POST /v1/conversation (kdn/client/history.py's path from another node): the held prefix
    as verified frames, in order, the bytes kept; the same checks as conversation_fetch: another
    tenant's token is 403, none 401, a scope homed elsewhere or a wrong namespace 400."""
    from kdn.client.http import EdgeHTTPClient
    from kdn.core.errors import AccessDenied, BadRequest
    edge = kit.local_edge([], auth=AUTH)
    server = serve(edge)
    scope, ns, chunks = conversation(kit)
    keys = [c.key for c in chunks]
    assert loop.run(edge.put_conversation(chunks[:2], "acme", "fp", scope, token=ACME)) == 2
    with EdgeHTTPClient(server.url, token=ACME) as c:
        objs, nbytes = c.conversation_get(keys, ns, "acme", "fp", scope)      # the third is not held
        assert [o.kv.tobytes() for o in objs[:2]] == [ch.kv.tobytes() for ch in chunks[:2]]
        assert objs[2] is None and [o.key for o in objs[:2]] == keys[:2] and nbytes > 0
        with pytest.raises(BadRequest, match="ns is not the namespace"):
            c.conversation_get(keys, ns, "beta", "fp", scope)
        away_scope, away_ns, _ = conversation(kit, home="far-0")
        with pytest.raises(BadRequest, match="home is edge 'far-0'"):
            c.conversation_get(keys, away_ns, "acme", "fp", away_scope)
    with pytest.raises(AccessDenied, match="403"):
        EdgeHTTPClient(server.url, token=BETA).conversation_get(keys, ns, "acme", "fp", scope)
    with pytest.raises(AccessDenied, match="401"):
        EdgeHTTPClient(server.url).conversation_get(keys, ns, "acme", "fp", scope)
    assert edge.counters["conversation_chunks_served"] == 2


def resolved(obj):
    import ray
    return ray.get(obj) if isinstance(obj, ray.ObjectRef) else obj


# --- memory then disk (a real kdn/edge/disk.DiskTier of the tier's own) --------------------------
def disk_tier(kit, tmp_path, n_memory: int, n_disk: int = 16, **kw):
    """A tier whose memory holds n_memory of kit's chunks and whose disk holds n_disk."""
    from kdn.edge.disk import DiskTier
    from kdn.edge.tiers import Held as RealHeld
    chunks = kit.make_chunks(8)
    size = chunks[0].nbytes
    disk = DiskTier(tmp_path / "conv", n_disk * (size + 4096), "lru")
    clock = Clock()
    c = Conversations(n_memory * size, clock=clock, disk=disk, keep=RealHeld.here, **kw)
    return c, clock, disk, chunks, [RealHeld.here(x) for x in chunks]


def files(disk) -> set:
    return {p.name for p in disk.dir.rglob("*.kdnc")}


def test_memorys_oldest_chunks_move_to_disk_and_a_read_brings_them_back_the_same_bytes(kit, tmp_path):
    c, clock, disk, chunks, helds = disk_tier(kit, tmp_path, n_memory=2)
    for i in range(4):
        clock.t += 1
        assert c.put("a", chunks[i].key, helds[i])
    s = c.stats()
    assert s["chunks"] == 4 and s["bytes"] == 2 * chunks[0].nbytes and s["disk_bytes"] == 2 * chunks[0].nbytes
    assert files(disk) == {chunks[i].key.hex() + ".kdnc" for i in (0, 1)} and s["conv_spilled"] == 2
    assert s["tenant_bytes"] == {"a": 4 * chunks[0].nbytes}          # the budget counts both tiers
    got = c.get(chunks[0].key, kit.NS)                               # read back into memory
    assert got.obj.kv.tobytes() == chunks[0].kv.tobytes() and got.obj.key == chunks[0].key
    assert c.stats()["conv_disk_hits"] == 1 and c.stats()["bytes"] == 2 * chunks[0].nbytes
    assert c.peek(chunks[2].key) is None and chunks[2].key in c       # chunk 2 went to disk for it
    assert c.get(chunks[0].key, OTHER_NS) is None                    # another namespace: a miss
    got = c.get_prefix([x.key for x in chunks[:4]], kit.NS)
    assert [h.obj.kv.tobytes() for h in got] == [x.kv.tobytes() for x in chunks[:4]]


OTHER_NS = b"o" * 16


def test_nothing_outlives_its_ttl_in_memory_or_on_disk(kit, tmp_path):
    c, clock, disk, chunks, helds = disk_tier(kit, tmp_path, n_memory=2, default_ttl_s=60)
    dropped = []
    c.on_drop = dropped.append
    for i in range(5):
        c.put("a", chunks[i].key, helds[i])
    assert len(files(disk)) == 3
    clock.t += 61
    assert c.get(chunks[0].key) is None                               # on disk, idle past its TTL
    assert c.sweep() == 4
    assert files(disk) == set() and c.stats()["chunks"] == 0 and c.stats()["bytes"] == 0
    assert c.stats()["disk_bytes"] == 0 and len(disk) == 0
    assert sorted(dropped) == sorted(x.key for x in chunks[:5]) and c.stats()["conv_expired"] == 5


def test_a_tenants_budget_counts_disk_and_its_oldest_goes_from_disk(kit, tmp_path):
    c, clock, disk, chunks, helds = disk_tier(kit, tmp_path, n_memory=1,
                                              default_budget_bytes=3 * kit.make_chunks(1)[0].nbytes)
    for i in range(4):
        clock.t += 1
        c.put("a", chunks[i].key, helds[i])
    assert [i for i in range(4) if chunks[i].key in c] == [1, 2, 3]
    assert chunks[0].key.hex() + ".kdnc" not in files(disk) and c.stats()["conv_evicted_budget"] == 1
    c.drop_tenant("a")
    assert files(disk) == set() and c.stats()["tenant_bytes"] == {}


def test_what_the_disks_own_capacity_evicts_is_gone(kit, tmp_path):
    c, clock, disk, chunks, helds = disk_tier(kit, tmp_path, n_memory=1, n_disk=2)
    for i in range(5):
        clock.t += 1
        c.put("a", chunks[i].key, helds[i])
    held = [i for i in range(5) if chunks[i].key in c]
    assert len(held) == 3 and 4 in held and len(files(disk)) == 2     # 1 in memory, 2 on disk
    assert c.stats()["conv_evicted_capacity"] == 2 and c.stats()["chunks"] == 3


def test_an_edge_with_a_disk_keeps_conversations_beside_it_and_starts_them_empty(kit, tmp_path):
    import asyncio
    size = kit.make_chunks(1)[0].nbytes
    opts = dict(auth=AUTH, disk_bytes=64 << 20, disk_dir=str(tmp_path), conversation_bytes=2 * size)
    edge = kit.local_edge([], **opts)
    scope, ns, chunks = conversation(kit, n=5)
    keys = [x.key for x in chunks]
    assert asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME)) == 5
    conv_dir = tmp_path / "here-0.conversations"
    assert edge.conversations.disk.dir == conv_dir and edge.conversations.disk.capacity == 32 << 20
    on_disk = {p.name for p in conv_dir.rglob("*.kdnc")}
    assert len(on_disk) == 3 and not list((tmp_path / "here-0").rglob("*.kdnc"))   # not the KB tier's
    assert asyncio.run(edge.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME)) == 5
    got = asyncio.run(edge.conversation_fetch(keys, ns, "acme", "fp", scope, token=ACME))
    assert [resolved(o).kv.tobytes() for o in got["refs"]] == [x.kv.tobytes() for x in chunks]
    m = samples(edge)
    assert m[("kdn_edge_conversation_tier_bytes", (("tier", "disk"),))] == 3 * size
    assert m[("kdn_edge_conversation_disk_reads_total", ())] >= 3
    listed = asyncio.run(edge.conversations_of("acme", token=ACME))["conversations"][0]
    assert listed["chunks"] == 5 and listed["on_disk"] == 3 * size
    again = kit.local_edge([], **opts)                              # restarted on the same disk
    assert not list(conv_dir.rglob("*.kdnc")) and again.conversations.stats()["chunks"] == 0
    assert asyncio.run(again.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME)) == 0
    # past its idle TTL, nothing of it is left in memory or on disk
    clock = Clock()
    again.conversations.clock = clock
    assert asyncio.run(again.put_conversation(chunks, "acme", "fp", scope, token=ACME)) == 5
    assert len(list(conv_dir.rglob("*.kdnc"))) == 3
    asyncio.run(again.set_conversation_policy("acme", ttl_s=60, token=ADMIN))
    clock.t += 61
    asyncio.run(again._tick())                                      # the edge's background tick
    assert not list(conv_dir.rglob("*.kdnc")) and again.conversations.stats()["chunks"] == 0
    assert again.conversations.stats()["bytes"] == 0 and again.conversations.stats()["conv_expired"] == 5


def test_a_conversations_new_tail_goes_before_the_head_it_extends():
    c, _ = tier(capacity=600)
    c.put("a", key(99), Held(key(99)))                                    # another conversation, same ns
    c.put_prefix("a", [(key(i), Held(key(i))) for i in range(3)])          # turn 1: chunks 0-2
    c.get_prefix([key(0), key(1), key(2)], b"n" * 16)                      # turn 2 reads them
    c.put("a", key(98), Held(key(98)))                                    # and another conversation
    c.put_prefix("a", [(key(i), Held(key(i))) for i in range(3, 7)],       # and adds 3-6: two too many
                 head=[key(0), key(1), key(2)])
    assert [i for i in (0, 1, 2, 3, 4, 98, 99) if key(i) in c] == [0, 1, 2, 3, 4], \
        "the other conversations' older chunks, then this one's tail, never its head"


def test_a_spill_the_disk_fails_or_evicts_at_once_loses_that_chunk_and_nothing_else(kit, tmp_path):
    import errno
    c, clock, disk, chunks, helds = disk_tier(kit, tmp_path, n_memory=1)
    real_write = disk.write

    def failing(obj):
        raise OSError(errno.EIO, "I/O error")
    disk.write = failing
    c.put("a", chunks[0].key, helds[0])
    c.put("a", chunks[1].key, helds[1])               # chunk 0 moves out; its write fails
    assert chunks[0].key not in c and chunks[1].key in c and c._spilling == {}
    assert c.stats()["tenant_bytes"] == {"a": chunks[1].nbytes} and c.stats()["conv_evicted_capacity"] == 1

    def evicted_at_once(obj):                          # written, then another write's eviction took it
        ok = real_write(obj)
        disk.discard(obj.key)
        return ok
    disk.write = evicted_at_once
    c.put("a", chunks[2].key, helds[2])               # chunk 1 moves out: its file is gone at once
    assert chunks[1].key not in c and c.stats()["chunks"] == 1 and c._spilling == {}
    assert c.stats()["tenant_bytes"] == {"a": chunks[2].nbytes} and files(disk) == set()


# --- a pinned tenant (kdn/origin/conversations.py): the edge keeps the origin's copy in step -------
class ToOrigin:
    """The edge's calls to ORIGIN_NODE, answered by a real OriginNode in this process (its
    store in a folder), or Unreachable while `down`."""

    def __init__(self, origin):
        self.origin, self.down, self.calls, self.miss = origin, False, [], set()
        self.slow = {}                          # method -> seconds its answers take

    async def call(self, node, method, *args, timeout=None, **kw):
        import asyncio
        from kdn.core.rpc import Unreachable
        self.calls.append(method)
        if self.down or method in self.miss:
            self.miss.discard(method)           # a method in miss misses its next call only
            raise Unreachable(f"{node} is down (a test's)")
        await asyncio.sleep(self.slow.get(method, 0))
        return await getattr(self.origin, method)(*args, token=ADMIN, **kw)


@pytest.fixture
def pinned_edge(kit, tmp_path):
    """(edge, origin, stand-in) with tenant acme pinned at the origin and the edge told so."""
    import asyncio
    from kdn.origin.node import OriginNode
    origin = OriginNode("t", str(tmp_path / "origin"), kit.topology(), auth=AUTH, actors=object())
    asyncio.run(origin.set_conversation_policy("acme", pinned=True, token=ADMIN))
    edge = kit.local_edge([], auth=AUTH)
    edge.peers.actors = ToOrigin(origin)
    _ping(edge, origin.store.conversations.policies)
    return edge, origin, edge.peers.actors


def test_a_pinned_tenants_chunks_reach_the_origin_and_come_back_when_the_edge_lost_them(pinned_edge, kit):
    import asyncio
    edge, origin, _ = pinned_edge
    scope, ns, chunks = conversation(kit, n=4)
    keys = [c.key for c in chunks]
    asyncio.run(edge.put_conversation(chunks[:2], "acme", "fp", scope, token=ACME))   # stored whole
    assert origin.store.conversation_prefix("acme", ns, keys) == keys[:2]
    assert edge.conversations.policy_of("acme")["pinned"]
    assert asyncio.run(edge.drop_conversations("acme", token=ADMIN)) == 2          # the edge's copy only
    assert asyncio.run(edge.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME)) == 2
    got = asyncio.run(edge.conversation_fetch(keys, ns, "acme", "fp", scope, token=ACME))
    assert [resolved(o).kv.tobytes() for o in got["refs"]] == [c.kv.tobytes() for c in chunks[:2]]
    assert edge.counters["conversation_pulled_chunks"] == 2
    # a conversation pinned midway: its next store sends the origin its start too
    _, other_ns, other = conversation(kit, n=3, salt="late")
    other_scope = conversation(kit, salt="late")[0]
    edge.conversations.set_pinned([])
    asyncio.run(edge.put_conversation(other[:2], "acme", "fp", other_scope, token=ACME))
    edge.conversations.set_pinned(["acme"])
    asyncio.run(edge.put_conversation(other[2:], "acme", "fp", other_scope, head=[c.key for c in other[:2]],
                                      token=ACME))
    assert origin.store.conversation_prefix("acme", other_ns, [c.key for c in other]) == [c.key for c in other]


def test_a_pull_back_slower_than_its_lookup_goes_on_and_lands_for_the_next_turn(pinned_edge, kit, monkeypatch):
    """Under load the origin's read outlasts a lookup's wait: the lookup answers what is held
    (nothing), the one pull goes on (a second lookup meanwhile joins it, no second read) and
    the next turn's lookup finds the whole conversation; a lookup naming more keys (the next
    turn's) joins the same pull. A tenant unpinned while its pull is
    on the way gets nothing back."""
    import asyncio
    from kdn.edge import node as edge_node
    monkeypatch.setattr(edge_node, "PIN_LOOKUP_TIMEOUT_S", 0.05)
    edge, origin, to_origin = pinned_edge
    scope, ns, chunks = conversation(kit, n=4)
    longer = [c.key for c in chunks]            # the next turn's keys: one chunk more
    chunks, keys = chunks[:3], longer[:3]
    asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME))
    asyncio.run(edge.drop_conversations("acme", token=ADMIN))           # the edge's copy only
    to_origin.slow["conversation_chunks"] = 0.4
    reads = to_origin.calls.count("conversation_chunks")

    async def turns():
        first = await edge.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME)
        second = await edge.conversation_lookup(longer, ns, "acme", "fp", scope, token=ACME)
        await asyncio.sleep(0.6)
        return first, second, await edge.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME)
    assert asyncio.run(turns()) == (0, 0, 3)
    assert to_origin.calls.count("conversation_chunks") == reads + 1
    assert edge.counters["conversation_pull_late"] == 2 and edge.counters["conversation_pulled_chunks"] == 3
    got = asyncio.run(edge.conversation_fetch(keys, ns, "acme", "fp", scope, token=ACME))
    assert [resolved(o).kv.tobytes() for o in got["refs"]] == [c.kv.tobytes() for c in chunks]
    assert samples(edge)[("kdn_edge_conversation_pull_waits_cut_total", ())] == 2

    asyncio.run(edge.drop_conversations("acme", token=ADMIN))

    async def unpinned_meanwhile():
        assert await edge.conversation_lookup(keys, ns, "acme", "fp", scope, token=ACME) == 0
        edge.conversations.set_pinned([])
        await asyncio.sleep(0.6)
        return [k in edge.conversations for k in keys]
    assert asyncio.run(unpinned_meanwhile()) == [False] * 3
    assert edge.counters["conversation_pulled_chunks"] == 3 and edge._pin_pulls == {}


def test_a_key_keeps_the_origins_bytes_and_an_unreachable_origin_costs_only_the_copy(pinned_edge, kit):
    import asyncio
    edge, origin, to_origin = pinned_edge
    scope, ns, chunks = conversation(kit, n=2)
    asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME))
    asyncio.run(edge.drop_conversations("acme", token=ADMIN))
    # a worker that recomputed the same keys (other last bits) after the edge lost them
    from kdn.core.chunk import Chunk
    again = [Chunk(c.key, c.ns, c.kv + 1e-6, "float32") for c in chunks]
    assert asyncio.run(edge.put_conversation(again, "acme", "fp", scope, token=ACME)) == 2
    got = asyncio.run(edge.conversation_fetch([c.key for c in chunks], ns, "acme", "fp", scope, token=ACME))
    assert [resolved(o).kv.tobytes() for o in got["refs"]] == [c.kv.tobytes() for c in chunks]
    # the origin down: the chunks are kept here all the same, and the failure counted
    _, _, more = conversation(kit, n=2, salt="offline")
    to_origin.down = True
    assert asyncio.run(edge.put_conversation(more, "acme", "fp", conversation(kit, salt="offline")[0],
                                             token=ACME)) == 2
    assert edge.counters["conversation_pin_failures"] == 1
    assert edge.conversations.not_at_origin([c.key for c in more]) == [c.key for c in more]
    # unpinned at the origin (a refusal): counted, nothing lost here
    to_origin.down = False
    asyncio.run(origin.set_conversation_policy("acme", pinned=False, token=ADMIN))
    _, _, last = conversation(kit, n=1, salt="after")
    assert asyncio.run(edge.put_conversation(last, "acme", "fp", conversation(kit, salt="after")[0],
                                             token=ACME)) == 1
    assert edge.counters["conversation_pin_refused"] == 1
    m = samples(edge)
    assert m[("kdn_edge_conversation_origin_chunks_total", (("direction", "pulled"),))] == 2
    assert m[("kdn_edge_conversation_pin_failures_total", (("reason", "unreachable"),))] == 1
    assert m[("kdn_edge_conversation_pin_failures_total", (("reason", "refused"),))] == 1


def test_a_recomputed_copy_the_pull_missed_is_replaced_by_the_origins_bytes(pinned_edge, kit):
    """The edge lost its copy, the pull before a worker's store did not answer, and the edge
    kept the worker's recomputed bytes: the origin (which keeps the key's first bytes) says
    which differ, and the edge takes the origin's."""
    import asyncio
    from kdn.core.chunk import Chunk
    edge, origin, to_origin = pinned_edge
    scope, ns, chunks = conversation(kit, n=2)
    keys = [c.key for c in chunks]
    asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME))
    asyncio.run(edge.drop_conversations("acme", token=ADMIN))
    to_origin.miss = {"conversation_chunks"}
    again = [Chunk(c.key, c.ns, c.kv + 1e-6, "float32") for c in chunks]
    assert asyncio.run(edge.put_conversation(again, "acme", "fp", scope, token=ACME)) == 2
    assert edge.counters["conversation_pin_replaced"] == 2
    got = asyncio.run(edge.conversation_fetch(keys, ns, "acme", "fp", scope, token=ACME))
    assert [resolved(o).kv.tobytes() for o in got["refs"]] == [c.kv.tobytes() for c in chunks]
    assert samples(edge)[("kdn_edge_conversation_replaced_chunks_total", ())] == 2


def test_a_deletion_at_the_origin_makes_the_edge_send_its_chunks_again(pinned_edge, kit):
    """An operator's drop reached the origin but not this edge: the tenant's epoch moved on,
    the edge's next ping forgets which chunks it sent, and its next store sends the whole
    conversation again."""
    import asyncio
    edge, origin, _ = pinned_edge
    scope, ns, chunks = conversation(kit, n=3)
    keys = [c.key for c in chunks]
    asyncio.run(edge.put_conversation(chunks[:2], "acme", "fp", scope, token=ACME))
    assert asyncio.run(origin.drop_conversations("acme", token=ADMIN))["deleted"] == 2
    _ping(edge, origin.store.conversations.policies)
    assert edge.conversations.not_at_origin(keys) == keys[:2]
    asyncio.run(edge.put_conversation(chunks[2:], "acme", "fp", scope, head=keys[:2], token=ACME))
    assert origin.store.conversation_prefix("acme", ns, keys) == keys


def test_an_origin_that_fails_to_store_costs_only_the_copy(pinned_edge, kit, monkeypatch):
    import asyncio
    from kdn.core.errors import StoreError
    edge, origin, _ = pinned_edge

    def full(*a):
        raise StoreError("disk full (a test's)")
    monkeypatch.setattr(origin.store, "put_conversation", full)
    scope, ns, chunks = conversation(kit, n=2)
    assert asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, token=ACME)) == 2
    assert edge.counters["conversation_pin_store_errors"] == 1
    assert edge.conversations.not_at_origin([c.key for c in chunks]) == [c.key for c in chunks]
    assert samples(edge)[("kdn_edge_conversation_pin_failures_total", (("reason", "store_error"),))] == 1


def _ping(edge, policies):
    """A health ping carrying policies, and the background task that applies them, done."""
    import asyncio

    async def go():
        await edge.ping(conversation_policies=policies)
        await edge._policy_task
    asyncio.run(go())


def test_the_origins_policies_reach_an_edge_with_its_pings_and_apply_once(kit):
    """A restarted edge knows no operator's setting; the origin's pings carry them all
    (kdn/origin/conversations.py), and the edge applies each where it differs, once."""
    edge = kit.local_edge([], auth=AUTH)
    policies = {"acme": {"ttl_s": 600.0, "max_ttl_s": 300.0, "budget_bytes": 1 << 20, "pinned": True},
                "beta": {"budget_bytes": 2 << 20}}
    _ping(edge, policies)
    assert edge.conversations.policy_of("acme") == {"tenant": "acme", "ttl_s": 300.0, "max_ttl_s": 300.0,
                                                    "budget_bytes": 1 << 20, "pinned": True}
    assert edge.conversations.policy_of("beta")["budget_bytes"] == 2 << 20
    assert not edge.conversations.policy_of("beta")["pinned"]
    _ping(edge, policies)
    assert edge.counters["conversation_policies_applied"] == 2          # once per tenant
    _ping(edge, {**policies, "acme": {**policies["acme"], "pinned": False}})
    assert not edge.conversations.policy_of("acme")["pinned"]


def test_a_policy_the_edge_refuses_is_counted_and_the_others_still_apply(kit):
    """One tenant's bad value (an origin of another version, a hand-edited file) never stops
    the pings or the other tenants' policies."""
    edge = kit.local_edge([], auth=AUTH)
    _ping(edge, {"bad": {"budget_bytes": -5}, "good": {"budget_bytes": 3 << 20}})
    assert edge.counters["conversation_policies_refused"] == 1
    assert edge.conversations.policy_of("good")["budget_bytes"] == 3 << 20
    assert edge.conversations.policy_of("bad")["budget_bytes"] == edge.conversations.default_budget


# --- tails: a conversation's trailing partial chunk (kdn.core.conversation.tail_key) ----------
def tail_of(chunks, n=20, seed=1):
    """A tail of n tokens after chunks[-1], under the one key rule, and its tokens."""
    import numpy as np
    from kdn.core.chunk import Chunk
    from kdn.core.conversation import tail_key
    tokens = list(range(900_000 + seed * 1000, 900_000 + seed * 1000 + n))
    kv = np.random.default_rng(seed).standard_normal((2, 2, 2, n, 64)).astype(np.float32)
    return Chunk(tail_key(chunks[-1].key, tokens, 64), chunks[-1].ns, kv, "float32"), tokens


def test_a_tail_is_kept_listed_after_its_chunk_and_superseded_by_a_longer_conversation(kit):
    import asyncio
    edge = kit.local_edge([], auth=AUTH)
    scope, ns, chunks = conversation(kit, n=4)
    keys = [c.key for c in chunks]
    tail, _ = tail_of(chunks[:2])
    assert asyncio.run(edge.put_conversation(chunks[:2], "acme", "fp", scope, tail=tail, token=ACME)) == 2
    got = asyncio.run(edge.conversation_find(keys, ns, "acme", "fp", scope, token=ACME))
    assert got == {"held": 2, "tails": [[20, tail.key]]}
    fetched = asyncio.run(edge.conversation_fetch(keys[:2] + [tail.key], ns, "acme", "fp", scope, token=ACME))
    assert resolved(fetched["refs"][-1]).kv.tobytes() == tail.kv.tobytes()
    # the next turn kept two more chunks and its own tail: the first tail goes
    tail2, _ = tail_of(chunks, n=30, seed=2)
    asyncio.run(edge.put_conversation(chunks[2:], "acme", "fp", scope, head=keys[:2], tail=tail2, token=ACME))
    assert tail.key not in edge.conversations and tail2.key in edge.conversations
    assert asyncio.run(edge.conversation_find(keys, ns, "acme", "fp", scope, token=ACME)) == \
        {"held": 4, "tails": [[30, tail2.key]]}
    assert edge.counters["conversation_tails_kept"] == 2
    # a tail expires, is evicted or dropped like any chunk, and is no longer listed
    asyncio.run(edge.drop_conversations("acme", token=ADMIN))
    assert edge.conversations.tails_after(keys[-1]) == []


def test_a_bad_tail_is_refused_and_nothing_is_stored(kit):
    import asyncio
    import numpy as np
    from kdn.core.chunk import Chunk
    edge = kit.local_edge([], auth=AUTH)
    scope, ns, chunks = conversation(kit, n=2)
    tail, _ = tail_of(chunks)
    _, other_ns, _ = conversation(kit, salt="other")
    whole = Chunk(tail.key, ns, np.zeros((2, 2, 2, 64, 64), np.float32), "float32")   # not shorter
    for bad, kw in ((Chunk(tail.key, other_ns, tail.kv, "float32"), {}), (whole, {}), (tail, {"none": True})):
        with pytest.raises(BadRequest, match="tail"):
            asyncio.run(edge.put_conversation([] if kw else chunks, "acme", "fp", scope, tail=bad, token=ACME))
    assert edge.conversations.keys() == []


def test_a_pinned_tenants_tail_stays_at_its_edge(pinned_edge, kit):
    import asyncio
    edge, origin, _ = pinned_edge
    scope, ns, chunks = conversation(kit, n=2)
    tail, _ = tail_of(chunks)
    asyncio.run(edge.put_conversation(chunks, "acme", "fp", scope, tail=tail, token=ACME))
    keys = [c.key for c in chunks]
    assert origin.store.conversation_prefix("acme", ns, keys + [tail.key]) == keys
    assert not origin.store.has(tail.key) and tail.key in edge.conversations
