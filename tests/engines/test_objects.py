"""Opaque objects in KDN (kdn.engines.objects) and their frames (kdn.core.chunk's dtype "opaque"):
bytes and checksums round-trip, a corrupt or mis-sized object is never unpacked as good,
frames say "opaque" and never a KV shape, only lossless codecs apply, a forged header is
refused, namespaces separate tenants, layers and models, and bad settings name the field.
No network: the paths through one are in test_lmcache.py and test_sglang.py."""
import numpy as np
import pytest

from kdn.core.chunk import Chunk, Encoded, _frame_prefix, decode, encode, read_header
from kdn.core.errors import BadConfig, BadHeader, BadLength, BadRequest, ChecksumMismatch, UnknownCodec
from kdn.engines.objects import (TRAILER, Tenancy, check_params, object_key, object_namespace,
                                 pack, read_tokens_of, unpack_into)

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


def test_a_corrupt_or_mis_sized_object_is_not_good():
    src = data(5000)
    c = pack(KEY, NS, src)
    out = bytearray(4999)
    assert not unpack_into(c, out)                      # the host asked for another size
    c.kv[1234] ^= 1
    assert not unpack_into(c, bytearray(5000))          # a flipped bit: the checksum catches it


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
