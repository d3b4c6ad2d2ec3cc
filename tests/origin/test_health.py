"""Health: an edge that misses DOWN_AFTER pings leaves the ring, and rejoins when it answers."""
import asyncio

from kdn.origin.health import DOWN_AFTER, Health

MEMBERS = [("a", "us-east", 1.0), ("b", "eu-west", 1.0)]


def test_a_silent_edge_leaves_after_down_after_misses_and_rejoins(edges):
    async def go():
        fake = edges(["a", "b"])
        h = Health(fake)
        fake.dead.add("b")
        for _ in range(DOWN_AFTER - 1):
            assert await h.round(MEMBERS) is None
        assert await h.round(MEMBERS) == [("a", "us-east", 1.0)]
        assert h.down == {"b": ("eu-west", 1.0)}
        members = [("a", "us-east", 1.0)]
        assert await h.round(members) is None                 # still down, nothing new
        fake.dead.clear()
        assert await h.round(members) == MEMBERS              # answers again: back in
        assert h.down == {} and h.counters == {"pings_missed": DOWN_AFTER + 1,
                                               "edges_marked_down": 1, "edges_back": 1}
        assert set(fake.count("ping")) == {"a", "b"}
    asyncio.run(go())


def test_when_every_edge_is_silent_the_ring_stays(edges):
    async def go():
        fake = edges(["a", "b"])
        fake.dead.update({"a", "b"})
        h = Health(fake, down_after=1)
        assert await h.round(MEMBERS) is None and set(h.down) == {"a", "b"}
    asyncio.run(go())


def test_an_operators_membership_keeps_down_edges_out_until_they_answer(edges):
    h = Health(edges(["a", "b"]))
    h.down = {"b": ("eu-west", 1.0), "c": ("eu-west", 1.0)}
    assert h.in_ring(MEMBERS) == [("a", "us-east", 1.0)]
    h.keep_only(["a", "b"])
    assert h.down == {"b": ("eu-west", 1.0)}                 # c was left out: forgotten
    assert h.forget("b") and not h.forget("b") and h.down == {}
