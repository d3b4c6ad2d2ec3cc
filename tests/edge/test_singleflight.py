"""Singleflight: concurrent loads of one key cause one loader call, and everyone gets its answer."""
import asyncio

from kdn.edge.singleflight import Group


def test_concurrent_loads_of_one_key_call_the_loader_once_and_count_the_deduped():
    calls = []

    async def loader(keys):
        calls.append(list(keys))
        await asyncio.sleep(0.05)            # still in flight when the others ask
        return {k: f"v-{k}" for k in keys}

    async def main():
        g = Group()
        got = await asyncio.gather(*(g.do_many(["a"], loader) for _ in range(10)))
        return g, got

    g, got = asyncio.run(main())
    assert calls == [["a"]]
    assert got == [["v-a"]] * 10
    assert g.counters == {"loads": 1, "loads_deduped": 9}
    assert g.stats() == {"inflight": 0, "loads": 1, "loads_deduped": 9}


def test_a_batch_loads_only_the_keys_nobody_else_is_loading():
    calls = []

    async def loader(keys):
        calls.append(sorted(keys))
        await asyncio.sleep(0.05)
        return {k: k.upper() for k in keys if k != "missing"}

    async def main():
        g = Group()
        first = asyncio.ensure_future(g.do_many(["a", "b"], loader))
        await asyncio.sleep(0)               # a and b now in flight
        second = await g.do_many(["b", "c", "missing"], loader)
        return g, await first, second

    g, first, second = asyncio.run(main())
    assert calls == [["a", "b"], ["c", "missing"]]
    assert first == ["A", "B"] and second == ["B", "C", None]
    assert g.counters["loads"] == 2 and g.counters["loads_deduped"] == 1
    assert len(g) == 0


def test_a_loader_error_reaches_every_waiter_and_nothing_stays_in_flight():
    async def loader(keys):
        await asyncio.sleep(0.05)
        raise ConnectionError("origin unreachable")

    async def main():
        g = Group()
        results = await asyncio.gather(*(g.do_many(["k"], loader) for _ in range(3)),
                                       return_exceptions=True)
        return g, results

    g, results = asyncio.run(main())
    assert len(results) == 3
    assert all(isinstance(r, ConnectionError) and str(r) == "origin unreachable" for r in results)
    assert len(g) == 0 and g.counters == {"loads": 1, "loads_deduped": 2}


def test_after_a_load_completes_the_next_miss_loads_again():
    calls = []

    async def loader(keys):
        calls.append(list(keys))
        return {}

    async def main():
        g = Group()
        assert await g.do_many(["x"], loader) == [None]
        assert await g.do_many(["x"], loader) == [None]

    asyncio.run(main())
    assert calls == [["x"], ["x"]], "only concurrent loads are shared; results are not cached"


def test_no_keys_no_load():
    async def loader(keys):
        raise AssertionError("must not be called")

    g = Group()
    assert asyncio.run(g.do_many([], loader)) == []
    assert g.counters["loads"] == 0


def test_a_cancelled_loader_hands_its_keys_to_a_waiter_never_its_cancellation():
    """Go's singleflight: one caller's cancellation is its own. The waiters load the keys
    again (one of them as the new loader) and all get the value."""
    calls = []

    async def loader(keys):
        calls.append(list(keys))
        await asyncio.sleep(0.05 if len(calls) == 1 else 0.01)
        return {k: f"v-{k}" for k in keys}

    async def main():
        g = Group()
        leader = asyncio.ensure_future(g.do_many(["a", "b"], loader))
        await asyncio.sleep(0)                 # the leader is loading a and b
        followers = [asyncio.ensure_future(g.do_many(["a"], loader)) for _ in range(3)]
        follower_b = asyncio.ensure_future(g.do_many(["b", "c"], loader))
        await asyncio.sleep(0.01)
        leader.cancel()
        got = await asyncio.gather(*followers, follower_b)
        try:
            await leader
        except asyncio.CancelledError:
            pass
        return g, got, leader.cancelled()

    g, got, leader_cancelled = asyncio.run(main())
    assert leader_cancelled, "the cancelled caller sees its own cancellation"
    assert got == [["v-a"]] * 3 + [["v-b", "v-c"]]
    assert calls[0] == ["a", "b"] and ["c"] in calls, calls
    assert sorted(k for c in calls[1:] for k in c) == ["a", "b", "c"], "each key loaded once more"
    assert g.counters["loads_abandoned"] == 1 and len(g) == 0


def test_a_cancelled_waiter_leaves_the_load_to_the_others():
    """A waiter that stops waiting (its reader hung up) must not cancel the shared load."""
    async def loader(keys):
        await asyncio.sleep(0.05)
        return {k: k.upper() for k in keys}

    async def main():
        g = Group()
        leader = asyncio.ensure_future(g.do_many(["a"], loader))
        await asyncio.sleep(0)
        quitter = asyncio.ensure_future(g.do_many(["a"], loader))
        stayer = asyncio.ensure_future(g.do_many(["a"], loader))
        await asyncio.sleep(0.01)
        quitter.cancel()
        return g, await leader, await stayer, quitter.cancelled()

    g, lead, stay, quit_cancelled = asyncio.run(main())
    assert (lead, stay, quit_cancelled) == (["A"], ["A"], True)
    assert g.counters == {"loads": 1, "loads_deduped": 2}
