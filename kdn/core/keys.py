"""Chunk keys: chained 128-bit xxh3 digests that name a chunk of tokens and its whole prefix.

A prompt is cut into chunks of CHUNK_TOKENS tokens (the last one may be shorter). Chunk i's
key is xxh3_128(key_{i-1} || token ids of chunk i as little-endian uint32), and key_{-1} is
the namespace digest of (tenant, model fingerprint). Because every key folds in its parent,
a hit on key i means the first i+1 chunks match exactly, and because the chain starts at the
namespace, one tenant can neither name nor read another's chunks, nor one model another's.

Keys must be the same in every process, machine and Python version — a worker computes the
keys of its own prompt and expects the edge, filled by the origin, to know them. So: never
the hash builtin, a fixed byte encoding of the tokens (uint32 LE, whatever the input type), and
a fixed encoding of the namespace. Tokens are converted to one uint32 array once and hashed
slice by slice; there is no per-token Python work (1M tokens hash in about a millisecond).

A knowledge base of L tokens is published with the chunking of its own L tokens, trailing
partial chunk included (a 1,000-token KB has 4 keys, the last over 232 tokens). A prompt
that is the KB followed by a question finds that last chunk with
prompt_keys(prompt, ns, boundary=L), which chunks exactly as the publisher did.
"""
import operator
import re

import numpy as np
import xxhash

from kdn.core.errors import BadRequest, BadTokens

CHUNK_TOKENS = 256
# Limits every node and client agrees on: the longest KB the origin commits, and the most
# keys one fetch may name (4M tokens at 256 tokens a chunk; a longer prompt is fetched in parts).
MAX_TOKENS_PER_KB = 1 << 24
MAX_FETCH_KEYS = 16384
MAX_KEYS_PER_CALL = 1 << 22   # keys one operator or origin call may name: a whole KB's, in chunks of 4+ tokens
KEY_BYTES = 16
NS_PREFIX = b"kdn-ns-v1\0"
MAX_TOKEN = 2**32 - 1

_HEX_KEY = re.compile(r"[0-9a-fA-F]{32}")
_TOKEN_DTYPE = np.dtype("<u4")


