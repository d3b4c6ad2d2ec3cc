"""Opaque objects in KDN (kdn.integrations.objects) and their frames (kdn.core.chunk's dtype "opaque"):
bytes and checksums round-trip, a corrupt or mis-sized object is never unpacked as good,
frames say "opaque" and never a KV shape, only lossless codecs apply, a forged header is
refused, namespaces separate tenants, layers and models, and bad settings name the field;
loads go in batches, each under the deadline of its keys and bytes, and a batch no edge
answers keeps what arrived. No network (a simulated one at most): the paths through a real
one are in test_lmcache.py and test_sglang.py."""
import numpy as np
import pytest

from kdn.core.chunk import Chunk, Encoded, _frame_prefix, decode, encode, read_header
from kdn.core.errors import (BadConfig, BadHeader, BadLength, BadRequest, ChecksumMismatch, NoLiveEdge,
                             UnknownCodec)
from kdn.core.keys import MAX_FETCH_KEYS
from kdn.core.interfaces import EdgeAPI
from kdn.core.rpc import Stub
from kdn.core.transfer import fetch_deadline_s
from kdn.edge.forms import corrupted
from kdn.integrations.objects import (READ_BATCH_BYTES, READ_BATCH_KEYS, TRAILER, Objects, Tenancy,
                                 check_params, object_key, object_namespace, pack, read_batch,
                                 read_tokens_of, unpack_into)

NS = object_namespace("default", "lmcache", "m")
KEY = object_key(NS, b"host-key")


