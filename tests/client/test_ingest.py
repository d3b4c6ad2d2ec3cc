"""A client's bulk writes to the origin (kdn/client/ingest.py), against the origin's real HTTP
server on loopback and a stand-in for its Ray calls: over HTTP where the data plane says so,
the answer the origin's own; a write the server does not answer goes over Ray and the address
is asked again; a refusal raises; on the origin's node, or with "ray", Ray carries them."""
import asyncio
import threading

import numpy as np
import pytest

from kdn.client.dataplane import ReaderPlane
from kdn.client.ingest import OriginWrites
from kdn.core.auth import Tokens
from kdn.core.chunk import Chunk
from kdn.core.errors import AccessDenied
from kdn.core.interfaces import OriginAPI
from kdn.core.rpc import Stub
from kdn.origin.http import OriginHTTP
from kdn.origin.store import ChunkStore

ADMIN = "admin-token-ingest-0123456789"
NS = b"i" * 16


class Origin:
    """The origin's server on loopback (its writes stored straight into a real store) and a
    view whose origin() answers data_address and takes put_chunks as Ray would."""

    def __init__(self, tmp_path, node="node-1"):
        self.store, self.node, self.ray_calls = ChunkStore(tmp_path / "store"), node, []
        self.admin_token, self.most = ADMIN, 1 << 29
        self.plane = ReaderPlane("auto", None, None, None)     # its pool of connections

        async def put_chunks(chunks):
            results = await asyncio.to_thread(self.store.put_chunks, chunks)
            return {"received": len(chunks), "written": sum(w for w, _ in results), "sums": [x for _, x in results]}
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = OriginHTTP(self.store, Tokens.from_dict({"admin": ADMIN}), ingest={"chunks": put_chunks})
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)

    def origin(self, timeout):
        def call(method, args, kw):
            if method == "data_address":
                return {"url": self.url, "node": self.node, "ip": "127.0.0.1", "max_write_bytes": self.most}
            assert method == "put_chunks"
            self.ray_calls.append([c.key for c in args[0]])
            return {"received": len(args[0]), "written": 0, "sums": [c.digest() for c in args[0]]}
        return Stub(OriginAPI, call, "the origin")

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def origin(tmp_path):
    o = Origin(tmp_path)
    yield o
    if o.thread.is_alive():
        o.stop()


def chunks(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Chunk(rng.bytes(16), NS, rng.standard_normal((2, 2, 2, 32, 8)).astype(np.float32), "float32")
            for _ in range(n)]


def test_writes_go_to_the_origins_server_and_a_silent_server_sends_them_over_ray(origin):
    writes = OriginWrites(origin, "http", "node-1", "127.0.0.1")
    first, second = chunks(3, seed=1), chunks(2, seed=2)
    got = writes.put("chunks", first, 30.0)
    assert got == {"received": 3, "written": 3, "sums": [c.digest() for c in first]}
    assert all(origin.store.get(c.key).kv.tobytes() == c.kv.tobytes() for c in first)   # the bytes sent
    assert origin.ray_calls == [] and writes.stats()["http_frames"] == 3
    origin.stop()                                           # the server goes: Ray takes the write
    assert writes.put("chunks", second, 5.0)["received"] == 2
    assert origin.ray_calls == [[c.key for c in second]]
    st = writes.stats()
    assert st["http_failures"] == 1 and st["ray_writes"] == 1 and writes.addresses.stale("origin")
    writes.put("chunks", first, 5.0)                       # Ray for a while: the server is not asked
    assert len(origin.ray_calls) == 2 and writes.stats()["http_failures"] == 1


def test_a_write_larger_than_the_server_takes_goes_over_ray(origin):
    origin.most = 10_000                                   # the origin's bound on one body
    writes = OriginWrites(origin, "http", "node-1", "127.0.0.1")
    small, large = chunks(1, seed=4), chunks(3, seed=5)   # 2 KiB each: 3 of them pass the bound
    writes.put("chunks", small, 30.0)
    writes.put("chunks", large, 30.0)
    assert origin.ray_calls == [[c.key for c in large]] and writes.stats()["http_frames"] == 1


def test_a_refused_write_raises_and_is_not_sent_again_over_ray(origin):
    writes = OriginWrites(origin, "http", "node-1", "127.0.0.1", token="not-the-admin-token-012")
    with pytest.raises(AccessDenied, match="403"):
        writes.put("chunks", chunks(1), 30.0)
    assert origin.ray_calls == [] and origin.store.chunk_count == 0


@pytest.mark.parametrize("mode,node", [("auto", "node-1"), ("ray", "node-2")])
def test_on_the_origins_node_or_with_ray_the_writes_go_over_ray(origin, mode, node):
    writes = OriginWrites(origin, mode, node, "127.0.0.1")
    cs = chunks(2, seed=3)
    assert writes.put("chunks", cs, 30.0)["sums"] == [c.digest() for c in cs]
    assert origin.ray_calls == [[c.key for c in cs]] and origin.server.counters["ingest_chunks_calls"] == 0
