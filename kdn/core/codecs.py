"""KV payload codecs: fewer bytes per chunk on the wire and in caches, lossless or quantized.

This module is the codec table: a frame's `codec` field names an entry, so any reader
decodes any frame (kdn.core.chunk reads the table; "raw", the KV bytes themselves, is one entry).
Which codec to send over a link, and which ones a reader or a store accepts, is policy:
kdn.core.transfer.

- "zstd": lossless. The KV's bytes are split into byte planes (byte i of every element
  together: a float's exponent byte is highly repetitive, its mantissa bytes are noise),
  and each plane is zstd-compressed only where that pays (measured on SmolLM2's KV: the
  exponent plane shrinks 2.6x, the mantissa planes not at all, so they are stored as they
  are and cost no decompression). lz4 on the same planes, and zstd on the bytes as they are,
  were measured too (`kdn bench codecs` prints both): neither pays as well.
- "q8", "q4": lossy, KIVI-style asymmetric integer quantization (min and scale per group,
  fp16). Keys are quantized per channel (a group is one channel over `KEY_GROUP` tokens),
  because keys have outlier channels; values per token (one token's `VALUE_GROUP`
  channels), because value errors are mixed by the attention weights per token.
- "q4z", "q8z": the same quantized stream entropy-coded with zstd (the quantized levels
  are far from uniform), so the same decoded tensor in fewer bytes.
- "k4v3z": 4-bit keys in 128-token groups, 3-bit values, entropy-coded: the one that comes
  in at >= 4x smaller than fp16 (4.37x on SmolLM2's KV). Most of its error is the values'
  in the first third of the layers (`kdn bench quantlab --layers`): 4-bit values there
  would halve its KL at ~4.1x, the measured next step.

Never larger than raw: when a codec cannot beat the raw bytes (noise, a tiny chunk) or
cannot represent the KV (non-finite values, values beyond fp16 scales) it stores the raw
bytes themselves; a payload exactly as long as the raw KV is therefore the raw KV, and
anything shorter is the codec's format, which starts with its own magic and version and
is checked field by field (a malformed payload raises BadPayload naming the problem).
"""
import collections
import struct
import threading

import numpy as np
import zstandard

from kdn.core.dtypes import DTYPES, OPAQUE, STORAGE
from kdn.core.errors import BadRequest, FrameError


class BadPayload(FrameError):
    """A codec's payload is malformed (its checksum was fine: a bug or a hostile writer)."""


LOSSLESS = ("zstd",)
LOSSY = ("q8", "q4", "q8z", "q4z", "k4v3z")
KEY_GROUP = 64           # tokens per key quantization group (per channel)
VALUE_GROUP = 64         # channels per value quantization group (per token)
ZSTD_LEVEL = 1
PLANE_SAMPLE = 1 << 16   # bytes of a plane trial-compressed before compressing it all
PLANE_GAIN = 0.95        # a plane is compressed only if it shrinks below this fraction
FP16_MAX = 65504.0

counters = collections.Counter()   # module-wide: frames encoded, decoded, rejected

_local = threading.local()


def _zc() -> zstandard.ZstdCompressor:
    """This thread's compressor: zstandard's (de)compressor objects must not be shared by
    threads running at once (the origin, edges and HTTP server code in worker threads)."""
    z = getattr(_local, "zc", None)
    if z is None:
        z = _local.zc = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return z


def _zd() -> zstandard.ZstdDecompressor:
    z = getattr(_local, "zd", None)
    if z is None:
        z = _local.zd = zstandard.ZstdDecompressor()
    return z


def _bad(message: str) -> BadPayload:
    counters["rejected"] += 1
    return BadPayload(message)


# --- the codec table ----------------------------------------------------------------------------
_CODECS = {}


def register_codec(name: str, encode_fn, decode_fn):
    """Make a payload codec available to encode()/decode() by name.

    encode_fn(kv: np.ndarray, dtype: str) -> bytes-like payload (C-contiguous buffer).
    decode_fn(payload: memoryview, header: dict) -> np.ndarray of shape
        (layers, 2, heads, tokens, head_dim) and DTYPES[header["dtype"]][0] storage dtype.
    The header dict holds the fields read_header() returns. Registering a name again with
    other functions is refused: frames written under a name must keep decoding.
    """
    if not isinstance(name, str) or not 0 < len(name) <= 32:
        raise BadRequest(f"codec name must be a str of 1..32 characters, got {name!r}")
    if not callable(encode_fn) or not callable(decode_fn):
        raise BadRequest(f"codec {name!r}: encode_fn and decode_fn must be callable")
    if name in _CODECS and _CODECS[name] != (encode_fn, decode_fn):
        raise BadRequest(f"codec {name!r} is already registered with other functions")
    _CODECS[name] = (encode_fn, decode_fn)


