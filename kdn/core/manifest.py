"""Knowledge-base manifests: the one description of a published KB version that every node shares.

A manifest names a KB version under a namespace (tenant, model fingerprint) and lists its
documents, their token ranges, and every chunk key in order. With it a worker knows which
keys to ask for, an edge knows what to pin or prefetch, and the origin knows which chunks a
live version still references (everything else can be collected).

- `prefix` layout: the documents are concatenated into one token stream, and the keys are
  chunk_keys() of that stream; a document's chunks are those its token range overlaps.
- `segments` layout: each document is chunked on its own (its key chain starts at the
  namespace), and the keys are the documents' keys one after another. start/end still give
  each document's offsets in publication order, so n_tokens is the sum of their lengths.

A Manifest validates itself when it is built, so an invalid one never exists in memory:
names cannot smuggle paths, ranges are inside the token stream, chunk ranges are inside the
keys and agree with the chunking. On the wire and on disk it is msgpack behind a magic, a
format version and an xxh3_64 of the body, so a flipped byte is a ManifestError, not a
silently different KB.

How long an edge keeps a KB's chunks (an operator's TTL, set at the origin or at one edge)
is bounded here too, so the origin and the edges refuse the same values: check_ttl.
"""
import dataclasses
import re
import struct
import time
from dataclasses import dataclass, field

import msgpack
import numpy as np
import xxhash

from kdn.core.checks import check_int, check_number
from kdn.core.errors import KDNError, ManifestError
from kdn.core.keys import CHUNK_TOKENS, KEY_BYTES, as_token_array, check_key, chunk_keys, namespace_digest
from kdn.core.names import unsafe_char

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
LAYOUTS = ("prefix", "segments")
FORMAT = 1
MANIFEST_MAGIC = b"KDNM"
_PREAMBLE = struct.Struct("<4sHQ")    # magic, format version, xxh3_64 of the body
MAX_MANIFEST_BYTES = 256 << 20       # 16M keys: far beyond any KB; refuse absurd input
MAX_META_BYTES = 64 << 10
MAX_CHUNK_TOKENS = 1 << 20
MAX_DOC_NAME = 1024
MAX_TTL_S = 10 * 365 * 86400.0       # ten years: anything longer is a mistake, not a TTL


def check_name(value, what: str) -> str:
    """`value` if it is a safe KB name or tenant (usable as a path component), else ManifestError."""
    if not isinstance(value, str) or not NAME_RE.fullmatch(value) or ".." in value:
        why = isinstance(value, str) and unsafe_char(value)
        raise ManifestError(f"{what} must match {NAME_RE.pattern} and not contain '..', got {value!r:.200}"
                            + (f" (it holds {why})" if why else ""))
    return value


def check_ttl(value) -> float:
    """A TTL in seconds as a float: a finite number in (0, MAX_TTL_S]; BadRequest otherwise."""
    return check_number(value, "ttl_s (seconds)", 0, MAX_TTL_S, open_lo=True)


def _int(value, what, lo=0, hi=None):
    return check_int(value, what, lo, hi, error=ManifestError)


def _str(value, what, maxlen=1024):
    """value if a non-empty str of at most maxlen characters without NUL, else ManifestError."""
    if not isinstance(value, str) or not value or len(value) > maxlen or "\0" in value:
        raise ManifestError(f"{what} must be a non-empty str of at most {maxlen} chars without NUL, "
                            f"got {value!r:.200}")
    return value


def _shown(value, what):
    """value unless it holds a character that rewrites what a terminal shows
    (kdn.core.names.unsafe_char), else ManifestError naming it. Checked where a name is new
    (Manifest.build, the origin's commit: Manifest.check_names), not where a stored manifest
    is read back, so a KB published before the rule stays readable."""
    if unsafe_char(value):
        raise ManifestError(f"{what} {value!r:.200} holds {unsafe_char(value)}; names may not hold "
                            f"control or bidirectional-control characters")
    return value


def token_digest(tokens) -> str:
    """Hex xxh3_128 of token ids as little-endian uint32: a document's content digest."""
    return xxhash.xxh3_128_hexdigest(memoryview(as_token_array(tokens)).cast("B"))


