"""Chunks and their frames: the KV of one run of tokens, in memory and on the wire.

In memory a Chunk is one C-contiguous numpy array kv[layers, 2, kv_heads, tokens, head_dim]
(index 0 of axis 1 = keys, 1 = values), so a whole chunk moves as one buffer (Ray's object
store, a file, a socket) and each layer's (k, v) is a torch view of it in the shape
transformers' caches take, [1, kv_heads, tokens, head_dim], without a copy. numpy has no
bfloat16: bf16 KV is stored as uint16 and reinterpreted by torch's .view(torch.bfloat16).

On the wire and on disk a chunk is a self-describing frame:

    b"KDNC" | uint32 LE header length | msgpack header | payload

The header names the chunk (key, ns), its shape, dtype and codec, the payload length
(nbytes), the uncompressed length (raw) and the payload's xxh3_64 (xxh). Its last field,
hx, is the xxh3_64 of every frame byte before it (magic, length, header), so a flipped bit
anywhere in a frame is caught, not only in the payload. A pad field makes the header end
on a 64-byte boundary, so a payload in an aligned buffer (mmap, shared memory) is aligned.

Frames come from other machines and disks: decode() trusts nothing. Every length, size,
type and checksum is checked, and each problem raises its own kdn.core.errors.FrameError
subclass naming what is wrong — never a crash, never a silently wrong tensor. decode() is
zero-copy: the chunk's kv is a view of the caller's buffer (read-only when the buffer is
bytes), and verifying costs one xxh3 pass, faster than a memory copy.

Codecs are pluggable (kdn.core.codecs is the table; "raw" is the kv bytes themselves).

Opaque chunks: another cache layer's objects (LMCache memory objects, SGLang pages: see
kdn.integrations.objects) travel as chunks of dtype "opaque": kv is a 1-D uint8 array of the
object's bytes, and the frame says exactly that (dtype "opaque", layers = heads = head_dim =
tokens = 0, raw = the length), never a made-up KV shape. Only lossless codecs apply to them.

Chunk and Encoded (a chunk kept as one compressed frame) answer the same questions, so
tiers, links and readers never ask which one they hold: key, ns, dtype, codec, exact,
nbytes (what holding or sending it costs), raw (the size of its KV), decode() (the Chunk)
and verify(expected) (the one place a copy is checked: FrameError unless its bytes are the
ones named).
"""
import collections
import struct
import warnings
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from kdn.core.checks import check_int
from kdn.core.codecs import _CODECS, LOSSY, codecs, register_codec  # noqa: F401 - re-exported
from kdn.core.dtypes import DTYPES, OPAQUE, name_of, torch_dtype
from kdn.core.errors import (BadHeader, BadLength, BadRequest, ChecksumMismatch, FrameError,
                             SizeLimitExceeded, TruncatedFrame, UnknownCodec, UnknownDtype,
                             UnknownVersion)
from kdn.core.keys import CHUNK_TOKENS, KEY_BYTES, check_key, chunk_spans


FRAME_MAGIC = b"KDNC"
VERSION = 1
MAX_PAYLOAD = 1 << 30
MAX_HEADER = 4096
MAX_LAYERS = 4096
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_TOKENS = 65536
ALIGN = 64                          # the payload starts at a multiple of this in the frame
_PREFIX = struct.Struct("<4sI")     # magic, header length
_HX_TAIL = b"\xa2hx\xc4\x08"        # msgpack of key "hx" and the head of an 8-byte bin
_DIMS = (("layers", MAX_LAYERS), ("heads", MAX_HEADS), ("head_dim", MAX_HEAD_DIM),
         ("tokens", MAX_TOKENS))
_FUSE_BLOCK = 1 << 18               # copy+hash block: fits L2, so the hash reads from cache

counters = collections.Counter()   # module-wide: frames encoded, decoded, rejected


def _from_numpy(arr):
    import torch    # only an engine asks for torch views: the vocabulary never loads torch
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    # Read-only arrays (decoded from bytes) make torch warn; the caller owns immutability.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _layer_shape(t):
    """(heads, T, hd) of a per-layer k or v tensor [1, heads, T, hd] or [heads, T, hd]."""
    if t.dim() == 4 and t.shape[0] == 1:
        return tuple(t.shape[1:])
    return tuple(t.shape) if t.dim() == 3 else None


