"""The origin's frames over HTTP (kdn/origin/http.py), against a real store and server, without
Ray: what an edge's peer client pulls is the stored bytes, in the order asked, absent chunks
left out; an answer whose frame changed after its size was announced ends short (the edge then
takes the push over Ray); only the admin reads; off loopback it needs an admin token."""
import asyncio
import threading

import numpy as np
import pytest

from kdn.client.http import EdgeHTTPClient
from kdn.core.auth import Tokens
from kdn.core.chunk import Chunk
from kdn.core.errors import AccessDenied, BadRequest
from kdn.core.rpc import Unreachable
from kdn.origin.http import OriginHTTP
from kdn.origin.store import ChunkStore

ADMIN = "admin-token-origin-http-0123456789"
NS = b"n" * 16


@pytest.fixture
def served(tmp_path):
    """(store, server, url): an origin store of 4 chunks served on loopback from a loop in a thread."""
    store = ChunkStore(tmp_path / "store")
    rng = np.random.default_rng(5)
    chunks = [Chunk(bytes([i]) * 16, NS, rng.standard_normal((2, 2, 2, 64, 16)).astype(np.float32), "float32")
              for i in range(1, 5)]
    store.put_chunks(chunks)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = OriginHTTP(store, Tokens.from_dict({"admin": ADMIN}))
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    yield store, server, url, chunks
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_the_stored_frames_are_served_in_order_to_the_admin_only(served):
    store, server, url, chunks = served
    keys = [c.key for c in chunks]
    with EdgeHTTPClient(url, token=ADMIN) as c:
        objs, nbytes = c.peer_get([keys[2], b"\x09" * 16, keys[0]])      # one the store lacks
        assert objs[1] is None and [o.key for o in (objs[0], objs[2])] == [keys[2], keys[0]]
        assert np.array_equal(objs[0].kv, chunks[2].kv) and np.array_equal(objs[2].kv, chunks[0].kv)
        assert nbytes == store.size_of(keys[2]) + store.size_of(keys[0])
        with pytest.raises(BadRequest, match="named twice"):
            c.peer_get([keys[0], keys[0]])
    with pytest.raises(AccessDenied, match="401"):
        EdgeHTTPClient(url).peer_get(keys)
    with pytest.raises(AccessDenied, match="403"):
        EdgeHTTPClient(url, token="not-the-admin").peer_get(keys)
    assert server.counters["frames_sent"] == 2 and server.counters["status_401"] == 1


def test_a_frame_that_changed_after_its_size_was_announced_cuts_the_answer_short(served, monkeypatch):
    store, server, url, chunks = served
    real = store.size_of
    monkeypatch.setattr(store, "size_of", lambda k: real(k) + (7 if k == chunks[1].key else 0))
    with EdgeHTTPClient(url, token=ADMIN) as c:
        with pytest.raises(Unreachable, match="ended after"):
            c.peer_get([ch.key for ch in chunks])
    assert server.counters["answers_cut_short"] == 1 and server.counters["frames_sent"] == 1


def test_off_loopback_the_origin_serves_its_frames_only_with_an_admin_token(tmp_path):
    with pytest.raises(BadRequest, match="off loopback, without an admin token"):
        OriginHTTP(ChunkStore(tmp_path / "store"), Tokens.from_dict(None), host="192.0.2.7")
