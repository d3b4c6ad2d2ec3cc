"""KDN as an LMCache L2 adapter: LMCache's multiprocess server stores to and loads from KDN.

LMCache (0.5.6) loads it with its own `plugin` adapter type, no patch:

    --l2-adapter '{"type": "plugin", "module_path": "kdn.integrations.lmcache",
                   "class_name": "KDNL2Adapter",
                   "adapter_params": {"network": "kdn", "region": "eu-west", "token": "..."}}'

and finds `KDNL2AdapterConfig` beside the class by its name. A store publishes the memory
objects' bytes (opaque chunks, kdn.integrations.objects) to the origin, which keeps them durably
and pushes them to their ring owners; a lookup asks the nearest live edge (then the origin
for what it lacks); a load fetches from the nearest live edge, failing over, straight into
LMCache's memory objects (`obj.byte_array`: one copy, from Ray's object store). A key is
ObjectKey's chunk hash, rank and object group, in the namespace of (tenant, model); the
key's `cache_salt` picks the tenant (kdn.integrations.objects.Tenancy).

LMCache's contract, as its own fs and mock adapters keep it: three distinct eventfds, a
lock over task ids and completed results, one daemon thread with an asyncio loop (network
calls run in a small thread pool under it, never on LMCache's threads), each result handed
out once. A locked key stays loadable: the origin never evicts on its own, so whatever a lookup
found any edge can serve until unlock (or a delete). A load that fails reports those keys
not loaded and LMCache recomputes them: never a wrong byte (every object is checked end to
end). `delete` (LMCache's eviction: give `capacity_bytes` to turn its global eviction on)
deletes from the origin and every edge; objects otherwise stay until an operator's
`collect(object_ttl_s=...)` (kdn.integrations.objects: lifetime).

Tokens: `token` (the admin token) goes only with stores and deletes; lookups and loads carry
`read_token` (`tenant`'s) or `read_tokens` (per tenant). A refusal is logged once as an
error naming the setting, counted (store_refused, lookup_refused, load_refused), and those
keys are reported not stored / not found / not loaded.
"""
import asyncio
import collections
import concurrent.futures
import logging
import threading

import msgpack
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.platform import create_event_notifier

from kdn.core.dataplane import MODES
from kdn.integrations.objects import ACKS, Objects, Tenancy, check_params, object_key, read_tokens_of
from kdn.core.checks import check_int
from kdn.core.errors import AccessDenied, BadConfig, NetworkError

log = logging.getLogger(__name__)

LAYER = "lmcache"
NETWORK_THREADS = 4           # blocking network calls in flight at once (stores, lookups, loads)
DELETE_TIMEOUT_S = 30.0       # a delete waits this long for the origin (as LMCache's fs adapter)

PARAMS = {               # adapter_params: name -> (type, default)
    "network": (str, "kdn"),          # the KDN network's name
    "region": ((str, type(None)), None),   # where this server is (default: its Ray node's label)
    "tenant": (str, "default"),       # the tenant of keys without a cache_salt
    "tenants": (dict, None),          # cache_salt -> tenant; other salts: "<tenant>~<salt>"
    "token": ((str, type(None)), None),    # the network's admin token: stores and deletes only
    "read_token": ((str, type(None)), None),   # `tenant`'s read token: lookups and loads
    "read_tokens": ((dict, type(None)), None),  # tenant -> read token, for the tenants salts map to
    "capacity_bytes": (int, 0),            # > 0: LMCache's eviction deletes beyond it (0: none)
    "address": ((str, type(None)), None),  # Ray's address (default: `kdn up`'s, else auto)
    "prefault": (bool, True),              # map the object store's pages ahead of loads (kdn.core.prefault)
    "ack": (str, "edge"),                  # a store answered by the edge ("edge") or once durable ("origin")
    "data_plane": (str, "auto"),           # loads from another node's edge: its HTTP frames ("auto") or "ray"
}