def codecs() -> list:
    """Names of the registered codecs."""
    return sorted(_CODECS)


def _raw_encode(kv, dtype):
    return memoryview(kv).cast("B")


def _raw_decode(payload, header):
    return _stored(payload, header)


register_codec("raw", _raw_encode, _raw_decode)


def _shape(header) -> tuple:
    if header["dtype"] == OPAQUE:
        return (header["raw"],)          # opaque bytes: one axis, their length
    return (header["layers"], 2, header["heads"], header["tokens"], header["head_dim"])


def _stored(payload, header) -> np.ndarray:
    """The raw-bytes fallback every codec shares: a view of the payload, as "raw" gives."""
    return np.frombuffer(payload, dtype=STORAGE[header["dtype"]][0]).reshape(_shape(header))


def _unzstd(data, size: int, what: str) -> bytes:
    try:
        out = _zd().decompress(data, max_output_size=size)
    except zstandard.ZstdError as e:
        raise _bad(f"{what}: zstd data is corrupt: {e}") from None
    if len(out) != size:
        raise _bad(f"{what}: zstd data holds {len(out)} bytes, expected {size}")
    return out


# --- lossless: byte planes + zstd ---------------------------------------------------------
# payload: b"KZ" | version u8 | itemsize u8 | per plane (method u8, length u32) | plane bytes
_PLANES_HEAD = struct.Struct("<2sBB")
_PLANE_ENTRY = struct.Struct("<BI")
PLANES_VERSION = 1
_STORE, _ZSTD = 0, 1


def _zstd_encode(kv: np.ndarray, dtype: str):
    raw = memoryview(kv).cast("B")
    size = STORAGE[dtype][1]
    planes = kv.reshape(-1).view(np.uint8).reshape(-1, size).T   # [itemsize, n] strided view
    entries, blobs = [], []
    for i in range(size):
        plane = np.ascontiguousarray(planes[i])
        sample = plane[:PLANE_SAMPLE]
        method, blob = _STORE, plane
        if len(_zc().compress(sample)) < PLANE_GAIN * sample.nbytes:
            z = _zc().compress(plane)
            if len(z) < PLANE_GAIN * plane.nbytes:
                method, blob = _ZSTD, z
        entries.append(_PLANE_ENTRY.pack(method, len(blob) if method else plane.nbytes))
        blobs.append(blob)
    head = _PLANES_HEAD.pack(b"KZ", PLANES_VERSION, size) + b"".join(entries)
    total = len(head) + sum(memoryview(b).nbytes for b in blobs)
    counters["encoded"] += 1
    if total >= raw.nbytes:
        counters["encoded_raw_fallback"] += 1
        return raw
    out = bytearray(total)
    out[:len(head)] = head
    at = len(head)
    for b in blobs:
        n = memoryview(b).nbytes
        out[at:at + n] = memoryview(b).cast("B")
        at += n
    return out


