"""/metrics through prometheus_client: read back with the library's own parser, values that
move with what the edge does, one registry per edge, nothing about other tenants' keys."""
import asyncio

from prometheus_client.parser import text_string_to_metric_families

from kdn.edge.metrics import HIDDEN, EdgeMetrics
from kdn.core.keys import namespace_digest


def samples(edge) -> dict:
    """{(sample name, sorted labels): value} of one edge's exposition."""
    text = EdgeMetrics(edge).exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


async def _resolve(helds):
    return [await h.resolve() for h in helds]


async def _as_stored(helds, sources):
    return list(helds), len(helds), False


def test_a_fetch_moves_fetches_hits_by_tier_and_served_by_source(kit):
    a, b = kit.make_chunks(2)
    edge = kit.local_edge([a])
    edge.tiers.put("hot", b.key, kit.held(b))
    before = samples(edge)
    asyncio.run(edge.reads.fetch([a.key, b.key], kit.NS, None, None, _as_stored))
    after = samples(edge)

    def moved(name, **labels):
        k = (name, tuple(sorted(labels.items())))
        return after[k] - before.get(k, 0)

    assert moved("kdn_edge_fetches_total") == 1
    assert moved("kdn_edge_hits_total", tier="main") == 1 and moved("kdn_edge_hits_total", tier="hot") == 1
    assert moved("kdn_edge_chunks_served_total", source="local") == 2
    assert moved("kdn_edge_bytes_served_total") == a.raw + b.raw
    assert after[("kdn_edge_chunks", (("tier", "main"),))] == 1
    assert after[("kdn_edge_hot_copies", ())] == 1
    assert after[("kdn_edge_events_total", (("event", "fetches"),))] == 1
    assert after[("kdn_edge_tier_ops_total", (("op", "hits"), ("tier", "hot")))] == 1


def test_deduplicated_loads_are_exported(kit):
    a, = kit.make_chunks(1)
    edge = kit.local_edge([])
    batches = []

    async def load_batch(keys):
        batches.append(list(keys))
        await asyncio.sleep(0.05)
        return {a.key: (kit.held(a, own=False), "origin")}

    async def no_keep(items):
        pass

    edge.pull._load_batch, edge.pull.keep = load_batch, no_keep

    async def three_readers():
        await asyncio.gather(*(edge.reads.fetch([a.key], kit.NS, None, None, _as_stored)
                               for _ in range(3)))

    asyncio.run(three_readers())
    s = samples(edge)
    assert len(batches) == 1
    assert s[("kdn_edge_loads_total", ())] == 1 and s[("kdn_edge_loads_deduped_total", ())] == 2
    assert s[("kdn_edge_chunks_served_total", (("source", "origin"),))] == 3


def test_two_edges_in_one_process_never_share_a_metric(kit):
    a, = kit.make_chunks(1)
    one, two = kit.local_edge([a]), kit.local_edge([])
    asyncio.run(one.reads.fetch([a.key], kit.NS, None, None, _as_stored))
    assert samples(one)[("kdn_edge_fetches_total", ())] == 1
    assert samples(two)[("kdn_edge_fetches_total", ())] == 0
    m1, m2 = EdgeMetrics(one), EdgeMetrics(two)
    assert m1.registry is not m2.registry


def test_counters_that_depend_on_other_tenants_are_not_exported(kit):
    a, = kit.make_chunks(1)
    edge = kit.local_edge([a])
    edge.reads.counters["namespace_refused"] += 1
    asyncio.run(edge.reads.fetch([a.key], namespace_digest("other", "x"), None, None, _as_stored))
    s = samples(edge)
    events = {dict(k[1])["event"] for k in s if k[0] == "kdn_edge_events_total"}
    assert not events & HIDDEN and "fetches" in events
    assert s[("kdn_edge_hits_total", (("tier", "main"),))] == 0, "another tenant's key is no hit"


def test_an_edge_with_a_disk_tier_reports_it_beside_main_and_hot(kit, tmp_path):
    cs = kit.make_chunks(3)
    edge = kit.local_edge(capacity_bytes=2 * cs[0].nbytes, disk_bytes=1 << 20, disk_dir=str(tmp_path))
    for c in cs:                                   # main holds one: two are victims
        edge.tiers.put("main", c.key, kit.held(c))
    assert asyncio.run(edge.tiers.drain_write_backs(edge.forms.intact)) == 2
    got = asyncio.run(edge.reads.fetch([c.key for c in cs], kit.NS, None, None, _as_stored))
    objs = asyncio.run(_resolve(got["out"]))       # in Ray's store if Ray is up, else here
    assert [o.equal(c) for o, c in zip(objs, cs)] == [True] * 3
    s = samples(edge)
    assert s[("kdn_edge_hits_total", (("tier", "disk"),))] == 2
    assert s[("kdn_edge_chunks", (("tier", "disk"),))] == 2
    assert s[("kdn_edge_bytes", (("tier", "disk"),))] == sum(
        p.stat().st_size for p in (tmp_path / "here-0").rglob("*.kdnc"))
    assert s[("kdn_edge_capacity_bytes", (("tier", "disk"),))] == 1 << 20
    assert s[("kdn_edge_write_backs_total", (("tier", "disk"),))] == 2
    assert s[("kdn_edge_write_backs_dropped_total", (("reason", "full"), ("tier", "disk")))] == 0
    assert got["sources"] == ["disk", "disk", "local"]     # main kept the last put
    assert s[("kdn_edge_chunks_served_total", (("source", "local"),))] == 1
    assert s[("kdn_edge_chunks_served_total", (("source", "disk"),))] == 2
