"""Conversation KV: the keys, scope and lifetime of the KV of any prompt a worker computed.

A conversation's prompt (an agent's history, a plain chat) is cut into CHUNK_TOKENS-token
chunks and keyed by the one key rule (kdn.core.keys: key_i = xxh3_128(key_{i-1} ‖ chunk i)),
so a next turn whose prompt starts with the whole history finds its longest cached prefix by
its keys. Its whole chunks are kept, and its trailing partial chunk (the tail: what the
answer's last chunk holds so far) beside them, keyed by the same rule over its own tokens
(tail_key: xxh3_128(key of the last whole chunk ‖ the tail's tokens)), so a next turn on
another replica recomputes only its new tokens. A tail is the one key of its tokens after
that chunk, so it stays exact; the next turn's chunk at that place is longer and has another
key, so the home edge lists the tails it holds after a whole chunk (EdgeNode.conversation_find)
and the reader takes the longest one its own prompt reproduces.

What differs from a published KB is who may name the keys and where the bytes live:
- the chain starts at a conversation namespace, conversation_namespace(tenant, fingerprint,
  scope), never at the KB's: a tenant's KB chunks stay the KB's, and conversation chunks are
  never mistaken for published ones;
- the scope names the conversation's **home edge** (one edge of the region that computed it,
  chosen by rendezvous hashing on the conversation's first key: kdn.placement.ring.owners_in)
  and, when the caller narrowed it, a digest of its salt. A key therefore lives in exactly one
  edge, which keeps the first bytes stored under it: "a key means one byte string" holds for
  soft KV too, with no origin to arbitrate (another region computing the same turns keys them
  under its own home edge);
- the tenant is the one the request authenticated as (its token), never one the caller names:
  a salt (`cache_salt`, OpenAI's `safety_identifier` or `user`) only narrows the namespace
  inside that tenant, so a copied salt under another token reads nothing of it.

Lifetime: an idle TTL (default IDLE_TTL_S, set per tenant by the operator within
[MIN_TTL_S, MAX_TTL_S]; a request's `prompt_cache_retention` picks "in_memory", the tenant's
TTL, or "24h", up to the tenant's maximum) and a byte budget per tenant at each edge
(TENANT_BUDGET_BYTES by default). Conversation KV is soft state: it never reaches the origin
unless an operator pins the tenant's conversations (kdn/origin/conversations.py), when the home
edges also keep it there, durably, and read it back from there.
"""
import xxhash

from kdn.core.checks import check_int, check_number
from kdn.core.errors import BadRequest
from kdn.core.keys import CHUNK_TOKENS, as_token_array, check_key, chunk_keys, namespace_digest

CONV_PREFIX = b"kdn-conv-v1\0"
IDLE_TTL_S = 1800.0                 # 30 minutes of no use and a conversation's KV is gone
MIN_TTL_S, MAX_TTL_S = 1.0, 86400.0  # what an operator may set; "24h" asks for the maximum
TENANT_BUDGET_BYTES = 1 << 30       # a tenant's conversation KV at one edge, at most
CONVERSATION_SHARE = 0.5            # an edge's conversation tier, beside its capacity for KBs
MAX_SCOPE_CHARS = 256
MAX_SALT_CHARS = 1024
RETENTIONS = ("in_memory", "24h")   # OpenAI's prompt_cache_retention values


def check_salt(salt, what: str = "cache_salt") -> "str | None":
    """A caller's salt as given (None: none), or BadRequest naming the problem."""
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt or len(salt) > MAX_SALT_CHARS:
        raise BadRequest(f"{what} must be a non-empty string of at most {MAX_SALT_CHARS} "
                         f"characters, got {salt!r:.60}")
    return salt


def conversation_scope(home_edge: str, salt: str = None) -> str:
    """The scope of a conversation: its home edge, and the digest of the caller's salt if any
    (the salt itself never travels: an edge's logs and stats show only its digest)."""
    if not isinstance(home_edge, str) or not home_edge:
        raise BadRequest(f"a conversation's home edge must be a non-empty str, got {home_edge!r:.60}")
    salt = check_salt(salt)
    return home_edge if salt is None else f"{home_edge}/{xxhash.xxh3_64_hexdigest(salt.encode())}"


def home_of(scope: str) -> str:
    """The home edge a scope names."""
    return check_scope(scope).partition("/")[0]