def _zstd_decode(payload, header) -> np.ndarray:
    if header["nbytes"] == header["raw"]:
        return _stored(payload, header)
    size = STORAGE[header["dtype"]][1]
    n = header["raw"] // size
    head = _PLANES_HEAD.size + size * _PLANE_ENTRY.size
    if len(payload) < head:
        raise _bad(f"zstd payload of {len(payload)} bytes is shorter than its {head}-byte header")
    magic, version, itemsize = _PLANES_HEAD.unpack_from(payload)
    if magic != b"KZ" or version != PLANES_VERSION:
        raise _bad(f"zstd payload starts {magic!r} v{version}, expected b'KZ' v{PLANES_VERSION}")
    if itemsize != size:
        raise _bad(f"zstd payload has {itemsize}-byte planes but dtype {header['dtype']} "
                   f"has {size}-byte elements")
    out = np.empty(_shape(header), STORAGE[header["dtype"]][0])
    planes = out.reshape(-1).view(np.uint8).reshape(n, size)
    at = head
    for i in range(size):
        method, length = _PLANE_ENTRY.unpack_from(payload, _PLANES_HEAD.size + i * _PLANE_ENTRY.size)
        if at + length > len(payload):
            raise _bad(f"zstd plane {i} of {length} bytes runs past the {len(payload)}-byte payload")
        blob = payload[at:at + length]
        if method == _STORE:
            if length != n:
                raise _bad(f"stored plane {i} is {length} bytes, expected {n}")
            planes[:, i] = np.frombuffer(blob, np.uint8)
        elif method == _ZSTD:
            planes[:, i] = np.frombuffer(_unzstd(blob, n, f"plane {i}"), np.uint8)
        else:
            raise _bad(f"zstd plane {i} has unknown method {method}")
        at += length
    if at != len(payload):
        raise _bad(f"zstd payload has {len(payload) - at} bytes after its last plane")
    return out


# --- lossy: KIVI quantization ---------------------------------------------------------------
# payload v2: b"KQ" | version u8 | key bits u8 | value bits u8 | entropy u8 | key_group u16 |
# value_group u16 | exact tokens u16 | body. The body (zstd-compressed when entropy): key mins,
# key scales [L, H, key groups, D] fp16, value mins, value scales [L, H, T, value groups] fp16,
# the first `exact` tokens' KV [L, 2, H, exact, D] in fp16 (bf16 chunks: bf16), then the
# levels: every key level [L, H, T, D], then every value level [L, H, T, D] (apart, zstd's
# Huffman tables fit each kind: k4v3z 7.8% smaller than interleaved), two per byte when keys
# and values are both 4 bits (the low nibbles hold the first half of the levels, the high
# nibbles the second half, so unpacking is two contiguous passes instead of an interleave),
# else one byte each (8 bits, or narrower levels under entropy coding: zstd's Huffman stage
# then spends about their entropy on each, so no bit packing is needed).
# v1 (written before the exact tokens existed) has no exact-tokens field or section, and its
# levels interleave keys and values in [L, 2, H, T, D] order; it still decodes.
#
# Why exact tokens: a chunk's first token may be its sequence's first, the attention sink
# (StreamingLLM; IntactKV keeps such "pivot" tokens intact for the same reason) that every
# later query attends to heavily, so an error in its K or V spreads to every position.
# Its norm does not stand out, so it is not found by size; keeping each chunk's first
# token exact costs 1/256 of a chunk and, measured on SmolLM2 (kdn bench codecs), cut the
# perplexity change of 4-bit keys and values from +0.9% to -0.2%.
_QUANT_HEAD_V1 = struct.Struct("<2sBBBBHH")
_QUANT_HEAD = struct.Struct("<2sBBBBHHH")
QUANT_VERSION = 2
EXACT_TOKENS = 1         # leading tokens of every chunk kept exact (fp16)