class KDNL2AdapterConfig(L2AdapterConfigBase):
    """adapter_params, checked: a bad one is a BadConfig (a ValueError) naming the field."""

    def __init__(self, network="kdn", region=None, tenant="default", tenants=None, token=None,
                 read_token=None, read_tokens=None, capacity_bytes=0, address=None, prefault=True,
                 ack="edge", data_plane="auto"):
        if ack not in ACKS:
            raise BadConfig(f"adapter_params: field 'ack' must be one of {', '.join(ACKS)}, got {ack!r:.40}")
        if data_plane not in MODES:
            raise BadConfig(f"adapter_params: field 'data_plane' must be one of {', '.join(MODES)}, "
                            f"got {data_plane!r:.40}")
        self.network, self.region, self.tenant, self.ack = network, region, tenant, ack
        self.data_plane = data_plane
        self.prefault = prefault
        self.tenancy = Tenancy(tenant, tenants, "adapter_params")
        self.token, self.address = token, address
        self.read_tokens = read_tokens_of(tenant, read_token, read_tokens, "adapter_params")
        self.capacity_bytes = check_int(capacity_bytes, "adapter_params: field 'capacity_bytes'", 0,
                                        error=BadConfig)

    @classmethod
    def from_dict(cls, d: dict) -> "KDNL2AdapterConfig":
        return cls(**check_params(d, PARAMS, "KDN L2 adapter_params"))

    @classmethod
    def help(cls) -> str:
        return ("KDN L2 adapter_params:\n" + "\n".join(
            f"- {name} ({'/'.join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))}"
            f", default {default!r})" for name, (kind, default) in PARAMS.items()))


def host_key(key) -> bytes:
    """LMCache's ObjectKey without its salt (the salt picks the tenant) as canonical bytes."""
    return msgpack.packb([bytes(key.chunk_hash), int(key.kv_rank), int(key.object_group_id)])