def namespace_digest(tenant: str, fingerprint: str) -> bytes:
    """The 16-byte namespace digest that starts every key chain of (tenant, fingerprint)."""
    parts = []
    for name, value in (("tenant", tenant), ("fingerprint", fingerprint)):
        if not isinstance(value, str) or not value:
            raise BadRequest(f"namespace {name} must be a non-empty str, got {value!r}")
        if "\0" in value:  # NUL separates the fields: allowing it would make two namespaces collide
            raise BadRequest(f"namespace {name} must not contain NUL, got {value!r}")
        try:
            parts.append(value.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise BadRequest(f"namespace {name} is not encodable as UTF-8: {value!r} ({e})") \
                from None
    return xxhash.xxh3_128_digest(NS_PREFIX + parts[0] + b"\0" + parts[1])


def as_token_array(tokens) -> np.ndarray:
    """Token ids as a C-contiguous little-endian uint32 1-D array (no copy if already one).

    Accepts a list/tuple/range of ints, a numpy integer array or a torch integer tensor.
    Raises BadTokens for anything that is not a 1-D sequence of integers in [0, 2**32).
    """
    if type(tokens).__module__.split(".")[0] == "torch":
        if tokens.is_floating_point() or tokens.is_complex():
            raise BadTokens(f"token ids must be integers, got a torch tensor of {tokens.dtype}")
        try:
            tokens = tokens.detach().cpu().numpy()
        except (TypeError, RuntimeError) as e:
            raise BadTokens(f"cannot read token tensor of {tokens.dtype}: {e}") from None
    try:
        arr = np.asarray(tokens)
    except (OverflowError, ValueError, TypeError) as e:
        raise BadTokens(f"token ids are not an integer sequence: {e}") from None
    if arr.ndim != 1:
        raise BadTokens(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=_TOKEN_DTYPE)
    if arr.dtype.kind not in "iu":
        raise BadTokens(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype == _TOKEN_DTYPE:
        return np.ascontiguousarray(arr)
    if arr.dtype.kind == "i":
        lo = int(arr.min())
        if lo < 0:
            raise BadTokens(f"token ids must be >= 0, got {lo} at index {int(arr.argmin())}")
    if arr.dtype.itemsize > 4:
        hi = int(arr.max())
        if hi > MAX_TOKEN:
            raise BadTokens(f"token ids must be < 2**32, got {hi} at index {int(arr.argmax())}")
    return arr.astype(_TOKEN_DTYPE)


def _count(value, what, minimum):
    if isinstance(value, bool):
        raise BadRequest(f"{what} must be an int, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise BadRequest(f"{what} must be an int, got {value!r}") from None
    if n < minimum:
        raise BadRequest(f"{what} must be >= {minimum}, got {n}")
    return n


def chunk_spans(n_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> list:
    """(start, end) of each chunk of n_tokens tokens: full chunks, then the trailing partial one."""
    n = _count(n_tokens, "n_tokens", 0)
    c = _count(chunk_tokens, "chunk_tokens", 1)
    return [(s, min(s + c, n)) for s in range(0, n, c)]


def check_key(key, what: str = "key", error=BadRequest) -> bytes:
    """key as bytes, or `error` naming what is wrong: every key and namespace digest is
    KEY_BYTES bytes (chunks, manifests, stores and requests all check with this)."""
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        shown = f"{len(key)} bytes" if isinstance(key, (bytes, bytearray, memoryview)) \
            else type(key).__name__
        raise error(f"{what} must be {KEY_BYTES} bytes, got {shown}")
    return bytes(key)


def extend_key(parent: bytes, tokens) -> bytes:
    """One step of the chain: the key of a chunk of `tokens` whose prefix has key `parent`."""
    parent = check_key(parent, "parent key")
    arr = as_token_array(tokens)
    if arr.size == 0:
        raise BadTokens("a chunk holds at least one token, got none")
    return xxhash.xxh3_128_digest(parent + memoryview(arr).cast("B"))


def chunk_keys(tokens, ns: bytes, chunk_tokens: int = CHUNK_TOKENS) -> list:
    """One key per chunk_spans() span of tokens, trailing partial chunk included."""
    key = check_key(ns, "namespace digest")
    arr = as_token_array(tokens)
    raw = memoryview(arr).cast("B")
    digest = xxhash.xxh3_128_digest
    keys = []
    for start, end in chunk_spans(len(arr), chunk_tokens):
        key = digest(key + raw[start * 4:end * 4])
        keys.append(key)
    return keys


def prompt_keys(tokens, ns: bytes, chunk_tokens: int = CHUNK_TOKENS, boundary=None) -> list:
    """Keys a prompt is looked up with.

    Without boundary: chunk_keys(tokens), every full chunk plus the partial one. With
    boundary=L (the token length of a knowledge base the prompt starts with, L <= len):
    chunk_keys(tokens[:L]) — the chunking that KB was published with, so its trailing
    partial chunk is found even though the prompt goes on with a question.
    """
    arr = as_token_array(tokens)
    if boundary is not None:
        end = _count(boundary, "boundary", 0)
        if end > len(arr):
            raise BadRequest(f"boundary {end} is beyond the prompt's {len(arr)} tokens")
        arr = arr[:end]
    return chunk_keys(arr, ns, chunk_tokens)


def key_hex(key: bytes) -> str:
    """The 32-character lowercase hex name of a key."""
    return check_key(key).hex()


def key_from_hex(s: str) -> bytes:
    """The key named by 32 hex characters; BadRequest for anything else."""
    if not isinstance(s, str) or not _HEX_KEY.fullmatch(s):
        raise BadRequest(f"a key is 32 hex characters, got {s!r}")
    return bytes.fromhex(s)
