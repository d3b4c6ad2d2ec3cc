"""Stores acknowledged at the edge (kdn/edge/stores.py): kept here and answered at once, then
made durable at the origin; an origin that does not answer is tried again and nothing waiting
is lost; past the backlog's bound a store waits in line for room, and for the origin where
none comes; a delete wins over a store
not yet durable, queued or on its way. The origin here answers from `edge.answers` (the
write-behind against a real origin, through LMCache, is tests/integrations/test_lmcache.py)."""
import asyncio

import numpy as np
import pytest

from kdn.core.chunk import Chunk
from kdn.core.errors import BadRequest, NetworkError
from kdn.edge import stores
from kdn.edge.tiers import Held
from kdn.integrations.objects import object_key, pack


@pytest.fixture
def edge(kit, monkeypatch):
    monkeypatch.setattr(stores, "FORWARD_RETRY_S", 0.01)
    # held in this process even where this process joined Ray for other tests
    monkeypatch.setattr(Held, "kept", classmethod(lambda cls, obj: cls.here(obj)))
    monkeypatch.setattr(Held, "arrival", classmethod(lambda cls, obj, kind="store": cls.kept(obj)))   # (tests/edge/test_arrivals.py)
    e = kit.local_edge([])
    e.answers, e.asked = {}, []

    async def ask(node, method, *args, timeout=None, **kw):
        e.asked.append((node, method, list(args[0]) if args and isinstance(args[0], (list, tuple)) else []))
        answer = e.answers.get((node, method))
        if asyncio.iscoroutinefunction(answer):
            return await answer(*args)
        return answer(*args) if callable(answer) else answer

    e.peers.ask = ask
    return e


def objects(kit, n, seed=0, size=4096):
    rng = np.random.default_rng(seed)
    return [pack(object_key(kit.NS, f"obj-{seed}-{i}".encode()), kit.NS,
                 rng.integers(0, 255, size, dtype=np.uint8)) for i in range(n)]


def origin_took(e):
    return [c.key for node, m, args in e.asked if node is None and m == "put_objects" for c in args]


def gated(e, method):
    """The origin's answer to method (a store) held until the Event returned is set."""
    gate = asyncio.Event()

    async def answer(items):
        await gate.wait()
        return {"received": len(items), "written": len(items), "pushing": 0}
    e.answers[(None, method)] = answer
    return gate


async def settle(e, timeout_s=5.0):
    assert await e.stores.drain(timeout_s), e.stores.stats()


def test_a_store_is_answered_at_the_edge_then_made_durable_and_unpinned(kit, edge):
    objs = objects(kit, 3)
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}

    assert edge.stores.owns([c.key for c in objs]) == [True] * 3      # the ring's only edge: kept in main

    async def main():
        got = await edge.put_objects(objs)
        main_tier = edge.tiers.tier("main")
        held_at_once = [main_tier.is_pinned(c.key) for c in objs]
        await settle(edge)
        return got, held_at_once, [main_tier.is_pinned(c.key) for c in objs], [edge.tiers.peek(c.key) for c in objs]
    got, pinned_before, pinned_after, held = asyncio.run(main())
    assert not any(c.key in edge.tiers.tier("hot") for c in objs)
    assert got == {"received": 3, "kept": 3, "pending": 3}
    assert pinned_before == [True] * 3 and pinned_after == [False] * 3
    assert [h.obj.kv.tobytes() for h in held] == [c.kv.tobytes() for c in objs]      # the bytes, served here
    assert origin_took(edge) == [c.key for c in objs]
    st = edge.stores.stats()
    assert st["backlog_objects"] == 0 and st["backlog_bytes"] == 0 and st["store_acked_edge"] == 3 and st["store_forwarded"] == 3


def test_an_origin_that_does_not_answer_is_tried_again_and_nothing_waiting_is_lost(kit, edge):
    objs = objects(kit, 2, seed=1)
    edge.answers[(None, "put_objects")] = None          # unreachable

    async def main():
        await edge.put_objects(objs)
        await asyncio.sleep(0.1)
        waiting, shown = edge.stores.stats(), await edge.stats()
        edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs)}
        await settle(edge)
        return waiting, shown, await edge.stats()
    waiting, shown, after = asyncio.run(main())
    assert waiting["backlog_objects"] == 2 and waiting["backlog_bytes"] == sum(c.nbytes for c in objs)
    # `kdn status` prints what is not durable yet, from the edge's own stats
    from kdn.cli.cluster import status_rows
    from kdn.cli.common import gib
    row, = status_rows({"edges": [shown]})
    assert row["not durable"] == f"2 / {gib(sum(c.nbytes for c in objs))}", row
    row, = status_rows({"edges": [after]})
    assert row["not durable"] == f"0 / {gib(0)}", row
    assert waiting["store_forward_retries"] >= 2
    assert origin_took(edge)[-2:] == [c.key for c in objs]


def checked(cls, obj, kind="store"):
    """Held.arrival with the copy's checksum known, as the edge's verification leaves it."""
    held = cls.here(obj)
    held.xxh = obj.digest()
    return held


