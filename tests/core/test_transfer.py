"""The link cost model and store/reader policy (kdn/core/transfer.py): which form crosses a link
soonest, re-encoding only for a clear gain, a measured profile, who may store what."""
import numpy as np
import pytest

from kdn.core import codecs as kc
from kdn.core import transfer as kt
from kdn.core.errors import BadRequest


def kv_like(shape, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.linspace(0.1, 4, shape[-1])).astype(np.float32)


def test_choose_codec_by_link():
    n = 10 << 20
    assert kt.choose_codec(n, 0.1, same_node=True) == "raw"
    assert kt.choose_codec(n, 0.02, same_node=False) == "zstd"       # slow WAN: compress
    assert kt.choose_codec(n, 100.0, same_node=False) == "raw"       # faster than encoding
    assert kt.choose_codec(n, 0.02, same_node=False, allowed=("q8", "q4", "q4z")) in ("q4", "q4z")
    assert kt.choose_codec(n, 0.02, same_node=False, allowed=kc.LOSSY) == "k4v3z"   # smallest
    assert kt.choose_codec(0, 0.02, same_node=False) == "raw"
    # already stored as q4z: sending it on as is costs no encode, the receiver decodes
    t_stored = kt.transfer_seconds("q4z", n, 10.0, stored="q4z")
    assert t_stored < kt.transfer_seconds("q4z", n, 10.0)
    with pytest.raises(Exception, match="no profile"):
        kt.choose_codec(n, 1.0, False, allowed=("nope",))


def test_choose_codec_re_encodes_only_for_a_clear_gain():
    n = 10 << 20
    # at 0.1 GB/s zstd from raw is estimated ~1% faster than raw: not worth re-encoding
    raw_s = kt.transfer_seconds("raw", n, 0.1)
    assert kt.transfer_seconds("zstd", n, 0.1) < raw_s
    assert kt.transfer_seconds("zstd", n, 0.1) > kt.MIN_GAIN * raw_s
    assert kt.choose_codec(n, 0.1, same_node=False) == "raw"
    # stored zstd already: sending it as it is costs no encode, and wins
    assert kt.choose_codec(n, 0.1, same_node=False, allowed=("zstd",), stored="zstd") == "zstd"
    # stored lossy q8z, reader accepts it: kept even where raw would be as fast
    assert kt.choose_codec(n, 50.0, same_node=False, allowed=("q8z",), stored="q8z") == "q8z"


def test_measured_profile_drives_the_choice():
    kv = kv_like((2, 2, 2, 64, 64))
    prof = kt.measure_profile(kv, "float32", codecs=("zstd", "q4"), reps=2)
    assert prof["q4"]["ratio"]["float32"] > 6 and prof["q4"]["ratio"]["float16"] > 3
    assert prof["zstd"]["decode_gbps"] > 0
    # 1 MB/s: q4's 7x fewer bytes save ~0.9 s, far more than any encode time
    assert kt.choose_codec(1 << 20, 0.001, False, allowed=("zstd", "q4"), profile=prof) == "q4"


def test_store_codecs_edges_may_go_lossy_the_origin_never():
    assert kt.check_store_codec("k4v3z", "edge") == "k4v3z"
    assert kt.check_store_codec("zstd", "origin") == "zstd"
    with pytest.raises(BadRequest, match="lossy codec 'q8'"):
        kt.check_store_codec("q8", "origin")
    with pytest.raises(BadRequest, match="edge store codec must be one of"):
        kt.check_store_codec("gzip", "edge")


def test_accept_names_codecs_and_defaults_to_lossless():
    assert kt.check_accept(None) == kc.LOSSLESS
    assert kt.check_accept(["raw", "q8z"]) == ("q8z",)
    with pytest.raises(BadRequest, match="unknown codec"):
        kt.check_accept(["nope"])
    with pytest.raises(BadRequest, match="list of codec names"):
        kt.check_accept("zstd")
