"""KV codecs (kdn/core/codecs.py): exact lossless round trips, bounded lossy error, never larger
than raw, corrupt and malformed payloads refused with their error, per-link choice, store."""
import numpy as np
import pytest

from kdn.core import codecs as kc
from kdn.core.chunk import (DTYPES, Chunk, _frame_prefix, _header_fields, codecs, decode, encode,
                            encode_parts)
from kdn.core.errors import ChecksumMismatch, FrameError, StoreError
from kdn.core.keys import chunk_keys, namespace_digest
from kdn.origin.store import ChunkStore

NS = namespace_digest("t", "codecs")
KEY = chunk_keys(range(8), NS)[0]


def kv_like(shape, dtype, seed=0):
    """KV-like floats: channels of different scales (outlier channels), a few larger tokens."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    x *= rng.uniform(0.2, 4.0, size=shape[-1]).astype(np.float32)
    x[:, :, :, ::17] *= 3
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(DTYPES[dtype][0])


def as_f32(kv, dtype):
    if dtype == "bfloat16":
        return (kv.astype(np.uint32) << 16).view(np.float32)
    return kv.astype(np.float32)


def test_codecs_are_registered_in_every_reader():
    assert set(kc.LOSSLESS + kc.LOSSY) | {"raw"} <= set(codecs())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lossless_round_trip_is_exact_and_smaller(dtype):
    chunk = Chunk(KEY, NS, kv_like((3, 2, 2, 100, 64), dtype), dtype)
    frame = encode(chunk, "zstd")
    back = decode(frame)
    assert back.equal(chunk)
    assert len(frame) < len(encode(chunk, "raw"))         # the exponent plane compresses


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lossless_never_larger_than_raw_on_noise(dtype):
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 256, size=4 * 2 * 2 * 64 * 32 * DTYPES[dtype][2], dtype=np.uint8)
    kv = bits.view(DTYPES[dtype][0]).reshape(4, 2, 2, 64, 32)    # NaNs and infs included
    chunk = Chunk(KEY, NS, kv, dtype)
    prefix, payload = encode_parts(chunk, "zstd")
    assert payload.nbytes == chunk.nbytes                  # stored as the raw bytes
    assert decode(prefix + bytes(payload)).equal(chunk)


@pytest.mark.parametrize("codec", kc.LOSSY)
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_lossy_error_is_within_half_a_step(codec, dtype):
    # tokens 100 = one full key group + a tail; head_dim 80 = one full value group + a tail
    kv = kv_like((2, 2, 3, 100, 80), dtype, seed=2)
    chunk = Chunk(KEY, NS, kv, dtype)
    frame = encode(chunk, codec)
    back = decode(frame)
    assert back.kv.shape == kv.shape and back.kv.dtype == kv.dtype
    x, y = as_f32(kv, dtype), as_f32(back.kv, dtype)
    kbits, vbits, _, kg, vg = kc.QUANTIZED[codec]
    out_eps = {"float32": 1e-6, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}[dtype]
    for kind, axis, group, bits in ((0, 2, kg, kbits), (1, 3, vg, vbits)):
        levels = (1 << bits) - 1
        a, b = x[:, kind], y[:, kind]
        for start in range(0, a.shape[axis], group):
            sl = (slice(None),) * axis + (slice(start, start + group),)
            g, h = a[sl], b[sl]
            span = g.max(axis=axis, keepdims=True) - g.min(axis=axis, keepdims=True)
            bound = span / levels / 2 * 1.01 + 1e-3 * np.abs(g).max() / levels + out_eps * np.abs(g)
            assert (np.abs(g - h) <= bound).all(), (codec, dtype, kind, start)
    assert len(frame) < chunk.nbytes * (max(kbits, vbits) + 2) / (8 * DTYPES[dtype][2])


def test_entropy_coded_levels_decode_to_the_same_tensor():
    chunk = Chunk(KEY, NS, kv_like((2, 2, 2, 256, 64), "float32", seed=3), "float32")
    for plain, coded in (("q8", "q8z"), ("q4", "q4z")):
        a, b = encode(chunk, plain), encode(chunk, coded)
        assert np.array_equal(decode(a).kv, decode(b).kv)
        assert len(b) < len(a)


@pytest.mark.parametrize("codec", kc.LOSSY)
def test_lossy_keeps_non_finite_kv_exact(codec):
    kv = kv_like((2, 2, 1, 16, 8), "float32")
    kv[1, 1, 0, 3, 5] = np.inf
    kv[0, 0, 0, 0, 0] = np.nan
    chunk = Chunk(KEY, NS, kv, "float32")
    prefix, payload = encode_parts(chunk, codec)
    assert payload.nbytes == chunk.nbytes
    assert decode(prefix + bytes(payload)).equal(chunk)


def test_tiny_chunk_falls_back_to_raw():
    chunk = Chunk(KEY, NS, kv_like((1, 2, 1, 1, 2), "float32"), "float32")
    for codec in kc.LOSSY + kc.LOSSLESS:
        _, payload = encode_parts(chunk, codec)
        assert payload.nbytes == chunk.nbytes


@pytest.mark.parametrize("codec", ["zstd", "q4z", "q8"])
def test_corrupt_compressed_payload_fails_its_checksum(codec):
    frame = bytearray(encode(Chunk(KEY, NS, kv_like((2, 2, 2, 64, 64), "float16"), "float16"), codec))
    frame[-7] ^= 0x10
    with pytest.raises(ChecksumMismatch, match="payload checksum mismatch"):
        decode(bytes(frame))


def framed(chunk, codec, payload):
    """A frame whose checksums are right for an arbitrary payload."""
    import xxhash
    fields = _header_fields(chunk, codec, len(payload), xxhash.xxh3_64_intdigest(payload))
    return _frame_prefix(fields) + bytes(payload)


@pytest.mark.parametrize("codec,mangle,message", [
    ("zstd", lambda p: b"XX" + p[2:], "expected b'KZ'"),
    ("zstd", lambda p: p[:3], "shorter than its"),
    ("zstd", lambda p: p[:-5], "runs past"),
    ("zstd", lambda p: p + b"\0", "after its last plane"),
    ("q4", lambda p: p[:-1], "needs"),
    ("q8", lambda p: p[:2] + b"\x07" + p[3:], "expected b'KQ' v1"),
    ("q4", lambda p: p[:3] + b"\x08" + p[4:], "declares 8-bit keys"),
    ("q4z", lambda p: p[:12] + bytes(len(p) - 12), "zstd data"),
    ("q4", lambda p: p[:10] + b"\x40\x00" + p[12:], "declares 64 exact tokens in a 64-token chunk"),
    ("q4", lambda p: p[:11], "shorter than its 12-byte v2 header"),
    # scales for 2 layers x 2 heads (1 key group of 128 tokens x 64 channels, 64 value tokens),
    # one exact token (2 x 2 x 2 x 64 fp16), then every level 15: fine for 4-bit keys, not
    # for 3-bit values
    ("k4v3z", lambda p: p[:12] + __import__("zstandard").compress(
        bytes(4 * 256 + 4 * 256 + 2 * 512) + b"\x0f" * (2 * 2 * 2 * 64 * 64)),
     "level 15 in its values, over the 3-bit maximum 7"),
])
def test_malformed_payload_with_valid_checksum_is_refused(codec, mangle, message):
    chunk = Chunk(KEY, NS, kv_like((2, 2, 2, 64, 64), "float32", seed=4), "float32")
    _, payload = encode_parts(chunk, codec)
    bad = mangle(bytes(payload))
    assert len(bad) != chunk.nbytes
    with pytest.raises(kc.BadPayload, match=message) as info:
        decode(framed(chunk, codec, bad))
    assert isinstance(info.value, FrameError)


@pytest.mark.parametrize("codec", ["zstd", "q8z"])
def test_store_with_codec_round_trip(tmp_path, codec):
    store = ChunkStore(tmp_path / codec, fsync=False, codec=codec)
    chunk = Chunk(KEY, NS, kv_like((3, 2, 2, 128, 64), "float32", seed=5), "float32")
    assert store.put(chunk)
    got = store.get(KEY)
    if codec == "zstd":
        assert got.equal(chunk)
    else:
        assert np.abs(got.kv - chunk.kv).max() <= np.ptp(chunk.kv) / 255
    assert store.size_of(KEY) < chunk.nbytes
    assert decode(store.get_frame(KEY)).kv.shape == chunk.kv.shape
    assert store.stats()["codec"] == codec
    with pytest.raises(StoreError, match="codec 'nope' is not registered"):
        ChunkStore(tmp_path / "x", codec="nope")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("codec", ["q8", "q4z", "k4v3z"])
def test_each_chunks_first_token_is_kept_exact(codec, dtype):
    """The attention sink (a sequence's first token) must not be quantized: see kdn.core.codecs."""
    chunk = Chunk(KEY, NS, kv_like((2, 2, 2, 64, 64), dtype, seed=6), dtype)
    got = decode(encode(chunk, codec)).kv
    want = chunk.kv[:, :, :, :1]
    if dtype == "float32":
        want = want.astype(np.float16).astype(np.float32)
    assert np.array_equal(got[:, :, :, :1], want)
    assert not np.array_equal(got[:, :, :, 1:], chunk.kv[:, :, :, 1:])     # the rest is quantized


def test_version_1_quantized_payloads_still_decode():
    """Frames written before exact tokens existed (format v1) keep decoding."""
    chunk = Chunk(KEY, NS, kv_like((2, 2, 2, 64, 64), "float32", seed=7), "float32")
    x = chunk.kv
    kq, kmin, ks = kc._quantize(np.ascontiguousarray(x[:, 0]), 2, 64, 15)
    vq, vmin, vs = kc._quantize(np.ascontiguousarray(x[:, 1]), 3, 64, 15)
    body = b"".join([kmin.tobytes(), ks.tobytes(), vmin.tobytes(), vs.tobytes(),
                     kc._pack4(np.stack([kq, vq], 1)).tobytes()])
    payload = kc._QUANT_HEAD_V1.pack(b"KQ", 1, 4, 4, 0, 64, 64) + body
    got = decode(framed(chunk, "q4", payload)).kv
    want = np.empty(x.shape, np.float32)
    kc._dequantize(kq, kmin, ks, 2, 64, want[:, 0])
    kc._dequantize(vq, vmin, vs, 3, 64, want[:, 1])
    assert np.array_equal(got, want)


def test_codecs_are_safe_from_many_threads_at_once():
    """The origin, edges and HTTP server encode and decode in worker threads concurrently
    (zstandard's compressor objects must not be shared: this once corrupted origin reads)."""
    from concurrent.futures import ThreadPoolExecutor
    chunks = [Chunk(KEY, NS, kv_like((4, 2, 2, 256, 64), "float32", seed=s), "float32")
              for s in range(4)]

    def work(i):
        c = chunks[i % len(chunks)]
        codec = ("zstd", "q4z", "k4v3z")[i % 3]
        frame = encode(c, codec)
        return bool(np.array_equal(decode(frame).kv, decode(encode(c, codec)).kv)) and \
            (codec != "zstd" or decode(frame).equal(c))

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(96)))