def test_an_edge_serving_http_has_the_origin_pull_its_backlog_and_sends_over_ray_what_was_not_pulled(kit, edge, monkeypatch):
    """Where the edge serves HTTP the origin is handed only the keys and pulls the bytes from
    its frames (pull_objects); a key the origin did not receive intact goes over Ray; an
    origin that reads this edge over Ray ({"pulled": None}) gets every batch over Ray, and
    is not asked to pull again for HTTP_RETRY_S."""
    monkeypatch.setattr(Held, "arrival", classmethod(checked))
    first, second, third = objects(kit, 4, seed=20), objects(kit, 2, seed=21), objects(kit, 2, seed=22)
    edge.stores.name, edge.stores.serves_http = "e0", lambda: True
    asked_pull = []

    def pull(name, keys, sums):
        asked_pull.append((name, list(keys)))
        assert sums == [c.digest() for c in first + second if c.key in keys]   # of each copy queued
        if len(asked_pull) > 1:
            return {"pulled": None}
        return {"received": 3, "written": 3, "pushing": 3, "kept_other": [], "pulled": 3, "missing": [first[1].key]}
    edge.answers[(None, "pull_objects")] = pull
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}

    async def main():
        for objs in (first, second, third):
            await edge.put_objects(objs)
            await settle(edge)
    asyncio.run(main())
    assert asked_pull == [("e0", [c.key for c in first]), ("e0", [c.key for c in second])]
    # over Ray: the key not pulled, then the declined batch, then the next without asking
    assert origin_took(edge) == [first[1].key] + [c.key for c in second + third]
    st = edge.stores.stats()
    assert st["store_forwarded_http"] == 3 and st["store_forwarded_http_bytes"] == sum(
        c.nbytes for i, c in enumerate(first) if i != 1)
    assert st["store_forward_http_declined"] == 1 and st["store_forwarded"] == 8 and st["backlog_objects"] == 0


def test_copies_with_no_checksum_known_are_not_offered_to_the_pull_and_go_over_ray(kit, edge):
    edge.stores.name, edge.stores.serves_http = "e0", lambda: True     # (the fixture's copies: none known)
    edge.answers[(None, "pull_objects")] = lambda *a: pytest.fail("asked to pull copies it cannot check")
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}
    objs = objects(kit, 2, seed=34)

    async def main():
        await edge.put_objects(objs)
        await settle(edge)
    asyncio.run(main())
    assert origin_took(edge) == [c.key for c in objs]
    assert edge.stores.stats().get("store_forward_http_declined", 0) == 0


def test_a_batch_the_origin_refuses_is_tried_again_and_the_forwarder_goes_on(kit, edge):
    """An error the origin raised on purpose (its disk full: StoreError) is not the end of the
    backlog: the batch is tried again, and stores after it still become durable."""
    from kdn.core.errors import StoreError
    calls = []

    def origin(cs):
        calls.append([c.key for c in cs])
        if len(calls) == 1:
            raise StoreError("no space left on the origin's disk")
        return {"received": len(cs), "written": len(cs), "pushing": 0}
    edge.answers[(None, "put_objects")] = origin
    objs, later = objects(kit, 2, seed=35), objects(kit, 1, seed=36)

    async def main():
        await edge.put_objects(objs)
        await settle(edge)
        await edge.put_objects(later)
        await settle(edge)
    asyncio.run(main())
    assert calls[0] == calls[1] == [c.key for c in objs] and calls[2] == [later[0].key]
    st = edge.stores.stats()
    assert st["store_forward_errors"] == 1 and st["store_forwarded"] == 3 and st["backlog_objects"] == 0


def test_an_origin_that_refuses_to_pull_gets_the_backlog_over_ray_and_a_key_is_asked_once(kit, edge, monkeypatch):
    """A refusal of pull_objects (an error the origin raised on purpose) costs the HTTP path,
    not the backlog: the batch goes over Ray and the forwarder goes on; a key twice in one
    store is queued and asked for once, and more objects than one call takes go in several."""
    from kdn.core.errors import BadRequest
    monkeypatch.setattr(Held, "arrival", classmethod(checked))
    edge.stores.name, edge.stores.serves_http = "e0", lambda: True
    objs = objects(kit, 3, seed=30)
    asked_pull = []

    def refuse(name, keys, sums):
        asked_pull.append(list(keys))
        raise BadRequest("pull_objects: a key is named twice")
    edge.answers[(None, "pull_objects")] = refuse
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}

    async def main():
        await edge.put_objects(objs + [objs[0]])          # the first key twice in one store
        await settle(edge)
        await edge.put_objects(objects(kit, 2, seed=31))   # Ray for a while: not asked to pull
        await settle(edge)
    asyncio.run(main())
    assert asked_pull == [[c.key for c in objs]]
    st = edge.stores.stats()
    assert st["store_forward_http_declined"] == 1 and st["backlog_objects"] == 0
    assert sorted(origin_took(edge)[:3]) == sorted(c.key for c in objs)
    assert origin_took(edge)[3:] == [c.key for c in objects(kit, 2, seed=31)]


def test_a_backlog_of_more_objects_than_one_call_takes_goes_in_several(kit, edge, monkeypatch):
    monkeypatch.setattr(stores, "MAX_OBJECTS_PER_CALL", 3)
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}
    calls = []
    edge.answers[(None, "put_objects")] = lambda cs: calls.append(len(cs)) or {
        "received": len(cs), "written": len(cs), "pushing": 0}

    async def main():
        await edge.put_objects(objects(kit, 3, seed=32))
        await edge.put_objects(objects(kit, 3, seed=33))
        await settle(edge)
    asyncio.run(main())
    assert max(calls) <= 3 and sum(calls) == 6


