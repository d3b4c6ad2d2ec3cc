"""An edge in this process, without Ray (fixture `kit`): the real EdgeNode and its parts,
chunks put in its tiers directly (no object store), its HTTP server on an event loop in a
thread (fixtures `loop`, `serve`).

What needs other nodes (pull-through, membership from the origin) is tested on a real
network in test_node.py; everything an edge decides alone is tested here, fast.
"""
import asyncio
import threading
import time
import types

import numpy as np
import pytest

from kdn.core.chunk import Chunk
from kdn.edge.tiers import Held
from kdn.core.keys import chunk_keys, namespace_digest
from kdn.placement.topology import Topology

NS = namespace_digest("default", "edge-unit")


def topology(slow_gbps: float = 1.0) -> dict:
    """Regions here and far, an edge in each; the link between them slow_gbps."""
    t = Topology.default_local(["here", "far"], capacity_bytes=64 << 20).to_dict()
    t["links"][0]["bandwidth_gbps"] = slow_gbps
    return t


def make_chunks(n: int, tokens: int = 64, ns: bytes = NS, seed: int = 0, shape=(2, 2, 2, 64)) -> list:
    """n chunks of a chain (fp16-precision fp32 KV: compressible, like a model's)."""
    keys = chunk_keys(range(seed * 100000, seed * 100000 + n * tokens), ns, tokens)
    rng = np.random.default_rng(seed)
    layers, two, heads, head_dim = shape
    return [Chunk(k, ns, rng.standard_normal((layers, two, heads, tokens, head_dim))
                  .astype(np.float16).astype(np.float32), "float32") for k in keys]


def big_chunks(n: int, mib: int = 64, ns: bytes = NS) -> list:
    """n chunks of mib MiB each over one shared read-only buffer (as in the object store): the
    CPU work of checking them is real, their memory is one chunk's."""
    kv = np.ones((mib, 2, 8, 256, 16), np.float32)     # 1 MiB per layer
    kv.flags.writeable = False
    return [Chunk(k, ns, kv, "float32") for k in chunk_keys(range(n * 256), ns, 256)]


def held(obj, own: bool = True) -> Held:
    """A Held already read into this process (no object store behind it)."""
    h = Held(None, obj.key, obj.ns, obj.nbytes, obj.raw, obj.codec, obj.dtype, own=own)
    h.obj = obj
    return h


def local_edge(chunks=(), role="main", **options):
    """An EdgeNode outside Ray holding chunks (network "t", edge here-0 in region here). Its
    peers answer over the stand-in transport (Ray's calls), so it pulls with data_plane "ray"
    unless told otherwise (tests/edge/test_dataplane.py)."""
    from kdn.edge.node import EdgeNode
    options.setdefault("topology", topology())
    options.setdefault("data_plane", "ray")
    edge = EdgeNode("t", "here-0", "here", options.pop("capacity_bytes", 64 << 20), **options)
    for c in chunks:
        edge.tiers.put(role, c.key, held(c))
    return edge


async def stalls(coro, tick_s: float = 0.002) -> tuple:
    """(coro's result, the event loop's longest stall while it ran, ticks, seconds it took): a
    ticker sleeps tick_s again and again beside coro; a stall is how late it woke. CPU work on
    the loop is one stall as long as the work, with no tick during it."""
    stop, gaps = asyncio.Event(), []

    async def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(tick_s)
            now = time.perf_counter()
            gaps.append(now - last - tick_s)
            last = now
    t = asyncio.ensure_future(ticker())
    await asyncio.sleep(tick_s)                    # the ticker is running
    gaps.clear()
    t0 = time.perf_counter()
    out = await coro
    took = time.perf_counter() - t0
    ticks = len(gaps)
    await asyncio.sleep(2 * tick_s)               # the ticker's wake after the call: its gap counts
    stop.set()
    await t
    return out, max(gaps[:ticks + 1], default=took), ticks, took


def assert_off_loop(measure, attempts: int = 3) -> None:
    """measure() -> stalls()'s (stall, ticks, took) of fresh work: the loop must tick while it
    runs and never stall half of it. Up to attempts tries: a stall a busy machine's scheduler
    made passes on another try, work on the loop stalls every one."""
    seen = []
    for _ in range(attempts):
        stall, ticks, took = measure()
        if ticks >= 3 and stall < took / 2:
            return
        seen.append(f"{stall * 1e3:.0f} ms ({ticks} ticks) in {took * 1e3:.0f} ms")
    raise AssertionError(f"the loop stalled {'; '.join(seen)} of work")


class Loop:
    """An event loop in a thread: run(coro) waits for its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def kit():
    """NS, topology(), make_chunks(), big_chunks(), held(), local_edge(), stalls(),
    assert_off_loop(): see their docstrings."""
    return types.SimpleNamespace(NS=NS, topology=topology, make_chunks=make_chunks, held=held,
                                 local_edge=local_edge, stalls=stalls, big_chunks=big_chunks,
                                 assert_off_loop=assert_off_loop)


@pytest.fixture
def loop():
    lp = Loop()
    yield lp
    lp.close()


@pytest.fixture
def serve(loop):
    """serve(edge, **http_options) -> a started EdgeHTTP of edge (stopped after the test)."""
    from kdn.edge.http import EdgeHTTP
    servers = []

    def start(edge, **kw):
        server = EdgeHTTP(edge, **kw)
        loop.run(server.start())
        edge.http = server
        servers.append(server)
        return server
    yield start
    for s in servers:
        loop.run(s.stop())