@dataclass(frozen=True)
class Document:
    """One document of a KB: its token range in publication order and its chunk range in keys."""
    name: str
    start: int
    end: int
    first_chunk: int
    n_chunks: int
    digest: str

    def __post_init__(self):
        _str(self.name, "document name", MAX_DOC_NAME)
        _int(self.start, f"document {self.name!r} start")
        _int(self.end, f"document {self.name!r} end", self.start)
        _int(self.first_chunk, f"document {self.name!r} first_chunk")
        _int(self.n_chunks, f"document {self.name!r} n_chunks")
        if not isinstance(self.digest, str) or not re.fullmatch(r"[0-9a-f]{1,128}", self.digest):
            raise ManifestError(f"document {self.name!r} digest must be lowercase hex, got {self.digest!r}")

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> "Document":
        if not isinstance(d, dict):
            raise ManifestError(f"a document must be a dict, got {type(d).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        missing = [f for f in fields if f not in d]
        extra = sorted(str(k) for k in d if k not in fields)
        if missing or extra:
            raise ManifestError(f"document {d.get('name')!r}: missing field(s) {missing}, unknown field(s) {extra}")
        return cls(**{f: d[f] for f in fields})


@dataclass(frozen=True)
class Manifest:
    """A knowledge-base version: documents, chunk keys, and small operator metadata."""
    name: str
    version: "int | None"
    tenant: str
    fingerprint: str
    layout: str
    chunk_tokens: int
    n_tokens: int
    documents: tuple
    keys: tuple
    created: float = field(default_factory=time.time)
    meta: dict = field(default_factory=dict)
    tokens: bytes = b""    # the KB's token ids (uint32 LE), so a worker can build the prompt; optional
    sums: tuple = ()       # xxh3_64 of each chunk's KV bytes, in key order: end-to-end integrity; optional

    def __post_init__(self):
        check_name(self.name, "manifest name")
        check_name(self.tenant, "manifest tenant")
        if self.version is not None:
            _int(self.version, "manifest version", 1)
        _str(self.fingerprint, "manifest fingerprint")
        if self.layout not in LAYOUTS:
            raise ManifestError(f"manifest layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        _int(self.chunk_tokens, "manifest chunk_tokens", 1, MAX_CHUNK_TOKENS)
        _int(self.n_tokens, "manifest n_tokens")
        object.__setattr__(self, "created", check_number(self.created, "manifest created (a time)", 0,
                                                         error=ManifestError))
        self._check_meta()
        object.__setattr__(self, "keys", self._check_keys(self.keys))
        object.__setattr__(self, "documents", self._check_documents(self.documents))
        self._check_tokens()
        self._check_sums()

    def _check_sums(self):
        sums = self.sums
        if isinstance(sums, (str, bytes)) or not isinstance(sums, (list, tuple)):
            raise ManifestError(f"manifest sums must be a list of ints, got {type(sums).__name__}")
        if sums and len(sums) != len(self.keys):
            raise ManifestError(f"manifest has {len(sums)} sums for {len(self.keys)} keys")
        for i, v in enumerate(sums):
            _int(v, f"manifest sums[{i}] (a uint64)", 0, 2**64 - 1)
        object.__setattr__(self, "sums", tuple(sums))

    def sum_of(self) -> dict:
        """key -> expected xxh3_64 of its KV bytes (empty when published without sums)."""
        return dict(zip(self.keys, self.sums)) if self.sums else {}

    def _check_tokens(self):
        t = self.tokens
        if not isinstance(t, (bytes, bytearray, memoryview)):
            raise ManifestError(f"manifest tokens must be bytes (uint32 LE ids), got {type(t).__name__}")
        t = bytes(t)
        object.__setattr__(self, "tokens", t)
        if not t:
            return
        if len(t) != 4 * self.n_tokens:
            raise ManifestError(f"manifest tokens hold {len(t)} bytes; {self.n_tokens} tokens need {4 * self.n_tokens}")
        ids = np.frombuffer(t, dtype="<u4")
        for d in self.documents:
            if token_digest(ids[d.start:d.end]) != d.digest:
                raise ManifestError(f"manifest tokens of document {d.name!r} do not match its digest")

    def token_ids(self) -> np.ndarray:
        """The KB's token ids in publication order (ManifestError if it was published without them)."""
        if not self.tokens:
            raise ManifestError(f"KB {self.label()} was published without its token ids")
        return np.frombuffer(self.tokens, dtype="<u4")

    def _check_meta(self):
        if not isinstance(self.meta, dict) or not all(isinstance(k, str) for k in self.meta):
            raise ManifestError(f"manifest meta must be a dict with str keys, got {self.meta!r:.200}")
        try:
            packed = msgpack.packb(self.meta, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as e:
            raise ManifestError(f"manifest meta is not msgpack-able: {e}") from None
        if len(packed) > MAX_META_BYTES:
            raise ManifestError(f"manifest meta is {len(packed)} bytes packed, limit {MAX_META_BYTES}")
        # A private copy: a frozen manifest must not change because a caller's dict did.
        object.__setattr__(self, "meta", msgpack.unpackb(packed, raw=False, strict_map_key=True))

    @staticmethod
    def _check_keys(keys) -> tuple:
        if isinstance(keys, (bytes, str)) or not isinstance(keys, (list, tuple)):
            raise ManifestError(f"manifest keys must be a list of {KEY_BYTES}-byte keys, got {type(keys).__name__}")
        return tuple(check_key(k, f"manifest keys[{i}]", ManifestError) for i, k in enumerate(keys))

    def _check_documents(self, docs) -> tuple:
        if isinstance(docs, (str, bytes, dict)) or not isinstance(docs, (list, tuple)):
            raise ManifestError(f"manifest documents must be a list, got {type(docs).__name__}")
        out, names = [], set()
        prev_end, next_chunk = 0, 0
        ct = self.chunk_tokens
        for i, d in enumerate(docs):
            if isinstance(d, dict):
                d = Document.from_dict(d)
            if not isinstance(d, Document):
                raise ManifestError(f"manifest documents[{i}] must be a Document, got {type(d).__name__}")
            if d.name in names:
                raise ManifestError(f"manifest documents[{i}] name {d.name!r} is not unique")
            names.add(d.name)
            if d.start < prev_end or d.end > self.n_tokens:
                raise ManifestError(
                    f"manifest documents[{i}] ({d.name!r}) token range [{d.start}, {d.end}) must lie in "
                    f"[{prev_end}, {self.n_tokens}] (in order, not overlapping, inside n_tokens)")
            if d.first_chunk + d.n_chunks > len(self.keys):
                raise ManifestError(
                    f"manifest documents[{i}] ({d.name!r}) chunk range [{d.first_chunk}, "
                    f"{d.first_chunk + d.n_chunks}) is beyond the {len(self.keys)} keys")
            if self.layout == "prefix":
                want = (d.start // ct, -(-d.end // ct) - d.start // ct) if d.end > d.start else (d.start // ct, 0)
            else:
                want = (next_chunk, -(-d.tokens // ct))
            if (d.first_chunk, d.n_chunks) != want:
                raise ManifestError(
                    f"manifest documents[{i}] ({d.name!r}) chunk range first_chunk={d.first_chunk} "
                    f"n_chunks={d.n_chunks} disagrees with its tokens [{d.start}, {d.end}) in the "
                    f"{self.layout} layout at {ct} tokens per chunk (want first_chunk={want[0]} n_chunks={want[1]})")
            prev_end, next_chunk = d.end, d.first_chunk + d.n_chunks
            out.append(d)
        if self.layout == "prefix":
            expected = -(-self.n_tokens // ct)
        else:
            expected = next_chunk
            covered = sum(d.tokens for d in out)
            if covered != self.n_tokens or (out and (out[0].start != 0 or any(
                    a.end != b.start for a, b in zip(out, out[1:])))):
                raise ManifestError(
                    f"manifest n_tokens={self.n_tokens}: segments documents must be contiguous from 0 "
                    f"and cover it exactly (they cover {covered})")
        if len(self.keys) != expected:
            raise ManifestError(
                f"manifest has {len(self.keys)} keys; the {self.layout} layout of {self.n_tokens} tokens "
                f"at {ct} tokens per chunk has {expected}")
        return tuple(out)

    def __hash__(self):  # in-memory only (sets, dict keys); meta, a dict, is left out
        ident = f"{self.tenant}\0{self.fingerprint}\0{self.name}\0{self.version}\0".encode()
        return xxhash.xxh3_64_intdigest(ident + b"".join(self.keys))

    # --- derived -----------------------------------------------------------------------
    @property
    def ns(self) -> bytes:
        """The namespace digest every key of this KB is salted with."""
        return namespace_digest(self.tenant, self.fingerprint)

    def token_length(self, names=None) -> int:
        """Tokens of the named documents (all of the KB's tokens when names is None)."""
        if names is None:
            return self.n_tokens
        return sum(self.document(n).tokens for n in names)

    def document(self, name: str) -> Document:
        for d in self.documents:
            if d.name == name:
                return d
        raise ManifestError(f"KB {self.name!r} has no document {name!r}")

    def document_keys(self, name: str) -> tuple:
        """The chunk keys of one document (its own chain in segments, its overlap in prefix)."""
        d = self.document(name)
        return self.keys[d.first_chunk:d.first_chunk + d.n_chunks]

    def with_version(self, version: int) -> "Manifest":
        return dataclasses.replace(self, version=version)

    def label(self) -> str:
        """'tenant/name@vN' for messages and logs."""
        return f"{self.tenant}/{self.name}@v{self.version if self.version is not None else '?'}"

    # --- building ----------------------------------------------------------------------
    @classmethod
    def build(cls, name: str, tenant: str, fingerprint: str, documents, layout: str = "prefix",
              chunk_tokens: int = CHUNK_TOKENS, meta: "dict | None" = None,
              version: "int | None" = None, created: "float | None" = None) -> "Manifest":
        """The manifest of documents [(doc name, token ids), ...] published in this order."""
        if layout not in LAYOUTS:
            raise ManifestError(f"manifest layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        check_name(tenant, "manifest tenant")
        _str(fingerprint, "manifest fingerprint")
        _int(chunk_tokens, "manifest chunk_tokens", 1, MAX_CHUNK_TOKENS)
        try:
            ns = namespace_digest(tenant, fingerprint)
            arrays = [(n, as_token_array(t)) for n, t in documents]
        except KDNError as e:
            raise ManifestError(f"cannot build manifest {name!r}: {e}") from None
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest documents must be (name, tokens) pairs: {e}") from None
        docs, keys, pos = [], [], 0
        for doc_name, arr in arrays:
            start, end = pos, pos + len(arr)
            if layout == "prefix":
                first = start // chunk_tokens
                n = -(-end // chunk_tokens) - first if end > start else 0
            else:
                first = len(keys)
                keys.extend(chunk_keys(arr, ns, chunk_tokens))
                n = len(keys) - first
            docs.append(Document(doc_name, start, end, first, n, token_digest(arr)))
            pos = end
        if layout == "prefix":
            stream = np.concatenate([a for _, a in arrays]) if arrays else []
            keys = chunk_keys(stream, ns, chunk_tokens)
        stream = np.concatenate([a for _, a in arrays]) if arrays else np.zeros(0, "<u4")
        return cls(name=name, version=version, tenant=tenant, fingerprint=fingerprint, layout=layout,
                   chunk_tokens=chunk_tokens, n_tokens=pos, documents=tuple(docs), keys=tuple(keys),
                   created=time.time() if created is None else created, meta=dict(meta or {}),
                   tokens=stream.astype("<u4").tobytes()).check_names()

    def check_names(self) -> "Manifest":
        """self, unless its fingerprint or a document name holds a character that rewrites what
        a terminal shows (ManifestError naming the name and the character): what a new
        manifest must pass (build, the origin's commit); a stored one is read back as it is."""
        _shown(self.fingerprint, "manifest fingerprint")
        for d in self.documents:
            _shown(d.name, "document name")
        return self

    # --- wire / disk -------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dict(name=self.name, version=self.version, tenant=self.tenant,
                    fingerprint=self.fingerprint, layout=self.layout,
                    chunk_tokens=self.chunk_tokens, n_tokens=self.n_tokens,
                    documents=[d.to_dict() for d in self.documents], keys=list(self.keys),
                    created=self.created, meta=dict(self.meta), tokens=self.tokens,
                    sums=list(self.sums))

    @classmethod
    def from_dict(cls, d) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError(f"a manifest must be a dict, got {type(d).__name__}")
        fields = [f.name for f in dataclasses.fields(cls)]
        optional = {"tokens", "sums"}
        missing = [f for f in fields if f not in d and f not in optional]
        if missing:
            raise ManifestError(f"manifest is missing field(s): {', '.join(missing)}")
        extra = sorted(str(k) for k in d if k not in fields)
        if extra:
            raise ManifestError(f"manifest has unknown field(s): {', '.join(extra)}")
        return cls(**{f: d[f] for f in fields if f in d})

    def to_bytes(self) -> bytes:
        body = msgpack.packb(self.to_dict(), use_bin_type=True)
        return _PREAMBLE.pack(MANIFEST_MAGIC, FORMAT, xxhash.xxh3_64_intdigest(body)) + body

    @classmethod
    def from_bytes(cls, buf) -> "Manifest":
        buf = memoryview(buf).cast("B") if not isinstance(buf, bytes) else buf
        if len(buf) < _PREAMBLE.size:
            raise ManifestError(f"manifest bytes are truncated: {len(buf)} bytes, need at least {_PREAMBLE.size}")
        if len(buf) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is {len(buf)} bytes, limit {MAX_MANIFEST_BYTES}")
        magic, fmt, digest = _PREAMBLE.unpack_from(buf, 0)
        if magic != MANIFEST_MAGIC:
            raise ManifestError(f"not a manifest: magic {bytes(magic)!r}, want {MANIFEST_MAGIC!r}")
        if fmt != FORMAT:
            raise ManifestError(f"manifest format version {fmt} is not one this build reads ({FORMAT})")
        body = buf[_PREAMBLE.size:]
        actual = xxhash.xxh3_64_intdigest(body)
        if actual != digest:
            raise ManifestError(f"manifest checksum mismatch: stored {digest:016x}, computed {actual:016x} (corrupt)")
        try:
            d = msgpack.unpackb(body, raw=False, strict_map_key=True)
        except Exception as e:  # msgpack raises several unrelated classes on bad input
            raise ManifestError(f"manifest body is not valid msgpack: {e}") from None
        return cls.from_dict(d)



def best_prefix(tokens, ns: bytes, manifests, kb: str = None, chunk_tokens: int = CHUNK_TOKENS) -> tuple:
    """(keys, manifest) of the prefix-layout KB the prompt starts with, matched longest.

    A KB of L tokens was published with the chunking of its own L tokens, so the prompt is
    keyed with boundary=L (kdn.core.keys.prompt_keys): its trailing partial chunk then matches
    even though the prompt goes on with a question. No match: the prompt's own keys, None.
    """
    from kdn.core.keys import prompt_keys
    toks = as_token_array(tokens)
    cands = [m for m in manifests if m.layout == "prefix" and m.chunk_tokens == chunk_tokens
             and (kb is None or m.name == kb)]
    best, best_keys, best_n = None, None, 0
    for m in sorted(cands, key=lambda m: -(m.version or 0)):
        keys = prompt_keys(toks, ns, m.chunk_tokens, boundary=min(m.n_tokens, len(toks)))
        n = 0
        for a, b in zip(keys, m.keys):
            if a != b:
                break
            n += 1
        if n > best_n:
            best, best_keys, best_n = m, keys[:n], n
    if best is None:
        return prompt_keys(toks, ns, chunk_tokens), None
    return best_keys, best