def data(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.mark.parametrize("n", [1, 1000, (1 << 18) + 3, 3 << 20])
def test_pack_unpack_round_trips_the_bytes(n):
    src = data(n)
    c = pack(KEY, NS, memoryview(src))
    assert c.opaque and c.nbytes == n + TRAILER and c.tokens == 0
    out = bytearray(n)
    assert unpack_into(c, out) and bytes(out) == src.tobytes()
    # the frame's payload checksum, hashed in pack's pass, is the bytes' own: a frame of it
    # carries it unhashed again and decodes as the chunk
    assert not c.kv.flags.writeable and c._xxh == c.digest()
    frame = encode(c)
    assert read_header(frame)[0]["xxh"] == c.digest() and decode(frame).equal(c)


def test_a_corrupt_or_mis_sized_object_is_not_good():
    src = data(5000)
    c = pack(KEY, NS, src)
    out = bytearray(4999)
    assert not unpack_into(c, out)                      # the host asked for another size
    assert not c.kv.flags.writeable                     # keys name contents
    assert not unpack_into(corrupted(c), bytearray(5000))   # a flipped byte: the checksum catches it


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_opaque_frames_say_so_and_round_trip(codec):
    c = pack(KEY, NS, np.zeros(70000, np.uint8))        # compressible
    frame = encode(c, codec)
    header, _ = read_header(frame)
    assert (header["dtype"], header["layers"], header["heads"], header["tokens"],
            header["head_dim"], header["raw"]) == ("opaque", 0, 0, 0, 0, c.nbytes)
    assert decode(frame).equal(c)
    e = Encoded.from_frame(frame)
    assert e.exact and e.decode().equal(c)
    if codec == "zstd":
        assert len(frame) < c.nbytes // 10


@pytest.mark.parametrize("codec", ["q8", "q8z", "k4v3z"])
def test_lossy_codecs_never_apply_to_opaque_bytes(codec):
    with pytest.raises(BadRequest, match="lossy"):
        encode(pack(KEY, NS, data(4096)), codec)


def _forged(**changes) -> bytes:
    c = pack(KEY, NS, data(64))
    fields = {"v": 1, "key": c.key, "ns": c.ns, "layers": 0, "heads": 0, "head_dim": 0, "tokens": 0,
              "dtype": "opaque", "codec": "raw", "nbytes": c.nbytes, "raw": c.nbytes,
              "xxh": 0, **changes}
    return _frame_prefix(fields) + c.kv.tobytes()


@pytest.mark.parametrize("changes, error, match", [
    ({"layers": 2}, BadHeader, "must be 0"),                      # opaque bytes with a KV shape
    ({"codec": "q8z"}, UnknownCodec, "lossy"),
    ({"raw": 0, "nbytes": 0}, BadLength, "raw=0"),
    ({}, ChecksumMismatch, "payload checksum"),                   # xxh 0 is not its checksum
])
def test_forged_opaque_headers_are_refused(changes, error, match):
    with pytest.raises(error, match=match):
        decode(_forged(**changes))


def test_opaque_chunks_hold_one_axis_of_bytes_and_no_kv():
    with pytest.raises(BadRequest, match="1-D uint8"):
        Chunk(KEY, NS, np.zeros((2, 4), np.uint8), "opaque")
    with pytest.raises(BadRequest, match="1-D uint8"):
        Chunk(KEY, NS, np.zeros(4, np.float32), "opaque")
    with pytest.raises(BadRequest, match="not KV"):
        pack(KEY, NS, data(8)).to_layers()


def test_namespaces_separate_tenants_layers_and_models():
    names = {object_namespace(t, layer, m) for t in ("a", "b") for layer in ("lmcache", "sglang")
             for m in ("m1", "m2")}
    assert len(names) == 8
    assert object_key(NS, b"k") != object_key(object_namespace("other", "lmcache", "m"), b"k")


def test_tenancy_maps_salts_to_tenants_never_around_them():
    t = Tenancy("default", {"alice": "tenant-a"})
    assert t.of("") == t.of(None) == "default"
    assert t.of("alice") == "tenant-a"
    assert t.of("bob") == "default~bob" != t.of("carol")      # an unmapped salt: its own tenant
    with pytest.raises(BadConfig, match="'tenants'"):
        Tenancy("default", {"x": 3})


def test_check_params_names_the_field():
    allowed = {"network": (str, "kdn"), "port": (int, 1)}
    assert check_params({"port": 5}, allowed, "p") == {"network": "kdn", "port": 5}
    for bad, field in (({"prot": 5}, "prot"), ({"port": "5"}, "port"), ({"port": True}, "port")):
        with pytest.raises(BadConfig, match=f"'{field}'"):
            check_params(bad, allowed, "p")
    with pytest.raises(BadConfig, match="JSON object"):
        check_params([1], allowed, "p")


def test_read_tokens_name_the_field_of_a_bad_one():
    assert read_tokens_of("acme", "tok-a", {"beta": "tok-b"}, "p") == {"acme": "tok-a", "beta": "tok-b"}
    assert read_tokens_of("acme", None, None, "p") == {}
    with pytest.raises(BadConfig, match="'read_token'"):
        read_tokens_of("acme", "", None, "p")
    with pytest.raises(BadConfig, match="'read_tokens'"):
        read_tokens_of("acme", None, {"beta": 7}, "p")


# --- loads in batches, under deadlines of their work, through a simulated network -------------
class SimulatedEdges:
    """A network view (kdn.client.view's edge()) over edges that hold `held` (key -> Chunk) and
    answer a fetch in `per_key_s` a key, or stall on a key in `stuck` (a hung pull-through):
    an edge slower than the caller's deadline times out and the next is tried, as the real
    view does; none in time is NoLiveEdge. No time passes: the clock is simulated."""

    region, node_id = "eu-west", "node-0"

    def __init__(self, held, per_key_s=0.0024, stuck=(), edges=("eu-west-0", "us-east-0")):
        self.held, self.per_key_s, self.stuck, self.edges = held, per_key_s, set(stuck), edges
        self.asked = []                  # (keys, deadline) of every fetch

    def nearest(self, timeout, resolve_refs=False):
        return Stub(EdgeAPI, lambda m, a, k: self.edge(m, *a, timeout=timeout, **k), "the nearest edge")

    def edge(self, method, keys, ns, *args, timeout, **kw):
        assert method == "fetch" and len(keys) <= MAX_FETCH_KEYS
        self.asked.append((len(keys), timeout))
        took = self.per_key_s * len(keys) + (1e9 if self.stuck & set(keys) else 0)
        if took > timeout:
            raise NoLiveEdge(f"no edge answered fetch (tried {', '.join(self.edges)})")
        chunks = []
        for k in keys:
            if k not in self.held:
                break
            chunks.append(self.held[k])
        reply = {"chunks": chunks, "sources": ["local"] * len(chunks), "codecs": ["raw"] * len(chunks),
                 "wire": [c.nbytes for c in chunks], "more": False, "ring": 0}
        return reply, self.edges[0], []

    def follow(self, ring_version):
        pass


def simulated(n, size=16, **kw):
    """(Objects over SimulatedEdges holding n objects of size bytes, ns, keys, their bytes)."""
    objs = Objects(None, "lmcache")
    ns = objs.namespace("default", "m")
    keys = [object_key(ns, i.to_bytes(4, "little")) for i in range(n)]
    datas = [np.full(size, i % 251, np.uint8) for i in range(n)]
    objs.view = SimulatedEdges({k: pack(k, ns, d) for k, d in zip(keys, datas)}, **kw)
    return objs, ns, keys, datas


def test_a_load_of_the_fetch_limit_meets_its_deadlines():
    """16,384 keys (MAX_FETCH_KEYS), edges healthy but slow at 2.4 ms a key (the worst
    measured for small objects, 2 cores at a load average of 10-15: ~40 s for them all,
    where a fixed 4 s deadline failed over on every edge and loaded nothing): every key
    loads, in batches of READ_BATCH_KEYS, each under its own work's deadline."""
    objs, ns, keys, datas = simulated(MAX_FETCH_KEYS)
    outs = [bytearray(16) for _ in keys]
    assert objs.load(ns, keys, outs) == [True] * MAX_FETCH_KEYS
    assert all(bytes(o) == d.tobytes() for o, d in zip(outs, datas))
    assert objs.counters["loaded"] == MAX_FETCH_KEYS and objs.counters["load_no_edge"] == 0
    asked = objs.view.asked
    assert [n for n, _ in asked] == [READ_BATCH_KEYS] * (MAX_FETCH_KEYS // READ_BATCH_KEYS)
    assert all(t == fetch_deadline_s(n, n * (16 + TRAILER)) for n, t in asked)


def test_a_batch_no_edge_answers_keeps_what_arrived_and_counts_the_rest():
    """Edges stall on one key of the second batch: the first batch's keys load (with their
    bytes), that batch and the rest are reported not loaded and counted load_no_edge."""
    n = 2 * READ_BATCH_KEYS + 500
    objs, ns, keys, datas = simulated(n)
    objs.view.stuck = {keys[READ_BATCH_KEYS + 7]}
    outs = [bytearray(16) for _ in keys]
    got = objs.load(ns, keys, outs)
    assert got == [True] * READ_BATCH_KEYS + [False] * (n - READ_BATCH_KEYS)
    assert all(bytes(o) == d.tobytes() for o, d in zip(outs[:READ_BATCH_KEYS], datas))
    assert objs.counters["load_no_edge"] == n - READ_BATCH_KEYS
    assert objs.counters["loaded"] == READ_BATCH_KEYS
    assert len(objs.view.asked) == 2                # a dead network costs one batch's deadline


def test_a_key_nobody_holds_is_skipped_and_the_rest_load():
    objs, ns, keys, datas = simulated(3000)
    del objs.view.held[keys[2500]]
    outs = [bytearray(16) for _ in keys]
    got = objs.load(ns, keys, outs)
    assert got == [True] * 2500 + [False] + [True] * 499
    assert objs.counters["load_no_edge"] == 0


def test_read_batches_bound_keys_and_bytes():
    sizes = [100] * 5000
    assert read_batch(sizes, list(range(5000))) == READ_BATCH_KEYS
    assert read_batch(sizes, list(range(10))) == 10
    big = [8 << 20] * 100                            # 8 MiB objects: 64 a batch (512 MiB)
    n = read_batch(big, list(range(100)))
    assert n * ((8 << 20) + TRAILER) <= READ_BATCH_BYTES < (n + 1) * ((8 << 20) + TRAILER)
    assert read_batch([2 * READ_BATCH_BYTES], [0]) == 1     # one larger than a batch still goes


# --- stores reuse their pack buffers ------------------------------------------------------------
class RecordingEdge:
    """A network view whose nearest edge takes put_objects as Ray does: the arguments' bytes are
    copied when the call is sent (so a caller's buffers are free once it answers)."""

    region = "eu-west"

    def __init__(self, fail=False):
        self.sent, self.buffers, self.fail = [], [], fail

    def nearest(self, timeout, resolve_refs=False):
        return Stub(EdgeAPI, self.call, "the nearest edge")

    def writes(self, token=None):
        """Writes to the origin over Ray (kdn/client/ingest.py): this view's origin()."""
        from kdn.client.ingest import OriginWrites
        return OriginWrites(self, "ray", None, None, token)

    def call(self, method, args, kw):
        assert method == "put_objects"
        chunks = args[0]
        self.buffers.append([c.kv.__array_interface__["data"][0] for c in chunks])
        self.sent.append([c.kv.tobytes() for c in chunks])       # Ray's copy into its store
        if self.fail:
            raise NoLiveEdge("no edge answered put_objects")
        return {"received": len(chunks), "pending": len(chunks)}, "eu-west-0", []


def test_a_store_packs_into_the_buffers_of_the_one_before_and_sends_each_its_own_bytes():
    objs = Objects(None, "lmcache")
    objs.view = RecordingEdge()
    ns = objs.namespace("default", "m")
    keys = [(ns, object_key(ns, bytes([i]))) for i in range(3)]
    first, second = [data(5000, seed=i) for i in range(3)], [data(5000, seed=10 + i) for i in range(3)]
    assert objs.store(keys, first) == objs.store(keys, second) == 3 * 5000
    sent = objs.view.sent
    assert [b[:-TRAILER] for b in sent[0]] == [d.tobytes() for d in first]
    assert [b[:-TRAILER] for b in sent[1]] == [d.tobytes() for d in second]
    for call in sent:                            # each with its own checksum
        assert all(unpack_into(pack(k, ns, b[:-TRAILER]), bytearray(5000)) for (_, k), b in zip(keys, call))
    assert sorted(objs.view.buffers[1]) == sorted(objs.view.buffers[0])      # the same memory again
    smaller = [data(1000, seed=20)]                  # fills under half of a kept buffer: new memory
    objs.store(keys[:1], smaller)
    assert objs.view.buffers[2][0] not in objs.view.buffers[0]


def test_a_store_that_fails_gives_its_buffers_back_and_the_spare_ones_stay_bounded():
    from kdn.core.interfaces import OriginAPI
    from kdn.core.rpc import Unreachable
    from kdn.integrations import objects as mod
    objs = Objects(None, "lmcache")
    objs.view = RecordingEdge(fail=True)                 # no edge answers: the origin is asked
    objs._spare = mod._Spare(limit=2 * (5000 + TRAILER))

    def origin(method, args, kw):
        raise Unreachable("the origin did not answer put_objects")
    objs.view.origin = lambda timeout: Stub(OriginAPI, origin, "the origin")
    ns = objs.namespace("default", "m")
    keys = [(ns, object_key(ns, bytes([i]))) for i in range(3)]
    with pytest.raises(Unreachable, match="did not answer put_objects"):
        objs.store(keys, [data(5000, seed=i) for i in range(3)])
    assert objs._spare.bytes == 3 * (5000 + TRAILER)       # given back: one batch's, past the limit
    objs.view.fail = False
    assert objs.store(keys, [data(5000, seed=i) for i in range(3)]) == 3 * 5000
    assert sorted(objs.view.buffers[1]) == sorted(objs.view.buffers[0])      # all three kept, reused
    more = [(ns, object_key(ns, bytes([i]))) for i in range(6)]
    assert objs.store(more, [data(5000, seed=i) for i in range(6)]) == 6 * 5000
    assert objs._spare.bytes == 4 * (5000 + TRAILER)       # never more than twice the limit


def test_a_full_batch_of_power_of_two_objects_keeps_every_buffer():
    """32 x 8 MiB is one batch 256 bytes over PUT_BATCH_BYTES (the trailers): every buffer is
    kept for the next store, none written anew (the limit alone dropped one a batch)."""
    from kdn.integrations import objects as mod
    spare = mod._Spare()
    bufs = [spare.take((8 << 20) + TRAILER) for _ in range(32)]
    assert sum(b.nbytes for b in bufs) > mod.SPARE_BYTES
    spare.give(bufs)
    again = [spare.take((8 << 20) + TRAILER) for _ in range(32)]
    assert sorted(map(id, again)) == sorted(map(id, bufs)) and spare.bytes == 0
