"""The one call helper (kdn/core/rpc.py) against real Ray actors: it fails over on a dead, missing
or slow actor and on nothing else — a refusal arrives as itself, a bug is never swallowed."""
import asyncio
import threading
import time
import uuid

import pytest
import ray

from kdn.core.errors import AccessDenied
from kdn.core.names import NAMESPACE, edge_actor_name
from kdn.core.rpc import Actors, Unreachable


class Node:
    """A stand-in KDN actor: every method takes token=, like the real nodes."""

    async def echo(self, x, token=None):
        return (x, token)

    async def refuse(self, token=None):
        raise AccessDenied("refused: this namespace needs its tenant's read token")

    async def slow(self, seconds, token=None):
        await asyncio.sleep(seconds)
        return "late"

    async def no_token(self):          # the old bug: a method that takes no token=
        return "never"


@pytest.fixture(scope="module")
def node(ray_cluster):
    network = f"r{uuid.uuid4().hex[:8]}"
    h = ray.remote(Node).options(name=edge_actor_name(network, "e1"), namespace=NAMESPACE,
                                 num_cpus=0, max_restarts=0).remote()
    ray.get(h.echo.remote(1))
    yield network, h
    ray.kill(h)


def test_a_call_passes_the_token_and_returns_the_answer(node):
    network, _ = node
    actors = Actors(network, token="tok")
    assert actors.call_sync("e1", "echo", 5, timeout=10) == (5, "tok")
    assert actors.call_sync("e1", "echo", 5, timeout=10, token="other") == (5, "other")
    assert asyncio.run(actors.call("e1", "echo", 6, timeout=10)) == (6, "tok")


def test_calls_started_at_once_are_collected_one_by_one(node):
    network, _ = node
    actors = Actors(network, token="tok")
    refs = [actors.start("e1", "echo", i) for i in range(3)] + [actors.start("e1", "echo", 9, token="t2")]
    assert [actors.get_sync("e1", r, timeout=10) for r in refs] == [(0, "tok"), (1, "tok"), (2, "tok"), (9, "t2")]
    with pytest.raises(Unreachable, match="no actor"):
        actors.start("nobody", "echo", 1)


def test_a_refusal_arrives_as_itself_without_a_remote_traceback(node):
    network, _ = node
    with pytest.raises(AccessDenied) as e:
        Actors(network).call_sync("e1", "refuse", timeout=10)
    assert type(e.value) is AccessDenied
    assert str(e.value) == "refused: this namespace needs its tenant's read token"
    assert asyncio.run(_try(Actors(network), "refuse")) == "AccessDenied"


async def _try(actors, method):
    try:
        await actors.try_call("e1", method, timeout=10)
    except AccessDenied:
        return "AccessDenied"
    return "swallowed"


def test_a_wrong_signature_is_a_bug_that_raises_not_a_failover(node):
    network, _ = node
    with pytest.raises(TypeError, match="token"):
        Actors(network).call_sync("e1", "no_token", timeout=10)
    with pytest.raises(TypeError, match="token"):
        asyncio.run(Actors(network).try_call("e1", "no_token", timeout=10))


def test_slow_missing_and_dead_actors_fail_over(ray_cluster):
    network = f"r{uuid.uuid4().hex[:8]}"
    h = ray.remote(Node).options(name=edge_actor_name(network, "e1"), namespace=NAMESPACE,
                                 num_cpus=0, max_restarts=0).remote()
    actors = Actors(network)
    assert actors.call_sync("e1", "echo", 1, timeout=30) == (1, None)
    t0 = time.monotonic()
    with pytest.raises(Unreachable, match="did not answer slow: GetTimeoutError"):
        actors.call_sync("e1", "slow", 10, timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert asyncio.run(actors.try_call("e1", "slow", 10, timeout=0.5)) is None
    with pytest.raises(Unreachable, match="no actor .*edge:nope"):
        actors.call_sync("nope", "echo", 1, timeout=5)
    ray.kill(h)
    time.sleep(1.0)
    with pytest.raises(Unreachable):
        actors.call_sync("e1", "echo", 1, timeout=10)
    assert "e1" not in actors._handles                 # forgotten: looked up afresh next time


def test_after_a_failover_the_lookup_runs_off_the_loop_once_for_every_waiting_call(node, monkeypatch):
    """ray.get_actor is a blocking call to the GCS: made slow here (250 ms, a GCS under load),
    it must not stall the loop, and concurrent calls share one lookup."""
    network, _ = node
    real, lookups = ray.get_actor, []

    def slow_get_actor(*a, **kw):
        lookups.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.25)
        return real(*a, **kw)
    monkeypatch.setattr(ray, "get_actor", slow_get_actor)
    actors = Actors(network, token="tok")

    async def main():
        lags, stop = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not stop.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                lags.append(now - last)
                last = now
        t = asyncio.ensure_future(ticker())
        got = await asyncio.gather(*(actors.call("e1", "echo", i, timeout=30) for i in range(8)))
        stop.set()
        await t
        return got, max(lags)

    got, lag = asyncio.run(main())
    assert got == [(i, "tok") for i in range(8)]
    assert lookups == [False], "one lookup, in a worker thread"
    assert lag < 0.2, f"the loop stalled {lag * 1e3:.0f} ms during a 250 ms lookup"
    assert asyncio.run(actors.call("e1", "echo", 9, timeout=30)) == (9, "tok") and len(lookups) == 1
