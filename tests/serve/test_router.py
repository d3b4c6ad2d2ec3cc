"""KV-aware routing's decision and the replica's engine-side KV cache (kdn.serve.router),
without Serve: the decision is a pure function of queues, holders and costs; the router class
is Serve's RequestRouter, checked here to choose from the ranks it returns. The service
itself routes through it in tests/serve/test_serve.py."""
import asyncio
import time
import types

import pytest

from kdn.serve.regions import UNAVAILABLE, View
from kdn.serve.router import EngineKV, KBAffinityRouter, decide, kb_of, owner, region_routers, replica_kv_sources

R = ["r1", "r2", "r3"]


def test_a_kb_goes_to_the_replica_whose_engine_holds_it():
    # one request ahead of it (1 s) costs less than fetching (1.5 s): it waits for r1
    assert decide("t/a", {"r1": 1, "r2": 0, "r3": 0}, {"r1"}, 1.0, 1.5) == ("r1", "engine_hit")
    assert decide("t/a", {"r1": 0, "r2": 0}, {"r2"}, 1.0, 0.0) == ("r2", "engine_hit")


def test_a_holder_busier_than_a_fetch_costs_is_passed_over():
    # r1 holds it but 3 requests wait there (3 s); r2 is idle: fetching (0.5 s) is cheaper
    assert decide("t/a", {"r1": 3, "r2": 0}, {"r1"}, 1.0, 0.5) == ("r2", "routed_away_queue")
    # the same queue with a fetch that costs more than the wait: stay
    assert decide("t/a", {"r1": 3, "r2": 0}, {"r1"}, 1.0, 5.0) == ("r1", "engine_hit")


def test_a_kb_no_engine_holds_goes_to_its_rendezvous_owner_the_same_everywhere():
    queues = {r: 0 for r in R}
    got = {decide(f"t/kb{i}", queues, set(), 1.0, 0.1) for i in range(30)}
    assert {why for _, why in got} == {"owner"} and {r for r, _ in got} == set(R)   # spread
    assert all(decide(f"t/kb{i}", queues, set(), 1.0, 0.1)[0] == owner(f"t/kb{i}", R) for i in range(30))
    # a replica gone moves only its own KBs
    moved = [i for i in range(100) if owner(f"t/kb{i}", R) != owner(f"t/kb{i}", R[:2])]
    assert all(owner(f"t/kb{i}", R) == "r3" for i in moved)


def test_a_busy_owner_is_passed_over():
    o = owner("t/x", R)
    queues = {r: (5 if r == o else 0) for r in R}
    r, why = decide("t/x", queues, set(), 1.0, 0.1)
    assert why == "owner_busy" and r != o


def test_a_decision_takes_well_under_a_millisecond():
    queues = {f"replica-{i}": i % 3 for i in range(64)}
    holders = {"replica-3", "replica-40"}
    t0 = time.perf_counter()
    for i in range(1000):
        decide(f"t/kb{i % 50}", queues, holders, 1.0, 0.2)
    assert (time.perf_counter() - t0) / 1000 < 1e-3


def test_kb_of_reads_the_replica_call():
    assert kb_of(({"kb": "rights", "version": None}, "default", None)) == "default/rights"
    assert kb_of(("default", None)) is None
    assert kb_of(({"kb": None}, "default", None)) is None       # a plain chat names no KB


def test_the_engine_cache_is_bounded_in_bytes_and_least_recently_used_goes_first():
    kv = EngineKV(100)
    assert kv.put("t/a", 1, "A", 40, 0.1) and kv.put("t/b", 1, "B", 40, 0.2)
    assert kv.get("t/a", 1) == "A"                 # a is now the most recent
    assert kv.put("t/c", 1, "C", 40, 0.3)          # b goes
    assert kv.get("t/b", 1) is None and kv.get("t/c", 1) == "C" and kv.bytes == 80
    assert not kv.put("t/huge", 1, "H", 101, 1.0)   # larger than the cache: refused, nothing evicted
    st = kv.routing_stats()
    assert st["kbs"] == ["t/a", "t/c"] and st["fetch_s"]["t/huge"] == 1.0
    assert kv.stats()["engine_hits"] == 2 and kv.stats()["engine_misses"] == 1
    kv.served(2.0)
    kv.served(1.0)
    assert kv.routing_stats()["service_s"] == pytest.approx(1.8)


