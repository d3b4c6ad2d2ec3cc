"""Chunk layout, torch views, and the frame codec: exact round trips, hostile input refused."""
import mmap
import struct

import msgpack
import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as st

from kdn.core import chunk as C
from kdn.core.chunk import (DTYPES, MAX_PAYLOAD, Chunk, decode, encode, encode_into, encode_parts,
                            frame_size, read_header, register_codec)
from kdn.core.errors import (BadHeader, BadLength, BadRequest, ChecksumMismatch, FrameError,
                             KDNError, SizeLimitExceeded, TruncatedFrame, UnknownCodec, UnknownDtype,
                             UnknownVersion)
from kdn.core.dtypes import torch_dtype
from kdn.core.keys import chunk_keys, namespace_digest

NS = namespace_digest("acme", "tiny-model:0001")
KEY = chunk_keys(list(range(256)), NS)[0]
TORCH = {name: torch_dtype(name) for name in DTYPES}


def kv_tensor(layers=2, heads=3, tokens=5, head_dim=4, dtype="float32", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, tokens, head_dim, generator=g).to(TORCH[dtype])


def small_chunk(dtype="float32", **kw):
    return Chunk.from_torch(KEY, NS, kv_tensor(dtype=dtype, **kw))


def storage_ptr_range(arr):
    return arr.ctypes.data, arr.ctypes.data + arr.nbytes


def craft(fields, payload=b"", drop=(), **changes):
    """A frame whose header has these changes but a valid header checksum."""
    body = dict(fields, **changes)
    for name in drop:
        body.pop(name)
    return C._frame_prefix(body) + bytes(payload)


def good_fields(chunk, payload):
    return C._header_fields(chunk, "raw", len(payload), xxhash.xxh3_64_intdigest(payload))


# --- layout and torch views ------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_from_torch_shares_memory_and_round_trips(dtype):
    t = kv_tensor(dtype=dtype)
    c = Chunk.from_torch(KEY, NS, t)
    assert (c.layers, c.kv_heads, c.tokens, c.head_dim) == (2, 3, 5, 4)
    assert c.nbytes == 2 * 2 * 3 * 5 * 4 * DTYPES[dtype][2] and c.kv.dtype == DTYPES[dtype][0]
    back = c.to_torch()
    assert back.dtype == TORCH[dtype] and torch.equal(back, t)
    assert back.data_ptr() == t.data_ptr() == c.kv.ctypes.data          # no copy either way
    k, v = c.layer(1)
    assert k.shape == v.shape == (1, 3, 5, 4) and k.dtype == TORCH[dtype]
    assert torch.equal(k[0], t[1, 0]) and torch.equal(v[0], t[1, 1])
    lo, hi = storage_ptr_range(c.kv)
    assert lo <= k.data_ptr() < hi and lo <= v.data_ptr() < hi
    k.fill_(0)                                                          # a view: writes show in kv
    assert torch.count_nonzero(c.to_torch()[1, 0]) == 0


def test_layer_views_feed_torch_attention_ops():
    c = small_chunk("bfloat16", tokens=6)
    k, v = c.layer(-1)
    q = torch.randn(1, 3, 1, 4, dtype=torch.bfloat16)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.shape == (1, 3, 1, 4) and torch.isfinite(out.float()).all()
    grown = torch.cat([k, torch.zeros(1, 3, 1, 4, dtype=k.dtype)], dim=2)   # cache append
    assert grown.shape == (1, 3, 7, 4)
    assert [tuple(x.shape) for pair in c.to_layers() for x in pair] == [(1, 3, 6, 4)] * 4


def test_from_torch_copies_only_when_needed():
    base = kv_tensor(tokens=6, head_dim=4)
    strided = base.transpose(3, 4).contiguous().transpose(3, 4)        # same values, not contiguous
    assert not strided.is_contiguous()
    c = Chunk.from_torch(KEY, NS, strided)
    assert torch.equal(c.to_torch(), base) and c.kv.flags.c_contiguous
    g = kv_tensor().requires_grad_(True)
    assert torch.equal(Chunk.from_torch(KEY, NS, g).to_torch(), g.detach())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_from_layers_both_shapes(dtype):
    t = kv_tensor(layers=3, dtype=dtype)
    four_d = [(t[i, 0].unsqueeze(0), t[i, 1].unsqueeze(0)) for i in range(3)]
    three_d = [[t[i, 0], t[i, 1]] for i in range(3)]
    expect = Chunk.from_torch(KEY, NS, t.clone())
    assert Chunk.from_layers(KEY, NS, four_d).equal(expect)
    assert Chunk.from_layers(KEY, NS, three_d).equal(expect)
    assert Chunk.from_layers(KEY, NS, expect.to_layers()).equal(expect)