def check_scope(scope) -> str:
    if not isinstance(scope, str) or not 0 < len(scope) <= MAX_SCOPE_CHARS or "\0" in scope:
        raise BadRequest(f"a conversation scope must be 1-{MAX_SCOPE_CHARS} characters without NUL, "
                         f"got {scope!r:.60}")
    return scope


def conversation_namespace(tenant: str, fingerprint: str, scope: str) -> bytes:
    """The 16-byte digest that starts a conversation's key chain in (tenant, fingerprint)."""
    base = namespace_digest(tenant, fingerprint)
    return xxhash.xxh3_128_digest(CONV_PREFIX + base + check_scope(scope).encode("utf-8"))


def claims(claim, ns: bytes) -> bool:
    """Whether claim (tenant, fingerprint, scope) digests to the conversation namespace ns."""
    if not (isinstance(claim, (tuple, list)) and len(claim) == 3
            and all(isinstance(x, str) and x for x in claim)):
        return False
    try:
        return conversation_namespace(*claim) == check_key(ns, "ns")
    except BadRequest:            # a NUL, an overlong scope: digests nothing
        return False


def whole_chunks(n_tokens: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """How many whole chunks n_tokens tokens fill (what a conversation keeps of them)."""
    return check_int(n_tokens, "n_tokens", 0) // chunk_tokens


def conversation_keys(tokens, ns: bytes, chunk_tokens: int = CHUNK_TOKENS) -> list:
    """Keys of the whole chunks of tokens in the chain starting at ns (no partial chunk)."""
    arr = as_token_array(tokens)
    return chunk_keys(arr[:whole_chunks(len(arr), chunk_tokens) * chunk_tokens], ns, chunk_tokens)


def tail_key(after: bytes, tokens, chunk_tokens: int = CHUNK_TOKENS) -> bytes:
    """The key of a conversation's trailing partial chunk: tokens (fewer than a chunk) after
    the whole chunk whose key is after (the one key rule, kdn.core.keys.chunk_keys)."""
    arr = as_token_array(tokens)
    if not 0 < len(arr) < chunk_tokens:
        raise BadRequest(f"a conversation's tail has 1 to {chunk_tokens - 1} tokens, got {len(arr)}")
    return chunk_keys(arr, check_key(after, "the key before a tail"), chunk_tokens)[0]


def first_key(tokens, tenant: str, fingerprint: str, start_chunk: int,
              chunk_tokens: int = CHUNK_TOKENS) -> "bytes | None":
    """The key that picks a conversation's home edge: of its first chunk after the KB's whole
    chunks (start_chunk), in the tenant's plain chain; None when the prompt has no such whole
    chunk (nothing of it would be kept)."""
    arr = as_token_array(tokens)
    if whole_chunks(len(arr), chunk_tokens) <= start_chunk:
        return None
    end = (start_chunk + 1) * chunk_tokens
    return chunk_keys(arr[:end], namespace_digest(tenant, fingerprint), chunk_tokens)[-1]


def reproduced(computed, rerendered) -> int:
    """How many leading token ids two renderings of one conversation share: the KV of
    `computed` (the prompt and the tokens generated) is kept only that far, since the next
    turn's prompt (`rerendered`: the answer put back through the chat template) is what will
    be looked up, and a tokenizer may render an answer's text other than as it was generated."""
    a, b = as_token_array(computed), as_token_array(rerendered)
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()[0]
    return int(diff[0]) if len(diff) else n


def check_ttl(ttl_s, what: str = "conversation TTL") -> float:
    return check_number(ttl_s, what, MIN_TTL_S, MAX_TTL_S)


def check_budget(nbytes, what: str = "conversation budget") -> int:
    return check_int(nbytes, what, 0)


def retention_ttl(retention, tenant_ttl_s: float, tenant_max_s: float = MAX_TTL_S) -> float:
    """The idle TTL a request's prompt_cache_retention asks for, within the tenant's bounds:
    None or "in_memory": the tenant's TTL; "24h": a day, capped by the tenant's maximum."""
    if retention is None or retention == "in_memory":
        return float(tenant_ttl_s)
    if retention == "24h":
        return float(min(MAX_TTL_S, tenant_max_s))
    raise BadRequest(f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, "
                     f"got {retention!r:.40}")