def test_the_engine_cache_reports_each_kbs_tier_and_size():
    kv = EngineKV(100)
    kv.put("t/a", 1, "A", 40, 0.5, "origin")
    kv.put("t/a", 2, "A2", 40, 0.1, "edge_disk")     # the latest fetch of a KB is what counts
    st = kv.routing_stats()
    assert st["tiers"] == {"t/a": "edge_disk"} and st["kv_bytes"] == {"t/a": 40} and st["fetch_s"] == {"t/a": 0.1}
    assert kv.stats()["fetched_origin"] == 1 and kv.stats()["fetched_edge_disk"] == 1


def test_the_engine_cache_counts_where_each_answers_kv_came_from():
    kv = EngineKV(100)
    for s in ("engine", "engine", "edge_memory", "edge_disk", "none"):
        kv.served_from(s)
    assert kv.routing_stats()["kv_sources"] == {"engine": 2, "edge_memory": 1, "edge_disk": 1, "none": 1}
    with pytest.raises(ValueError, match="unknown KV source 'edge'"):
        kv.served_from("edge")
    assert kv.routing_stats()["kv_sources"]["engine"] == 2


class _Rid:
    """A stand-in for Serve's ReplicaID (hashable, as Serve's replica maps key by it)."""

    def __init__(self, name):
        self.name = name

    def to_full_id_str(self):
        return self.name


class _Replica:
    def __init__(self, name, stats=None):
        self.replica_id = _Rid(name)
        self.routing_stats = stats or {}
        self.max_ongoing_requests = 4


def _region_router(app: str, region: str, replicas, queues=None):
    """A KBAffinityRouter of region's deployment in app, as Serve makes it (its deployment id,
    its replicas, its queue-length cache; queues: replica name -> queue length)."""
    router = KBAffinityRouter.__new__(KBAffinityRouter)
    router._deployment_id = types.SimpleNamespace(name=region, app_name=app)
    q = queues or {}
    router._replica_queue_len_cache = types.SimpleNamespace(get=lambda rid: q.get(rid.name))
    router.initialize_state()
    router._replicas = {r.replica_id: r for r in replicas}      # what curr_replicas returns
    return router


def test_the_serve_router_ranks_the_holder_first_and_the_rest_after():
    """KBAffinityRouter.choose_replicas on stand-ins for Serve's RunningReplica (only the
    attributes it reads), its queue-length cache empty (0 queued)."""
    router = KBAffinityRouter.__new__(KBAffinityRouter)
    router._replica_queue_len_cache = types.SimpleNamespace(get=lambda rid: None)
    router.initialize_state()
    reps = [_Replica("a"), _Replica("b", {"kbs": ["default/rights"], "service_s": 1.0}), _Replica("c")]
    req = types.SimpleNamespace(args=({"kb": "rights"}, "default", None))
    ranks = asyncio.run(router.choose_replicas(reps, req))
    assert [r.replica_id.name for r in ranks[0]] == ["b"] and {r.replica_id.name for r in ranks[1]} == {"a", "c"}
    assert router.counters["engine_hit"] == 1
    # what this router sent is remembered before the replica reports it
    router.on_request_routed(types.SimpleNamespace(args=({"kb": "new"}, "default", None)),
                             reps[2].replica_id, None)
    ranks = asyncio.run(router.choose_replicas(reps, types.SimpleNamespace(args=({"kb": "new"}, "default", None))))
    assert ranks[0][0].replica_id.name == "c"