def test_the_backlog_goes_to_the_origin_as_references_to_the_kept_copies_and_as_bytes_when_those_fail(kit, edge, monkeypatch):
    """In Ray each kept copy has a reference: the origin is handed those (no copy made to
    send them); a hand-over the origin could not read (None: unreachable) is retried with
    the bytes, and nothing waiting is lost."""
    refs = {}

    def kept(cls, obj):                      # a copy in the node's store: a reference beside it
        held = cls.here(obj)
        held.ref = refs.setdefault(obj.key, f"ref-{len(refs)}")
        return held
    monkeypatch.setattr(Held, "kept", classmethod(kept))
    first, second = objects(kit, 2, seed=8), objects(kit, 2, seed=9)
    edge.answers[(None, "put_object_refs")] = lambda rs: {"received": len(rs)}
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs)}

    async def main():
        await edge.put_objects(first)
        await settle(edge)
        edge.answers[(None, "put_object_refs")] = None       # the origin cannot read them
        await edge.put_objects(second)
        await settle(edge)
    asyncio.run(main())
    handed = [(m, args) for node, m, args in edge.asked if node is None]
    assert handed[0] == ("put_object_refs", [refs[c.key] for c in first])
    assert handed[1] == ("put_object_refs", [refs[c.key] for c in second])
    assert handed[2][0] == "put_objects"                      # the retry: the bytes themselves
    assert [c.kv.tobytes() for c in handed[2][1]] == [c.kv.tobytes() for c in second]
    st = edge.stores.stats()
    assert st["store_forwarded_by_ref"] == 2 and st["store_forwarded"] == 4 and st["backlog_objects"] == 0


def test_a_batch_of_large_and_small_objects_goes_as_references_and_as_bytes_in_one_round(kit, edge, monkeypatch):
    """Objects at or over INLINE_BYTES are kept in the node's store (a reference beside them),
    smaller ones in this process: one batch of both hands the origin the references of the
    first and the bytes of the second, and is done once both are answered; when the bytes'
    call goes unanswered the whole batch is tried again (what the origin took is deduplicated
    there), and nothing waiting is lost."""
    from kdn.edge.tiers import INLINE_BYTES
    refs = {}

    def kept(cls, obj):
        held = cls.here(obj)
        if obj.nbytes >= INLINE_BYTES:
            held.ref = refs.setdefault(obj.key, f"ref-{len(refs)}")
        return held
    monkeypatch.setattr(Held, "kept", classmethod(kept))
    big, small = objects(kit, 2, seed=10, size=INLINE_BYTES + 1024), objects(kit, 3, seed=11, size=512)
    mixed = [big[0], small[0], small[1], big[1], small[2]]
    calls = {"values": 0}

    def values(cs):                    # the first bytes call is not answered
        calls["values"] += 1
        return None if calls["values"] == 1 else {"received": len(cs), "written": len(cs), "pushing": 0}
    edge.answers[(None, "put_object_refs")] = lambda rs: {"received": len(rs), "written": len(rs), "pushing": 0}
    edge.answers[(None, "put_objects")] = values

    async def main():
        await edge.put_objects(mixed)
        await settle(edge)
    asyncio.run(main())
    handed = [(m, args) for node, m, args in edge.asked if node is None]
    assert handed[0] == ("put_object_refs", [refs[big[0].key], refs[big[1].key]])
    assert handed[1][0] == "put_objects" and [c.key for c in handed[1][1]] == [c.key for c in small]
    # tried again (by bytes, as every retry): all five, the bytes themselves
    assert handed[2][0] == "put_objects" and [c.key for c in handed[2][1]] == [c.key for c in mixed]
    assert [c.kv.tobytes() for c in handed[2][1]] == [c.kv.tobytes() for c in mixed]
    assert len(handed) == 3
    st = edge.stores.stats()
    assert st["store_forwarded_by_ref"] == 2 and st["store_forwarded"] == 5 and st["backlog_objects"] == 0


def test_past_the_backlogs_bound_with_no_room_in_time_a_store_waits_for_the_origin(kit, edge):
    first, second = objects(kit, 1, seed=2, size=6000), objects(kit, 1, seed=3, size=6000)
    edge.stores.backlog_bytes = 8000                    # room for one
    edge.stores.backlog_wait_s = 0.2                    # the origin down: no room comes
    edge.answers[(None, "put_objects")] = None

    async def main():
        a = await edge.put_objects(first)               # acknowledged here (origin down)
        with pytest.raises(NetworkError, match="backlog of stores not yet durable is full.* the origin did not answer"):
            await edge.put_objects(second)
        refused_kept = edge.tiers.tier("hot").is_pinned(second[0].key)
        edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs)}
        edge.stores.backlog_wait_s = 0                  # no wait for room: to the origin at once
        b = await edge.put_objects(second)
        await settle(edge)
        return a, refused_kept, b
    a, refused_kept, b = asyncio.run(main())
    assert a["pending"] == 1 and b == {"received": 1, "kept": 1, "pending": 0}
    assert refused_kept is False, "a store refused is not held as if it were on its way"
    st = edge.stores.stats()
    assert st["store_acked_origin"] == 1 and st["store_origin_backlog_full"] == 1
    assert st.get("store_origin_no_room", 0) == 0
    assert st["store_backlog_waits"] == 1 and st["store_backlog_wait_us"] >= 0.2e6    # the one refused
    from kdn.cli.cluster import status_rows            # `kdn status` says why stores waited
    row, = status_rows({"edges": [asyncio.run(edge.stats())]})
    assert row["waited for origin (bound / room)"] == "1 / 0", row


def line_of_two(kit, edge, seed):
    """A backlog with room for two objects, a store of two to fill it (held at the origin's
    gate, returned with them) and two single stores to wait behind it."""
    first = objects(kit, 2, seed=seed, size=3000)
    second, third = (objects(kit, 1, seed=seed + i, size=3000) for i in (1, 2))
    edge.stores.backlog_bytes = 7000
    return first, second, third, gated(edge, "put_objects")


