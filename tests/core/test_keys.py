"""Chunk keys: the chain, its byte encoding, determinism across processes, validation."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from kdn.core.errors import BadRequest, BadTokens, KDNError
from kdn.core.keys import (CHUNK_TOKENS, KEY_BYTES, as_token_array, chunk_keys, chunk_spans,
                           extend_key, key_from_hex, key_hex, namespace_digest, prompt_keys)

NS = namespace_digest("acme", "llama-3-8b:abc123")


def reference_keys(tokens, ns, chunk_tokens=CHUNK_TOKENS):
    """The documented formula, written the slow obvious way."""
    keys, parent = [], ns
    for s in range(0, len(tokens), chunk_tokens):
        data = b"".join(struct.pack("<I", t) for t in tokens[s:s + chunk_tokens])
        parent = xxhash.xxh3_128_digest(parent + data)
        keys.append(parent)
    return keys


def test_namespace_digest_is_the_documented_formula():
    assert NS == xxhash.xxh3_128_digest(b"kdn-ns-v1\0acme\0llama-3-8b:abc123")
    assert len(NS) == KEY_BYTES == 16
    assert namespace_digest("é", "f") == xxhash.xxh3_128_digest("kdn-ns-v1\0é\0f".encode())


@pytest.mark.parametrize("tenant,fp,needle", [
    ("", "f", "tenant"), ("t", "", "fingerprint"), (None, "f", "tenant"),
    ("t", b"f", "fingerprint"),
    ("a\0b", "f", "NUL"), ("t", "\ud800", "UTF-8"),
])
def test_namespace_digest_validates(tenant, fp, needle):
    with pytest.raises(BadRequest, match=needle):
        namespace_digest(tenant, fp)


def test_golden_keys_never_change():
    # Pinned bytes: a change here orphans every published chunk everywhere.
    ns = namespace_digest("t", "f")
    assert ns.hex() == "ef41ac11b5acbddddc81959617e0e234"
    assert [key_hex(k) for k in chunk_keys(range(600), ns)] == [
        "0292d2271fdd53c0ca79cf8ba36c6782",
        "f029067950f3c845ecea0cc722f21d30",
        "f72c04dffdce6df34d53e514a56835df",
    ]
    assert chunk_keys(range(600), ns) == reference_keys(list(range(600)), ns)


def test_chunk_spans():
    assert chunk_spans(0) == []
    assert chunk_spans(1000) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert chunk_spans(512) == [(0, 256), (256, 512)]
    assert chunk_spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_spans(np.int64(3), np.int32(3)) == [(0, 3)]


@pytest.mark.parametrize("args,needle", [
    ((10, 0), "chunk_tokens must be >= 1, got 0"), ((10, -4), "chunk_tokens must be >= 1"),
    ((10, 2.5), "chunk_tokens must be an int"), ((10, True), "chunk_tokens must be an int"),
    ((-1, 256), "n_tokens must be >= 0"), (("9", 256), "n_tokens must be an int"),
])
def test_chunk_spans_validates(args, needle):
    with pytest.raises(BadRequest, match=needle):
        chunk_spans(*args)


def test_chunk_keys_validates_chunk_tokens_and_ns():
    with pytest.raises(BadRequest, match="chunk_tokens must be >= 1"):
        chunk_keys([1, 2], NS, chunk_tokens=0)
    with pytest.raises(BadRequest, match="namespace digest must be 16 bytes, got 3"):
        chunk_keys([1, 2], b"abc")


def test_1000_tokens_have_4_keys_and_match_the_reference():
    tokens = list(range(100_000, 101_000))
    keys = chunk_keys(tokens, NS)
    assert len(keys) == 4 and all(len(k) == 16 for k in keys)
    assert keys == reference_keys(tokens, NS)
    assert len(set(keys)) == 4


def test_every_input_type_gives_the_same_keys():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2**32, size=700, dtype=np.uint64)
    expect = reference_keys([int(t) for t in base], NS)
    small = rng.integers(0, 2**31, size=700)
    expect_small = reference_keys([int(t) for t in small], NS)
    assert chunk_keys([int(t) for t in base], NS) == expect
    assert chunk_keys(tuple(int(t) for t in base), NS) == expect
    assert chunk_keys(base, NS) == expect                                   # uint64
    assert chunk_keys(base.astype(np.int64), NS) == expect                  # int64
    assert chunk_keys(base.astype(">u4"), NS) == expect                     # big-endian input
    assert chunk_keys(torch.from_numpy(base.astype(np.int64)), NS) == expect
    assert chunk_keys(small.astype(np.int32), NS) == expect_small
    assert chunk_keys(torch.tensor(small.tolist(), dtype=torch.int32), NS) == expect_small
    strided = np.repeat(small, 2)[::2]                                      # non-contiguous view
    assert chunk_keys(strided, NS) == expect_small


def test_as_token_array():
    a = np.arange(10, dtype="<u4")
    assert as_token_array(a) is a                                           # no copy when canonical
    out = as_token_array([3, 2**32 - 1])
    assert out.dtype == np.dtype("<u4") and out.tolist() == [3, 2**32 - 1]
    assert as_token_array([]).dtype == np.dtype("<u4") and as_token_array([]).size == 0
    assert as_token_array(np.array([5], np.int8)).tolist() == [5]


@pytest.mark.parametrize("tokens,needle", [
    ([1.0, 2.0], "must be integers, got dtype float64"),
    ([1, -3], "must be >= 0, got -3 at index 1"),
    (np.array([7, -1], np.int16), "must be >= 0, got -1 at index 1"),
    ([0, 2**32], "must be < 2\\*\\*32, got 4294967296 at index 1"),
    (np.array([2**40], np.uint64), "must be < 2\\*\\*32"),
    ([2**70], "integer"),
    ([[1, 2], [3, 4]], "must be 1-D, got shape \\(2, 2\\)"),
    (5, "must be 1-D, got shape \\(\\)"),
    ([True, False], "got dtype bool"),
    (["1", "2"], "must be integers"),
    (torch.tensor([1.0]), "torch tensor of torch.float32"),
    (torch.tensor([1.0], dtype=torch.bfloat16), "torch tensor of torch.bfloat16"),
])
def test_bad_tokens_are_refused(tokens, needle):
    with pytest.raises(BadTokens, match=needle):
        chunk_keys(tokens, NS)


def test_prompt_keys_finds_the_kbs_trailing_partial_chunk():
    rng = np.random.default_rng(2)
    kb = rng.integers(0, 50_000, size=1000).tolist()
    question = rng.integers(0, 50_000, size=40).tolist()
    published = chunk_keys(kb, NS)
    assert len(published) == 4
    looked_up = prompt_keys(kb + question, NS, boundary=1000)
    assert looked_up == published
    assert looked_up[-1] == published[-1]
    # without the boundary, the prompt's own chunking differs in the last chunk only
    plain = prompt_keys(kb + question, NS)
    assert plain[:3] == published[:3] and plain[3] != published[3]
    assert plain == chunk_keys(kb + question, NS)
    assert prompt_keys(kb, NS, boundary=0) == []


def test_prompt_keys_validates_boundary():
    with pytest.raises(BadRequest, match="boundary 11 is beyond the prompt's 10 tokens"):
        prompt_keys(list(range(10)), NS, boundary=11)
    with pytest.raises(BadRequest, match="boundary must be >= 0"):
        prompt_keys(list(range(10)), NS, boundary=-1)
    with pytest.raises(BadRequest, match="boundary must be an int"):
        prompt_keys(list(range(10)), NS, boundary=2.0)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 900), chunk=st.sampled_from([1, 7, 64, 256]), data=st.data())
def test_changing_one_token_changes_that_chunk_and_every_later_key(n, chunk, data):
    tokens = np.arange(n, dtype=np.int64) * 7919 % 150_000
    pos = data.draw(st.integers(0, n - 1))
    changed = tokens.copy()
    changed[pos] = (changed[pos] + data.draw(st.integers(1, 1000))) % 2**32
    a, b = chunk_keys(tokens, NS, chunk), chunk_keys(changed, NS, chunk)
    hit = pos // chunk
    assert a[:hit] == b[:hit]
    assert all(x != y for x, y in zip(a[hit:], b[hit:]))


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=300), chunk=st.integers(1, 70))
def test_chain_equals_extend_key_steps(tokens, chunk):
    keys = chunk_keys(tokens, NS, chunk)
    parent, steps = NS, []
    for s, e in chunk_spans(len(tokens), chunk):
        parent = extend_key(parent, tokens[s:e])
        steps.append(parent)
    assert keys == steps == reference_keys(tokens, NS, chunk)


def test_extend_key_validates():
    with pytest.raises(BadRequest, match="parent key must be 16 bytes, got 15"):
        extend_key(b"x" * 15, [1])
    with pytest.raises(BadTokens, match="at least one token"):
        extend_key(NS, [])


def test_namespaces_separate_every_key():
    tokens = list(range(1000))
    other_tenant = chunk_keys(tokens, namespace_digest("other", "llama-3-8b:abc123"))
    other_model = chunk_keys(tokens, namespace_digest("acme", "llama-3-8b:abc124"))
    mine = chunk_keys(tokens, NS)
    assert not set(mine) & set(other_tenant) and not set(mine) & set(other_model)
    # the NUL separator keeps ("ab", "c") and ("a", "bc") apart
    assert namespace_digest("ab", "c") != namespace_digest("a", "bc")


def test_keys_are_the_same_in_other_processes_and_hash_seeds():
    script = ("import json, numpy as np; from kdn.core.keys import *\n"
              "ns = namespace_digest('acme', 'llama-3-8b:abc123')\n"
              "t = list(range(100_000, 101_000))\n"
              "print(json.dumps([key_hex(k) for k in chunk_keys(t, ns)] + [ns.hex()]))\n")
    expect = [key_hex(k) for k in chunk_keys(list(range(100_000, 101_000)), NS)] + [NS.hex()]
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                             text=True, check=True, timeout=120)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == expect


def test_key_hex_round_trip_and_validation():
    k = chunk_keys([1, 2, 3], NS)[0]
    s = key_hex(k)
    assert len(s) == 32 and s == s.lower() and key_from_hex(s) == k
    assert key_from_hex(s.upper()) == k
    for bad in ("", "ab", s[:-1], s + "0", "g" * 32, " " + s[1:], 12, None, s.encode()):
        with pytest.raises(BadRequest, match="32 hex characters"):
            key_from_hex(bad)
    with pytest.raises(BadRequest, match="key must be 16 bytes, got 4"):
        key_hex(b"abcd")
    assert issubclass(BadRequest, KDNError)
