"""An edge node: an async Ray actor around a memory tier, the ring and the replication policy.

An edge holds two kinds of chunks in two byte-bounded tiers: "main" (chunks the ring assigns
it, pushed by the origin at publish) and "hot" (copies of chunks owned elsewhere that its
region reads often: groupcache's hot cache, but promoted by measured demand rather than by
chance; the hot tier's size is the budget that keeps copies from crowding out main chunks).

`fetch(keys)` serves the longest prefix of keys it can: its own tiers first, then the ring
owners nearest first, then the origin — one batched call per source, never one per chunk —
and stops at the first key nobody holds. Concurrent misses for one key share one load
(singleflight). A chunk this edge owns but lacked (it restarted empty) is kept on the way
through, so an edge refills itself; an owner found lacking a chunk is sent it afterwards
(read repair). Every served chunk's namespace is checked against the asker's, so one
tenant's key never returns another tenant's KV.

Placement is computed here from the membership the origin broadcasts (and, before that, from
the topology): no per-request call asks anyone where a key lives.

Chunks live in Ray's object store, put there once when they enter a tier; the tiers hold
references (`Held`). A fetch returns references, so a worker on the edge's node maps the KV
with no copy at all, and one elsewhere pulls it straight from this node's store; the edge
process never re-serializes a chunk per request. Evicting a reference frees the object once
no reader still holds it.

Compressed KV (kdn.codecs). With store_codec set, an edge keeps chunks as compressed frames
(kdn.chunk.Encoded): its byte capacity is charged the compressed size, so it holds more
chunks (zstd: lossless, ~1.2x on fp32 KV; q8z/k4v3z: lossy, 3.9x/8x, an operator's choice).
What a fetch sends is chosen per chunk by the link to the reader (kdn.codecs.choose_codec):
on the reader's own node the stored form as it is (raw stays zero-copy; a compressed form is
decoded by the reader, which costs no more than decoding it here); across a link the form
that arrives soonest, counting encode and decode time against the bytes saved at the
topology's bandwidth. Lossy codecs are sent only to readers that accept them (or when the
edge already stores lossy KV: re-expanding it restores nothing). A copy that must be
encoded to be kept (a refill, a hot copy) is encoded in the background, after the reply.
"""
import asyncio
import collections
import os
import time

import numpy as np

from kdn.names import NAMESPACE, edge_actor_name, origin_name
from kdn.edge.cache import ChunkCache
from kdn.edge.singleflight import Group
from kdn.auth import Tokens
from kdn.chunk import Chunk, Encoded, codecs as registered_codecs
from kdn.codecs import LOSSLESS, LOSSY
from kdn.transfer import PROFILE, check_accept, check_store_codec as _check_codec, choose_codec
from kdn.errors import AccessDenied, BadRequest, FrameError, PinCapacityError
from kdn.keys import namespace_digest
from kdn.manifest import Manifest
from kdn.placement.replication import ReplicationPolicy
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology

class Held:
    """A chunk in the object store (a Chunk, or an Encoded frame): its reference plus what
    routing needs without fetching it. nbytes is what holding it costs (compressed size),
    raw the size of its KV."""
    __slots__ = ("ref", "key", "ns", "nbytes", "raw", "codec", "dtype", "own", "chunk")

    def __init__(self, ref, key: bytes, ns: bytes, nbytes: int, raw: int = None, codec: str = "raw",
                 dtype: str = "float32", own: bool = True, chunk=None):
        self.ref, self.key, self.ns, self.nbytes, self.own = ref, key, ns, nbytes, own
        self.raw = nbytes if raw is None else raw
        self.codec, self.dtype = codec, dtype
        self.chunk = chunk      # a view of the object, once this process has read it (HTTP)

    @classmethod
    def of(cls, obj) -> "Held":
        """Put a Chunk or an Encoded into this node's object store."""
        import ray
        codec = obj.codec if isinstance(obj, Encoded) else "raw"
        raw = obj.raw if isinstance(obj, Encoded) else obj.nbytes
        return cls(ray.put(obj), obj.key, obj.ns, obj.nbytes, raw, codec, obj.dtype)

    async def resolve(self):
        """The chunk itself; our own objects are read once (a zero-copy view) and kept."""
        if self.chunk is not None:
            return self.chunk
        chunk = await self.ref
        if self.own:
            self.chunk = chunk
        return chunk

    def wire(self) -> tuple:
        return (self.ref, self.key, self.ns, self.nbytes, self.raw, self.codec, self.dtype)

    @classmethod
    def from_wire(cls, w) -> "Held":
        return cls(*w, own=False)