def test_past_the_bound_stores_wait_in_line_for_room_and_are_answered_at_the_edge(kit, edge):
    """The origin makes room (the first store lands): the stores past the bound are let in, in
    the order they came, acknowledged here, and their bytes go to the origin once, the
    backlog's way; the one that fits while another waits queues behind it."""
    first, second, third, gate = line_of_two(kit, edge, seed=19)

    async def main():
        a = await edge.put_objects(first)               # in the backlog, held at the origin's gate
        b = asyncio.create_task(edge.put_objects(second))
        await asyncio.sleep(0.05)
        c = asyncio.create_task(edge.put_objects(third))
        await asyncio.sleep(0.05)
        waiting = (b.done(), c.done(), len(edge.stores._waiters))
        gate.set()                                       # the origin answers: room, one at a time
        got = [a, await b, await c]
        await settle(edge)
        return waiting, got
    waiting, got = asyncio.run(main())
    assert waiting == (False, False, 2), "both wait for room, in line"
    assert [g["pending"] for g in got] == [2, 1, 1], "all answered here before durable"
    assert origin_took(edge) == [c.key for c in first + second + third], "each sent once, in order"
    st = edge.stores.stats()
    assert st["store_acked_edge"] == 4 and st.get("store_acked_origin", 0) == 0
    assert st["store_backlog_waits"] == 2 and st["backlog_bytes"] == 0 and edge.stores._reserved == 0


def test_a_store_behind_a_full_line_or_of_keys_already_waiting_does_not_wait(kit, edge):
    """The stores waiting for room hold the bound's worth: the next goes to the origin at
    once. A store of keys whose copies wait in the backlog needs no room: answered by them."""
    first, second, third = (objects(kit, 1, seed=s, size=6000) for s in (27, 28, 29))
    edge.stores.backlog_bytes = 8000                    # room for one
    gate = gated(edge, "put_objects")

    async def main():
        await edge.put_objects(first)
        waiting = asyncio.create_task(edge.put_objects(second))
        await asyncio.sleep(0.05)
        again = await asyncio.wait_for(edge.put_objects(first), 1.0)      # riding: at once
        to_origin = asyncio.create_task(edge.put_objects(third))        # the line is full
        await asyncio.sleep(0.05)
        sent = origin_took(edge)
        gate.set()
        await waiting
        got = await to_origin
        await settle(edge)
        return again, got, sent
    again, got, sent = asyncio.run(main())
    assert again["pending"] == 1 and got["pending"] == 0
    assert third[0].key in sent, "sent to the origin without waiting in line"
    st = edge.stores.stats()
    assert st["store_origin_backlog_full"] == 1 and st["store_backlog_waits"] == 1
    assert st.get("store_queued_already", 0) + st.get("store_queued_unchecked", 0) == 1    # answered by its copy


def test_a_store_larger_than_the_bound_goes_to_the_origin_at_once(kit, edge):
    big = objects(kit, 2, seed=23, size=6000)
    edge.stores.backlog_bytes = 8000                    # less than the two together
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}
    got = asyncio.run(edge.put_objects(big))
    assert got == {"received": 2, "kept": 2, "pending": 0}
    st = edge.stores.stats()
    assert st["store_origin_backlog_full"] == 2 and st.get("store_backlog_waits", 0) == 0
    assert origin_took(edge) == [c.key for c in big]


def test_a_store_cancelled_while_it_waits_for_room_gives_its_place_up(kit, edge):
    first, second, third, gate = line_of_two(kit, edge, seed=24)

    async def main():
        await edge.put_objects(first)
        b = asyncio.create_task(edge.put_objects(second))
        await asyncio.sleep(0.05)
        c = asyncio.create_task(edge.put_objects(third))
        await asyncio.sleep(0.05)
        b.cancel()                                       # its caller gone
        with pytest.raises(asyncio.CancelledError):
            await b
        gate.set()
        got = await c
        await settle(edge)
        return got
    got = asyncio.run(main())
    assert got["pending"] == 1
    assert origin_took(edge) == [c.key for c in first + third]
    assert not edge.stores._waiters and edge.stores._reserved == 0 and edge.stores.stats()["backlog_bytes"] == 0


def test_a_delete_wins_over_a_store_waiting_or_on_its_way(kit, edge):
    waiting, flying = objects(kit, 1, seed=4), objects(kit, 1, seed=5)
    release = asyncio.Event

    async def main():
        gate = release()

        async def slow(cs):
            await gate.wait()
            return {"received": len(cs)}
        edge.answers[(None, "put_objects")] = slow
        edge.answers[(None, "delete_objects")] = lambda keys, ns: {"deleted": len(keys)}
        await edge.put_objects(flying)                   # the forward takes it at once, and waits
        await asyncio.sleep(0.05)
        await edge.put_objects(waiting)                  # queued behind it
        n = await edge.drop([flying[0].key, waiting[0].key])   # the origin's delete reaches the edge
        gate.set()
        await settle(edge)
        return n
    n = asyncio.run(main())
    assert n == 2
    assert origin_took(edge) == [flying[0].key], "the waiting store is never sent"
    again = [(m, args) for node, m, args in edge.asked if m == "delete_objects"]
    assert again == [("delete_objects", [flying[0].key])], "what was on its way is deleted again"
    assert edge.tiers.peek(flying[0].key) is None and edge.tiers.peek(waiting[0].key) is None
    assert edge.stores.stats()["store_forgotten"] == 1 and edge.stores.stats()["store_deleted_again"] == 1