@pytest.mark.parametrize("layers,needle", [
    ([], "at least one"),
    ([(torch.zeros(1, 2, 3, 4),)], "not a \\(k, v\\) pair"),
    ([(torch.zeros(1, 2, 3, 4), np.zeros((1, 2, 3, 4)))], "not a \\(k, v\\) pair"),
    ([(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 3, 4))], "\\[1, heads, T, hd\\]"),
    ([(torch.zeros(2, 3, 4, dtype=torch.float64),) * 2], "float64"),
    ([(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))], "layer 0 v is \\(2, 3, 5\\)"),
    ([(torch.zeros(2, 3, 4),) * 2, (torch.zeros(2, 3, 4, dtype=torch.float16),) * 2],
     "layer 1 k is \\(2, 3, 4\\) torch.float16, expected .* torch.float32"),
])
def test_from_layers_refuses_mismatches(layers, needle):
    with pytest.raises(BadRequest, match=needle):
        Chunk.from_layers(KEY, NS, layers)


@pytest.mark.parametrize("make,needle", [
    (lambda: Chunk(b"short", NS, np.zeros((1, 2, 1, 1, 1), "<f4"), "float32"),
     "key must be 16 bytes"),
    (lambda: Chunk(KEY, None, np.zeros((1, 2, 1, 1, 1), "<f4"), "float32"), "ns must be 16 bytes"),
    (lambda: Chunk(KEY, NS, np.zeros((1, 2, 1, 1, 1), "<f4"), "int8"), "dtype 'int8'"),
    (lambda: Chunk(KEY, NS, np.zeros((1, 3, 1, 1, 1), "<f4"), "float32"), "got shape \\(1, 3"),
    (lambda: Chunk(KEY, NS, np.zeros((1, 2, 0, 1, 1), "<f4"), "float32"), "no empty axis"),
    (lambda: Chunk(KEY, NS, np.zeros((1, 2, 1, 1, 1), "<f2"), "float32"), "stored as float32"),
    (lambda: Chunk(KEY, NS, np.zeros((1, 2, 2, 2, 2), "<f4")[:, :, :, ::-1], "float32"),
     "C-contiguous"),
    (lambda: Chunk(KEY, NS, [[0.0]], "float32"), "numpy array"),
    (lambda: Chunk.from_torch(KEY, NS, torch.zeros(1, 2, 1, 1, 1, dtype=torch.float64)), "float64"),
    (lambda: Chunk.from_torch(KEY, NS, torch.zeros(2, 1, 1, 1)), "got \\(2, 1, 1, 1\\)"),
    (lambda: small_chunk().layer(2), r"layer must be an int in \[-2, 1\] \(a chunk of 2 layers\), got 2"),
])
def test_chunk_validation(make, needle):
    with pytest.raises(BadRequest, match=needle):
        make()


def test_equal_compares_bits():
    a = small_chunk()
    b = Chunk.from_torch(KEY, NS, a.to_torch().clone())
    assert a.equal(b) and not a.equal("x")
    b.kv.reshape(-1)[7] = np.nextafter(b.kv.reshape(-1)[7], np.float32(9))
    assert not a.equal(b)
    nan = np.full((1, 2, 1, 1, 1), np.nan, "<f4")
    assert Chunk(KEY, NS, nan, "float32").equal(Chunk(KEY, NS, nan.copy(), "float32"))
    other_key = Chunk(bytes(16), NS, a.kv, "float32")
    assert not a.equal(other_key) and not a.equal(Chunk(KEY, bytes(16), a.kv, "float32"))


# --- round trips -----------------------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dtype=st.sampled_from(list(DTYPES)), layers=st.integers(1, 4), heads=st.integers(1, 4),
       tokens=st.integers(1, 17), head_dim=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
