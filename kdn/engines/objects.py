"""Other cache layers' objects in KDN: opaque byte strings under keys in a tenant namespace.

LMCache (kdn.engines.lmcache) and SGLang's HiCache (kdn.engines.sglang) hand KDN objects it
does not interpret: an LMCache memory object's bytes, an SGLang page. Each is kept as one
opaque chunk (kdn.core.chunk: dtype "opaque", its frame says so) whose bytes are the object
followed by the xxh3_64 of the object (8 bytes, little-endian): no manifest names these
chunks, so the checksum travels with them and a loader checks every object end to end,
whatever path it took (Ray's object store, an edge's disk, a compressed link).

Keys: a host key (LMCache's ObjectKey fields, SGLang's per-page SHA-256 hex) becomes
xxh3_128(namespace ‖ host key bytes), the namespace being namespace_digest(tenant,
"<layer>/<model>"). A host's per-user salt picks the tenant (`Tenancy`): a salt never
reads around its tenant, and two salts never share a namespace.

Paths: a store publishes the objects to the origin (`put_objects`: durable, then pushed to
their ring owners); a lookup asks the nearest live edge what it holds, then the origin in
one call for the rest; a load fetches from the nearest live edge (kdn.client.reader: failover,
pull-through), which serves what it lacks from the ring owners and the origin. An object
that does not arrive intact is reported not loaded (the host recomputes it): never a wrong
byte. Every call here blocks; hosts run them off their engine's thread.
"""
import collections
import concurrent.futures
import struct

import numpy as np
import xxhash

from kdn.core.chunk import Chunk
from kdn.core.dtypes import OPAQUE
from kdn.core.errors import BadConfig, FrameError, NoLiveEdge
from kdn.core.keys import MAX_FETCH_KEYS, namespace_digest
from kdn.core.rpc import Unreachable

TRAILER = 8                      # xxh3_64 of the object, after its bytes
PUT_BATCH_BYTES = 256 << 20         # one put_objects call carries at most this much
BATCH_OBJECTS = 1024
STORE_TIMEOUT_S = 30.0           # a store batch (retried while the origin restarts)
LOAD_TIMEOUT_S = 4.0             # a load: base ...
LOAD_TIMEOUT_PER_MB_S = 0.02     # ... plus this per MB (slow WAN links)
HAS_TIMEOUT_S = 5.0
_BLOCK = 1 << 18                 # copy+hash block: fits L2, so the hash reads from cache
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


def pack(key: bytes, ns: bytes, data) -> Chunk:
    """An opaque chunk holding data's bytes and their checksum (one copy of the bytes)."""
    src = np.frombuffer(as_bytes(data), np.uint8)
    arr = np.empty(src.size + TRAILER, np.uint8)
    body, h = arr[:src.size], xxhash.xxh3_64()
    for s in range(0, src.size, _BLOCK):
        np.copyto(body[s:s + _BLOCK], src[s:s + _BLOCK])
        h.update(body[s:s + _BLOCK])
    arr[src.size:] = np.frombuffer(_TRAILER.pack(h.intdigest()), np.uint8)
    return Chunk(key, ns, arr, OPAQUE)


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