def test_a_hosts_delete_withdraws_its_keys_and_waits_only_for_the_batch_on_its_way(kit, edge):
    """Before a host's delete (LMCache's eviction) the edge withdraws the keys: a store of one
    waiting in the backlog is never sent and is let go here, one on its way is waited for
    until it has landed (so the origin's delete that follows finds it), and the rest of the
    backlog is neither waited for nor held back. A key still on its way at the deadline is
    deleted again once it lands."""
    flying, waiting, others = objects(kit, 2, seed=40), objects(kit, 1, seed=41), objects(kit, 3, seed=42)

    async def main():
        gate = asyncio.Event()
        sent = []

        async def slow(cs):
            sent.append([c.key for c in cs])
            if len(sent) == 1:
                await gate.wait()                          # the first batch stays on its way
            return {"received": len(cs)}
        edge.answers[(None, "put_objects")] = slow
        edge.answers[(None, "delete_objects")] = lambda keys, ns: {"deleted": len(keys)}
        await edge.put_objects(flying)
        await asyncio.sleep(0.05)
        await edge.put_objects(waiting + others)           # queued behind it
        victims = [flying[0].key, waiting[0].key]
        late = await edge.withdraw_stores(victims, 0.2, token=None)   # the batch is held: a deadline
        asyncio.get_running_loop().call_later(0.1, gate.set)
        t0 = asyncio.get_running_loop().time()
        landed = await edge.withdraw_stores(victims, 5.0)
        waited = asyncio.get_running_loop().time() - t0
        await settle(edge)
        return late, landed, waited, sent
    late, landed, waited, sent = asyncio.run(main())
    # the waiting one out; the flying one not landed yet; behind it, the flying two and the others
    assert late == {"withdrawn": 1, "settled": False, "backlog_objects": 5}
    assert (landed["withdrawn"], landed["settled"]) == (0, True) and waited < 2.0
    assert sent[0] == [c.key for c in flying]
    assert [k for batch in sent[1:] for k in batch] == [c.key for c in others], "the waiting store is never sent"
    assert edge.tiers.peek(waiting[0].key) is None               # let go here, not left pinned
    assert all(edge.tiers.peek(c.key) is not None for c in others + flying)
    again = [args for node, m, args in edge.asked if m == "delete_objects"]
    assert again == [[flying[0].key]], "on its way at the first deadline: deleted again once landed"
    st = edge.stores.stats()
    assert st["store_withdrawn"] == 1 and st["store_forgotten"] == 1 and st["backlog_objects"] == 0
    with pytest.raises(BadRequest, match="timeout_s must be in"):
        asyncio.run(edge.withdraw_stores([flying[0].key], 0))


def test_a_store_of_anything_but_opaque_objects_is_refused_and_nothing_is_kept(kit, edge):
    kv = kit.make_chunks(1)
    with pytest.raises(BadRequest, match="item 1 is not an opaque Chunk"):
        asyncio.run(edge.put_objects(objects(kit, 1, seed=6) + kv))
    assert edge.stores.stats()["backlog_objects"] == 0 and edge.tiers.peek(kv[0].key) is None


@pytest.mark.parametrize("owned", [False, True])
def test_what_memory_cannot_hold_pinned_waits_for_the_origin(kit, edge, owned):
    """A key this edge does not own is kept in the hot tier (16 MiB of the edge's 64), one it
    owns in the main tier (48 MiB, half of it for store pins): what memory cannot hold pinned
    is answered by the origin."""
    edge.stores.owns = lambda keys: [owned] * len(keys)
    size = 20 << 20 if owned else 12 << 20              # two: over the room, one fits
    objs = objects(kit, 2, seed=7, size=size)
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs)}
    got = asyncio.run(edge.put_objects(objs))
    assert got["received"] == 2 and got["pending"] < 2
    st = edge.stores.stats()
    assert got["pending"] == 1 and st["store_acked_origin"] == st["store_origin_no_room"] == 1
    assert st.get("store_origin_backlog_full", 0) == 0
    tier, other = (edge.tiers.tier("main"), edge.tiers.tier("hot"))[::1 if owned else -1]
    assert objs[0].key in tier and not any(c.key in other for c in objs)
    sent_now = origin_took(edge)
    assert len(sent_now) >= 2 - got["pending"]


def test_stores_durable_waits_for_the_backlog_and_says_whether_it_is_empty(kit, edge):
    objs = objects(kit, 2, seed=40)
    edge.answers[(None, "put_objects")] = None                   # the origin does not answer yet

    async def main():
        await edge.put_objects(objs)
        waiting = await edge.stores_durable(0.2)
        edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}
        return waiting, await edge.stores_durable(5.0)
    waiting, durable = asyncio.run(main())
    assert not waiting["durable"] and waiting["backlog_objects"] == 2
    assert durable["durable"] and durable["backlog_objects"] == 0 and durable["store_forwarded"] == 2
    with pytest.raises(BadRequest, match="timeout_s"):
        asyncio.run(edge.stores_durable(0))
    assert edge.tiers.peek(objs[0].key) is not None             # nothing harmed


