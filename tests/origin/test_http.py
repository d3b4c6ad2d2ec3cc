"""The origin's frames over HTTP (kdn/origin/http.py), against a real store and server, without
Ray: what an edge's peer client pulls is the stored bytes, in the order asked, absent chunks
left out; an answer whose frame changed after its size was announced ends short (the edge then
takes the push over Ray); only the admin reads; off loopback it needs an admin token. Writes
(a client's chunks and objects as frames, kdn/client/ingest.py) are stored verified and
answered, and a bad one is refused whole, naming the problem."""
import asyncio
import threading

import numpy as np
import pytest

from kdn.client.http import EdgeHTTPClient
from kdn.core.auth import Tokens
from kdn.core.chunk import Chunk, check_objects
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


@pytest.fixture
def ingesting(tmp_path):
    """(store, server, url): an empty origin store whose server takes writes (the origin's
    put_chunks and put_objects stand-ins store straight into it)."""
    store = ChunkStore(tmp_path / "store")

    async def put_chunks(chunks):
        results = await asyncio.to_thread(store.put_chunks, chunks)
        return {"received": len(chunks), "written": sum(w for w, _ in results), "sums": [x for _, x in results]}

    async def put_objects(chunks):
        check_objects(chunks, 4096, "put_objects")          # as OriginNode.put_objects does first
        results = await asyncio.to_thread(store.put_objects, chunks)
        return {"received": len(chunks), "written": sum(w for w, _ in results), "kept_other": []}
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = OriginHTTP(store, Tokens.from_dict({"admin": ADMIN}),
                        ingest={"chunks": put_chunks, "objects": put_objects})
    url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    yield store, server, url
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def _post(url, path, body, token=ADMIN, content_type="application/x-kdn-frames"):
    import http.client
    import json
    from urllib.parse import urlsplit
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("POST", path, body=body, headers={"Content-Type": content_type,
                                                   "Authorization": f"Bearer {token}"})
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, (json.loads(raw) if resp.status != 200 else raw)


def test_a_clients_chunks_and_objects_written_over_http_are_stored_verified_and_answered(ingesting):
    from kdn.integrations.objects import object_key, pack
    store, server, url = ingesting
    rng = np.random.default_rng(8)
    chunks = [Chunk(bytes([i]) * 16, NS, rng.standard_normal((2, 2, 2, 64, 16)).astype(np.float16), "float16")
              for i in range(1, 4)]
    objs = [pack(object_key(NS, f"o{i}".encode()), NS, rng.integers(0, 255, 5000 + i, dtype=np.uint8))
            for i in range(2)]
    with EdgeHTTPClient(url, token=ADMIN) as c:
        got = c.put_frames("chunks", chunks)
        assert got == {"received": 3, "written": 3, "sums": [ch.digest() for ch in chunks]}
        assert c.put_frames("chunks", chunks[:1])["written"] == 0          # deduplicated
        assert c.put_frames("objects", objs) == {"received": 2, "written": 2, "kept_other": []}
    for ch in chunks + objs:                                               # the bytes sent
        assert store.get(ch.key).kv.tobytes() == ch.kv.tobytes()      # moved, not computed: any CPU
    assert server.counters["ingest_chunks_frames"] == 4 and server.counters["ingest_objects_calls"] == 1
    with pytest.raises(AccessDenied, match="403"):
        EdgeHTTPClient(url, token="not-the-admin").put_frames("chunks", chunks)


def test_a_bad_write_is_refused_whole_naming_the_problem_and_stores_nothing(ingesting, monkeypatch):
    from kdn.core.chunk import encode
    from kdn.core import serving
    store, server, url = ingesting
    rng = np.random.default_rng(9)
    chunks = [Chunk(bytes([i]) * 16, NS, rng.standard_normal((2, 2, 2, 8, 16)).astype(np.float32), "float32")
              for i in range(1, 4)]
    frames = [bytearray(encode(ch)) for ch in chunks]
    frames[1][-3] ^= 0xFF                                                  # a payload byte flipped
    status, err = _post(url, "/v1/chunks", b"".join(frames))
    assert status == 400 and "frame 1 " in err["message"] and "checksum" in err["message"]
    status, err = _post(url, "/v1/chunks", encode(chunks[0]) + b"tail")
    assert status == 400 and "frame 1 " in err["message"]
    status, err = _post(url, "/v1/chunks", encode(chunks[0]), content_type="application/octet-stream")
    assert status == 400 and "application/x-kdn-frames" in err["message"]
    status, err = _post(url, "/v1/chunks", encode(chunks[0]), token="")
    assert status == 401
    status, err = _post(url, "/v1/objects", encode(chunks[0]))            # not an opaque object
    assert status == 400 and "opaque" in err["message"]
    monkeypatch.setattr(serving, "MAX_INGEST_BYTES", 1000)
    status, err = _post(url, "/v1/chunks", encode(chunks[0]))
    assert status == 413 and "at most 1000 bytes" in err["message"]
    assert store.chunk_count == 0                                          # nothing of any was kept
