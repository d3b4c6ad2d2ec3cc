"""The client: how an inference worker or an operator talks to a KDN network over Ray.

`connect()` finds the network's origin by name, reads the membership and topology once, and
from then on computes everything itself: the keys of a prompt (kdn.keys), which edge is
nearest (the topology, from the worker's region — its Ray node's `region` label unless told),
which keys belong to which KB (manifests, cached). A request goes to the nearest live edge; a
call that errors or times out moves to the next edge at once, so a dead edge costs one
timeout, never Ray's ~15 s node-death detection. Edges that failed are skipped for a while.

Operator controls (pin, replicas, TTL, warm, add/remove edge) go to the origin.
"""
import collections
import dataclasses
import time
from dataclasses import dataclass, field

import numpy as np

from kdn.chunk import Chunk, Encoded
from kdn.cluster import init_ray
from kdn.names import NAMESPACE, edge_actor_name, origin_name
from kdn.errors import BadRequest, FrameError, KDNError, ManifestError, NetworkError, NoLiveEdge
from kdn.keys import CHUNK_TOKENS, as_token_array, namespace_digest
from kdn.manifest import Manifest, best_prefix
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology

CALL_TIMEOUT_S = 5.0          # a control call
FETCH_TIMEOUT_S = 4.0         # a fetch: base ...
FETCH_TIMEOUT_PER_MB_S = 0.02  # ... plus this per expected MB (slow WAN links)
SUSPECT_S = 10.0              # a failed edge is tried last for this long
MAX_CORRUPT_RETRIES = 2       # fetches repeated after dropping corrupt copies
OPEN_METHODS = {"membership", "stats", "ping"}   # calls that carry no token
MANIFEST_TTL_S = 5.0


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
    exact: bool = True          # False when some chunk came through a lossy codec (kdn.codecs)
    wire_bytes: int = 0         # bytes that crossed the link (compressed where a codec was used)
    codecs: dict = field(default_factory=dict)      # codec -> chunks that arrived in it

    def kv_parts(self) -> list:
        """Per-chunk KV arrays [layers, 2, heads, tokens, head_dim], in prompt order."""
        return [c.kv for c in self.chunks]

    def source_counts(self) -> dict:
        out = {}
        for s in self.sources:
            s = s.split(":")[0]
            out[s] = out.get(s, 0) + 1
        return out


def node_region() -> "str | None":
    """The `region` label of the Ray node this process runs on (None when unlabelled)."""
    import ray
    labels = ray.get_runtime_context().get_node_labels() or {}
    return labels.get("region")


def connect(region: str = None, address: str = None, network: str = "kdn", tenant: str = "default",
            fingerprint: str = "unspecified", token: str = None, admin_token: str = None,
            accept=None) -> "Client":
    """Connect to a running KDN network (joining Ray at `address`, default 'auto', if needed).

    token: the tenant's read token (when the network requires one for it); admin_token: the
    network's admin token, for publishing and operator controls. accept: the codecs this
    reader takes over a slow link (default the lossless ones; name a lossy one, e.g.
    ("zstd", "q8z"), to trade exactness for bytes).
    """
    import ray
    if not ray.is_initialized():
        init_ray(address or "auto")
    return Client(network=network, region=region, tenant=tenant, fingerprint=fingerprint,
                  token=token, admin_token=admin_token, accept=accept)


