"""Other cache layers' objects in KDN: opaque byte strings under keys in a tenant namespace.

LMCache (kdn.integrations.lmcache) and SGLang's HiCache (kdn.integrations.sglang) hand KDN objects it
does not interpret: an LMCache memory object's bytes, an SGLang page. Each is kept as one
opaque chunk (kdn.core.chunk: dtype "opaque", its frame says so) whose bytes are the object
followed by the xxh3_64 of the object (8 bytes, little-endian): no manifest names these
chunks, so the checksum travels with them and a loader checks every object end to end,
whatever path it took (Ray's object store, an edge's disk, a compressed link).

Keys: a host key (LMCache's ObjectKey fields, SGLang's per-page SHA-256 hex) becomes
xxh3_128(namespace ‖ host key bytes), the namespace being namespace_digest(tenant,
"<layer>/<model>"). A host's per-user salt picks the tenant (`Tenancy`): a salt never
reads around its tenant, and two salts never share a namespace.

Paths: a store goes, by the host's `ack` setting, to the nearest live edge (`ack = "edge"`,
the default, as LMCache's own adapters answer once their backend holds the bytes: the edge
keeps them in memory and answers, and makes them durable at the origin after, with a bounded
backlog: kdn/edge/stores.py; an edge on another node than the host's is written over its
HTTP frames, POST /v1/objects: kdn.client.view) or to the origin (`ack = "origin"`: `put_objects` answers once
they are durable there, one fsync batch a call; from another node than the origin's, over its
HTTP server: kdn/client/ingest.py); either way the origin pushes them to their
ring owners in the background; a lookup asks the nearest live edge, which answers for itself and asks the
origin for the rest (`holds`); a load fetches from the nearest live edge (kdn.client.reader:
failover, pull-through), which serves what it lacks from the ring owners and the origin, so
a load right after a store finds the object even before its push arrives. Loads and lookups
go in batches, each under the deadline of its keys and bytes (kdn.core.transfer), so a load
of the most keys a fetch may name meets its deadlines on healthy edges, and a batch no edge
answers ends a load with what arrived. An object that does not arrive intact is reported
not loaded (the host recomputes it): never a wrong byte.
Every call here blocks; hosts run them off their engine's thread.

Tokens, least privilege: writes (store, delete) carry the admin token; reads carry the
tenant's read token (and name the tenant and fingerprint their namespace digests, so an
edge checks that token for a namespace no manifest names).

Lifetime: the origin keeps objects durably, across restarts and its `collect` (which keeps
every opaque chunk, since no manifest names them). They go when the host deletes them
(LMCache's `delete`, which its eviction calls: `delete` here, from the origin and every
edge) or by an operator's `collect(object_ttl_s=...)`, which removes those written longer
ago than that. SGLang's HiCache has no per-key delete: its objects go by the TTL. Edges
evict their copies by their own bounds, like any chunk.
"""
import collections
import concurrent.futures
import contextlib
import struct
import threading

import numpy as np
import xxhash

from kdn.core.chunk import Chunk
from kdn.core.dtypes import OPAQUE
from kdn.core.errors import AccessDenied, BadConfig, FrameError, NoLiveEdge
from kdn.core.rpc import Unreachable
from kdn.core.keys import namespace_digest
from kdn.core.transfer import fetch_deadline_s

TRAILER = 8                      # xxh3_64 of the object, after its bytes
PUT_BATCH_BYTES = 256 << 20         # one put_objects call carries at most this much
BATCH_OBJECTS = 1024
ACK_EDGE, ACK_ORIGIN = "edge", "origin"   # where a store is acknowledged (the hosts' `ack`)
ACKS = (ACK_EDGE, ACK_ORIGIN)
STORE_TIMEOUT_S = 30.0           # a store batch (retried while the origin restarts)
WITHDRAW_WAIT_S = STORE_TIMEOUT_S - 5     # an edge's wait for a delete's keys on their way (inside the call's)
# A load or lookup asks in batches of at most these, each under its own deadline (that of its
# keys and bytes: kdn.core.transfer.fetch_deadline_s): a hung edge costs one batch's deadline
# (then it is tried last), and a batch no edge answers loses only itself and what follows.
READ_BATCH_KEYS = 1024           # a 9.1 s deadline; 0.3-2.5 s healthy (small objects, 2 busy cores)
READ_BATCH_BYTES = 512 << 20     # within an edge's reply bound (1 GiB): one answer a batch
_BLOCK = 1 << 20                 # copy+hash block: fits L2, so the copy reads from cache
                                 # (loads of 32 x 8 MiB from the local edge: 1 MiB 41 ms, 256 KiB 46)