def test_a_key_this_edge_owns_is_kept_in_its_main_tier_pinned_until_durable_the_rest_in_hot(kit, edge):
    """The origin pushes nothing to an owner that holds a key: kept only in the hot tier, an
    owner's copy would go with the hot tier's evictions and the owner would hold nothing. So
    an owned key's copy is kept in main from the start (pinned until durable), the rest in hot."""
    mine, other = objects(kit, 2, seed=50)
    edge.stores.owns = lambda keys: [k == mine.key for k in keys]
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}

    main_tier, hot = edge.tiers.tier("main"), edge.tiers.tier("hot")

    async def main():
        gate = gated(edge, "put_objects")
        await edge.put_objects([mine, other])
        # until durable: the owned key pinned in main from the start, the other in hot
        waiting = (main_tier.is_pinned(mine.key), mine.key in hot, hot.is_pinned(other.key), other.key in main_tier)
        gate.set()
        await settle(edge)
        return waiting
    assert asyncio.run(main()) == (True, False, True, False)
    assert mine.key in main_tier and mine.key not in hot and not main_tier.is_pinned(mine.key)
    assert other.key in hot and other.key not in main_tier and not hot.is_pinned(other.key)
    assert edge.tiers.peek(mine.key).obj.kv.tobytes() == mine.kv.tobytes()
    assert edge.stores.stats()["store_kept_as_main"] == 1


def test_the_same_key_twice_in_one_store_is_kept_and_sent_once(kit, edge):
    obj, = objects(kit, 1, seed=52)
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}
    main_tier, hot = edge.tiers.tier("main"), edge.tiers.tier("hot")

    async def main():
        gate = gated(edge, "put_objects")
        got = await edge.put_objects([obj, obj])
        waiting = (main_tier.is_pinned(obj.key), obj.key in hot, edge.stores.stats()["backlog_objects"])
        gate.set()
        await settle(edge)
        return got, waiting
    got, waiting = asyncio.run(main())
    assert got == {"received": 2, "kept": 2, "pending": 2} and waiting == (True, False, 1)
    assert origin_took(edge) == [obj.key]
    assert obj.key in main_tier and not main_tier.is_pinned(obj.key) and obj.key not in hot
    assert edge.stores.stats()["store_kept_as_main"] == 1


def test_store_pins_fill_at_most_their_share_of_the_main_tier_then_the_hot_tier(kit, edge):
    """The main tier (48 MiB) keeps half its pins for the operator's pinned KBs: a second
    owned 14 MiB store would pass 24 MiB of store pins there, so it is pinned in hot."""
    first, second = objects(kit, 2, seed=53, size=14 << 20)
    main_tier, hot = edge.tiers.tier("main"), edge.tiers.tier("hot")
    assert stores.MAIN_PIN_SHARE * main_tier.capacity == 24 << 20

    async def main():
        gate = gated(edge, "put_objects")
        got = await edge.put_objects([first, second])
        where = [(c.key in main_tier, c.key in hot, main_tier.is_pinned(c.key) or hot.is_pinned(c.key))
                 for c in (first, second)]
        gate.set()
        await settle(edge)
        return got, where
    got, where = asyncio.run(main())
    assert got["pending"] == 2 and where == [(True, False, True), (False, True, True)]
    assert first.key in main_tier and second.key in main_tier and second.key not in hot   # moved once durable
    assert main_tier.pinned_bytes() == 0 and hot.pinned_bytes() == 0


def _arrivals(monkeypatch):
    """Every object kept as it arrived (as inside Ray, for objects of INLINE_BYTES and more):
    a view of the caller's bytes, as a call's argument or an HTTP body is."""
    def arrival(cls, obj, kind="store"):
        held = cls.here(Chunk(obj.key, obj.ns, obj.kv[:], obj.dtype))
        held.xxh, held.arrived = obj.digest(), kind
        return held
    monkeypatch.setattr(Held, "arrival", classmethod(arrival))


def test_a_copy_the_object_store_refuses_leaves_the_arrival_which_goes_to_the_origin_by_value(kit, edge, monkeypatch):
    """The object store refuses the edge's copies (full): each stays an arrival, answered and
    sent by value, in memory of its own: not a view into the body (or call argument) it came
    in, which would keep the whole of it for one object."""
    import ray
    import ray.exceptions as rex

    def full(obj):
        raise rex.ObjectStoreFullError("the object store is full (this test)")
    _arrivals(monkeypatch)
    monkeypatch.setattr(ray, "put", full)
    objs = objects(kit, 2, seed=60)
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}

    async def main():
        got = await edge.put_objects(objs)
        await settle(edge)
        return got
    assert asyncio.run(main())["pending"] == 2                  # answered at the edge all the same
    assert origin_took(edge) == [c.key for c in objs]           # nothing stuck: sent as bytes
    sent = [c for node, m, args in edge.asked if m == "put_objects" for c in args]
    assert [c.kv.tobytes() for c in sent] == [c.kv.tobytes() for c in objs]
    st = edge.stores.stats()
    assert st["store_adopt_errors"] >= 2 and st["backlog_objects"] == 0 and st.get("store_adopted", 0) == 0
    assert all(edge.tiers.peek(c.key).arrived and edge.tiers.peek(c.key).obj.kv.tobytes() == c.kv.tobytes()
               for c in objs)
    assert not any(np.shares_memory(edge.tiers.peek(c.key).obj.kv, c.kv) for c in objs)   # its own bytes
    assert all(edge.tiers.peek(c.key).obj.digest() == c.digest() for c in objs)
    # kept in main until durable (the edge owns them), then never an owner's main copy: hot
    hot, main_tier = edge.tiers.tier("hot"), edge.tiers.tier("main")
    assert all(c.key in hot and c.key not in main_tier and not hot.is_pinned(c.key) for c in objs)