def _as_float32(kv: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (kv.astype(np.uint32) << 16).view(np.float32)
    return kv.astype(np.float32, copy=False)


def _to_storage(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """float32 x into out (storage dtype); bf16 rounds to nearest even."""
    if dtype == "float32":
        return
    if dtype == "float16":
        np.copyto(out, x, casting="unsafe")
        return
    u = x.view(np.uint32)
    u += 0x7FFF + ((u >> 16) & 1)
    np.copyto(out, u >> 16, casting="unsafe")


def _groups(n: int, g: int) -> int:
    return -(-n // g)


def _split(axis_len: int, g: int):
    """[(start, stop, group size)] covering axis_len: the full groups, then a shorter tail."""
    full = axis_len // g * g
    out = [(0, full, g)] if full else []
    if full < axis_len:
        out.append((full, axis_len, axis_len - full))
    return out


def _quantize(x: np.ndarray, axis: int, g: int, levels: int):
    """(q uint8, mins fp16, scales fp16) of x [L, H, T, D] grouped by g along axis (2 or 3).

    The min is rounded down and the scale up to fp16, so every x lies in
    [min, min + levels * scale] and the error is at most scale / 2.
    """
    q = np.empty(x.shape, np.uint8)
    shape = list(x.shape)
    shape[axis] = _groups(x.shape[axis], g)
    mins = np.empty(shape, np.float16)
    scales = np.empty(shape, np.float16)
    for start, stop, size in _split(x.shape[axis], g):
        part = x[:, :, start:stop] if axis == 2 else x[:, :, :, start:stop]
        n = (stop - start) // size
        gshape = list(part.shape[:axis]) + [n, size] + list(part.shape[axis + 1:])
        p = part.reshape(gshape)
        lo = p.min(axis=axis + 1, keepdims=True)
        hi = p.max(axis=axis + 1, keepdims=True)
        lo16 = lo.astype(np.float16)
        lo16 = np.where(lo16.astype(np.float32) > lo, np.nextafter(lo16, np.float16(-np.inf)), lo16)
        base = lo16.astype(np.float32)
        sc = ((hi - base) / levels).astype(np.float32)
        sc16 = sc.astype(np.float16)
        sc16 = np.where(sc16.astype(np.float32) < sc, np.nextafter(sc16, np.float16(np.inf)), sc16)
        scf = sc16.astype(np.float32)
        inv = np.where(scf > 0, 1.0 / np.where(scf > 0, scf, 1.0), 0.0).astype(np.float32)
        levels_f = np.rint((p - base) * inv)
        np.clip(levels_f, 0, levels, out=levels_f)
        qpart = q[:, :, start:stop] if axis == 2 else q[:, :, :, start:stop]
        qpart.reshape(gshape)[...] = levels_f
        sl = (slice(None),) * axis + (slice(start // g, start // g + n),)
        mins[sl] = lo16.squeeze(axis + 1)
        scales[sl] = sc16.squeeze(axis + 1)
    return q, mins, scales


def _dequantize(q: np.ndarray, mins: np.ndarray, scales: np.ndarray, axis: int, g: int,
                out: np.ndarray) -> None:
    """out[L, H, T, D] (float32, may be a strided view) = q * scale + min, group by group."""
    for start, stop, size in _split(q.shape[axis], g):
        n = (stop - start) // size
        sl = (slice(None),) * axis + (slice(start // g, start // g + n),)
        m = np.expand_dims(mins[sl].astype(np.float32), axis + 1)
        s = np.expand_dims(scales[sl].astype(np.float32), axis + 1)
        if axis == 2:
            qp, op = q[:, :, start:stop], out[:, :, start:stop]
        else:
            qp, op = q[:, :, :, start:stop], out[:, :, :, start:stop]
        gshape = list(qp.shape[:axis]) + [n, size] + list(qp.shape[axis + 1:])
        o = op.reshape(gshape)                # splitting an axis: always a view, never a copy
        np.multiply(qp.reshape(gshape), s, out=o)
        o += m


def _pack4(q: np.ndarray) -> np.ndarray:
    flat = q.reshape(-1)
    half = -(-flat.size // 2)
    packed = flat[:half].copy()
    hi = flat[half:]
    packed[:hi.size] |= hi << 4
    return packed


def _unpack4(packed: np.ndarray, n: int) -> np.ndarray:
    half = -(-n // 2)
    q = np.empty(n, np.uint8)
    np.bitwise_and(packed, 0x0F, out=q[:half])
    np.right_shift(packed[:n - half], 4, out=q[half:])
    return q


def _quant_sizes(header, packed: bool, kg: int, vg: int) -> tuple:
    L, _, H, T, D = _shape(header)
    ks = L * H * _groups(T, kg) * D
    vs = L * H * T * _groups(D, vg)
    n = L * 2 * H * T * D
    return ks, vs, (-(-n // 2) if packed else n)


def _quant_encoder(kbits: int, vbits: int, entropy: bool, kg: int, vg: int):
    packed = kbits == vbits == 4

    def encode(kv: np.ndarray, dtype: str):
        raw = memoryview(kv).cast("B")
        counters["encoded"] += 1
        x = _as_float32(kv, dtype)
        if not np.isfinite(x).all() or np.abs(x).max() > FP16_MAX / 2:
            counters["encoded_raw_fallback"] += 1   # fp16 scales cannot describe it: keep it exact
            return raw
        T = x.shape[3]
        exact = min(EXACT_TOKENS, T - 1)
        keys = x[:, 0]
        if exact:   # the exact tokens must not widen their key groups' ranges
            keys = keys.copy()
            keys[:, :, :exact] = keys[:, :, exact:exact + 1]
        kq, kmin, kscale = _quantize(keys, 2, kg, (1 << kbits) - 1)
        vq, vmin, vscale = _quantize(x[:, 1], 3, vg, (1 << vbits) - 1)
        q = np.concatenate([kq.reshape(-1), vq.reshape(-1)])   # v2: all keys, then all values
        stream = _pack4(q) if packed else q
        head = kv[:, :, :, :exact]
        head = head.astype(np.float16) if dtype == "float32" else np.ascontiguousarray(head)
        body = b"".join([kmin.tobytes(), kscale.tobytes(), vmin.tobytes(), vscale.tobytes(),
                         head.tobytes(), stream.tobytes()])
        if entropy:
            body = _zc().compress(body)
        payload = _QUANT_HEAD.pack(b"KQ", QUANT_VERSION, kbits, vbits, int(entropy), kg, vg,
                                   exact) + body
        if len(payload) >= raw.nbytes:
            counters["encoded_raw_fallback"] += 1
            return raw
        return payload

    return encode


def _quant_head(name: str, payload, kbits: int, vbits: int, entropy: bool) -> tuple:
    """(version, key group, value group, exact tokens, header bytes) of a quantized payload,
    checked against the codec's bits and entropy coding. Group sizes and exact tokens are
    read from the payload (any valid value decodes)."""
    if len(payload) < _QUANT_HEAD_V1.size:
        raise _bad(f"{name} payload of {len(payload)} bytes is shorter than its "
                   f"{_QUANT_HEAD_V1.size}-byte header")
    magic, version = bytes(payload[:2]), payload[2]
    if magic != b"KQ" or version not in (1, QUANT_VERSION):
        raise _bad(f"{name} payload starts {magic!r} v{version}, expected b'KQ' "
                   f"v1 or v{QUANT_VERSION}")
    if version == 1:
        _, _, got_k, got_v, got_entropy, kg, vg = _QUANT_HEAD_V1.unpack_from(payload)
        exact, head_size = 0, _QUANT_HEAD_V1.size
    else:
        if len(payload) < _QUANT_HEAD.size:
            raise _bad(f"{name} payload of {len(payload)} bytes is shorter than its "
                       f"{_QUANT_HEAD.size}-byte v2 header")
        _, _, got_k, got_v, got_entropy, kg, vg, exact = _QUANT_HEAD.unpack_from(payload)
        head_size = _QUANT_HEAD.size
    if (got_k, got_v, got_entropy) != (kbits, vbits, int(entropy)):
        raise _bad(f"{name} payload declares {got_k}-bit keys, {got_v}-bit values, "
                   f"entropy={got_entropy}; the {name} codec is {kbits}-bit keys, "
                   f"{vbits}-bit values, entropy={int(entropy)}")
    if kg < 1 or vg < 1:
        raise _bad(f"{name} payload declares group sizes key={kg}, value={vg}; both must be >= 1")
    return version, kg, vg, exact, head_size


def _quant_parts(name: str, body, header, packed: bool, kg: int, vg: int, exact: int) -> tuple:
    """(key mins, key scales, value mins, value scales, exact tokens, level stream): views
    into body (the payload after its header, decompressed), each checked finite."""
    L, _, H, T, D = _shape(header)
    ks, vs, nlev = _quant_sizes(header, packed, kg, vg)
    nexact = L * 2 * H * exact * D
    at = 0

    def take(count, dtype, shape):
        nonlocal at
        arr = np.frombuffer(body, dtype, count=count, offset=at).reshape(shape)
        at += arr.nbytes
        return arr

    kshape, vshape = (L, H, _groups(T, kg), D), (L, H, T, _groups(D, vg))
    kmin, kscale = take(ks, np.float16, kshape), take(ks, np.float16, kshape)
    vmin, vscale = take(vs, np.float16, vshape), take(vs, np.float16, vshape)
    dtype = header["dtype"]
    head = take(nexact, np.float16 if dtype == "float32" else DTYPES[dtype][0], (L, 2, H, exact, D))
    stream = take(nlev, np.uint8, (nlev,))
    for what, arr in (("key mins", kmin), ("key scales", kscale), ("value mins", vmin),
                      ("value scales", vscale)):
        if not np.isfinite(arr).all():
            raise _bad(f"{name} payload holds non-finite {what}")
    if exact and dtype != "bfloat16" and not np.isfinite(head).all():
        raise _bad(f"{name} payload holds non-finite exact-token values")
    return kmin, kscale, vmin, vscale, head, stream


def _quant_levels(name: str, stream, header, version: int, packed: bool, kbits: int, vbits: int) -> tuple:
    """(key levels [L, H, T, D], value levels [L, H, T, D]) of the level stream, each
    checked within its bits (a packed stream's padding nibble 0)."""
    L, _, H, T, D = _shape(header)
    n = L * 2 * H * T * D
    flat = _unpack4(stream, n) if packed else stream
    if version == 1:      # levels in [L, 2, H, T, D] order
        q = flat.reshape(L, 2, H, T, D)
        kq, vq = q[:, 0], q[:, 1]
    else:                 # all key levels, then all value levels
        kq, vq = flat[:n // 2].reshape(L, H, T, D), flat[n // 2:].reshape(L, H, T, D)
    if packed and len(stream) * 2 > n and stream[-1] >> 4:
        raise _bad(f"{name} payload's padding nibble is {stream[-1] >> 4}, not 0")
    if not packed:
        for kind, bits in ((0, kbits), (1, vbits)):
            top = int((vq if kind else kq).max()) if bits < 8 else 0
            if top >= 1 << bits:
                raise _bad(f"{name} payload holds level {top} in its "
                           f"{'values' if kind else 'keys'}, over the {bits}-bit maximum "
                           f"{(1 << bits) - 1}")
    return kq, vq


def _quant_decoder(name: str, kbits: int, vbits: int, entropy: bool, kg: int, vg: int):
    packed = kbits == vbits == 4

    def decode(payload, header) -> np.ndarray:
        if header["nbytes"] == header["raw"]:
            return _stored(payload, header)
        version, kg, vg, exact, head_size = _quant_head(name, payload, kbits, vbits, entropy)
        L, _, H, T, D = _shape(header)
        if exact >= T:
            raise _bad(f"{name} payload declares {exact} exact tokens in a {T}-token chunk")
        ks, vs, nlev = _quant_sizes(header, packed, kg, vg)
        size = 4 * ks + 4 * vs + 2 * (L * 2 * H * exact * D) + nlev
        body = payload[head_size:]
        if entropy:
            body = memoryview(_unzstd(body, size, f"{name} body"))
        elif len(body) != size:
            raise _bad(f"{name} body is {len(body)} bytes; shape {_shape(header)} with groups "
                       f"key={kg}, value={vg} needs {size}")
        kmin, kscale, vmin, vscale, head, stream = _quant_parts(name, body, header, packed, kg, vg, exact)
        kq, vq = _quant_levels(name, stream, header, version, packed, kbits, vbits)
        dtype = header["dtype"]
        out = np.empty(_shape(header), DTYPES[dtype][0])
        work = out if dtype == "float32" else np.empty(out.shape, np.float32)
        _dequantize(kq, kmin, kscale, 2, kg, work[:, 0])
        _dequantize(vq, vmin, vscale, 3, vg, work[:, 1])
        _to_storage(work, dtype, out)
        if exact:
            out[:, :, :, :exact] = head     # fp16 -> fp32, or the bf16/fp16 bits as they were
        counters["decoded"] += 1
        counters["decoded_bytes"] += out.nbytes
        return out

    return decode


# name -> (key bits, value bits, entropy-coded, key group tokens, value group channels).
# k4v3z: values take 3 bits and key groups span 128 tokens, to come in at >= 4x smaller
# than fp16.
QUANTIZED = {"q8": (8, 8, False, KEY_GROUP, VALUE_GROUP), "q4": (4, 4, False, KEY_GROUP, VALUE_GROUP),
             "q8z": (8, 8, True, KEY_GROUP, VALUE_GROUP), "q4z": (4, 4, True, KEY_GROUP, VALUE_GROUP),
             "k4v3z": (4, 3, True, 2 * KEY_GROUP, VALUE_GROUP)}

register_codec("zstd", _zstd_encode, _zstd_decode)
for _name, _spec in QUANTIZED.items():
    register_codec(_name, _quant_encoder(*_spec), _quant_decoder(_name, *_spec))