class Objects:
    """Store, look up and load opaque objects through one network view (kdn.client.view).

    layer names the host ("lmcache", "sglang"); admin_token is what stores need (the
    origin takes writes only with it) and what reads carry. Counters in `counters`.
    """

    def __init__(self, view, layer: str, admin_token: str = None):
        from kdn.client.reader import Reader
        self.view, self.layer, self.token = view, layer, admin_token
        self._names = {}               # ns -> (tenant, fingerprint) it digests
        self._readers = {}             # ns -> Reader
        self._reader_cls = Reader
        self.counters = collections.Counter()

    @classmethod
    def connect(cls, network: str, region: str, layer: str, admin_token: str = None,
                address: str = None) -> "Objects":
        """Join Ray (at address, else where `kdn up` recorded, else 'auto') and view network."""
        import ray
        from kdn.client.join import init_ray, read_state, state_path
        from kdn.client.view import NetworkView
        if not ray.is_initialized():
            if address is None and state_path().exists():
                address = read_state(require_alive=True)["address"]
            init_ray(address or "auto")
        return cls(NetworkView(network, region=region, admin_token=admin_token), layer, admin_token)

    def stats(self) -> dict:
        return {"layer": self.layer, "region": self.view.region, "counters": dict(self.counters)}

    def namespace(self, tenant: str, model: str) -> bytes:
        """The namespace of this layer's objects of model for tenant (see object_namespace)."""
        ns = object_namespace(tenant, self.layer, model)
        self._names.setdefault(ns, (tenant, f"{self.layer}/{model}"))
        return ns

    # --- store ---------------------------------------------------------------------------
    def store(self, ns_keys: list, datas: list) -> int:
        """Publish objects (ns_keys: [(ns, key)], datas: their buffers); the bytes sent.
        Raises NetworkError (Unreachable) when the origin does not take them."""
        sent, batch, size = 0, [], 0
        for (ns, key), data in zip(ns_keys, datas, strict=True):
            batch.append(pack(key, ns, data))
            size += batch[-1].nbytes
            if size >= PUT_BATCH_BYTES or len(batch) >= BATCH_OBJECTS:
                sent += self._put(batch)
                batch, size = [], 0
        if batch:
            sent += self._put(batch)
        return sent

    def _put(self, chunks) -> int:
        got = self.view.origin("put_objects", chunks, timeout=STORE_TIMEOUT_S)
        self.counters["stored"] += got["received"]
        self.counters["written"] += got["written"]
        n = sum(c.nbytes - TRAILER for c in chunks)
        self.counters["stored_bytes"] += n
        return n

    # --- lookup --------------------------------------------------------------------------
    def lookup(self, ns: bytes, keys: list) -> list:
        """Per key, whether the network holds it: the nearest live edge's answer, then the
        origin's for the rest (one call each). Raises NoLiveEdge when no edge answers."""
        held = [False] * len(keys)
        for s in range(0, len(keys), MAX_FETCH_KEYS):
            part = keys[s:s + MAX_FETCH_KEYS]
            here, _, _ = self.view.edge("have", part, ns, token=self.token, timeout=HAS_TIMEOUT_S)
            rest = [i for i, h in enumerate(here) if not h]
            if rest:
                try:
                    there = self.view.origin("has", [part[i] for i in rest], ns, timeout=HAS_TIMEOUT_S)
                except Unreachable:                  # origin down: what the edge holds is the answer
                    self.counters["lookup_origin_unreachable"] += 1
                    there = [False] * len(rest)
                for i, h in zip(rest, there):
                    here[i] = h
            held[s:s + len(part)] = here
        self.counters["lookups"] += 1
        self.counters["lookup_keys"] += len(keys)
        self.counters["lookup_hits"] += sum(held)
        return held

    # --- load ----------------------------------------------------------------------------
    def _reader(self, ns: bytes):
        r = self._readers.get(ns)
        if r is None:
            tenant, fingerprint = self._names[ns]       # namespace() named it
            r = self._readers[ns] = self._reader_cls(self.view, tenant, fingerprint, token=self.token)
        return r

    def load(self, ns: bytes, keys: list, outs: list) -> list:
        """Fill outs[i] (writable buffers) with the objects of keys; per key whether it was
        loaded intact. A key nobody holds, an object that fails its checksum or a network
        failure leaves it False: never a wrong byte reported loaded."""
        ok = [False] * len(keys)
        todo = list(range(len(keys)))
        reader = self._reader(ns)
        while todo:
            part = todo[:MAX_FETCH_KEYS]
            mb = sum(as_bytes(outs[i]).nbytes for i in part) / 1e6
            try:
                got = reader.fetch_objects([keys[i] for i in part],
                                           timeout_s=LOAD_TIMEOUT_S + LOAD_TIMEOUT_PER_MB_S * mb)
            except NoLiveEdge:
                self.counters["load_no_edge"] += len(part)
                break
            for i, good in zip(part, _UNPACK.map(self._unpacked, got.chunks,
                                                 [outs[i] for i in part[:len(got.chunks)]])):
                ok[i] = good
            if got.chunks:
                self.counters["from_edge:" + got.edge] += len(got.chunks)
            self.counters["load_failovers"] += len(got.failovers)
            # the prefix stopped at a key nobody holds (or a copy that stayed corrupt): skip it
            todo = todo[len(got.chunks) + 1:] if len(got.chunks) < len(part) else todo[len(part):]
        self.counters["loads"] += 1
        self.counters["load_keys"] += len(keys)
        self.counters["loaded"] += sum(ok)
        return ok

    def _unpacked(self, chunk, out) -> bool:
        try:
            good = unpack_into(chunk, out)
        except FrameError:
            good = False
        if not good:
            self.counters["load_rejected"] += 1
        return good