def test_codec_round_trip_is_exact(dtype, layers, heads, tokens, head_dim, seed):
    storage = DTYPES[dtype][0]
    shape = (layers, 2, heads, tokens, head_dim)
    rng = np.random.default_rng(seed)
    # any bit pattern, NaNs and infinities included, must come back bit for bit
    kv = np.frombuffer(rng.bytes(int(np.prod(shape)) * storage.itemsize), storage).reshape(shape)
    c = Chunk(KEY, NS, kv.copy(), dtype)
    frame = encode(c)
    header, off = read_header(frame)
    assert off % 64 == 0 and frame_size(header, off) == len(frame)
    assert header["raw"] == header["nbytes"] == kv.nbytes and header["dtype"] == dtype
    d = decode(frame)
    assert d.equal(c) and d.kv.tobytes() == kv.tobytes() and d.dtype == dtype
    assert torch.equal(d.to_torch().view(torch.uint8), c.to_torch().view(torch.uint8))
    assert b"".join(bytes(p) for p in encode_parts(c)) == frame
    buf = bytearray(len(frame) + 5)
    assert encode_into(c, buf) == len(frame) and bytes(buf[:len(frame)]) == frame
    assert encode(d) == frame                                   # re-encoding is stable


def test_decode_is_zero_copy_over_every_buffer_kind(tmp_path):
    c = small_chunk("float16")
    frame = encode(c)
    for buf in (frame, bytearray(frame), memoryview(frame), np.frombuffer(frame, np.uint8)):
        d = decode(buf)
        assert d.equal(c)
        assert np.shares_memory(d.kv, np.frombuffer(buf, np.uint8))
        lo, hi = storage_ptr_range(np.frombuffer(buf, np.uint8))
        k, v = d.layer(0)
        assert lo <= k.data_ptr() < hi and lo <= v.data_ptr() < hi
    assert not decode(frame).kv.flags.writeable                # over bytes: read-only
    assert decode(bytearray(frame)).kv.flags.writeable
    path = tmp_path / "chunk.kdnc"
    path.write_bytes(frame)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        d = decode(m)
        assert d.equal(c) and np.shares_memory(d.kv, np.frombuffer(m, np.uint8))
        del d


def test_encode_parts_do_not_copy_the_payload():
    c = small_chunk()
    prefix, payload = encode_parts(c)
    assert isinstance(prefix, bytes) and prefix[:4] == b"KDNC" and len(prefix) % 64 == 0
    assert np.shares_memory(np.frombuffer(payload, np.uint8), c.kv)
    assert struct.unpack_from("<I", prefix, 4)[0] == len(prefix) - 8


def test_frames_stream_with_read_header_and_frame_size():
    chunks = [small_chunk(dt, seed=i) for i, dt in enumerate(DTYPES)]
    stream = b"".join(encode(c) for c in chunks)
    pos, out = 0, []
    while pos < len(stream):
        header, off = read_header(memoryview(stream)[pos:])
        size = frame_size(header, off)
        out.append(decode(memoryview(stream)[pos:pos + size]))
        pos += size
    assert all(a.equal(b) for a, b in zip(out, chunks)) and len(out) == 3
    header, off = read_header(stream)                     # reads the first, ignores the rest
    assert set(header) == {"v", "key", "ns", "layers", "heads", "head_dim", "tokens", "dtype",
                           "codec", "nbytes", "raw", "xxh"}
    assert header["key"] == KEY and header["ns"] == NS and header["v"] == 1
    with pytest.raises(TruncatedFrame, match="ends inside its header"):
        read_header(stream[:off - 1])


def test_decoded_chunk_reencodes_without_hashing(monkeypatch):
    frame = encode(small_chunk())
    d = decode(frame)
    calls = []
    real = C.xxhash.xxh3_64_intdigest
    monkeypatch.setattr(C.xxhash, "xxh3_64_intdigest", lambda b: calls.append(1) or real(b))
    assert encode(d) == frame and calls == []
    mutable = decode(bytearray(frame))                    # could change under us: hash again
    calls.clear()
    assert encode(mutable) == frame and calls == [1]


# --- hostile and damaged frames --------------------------------------------------------
def test_every_truncation_raises_truncated_frame():
    frame = encode(small_chunk(layers=1, heads=1, tokens=3, head_dim=2))
    for n in range(len(frame)):
        with pytest.raises(TruncatedFrame) as e:
            decode(frame[:n])
        assert "ends inside" in str(e.value)


