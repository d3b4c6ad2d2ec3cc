"""Reads: the longest verified prefix of a prompt's KV, from the nearest live edge.

The one reader, over either transport: Ray (kdn.client.view.NetworkView: edges ranked by the
topology, failover on Unreachable) or HTTP (kdn.client.http.HTTPEdges: edges' HTTP servers in
the order given). Either answers the reader's part of the edge interface
(kdn.core.interfaces.EdgeReads) through `nearest()` and `at(edge)`.

A worker computes everything itself: the keys of its prompt (kdn.core.keys), which KB the prompt
starts with (manifests, listed by an edge and cached a few seconds; a prompt that matches no
KB lists them again at most once a second, so a KB published seconds ago is found at once),
and so the chunk checksums the publisher recorded. It asks the nearest live edge for those
keys and checks every chunk it gets in one place
(`_checked`): the frame decodes, the chunk is the one asked for, and exact KV hashes to its
manifest checksum. A corrupt copy is reported to the edge holding it (which drops it only if
it really fails) and its keys fetched again, so a reader never returns wrong KV. An edge
bounds the bytes of one reply; while it says "more", the reader asks for the keys after the
ones it received.
"""
import collections
import time
from dataclasses import dataclass, field

from kdn.core.errors import FrameError, ManifestError, RemoteError
from kdn.core.keys import CHUNK_TOKENS, MAX_FETCH_KEYS, as_token_array, namespace_digest
from kdn.core.manifest import Manifest, best_prefix
from kdn.core.names import source_holder, source_kind
from kdn.core.rpc import Unreachable
from kdn.core.transfer import check_accept, fetch_deadline_s

CHUNK_BYTES_ESTIMATE = 64 << 20  # generous: the timeout must not cut a slow but healthy transfer
MAX_CORRUPT_RETRIES = 2        # fetches repeated after dropping corrupt copies
MANIFEST_TTL_S = 5.0           # a reader's cached manifests are this fresh (Ray and HTTP alike)
REFRESH_ON_MISS_S = 1.0        # a prompt that matches no KB re-lists the KBs at most this often
DROP_TIMEOUT_S = 5.0


@dataclass
class Fetched:
    """The longest cached prefix of a prompt: its chunks, where each came from, how long it took."""
    keys: list
    chunks: list
    sources: list
    tokens: int                 # prompt tokens covered by the chunks
    nbytes: int
    edge: str
    seconds: float
    failovers: list = field(default_factory=list)   # edges that failed before one answered
    kb: object = None           # the manifest matched, if any
    exact: bool = True          # False when some chunk came through a lossy codec (kdn.core.codecs)
    wire_bytes: int = 0         # bytes that crossed the link (compressed where a codec was used)
    codecs: dict = field(default_factory=dict)      # codec -> chunks that arrived in it

    def kv_parts(self) -> list:
        """Per-chunk KV arrays [layers, 2, heads, tokens, head_dim], in prompt order."""
        return [c.kv for c in self.chunks]

    def source_counts(self) -> dict:
        """local / peer / origin -> chunks served from there."""
        return dict(collections.Counter(source_kind(s) for s in self.sources))


@dataclass
class _Received:
    """Verified chunks gathered over one or more edge replies, in key order."""
    chunks: list = field(default_factory=list)
    sources: list = field(default_factory=list)
    exact: list = field(default_factory=list)
    codecs: collections.Counter = field(default_factory=collections.Counter)
    wire_bytes: int = 0
    edge: str = None
    failovers: list = field(default_factory=list)

    def add(self, reply: dict, chunks: list, exact: list, edge: str) -> None:
        n = len(chunks)
        self.chunks += chunks
        self.exact += exact
        self.sources += reply["sources"][:n]
        self.codecs.update(reply["codecs"][:n])
        self.wire_bytes += sum(reply["wire"][:n])
        self.edge = edge

    def fetched(self, keys, tokens: int, t0: float, kb=None) -> Fetched:
        n = len(self.chunks)
        return Fetched(keys=keys[:n], chunks=self.chunks, sources=self.sources, tokens=tokens,
                       nbytes=sum(c.nbytes for c in self.chunks), edge=self.edge,
                       seconds=time.perf_counter() - t0, failovers=self.failovers, kb=kb,
                       exact=all(self.exact), wire_bytes=self.wire_bytes, codecs=dict(self.codecs))