def test_a_conversations_next_turn_goes_to_the_replica_that_holds_it_unless_its_queue_costs_more():
    from kdn.serve.router import conversation_of
    router = KBAffinityRouter.__new__(KBAffinityRouter)
    queues = {}
    router._replica_queue_len_cache = types.SimpleNamespace(get=lambda rid: queues.get(rid.name))
    router.initialize_state()
    reps = [_Replica("a", {"kbs": ["default/rights"], "service_s": 1.0}),
            _Replica("b", {"conversations": ["open:c1"], "service_s": 1.0}), _Replica("c")]
    later = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    turn = types.SimpleNamespace(args=({"kb": "rights", "conversation": "open:c1", "messages": later},
                                       "default", None))
    assert conversation_of(turn.args) == "open:c1" and conversation_of(({"kb": "x"}, "t", None)) is None
    first = {"kb": "rights", "conversation": "open:c1", "messages": later[:1]}
    assert conversation_of((first, "default", None)) is None, "a first turn follows nothing"
    assert conversation_of((dict(first, prompt_cache_key="k"), "default", None)) == "open:c1"
    ranks = asyncio.run(router.choose_replicas(reps, turn))
    assert ranks[0][0].replica_id.name == "b", "the conversation's holder, not the KB's"
    assert router.counters["conversation_hit"] == 1
    queues.update(b=9)                                # 9 queued x 1 s: more than a fetch costs
    ranks = asyncio.run(router.choose_replicas(reps, turn))
    assert ranks[0][0].replica_id.name != "b" and router.counters["conversation_routed_away_queue"] == 1
    # a plain chat's conversation no replica holds: Serve's own choice, then remembered
    plain = types.SimpleNamespace(args=({"kb": None, "conversation": "open:new", "messages": later},
                                        "default", None))
    assert [len(r) for r in asyncio.run(router.choose_replicas(reps, plain))] == [3]
    router.on_request_routed(plain, reps[2].replica_id, None)
    assert asyncio.run(router.choose_replicas(reps, plain))[0][0].replica_id.name == "c"


def test_a_request_whose_replica_died_before_answering_is_sent_once_more():
    """kdn.serve.app.Ingress._twice: a replica's death before its answer costs a retry (another
    replica), not a failed request; a second death, or any other error, is raised."""
    import collections
    from ray.exceptions import RayActorError
    from kdn.serve.app import Ingress
    router = Ingress.__new__(Ingress)
    router.counters = collections.Counter()
    calls = []

    async def dies_once():
        calls.append(1)
        if len(calls) == 1:
            raise RayActorError()
        return {"status": 200}
    moved = []
    assert asyncio.run(router._twice(dies_once, lambda: moved.append(1))) == {"status": 200}
    assert router.counters["retried_replica_died"] == 1 and len(calls) == 2 and moved == [1]

    async def always_dies():
        raise RayActorError()
    with pytest.raises(RayActorError):
        asyncio.run(router._twice(always_dies))

    async def a_bug():
        raise ValueError("a bug")
    with pytest.raises(ValueError):
        asyncio.run(router._twice(a_bug))


def test_a_regions_view_is_its_wait_plus_the_fetch_from_the_tier_that_holds_the_kb():
    """KBAffinityRouter.view: what the ingress weighs across regions (kdn.serve.regions)."""
    reps = [_Replica("a", {"kbs": ["t/held"], "service_s": 2.0}),
            _Replica("b", {"fetch_s": {"t/seen": 0.3}, "tiers": {"t/seen": "peer"}, "kv_bytes": {"t/seen": 7},
                           "service_s": 1.0})]
    router = _region_router("kdn-view", "eu-west", reps, {"a": 3, "b": 1})
    # 4 requests on 2 replicas, 2 s each (the slowest replica's): 4 s ahead
    assert router.view("t/held") == View(4.0, 0.0, "engine")
    assert router.view("t/seen") == View(4.0, 0.3, "peer") and router.kv_bytes("t/seen") == 7
    assert router.view("t/never") == View(4.0, 0.05, "unknown") and router.kv_bytes("t/never") is None
    assert router.view("t/held", in_flight=10).wait_s == 10.0     # the caller's own requests there
    assert _region_router("kdn-view", "ap-south", []).view("t/held") == UNAVAILABLE
    assert set(region_routers("kdn-view")) == {"eu-west", "ap-south"}