def check_store_codec(codec: str) -> str:
    return _check_codec(codec, "edge")




PEER_TIMEOUT_S = 5.0      # a peer that does not answer in time is skipped (next owner, then origin)
ORIGIN_TIMEOUT_S = 20.0
MEMBERSHIP_REFRESH_S = 10.0
POLICY_TICK_S = 1.0


class EdgeNode:
    def __init__(self, network: str, name: str, region: str, capacity_bytes: int, topology: dict,
                 policy: str = "s3fifo", hot_fraction: float = 0.25, replicas: int = 2,
                 http_port=None, http_host: str = "127.0.0.1", replication: dict = None,
                 fault_injection: bool = False, auth: dict = None, store_codec: str = "raw"):
        import ray
        self.network, self.name, self.region = network, name, region
        self.store_codec = check_store_codec(store_codec)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.tokens = Tokens.from_dict(auth)
        self.ns_tenant = {}        # namespace digest -> tenant, from manifests (read-token checks)
        self.capacity = int(capacity_bytes)
        hot_bytes = max(1, int(self.capacity * hot_fraction))
        self.main = ChunkCache(self.capacity - hot_bytes, policy)
        self.hot = ChunkCache(hot_bytes, "lru")
        self.topology = Topology.from_dict(topology)
        self.replicas = replicas
        self.members_version = 0
        self.overrides = {}
        self.ring = Ring([e for e in self.topology.edges])
        self.demand = ReplicationPolicy(**{"hot_budget_fraction": hot_fraction, **(replication or {})})
        self.loads = Group()
        self.expiry = {}           # key -> monotonic deadline (KB TTL set by an operator)
        self.manifests = {}        # (tenant, fingerprint, name, version) -> manifest dict, as broadcast
        self.sums = {}             # key -> xxh3_64 of its KV bytes, from those manifests
        self.fault_injection = bool(fault_injection)
        self.handles = {}
        self.counters = collections.Counter()
        self.started = time.time()
        self._bg = None
        self._tasks = set()        # background work (keeping encoded copies), referenced till done
        self._keeping = set()      # keys being encoded to be kept
        self._last_refresh = 0.0
        self.http_port_wanted, self.http_host = http_port, http_host
        self.http = None

    # --- lifecycle ----------------------------------------------------------------------
    def _start_background(self):
        if self._bg is None:
            self._bg = asyncio.get_running_loop().create_task(self._background())

    async def _background(self):
        while True:
            await asyncio.sleep(POLICY_TICK_S)
            try:
                self._tick()
                if time.monotonic() - self._last_refresh > MEMBERSHIP_REFRESH_S:
                    await self._refresh_membership()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                self.counters["background_errors"] += 1

    def _tick(self):
        """Apply the replication policy: fetch newly hot chunks, drop cold ones; expire TTLs."""
        d = self.demand.decide(region_capacity_bytes={self.region: self.capacity},
                               owners_region=self._owner_regions)
        for key, region in d.demote:
            if region == self.region and self.hot.discard(key):
                self.counters["hot_demoted"] += 1
        wanted = [k for k, region in d.promote if region == self.region and not self.hot.peek(k)
                  and not self.main.peek(k)]
        if wanted:
            asyncio.get_running_loop().create_task(self._promote(wanted))
        now = time.monotonic()
        for key in [k for k, t in self.expiry.items() if t <= now]:
            self.main.discard(key)
            self.hot.discard(key)
            del self.expiry[key]
            self.counters["ttl_expired"] += 1

    def _owner_regions(self, key):
        return [self.ring.region_of(o) for o in self._owners([key])[0]]

    async def _promote(self, keys):
        """Copy chunks the policy made hot in this region into the hot tier (from owners)."""
        got = await self.loads.do_many(keys, self._load_batch)
        for k, g in zip(keys, got):
            if g is None:
                continue
            held = await self._own_copy(g[0])
            if held is not None and self.hot.put(k, held):
                self.counters["hot_promoted"] += 1

    async def ping(self, token=None) -> dict:
        self._start_background()
        if self.http_port_wanted is not None and self.http is None:
            await self.start_http(self.http_port_wanted, self.http_host)
        return {"role": "edge", "name": self.name, "region": self.region, "pid": os.getpid(),
                "http": self.http_address()}

    def http_address(self):
        return None if self.http is None else f"http://{self.http_host}:{self.http.port}"

    async def start_http(self, port: int = 0, host: str = "127.0.0.1") -> str:
        """Serve this edge over HTTP too (edge/http.py); returns the base URL."""
        from kdn.edge.http import EdgeHTTP
        if self.http is None:
            self.http = EdgeHTTP(self, host=host, port=port)
            await self.http.start()
            self.http_host = host
        return self.http_address()

    # --- membership ---------------------------------------------------------------------
    async def set_membership(self, m: dict, token=None) -> int:
        self.tokens.check_admin(token, "set_membership")
        if m["version"] >= self.members_version:
            self.members_version = m["version"]
            self.ring = Ring([Edge(*e) for e in m["members"]])
            self.replicas = m.get("replicas", self.replicas)
            self.overrides = m.get("overrides", {})
            self.topology = Topology.from_dict(m["topology"])
            self._last_refresh = time.monotonic()
        return self.members_version

    async def membership(self) -> dict:
        """The membership this edge routes by (clients use it while the origin is down)."""
        return {"version": self.members_version, "replicas": self.replicas,
                "members": [[e.name, e.region, e.weight] for e in self.ring.edges],
                "topology": self.topology.to_dict(), "overrides": self.overrides}

    async def _refresh_membership(self):
        self._last_refresh = time.monotonic()
        m = await self._call_origin("membership", timeout=5.0)
        if m is not None:
            await self.set_membership(m, token=self.tokens.admin)

    def _handle(self, edge: str):
        import ray
        h = self.handles.get(edge)
        if h is None:
            name = origin_name(self.network) if edge is None else edge_actor_name(self.network, edge)
            h = ray.get_actor(name, namespace=NAMESPACE)
            self.handles[edge] = h
        return h

    async def _call(self, edge, method, *args, timeout=PEER_TIMEOUT_S, **kw):
        """Call a peer (edge name) or the origin (None); None when it is gone or too slow."""
        try:
            ref = getattr(self._handle(edge), method).remote(*args, token=self.tokens.admin, **kw)
            return await asyncio.wait_for(ref, timeout)
        except Exception:  # noqa: BLE001 - failover: the caller tries the next source
            self.handles.pop(edge, None)
            self.counters["peer_failures" if edge is not None else "origin_failures"] += 1
            return None

    async def _call_origin(self, method, *args, timeout=ORIGIN_TIMEOUT_S, **kw):
        return await self._call(None, method, *args, timeout=timeout, **kw)

    # --- the memory tiers ---------------------------------------------------------------
    def _local(self, key):
        if key in self.expiry and self.expiry[key] <= time.monotonic():
            return None
        c = self.main.get(key)
        if c is None:
            c = self.hot.get(key)
            if c is not None:
                self.counters["hot_hits"] += 1
        else:
            self.counters["main_hits"] += 1
        return c

    def _owners(self, keys):
        return self.ring.owners_batch(list(keys), self.replicas) if len(self.ring) else [[] for _ in keys]

    async def have(self, keys, ns: bytes = None, token=None) -> list:
        """Which keys this edge holds (given ns: holds under that namespace)."""
        self.tokens.check_admin(token, "have")
        if ns is None:
            return [(k in self.main) or (k in self.hot) for k in keys]
        return [getattr(self.main.peek(k) or self.hot.peek(k), "ns", None) == ns for k in keys]

    async def put_chunks(self, chunks, role: str = "main", pin: bool = False, ttl_s=None, token=None) -> int:
        """Store chunks the origin pushes (role main) or warms (role hot); returns how many fit."""
        self.tokens.check_admin(token, "put_chunks")
        tier = self.hot if role == "hot" else self.main
        n = 0
        new = [c for c in chunks if c is not None and not isinstance(c, Held) and c.key not in tier]
        stored = dict(zip((c.key for c in new), await self._store_forms(new))) if new else {}
        for c in chunks:
            if c is None:
                continue
            if not isinstance(c, Held):
                held = tier.peek(c.key)      # already held: keep the object we have
                if held is None:
                    if c.key not in stored:  # held above, evicted while others were encoded
                        stored[c.key] = (await self._store_forms([c]))[0]
                    if stored[c.key] is None:
                        continue             # failed verification
                    held = Held.of(stored[c.key])
            else:
                held = c
            if pin:
                try:
                    ok = tier.put(c.key, held, pin=True)
                except PinCapacityError:  # keep it, unpinned, rather than not at all
                    self.counters["pin_refused"] += 1
                    ok = tier.put(c.key, held)
            else:
                ok = tier.put(c.key, held)
            n += bool(ok)
            if ttl_s:
                self.expiry[c.key] = time.monotonic() + float(ttl_s)
        self.counters[f"received_{role}"] += n
        return n

    async def pin_keys(self, keys, token=None) -> int:
        """Pin chunks this edge holds (an operator pinned their KB to this region)."""
        self.tokens.check_admin(token, "pin_keys")
        n = 0
        for k in keys:
            c = self.main.peek(k) or self.hot.peek(k)
            if c is None:
                continue
            try:
                if k not in self.main:
                    self.main.put(k, c, pin=True)
                    self.hot.discard(k)
                else:
                    self.main.pin(k)
                n += 1
            except PinCapacityError:
                self.counters["pin_refused"] += 1
        return n

    async def peer_get(self, keys, token=None, region: str = None) -> list:
        """What this edge holds of `keys` (None elsewhere); asked by other edges, never cascades.

        region: where the asker (and so its reader, who pulls the objects from this node)
        is; each chunk then goes in the lossless form that crosses that link soonest.
        """
        self.tokens.check_admin(token, "peer_get")
        out = [self._local(k) for k in keys]
        self.counters["peer_served"] += sum(c is not None for c in out)
        if region is not None and region != self.region:
            held = [h for h in out if h is not None]
            forms, n = await self._link_forms(held, region, False, LOSSLESS, budget_s=PEER_TIMEOUT_S / 3)
            forms = iter(forms[:n] + [None] * (len(held) - n))     # a corrupt copy: not sent
            out = [None if h is None else next(forms) for h in out]
        return [None if h is None else h.wire() for h in out]

    async def drop(self, keys, token=None) -> int:
        self.tokens.check_admin(token, "drop")
        return sum(self.main.discard(k) | self.hot.discard(k) for k in keys)

    # --- manifests (broadcast by the origin, so reads survive an origin outage) -----------
    async def add_manifest(self, m: dict, token=None) -> None:
        self.tokens.check_admin(token, "add_manifest")
        self.manifests[(m["tenant"], m["fingerprint"], m["name"], m["version"])] = m
        self.ns_tenant[namespace_digest(m["tenant"], m["fingerprint"])] = m["tenant"]
        for k, v in zip(m.get("keys", ()), m.get("sums", ()) or ()):
            self.sums[k] = v

    async def _check_read(self, ns, token, what):
        """Reads of a tenant with a read token need it; the tenant is found from the namespace."""
        if not self.tokens.readers:
            return
        tenant = self.ns_tenant.get(ns)
        if tenant is None:
            for m in await self._call_origin("manifests", timeout=5.0) or []:
                await self.add_manifest(m, token=self.tokens.admin)
            tenant = self.ns_tenant.get(ns)
        if tenant is None:
            raise AccessDenied(f"{what}: no knowledge base is published under this namespace")
        self.tokens.check_read(tenant, token, what)

    def _verified(self, obj) -> bool:
        """False when a chunk's bytes differ from the checksum its manifest recorded, or an
        Encoded frame fails its own checks (lossy frames have only those: their KV is not the
        published KV, so the manifest's checksum cannot apply)."""
        try:
            chunk = obj.decode() if isinstance(obj, Encoded) else obj
        except FrameError:
            self.counters["corrupt_detected"] += 1
            return False
        if isinstance(obj, Encoded) and not obj.exact:
            return True
        want = self.sums.get(chunk.key)
        if want is None or chunk.digest() == want:
            return True
        self.counters["corrupt_detected"] += 1
        return False

    def _store_form(self, obj):
        """obj (Chunk or Encoded) verified and in the form this edge keeps; None if corrupt.
        CPU work: call it from a thread (_store_forms)."""
        if isinstance(obj, Encoded):
            try:
                chunk = obj.decode()
            except FrameError:
                self.counters["corrupt_detected"] += 1
                return None
            if obj.exact and not self._verified(chunk):
                return None
            if obj.codec == self.store_codec or not obj.exact:
                return obj          # lossy KV stays as it is: expanding it restores nothing
            obj = chunk
        elif not self._verified(obj):
            return None
        if self.store_codec == "raw":
            return obj
        self.counters["stored_encoded"] += 1
        return Encoded.of(obj, self.store_codec)

    async def _store_forms(self, objs) -> list:
        if self.store_codec == "raw" and not any(isinstance(o, Encoded) for o in objs):
            return [o if self._verified(o) else None for o in objs]
        return await asyncio.to_thread(lambda: [self._store_form(o) for o in objs])

    async def _own_copy(self, held):
        """held as this node's own object in this edge's stored form (a peer's object vanishes
        with the peer); None when it cannot be read in time or fails verification."""
        if held.own and held.codec == self.store_codec:
            return held
        try:
            obj = await asyncio.wait_for(held.ref, PEER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the peer went away: nothing to keep
            return None
        obj = (await self._store_forms([obj]))[0]
        return None if obj is None else Held.of(obj)

    async def drop_corrupt(self, keys, token=None) -> int:
        """A reader found these copies corrupt: drop them (they are fetched again elsewhere)."""
        self.counters["corrupt_reported"] += len(keys)
        dropped = 0
        for k in keys:   # a reader's claim is checked: only a copy that really fails is dropped
            for tier in (self.main, self.hot):
                held = tier.peek(k)
                if held is not None and not self._verified(await held.ref):
                    dropped += tier.discard(k)
        return dropped

    async def inject_corruption(self, key, token=None) -> bool:
        """Tests only (edge option fault_injection=True): replace a held copy with a corrupt one."""
        self.tokens.check_admin(token, "inject_corruption")
        if not self.fault_injection:
            raise AccessDenied("fault injection is disabled on this edge")
        for tier in (self.main, self.hot):
            held = tier.peek(key)
            if held is not None:
                c = await held.ref
                if isinstance(c, Encoded):
                    frame = np.array(c.frame, copy=True)
                    frame[-max(1, (frame.nbytes - 4096) // 2)] ^= 0xFF   # inside the payload
                    bad = Encoded(c.key, c.ns, c.codec, c.dtype, c.raw, c.exact, frame)
                else:
                    kv = np.array(c.kv, copy=True)
                    kv.reshape(-1).view(np.uint8)[kv.nbytes // 2] ^= 0xFF
                    bad = Chunk(c.key, c.ns, kv, c.dtype)
                tier.put(key, Held.of(bad))
                return True
        return False

    async def drop_manifest(self, ns, name, version, token=None) -> None:
        self.tokens.check_admin(token, "drop_manifest")
        for k in [k for k, m in self.manifests.items()
                  if k[2] == name and k[3] == version and Manifest.from_dict(m).ns == ns]:
            del self.manifests[k]

    async def list_manifests(self, tenant: str, fingerprint: str, token=None) -> list:
        """Manifests of one namespace: from the origin when it answers, else the broadcast copy."""
        self.tokens.check_read(tenant, token, "listing knowledge bases")
        from kdn.keys import namespace_digest
        got = await self._call_origin("manifests", namespace_digest(tenant, fingerprint), timeout=5.0)
        if got is not None:
            for m in got:
                await self.add_manifest(m, token=self.tokens.admin)
            return got
        return [m for (t, f, _, _), m in self.manifests.items() if t == tenant and f == fingerprint]

    # --- fetch --------------------------------------------------------------------------
    async def fetch(self, keys, ns: bytes, region: str = None, resolve: bool = False, token=None,
                    node: str = None, accept=None, _again: bool = False) -> dict:
        """The longest prefix of `keys` that the network holds, with where each chunk came from.

        Returns object references ("refs"; ray.get them: zero-copy on this node), each to a
        Chunk or an Encoded frame ("codecs" names each one's codec, "wire" its size in bytes),
        or with resolve=True the objects themselves as stored ("chunks", for the HTTP server in
        this process, which picks its own codec). node (the reader's Ray node id) and accept
        (codecs it takes besides raw; default the lossless ones) choose each chunk's form for
        the link: see the module docstring. Without node, chunks go as stored.
        """
        accept = check_accept(accept)
        await self._check_read(ns, token, "fetch")
        self._start_background()
        t0 = time.perf_counter()
        region = region or self.region
        n = len(keys)
        chunks, sources = [None] * n, [None] * n
        for i, k in enumerate(keys):
            c = self._local(k)
            if c is not None:
                chunks[i], sources[i] = c, "local"
        missing = [i for i in range(n) if chunks[i] is None]
        if missing:
            # Keys after the first one nobody holds are useless for a prefix; but a local gap
            # can be filled, so load every missing key up to the end and cut afterwards.
            loaded = await self.loads.do_many([keys[i] for i in missing], self._load_batch)
            for i, got in zip(missing, loaded):
                if got is not None:
                    chunks[i], sources[i] = got
        m = next((i for i in range(n) if chunks[i] is None), n)
        for i in range(m):
            if chunks[i].ns != ns or chunks[i].key != keys[i]:
                self.counters["namespace_refused"] += 1
                m = i
                break
        nbytes = 0
        keep = []
        for i in range(m):
            nbytes += chunks[i].raw
            self.demand.record(keys[i], region, chunks[i].nbytes)
            if sources[i] != "local":
                keep.append((keys[i], chunks[i], region))
        if keep:
            await self._keep(keep)
        self.counters["fetches"] += 1
        self.counters["chunks_served"] += m
        self.counters["bytes_served"] += nbytes
        for s in sources[:m]:
            self.counters["served_" + s.split(":")[0]] += 1
        self.counters["fetch_us"] += int((time.perf_counter() - t0) * 1e6)
        reply = {"sources": sources[:m], "edge": self.name, "region": self.region,
                 "ring": self.members_version}
        if resolve:
            reply["chunks"] = list(await asyncio.gather(*(h.resolve() for h in chunks[:m])))
            return reply
        if node is not None:
            forms, sendable = await self._link_forms(chunks[:m], region, node == self.node_id, accept)
            if sendable < m and not _again:
                # a corrupt copy was found (and dropped) while re-encoding: fetch once more,
                # from another replica or the origin, rather than answer a shorter prefix
                return await self.fetch(keys, ns, region, resolve, token, node, accept, _again=True)
            chunks[:m], m = forms, sendable
            reply["sources"] = reply["sources"][:m]
        reply["refs"] = [h.ref for h in chunks[:m]]
        reply["codecs"] = [h.codec for h in chunks[:m]]
        reply["wire"] = [h.nbytes for h in chunks[:m]]      # bytes of each object sent
        self.counters["wire_bytes"] += sum(reply["wire"])
        for h in chunks[:m]:
            self.counters["sent_" + h.codec] += 1
        return reply

    def _link_codec(self, held, region: str, same_node: bool, accept: tuple) -> str:
        """The form of one chunk that reaches a reader in `region` soonest (kdn.codecs)."""
        if same_node or held.codec in LOSSY:
            # raw stays zero-copy; a compressed form is decoded by the reader; lossy KV goes
            # as it is (expanding it restores nothing, and it must stay marked lossy)
            return held.codec
        allowed = accept + ((held.codec,) if held.codec != "raw" else ())
        try:
            bandwidth = self.topology.bandwidth_gbps(self.region, region)
            return choose_codec(held.raw, bandwidth, same_node=False, dtype=held.dtype,
                                allowed=allowed, stored=held.codec)
        except Exception:  # noqa: BLE001 - a codec with no profile, an unknown region: as stored
            return held.codec

    async def _link_forms(self, helds, region, same_node: bool, accept: tuple,
                          budget_s: float = None) -> tuple:
        """(helds, n): helds re-encoded where the link to the reader wants another form than
        stored, and n, the length of the prefix that may be sent (a copy found corrupt while
        re-encoding is dropped here and ends the prefix: a reader cannot check lossy KV
        against its manifest, so it must never be encoded from wrong bytes).

        A peer's object is left as the peer sent it: the peer chose its form for the link
        from its region to this one (peer_get), which is the reader's (readers use the edge
        of their own region), and re-encoding it here would first pull it over that link.
        budget_s bounds the estimated encode time (a peer answering within a timeout);
        chunks past it go as stored.
        """
        want = [self._link_codec(h, region, same_node, accept) if h.own else h.codec for h in helds]
        todo = [i for i, (h, c) in enumerate(zip(helds, want)) if c != h.codec]
        if budget_s is not None:
            spent, fits = 0.0, []
            for i in todo:
                spent += helds[i].raw / (PROFILE.get(want[i], PROFILE["zstd"])["encode_gbps"] * 1e9)
                if spent <= budget_s:
                    fits.append(i)
            todo = fits
        if not todo:
            return helds, len(helds)
        try:
            objs = await asyncio.wait_for(asyncio.gather(*(helds[i].ref for i in todo)), PEER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a peer's object went away: send the forms we have
            return helds, len(helds)

        def transcode():
            out = []
            for obj, i in zip(objs, todo):
                try:
                    chunk = obj.decode() if isinstance(obj, Encoded) else obj
                except FrameError:
                    return out, i
                if (not isinstance(obj, Encoded) or obj.exact) and not self._verified(chunk):
                    return out, i
                out.append(chunk if want[i] == "raw" else Encoded.of(chunk, want[i]))
            return out, None
        made, bad = await asyncio.to_thread(transcode)
        out = list(helds)
        for i, obj in zip(todo, made):
            out[i] = Held.of(obj)
        self.counters["transcoded"] += len(made)
        if bad is None:
            return out, len(out)
        self.counters["corrupt_dropped"] += 1
        self.main.discard(helds[bad].key)
        self.hot.discard(helds[bad].key)
        return out, bad

    async def _keep(self, items):
        """Keep chunks that came from elsewhere if this edge owns them or its region reads them hot.

        A peer's object belongs to the peer (it vanishes with it), so a kept copy is put into
        this node's store as our own object.
        """
        owners = self._owners([k for k, _, _ in items])
        later = []
        for (key, held, region), os_ in zip(items, owners):
            if self.name in os_:
                tier, counter = self.main, "refilled"
            elif region == self.region and key in self.demand.hot(region):
                tier, counter = self.hot, "hot_promoted"
            else:
                continue
            if self.store_codec != "raw" or held.codec != "raw":
                if key not in self._keeping and key not in tier:
                    self._keeping.add(key)                 # one encode per key at a time
                    later.append((key, held, tier, counter))   # encoding: not on the reader's time
                continue
            held = await self._own_copy(held)
            if held is not None and tier.put(key, held):
                self.counters[counter] += 1
        if later:
            task = asyncio.get_running_loop().create_task(self._keep_copies(later))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _keep_copies(self, items):
        for key, held, tier, counter in items:
            try:
                held = await self._own_copy(held)
                if held is not None and tier.put(key, held):
                    self.counters[counter] += 1
            except Exception:  # noqa: BLE001 - a copy not kept is fetched again next time
                self.counters["keep_errors"] += 1
            finally:
                self._keeping.discard(key)

    async def _load_batch(self, keys) -> dict:
        """Load keys from owners nearest first, then the origin: one call per source per round."""
        result = {}
        owners = self._owners(keys)
        ranked = {}
        for k, os_ in zip(keys, owners):
            cands = [(o, self.ring.region_of(o)) for o in os_ if o != self.name]
            ranked[k] = self.topology.rank_sources(self.region, cands, 1 << 20) if cands else []
        lacking = collections.defaultdict(list)   # owner -> keys it should have had
        pending = list(keys)
        rnd = 0
        while pending and any(len(ranked[k]) > rnd for k in pending):
            groups = collections.defaultdict(list)
            for k in pending:
                if len(ranked[k]) > rnd:
                    groups[ranked[k][rnd]].append(k)
            replies = await asyncio.gather(*(self._call(e, "peer_get", ks, region=self.region)
                                             for e, ks in groups.items()))
            for (e, ks), got in zip(groups.items(), replies):
                for k, w in zip(ks, got or [None] * len(ks)):
                    if w is not None and w[1] == k:
                        result[k] = (Held.from_wire(w), f"peer:{e}")
                    elif got is not None:
                        lacking[e].append(k)
            pending = [k for k in pending if k not in result]
            rnd += 1
        if pending:
            got = await self._call_origin("get_chunks", pending) or [None] * len(pending)
            if any(isinstance(c, Encoded) for c in got):   # decoding to verify: off the loop
                ok = await asyncio.to_thread(lambda: [c is not None and self._verified(c) for c in got])
            else:
                ok = [c is not None and self._verified(c) for c in got]
            origin_chunks = {}
            for k, c, good in zip(pending, got, ok):
                if good and c.key == k:
                    result[k] = (Held.of(c), "origin")
                    origin_chunks[k] = c
            for e, ks in lacking.items():      # read repair, after the reply is on its way
                repair = [origin_chunks[k] for k in ks if k in origin_chunks]
                if repair:
                    self.counters["repairs_sent"] += len(repair)
                    asyncio.get_running_loop().create_task(self._call(e, "put_chunks", repair))
        return result

    async def lookup(self, keys, ns: bytes, token=None) -> dict:
        """How long a prefix of keys the network holds, without moving any KV."""
        await self._check_read(ns, token, "lookup")
        def held(k):
            c = self.main.peek(k) or self.hot.peek(k)
            return c is not None and c.ns == ns     # another tenant's chunk is not "held" for you

        here = [held(k) for k in keys]
        n = next((i for i, h in enumerate(here) if not h), len(keys))
        if n < len(keys):
            rest = list(keys[n:])
            got = await self._call_origin("has", rest, ns, timeout=5.0)
            if got is None:  # origin down: ask the owners
                got = [False] * len(rest)
                for i, (k, os_) in enumerate(zip(rest, self._owners(rest))):
                    for o in os_:
                        if o != self.name and (await self._call(o, "have", [k], ns) or [False])[0]:
                            got[i] = True
                            break
            n += next((i for i, h in enumerate(got) if not h), len(got))
        return {"chunks": n, "local": sum(here[:n]), "edge": self.name}

    async def stats(self) -> dict:
        c = dict(self.counters)
        return {"role": "edge", "name": self.name, "region": self.region, "pid": os.getpid(),
                "store_codec": self.store_codec, "node_id": self.node_id,
                "main": self.main.stats(), "hot": self.hot.stats(),
                "held_raw_bytes": sum(h.raw for t in (self.main, self.hot) for h in t.values()),
                "hot_copies": len(self.hot), "ring_version": self.members_version,
                "members": len(self.ring), "counters": c, "uptime_s": time.time() - self.started,
                "http": self.http_address(), "demand": self.demand.stats()}
