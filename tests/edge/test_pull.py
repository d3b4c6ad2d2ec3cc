"""Pull-through: owners nearest first, then the origin; verified origin copies; read repair;
refills and hot copies kept; keys of another namespace never loaded."""
import asyncio

import pytest

from kdn.edge.forms import corrupted
from kdn.edge.tiers import Held
from kdn.core.keys import namespace_digest


@pytest.fixture
def edge(kit, monkeypatch):
    """A local edge (here-0, with far-0 in the ring) whose calls answer from `edge.answers`."""
    monkeypatch.setattr(Held, "of", classmethod(lambda cls, obj: kit.held(obj)))
    e = kit.local_edge([])
    e.answers, e.asked = {}, []

    async def ask(node, method, *args, timeout=None, **kw):
        e.asked.append((node, method, len(args[0]) if args else 0))
        answer = e.answers.get((node, method))
        return answer(*args) if callable(answer) else answer

    e.peers.ask = ask
    return e


def _manifest(e, chunks):
    e.catalog.add({"tenant": "default", "fingerprint": "edge-unit", "name": "kb", "version": 1,
                   "keys": [c.key for c in chunks], "sums": [c.digest() for c in chunks]})


def _load(e, keys, ns):
    async def main():
        got = await e.pull.load(keys, ns)
        await asyncio.sleep(0.01)                # work sent after the reply
        return got
    return asyncio.run(main())


def test_owners_first_then_the_origin_and_the_owner_that_lacked_is_repaired(kit, edge):
    cs = kit.make_chunks(3)
    _manifest(edge, cs)
    by_key = {c.key: c for c in cs}
    edge.answers[("far-0", "peer_get")] = lambda keys: [kit.held(by_key[keys[0]]).wire()] + [None] * (len(keys) - 1)
    edge.answers[(None, "get_chunks")] = lambda keys: [by_key[k] for k in keys]
    got = _load(edge, [c.key for c in cs], kit.NS)
    assert [s for _, s in got] == ["peer:far-0", "origin", "origin"]
    assert [m for _, m, _ in edge.asked] == ["peer_get", "get_chunks", "put_chunks"]
    assert edge.asked[-1][0] == "far-0", "the owner that lacked two chunks is sent the origin's"
    assert edge.pull.counters["repairs_sent"] == 2


def test_an_unreachable_owner_is_no_reason_to_repair_it(kit, edge):
    cs = kit.make_chunks(1)
    edge.answers[("far-0", "peer_get")] = None
    edge.answers[(None, "get_chunks")] = lambda keys: cs
    got = _load(edge, [cs[0].key], kit.NS)
    assert got[0][1] == "origin" and "put_chunks" not in [m for _, m, _ in edge.asked]


def test_an_origin_copy_that_fails_its_checksum_is_not_served(kit, edge):
    cs = kit.make_chunks(2)
    _manifest(edge, cs)
    edge.answers[(None, "get_chunks")] = lambda keys: [corrupted(cs[0]), cs[1]]
    got = _load(edge, [c.key for c in cs], kit.NS)
    assert got[0] is None and got[1][1] == "origin"
    assert edge.forms.counters["corrupt_detected"] == 1


def test_keys_of_another_namespace_are_never_loaded(kit, edge):
    cs = kit.make_chunks(2)
    _manifest(edge, cs)
    other = namespace_digest("other", "edge-unit")
    assert _load(edge, [c.key for c in cs], other) == [None, None]
    assert edge.asked == []


def test_a_chunk_this_edge_owns_is_refilled_and_one_it_does_not_is_passed_through(kit, edge):
    cs = kit.make_chunks(40)
    owners = edge.members.owners([c.key for c in cs])
    mine = next(c for c, o in zip(cs, owners) if o[0] == "here-0")
    theirs = next(c for c, o in zip(cs, owners) if o[0] == "far-0")
    edge.members.replicas = 1
    items = [(c.key, kit.held(c), "here") for c in (mine, theirs)]
    asyncio.run(edge.pull.keep(items))
    assert edge.tiers.holds(mine.key) and not edge.tiers.holds(theirs.key)
    assert edge.pull.counters == {"refilled": 1}


def test_a_copy_kept_in_a_compressed_store_form_is_encoded_after_the_reply(kit, monkeypatch):
    monkeypatch.setattr(Held, "of", classmethod(lambda cls, obj: kit.held(obj)))
    e = kit.local_edge([], store_codec="zstd")
    a, = kit.make_chunks(1)

    async def main():
        await e.pull.keep([(a.key, kit.held(a), "here")])      # both edges own it (replicas 2)
        assert not e.tiers.holds(a.key) and a.key in e.pull._keeping
        await asyncio.sleep(0.5)

    asyncio.run(main())
    kept = e.tiers.peek(a.key)
    assert kept.codec == "zstd" and kept.obj.decode().equal(a) and not e.pull._keeping


def test_the_origins_batch_is_verified_and_put_off_the_event_loop(kit, edge):
    """A first fetch's chunks come from the origin: their hashing (and ray.put's copy) runs in
    a worker thread, so the loop keeps serving others while 32 x 64 MiB are checked."""
    def measure():
        cs = kit.big_chunks(32, ns=kit.NS)
        edge.catalog.add({"tenant": "default", "fingerprint": "edge-unit", "name": "big",
                          "version": 1, "keys": [c.key for c in cs], "sums": [cs[0].digest()] * len(cs)})
        edge.answers[("far-0", "peer_get")] = None
        edge.answers[(None, "get_chunks")] = lambda keys: cs
        got, stall, ticks, took = asyncio.run(kit.stalls(edge.pull.load([c.key for c in cs], kit.NS)))
        assert [s for _, s in got] == ["origin"] * 32 and [h.obj for h, _ in got] == cs
        return stall, ticks, took
    kit.assert_off_loop(measure)