def test_the_ingress_routes_a_kb_across_regions_and_counts_the_decision(monkeypatch):
    """kdn.serve.app.Ingress.across over the request routers Serve made in its process (here
    made by hand): us-east's one replica has 3 requests ahead; eu-west's is idle and its
    engine holds the KB; 110 ms between them. Every region is weighed: the decision's time
    budget (its own test below) is lifted, so a busy machine (CI's: the home view alone took
    longer than 0.5 ms once) cannot cut the decision short."""
    import collections
    from kdn.serve import app as serve_app
    from kdn.serve.app import Ingress
    monkeypatch.setattr(serve_app, "DECISION_BUDGET_S", 10.0)
    app = "kdn-across"
    _region_router(app, "us-east", [_Replica("u", {"kbs": ["t/kb"], "service_s": 1.0})], {"u": 3})
    _region_router(app, "eu-west", [_Replica("e", {"kbs": ["t/kb"], "service_s": 1.0})], {"e": 0})
    ingress = Ingress.__new__(Ingress)
    ingress.network, ingress.workers = "across", {"us-east": None, "eu-west": None}
    ingress.links = {"rtt_s": {"us-east": {"us-east": 0.0, "eu-west": 0.11}},
                     "origin": {"us-east": (0.0002, 1e10), "eu-west": (0.055, 1e9)}}
    ingress.in_flight, ingress.counters, ingress.nearest = collections.Counter(), collections.Counter(), {}
    assert ingress.across("us-east", "t/kb") == ("eu-west", "cross_region_queue")
    assert ingress.across("us-east", "t/other") == ("eu-west", "cross_region_queue")   # the queue alone
    c = ingress.counters
    assert c["route_decisions"] == 2 and c["tier_engine"] == 1 and c["tier_unknown"] == 1
    assert c["route_decision_us"] > 0          # each decision is timed (its speed: kdn bench route)
    # a KB fetched in one region only: elsewhere, its fetch is estimated over the origin's link
    _region_router("kdn-est", "us-east", [_Replica("u2", {"fetch_s": {"t/big": 0.01}, "kv_bytes": {"t/big": 10**9},
                                                          "service_s": 1.0})], {"u2": 0})
    _region_router("kdn-est", "eu-west", [_Replica("e2", {"service_s": 1.0})], {"e2": 0})
    ingress.network, ingress.counters = "est", collections.Counter()
    ingress.links["rtt_s"]["eu-west"] = {"eu-west": 0.0, "us-east": 0.11}
    # from eu-west: 55 ms + 1 GB at 1 GB/s from the origin, or 10 ms at us-east's edge + 110 ms
    assert ingress.across("eu-west", "t/big") == ("us-east", "cross_region_kv")
    assert ingress.counters["tier_edge_memory"] == 1
    ingress.links["origin"]["eu-west"] = (0.055, 1e11)      # a fat link: 65 ms, home is best
    assert ingress.across("eu-west", "t/big") == ("eu-west", "home")
    assert ingress.counters["tier_origin_estimate"] == 1


def test_the_region_decision_weighs_no_farther_region_past_its_budget(monkeypatch):
    """Past DECISION_BUDGET_S the ingress stops building Views (home first, then nearest
    first): the decision's own work is bounded whatever the number of regions."""
    import collections
    from kdn.serve import app as serve_app
    _region_router("kdn-budget", "us-east", [_Replica("bu", {"service_s": 1.0})], {"bu": 9})
    _region_router("kdn-budget", "eu-west", [_Replica("be", {"service_s": 1.0})], {"be": 0})
    ingress = serve_app.Ingress.__new__(serve_app.Ingress)
    ingress.network, ingress.workers = "budget", {"us-east": None, "eu-west": None}
    ingress.nearest = {"us-east": ["us-east", "eu-west"]}
    ingress.links = {"rtt_s": {"us-east": {"us-east": 0.0, "eu-west": 0.11}}, "origin": {}}
    ingress.in_flight, ingress.counters = collections.Counter(), collections.Counter()
    monkeypatch.setattr(serve_app, "DECISION_BUDGET_S", 10.0)      # time enough: every region weighed
    assert ingress.across("us-east", "t/kb") == ("eu-west", "cross_region_queue")
    monkeypatch.setattr(serve_app, "DECISION_BUDGET_S", 0.0)       # spent before eu-west is weighed
    assert ingress.across("us-east", "t/kb") == ("us-east", "home")
    assert ingress.counters["route_over_budget"] == 1


