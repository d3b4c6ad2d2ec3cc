"""The origin node: an async Ray actor around the durable chunk store.

It is the authority: every published chunk and manifest lives on its disk, and it keeps the
network's membership (which edges exist, in which region). Publishing is two calls from the
client — `put_chunks` (only the chunks the origin lacks: re-publishing transfers nothing) and
`commit` (the manifest, written last, so a version is visible only once every chunk is
durable) — after which the origin pushes each chunk to its ring owners with bounded
concurrency, asking each owner first which chunks it already holds.

Disk work runs in threads so a slow fsync never stalls the event loop that serves edges'
pull-through reads. A restarted origin reopens its store and its membership from disk.
With store_codec="zstd" its disk holds chunks losslessly compressed (reads decode them);
lossy codecs are refused here: the origin keeps the exact KV that every copy is checked against.
"""
import asyncio
import collections
import os
import time
from pathlib import Path

import msgpack

from kdn.names import NAMESPACE, edge_actor_name
from kdn.auth import Tokens
from kdn.chunk import Chunk
from kdn.errors import BadRequest, KDNError, ManifestError, StoreError, VersionNotFound
from kdn.keys import namespace_digest
from kdn.manifest import Manifest
from kdn.origin.store import ChunkStore
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology

PUSH_BATCH_BYTES = 64 << 20      # one put_chunks call carries at most this much
MAX_CHUNKS_PER_CALL = 4096       # limits on what one publish call may carry
MAX_BYTES_PER_CALL = 2 << 30
MAX_TOKENS_PER_KB = 1 << 24
PUSH_CONCURRENCY = 4             # batches in flight at once, across all edges
CALL_TIMEOUT_S = 30.0            # an edge that does not answer a push in time is skipped
HEALTH_PERIOD_S = 1.0            # every edge is pinged this often ...
HEALTH_TIMEOUT_S = 1.0           # ... and must answer within this
DOWN_AFTER = 5                   # consecutive misses before its keys are re-homed (a restart takes ~2 s)


def check_store_codec(codec: str) -> str:
    """The origin is the source of truth: it may store chunks compressed, but only losslessly."""
    from kdn.transfer import check_store_codec as check
    return check(codec, "origin")