def test_a_store_of_a_key_held_in_main_keeps_that_copy_and_adds_none_to_the_hot_tier(kit, edge, monkeypatch):
    _arrivals(monkeypatch)
    obj, = objects(kit, 1, seed=61)
    held = Held.here(obj)
    held.ref, held.xxh = "ref-main", obj.digest()
    edge.tiers.put("main", obj.key, held)
    edge.answers[(None, "put_object_refs")] = lambda rs: {"received": len(rs), "written": len(rs), "pushing": 0}

    async def main():
        got = await edge.put_objects([obj])
        await settle(edge)
        return got
    assert asyncio.run(main())["pending"] == 1
    assert edge.tiers.peek(obj.key) is held and obj.key not in edge.tiers.tier("hot")
    assert [(m, a) for node, m, a in edge.asked if node is None] == [("put_object_refs", ["ref-main"])]
    assert edge.stores.stats()["store_held_already"] == 1


def test_a_key_stored_again_while_its_copy_waits_is_answered_by_that_copy_and_keeps_its_first_bytes(kit, edge, monkeypatch):
    """One key stored three times while its first copy is on its way to the origin: the copy
    waiting answers for the others, nothing more is sent, and other bytes are refused in
    effect, here as at the origin (a key keeps its first bytes: kdn/origin/chunks.py), so the
    edge and the origin end with the same bytes. They used to go to the origin at once and
    replace the edge's copy: the origin kept whichever landed first."""
    def checked(cls, obj, kind="store"):                    # a copy with its checksum, as the store keeps
        held = cls.here(obj)
        held.xxh = obj.digest()
        return held
    monkeypatch.setattr(Held, "arrival", classmethod(checked))
    first, = objects(kit, 1, seed=70)
    other = pack(first.key, kit.NS, np.random.default_rng(71).integers(0, 255, 4096, dtype=np.uint8))
    assert other.kv.tobytes() != first.kv.tobytes()
    at_origin = {}

    async def main():
        gate = asyncio.Event()

        async def slow(cs):                   # the origin keeps a key's first bytes
            await gate.wait()
            for c in cs:
                at_origin.setdefault(c.key, c.kv.tobytes())
            return {"received": len(cs), "written": len(cs), "pushing": 0}
        edge.answers[(None, "put_objects")] = slow
        await edge.put_objects([first])                  # the forward takes it, and waits
        await asyncio.sleep(0.05)
        same = await edge.put_objects([first])           # the same bytes again
        differ = await edge.put_objects([other])         # other bytes under the key
        asked = len(edge.asked)
        pinned = edge.tiers.tier("main").is_pinned(first.key)      # the ring's only edge owns it
        gate.set()
        await settle(edge)
        return same, differ, asked, pinned
    same, differ, asked, pinned = asyncio.run(main())
    assert same["pending"] == 1 and differ["pending"] == 1 and asked == 1 and pinned
    sent = [c.kv.tobytes() for node, m, args in edge.asked if m == "put_objects" for c in args]
    assert sent == [first.kv.tobytes()]
    assert at_origin == {first.key: first.kv.tobytes()}
    assert edge.tiers.peek(first.key).obj.kv.tobytes() == first.kv.tobytes(), "the edge serves the origin's bytes"
    assert not edge.tiers.tier("main").is_pinned(first.key)
    st = edge.stores.stats()
    assert st["store_queued_already"] == 1 and st["store_kept_first"] == 1 and st["store_forwarded"] == 1
    assert st["backlog_objects"] == 0 and st.get("store_acked_origin", 0) == 0


def test_a_key_stored_again_while_its_copy_waits_from_the_main_tier_is_answered_by_that_copy(kit, edge, monkeypatch):
    """The copy waiting for the origin is the main tier's (a key this edge owns, stored again):
    a store of other bytes meanwhile adds nothing to the hot tier and sends nothing, and main
    keeps the first bytes once durable (it used to be replaced by the later bytes)."""
    _arrivals(monkeypatch)
    obj, = objects(kit, 1, seed=62)
    other = pack(obj.key, kit.NS, np.random.default_rng(63).integers(0, 255, 4096, dtype=np.uint8))
    held = Held.here(obj)
    held.ref, held.xxh = "ref-main", obj.digest()
    edge.tiers.put("main", obj.key, held)

    async def main():
        gate = gated(edge, "put_object_refs")
        first = await edge.put_objects([obj])             # waits, as main's copy
        await asyncio.sleep(0.05)
        again = await edge.put_objects([other])
        gate.set()
        await settle(edge)
        return first, again
    first, again = asyncio.run(main())
    assert first["pending"] == 1 and again["pending"] == 1
    assert [(m, a) for node, m, a in edge.asked if node is None] == [("put_object_refs", ["ref-main"])]
    assert edge.tiers.peek(obj.key) is held and obj.key not in edge.tiers.tier("hot")
    assert edge.stores.stats()["store_kept_first"] == 1