def test_a_retry_after_a_death_may_cross_regions_once_if_the_request_had_not():
    """kdn.serve.app.Ingress._cross_once: us-east's only replica died (Serve's router dropped
    it: no replica left); a request that had stayed home is retried in eu-west, one that had
    already crossed regions, or named its region, is retried where it was."""
    import collections
    from kdn.serve.app import Ingress
    _region_router("kdn-retry", "us-east", [])
    _region_router("kdn-retry", "eu-west", [_Replica("re", {"service_s": 1.0})], {"re": 0})
    ingress = Ingress.__new__(Ingress)
    ingress.network, ingress.workers = "retry", {"us-east": None, "eu-west": None}
    ingress.nearest = {"us-east": ["us-east", "eu-west"], "eu-west": ["eu-west", "us-east"]}
    ingress.links = {"rtt_s": {"us-east": {"us-east": 0.0, "eu-west": 0.11},
                               "eu-west": {"eu-west": 0.0, "us-east": 0.11}}, "origin": {}}
    ingress.in_flight, ingress.counters = collections.Counter({"us-east": 1}), collections.Counter()
    where, routed = ["us-east"], {"X-KDN-Region": "us-east", "X-KDN-Route": "home"}
    ingress._cross_once(where, "home", "t/kb", routed)
    assert where == ["eu-west"] and routed == {"X-KDN-Region": "eu-west", "X-KDN-Route": "home_unavailable"}
    assert ingress.in_flight == {"us-east": 0, "eu-west": 1} and ingress.counters["route_home_unavailable"] == 1
    for why in ("cross_region_queue", "home_unavailable", "pinned"):
        where = ["us-east"]
        ingress._cross_once(where, why, "t/kb", {})
        assert where == ["us-east"]


def test_a_request_serve_asks_about_again_is_one_decision():
    """Serve calls choose_replicas again while the replicas it was given are full (with
    backoff: the router asks for it): the request is counted once (its decision), the asks
    after it as "rechosen"."""
    router = _region_router("kdn-again", "us-east", [])
    reps = [_Replica("a", {"kbs": ["default/rights"]}), _Replica("b")]
    req = types.SimpleNamespace(args=({"kb": "rights"}, "default", None),
                                metadata=types.SimpleNamespace(internal_request_id="req-1"),
                                routing_context=types.SimpleNamespace(should_backoff=False))
    for _ in range(3):
        asyncio.run(router.choose_replicas(reps, req))
    assert router.counters["decisions"] == 1 and router.counters["engine_hit"] == 1
    assert router.counters["rechosen"] == 2
    assert req.routing_context.should_backoff      # Serve sleeps between asks, never a tight loop
    router.on_request_routed(req, reps[0].replica_id, None)      # routed: its id is forgotten
    assert not router._deciding


def test_the_counter_loop_retries_what_the_store_can_answer_and_stops_on_a_bug_visibly(monkeypatch):
    """kdn.serve.app.Ingress._publish_counters: a lost GCS connection is counted and tried again
    next period; any other error ends the loop, and stats() names it (publish_failure)."""
    import collections
    from kdn.serve import app as serve_app, metrics
    router = serve_app.Ingress.__new__(serve_app.Ingress)
    router.network, router.workers, router.home = "n", {}, "us-east"
    router.counters, router.publish_failure, router._publisher = collections.Counter(), None, None
    monkeypatch.setattr(router, "_replica_id", lambda: "r0")
    monkeypatch.setattr(router, "snapshot", lambda: {})
    monkeypatch.setattr(metrics, "PUBLISH_PERIOD_S", 0.01)
    calls = []

    def publish(*args):
        calls.append(args)
        if len(calls) <= 2:
            raise ConnectionError("GCS away")
        raise KeyError("a bug")
    monkeypatch.setattr(metrics, "publish", publish)

    async def run():
        router._start_publisher(asyncio.get_running_loop())
        with pytest.raises(KeyError):
            await router._publisher
        await asyncio.sleep(0)      # the done callback
    asyncio.run(run())
    assert len(calls) == 3 and router.counters["publish_failures"] == 2
    assert router.stats()["publish_failure"] == "KeyError: 'a bug'"


def test_the_router_keeps_each_replicas_kv_sources_after_it_is_gone():
    """What a replica reported of its answers' KV stays counted once Serve drops it (its
    answers happened), so the service's sums only grow."""
    a = _Replica("ka", {"kv_sources": {"engine": 2, "edge_disk": 1}})
    b = _Replica("kb", {"kv_sources": {"edge_memory": 3}})
    router = _region_router("kdn-kvsrc", "us-east", [a, b])
    assert replica_kv_sources("kdn-kvsrc") == {"us-east": {"ka": {"engine": 2, "edge_disk": 1},
                                                           "kb": {"edge_memory": 3}}}
    a.routing_stats = {"kv_sources": {"engine": 5, "edge_disk": 1}}     # a later report
    del router._replicas[b.replica_id]                                  # b died
    assert replica_kv_sources("kdn-kvsrc")["us-east"] == {"ka": {"engine": 5, "edge_disk": 1},
                                                          "kb": {"edge_memory": 3}}