class Client:
    def __init__(self, network: str = "kdn", region: str = None, tenant: str = "default",
                 fingerprint: str = "unspecified", chunk_tokens: int = CHUNK_TOKENS,
                 token: str = None, admin_token: str = None, accept=None):
        import ray
        from kdn.transfer import check_accept
        self.ray = ray
        self.accept = list(check_accept(accept))
        self.node_id = ray.get_runtime_context().get_node_id()
        self.admin_token = admin_token
        self.token = token or admin_token
        self.network = network
        self.tenant, self.fingerprint = tenant, fingerprint
        self.ns = namespace_digest(tenant, fingerprint)
        self.chunk_tokens = chunk_tokens
        self.region = region or node_region()
        self._handles = {}
        self._suspect = {}           # edge -> monotonic time until which it is tried last
        self._manifests = (0.0, [])  # (fetched at, [Manifest])
        self.membership = None
        self.stats = collections.Counter()
        self.refresh()
        if self.region is None:
            self.region = self.topology.origin_region
        if self.region not in self.topology.regions:
            raise KDNError(f"region {self.region!r} is not in the network's topology "
                           f"(regions: {', '.join(self.topology.regions)})")

    # --- plumbing -----------------------------------------------------------------------
    def _actor(self, edge):
        h = self._handles.get(edge)
        if h is None:
            name = origin_name(self.network) if edge is None else edge_actor_name(self.network, edge)
            try:
                h = self.ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                raise NetworkError(f"no actor {name!r} in namespace {NAMESPACE!r}: is the network "
                                   f"{self.network!r} up?") from None
            self._handles[edge] = h
        return h

    def _origin_call(self, method, *args, timeout=CALL_TIMEOUT_S, **kw):
        """Call the origin. While it restarts (Ray brings it back from disk) the call is retried
        until `timeout`; every origin method is idempotent (content-addressed puts, commits of
        identical content return the version that exists)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                left = max(0.1, deadline - time.monotonic())
                if method not in OPEN_METHODS:
                    kw["token"] = self.admin_token
                return self.ray.get(getattr(self._actor(None), method).remote(*args, **kw), timeout=left)
            except self.ray.exceptions.RayTaskError as e:
                cause = e.as_instanceof_cause()
                if isinstance(cause, KDNError):
                    raise cause from None
                raise
            except self.ray.exceptions.ActorUnavailableError as e:
                err = e                      # restarting: try again until the deadline
            except (self.ray.exceptions.GetTimeoutError, self.ray.exceptions.RayActorError) as e:
                err = e
                deadline = 0
            self._handles.pop(None, None)
            if time.monotonic() >= deadline:
                raise NetworkError(f"the origin of network {self.network!r} did not answer {method} "
                                   f"within {timeout:.0f} s: {type(err).__name__}") from None
            time.sleep(0.2)

    def refresh(self) -> None:
        """Re-read membership and topology (from the origin, else from any edge)."""
        try:
            m = self._origin_call("membership")
        except (NetworkError, ValueError):
            m = None
            for actor in self.ray.util.list_named_actors(all_namespaces=True):
                if actor.get("namespace") != NAMESPACE or not actor["name"].startswith(f"{self.network}:edge:"):
                    continue
                try:
                    h = self.ray.get_actor(actor["name"], namespace=NAMESPACE)
                    got = self.ray.get(h.membership.remote(), timeout=2)
                except Exception:  # noqa: BLE001 - dead or restarting edge: ask the next
                    continue
                if m is None or got["version"] > m["version"]:
                    m = got
            if m is None:
                raise NetworkError(f"network {self.network!r}: neither the origin nor any edge answers")
        self.membership = m
        self.topology = Topology.from_dict(m["topology"])
        self.ring = Ring([Edge(*e) for e in m["members"]])

    def ranked_edges(self) -> list:
        """Edges nearest first from this client's region; recently failed ones last."""
        now = time.monotonic()
        names = [e.name for e in self.ring.edges]
        cands = [(n, self.ring.region_of(n)) for n in names]
        ranked = self.topology.rank_sources(self.region, cands, 1 << 20)
        return sorted(ranked, key=lambda n: self._suspect.get(n, 0) > now)

    def _edge_call(self, method, *args, timeout=CALL_TIMEOUT_S, resolve_refs=False, **kw):
        """Call the nearest live edge; fail over to the next on error or timeout.

        With resolve_refs, the reply's object references ("refs") are fetched too, inside the
        same failover: an edge that dies between answering and the transfer costs a retry.
        """
        failed = []
        if method not in OPEN_METHODS:
            kw["token"] = self.token
        for edge in self.ranked_edges():
            try:
                ref = getattr(self._actor(edge), method).remote(*args, **kw)
                t0 = time.monotonic()
                reply = self.ray.get(ref, timeout=timeout)
                if resolve_refs:
                    left = max(0.5, timeout - (time.monotonic() - t0))
                    reply["chunks"] = self.ray.get(reply.pop("refs"), timeout=left) if reply["refs"] else []
                return reply, edge, failed
            except self.ray.exceptions.RayTaskError as e:
                cause = e.as_instanceof_cause()
                if isinstance(cause, KDNError):
                    raise cause from None
                failed.append(edge)
            except Exception:  # noqa: BLE001 - timeout, dead actor, dead node: next edge
                failed.append(edge)
            self._handles.pop(edge, None)
            self._suspect[edge] = time.monotonic() + SUSPECT_S
        raise NoLiveEdge(f"no edge of network {self.network!r} answered {method} "
                         f"(tried {', '.join(failed) or 'none'})")

    # --- knowledge bases ----------------------------------------------------------------
    def manifests(self, refresh: bool = False) -> list:
        """Committed KB versions of this client's namespace (cached a few seconds)."""
        at, ms = self._manifests
        if refresh or time.monotonic() - at > MANIFEST_TTL_S:
            got, _, _ = self._edge_call("list_manifests", self.tenant, self.fingerprint)
            ms = [Manifest.from_dict(d) for d in got]
            self._manifests = (time.monotonic(), ms)
        return ms

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
        cands = [self.manifest(kb, version)] if kb else self.manifests()
        return best_prefix(tokens, self.ns, cands, kb, self.chunk_tokens)

    # --- reads --------------------------------------------------------------------------
    def lookup(self, tokens, kb: str = None) -> dict:
        """How many leading tokens of the prompt the network holds (no KV moves)."""
        keys, m = self.keys_for(tokens, kb)
        got, edge, _ = self._edge_call("lookup", keys, self.ns)
        n = got["chunks"]
        return {"chunks": n, "tokens": self._tokens_of(n, len(as_token_array(tokens)), m),
                "keys": len(keys), "edge": edge, "kb": m.label() if m else None}

    def _tokens_of(self, n_chunks, n_tokens, m):
        if m is not None and n_chunks == len(m.keys):
            return m.n_tokens
        return min(n_chunks * self.chunk_tokens, n_tokens)

    def fetch(self, tokens, kb: str = None, timeout_s: float = None, version: int = None) -> Fetched:
        """The longest cached prefix of `tokens`, as chunks from the nearest live edge."""
        t0 = time.perf_counter()
        keys, m = self.keys_for(tokens, kb, version)
        if not keys:
            return Fetched([], [], [], 0, 0, None, 0.0, kb=m)
        if timeout_s is None:
            per_chunk = self._chunk_bytes_estimate()
            timeout_s = FETCH_TIMEOUT_S + FETCH_TIMEOUT_PER_MB_S * len(keys) * per_chunk / 1e6
        expected = self._expected_sums(keys, m)
        failed = []
        for attempt in range(MAX_CORRUPT_RETRIES + 1):
            reply, edge, more = self._fetch_call(keys, timeout_s)
            failed += more
            chunks, exact, bad = self._resolve(keys, reply["chunks"], edge, expected)
            sources = reply["sources"]
            if not bad:
                break
            # A corrupt copy is dropped where it lives and fetched again (another replica or the
            # origin); a client never returns wrong KV.
            self.stats["corrupt_chunks"] += len(bad)
            self._drop_corrupt(edge, [(keys[i], sources[i]) for i in bad])
            if attempt == MAX_CORRUPT_RETRIES:
                chunks, sources = chunks[:bad[0]], sources[:bad[0]]
        if reply.get("ring", 0) > self.membership.get("version", 0):
            try:
                self.refresh()
            except NetworkError:
                pass
        n = len(chunks)
        return Fetched(keys=keys[:n], chunks=chunks, sources=sources,
                       tokens=self._tokens_of(n, len(as_token_array(tokens)), m),
                       nbytes=sum(c.nbytes for c in chunks), edge=edge,
                       seconds=time.perf_counter() - t0, failovers=failed, kb=m,
                       **self._wire(reply, n, exact))

    def _fetch_call(self, keys, timeout_s):
        """The edge's fetch, asking for each chunk in the form that suits this reader's link."""
        return self._edge_call("fetch", keys, self.ns, self.region, timeout=timeout_s,
                               resolve_refs=True, node=self.node_id, accept=self.accept)

    def _resolve(self, keys, objs, edge, expected) -> tuple:
        """(chunks, exact flags, indices of bad ones) from what an edge sent (Chunks, Encoded).

        Encoded frames are decoded here, every checksum verified; a frame that fails, or an
        exact chunk whose bytes differ from its manifest checksum, is "bad". A lossy chunk
        has its frame's checksum only (its KV is not the published KV, by design).
        """
        chunks, exact, bad = [], [], []
        for i, (k, o) in enumerate(zip(keys, objs)):
            is_exact = not isinstance(o, Encoded) or o.exact
            try:
                c = o.decode() if isinstance(o, Encoded) else o
            except FrameError:
                c = None
            if c is not None and (not isinstance(c, Chunk) or c.key != k or c.ns != self.ns):
                raise NetworkError(f"edge {edge} answered a chunk that is not the one asked for")
            if c is None or (is_exact and k in expected and c.digest() != expected[k]):
                bad.append(i)
            chunks.append(c)
            exact.append(is_exact)
        return chunks, exact, bad

    @staticmethod
    def _wire(reply, n, exact) -> dict:
        """Fetched's exact, codecs and wire_bytes for the first n chunks of an edge's reply."""
        counts = {}
        for c in reply["codecs"][:n]:
            counts[c] = counts.get(c, 0) + 1
        return {"exact": all(exact[:n]), "codecs": counts, "wire_bytes": sum(reply["wire"][:n])}

    def _expected_sums(self, keys, m) -> dict:
        """key -> checksum from the manifests that name these keys (the KB matched, else all known)."""
        if m is not None and m.sums:
            return m.sum_of()
        out = {}
        try:
            for man in self.manifests():
                out.update(man.sum_of())
        except KDNError:
            pass
        return out

    def _drop_corrupt(self, edge, bad):
        by_edge = {}
        for key, source in bad:
            holder = source.split(":", 1)[1] if source.startswith("peer:") else edge
            by_edge.setdefault(holder, []).append(key)
        for holder, ks in by_edge.items():
            try:
                self.ray.get(self._actor(holder).drop_corrupt.remote(ks, token=self.token),
                             timeout=CALL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead holder holds nothing
                pass

    def fetch_keys(self, keys, timeout_s: float = None) -> Fetched:
        """The longest held prefix of explicit chunk keys (e.g. one document of a segments KB)."""
        t0 = time.perf_counter()
        keys = list(keys)
        if not keys:
            return Fetched([], [], [], 0, 0, None, 0.0)
        reply, edge, failed = self._fetch_call(keys, timeout_s or FETCH_TIMEOUT_S + 0.1 * len(keys))
        expected = self._expected_sums(keys, None)
        chunks, exact, bad = self._resolve(keys, reply["chunks"], edge, expected)
        if bad:
            i = bad[0]
            self._drop_corrupt(edge, [(keys[i], reply["sources"][i])])
            raise NetworkError(f"edge {edge} answered a corrupt chunk for key {keys[i].hex()}; "
                               "it was dropped there: fetch again")
        return Fetched(keys=keys[:len(chunks)], chunks=chunks, sources=reply["sources"],
                       tokens=sum(c.tokens for c in chunks), nbytes=sum(c.nbytes for c in chunks),
                       edge=edge, seconds=time.perf_counter() - t0, failovers=failed,
                       **self._wire(reply, len(chunks), exact))

    def _chunk_bytes_estimate(self):
        return 64 << 20  # generous: the timeout must not cut a slow but healthy transfer

    # --- publish ------------------------------------------------------------------------
    def publish(self, kb: str, documents, kv, layout: str = "prefix", meta: dict = None,
                dtype: str = None, batch_bytes: int = 64 << 20, timeout_s: float = 300.0) -> dict:
        """Publish a KB version whose KV the caller computed.

        documents: [(doc name, token ids), ...] in order. kv: for the prefix layout one array
        [layers, 2, heads, total tokens, head_dim] (numpy or torch) of the concatenated
        documents; for segments a list of such arrays, one per document. Only chunks the
        origin lacks travel; the origin then pushes them to their owners. Returns a receipt.
        """
        m = Manifest.build(kb, self.tenant, self.fingerprint, documents, layout=layout,
                           chunk_tokens=self.chunk_tokens, meta=meta)
        chunks = self._split(m, kv, dtype)
        # Per-chunk checksums travel in the manifest: every reader verifies what it got
        # against the publisher's bytes, whatever hops (disk, peers, object store) it crossed.
        m = dataclasses.replace(m, sums=tuple(c.digest() for c in chunks))
        missing = self._origin_call("missing", list(m.keys), timeout=timeout_s)
        sent = sent_bytes = 0
        batch, size = [], 0
        for i in missing:
            batch.append(chunks[i])
            size += chunks[i].nbytes
            if size >= batch_bytes:
                self._origin_call("put_chunks", batch, timeout=timeout_s)
                sent, sent_bytes, batch, size = sent + len(batch), sent_bytes + size, [], 0
        if batch:
            self._origin_call("put_chunks", batch, timeout=timeout_s)
            sent, sent_bytes = sent + len(batch), sent_bytes + size
        receipt = self._origin_call("commit", m.to_dict(), timeout=timeout_s)
        receipt.update(sent_chunks=sent, sent_bytes=sent_bytes)
        self._manifests = (0.0, [])
        return receipt

    def _split(self, m: Manifest, kv, dtype) -> list:
        def as_array(x):
            if isinstance(x, np.ndarray):
                return x
            try:
                import torch
                if isinstance(x, torch.Tensor):
                    return x
            except ImportError:
                pass
            raise BadRequest(f"kv must be a numpy array or torch tensor, got {type(x).__name__}")

        def cut(arr, spans, keys):
            if arr.ndim != 5 or arr.shape[1] != 2:
                raise BadRequest(f"kv must have shape [layers, 2, heads, tokens, head_dim], got {tuple(arr.shape)}")
            total = spans[-1][1] if spans else 0
            if arr.shape[3] != total:
                raise BadRequest(f"kv covers {arr.shape[3]} tokens but the documents have {total}")
            out = []
            for (s, e), k in zip(spans, keys):
                part = arr[:, :, :, s:e]
                if isinstance(part, np.ndarray):
                    out.append(Chunk(k, m.ns, np.ascontiguousarray(part), dtype or str(part.dtype)))
                else:
                    out.append(Chunk.from_torch(k, m.ns, part.contiguous()))
            return out

        ct = m.chunk_tokens
        if m.layout == "prefix":
            spans = [(s, min(s + ct, m.n_tokens)) for s in range(0, m.n_tokens, ct)]
            return cut(as_array(kv), spans, m.keys)
        if not isinstance(kv, (list, tuple)) or len(kv) != len(m.documents):
            raise BadRequest(f"the segments layout needs one kv array per document "
                             f"({len(m.documents)}), got {type(kv).__name__}")
        out = []
        for d, arr in zip(m.documents, kv):
            spans = [(s, min(s + ct, d.tokens)) for s in range(0, d.tokens, ct)]
            out.extend(cut(as_array(arr), spans, m.keys[d.first_chunk:d.first_chunk + d.n_chunks]))
        return out

    def delete(self, kb: str, version: int) -> dict:
        return self._origin_call("delete_version", self.ns, kb, version)

    # --- operators ----------------------------------------------------------------------
    def pin(self, kb: str, regions) -> dict:
        return self._origin_call("set_override", self.tenant, kb, pin_regions=list(regions), timeout=120)

    def set_replicas(self, kb: str, n: int) -> dict:
        return self._origin_call("set_override", self.tenant, kb, replicas=n, timeout=120)

    def set_ttl(self, kb: str, seconds: float) -> dict:
        return self._origin_call("set_override", self.tenant, kb, ttl_s=seconds, timeout=120)

    def warm(self, kb: str, region: str) -> dict:
        return self._origin_call("warm", self.tenant, kb, region, timeout=120)

    def add_edge(self, name: str, region: str, capacity_bytes: int = 2 << 30, **edge_options) -> dict:
        """Start an edge actor in `region` and add it to the ring (keys move to it)."""
        from kdn.cluster import start_edge
        topo = Topology.from_dict(self.membership["topology"])
        edge = topo.add_edge(name, region, int(capacity_bytes))
        # detached: the edge belongs to the network, not to this client (stop_network kills it)
        auth = self._origin_call("auth_config")
        h = start_edge(self.network, edge, topo, capacity_bytes=capacity_bytes, detached=True, auth=auth,
                       replicas=self.membership.get("replicas", 2), **edge_options)
        self.ray.get(h.ping.remote(), timeout=60)
        m = self._origin_call("add_edge", name, region, edge.weight, timeout=300)
        self.refresh()
        return m

    def remove_edge(self, name: str, kill: bool = True) -> dict:
        """Take an edge out of the ring (its keys re-homed first), then stop it."""
        m = self._origin_call("remove_edge", name, timeout=300)
        if kill:
            try:
                self.ray.kill(self._actor(name), no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._handles.pop(name, None)
        self.refresh()
        return m

    def status(self, timeout_s: float = 3.0) -> dict:
        """Origin and every edge's stats; a component that does not answer is reported down."""
        out = {"network": self.network, "region": self.region, "edges": []}
        try:
            out["origin"] = self._origin_call("stats", timeout=timeout_s)
        except NetworkError as e:
            out["origin"] = {"unreachable": str(e)}
        refs = {}
        for e in self.ring.edges:
            try:
                refs[e.name] = self._actor(e.name).stats.remote()
            except NetworkError:
                refs[e.name] = None
        for e in self.ring.edges:
            try:
                st = self.ray.get(refs[e.name], timeout=timeout_s) if refs[e.name] else None
            except Exception:  # noqa: BLE001
                st = None
            out["edges"].append(st or {"name": e.name, "region": e.region, "down": True})
        return out