class KDNL2Adapter(L2AdapterInterface):
    """LMCache's L2AdapterInterface over a KDN network (see the module docstring)."""

    def __init__(self, config, l1_memory_desc=None, objects: Objects = None):
        if isinstance(config, dict):
            config = KDNL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=config.capacity_bytes)   # 0: no global eviction
        self.config = config
        self.objects = objects or Objects.connect(config.network, config.region, LAYER,
                                                  admin_token=config.token, address=config.address,
                                                  read_tokens=config.read_tokens,
                                                  prefault=config.prefault, ack=config.ack,
                                                  data_plane=config.data_plane)
        self._refusals = set()                     # refusal messages logged (each once)
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._lock = threading.Lock()              # task ids, results, locks, known keys
        self._next_task_id = 0
        self._stores, self._lookups, self._loads = {}, {}, {}
        self._locked = collections.Counter()       # ObjectKey -> lookups holding it
        self._known = {}                           # ObjectKey -> size this adapter reported stored
        self.counters = collections.Counter()
        self._pool = concurrent.futures.ThreadPoolExecutor(NETWORK_THREADS, thread_name_prefix="kdn-l2")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="kdn-l2-loop", daemon=True)
        self._thread.start()

    # --- event fds ---------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # --- keys --------------------------------------------------------------------------
    def _ns_keys(self, keys) -> list:
        """[(ns, kdn key)] of ObjectKeys: the salt's tenant and the model pick the namespace."""
        out = []
        for k in keys:
            ns = self.objects.namespace(self.config.tenancy.of(k.cache_salt), k.model_name)
            out.append((ns, object_key(ns, host_key(k))))
        return out

    def _task(self) -> int:
        with self._lock:
            self._next_task_id += 1
            return self._next_task_id

    def _submit(self, coro) -> None:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        fut.add_done_callback(_log_failure)

    async def _io(self, fn, *args):
        return await self._loop.run_in_executor(self._pool, fn, *args)

    # --- store -------------------------------------------------------------------------
    def submit_store_task(self, keys, objects) -> int:
        task_id = self._task()
        self._submit(self._store(task_id, list(keys), list(objects)))
        return task_id

    def pop_completed_store_tasks(self) -> dict:
        with self._lock:
            done, self._stores = self._stores, {}
        return done

    async def _store(self, task_id, keys, objs) -> None:
        ok, sent = False, 0
        try:
            sent = await self._io(self.objects.store, self._ns_keys(keys), [o.byte_array for o in objs])
            ok = True
        except NetworkError as e:                 # the origin did not take them: LMCache may retry
            self.counters["store_failed"] += 1
            log.warning("KDN L2 store of %d objects failed: %s", len(keys), e)
        except AccessDenied as e:                 # no (or a wrong) admin token: a setting to fix
            self._refused("store_refused", e)
        finally:
            new = []
            if ok:
                with self._lock:
                    for k, o in zip(keys, objs):
                        if k not in self._known:
                            self._known[k] = o.get_size()
                            new.append(k)
            if new:
                self._notify_keys_stored(new, [self._known[k] for k in new])
            with self._lock:
                self._stores[task_id] = L2StoreResult(ok, sent)
            self._store_efd.notify()

    # --- lookup and lock ---------------------------------------------------------------
    def submit_lookup_and_lock_task(self, keys, group_layout_descs=None) -> int:
        task_id = self._task()
        self._submit(self._lookup(task_id, list(keys)))
        return task_id

    def query_lookup_and_lock_result(self, task_id):
        with self._lock:
            return self._lookups.pop(task_id, None)

    async def _lookup(self, task_id, keys) -> None:
        bitmap = Bitmap(len(keys))
        try:
            held = [False] * len(keys)
            by_ns = collections.defaultdict(list)       # one lookup per namespace
            for i, (ns, k) in enumerate(self._ns_keys(keys)):
                by_ns[ns].append((i, k))
            for ns, items in by_ns.items():
                got = await self._io(self.objects.lookup, ns, [k for _, k in items])
                for (i, _), h in zip(items, got):
                    held[i] = h
            with self._lock:
                for i, h in enumerate(held):
                    if h:
                        bitmap.set(i)
                        self._locked[keys[i]] += 1
        except NetworkError as e:                    # no edge answered: nothing is found
            self.counters["lookup_failed"] += 1
            log.warning("KDN L2 lookup of %d keys failed: %s", len(keys), e)
        except AccessDenied as e:                    # a missing or wrong read token
            self._refused("lookup_refused", e)
        finally:
            with self._lock:
                self._lookups[task_id] = bitmap
            self._lookup_efd.notify()

    def submit_unlock(self, keys) -> None:
        """Never fails: a lock is a count here (KDN never evicts what a lookup found)."""
        with self._lock:
            for k in keys:
                if self._locked[k] <= 1:
                    self._locked.pop(k, None)
                else:
                    self._locked[k] -= 1

    # --- load --------------------------------------------------------------------------
    def submit_load_task(self, keys, objects) -> int:
        task_id = self._task()
        self._submit(self._load(task_id, list(keys), list(objects)))
        return task_id

    def query_load_result(self, task_id):
        with self._lock:
            return self._loads.pop(task_id, None)

    async def _load(self, task_id, keys, objs) -> None:
        bitmap = Bitmap(len(keys))
        try:
            by_ns = collections.defaultdict(list)
            for i, (ns, k) in enumerate(self._ns_keys(keys)):
                by_ns[ns].append((i, k))
            for ns, items in by_ns.items():
                outs = [objs[i].byte_array for i, _ in items]
                try:
                    got = await self._io(self.objects.load, ns, [k for _, k in items], outs)
                except AccessDenied as e:           # a missing or wrong read token: not loaded
                    self._refused("load_refused", e)
                    continue
                for (i, _), ok in zip(items, got):
                    if ok:
                        bitmap.set(i)
        finally:
            loaded = [keys[i] for i in bitmap.get_indices_list()]
            if loaded:
                self._notify_keys_accessed(loaded)
            with self._lock:
                self._loads[task_id] = bitmap
            self._load_efd.notify()

    # --- eviction, status, close ---------------------------------------------------------
    def delete(self, keys) -> None:
        """Delete keys from the network (LMCache's eviction calls it): the origin and every
        edge drop them. Blocks, as LMCache's fs adapter does; a refused or failed delete
        leaves them stored (logged, counted) and LMCache's accounting unchanged."""
        keys = list(keys)
        if not keys:
            return
        by_ns = collections.defaultdict(list)
        for k, (ns, kdn_key) in zip(keys, self._ns_keys(keys)):
            by_ns[ns].append(kdn_key)
        try:
            for ns, ks in by_ns.items():
                self._pool.submit(self.objects.delete, ns, ks).result(timeout=DELETE_TIMEOUT_S)
        except (NetworkError, concurrent.futures.TimeoutError) as e:
            self.counters["delete_failed"] += 1
            log.warning("KDN L2 delete of %d keys failed: %s", len(keys), e)
            return
        except AccessDenied as e:
            self._refused("delete_refused", e)
            return
        with self._lock:
            gone = [(k, self._known.pop(k)) for k in keys if k in self._known]
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [n for _, n in gone])

    def _refused(self, counter: str, e: AccessDenied) -> None:
        """Count a refusal; log it as an error the first time its message is seen."""
        self.counters[counter] += 1
        if str(e) not in self._refusals:
            self._refusals.add(str(e))
            log.error("%s", e)

    def stats(self) -> dict:
        with self._lock:
            locked, known = len(self._locked), len(self._known)
        return {"counters": dict(self.counters), "objects": self.objects.stats(),
                "locked_keys": locked, "stored_keys": known}

    def report_status(self) -> dict:
        return {"is_healthy": self._thread.is_alive(), "type": "KDNL2Adapter",
                "network": self.config.network, "region": self.objects.view.region, **self.stats()}

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if not self._loop.is_running():
            self._loop.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()
        self.objects.close()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()


def _log_failure(fut) -> None:
    """A task that raised what no failover expects is a bug: its result is already posted
    (each task's `finally`), and the error is logged, not swallowed."""
    if not fut.cancelled() and fut.exception() is not None:
        log.error("KDN L2 task failed", exc_info=fut.exception())