def test_a_drop_replayed_from_the_origins_log_wins_over_a_store_waiting_as_its_broadcast_does(kit, edge):
    """The edge missed the broadcast of a delete and catches up on the origin's drop log
    (kdn/edge/drops.py): the store of that key it acknowledged and has not sent is not sent,
    the other key's is."""
    dropped, kept = objects(kit, 2, seed=80)
    log = {"log": "log-a", "head": 0}

    def drops(since=None):
        if since is None:
            return {**log, "keys": None}
        return {**log, "keys": [dropped.key][since:log["head"]]}
    edge.answers[(None, "drops")] = drops

    async def main():
        assert await edge.replay.catch_up() and edge.replay.seen == ("log-a", 0)
        edge.answers[(None, "put_objects")] = None       # the origin does not take stores yet
        await edge.put_objects([dropped, kept])
        log["head"] = 1                                   # the delete, its broadcast missed
        assert await edge.replay.catch_up() and edge.replay.seen == ("log-a", 1)
        unanswered = len(edge.asked)
        edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0}
        await settle(edge)
        return unanswered
    unanswered = asyncio.run(main())
    taken = [c.key for node, m, args in edge.asked[unanswered:] if m == "put_objects" for c in args]
    assert taken == [kept.key], "the replayed delete's key is never sent"
    assert edge.tiers.peek(dropped.key) is None and edge.tiers.peek(kept.key) is not None
    assert edge.stores.stats()["store_forgotten"] == 1


def test_a_key_stored_again_with_no_checksum_to_compare_is_answered_by_the_waiting_copy_and_counted_apart(kit, edge):
    """Copies held with no checksum (small objects kept in this process: Held.here) cannot be
    compared: the waiting copy answers, counted as unchecked, neither as the same bytes nor as
    other bytes."""
    obj, = objects(kit, 1, seed=95)

    async def main():
        gate = gated(edge, "put_objects")
        await edge.put_objects([obj])
        await asyncio.sleep(0.05)
        again = await edge.put_objects([obj])
        asked = len(edge.asked)
        gate.set()
        await settle(edge)
        return again, asked
    again, asked = asyncio.run(main())
    assert again["pending"] == 1 and asked == 1
    st = edge.stores.stats()
    assert st["store_queued_unchecked"] == 1 and "store_kept_first" not in st and "store_queued_already" not in st


def test_a_key_held_as_durable_and_stored_again_with_other_bytes_ends_with_the_origins_bytes(kit, edge, monkeypatch):
    """The gap the backlog's own check leaves: the first copy is durable (out of the backlog,
    held in the hot tier) when other bytes come under its key. The edge keeps and answers
    them at once, as any store, and sends them; the origin keeps the key's first bytes and
    names the key in its answer (kept_other, as OriginNode.put_objects does), and the edge lets
    its copy go: its readers then get the origin's bytes, never the ones the origin refused."""
    def checked(cls, obj, kind="store"):
        held = cls.here(obj)
        held.xxh = obj.digest()
        return held
    monkeypatch.setattr(Held, "arrival", classmethod(checked))
    monkeypatch.setattr(edge.stores, "owns", lambda keys: [False] * len(keys))    # stays hot
    first, = objects(kit, 1, seed=90)
    other = pack(first.key, kit.NS, np.random.default_rng(91).integers(0, 255, 4096, dtype=np.uint8))
    at_origin = {}

    def origin(cs):                           # a key keeps its first bytes (kdn/origin/chunks.py)
        kept = [c.key for c in cs if at_origin.setdefault(c.key, c.kv.tobytes()) != c.kv.tobytes()]
        return {"received": len(cs), "written": len(cs) - len(kept), "pushing": 0, "kept_other": kept}
    edge.answers[(None, "put_objects")] = origin

    async def main():
        await edge.put_objects([first])
        await settle(edge)
        durable = edge.tiers.peek(first.key).obj.kv.tobytes()
        got = await edge.put_objects([other])
        served_at_once = edge.tiers.peek(first.key).obj.kv.tobytes()
        await settle(edge)
        return durable, got, served_at_once
    durable, got, served_at_once = asyncio.run(main())
    assert durable == first.kv.tobytes() and got == {"received": 1, "kept": 1, "pending": 1}
    assert served_at_once == other.kv.tobytes()          # acknowledged here, as any store
    assert at_origin == {first.key: first.kv.tobytes()}
    assert edge.tiers.peek(first.key) is None, "the refused bytes are not served here any more"
    st = edge.stores.stats()
    assert st["store_origin_kept_other"] == 1 and st["store_forwarded"] == 2 and st["backlog_objects"] == 0
    # the same bytes stored again are nothing the origin names: the copy stays
    edge.answers[(None, "put_objects")] = origin

    async def again():
        await edge.put_objects([first])
        await settle(edge)
    asyncio.run(again())
    assert edge.tiers.peek(first.key).obj.kv.tobytes() == first.kv.tobytes()
    assert edge.stores.stats()["store_origin_kept_other"] == 1


def test_answers_in_two_calls_are_merged_with_the_keys_the_origin_kept_other_bytes_for(kit, edge, monkeypatch):
    """A batch sent as references and as bytes is answered by two calls: the counts add up and
    kept_other lists the keys of both."""
    refs = {}

    def kept(cls, obj):
        held = cls.here(obj)
        if obj.key.endswith(b"0") or len(refs) == 0:
            held.ref = refs.setdefault(obj.key, f"ref-{len(refs)}")
        return held
    monkeypatch.setattr(Held, "kept", classmethod(kept))
    objs = objects(kit, 2, seed=95)
    edge.answers[(None, "put_object_refs")] = lambda rs: {"received": len(rs), "written": 0, "pushing": 0,
                                                          "kept_other": [b"k-ref"]}
    edge.answers[(None, "put_objects")] = lambda cs: {"received": len(cs), "written": len(cs), "pushing": 0,
                                                      "kept_other": [b"k-val"]}
    held = [Held.kept(o) for o in objs]
    got = asyncio.run(edge.stores._send(held, by_ref=True))
    assert [h.ref is not None for h in held].count(True) == 1
    assert got == {"received": 2, "written": 1, "pushing": 0, "kept_other": [b"k-ref", b"k-val"]}