class OriginNode:
    def __init__(self, network: str, root: str, topology: dict, replicas: int = 2, auth: dict = None,
                 store_codec: str = "raw"):
        self.network = network
        self.tokens = Tokens.from_dict(auth)
        self.root = Path(root)
        check_store_codec(store_codec)
        self.store = ChunkStore(self.root / "store", codec=store_codec)
        self.topology = Topology.from_dict(topology)
        self.replicas = max(1, int(replicas))
        self.members_file = self.root / "membership.msgpack"
        self.members, self.version, self.overrides = self._load_members()
        self.ring = Ring([Edge(*m) for m in self.members])
        self.handles = {}
        self.counters = collections.Counter()
        self.started = time.time()
        self.down = {}                   # name -> (region, weight): members out for failing health checks
        self.misses = collections.Counter()
        self._bg = None

    # --- membership ---------------------------------------------------------------------
    def _load_members(self):
        try:
            d = msgpack.unpackb(self.members_file.read_bytes(), raw=False)
            return [tuple(m) for m in d["members"]], int(d["version"]), d.get("overrides", {})
        except FileNotFoundError:
            return [], 0, {}

    def _save_members(self):
        tmp = self.members_file.with_suffix(".tmp")
        self.root.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(msgpack.packb({"members": [list(m) for m in self.members], "version": self.version,
                                   "overrides": self.overrides}, use_bin_type=True))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.members_file)

    def membership(self) -> dict:
        """What clients and edges compute placement from (they never ask per request)."""
        if self._bg is None:
            try:
                self._start_background()
            except RuntimeError:   # called outside the event loop (from __init__ paths)
                pass
        return {"version": self.version, "members": [list(m) for m in self.members],
                "replicas": self.replicas, "topology": self.topology.to_dict(),
                "overrides": self.overrides}

    async def ping(self) -> dict:
        self._start_background()
        return {"role": "origin", "network": self.network, "members": self.version,
                "pid": os.getpid()}

    def _start_background(self):
        if self._bg is None:
            self._bg = asyncio.get_running_loop().create_task(self._health_loop())

    async def _health_loop(self):
        """Ping every edge; one that misses DOWN_AFTER in a row leaves the ring (its keys are
        re-homed to the next owners), and rejoins when it answers again. A crashed Ray node
        takes ~15 s to be declared dead; this takes ~DOWN_AFTER seconds and needs no Ray state."""
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            try:
                await self._health_round()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                self.counters["health_errors"] += 1

    async def _health_round(self):
        names = [m[0] for m in self.members] + list(self.down)
        replies = await asyncio.gather(*(self._call(n, "ping", timeout=HEALTH_TIMEOUT_S) for n in names))
        alive = {n for n, r in zip(names, replies) if r is not None}
        for n in names:
            self.misses[n] = 0 if n in alive else self.misses[n] + 1
        gone = [m for m in self.members if self.misses[m[0]] >= DOWN_AFTER]
        back = [(n, *self.down[n]) for n in self.down if n in alive]
        if not gone and not back:
            return
        for n, r, w in gone:
            self.down[n] = (r, w)
            self.counters["edges_marked_down"] += 1
        for n, _, _ in back:
            del self.down[n]
            self.counters["edges_back"] += 1
        keep = [m for m in self.members if m not in gone] + back
        if keep:
            await self.set_members(keep, _health=True, token=self.tokens.admin)

    async def set_members(self, members, _health: bool = False, token=None) -> dict:
        """Replace the membership (list of (name, region, weight)); re-home keys that moved."""
        self.tokens.check_admin(token, "set_members")
        self._start_background()
        members = [(str(n), str(r), float(w)) for n, r, w in members]
        if not _health:   # an operator's membership: forget health-check removals of other edges
            self.down = {n: v for n, v in self.down.items() if n in {m[0] for m in members}}
            members = [m for m in members if m[0] not in self.down]
        if len({m[0] for m in members}) != len(members):
            raise KDNError(f"edge names must be unique, got {[m[0] for m in members]}")
        old = Ring([Edge(*m) for m in self.members])
        if members == self.members:
            await self._broadcast_membership()
            return self.membership()
        self.members = members
        self.version += 1
        self.ring = Ring([Edge(*m) for m in members])
        for n, r, w in members:
            if r not in self.topology.regions:
                raise KDNError(f"edge {n!r} is in region {r!r}, which the topology does not name "
                               f"(regions: {', '.join(self.topology.regions)})")
        await asyncio.to_thread(self._save_members)
        await self._broadcast_membership()
        moved = await self._rehome(old) if len(old) else 0
        self.counters["rehomed_chunks"] += moved
        return self.membership()

    async def add_edge(self, name: str, region: str, weight: float = 1.0, token=None) -> dict:
        self.tokens.check_admin(token, "add_edge")
        if any(m[0] == name for m in self.members):
            raise KDNError(f"edge {name!r} is already a member")
        return await self.set_members(self.members + [(name, region, float(weight))], token=token)

    async def remove_edge(self, name: str, token=None) -> dict:
        self.tokens.check_admin(token, "remove_edge")
        if name in self.down:
            del self.down[name]
            return self.membership()
        if not any(m[0] == name for m in self.members):
            raise KDNError(f"edge {name!r} is not a member (members: {[m[0] for m in self.members]})")
        self.handles.pop(name, None)
        return await self.set_members([m for m in self.members if m[0] != name], token=token)

    def _handle(self, name):
        import ray
        h = self.handles.get(name)
        if h is None:
            h = ray.get_actor(edge_actor_name(self.network, name), namespace=NAMESPACE)
            self.handles[name] = h
        return h

    async def _call(self, name, method, *args, timeout=CALL_TIMEOUT_S, **kw):
        """Call an edge; None when it is gone or too slow (it refills by pull-through later)."""
        try:
            ref = getattr(self._handle(name), method).remote(*args, token=self.tokens.admin, **kw)
            return await asyncio.wait_for(ref, timeout)
        except Exception:  # noqa: BLE001 - a dead or slow edge must not fail a publish
            self.handles.pop(name, None)
            self.counters["edge_call_failures"] += 1
            return None

    async def _broadcast_membership(self):
        m = self.membership()
        await asyncio.gather(*(self._call(n, "set_membership", m, timeout=10) for n, _, _ in self.members))

    # --- publish ------------------------------------------------------------------------
    async def missing(self, keys, token=None) -> list:
        """Indices of `keys` the store lacks (the client sends only those chunks)."""
        self.tokens.check_admin(token, "publish (missing)")
        return [i for i, k in enumerate(keys) if not self.store.has(k)]

    async def has(self, keys, ns: bytes = None, token=None) -> list:
        """Which keys are stored (and, given ns, stored under that namespace)."""
        self.tokens.check_admin(token, "has")
        if ns is None:
            return [self.store.has(k) for k in keys]
        return await asyncio.to_thread(lambda: [self.store.ns_of(k) == ns for k in keys])

    async def put_chunks(self, chunks, token=None) -> dict:
        self.tokens.check_admin(token, "publish (put_chunks)")
        if not isinstance(chunks, (list, tuple)) or len(chunks) > MAX_CHUNKS_PER_CALL:
            raise BadRequest(f"put_chunks takes a list of at most {MAX_CHUNKS_PER_CALL} chunks, got "
                             f"{len(chunks) if isinstance(chunks, (list, tuple)) else type(chunks).__name__}")
        bad = next((i for i, c in enumerate(chunks) if not isinstance(c, Chunk)), None)
        if bad is not None:
            raise BadRequest(f"put_chunks: item {bad} is a {type(chunks[bad]).__name__}, not a Chunk")
        if sum(c.nbytes for c in chunks) > MAX_BYTES_PER_CALL:
            raise BadRequest(f"put_chunks carries more than {MAX_BYTES_PER_CALL} bytes: split it")
        written = await asyncio.to_thread(lambda: [self.store.put(c) for c in chunks])
        n = sum(written)
        self.counters["chunks_received"] += len(chunks)
        self.counters["chunks_written"] += n
        return {"received": len(chunks), "written": n}

    async def commit(self, manifest: dict, push: bool = True, token=None) -> dict:
        """Commit a manifest (all its chunks must be stored), push to owners, return a receipt."""
        self.tokens.check_admin(token, "publish (commit)")
        m = Manifest.from_dict(manifest) if isinstance(manifest, dict) else manifest
        if not isinstance(m, Manifest):
            raise BadRequest(f"commit takes a manifest, got {type(manifest).__name__}")
        if m.n_tokens > MAX_TOKENS_PER_KB:
            raise BadRequest(f"KB {m.name!r} has {m.n_tokens} tokens; the limit is {MAX_TOKENS_PER_KB}")
        t0 = time.perf_counter()
        latest = await asyncio.to_thread(self._latest, m.tenant, m.fingerprint, m.name)
        if latest is not None and self._same_content(latest, m):
            committed, unchanged = latest, True    # publishing unchanged knowledge: no new version
        else:
            committed, unchanged = await asyncio.to_thread(self.store.commit, m), False
            self.counters["versions_committed"] += 1
        await asyncio.gather(*(self._call(n, "add_manifest", committed.to_dict(), timeout=10)
                               for n, _, _ in self.members))
        placement, pushed = {}, {}
        if push:
            placement, pushed = await self._push(committed)
        return {"kb": committed.name, "tenant": committed.tenant, "version": committed.version,
                "unchanged": unchanged,
                "chunks": len(committed.keys), "tokens": committed.n_tokens,
                "bytes": self._bytes_of(committed.keys), "placement": placement, "pushed": pushed,
                "seconds": time.perf_counter() - t0}

    def _latest(self, tenant, fingerprint, name):
        try:
            return self.store.manifest(namespace_digest(tenant, fingerprint), name)
        except VersionNotFound:
            return None

    @staticmethod
    def _same_content(a: Manifest, b: Manifest) -> bool:
        return (a.keys == b.keys and a.layout == b.layout and a.chunk_tokens == b.chunk_tokens
                and [(d.name, d.start, d.end, d.digest) for d in a.documents]
                == [(d.name, d.start, d.end, d.digest) for d in b.documents] and a.meta == b.meta)

    def _bytes_of(self, keys):
        return sum(self.store.size_of(k) for k in set(keys))

    def _targets(self, m: Manifest) -> dict:
        """edge -> [keys]: ring owners (replica count per KB override) plus pinned regions."""
        ov = self.overrides.get(self._kb_id(m.tenant, m.name), {})
        r = int(ov.get("replicas") or self.replicas)
        targets = collections.defaultdict(list)
        if len(self.ring):
            for k, owners in zip(m.keys, self.ring.owners_batch(list(m.keys), r)):
                for o in owners:
                    targets[o].append(k)
        for region in ov.get("pin_regions", []):
            for name, reg, _ in self.members:
                if reg == region:
                    targets[name].extend(k for k in m.keys if k not in set(targets[name]))
                    break
        return targets

    async def _push(self, m: Manifest):
        ov = self.overrides.get(self._kb_id(m.tenant, m.name), {})
        pinned_edges = {n for region in ov.get("pin_regions", []) for n, reg, _ in self.members
                        if reg == region}
        targets = self._targets(m)
        sem = asyncio.Semaphore(PUSH_CONCURRENCY)
        pushed = {}

        async def push_to(edge, keys):
            have = await self._call(edge, "have", keys, timeout=10)
            if have is None:
                pushed[edge] = 0
                return
            todo = [k for k, h in zip(keys, have) if not h]
            if edge in pinned_edges:   # chunks it already holds get pinned where they are
                await self._call(edge, "pin_keys", [k for k, h in zip(keys, have) if h])
            pushed[edge] = await self._send(edge, todo, sem, role="main", pin=edge in pinned_edges,
                                            ttl_s=ov.get("ttl_s"))

        await asyncio.gather(*(push_to(e, ks) for e, ks in targets.items()))
        self.counters["chunks_pushed"] += sum(pushed.values())
        return {e: len(ks) for e, ks in targets.items()}, pushed

    async def _send(self, edge, keys, sem, role="main", pin=False, ttl_s=None) -> int:
        """Send chunks to an edge in batches of at most PUSH_BATCH_BYTES; returns chunks sent."""
        sent, batch, size = 0, [], 0

        async def flush(batch):
            async with sem:
                chunks = await asyncio.to_thread(self._outgoing, batch)
                ok = await self._call(edge, "put_chunks", chunks, role=role, pin=pin, ttl_s=ttl_s)
                return len(batch) if ok is not None else 0

        jobs = []
        for k in keys:
            batch.append(k)
            size += self.store.size_of(k)
            if size >= PUSH_BATCH_BYTES:
                jobs.append(flush(batch))
                batch, size = [], 0
        if batch:
            jobs.append(flush(batch))
        for n in await asyncio.gather(*jobs):
            sent += n
        return sent

    async def _rehome(self, old_ring) -> int:
        """After a membership change, push every live chunk to owners that did not own it."""
        moved = 0
        sem = asyncio.Semaphore(PUSH_CONCURRENCY)
        for m in self.store.manifests():
            targets = self._targets(m)
            old_owners = {k: set(o) for k, o in zip(m.keys, old_ring.owners_batch(list(m.keys), self.replicas))}
            jobs = []
            for edge, keys in targets.items():
                new_keys = [k for k in keys if edge not in old_owners.get(k, ())]
                if new_keys:
                    jobs.append(self._send(edge, new_keys, sem))
            moved += sum(await asyncio.gather(*jobs))
        return moved

    # --- reads (edges' pull-through, operators) ------------------------------------------
    def _outgoing(self, keys) -> list:
        """What goes to edges for keys: Chunks from a raw store; from a compressed one the
        stored frames as they are (kdn.chunk.Encoded: fewer bytes on the wire, no decoding
        here, and an edge storing the same codec keeps them without re-encoding). None where
        absent or corrupt (never sent). Disk work: call it in a thread."""
        out = []
        for k in keys:
            try:
                if self.store.codec == "raw":
                    out.append(self.store.get(k))
                else:
                    e = self.store.get_encoded(k)
                    out.append(e.decode() if e.codec == "raw" else e)
            except StoreError:
                out.append(None)
        return out

    async def get_chunks(self, keys, token=None) -> list:
        """Chunks for `keys` (None where absent or found corrupt: a corrupt copy is never served);
        Encoded frames where the store is compressed."""
        self.tokens.check_admin(token, "get_chunks")
        chunks = await asyncio.to_thread(self._outgoing, keys)
        self.counters["chunks_served"] += sum(c is not None for c in chunks)
        return chunks

    async def manifests(self, ns: bytes = None, token=None) -> list:
        self.tokens.check_admin(token, "manifests")
        return [m.to_dict() for m in self.store.manifests(ns)]

    async def manifest(self, ns: bytes, name: str, version: int = None, token=None) -> dict:
        self.tokens.check_admin(token, "manifest")
        return self.store.manifest(ns, name, version).to_dict()

    async def delete_version(self, ns: bytes, name: str, version: int, token=None) -> dict:
        self.tokens.check_admin(token, "delete_version")
        await asyncio.to_thread(self.store.delete_version, ns, name, version)
        await asyncio.gather(*(self._call(n, "drop_manifest", ns, name, version, timeout=10)
                               for n, _, _ in self.members))
        return {"deleted": f"{name}@v{version}"}

    async def collect(self, token=None) -> dict:
        self.tokens.check_admin(token, "collect")
        return await asyncio.to_thread(self.store.collect)

    # --- operator controls ---------------------------------------------------------------
    @staticmethod
    def _kb_id(tenant, name):
        return f"{tenant}/{name}"

    async def set_override(self, tenant: str, kb: str, pin_regions=None, replicas=None, ttl_s=None,
                           prefetch=None, token=None) -> dict:
        """Per-KB operator settings; applied to the latest version at once (pushes, pins)."""
        self.tokens.check_admin(token, "operator control (set_override)")
        latest = [m for m in self.store.manifests() if m.tenant == tenant and m.name == kb]
        if not latest:
            raise ManifestError(f"no committed knowledge base {tenant}/{kb}")
        ov = dict(self.overrides.get(self._kb_id(tenant, kb), {}))
        if pin_regions is not None:
            bad = [r for r in pin_regions if r not in self.topology.regions]
            if bad:
                raise KDNError(f"cannot pin {kb!r} to unknown region(s) {bad}; regions: {self.topology.regions}")
            ov["pin_regions"] = list(pin_regions)
        if replicas is not None:
            if not isinstance(replicas, int) or replicas < 1:
                raise KDNError(f"replicas must be an int >= 1, got {replicas!r}")
            ov["replicas"] = replicas
        if ttl_s is not None:
            if not isinstance(ttl_s, (int, float)) or ttl_s <= 0:
                raise KDNError(f"ttl_s must be a number > 0, got {ttl_s!r}")
            ov["ttl_s"] = float(ttl_s)
        if prefetch is not None:
            ov["prefetch"] = bool(prefetch)
        self.overrides[self._kb_id(tenant, kb)] = ov
        await asyncio.to_thread(self._save_members)
        await self._broadcast_membership()
        m = max(latest, key=lambda m: m.version)
        placement, pushed = await self._push(m)
        return {"kb": kb, "override": ov, "placement": placement, "pushed": pushed}

    async def warm(self, tenant: str, kb: str, region: str, version: int = None, token=None) -> dict:
        """Copy a KB's chunks into every edge of `region` now, as hot copies (prefetch)."""
        self.tokens.check_admin(token, "operator control (warm)")
        ms = [m for m in self.store.manifests() if m.tenant == tenant and m.name == kb
              and (version is None or m.version == version)]
        if not ms:
            raise ManifestError(f"no committed knowledge base {tenant}/{kb}"
                                + (f" version {version}" if version else ""))
        m = max(ms, key=lambda m: m.version)
        edges = [n for n, r, _ in self.members if r == region]
        if not edges:
            raise KDNError(f"no edge in region {region!r}")
        sem = asyncio.Semaphore(PUSH_CONCURRENCY)
        sent = {}
        for e in edges:
            have = await self._call(e, "have", list(m.keys), timeout=10) or [False] * len(m.keys)
            sent[e] = await self._send(e, [k for k, h in zip(m.keys, have) if not h], sem, role="hot")
        return {"kb": kb, "version": m.version, "region": region, "sent": sent}

    async def auth_config(self, token=None) -> dict:
        """The token configuration, for an edge an operator adds (admin only)."""
        self.tokens.check_admin(token, "auth_config")
        return self.tokens.to_dict()

    async def stats(self) -> dict:
        s = self.store.stats()
        return {"role": "origin", "network": self.network, "members": len(self.members),
                "down": sorted(self.down),
                "membership_version": self.version, "uptime_s": time.time() - self.started,
                "store": s, "counters": dict(self.counters), "overrides": self.overrides}
