"""One read, Ray and HTTP alike: distinct keys, bounded replies with "more", loading in rounds,
namespace checks, one retry after a corrupt copy."""
import asyncio

import pytest

from kdn.core.keys import MAX_FETCH_KEYS
from kdn.edge.reads import FIRST_ROUND_KEYS, check_keys
from kdn.core.errors import BadRequest
from kdn.core.keys import namespace_digest


async def _as_stored(helds, sources):
    return list(helds), len(helds), False


def _fetch(edge, keys, ns, shape=_as_stored, region=None, token=None):
    return asyncio.run(edge.reads.fetch(keys, ns, region, token, shape))


class Elsewhere:
    """Stands in for the owners and the origin behind pull-through: serves the given chunks
    as if from the origin, records each batch asked for."""

    def __init__(self, kit, chunks):
        self.kit, self.chunks, self.batches = kit, {c.key: c for c in chunks}, []

    async def load_batch(self, keys):
        self.batches.append(len(keys))
        return {k: (self.kit.held(self.chunks[k], own=False), "origin")
                for k in keys if k in self.chunks}

    async def keep(self, items):
        pass


def _elsewhere(edge, kit, chunks) -> Elsewhere:
    far = Elsewhere(kit, chunks)
    edge.pull._load_batch, edge.pull.keep = far.load_batch, far.keep
    return far


def test_check_keys_refuses_repeats_too_many_and_non_keys():
    k = [bytes([i]) * 16 for i in range(3)]
    assert check_keys(k) == k
    with pytest.raises(BadRequest, match=r"keys\[2\] repeats key 0000.*never repeats"):
        check_keys([k[0], k[1], k[0]])
    with pytest.raises(BadRequest, match=f"{MAX_FETCH_KEYS + 1} keys in one request; the limit is"):
        check_keys([k[0]] * (MAX_FETCH_KEYS + 1))
    with pytest.raises(BadRequest, match=r"keys\[1\] must be 16 bytes, got 3 bytes"):
        check_keys([k[0], b"abc"])
    with pytest.raises(BadRequest, match="keys must be a list"):
        check_keys(b"x" * 16)


def test_a_repeated_key_is_refused_before_any_work(kit):
    a, = kit.make_chunks(1)
    edge = kit.local_edge([a])
    with pytest.raises(BadRequest, match="repeats key"):
        _fetch(edge, [a.key] * 128, kit.NS)
    assert edge.all_counters()["fetches"] == 0 and edge.tiers.counters["main_hits"] == 0


def test_a_reply_stops_at_max_reply_bytes_and_says_more(kit):
    cs = kit.make_chunks(6)
    edge = kit.local_edge(cs, max_reply_bytes=int(2.5 * cs[0].raw))
    keys, got = [c.key for c in cs], []
    while len(got) < len(keys):
        r = _fetch(edge, keys[len(got):], kit.NS)
        assert len(r["out"]) == 2 and r["sources"] == ["local", "local"]
        got += r["out"]
        assert r["more"] == (len(got) < len(keys))
    assert [h.key for h in got] == keys
    c = edge.all_counters()
    assert c["fetches"] == 3 and c["chunks_served"] == 6 and c["bytes_served"] == sum(x.raw for x in cs)


def test_a_chunk_bigger_than_the_bound_still_goes_alone(kit):
    cs = kit.make_chunks(2)
    edge = kit.local_edge(cs, max_reply_bytes=10)
    r = _fetch(edge, [c.key for c in cs], kit.NS)
    assert len(r["out"]) == 1 and r["more"] is True


def test_the_prefix_stops_at_the_first_key_nobody_holds(kit):
    cs = kit.make_chunks(4)
    edge = kit.local_edge([cs[0], cs[1], cs[3]])
    _elsewhere(edge, kit, [])
    r = _fetch(edge, [c.key for c in cs], kit.NS)
    assert [h.key for h in r["out"]] == [cs[0].key, cs[1].key] and r["more"] is False


def test_missing_keys_load_in_rounds_that_fit_one_reply(kit):
    cs = kit.make_chunks(2 * FIRST_ROUND_KEYS + 8, shape=(1, 2, 1, 8))
    edge = kit.local_edge([], max_reply_bytes=(FIRST_ROUND_KEYS + 10) * cs[0].raw)
    far = _elsewhere(edge, kit, cs)
    r = _fetch(edge, [c.key for c in cs], kit.NS)
    # nothing known of sizes: a first round of FIRST_ROUND_KEYS, then what fits the budget
    assert far.batches == [FIRST_ROUND_KEYS, 10]
    assert len(r["out"]) == FIRST_ROUND_KEYS + 10 and r["more"] is True
    assert r["sources"] == ["origin"] * len(r["out"])


def test_another_namespace_reads_nothing_and_learns_nothing(kit):
    cs = kit.make_chunks(2)
    edge = kit.local_edge(cs)
    far = _elsewhere(edge, kit, cs)
    other = namespace_digest("other", "edge-unit")
    r = _fetch(edge, [c.key for c in cs], other)
    assert r["out"] == [] and far.batches == [], "a key held under another namespace is not pulled"
    c = edge.all_counters()
    assert c["main_hits"] == 0 and c["namespace_refused"] == 0


def test_a_corrupt_copy_is_dropped_and_the_read_made_once_more(kit):
    cs = kit.make_chunks(3)
    edge = kit.local_edge(cs)
    _elsewhere(edge, kit, cs)
    calls = []

    async def shape(helds, sources):
        calls.append(list(sources))
        if len(calls) == 1:
            return list(helds[:1]), 1, True          # chunk 1 found corrupt
        return list(helds), len(helds), False

    r = _fetch(edge, [c.key for c in cs], kit.NS, shape)
    assert calls == [["local"] * 3, ["local", "origin", "local"]]
    assert r["sources"] == ["local", "origin", "local"] and r["more"] is False
    assert edge.tiers.peek(cs[1].key) is None and edge.all_counters()["corrupt_dropped"] == 1


def test_an_unknown_region_is_refused(kit):
    a, = kit.make_chunks(1)
    edge = kit.local_edge([a])
    with pytest.raises(BadRequest, match="region must be one of"):
        _fetch(edge, [a.key], kit.NS, region="mars")


def test_lookup_counts_local_then_asks_the_origin(kit):
    cs = kit.make_chunks(4)
    edge = kit.local_edge(cs[:2])
    asked = []

    async def ask(node, method, *args, timeout=None, **kw):
        asked.append((node, method, len(args[0])))
        return [True, False] if method == "has" else None

    edge.peers.ask = ask
    got = asyncio.run(edge.reads.lookup([c.key for c in cs], kit.NS, None))
    assert got == {"chunks": 3, "local": 2, "edge": "here-0"} and asked == [(None, "has", 2)]