@dataclass(frozen=True, eq=False)
class Chunk:
    """The KV of one chunk of tokens for all layers: kv[layers, 2, kv_heads, tokens, head_dim].

    A chunk decoded from bytes holds a read-only view of them; one made from torch
    tensors shares their memory. Treat kv as immutable either way: keys name contents.
    """
    key: bytes
    ns: bytes
    kv: np.ndarray
    dtype: str
    # xxh3_64 of kv's bytes when decode() verified it over an immutable buffer: re-encoding
    # (an edge serving what it received) then costs no hashing.
    _xxh: int = field(default=None, init=False, repr=False)

    def __post_init__(self):
        for name in ("key", "ns"):
            object.__setattr__(self, name, check_key(getattr(self, name), f"chunk {name}"))
        if self.dtype not in DTYPES and self.dtype != OPAQUE:
            raise BadRequest(f"chunk dtype {self.dtype!r} is not one of {', '.join(DTYPES)} "
                             f"or {OPAQUE}")
        kv = self.kv
        if not isinstance(kv, np.ndarray):
            raise BadRequest(f"chunk kv must be a numpy array, got {type(kv).__name__}")
        if self.dtype == OPAQUE:
            if kv.ndim != 1 or kv.dtype != np.uint8 or kv.size == 0 or not kv.flags.c_contiguous:
                raise BadRequest(f"an opaque chunk holds a non-empty C-contiguous 1-D uint8 "
                                 f"array, got {kv.dtype} of shape {kv.shape}")
            return
        if kv.ndim != 5 or kv.shape[1] != 2 or 0 in kv.shape:
            raise BadRequest(f"chunk kv must be [layers, 2, kv_heads, tokens, head_dim] "
                             f"with no empty axis, got shape {kv.shape}")
        if kv.dtype != DTYPES[self.dtype][0]:
            raise BadRequest(f"chunk kv of dtype {self.dtype} must be stored as "
                             f"{DTYPES[self.dtype][0]}, got {kv.dtype}")
        if not kv.flags.c_contiguous:
            raise BadRequest("chunk kv must be C-contiguous")

    # KV dimensions; 0 for an opaque chunk (bytes, not KV)
    layers = property(lambda self: self.kv.shape[0] if self.kv.ndim == 5 else 0)
    kv_heads = property(lambda self: self.kv.shape[2] if self.kv.ndim == 5 else 0)
    tokens = property(lambda self: self.kv.shape[3] if self.kv.ndim == 5 else 0)
    head_dim = property(lambda self: self.kv.shape[4] if self.kv.ndim == 5 else 0)
    opaque = property(lambda self: self.dtype == OPAQUE)
    nbytes = property(lambda self: self.kv.nbytes)     # what holding or sending it costs
    raw = nbytes                                       # the size of its KV
    codec = "raw"
    exact = True

    def __reduce__(self):
        # The cached checksum never travels: a chunk that crossed a process or a node is
        # hashed again by whoever verifies it, so corruption on the way is caught.
        return (Chunk, (self.key, self.ns, self.kv, self.dtype))

    def __repr__(self):
        if self.opaque:
            return f"Chunk(key={self.key.hex()}, opaque, {self.nbytes} bytes)"
        return (f"Chunk(key={self.key.hex()}, layers={self.layers}, kv_heads={self.kv_heads}, "
                f"tokens={self.tokens}, head_dim={self.head_dim}, dtype={self.dtype})")

    def to_torch(self):
        """kv as a torch tensor [layers, 2, kv_heads, tokens, head_dim] of its dtype; no copy."""
        if self.opaque:
            raise BadRequest(f"chunk {self.key.hex()} holds opaque bytes, not KV")
        t = _from_numpy(self.kv)
        want = torch_dtype(self.dtype)
        return t if t.dtype == want else t.view(want)

    def layer(self, i: int):
        """(k, v) of layer i as torch views [1, kv_heads, tokens, head_dim]."""
        i = check_int(int(i) if isinstance(i, np.integer) else i, "layer", -self.layers, self.layers - 1,
                      note=f"a chunk of {self.layers} layers")
        t = self.to_torch()[i]
        return t[0].unsqueeze(0), t[1].unsqueeze(0)

    def to_layers(self) -> list:
        """[(k, v)] for every layer, each a torch view [1, kv_heads, tokens, head_dim]."""
        t = self.to_torch()
        return [(t[i, 0].unsqueeze(0), t[i, 1].unsqueeze(0)) for i in range(self.layers)]

    @classmethod
    def from_torch(cls, key, ns, t) -> "Chunk":
        """A chunk over tensor t [layers, 2, kv_heads, tokens, head_dim] (float32/16, bf16).

        Shares t's memory when t is a contiguous CPU tensor; copies otherwise.
        """
        import torch
        if not isinstance(t, torch.Tensor):
            raise BadRequest(f"from_torch takes a torch.Tensor, got {type(t).__name__}")
        name = name_of(t.dtype)
        if name is None:
            raise BadRequest(f"KV dtype {t.dtype} is not one of {', '.join(DTYPES)}")
        if t.dim() != 5 or t.shape[1] != 2:
            raise BadRequest(f"KV tensor must be [layers, 2, kv_heads, tokens, head_dim], "
                             f"got {tuple(t.shape)}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if name == "bfloat16":
            t = t.view(torch.uint16)
        arr = np.ascontiguousarray(t.numpy())   # no-op for a contiguous tensor
        return cls(key, ns, arr, name)

    @classmethod
    def from_layers(cls, key, ns, layers) -> "Chunk":
        """A chunk from per-layer (k, v) tensors [1, heads, T, hd] or [heads, T, hd] (one copy)."""
        import torch
        layers = [tuple(pair) if isinstance(pair, (tuple, list)) else pair for pair in layers]
        if not layers:
            raise BadRequest("from_layers needs at least one (k, v) layer")
        for i, pair in enumerate(layers):
            if not isinstance(pair, tuple) or len(pair) != 2 \
                    or not all(isinstance(t, torch.Tensor) for t in pair):
                raise BadRequest(f"layer {i} is not a (k, v) pair of torch tensors")
        first = layers[0][0]
        if name_of(first.dtype) is None:
            raise BadRequest(f"KV dtype {first.dtype} is not one of {', '.join(DTYPES)}")
        shape = _layer_shape(first)
        if shape is None:
            raise BadRequest(f"layer tensors must be [1, heads, T, hd] or [heads, T, hd], "
                             f"got {tuple(first.shape)}")
        out = torch.empty((len(layers), 2) + shape, dtype=first.dtype)
        for i, pair in enumerate(layers):
            for j, t in enumerate(pair):
                if t.dtype != first.dtype or _layer_shape(t) != shape:
                    raise BadRequest(f"layer {i} {'kv'[j]} is {tuple(t.shape)} {t.dtype}, "
                                     f"expected {shape} {first.dtype}")
                out[i, j].copy_(t.reshape(shape))
        return cls.from_torch(key, ns, out)

    def decode(self) -> "Chunk":
        """The chunk itself (an Encoded decodes its frame)."""
        return self

    def verify(self, expected: "int | None" = None) -> None:
        """ChecksumMismatch unless the KV hashes to `expected` (a manifest's per-chunk
        checksum); with expected None there is nothing to check a bare array against."""
        if expected is None:
            return
        got = self._xxh if self._xxh is not None else self.digest()
        if got != expected:
            raise _reject(ChecksumMismatch, f"chunk {self.key.hex()}: its KV hashes to "
                                            f"{got:016x}, its manifest says {expected:016x}")

    def digest(self) -> int:
        """xxh3_64 of the KV bytes, computed now (the raw frame's payload checksum, and the one
        a manifest records per chunk): what end-to-end verification compares."""
        return xxhash.xxh3_64_intdigest(memoryview(self.kv.reshape(-1).view(np.uint8)))

    def equal(self, other) -> bool:
        """Same key, namespace, dtype, shape and identical bytes (NaNs compare by bits)."""
        if not isinstance(other, Chunk):
            return False
        if (self.key, self.ns, self.dtype, self.kv.shape) != \
                (other.key, other.ns, other.dtype, other.kv.shape):
            return False
        a, b = self.kv.reshape(-1).view(np.uint8), other.kv.reshape(-1).view(np.uint8)
        step = 1 << 22
        return all(np.array_equal(a[s:s + step], b[s:s + step]) for s in range(0, a.size, step))


# --- frames ----------------------------------------------------------------------------
FRAME_SUFFIX = ".kdnc"     # a file (an edge's disk tier) or object (the origin's store) of one frame


def cut(kv, keys, ns, chunk_tokens: int = CHUNK_TOKENS, dtype: str = None) -> list:
    """Chunks of kv [layers, 2, kv_heads, tokens, head_dim] (numpy, or a torch tensor), one per
    key, cut along tokens on the chunk grid (kdn.core.keys.chunk_spans: full chunks, then the
    trailing partial one): the one place KV becomes chunks. One copy per chunk (a slice along
    tokens is not contiguous; a chunk is one contiguous buffer). dtype: the KDN dtype name of
    a numpy kv (default: the one its storage dtype stands for; uint16 is bfloat16)."""
    shape = tuple(getattr(kv, "shape", ()))
    if len(shape) != 5 or shape[1] != 2:
        raise BadRequest(f"kv must have shape [layers, 2, kv_heads, tokens, head_dim], got "
                         f"{shape or type(kv).__name__}")
    spans = chunk_spans(shape[3], chunk_tokens)
    keys = list(keys)
    if len(keys) != len(spans):
        raise BadRequest(f"{len(keys)} keys for {shape[3]} tokens, which make {len(spans)} "
                         f"chunks of {chunk_tokens}")
    if isinstance(kv, np.ndarray) and dtype is None:
        dtype = next((name for name, (storage, _, _) in DTYPES.items() if kv.dtype == storage), None)
        if dtype is None:
            raise BadRequest(f"KV dtype {kv.dtype} is not float32, float16 or uint16 (bfloat16 bits)")
    out = []
    for key, (a, b) in zip(keys, spans):
        part = kv[:, :, :, a:b]
        out.append(Chunk(key, ns, np.ascontiguousarray(part), dtype) if isinstance(part, np.ndarray)
                   else Chunk.from_torch(key, ns, part.contiguous()))
    return out


def _byte_view(buf) -> memoryview:
    try:
        mv = memoryview(buf)
    except TypeError:
        raise BadRequest(f"a frame is a bytes-like object, got {type(buf).__name__}") from None
    if mv.format != "B" or mv.ndim != 1:
        if not mv.c_contiguous:
            raise BadRequest("a frame buffer must be contiguous")
        mv = mv.cast("B")
    elif not mv.contiguous:
        raise BadRequest("a frame buffer must be contiguous")
    return mv


def _payload_view(payload) -> memoryview:
    mv = memoryview(payload)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _frame_prefix(fields: dict) -> bytes:
    """magic | length | msgpack(fields + pad + hx). Its length depends on every field but
    xxh's value, and 8 + header length is a multiple of ALIGN."""
    widest = dict(fields, xxh=2**64 - 1, pad=b"", hx=bytes(8))
    target = -(-(_PREFIX.size + len(msgpack.packb(widest))) // ALIGN) * ALIGN
    body = dict(fields, pad=b"", hx=bytes(8))
    short = target - _PREFIX.size - len(msgpack.packb(body))
    body["pad"] = bytes(short)                  # bin8 for < 256 bytes: grows by exactly `short`
    header = msgpack.packb(body)
    if len(header) > MAX_HEADER:
        raise SizeLimitExceeded(f"frame header of {len(header)} bytes exceeds {MAX_HEADER}")
    prefix = bytearray(_PREFIX.pack(FRAME_MAGIC, len(header)) + header)
    assert len(prefix) == target and prefix[-13:-8] == _HX_TAIL
    prefix[-8:] = xxhash.xxh3_64_digest(memoryview(prefix)[:-8])
    return bytes(prefix)


def _header_fields(chunk: Chunk, codec: str, nbytes: int, xxh: int) -> dict:
    return {"v": VERSION, "key": chunk.key, "ns": chunk.ns, "layers": chunk.layers,
            "heads": chunk.kv_heads, "head_dim": chunk.head_dim, "tokens": chunk.tokens,
            "dtype": chunk.dtype, "codec": codec, "nbytes": nbytes, "raw": chunk.nbytes,
            "xxh": xxh}


def _check_encodable(chunk: Chunk, codec: str):
    if not isinstance(chunk, Chunk):
        raise BadRequest(f"encode takes a Chunk, got {type(chunk).__name__}")
    if codec not in _CODECS:
        raise UnknownCodec(f"codec {codec!r} is not registered; known: {', '.join(codecs())}")
    if chunk.opaque and codec in LOSSY:
        raise BadRequest(f"codec {codec!r} is lossy: opaque bytes take only lossless codecs")
    for (name, limit), size in zip(_DIMS, (chunk.layers, chunk.kv_heads, chunk.head_dim,
                                           chunk.tokens)):
        if size > limit:
            raise SizeLimitExceeded(f"chunk {name} {size} exceeds the frame limit {limit}")
    if chunk.nbytes > MAX_PAYLOAD:
        raise SizeLimitExceeded(f"chunk of {chunk.nbytes} bytes exceeds MAX_PAYLOAD {MAX_PAYLOAD}")
    return _CODECS[codec][0]


def encode_parts(chunk: Chunk, codec: str = "raw") -> list:
    """[prefix bytes (magic, length, header), payload memoryview]: a frame without a join copy.

    With "raw" the payload is a view of chunk.kv: write the parts with os.writev or
    socket.sendmsg, or send them one after the other.
    """
    encode_fn = _check_encodable(chunk, codec)
    payload = _payload_view(encode_fn(chunk.kv, chunk.dtype))
    if payload.nbytes > MAX_PAYLOAD:
        raise SizeLimitExceeded(f"payload of {payload.nbytes} bytes exceeds {MAX_PAYLOAD}")
    xxh = chunk._xxh if codec == "raw" and chunk._xxh is not None \
        else xxhash.xxh3_64_intdigest(payload)
    prefix = _frame_prefix(_header_fields(chunk, codec, payload.nbytes, xxh))
    counters["encoded"] += 1
    counters["encoded_bytes"] += len(prefix) + payload.nbytes
    return [prefix, payload]


def encode(chunk: Chunk, codec: str = "raw") -> bytes:
    """One frame as bytes (a join of encode_parts: one copy of the payload)."""
    return b"".join(encode_parts(chunk, codec))


def encode_into(chunk: Chunk, out, codec: str = "raw") -> int:
    """Write one frame at the start of the writable buffer out; return its length.

    The payload is copied and hashed block by block, so each block is hashed while still
    in cache: about the speed of a plain copy into a preallocated buffer (mmap, shm).
    """
    encode_fn = _check_encodable(chunk, codec)
    dst = _byte_view(out)
    if dst.readonly:
        raise BadRequest("encode_into needs a writable buffer")
    payload = _payload_view(encode_fn(chunk.kv, chunk.dtype))
    n = payload.nbytes
    off = len(_frame_prefix(_header_fields(chunk, codec, n, 0)))
    if len(dst) < off + n:
        raise BadRequest(f"buffer of {len(dst)} bytes is too small for a {off + n}-byte frame")
    src = np.frombuffer(payload, np.uint8)
    body = np.frombuffer(dst, np.uint8, count=n, offset=off)
    if codec == "raw" and chunk._xxh is not None:
        np.copyto(body, src)
        xxh = chunk._xxh
    else:
        h = xxhash.xxh3_64()
        for s in range(0, n, _FUSE_BLOCK):
            np.copyto(body[s:s + _FUSE_BLOCK], src[s:s + _FUSE_BLOCK])
            h.update(payload[s:s + _FUSE_BLOCK])
        xxh = h.intdigest()
    prefix = _frame_prefix(_header_fields(chunk, codec, n, xxh))
    dst[:off] = prefix
    counters["encoded"] += 1
    counters["encoded_bytes"] += off + n
    return off + n


def _reject(exc_class, message):
    counters["rejected"] += 1
    return exc_class(message)


def _field(header, name, kind):
    if name not in header:
        raise _reject(BadHeader, f"frame header lacks field {name!r}")
    value = header[name]
    if type(value) is not kind:
        raise _reject(BadHeader, f"frame header field {name!r} must be {kind.__name__}, "
                                 f"got {type(value).__name__} {value!r:.60}")
    return value


def header_bytes(buf) -> "int | None":
    """How many bytes the frame starting at buf's start needs before read_header() can parse
    it (its prefix and header), or None while buf is shorter than the prefix. Checks
    nothing: read_header() does, once that many bytes are in."""
    mv = _byte_view(buf)
    if len(mv) < _PREFIX.size:
        return None
    return _PREFIX.size + min(_PREFIX.unpack_from(mv)[1], MAX_HEADER + 1)


def read_header(buf, *, max_payload: int = MAX_PAYLOAD):
    """Parse and check the magic and header at the start of buf: (header dict, payload offset).

    buf may hold more than the header (the payload, further frames). Raises TruncatedFrame
    if buf ends before the header does, another FrameError if the header is wrong. The
    dict holds v, key, ns, layers, heads, head_dim, tokens, dtype, codec, nbytes, raw, xxh.
    """
    header, end = _header_map(_byte_view(buf))
    _check_fields(header, max_payload)
    return {k: v for k, v in header.items() if k not in ("pad", "hx")}, end


def _header_map(mv) -> tuple:
    """(the header's map, where it ends): the magic, the prefix's length, msgpack, the format
    version and the header's own checksum (its last field, 'hx') checked."""
    n = len(mv)
    if mv[:min(n, 4)] != FRAME_MAGIC[:min(n, 4)]:
        raise _reject(BadHeader, f"not a KDN chunk frame: starts {bytes(mv[:4])!r}, "
                                 f"expected {FRAME_MAGIC!r}")
    if n < _PREFIX.size:
        raise _reject(TruncatedFrame, f"frame of {n} bytes ends inside its "
                                      f"{_PREFIX.size}-byte prefix")
    _, hlen = _PREFIX.unpack_from(mv)
    if hlen > MAX_HEADER:
        raise _reject(SizeLimitExceeded, f"frame header length {hlen} exceeds {MAX_HEADER}")
    if hlen <= len(_HX_TAIL) + 8:
        raise _reject(BadLength, f"frame header length {hlen} is too short for a header")
    end = _PREFIX.size + hlen
    if n < end:
        raise _reject(TruncatedFrame, f"frame of {n} bytes ends inside its header, "
                                      f"which ends at byte {end}")
    hb = mv[_PREFIX.size:end]
    try:
        header = msgpack.unpackb(hb, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise _reject(BadHeader, f"frame header is not valid msgpack: {e}") from None
    if not isinstance(header, dict):
        raise _reject(BadHeader, f"frame header is a {type(header).__name__}, not a map")
    version = _field(header, "v", int)
    if version != VERSION:
        raise _reject(UnknownVersion, f"frame format version {version} is not {VERSION}, "
                                      f"the one this build reads")
    stored = bytes(hb[-8:])
    if bytes(hb[-13:-8]) != _HX_TAIL or header.get("hx") != stored:
        raise _reject(BadHeader, "frame header does not end with its checksum field 'hx'")
    if xxhash.xxh3_64_digest(mv[:end - 8]) != stored:
        raise _reject(ChecksumMismatch, f"frame header checksum mismatch: stored "
                                        f"{stored.hex()}, computed "
                                        f"{xxhash.xxh3_64_hexdigest(mv[:end - 8])}")
    return header, end


def _check_fields(header: dict, max_payload: int) -> None:
    """The header's fields: key and ns, dtype, dimensions, codec, sizes, payload checksum."""
    for name in ("key", "ns"):
        if len(_field(header, name, bytes)) != KEY_BYTES:
            raise _reject(BadHeader, f"frame header field {name!r} must be {KEY_BYTES} bytes, "
                                     f"got {len(header[name])}")
    dtype = _field(header, "dtype", str)
    if dtype not in DTYPES and dtype != OPAQUE:
        raise _reject(UnknownDtype, f"frame dtype {dtype!r:.40} is not one of {', '.join(DTYPES)} "
                                    f"or {OPAQUE}")
    dims = _dims(header, dtype)
    codec = _field(header, "codec", str)
    if codec not in _CODECS:
        raise _reject(UnknownCodec, f"frame codec {codec!r:.40} is not registered; "
                                    f"known: {', '.join(codecs())}")
    if dtype == OPAQUE and codec in LOSSY:
        raise _reject(UnknownCodec, f"opaque frame declares lossy codec {codec!r}")
    nbytes, raw = _field(header, "nbytes", int), _field(header, "raw", int)
    if nbytes < 0 or nbytes > max_payload:
        raise _reject(SizeLimitExceeded, f"frame declares a payload of {nbytes} bytes; "
                                         f"the limit is {max_payload}")
    if dtype == OPAQUE:
        if not 1 <= raw <= max_payload:
            raise _reject(BadLength, f"opaque frame declares raw={raw} bytes; it must be "
                                     f"1..{max_payload}")
    else:
        _check_kv_size(dims, dtype, raw, max_payload)
    if codec == "raw" and nbytes != raw:
        raise _reject(BadLength, f"raw frame declares nbytes={nbytes} but raw={raw}")
    xxh = _field(header, "xxh", int)
    if not 0 <= xxh < 2**64:
        raise _reject(BadHeader, f"frame checksum xxh={xxh} is not a uint64")


def _dims(header: dict, dtype: str) -> list:
    """[layers, heads, head_dim, tokens], each within its limit (0 in an opaque frame)."""
    least = 0 if dtype == OPAQUE else 1     # an opaque frame declares no KV dimensions
    dims = []
    for name, limit in _DIMS:
        size = _field(header, name, int)
        if dtype == OPAQUE and size != 0:
            raise _reject(BadHeader, f"opaque frame declares {name}={size}; it must be 0")
        if size < least:
            raise _reject(BadHeader, f"frame header field {name!r} must be >= 1, got {size}")
        if size > limit:
            raise _reject(SizeLimitExceeded,
                          f"frame declares {name}={size}, over the limit {limit}")
        dims.append(size)
    return dims


def _check_kv_size(dims, dtype: str, raw: int, max_payload: int) -> None:
    """raw is the size of the KV the frame's dimensions and dtype describe, within the limit."""
    layers, heads, head_dim, tokens = dims
    expected = layers * 2 * heads * tokens * head_dim * DTYPES[dtype][2]
    if expected > max_payload:
        raise _reject(SizeLimitExceeded, f"frame declares a {expected}-byte chunk "
                                         f"({layers}x2x{heads}x{tokens}x{head_dim} {dtype}); "
                                         f"the limit is {max_payload}")
    if raw != expected:
        raise _reject(BadLength, f"frame declares raw={raw} bytes but its shape "
                                 f"({layers}x2x{heads}x{tokens}x{head_dim} {dtype}) is {expected}")


def frame_size(header: dict, payload_offset: int) -> int:
    """Total bytes of the frame whose header read_header() returned."""
    return payload_offset + header["nbytes"]


def decode(buf, *, verify: bool = True, max_payload: int = MAX_PAYLOAD) -> Chunk:
    """The chunk in buf, which must hold exactly one frame; zero-copy.

    The result's kv is a view of buf: read-only if buf is (bytes), and only valid while
    buf's contents stay unchanged. verify=False skips the payload checksum (the header is
    always checked): only for bytes this process verified itself.
    """
    mv = _byte_view(buf)
    header, off = read_header(mv, max_payload=max_payload)
    end = frame_size(header, off)
    if len(mv) < end:
        raise _reject(TruncatedFrame, f"frame of {len(mv)} bytes ends inside its "
                                      f"{header['nbytes']}-byte payload, which ends at {end}")
    if len(mv) > end:
        raise _reject(BadLength, f"{len(mv) - end} bytes follow the frame's end at byte {end}: "
                                 f"decode() takes exactly one frame")
    payload = mv[off:end]
    if verify:
        xxh = xxhash.xxh3_64_intdigest(payload)
        if xxh != header["xxh"]:
            raise _reject(ChecksumMismatch, f"payload checksum mismatch for chunk "
                                            f"{header['key'].hex()}: header says "
                                            f"{header['xxh']:016x}, payload hashes to {xxh:016x}")
    else:
        counters["checksum_skipped"] += 1
    try:
        kv = _CODECS[header["codec"]][1](payload, header)
    except FrameError:
        counters["rejected"] += 1
        raise
    except Exception as e:
        raise _reject(FrameError, f"codec {header['codec']!r} cannot decode the payload of "
                                  f"chunk {header['key'].hex()}: {e}") from None
    if header["dtype"] == OPAQUE:
        shape, storage = (header["raw"],), np.dtype(np.uint8)
    else:
        shape = (header["layers"], 2, header["heads"], header["tokens"], header["head_dim"])
        storage = DTYPES[header["dtype"]][0]
    if not isinstance(kv, np.ndarray) or kv.shape != shape or kv.dtype != storage \
            or not kv.flags.c_contiguous:
        got = f"{kv.shape} {kv.dtype}" if isinstance(kv, np.ndarray) else type(kv).__name__
        raise _reject(BadLength, f"codec {header['codec']!r} returned {got}, "
                                 f"expected C-contiguous {shape} {storage}")
    chunk = Chunk(header["key"], header["ns"], kv, header["dtype"])
    if verify and header["codec"] == "raw" and not kv.flags.writeable:
        object.__setattr__(chunk, "_xxh", header["xxh"])
    counters["decoded"] += 1
    counters["decoded_bytes"] += end
    return chunk


class Encoded:
    """A chunk kept as one compressed frame: an edge storing KV compressed, or a chunk sent
    compressed over a slow link. Its key, ns, codec and sizes are known without decoding;
    the frame is a uint8 numpy array, so it rides Ray's object store zero-copy like a Chunk.

    `exact` is False when the codec is lossy: the decoded KV then differs (slightly) from
    the KV that was published, and a manifest's per-chunk checksum cannot verify it (the
    frame's own payload checksum still does: nothing corrupt is ever decoded).
    """
    __slots__ = ("key", "ns", "codec", "dtype", "raw", "exact", "frame")

    def __init__(self, key: bytes, ns: bytes, codec: str, dtype: str, raw: int, exact: bool,
                 frame: np.ndarray):
        self.key, self.ns, self.codec, self.dtype = key, ns, codec, dtype
        self.raw, self.exact, self.frame = raw, exact, frame

    def __reduce__(self):
        return (Encoded, (self.key, self.ns, self.codec, self.dtype, self.raw, self.exact,
                          self.frame))

    nbytes = property(lambda self: self.frame.nbytes)    # what it costs to hold or send

    def __repr__(self):
        return (f"Encoded(key={self.key.hex()}, codec={self.codec}, "
                f"{self.nbytes} of {self.raw} bytes)")

    @staticmethod
    def _exact(header) -> bool:
        """Lossless codec, or a lossy one that kept the raw bytes (payload as long as the KV)."""
        return header["codec"] not in LOSSY or header["nbytes"] == header["raw"]

    @classmethod
    def of(cls, chunk: Chunk, codec: str) -> "Encoded":
        """chunk as one frame in codec (kdn.core.codecs; "raw" is allowed: a frame of the raw KV)."""
        return cls.from_frame(encode(chunk, codec))

    @classmethod
    def from_frame(cls, buf) -> "Encoded":
        """An Encoded around one frame (its header checked, its payload not yet)."""
        header, off = read_header(buf)
        frame = np.frombuffer(buf, dtype=np.uint8)
        if frame.nbytes != frame_size(header, off):
            raise _reject(BadLength, f"buffer of {frame.nbytes} bytes is not one frame of "
                                     f"{frame_size(header, off)}")
        return cls(header["key"], header["ns"], header["codec"], header["dtype"], header["raw"],
                   cls._exact(header), frame)

    def verify(self, expected: "int | None" = None) -> None:
        """FrameError unless the frame is intact and, for exact KV with an `expected` manifest
        checksum, decodes to exactly the published KV. Lossy KV is not the published KV by
        design: only its frame's own checksums (and its format, on decode) can vouch for it."""
        if expected is not None and self.exact:
            self.decode().verify(expected)
        else:
            self.check_frame()

    def check_frame(self) -> None:
        """Check the frame's header and payload checksums without decoding (FrameError if not)."""
        header, off = read_header(self.frame)
        payload = memoryview(self.frame)[off:frame_size(header, off)]
        if xxhash.xxh3_64_intdigest(payload) != header["xxh"]:
            raise _reject(ChecksumMismatch, f"payload checksum mismatch for chunk {self.key.hex()}")

    def decode(self) -> Chunk:
        """The chunk, its frame fully verified (header and payload checksums, codec format)
        and consistent with what this object says it is."""
        header, _ = read_header(self.frame)
        said = (self.key, self.ns, self.codec, self.dtype, self.raw, self.exact)
        found = (header["key"], header["ns"], header["codec"], header["dtype"], header["raw"],
                 self._exact(header))
        if said != found:
            raise _reject(BadHeader, f"frame of chunk {header['key'].hex()} ({header['codec']}, "
                                     f"{header['dtype']}) is not the one it was kept as "
                                     f"({self.key.hex()}, {self.codec}, {self.dtype})")
        return decode(self.frame)


def as_chunk(obj) -> Chunk:
    """A Chunk from a Chunk or an Encoded (decoded and verified)."""
    return obj.decode()


def check_objects(chunks, most: int, call: str) -> None:
    """BadRequest unless chunks is a list (or tuple) of at most `most` opaque Chunks (another
    cache layer's objects: kdn.integrations.objects), naming `call` and the first that is not."""
    from kdn.core.errors import BadRequest
    if not isinstance(chunks, (list, tuple)) or len(chunks) > most:
        raise BadRequest(f"{call} takes a list of at most {most} chunks, got "
                         f"{len(chunks) if isinstance(chunks, (list, tuple)) else type(chunks).__name__}")
    bad = next((i for i, c in enumerate(chunks) if not (isinstance(c, Chunk) and c.opaque)), None)
    if bad is not None:
        raise BadRequest(f"{call}: item {bad} is not an opaque Chunk")