def test_every_single_byte_flip_is_caught_exhaustively():
    frame = encode(small_chunk("bfloat16", layers=1, heads=1, tokens=3, head_dim=2))
    for i in range(len(frame)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(frame)
            bad[i] ^= mask
            with pytest.raises(FrameError):
                decode(bytes(bad))


@settings(max_examples=150, deadline=None)
@given(pos=st.integers(0, 10**9), mask=st.integers(1, 255), dtype=st.sampled_from(list(DTYPES)))
def test_random_byte_flips_are_caught(pos, mask, dtype):
    frame = FRAMES[dtype]
    bad = bytearray(frame)
    bad[pos % len(frame)] ^= mask
    with pytest.raises(FrameError) as e:
        decode(bytes(bad))
    assert str(e.value)


FRAMES = {dt: encode(small_chunk(dt, layers=3, heads=2, tokens=16, head_dim=8)) for dt in DTYPES}


@settings(max_examples=80, deadline=None)
@given(cut=st.integers(0, 10**9), dtype=st.sampled_from(list(DTYPES)))
def test_random_truncations_are_caught(cut, dtype):
    frame = FRAMES[dtype]
    with pytest.raises(TruncatedFrame):
        decode(frame[:cut % len(frame)])


def test_checksums_name_the_problem():
    frame = bytearray(encode(small_chunk()))
    frame[-1] ^= 0x10
    with pytest.raises(ChecksumMismatch, match="payload checksum mismatch for chunk " + KEY.hex()):
        decode(bytes(frame))
    assert decode(bytes(frame), verify=False).kv.tobytes()[-1] != small_chunk().kv.tobytes()[-1]
    frame = bytearray(encode(small_chunk()))
    _, off = read_header(frame)
    frame[off - 1] ^= 0x10                                     # inside hx itself
    with pytest.raises(ChecksumMismatch, match="frame header checksum mismatch"):
        decode(bytes(frame))


def test_trailing_bytes_are_refused():
    frame = encode(small_chunk())
    with pytest.raises(BadLength, match="3 bytes follow the frame's end"):
        decode(frame + b"abc")


@pytest.mark.parametrize("change,exc,needle", [
    (dict(v=2), UnknownVersion, "version 2 is not 1"),
    (dict(v="1"), BadHeader, "'v' must be int, got str"),
    (dict(dtype="int4"), UnknownDtype, "dtype 'int4' is not one of float32, float16, bfloat16"),
    (dict(dtype=7), BadHeader, "'dtype' must be str"),
    (dict(codec="lz77"), UnknownCodec, "codec 'lz77' is not registered"),
    (dict(layers=5000), SizeLimitExceeded, "layers=5000, over the limit 4096"),
    (dict(heads=2**40), SizeLimitExceeded, "heads=1099511627776"),
    (dict(head_dim=10**6), SizeLimitExceeded, "head_dim=1000000"),
    (dict(tokens=70000), SizeLimitExceeded, "tokens=70000"),
    (dict(tokens=0), BadHeader, "'tokens' must be >= 1, got 0"),
    (dict(layers=-3), BadHeader, "'layers' must be >= 1"),
    (dict(layers=True), BadHeader, "'layers' must be int, got bool"),
    (dict(layers=4096, heads=1024, tokens=65536, head_dim=4096), SizeLimitExceeded,
     "the limit is 1073741824"),
    (dict(nbytes=2**31), SizeLimitExceeded, "payload of 2147483648 bytes"),
    (dict(raw=479), BadLength, "raw=479 bytes but its shape"),
    (dict(nbytes=100), BadLength, "nbytes=100 but raw=480"),
    (dict(tokens=6), BadLength, "raw=480 bytes but its shape \\(2x2x3x6x4 float16\\) is 576"),
    (dict(key=b"k" * 15), BadHeader, "'key' must be 16 bytes, got 15"),
    (dict(ns="x" * 16), BadHeader, "'ns' must be bytes, got str"),
    (dict(xxh=-1), BadHeader, "xxh=-1 is not a uint64"),
    (dict(xxh=1.5), BadHeader, "'xxh' must be int, got float"),
])
def test_bad_header_fields(change, exc, needle):
    c = small_chunk("float16")
    payload = c.kv.tobytes()
    with pytest.raises(exc, match=needle):
        decode(craft(good_fields(c, payload), payload, **change))


@pytest.mark.parametrize("name", ["v", "key", "ns", "layers", "heads", "head_dim", "tokens",
                                  "dtype", "codec", "nbytes", "raw", "xxh"])
def test_missing_fields(name):
    c = small_chunk()
    payload = c.kv.tobytes()
    with pytest.raises(BadHeader, match=f"lacks field '{name}'"):
        decode(craft(good_fields(c, payload), payload, drop=(name,)))


def test_malformed_prefixes():
    frame = encode(small_chunk())
    with pytest.raises(BadHeader, match="not a KDN chunk frame: starts b'KDNX'"):
        decode(b"KDNX" + frame[4:])
    with pytest.raises(BadHeader, match="not a KDN chunk frame"):
        decode(b"PK")
    with pytest.raises(TruncatedFrame):
        decode(b"")
    with pytest.raises(SizeLimitExceeded, match="header length 4097 exceeds 4096"):
        decode(b"KDNC" + struct.pack("<I", 4097) + bytes(5000))
    with pytest.raises(BadLength, match="header length 3 is too short"):
        decode(b"KDNC" + struct.pack("<I", 3) + bytes(100))
    junk = b"\xc1" * 40                                       # 0xc1 is never valid msgpack
    with pytest.raises(BadHeader, match="not valid msgpack"):
        decode(b"KDNC" + struct.pack("<I", len(junk)) + junk)
    lst = msgpack.packb([1, 2, 3] + [0] * 20)
    with pytest.raises(BadHeader, match="is a list, not a map"):
        decode(b"KDNC" + struct.pack("<I", len(lst)) + lst)
    no_hx = msgpack.packb({"v": 1, "pad": bytes(30)})
    with pytest.raises(BadHeader, match="does not end with its checksum field 'hx'"):
        decode(b"KDNC" + struct.pack("<I", len(no_hx)) + no_hx)
    for bad in ("text", 42, None, memoryview(frame)[::2]):
        with pytest.raises(BadRequest):
            decode(bad)


def test_max_payload_is_enforced():
    frame = encode(small_chunk())
    with pytest.raises(SizeLimitExceeded, match="the limit is 100"):
        decode(frame, max_payload=100)
    with pytest.raises(SizeLimitExceeded, match="the limit is 100"):
        read_header(frame, max_payload=100)
    assert MAX_PAYLOAD == 1 << 30


def test_encode_refuses_what_decode_would_refuse():
    tall = Chunk(KEY, NS, np.zeros((4097, 2, 1, 1, 1), "<f2"), "float16")
    with pytest.raises(SizeLimitExceeded, match="layers 4097 exceeds the frame limit 4096"):
        encode(tall)
    with pytest.raises(UnknownCodec, match="codec 'nope' is not registered"):
        encode(small_chunk(), codec="nope")
    with pytest.raises(BadRequest, match="too small for a"):
        encode_into(small_chunk(), bytearray(10))
    with pytest.raises(BadRequest, match="writable"):
        encode_into(small_chunk(), bytes(10_000))


def test_errors_are_kdn_errors():
    for exc in (TruncatedFrame, BadLength, UnknownVersion, UnknownDtype, UnknownCodec,
                SizeLimitExceeded, BadHeader, ChecksumMismatch):
        assert issubclass(exc, FrameError) and issubclass(exc, KDNError)


def test_rejections_are_counted():
    before = dict(C.counters)
    decode(encode(small_chunk()))
    with pytest.raises(TruncatedFrame):
        decode(b"KDNC")
    assert C.counters["decoded"] == before["decoded"] + 1
    assert C.counters["rejected"] == before["rejected"] + 1
    assert C.counters["encoded"] == before["encoded"] + 1


# --- pluggable codecs ------------------------------------------------------------------
def _rev_encode(kv, dtype):
    return kv.tobytes()[::-1]


def _rev_decode(payload, header):
    shape = (header["layers"], 2, header["heads"], header["tokens"], header["head_dim"])
    data = bytes(payload)[::-1]
    return np.frombuffer(data, DTYPES[header["dtype"]][0]).reshape(shape).copy()


def _broken_decode(payload, header):
    raise ValueError("bad block")


def _short_decode(payload, header):
    return np.zeros(3, DTYPES[header["dtype"]][0])


register_codec("test-reverse", _rev_encode, _rev_decode)
register_codec("test-broken", _rev_encode, _broken_decode)
register_codec("test-short", _rev_encode, _short_decode)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_registered_codec_round_trips(dtype):
    c = small_chunk(dtype)
    frame = encode(c, codec="test-reverse")
    header, off = read_header(frame)
    assert header["codec"] == "test-reverse" and bytes(frame[off:]) == c.kv.tobytes()[::-1]
    assert decode(frame).equal(c)
    assert "raw" in C.codecs() and "test-reverse" in C.codecs()


def test_codec_failures_are_frame_errors():
    c = small_chunk()
    with pytest.raises(FrameError, match="codec 'test-broken' cannot decode .*bad block"):
        decode(encode(c, codec="test-broken"))
    with pytest.raises(BadLength, match="codec 'test-short' returned \\(3,\\)"):
        decode(encode(c, codec="test-short"))


def test_register_codec_validates():
    register_codec("test-reverse", _rev_encode, _rev_decode)          # same fns: idempotent
    with pytest.raises(BadRequest, match="already registered"):
        register_codec("raw", _rev_encode, _rev_decode)
    with pytest.raises(BadRequest, match="1..32 characters"):
        register_codec("", _rev_encode, _rev_decode)
    with pytest.raises(BadRequest, match="callable"):
        register_codec("test-x", None, _rev_decode)


# --- one interface for Chunk and Encoded ---------------------------------------------------
def _kv(seed=0, tokens=16):
    return np.random.default_rng(seed).standard_normal((2, 2, 2, tokens, 8)).astype(np.float32)


@pytest.mark.parametrize("codec", ["raw", "zstd", "q8z"])
def test_chunk_and_encoded_answer_the_same_questions(codec):
    from kdn.core.chunk import Encoded
    c = Chunk(KEY, NS, _kv(), "float32")
    e = Encoded.of(c, codec)
    for obj in (c, e):
        assert (obj.key, obj.ns, obj.dtype, obj.raw) == (KEY, NS, "float32", c.nbytes)
    assert (c.codec, c.exact, c.decode() is c) == ("raw", True, True)
    assert e.codec == codec and e.exact == (codec != "q8z")
    assert e.nbytes == e.frame.nbytes
    back = e.decode()
    assert back.key == KEY and back.kv.shape == c.kv.shape
    if e.exact:
        assert back.equal(c)


def test_verify_checks_the_manifest_sum_for_exact_kv_only():
    from kdn.core.chunk import Encoded
    c = Chunk(KEY, NS, _kv(), "float32")
    good, wrong = c.digest(), c.digest() ^ 1
    c.verify(good)
    c.verify(None)                                  # nothing to check a bare array against
    with pytest.raises(ChecksumMismatch, match="manifest says"):
        c.verify(wrong)
    z = Encoded.of(c, "zstd")
    z.verify(good)
    with pytest.raises(ChecksumMismatch):
        z.verify(wrong)                             # exact: decoded and compared
    lossy = Encoded.of(c, "q8z")
    lossy.verify(wrong)                             # lossy: not the published KV, by design
    frame = np.array(lossy.frame, copy=True)
    frame[-3] ^= 0xFF
    bad = Encoded(lossy.key, lossy.ns, lossy.codec, lossy.dtype, lossy.raw, lossy.exact, frame)
    with pytest.raises(ChecksumMismatch):
        bad.verify(None)                            # its own frame checksum still holds it


def test_header_bytes_says_when_a_frame_header_can_be_read():
    from kdn.core.chunk import header_bytes, read_header
    frame = encode(Chunk(b"k" * 16, b"n" * 16, np.zeros((1, 2, 1, 4, 2), np.float32), "float32"))
    need = header_bytes(frame)
    assert [header_bytes(frame[:i]) for i in range(8)] == [None] * 8
    assert header_bytes(frame[:8]) == need and 8 < need < len(frame)
    header, off = read_header(frame[:need])              # exactly enough
    assert off == need and header["tokens"] == 4