_TRAILER = struct.Struct("<Q")
# copy+hash of a load's objects, two at once: numpy's copy releases the GIL, and one
# thread leaves the second core idle (measured +10-30% on 32 x 8 MiB, a busy 2-core machine)
_UNPACK = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kdn-unpack")


def check_params(params: dict, allowed: dict, where: str) -> dict:
    """params checked against allowed (name -> (type or tuple of types, default; REQUIRED
    for none)): BadConfig naming the first unknown, missing or mistyped field."""
    if not isinstance(params, dict):
        raise BadConfig(f"{where} must be a JSON object, got {type(params).__name__}")
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise BadConfig(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(allowed))})")
    out = {}
    for name, (kind, default) in allowed.items():
        if name not in params:
            if default is REQUIRED:
                raise BadConfig(f"{where}: field {name!r} is required")
            out[name] = default
            continue
        value = params[name]
        if not isinstance(value, kind) or isinstance(value, bool) and bool not in _kinds(kind):
            names = "/".join(k.__name__ for k in _kinds(kind))
            raise BadConfig(f"{where}: field {name!r} must be {names}, got {value!r:.60}")
        out[name] = value
    return out


REQUIRED = object()


def _kinds(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


class Tenancy:
    """A host's per-user salt -> the KDN tenant it stores and reads as.

    No salt (or "") is `tenant`. A salt named in `tenants` is that tenant; any other salt is
    a tenant of its own, "<tenant>~<salt>", so salts never share keys and never fall back
    to the default tenant.
    """

    def __init__(self, tenant: str = "default", tenants: dict = None, where: str = "config"):
        tenants = dict(tenants or {})
        for salt, t in tenants.items():
            if not isinstance(t, str) or not t:
                raise BadConfig(f"{where}: field 'tenants' maps salt {salt!r} to {t!r}, "
                                f"not a tenant name")
        self.tenant, self.tenants = tenant, tenants

    def of(self, salt) -> str:
        if not salt:
            return self.tenant
        return self.tenants.get(salt) or f"{self.tenant}~{salt}"


def read_tokens_of(tenant: str, read_token, read_tokens, where: str) -> dict:
    """tenant -> read token from a host's settings: read_tokens (a dict), and read_token as
    tenant's; BadConfig naming the field for a token that is not a non-empty string."""
    out = dict(read_tokens or {})
    if read_token is not None:
        out[tenant] = read_token
    for t, tok in out.items():
        if not isinstance(t, str) or not t or not isinstance(tok, str) or not tok:
            field = "read_token" if t == tenant and read_token is not None else "read_tokens"
            raise BadConfig(f"{where}: field {field!r} maps tenant {t!r} to {tok!r:.20}, not a "
                            f"read token")
    return out


def object_namespace(tenant: str, layer: str, model: str) -> bytes:
    """The namespace of one host layer's objects of one model for one tenant."""
    return namespace_digest(tenant, f"{layer}/{model}")


def object_key(ns: bytes, host_key: bytes) -> bytes:
    """The KDN key of a host key (its bytes, e.g. LMCache's fields or SGLang's hex) in ns."""
    return xxhash.xxh3_128_digest(ns + host_key)


def as_bytes(obj) -> memoryview:
    """A flat byte view of a host buffer (memoryview, bytes, numpy array, CPU tensor)."""
    mv = memoryview(obj)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def pack(key: bytes, ns: bytes, data, into=None) -> Chunk:
    """An opaque chunk holding data's bytes and their checksum (one copy of the bytes), in
    `into` (a uint8 array of at least that many bytes) when given, else in new memory.

    Its kv is a read-only view that carries its frame's payload checksum (the xxh3_64 of the
    object and its trailer), hashed block by block in the same pass, while each block is in
    cache: a frame of it written over HTTP (an edge's or the origin's server) costs no second
    pass over the bytes. Ray's copy of it carries no checksum (Chunk.__reduce__): whoever
    receives it hashes again. The caller keeps `into` unchanged until the chunk is sent."""
    src = np.frombuffer(as_bytes(data), np.uint8)
    arr = np.empty(src.size + TRAILER, np.uint8) if into is None else into[:src.size + TRAILER]
    body, h, frame = arr[:src.size], xxhash.xxh3_64(), xxhash.xxh3_64()
    for s in range(0, src.size, _BLOCK):
        np.copyto(body[s:s + _BLOCK], src[s:s + _BLOCK])
        h.update(body[s:s + _BLOCK])
        frame.update(body[s:s + _BLOCK])
    arr[src.size:] = np.frombuffer(_TRAILER.pack(h.intdigest()), np.uint8)
    frame.update(arr[src.size:])
    kv = arr.view()
    kv.flags.writeable = False
    chunk = Chunk(key, ns, kv, OPAQUE)
    object.__setattr__(chunk, "_xxh", frame.intdigest())
    return chunk


def unpack_into(chunk: Chunk, out) -> bool:
    """Copy chunk's object into the writable buffer out if it is an intact object of exactly
    out's size; False (out's contents then undefined: the host recomputes) otherwise."""
    dst = np.frombuffer(as_bytes(out), np.uint8)
    kv = chunk.kv
    if not chunk.opaque or kv.size != dst.size + TRAILER:
        return False
    body, h = kv[:dst.size], xxhash.xxh3_64()
    for s in range(0, dst.size, _BLOCK):       # hash the source block, then copy it
        h.update(body[s:s + _BLOCK])
        np.copyto(dst[s:s + _BLOCK], body[s:s + _BLOCK])
    return h.intdigest() == _TRAILER.unpack(kv[dst.size:].tobytes())[0]


def read_batch(sizes: list, todo: list, max_keys: int = None, max_bytes: int = None) -> int:
    """How many of todo's leading objects (indices into sizes, their bytes) one fetch asks
    for: at most max_keys (READ_BATCH_KEYS) and max_bytes (READ_BATCH_BYTES), at least one."""
    max_keys = READ_BATCH_KEYS if max_keys is None else max_keys
    max_bytes = READ_BATCH_BYTES if max_bytes is None else max_bytes
    n, total = 0, 0
    for i in todo[:max_keys]:
        total += sizes[i] + TRAILER
        if n and total > max_bytes:
            break
        n += 1
    return n


SPARE_BYTES = PUT_BATCH_BYTES    # pack buffers a process keeps for its next store, at most


class _Spare:
    """Pack buffers kept from one store to the next (thread-safe: a host stores from several
    threads), at most `limit` bytes of them, or one batch's where that is more (a full batch
    passes PUT_BATCH_BYTES by up to its last object and trailers: 32 x 8 MiB objects are 256
    bytes over, and the limit alone dropped one buffer a batch, which the next store wrote
    as new memory), never more than twice `limit`; a buffer is reused for an object that
    fills at least half of it."""

    def __init__(self, limit: int = SPARE_BYTES):
        self.limit, self.bytes = limit, 0
        self._free = collections.defaultdict(list)     # capacity -> buffers
        self._lock = threading.Lock()

    def take(self, n: int) -> np.ndarray:
        with self._lock:
            for cap in sorted(c for c in self._free if n <= c <= 2 * n):
                if self._free[cap]:
                    self.bytes -= cap
                    return self._free[cap].pop()
        return np.empty(n, np.uint8)

    def give(self, bufs) -> None:
        bound = max(self.limit, min(sum(b.nbytes for b in bufs), 2 * self.limit))
        with self._lock:
            for b in bufs:
                if self.bytes + b.nbytes <= bound:
                    self._free[b.nbytes].append(b)
                    self.bytes += b.nbytes


class Objects:
    """Store, look up and load opaque objects through one network view (kdn.client.view).

    layer names the host ("lmcache", "sglang"). Least privilege: admin_token is what writes
    carry (stores and deletes: the origin takes them only with it) and nothing else;
    read_tokens (tenant -> that tenant's read token) is what lookups and loads carry, a
    tenant without one reading with no token (an open network or tenant). A refused read
    or write raises AccessDenied naming the setting to fix. Counters in `counters`.
    """

    def __init__(self, view, layer: str, admin_token: str = None, read_tokens: dict = None,
                 prefault: bool = False, ack: str = ACK_EDGE):
        from kdn.client.reader import Reader
        if ack not in ACKS:
            raise BadConfig(f"ack must be one of {', '.join(ACKS)}, got {ack!r:.40}")
        self.view, self.layer, self.token, self.ack = view, layer, admin_token, ack
        self._acked_at = set()         # edges that acknowledged stores of ours before the origin had them
        self.read_tokens = dict(read_tokens or {})
        # the object store's pages mapped ahead of the loads (kdn.core.prefault)
        self.prefaulter = None
        if prefault:
            from kdn.core.prefault import Prefaulter
            self.prefaulter = Prefaulter().start()
        self._spare = _Spare()           # pack buffers reused by stores
        self._names = {}               # ns -> (tenant, fingerprint) it digests
        self._readers = {}             # ns -> Reader
        self._reader_cls = Reader
        self.counters = collections.Counter()

    @classmethod
    def connect(cls, network: str, region: str, layer: str, admin_token: str = None,
                address: str = None, read_tokens: dict = None, prefault: bool = True,
                ack: str = None, data_plane: str = "auto") -> "Objects":
        """Join Ray (at address, else where `kdn up` recorded, else 'auto') and view network;
        prefault: keep this process's page tables over the object store filled (a host
        layer's process, whose loads are on the engine's time); data_plane: how loads from an
        edge on another node travel (kdn.client.dataplane: its HTTP frames by default)."""
        import ray
        from kdn.client.join import init_ray, read_state, state_path
        from kdn.client.view import NetworkView
        if not ray.is_initialized():
            if address is None and state_path().exists():
                address = read_state(require_alive=True)["address"]
            init_ray(address or "auto")
        return cls(NetworkView(network, region=region, admin_token=admin_token, data_plane=data_plane),
                   layer, admin_token, read_tokens, prefault, ack or ACK_EDGE)

    def stats(self) -> dict:
        out = {"layer": self.layer, "region": self.view.region, "counters": dict(self.counters),
               "data_plane": self.view.plane.stats(), "origin_writes": self.view.writes(self.token).stats()}
        if self.prefaulter is not None:
            out["prefault"] = self.prefaulter.stats()
        return out

    def close(self) -> None:
        """Stop the prefault thread (the network view stays usable)."""
        if self.prefaulter is not None:
            self.prefaulter.stop()

    def namespace(self, tenant: str, model: str) -> bytes:
        """The namespace of this layer's objects of model for tenant (see object_namespace)."""
        ns = object_namespace(tenant, self.layer, model)
        self._names.setdefault(ns, (tenant, f"{self.layer}/{model}"))
        return ns

    # --- store ---------------------------------------------------------------------------
    def store(self, ns_keys: list, datas: list) -> int:
        """Publish objects (ns_keys: [(ns, key)], datas: their buffers); the bytes sent.
        Raises NetworkError (Unreachable) when the origin does not take them.

        Each batch is packed into buffers this Objects reuses (`_Spare`): a call's arguments are
        copied into Ray's object store when it is sent, so they are free again once it
        answers, and memory used before costs no page fault per 4 KiB (new memory did: 0.15-1.4 s
        of a 256 MiB store on a 2-core VM, against 0.03 s reused)."""
        sent, batch, bufs, size = 0, [], [], 0
        try:
            for (ns, key), data in zip(ns_keys, datas, strict=True):
                bufs.append(self._spare.take(as_bytes(data).nbytes + TRAILER))
                batch.append(pack(key, ns, data, into=bufs[-1]))
                size += batch[-1].nbytes
                if size >= PUT_BATCH_BYTES or len(batch) >= BATCH_OBJECTS:
                    sent += self._put(batch)
                    batch, size = [], 0
                    self._spare.give(bufs)
                    bufs = []
            if batch:
                sent += self._put(batch)
        finally:
            self._spare.give(bufs)
        return sent

    def _put(self, chunks) -> int:
        try:
            if self.ack == ACK_EDGE:
                got = self._put_at_edge(chunks)
            else:
                got = self.view.writes(self.token).put("objects", chunks, STORE_TIMEOUT_S)
        except AccessDenied as e:
            self.counters["store_refused"] += 1
            raise AccessDenied(f"KDN {self.layer}: a store was refused ({e}): stores need the "
                               f"network's admin token (the `token` setting)") from None
        self.counters["stored"] += got["received"]
        self.counters["written"] += got["written"]
        n = sum(c.nbytes - TRAILER for c in chunks)
        self.counters["stored_bytes"] += n
        return n

    def _put_at_edge(self, chunks) -> dict:
        """Store at the nearest live edge (acknowledged in its memory, durable at the origin
        after: kdn/edge/stores.py); at the origin when no edge answers."""
        try:
            got, edge, _ = self.view.nearest(STORE_TIMEOUT_S).put_objects(chunks, token=self.token)
        except NoLiveEdge:
            self.counters["stored_at_origin_no_edge"] += 1
            return self.view.writes(self.token).put("objects", chunks, STORE_TIMEOUT_S)
        self.counters["acked_at_edge"] += got["pending"]
        if got["pending"]:
            self._acked_at.add(edge)
        self.counters["acked_at_origin"] += got["received"] - got["pending"]
        return {"received": got["received"], "written": got["received"]}

    # --- lookup --------------------------------------------------------------------------
    def lookup(self, ns: bytes, keys: list) -> list:
        """Per key, whether the network holds it: the nearest live edge answers for itself and
        the origin (one call, with the tenant's read token). Raises NoLiveEdge when no edge
        answers, AccessDenied when the read is refused."""
        held = [False] * len(keys)
        tenant, fingerprint = self._names[ns]            # namespace() named it
        for s in range(0, len(keys), READ_BATCH_KEYS):
            part = keys[s:s + READ_BATCH_KEYS]
            with self._reads_of(tenant):
                here, _, _ = self.view.nearest(fetch_deadline_s(len(part))).holds(
                    part, ns, token=self.read_tokens.get(tenant), tenant=tenant, fingerprint=fingerprint)
            held[s:s + len(part)] = here
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hits"] += sum(held)
        return held

    @contextlib.contextmanager
    def _reads_of(self, tenant: str):
        """An edge's refusal of tenant's reads as AccessDenied naming the setting to fix."""
        try:
            yield
        except AccessDenied as e:
            self.counters["read_refused"] += 1
            has = "a wrong" if tenant in self.read_tokens else "no"
            raise AccessDenied(f"KDN {self.layer}: the network refused reads of tenant {tenant!r} "
                               f"({has} read token given; set that tenant's read token in the "
                               f"`read_token`/`read_tokens` settings): {e}") from None

    # --- delete --------------------------------------------------------------------------
    def delete(self, ns: bytes, keys: list) -> int:
        """Delete objects of ns from the origin and every edge (the host's eviction); how
        many the origin held. Raises AccessDenied without the admin token, Unreachable.

        The edges that acknowledged stores of ours withdraw these keys first (EdgeNode.withdraw_stores):
        a store of one still in an edge's backlog is unknown to the origin, which would delete
        the rest and let that one reach it after (seen in the suite: a deleted key found
        again), so what waits is not sent and what is on its way is waited for until it has
        landed. The rest of their backlogs goes on: an eviction waits for at most a batch on
        its way, not for every store acknowledged before it (docs/figures.md). An edge that
        does not answer is passed over (restarted, it holds none)."""
        n = 0
        for s in range(0, len(keys), BATCH_OBJECTS):
            for edge in sorted(self._acked_at):
                try:       # the edge's own wait ends first, so its answer says what it did
                    got = self.view.at(edge, STORE_TIMEOUT_S).withdraw_stores(
                        keys[s:s + BATCH_OBJECTS], WITHDRAW_WAIT_S, token=self.token)
                except Unreachable:                      # restarted, it holds none of ours
                    self.counters["delete_edge_unreachable"] += 1
                    self._acked_at.discard(edge)
                    continue
                except AccessDenied as e:
                    self.counters["delete_refused"] += 1
                    raise AccessDenied(f"KDN {self.layer}: an edge refused a delete ({e}): deletes "
                                       f"need the network's admin token (the `token` setting)") from None
                self.counters["delete_withdrawn"] += got["withdrawn"]
                if not got["settled"]:        # still on its way: the edge deletes it again once landed
                    self.counters["delete_unsettled"] += 1
                elif not got["backlog_objects"]:     # nothing of ours waits there any more
                    self._acked_at.discard(edge)
            try:
                got = self.view.origin(STORE_TIMEOUT_S).delete_objects(keys[s:s + BATCH_OBJECTS], ns, token=self.token)
            except AccessDenied as e:
                self.counters["delete_refused"] += 1
                raise AccessDenied(f"KDN {self.layer}: the origin refused a delete ({e}): deletes "
                                   f"need the network's admin token (the `token` setting)") from None
            n += got["deleted"]
        self.counters["deleted"] += n
        return n

    # --- load ----------------------------------------------------------------------------
    def _reader(self, ns: bytes):
        r = self._readers.get(ns)
        if r is None:
            tenant, fingerprint = self._names[ns]       # namespace() named it
            r = self._readers[ns] = self._reader_cls(self.view, tenant, fingerprint,
                                                     token=self.read_tokens.get(tenant))
        return r

    def load(self, ns: bytes, keys: list, outs: list) -> list:
        """Fill outs[i] (writable buffers) with the objects of keys; per key whether it was
        loaded intact. A key nobody holds, an object that fails its checksum or a network
        failure leaves it False: never a wrong byte reported loaded.

        In batches (read_batch: READ_BATCH_KEYS keys, READ_BATCH_BYTES), one fetch each
        under the deadline of its keys and bytes. A batch no edge answers in time ends the
        load: what earlier batches loaded stands (a partial answer), the rest is counted
        load_no_edge and recomputed by the host. Fewer, larger fetches: smaller groups, one
        group's fetch overlapping another's unpacking, measured slower (56 and 70 ms for
        32 x 8 MiB in 64 and 32 MiB groups, against 46 ms in one: each call and its Ray
        transfer cost more than the overlap wins on two cores)."""
        ok = [False] * len(keys)
        sizes = [as_bytes(o).nbytes for o in outs]
        todo = list(range(len(keys)))
        reader = self._reader(ns)
        while todo:
            part = todo[:read_batch(sizes, todo)]
            nbytes = sum(sizes[i] + TRAILER for i in part)
            try:
                with self._reads_of(reader.tenant):
                    got = reader.fetch_objects([keys[i] for i in part],
                                               timeout_s=fetch_deadline_s(len(part), nbytes))
            except NoLiveEdge:        # every edge failed or timed out on this batch
                self.counters["load_no_edge"] += len(todo)
                break
            n = len(got.chunks)
            for i, good in zip(part, self._unpack_all(got.chunks, [outs[i] for i in part[:n]])):
                ok[i] = good
            if n:
                self.counters["from_edge:" + got.edge] += n
            self.counters["load_failovers"] += len(got.failovers)
            # the prefix stopped at a key nobody holds (or a copy that stayed corrupt): skip it
            todo = todo[n + 1:] if n < len(part) else todo[len(part):]
        self.counters["loads"] += 1
        self.counters["load_keys"] += len(keys)
        self.counters["loaded"] += sum(ok)
        return ok

    def _unpack_all(self, chunks, outs) -> list:
        """Per chunk whether it unpacked intact into its out: two threads, each a share of
        the chunks (one task a chunk cost more than the copy for small objects)."""
        if len(chunks) < 2:
            return [self._unpacked(c, o) for c, o in zip(chunks, outs)]
        halves = _UNPACK.map(lambda s: [self._unpacked(c, o) for c, o in zip(chunks[s::2], outs[s::2])],
                             (0, 1))
        even, odd = halves
        out = [None] * len(chunks)
        out[0::2], out[1::2] = even, odd
        return out

    def _unpacked(self, chunk, out) -> bool:
        try:
            good = unpack_into(chunk, out)
        except FrameError:
            good = False
        if not good:
            self.counters["load_rejected"] += 1
        return good