class Reader:
    """Fetches and lookups of one namespace (tenant, model fingerprint) through `view`, the
    transport (a NetworkView over Ray, or HTTPEdges).

    token: the tenant's read token (or the admin token). accept: the codecs taken over a
    slow link besides raw (default the lossless ones; a lossy one makes answers inexact).
    """

    def __init__(self, view, tenant: str, fingerprint: str, token: str = None, accept=None,
                 chunk_tokens: int = CHUNK_TOKENS):
        self.view = view
        self.tenant, self.fingerprint = tenant, fingerprint
        self.ns = namespace_digest(tenant, fingerprint)
        self.token = token
        self.accept = list(check_accept(accept))
        self.chunk_tokens = chunk_tokens
        self.counters = collections.Counter()
        self._manifests = (0.0, [])  # (listed at, [Manifest])
        self._relisted = 0.0         # when a prompt that matched no KB last re-listed them

    def stats(self) -> dict:
        return {"tenant": self.tenant, "counters": dict(self.counters)}

    # --- knowledge bases -----------------------------------------------------------------
    def manifests(self, refresh: bool = False) -> list:
        """Committed KB versions of this namespace (cached MANIFEST_TTL_S)."""
        at, ms = self._manifests
        if refresh or time.monotonic() - at > MANIFEST_TTL_S:
            got, _, _ = self.view.nearest().list_manifests(self.tenant, self.fingerprint, token=self.token)
            ms = [Manifest.from_dict(d) for d in got]
            self._manifests = (time.monotonic(), ms)
        return ms

    def forget_manifests(self) -> None:
        """A version was just published or deleted: list again on the next read."""
        self._manifests = (0.0, [])
        self._relisted = 0.0

    def manifest(self, kb: str, version: int = None) -> Manifest:
        for refresh in (False, True):
            ms = [m for m in self.manifests(refresh=refresh) if m.name == kb
                  and (version is None or m.version == version)]
            if ms:
                return max(ms, key=lambda m: m.version)
        raise ManifestError(f"no knowledge base {kb!r}" + (f" version {version}" if version else "")
                            + f" for tenant {self.tenant!r} and this model")

    def keys_for(self, tokens, kb: str = None, version: int = None) -> tuple:
        """(keys, manifest) for a prompt: the chunking of the KB the prompt starts with.

        A KB whose length is not a multiple of the chunk size ends in a partial chunk; its
        key covers exactly the KB's tokens, so the prompt is cut at the KB's length there.
        Without `kb`, every KB of the namespace is a candidate and the longest match wins.
        """
        if kb:
            return best_prefix(tokens, self.ns, [self.manifest(kb, version)], kb, self.chunk_tokens)
        keys, m = best_prefix(tokens, self.ns, self.manifests(), None, self.chunk_tokens)
        if m is None and time.monotonic() - self._relisted > REFRESH_ON_MISS_S:
            self._relisted = time.monotonic()
            self.counters["relisted"] += 1
            keys, m = best_prefix(tokens, self.ns, self.manifests(refresh=True), None, self.chunk_tokens)
        return keys, m

    # --- reads ---------------------------------------------------------------------------
    def lookup(self, tokens, kb: str = None) -> dict:
        """How many leading tokens of the prompt the network holds (no KV moves)."""
        keys, m = self.keys_for(tokens, kb)
        got, edge, _ = self.view.nearest().lookup(keys, self.ns, token=self.token)
        n = got["chunks"]
        return {"chunks": n, "tokens": self.tokens_of(n, len(as_token_array(tokens)), m),
                "keys": len(keys), "edge": edge, "kb": m.label() if m else None}

    def fetch(self, tokens, kb: str = None, timeout_s: float = None, version: int = None) -> Fetched:
        """The longest cached prefix of `tokens`, as verified chunks from the nearest live edge."""
        t0 = time.perf_counter()
        keys, m = self.keys_for(tokens, kb, version)
        if not keys:
            return Fetched([], [], [], 0, 0, None, 0.0, kb=m)
        expected = m.sum_of() if m is not None and m.sums else self._known_sums()
        got = self._receive(keys, expected, timeout_s)
        n_tokens = self.tokens_of(len(got.chunks), len(as_token_array(tokens)), m)
        return got.fetched(keys, n_tokens, t0, kb=m)

    def fetch_keys(self, keys, manifest: Manifest = None, timeout_s: float = None) -> Fetched:
        """The longest held prefix of explicit chunk keys (e.g. one document of a segments
        KB), checked against `manifest`'s checksums (else those of every KB listed)."""
        t0 = time.perf_counter()
        keys = list(keys)
        if not keys:
            return Fetched([], [], [], 0, 0, None, 0.0, kb=manifest)
        expected = manifest.sum_of() if manifest is not None and manifest.sums else self._known_sums()
        got = self._receive(keys, expected, timeout_s)
        return got.fetched(keys, sum(c.tokens for c in got.chunks), t0, kb=manifest)

    def fetch_objects(self, keys, timeout_s: float = None) -> Fetched:
        """The longest held prefix of keys no manifest names (opaque objects of another cache
        layer: kdn.integrations.objects), each checked by its frame; their owner checks contents."""
        t0 = time.perf_counter()
        keys = list(keys)
        got = self._receive(keys, {}, timeout_s, claim=True) if keys else _Received()
        return got.fetched(keys, 0, t0)

    def tokens_of(self, n_chunks, n_tokens, m) -> int:
        """Prompt tokens (of n_tokens) that the first n_chunks chunks of its keys cover."""
        if m is not None and n_chunks == len(m.keys):
            return m.n_tokens
        return min(n_chunks * self.chunk_tokens, n_tokens)

    def _known_sums(self) -> dict:
        """key -> checksum from every KB of the namespace (no KB matched the keys by name)."""
        out = {}
        for m in self.manifests():
            out.update(m.sum_of())
        return out

    def _timeout(self, n_keys: int) -> float:
        """One edge's deadline for n_keys chunks of unknown size (kdn.core.transfer)."""
        return fetch_deadline_s(n_keys, n_keys * CHUNK_BYTES_ESTIMATE)

    def _receive(self, keys, expected: dict, timeout_s: float = None, claim: bool = False) -> _Received:
        """The longest verified prefix of keys, over as many edge replies as it takes.

        A request names at most MAX_FETCH_KEYS keys (what an edge takes), and an edge stops
        early at its reply bound ("more"): the rest is asked for next. A corrupt copy is reported and
        its keys asked for again (another replica, or the origin), at most
        MAX_CORRUPT_RETRIES times; then the prefix ends before it. claim: name the
        namespace's tenant and fingerprint to the edge (a namespace no manifest names).
        """
        got, retries = _Received(), 0
        named = {"tenant": self.tenant, "fingerprint": self.fingerprint} if claim else {}
        while len(got.chunks) < len(keys):
            rest = keys[len(got.chunks):len(got.chunks) + MAX_FETCH_KEYS]
            nearest = self.view.nearest(timeout_s or self._timeout(len(rest)), resolve_refs=True)
            reply, edge, failed = nearest.fetch(rest, self.ns, self.view.region, node=self.view.node_id,
                                                accept=self.accept, token=self.token, **named)
            got.failovers += failed
            chunks, exact, bad = self._check_reply(rest, reply, edge, expected)
            got.add(reply, chunks, exact, edge)
            self.view.follow(reply.get("ring", 0))
            if bad:
                self.counters["corrupt_chunks"] += len(bad)
                self._drop_corrupt(edge, [(rest[i], reply["sources"][i]) for i in bad])
                retries += 1
                if retries > MAX_CORRUPT_RETRIES:
                    break
            elif not chunks or not (reply.get("more") or len(chunks) == len(rest)):
                break                # the network holds no more of the prefix
        self.counters["fetches"] += 1
        self.counters["chunks"] += len(got.chunks)
        return got

    def _check_reply(self, keys, reply: dict, edge: str, expected: dict) -> tuple:
        """(chunks, exact flags) of the verified prefix of an edge's reply, and the indices
        of every copy in it that failed (all reported at once, so one retry fixes them).
        Whether a chunk is exact is the object's own word (Ray: a Chunk or an Encoded frame)
        unless the reply says (HTTP: frames decoded on receipt)."""
        objs = reply["chunks"]
        flags = reply.get("exact") or [o.exact for o in objs]
        chunks, exact, bad = [], [], []
        for i, (key, obj) in enumerate(zip(keys, objs)):
            if obj.key != key or obj.ns != self.ns:
                raise RemoteError(f"edge {edge} answered a chunk that is not the one asked for")
            chunk = _checked(obj, expected.get(key), flags[i])
            if chunk is None:
                bad.append(i)
            elif not bad:
                chunks.append(chunk)
                exact.append(flags[i])
        return chunks, exact, bad

    def _drop_corrupt(self, edge: str, bad) -> None:
        """Tell each edge holding a corrupt copy (the one asked, or the peer it came from)."""
        by_holder = collections.defaultdict(list)
        for key, source in bad:
            by_holder[source_holder(source, edge)].append(key)
        for holder, keys in by_holder.items():
            try:
                self.view.at(holder, DROP_TIMEOUT_S).drop_corrupt(keys, self.ns, token=self.token)
            except Unreachable:
                pass                 # a dead holder holds nothing


def _checked(obj, expected: "int | None", exact: bool):
    """The Chunk of a received Chunk or Encoded, or None when its bytes are not right: the
    frame decodes (its checksums hold) and exact KV hashes to its manifest checksum. Lossy
    KV is not the published KV by design: only its frame vouches for it."""
    try:
        chunk = obj.decode()
        chunk.verify(expected if exact else None)
    except FrameError:
        return None
    return chunk
