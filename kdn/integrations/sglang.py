"""KDN as an SGLang HiCache storage backend: SGLang's host KV pages stored in and read from KDN.

SGLang (0.5.23) loads it as a dynamic backend, no patch:

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name": "kdn", "module_path": "kdn.integrations.sglang",
        "class_name": "KDNHiCacheStorage", "interface_v1": 1,
        "network": "kdn", "region": "eu-west", "tenant": "acme", "token": "..."}'

and builds it as `KDNHiCacheStorage(storage_config, kwargs)`; the host pool arrives later
through `register_mem_pool_host`. A page's key is SGLang's chained SHA-256 hex string
(already seeded by its storage namespace and cache salt); each page entry (keys and values
for MHA, one latent for MLA, as `get_page_buffer_meta` lays them out) is one opaque object
(kdn.integrations.objects) under "<page key>_<rank suffix>_<entry>" in the namespace of
(tenant, model). Stores publish to the origin; `batch_exists` asks the nearest live edge and
returns the length of the consecutive hit prefix; loads fetch from the nearest live edge,
failing over, straight into the host pool's pages (one copy). A page that does not arrive
intact is reported missing and SGLang recomputes it: never a wrong byte.

Tokens: `token` (the admin token) goes only with stores; lookups and loads carry
`read_token` (the tenant's). A refusal is logged once as an error naming the setting,
counted (`refused`), and the pages reported not stored / missing. HiCache has no per-key
delete: pages stay until an operator's `collect(object_ttl_s=...)` (kdn.integrations.objects).

Calls block, as SGLang's own backends' do: SGLang makes them from its cache controller's
I/O threads, never its scheduler's.

Keys are checked before anything moves: every call refuses a key that is not a non-empty
str (and a batch whose keys are not a list, or whose values do not match its keys) with
BadKey, a TypeError, as SGLang's own backends raise for a caller's mistake; a page that is
merely missing or not stored is answered False / None, as they answer it.
"""
import ctypes
import logging

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kdn.core.dataplane import MODES
from kdn.integrations.objects import ACKS, REQUIRED, Objects, as_bytes, check_params, object_key, read_tokens_of
from kdn.core.errors import AccessDenied, BadConfig, BadKey, NetworkError

log = logging.getLogger(__name__)

LAYER = "sglang"
PARAMS = {                       # the extra config: SGLang's fields, then KDN's
    "backend_name": (str, "kdn"), "module_path": (str, REQUIRED), "class_name": (str, REQUIRED),
    "interface_v1": (int, 1),                      # SGLang's switch to batch_{get,set}_v1
    "network": (str, "kdn"),                       # the KDN network's name
    "region": ((str, type(None)), None),           # where this server is (default: its node's label)
    "tenant": (str, "default"),                    # whose namespace the pages live in
    "model": ((str, type(None)), None),            # default: storage_config.model_name
    "token": ((str, type(None)), None),            # the network's admin token: stores only
    "read_token": ((str, type(None)), None),       # the tenant's read token: lookups and loads
    "address": ((str, type(None)), None),          # Ray's address (default: `kdn up`'s, else auto)
    "prefault": (bool, True),                      # map the object store's pages ahead of loads
    "ack": (str, "edge"),                          # a store answered by the edge, or once durable ("origin")
    "data_plane": (str, "auto"),                   # loads from another node's edge: its HTTP frames, or "ray"
}


def _check_keys(keys, call: str) -> list:
    """keys, if a list (or tuple) of non-empty str (SGLang's page hashes), else BadKey
    naming the call and the first key that is not."""
    if not isinstance(keys, (list, tuple)):
        raise BadKey(f"KDN HiCache {call}: keys must be a list of str, got {type(keys).__name__}")
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise BadKey(f"KDN HiCache {call}: keys[{i}] must be a non-empty str (a page hash), "
                         f"got {k!r:.60}")
    return keys


def _check_key(key, call: str) -> str:
    if not isinstance(key, str) or not key:
        raise BadKey(f"KDN HiCache {call}: the key must be a non-empty str (a page hash), got {key!r:.60}")
    return key


def _per_key(values, n: int, what: str, call: str) -> list:
    """values (one per key), or n Nones when not given (None or empty); BadKey if their
    number is not n."""
    if values is None or len(values) == 0:
        return [None] * n
    if len(values) != n:
        raise BadKey(f"KDN HiCache {call}: {n} keys but {len(values)} {what}")
    return list(values)


def _buffer(ptr: int, size: int):
    """A writable byte view of host memory at ptr (the host pool's pinned CPU pages)."""
    return memoryview((ctypes.c_ubyte * size).from_address(ptr)).cast("B")


class KDNHiCacheStorage(HiCacheStorage):
    """SGLang's HiCacheStorage over a KDN network (see the module docstring)."""

    def __init__(self, storage_config, kwargs=None, objects: Objects = None):
        extra = getattr(storage_config, "extra_config", None)
        cfg = check_params(extra if extra is not None else {}, PARAMS, "KDN HiCache extra config")
        if cfg["ack"] not in ACKS:
            raise BadConfig(f"KDN HiCache extra config: field 'ack' must be one of {', '.join(ACKS)}, "
                            f"got {cfg['ack']!r:.40}")
        if cfg["data_plane"] not in MODES:
            raise BadConfig(f"KDN HiCache extra config: field 'data_plane' must be one of "
                            f"{', '.join(MODES)}, got {cfg['data_plane']!r:.40}")
        model = cfg["model"] or getattr(storage_config, "model_name", None)
        if not model:
            raise BadConfig("KDN HiCache extra config: field 'model' is required when SGLang "
                            "gives no model name (pages of two models must never meet)")
        self.config, self.storage_config = cfg, storage_config
        self.is_mla = bool(storage_config.is_mla_model)
        # one suffix per rank whose slice of the KV a page entry holds (as SGLang's mooncake
        # backend keys them): MLA ranks share one latent, MHA ranks each hold their heads
        self.suffix = (f"mla{storage_config.pp_rank}" if self.is_mla else
                       f"{storage_config.tp_rank}of{storage_config.tp_size}p{storage_config.pp_rank}")
        self.entries = 1 if self.is_mla else 2     # entries per page until the pool says otherwise
        read_tokens = read_tokens_of(cfg["tenant"], cfg["read_token"], None, "KDN HiCache extra config")
        self.objects = objects or Objects.connect(cfg["network"], cfg["region"], LAYER,
                                                  admin_token=cfg["token"], address=cfg["address"],
                                                  read_tokens=read_tokens, prefault=cfg["prefault"],
                                                  ack=cfg["ack"], data_plane=cfg["data_plane"])
        self._refusals = set()                     # refusal messages logged (each once)
        self.ns = self.objects.namespace(cfg["tenant"], model)
        self.mem_pool_host = None

    # --- keys ------------------------------------------------------------------------------
    def _keys(self, page_keys, entries: int) -> list:
        """KDN keys of every entry of every page, page after page."""
        return [object_key(self.ns, f"{k}_{self.suffix}_{e}".encode())
                for k in page_keys for e in range(entries)]

    def _whole(self, page_keys) -> list:
        """KDN keys of values stored whole (the tensor / pointer API: one object a key)."""
        return [object_key(self.ns, f"{k}_{self.suffix}".encode()) for k in page_keys]

    def _grouped(self, oks, entries: int) -> list:
        return [all(oks[i:i + entries]) for i in range(0, len(oks), entries)]

    # --- the page API (zero-copy from and into the host pool) ---------------------------------
    def _meta(self, keys, host_indices) -> tuple:
        if self.mem_pool_host is None:
            raise BadConfig("KDN HiCache: no host pool registered (register_mem_pool_host)")
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys):
            raise BadConfig(f"KDN HiCache: {len(ptrs)} page buffers for {len(keys)} keys")
        self.entries = len(ptrs) // len(keys)
        return [_buffer(int(p), int(s)) for p, s in zip(ptrs, sizes)], self.entries

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list:
        _check_keys(keys, "batch_set_v1")
        if self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", 0) is None:
            return [True] * len(keys)          # a logical-only pool: nothing to move (as mooncake)
        bufs, n = self._meta(keys, host_indices)
        return self._set(self._keys(keys, n), bufs, len(keys))

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list:
        _check_keys(keys, "batch_get_v1")
        if self.mem_pool_host is not None and getattr(self.mem_pool_host, "kv_buffer", 0) is None:
            return [True] * len(keys)
        bufs, n = self._meta(keys, host_indices)
        return self._grouped(self._load(self._keys(keys, n), bufs), n)

    def _set(self, kdn_keys, bufs, pages: int) -> list:
        try:
            self.objects.store([(self.ns, k) for k in kdn_keys], bufs)
            return [True] * pages
        except NetworkError as e:              # the origin did not take them: SGLang may retry
            log.warning("KDN HiCache store of %d pages failed: %s", pages, e)
            return [False] * pages
        except AccessDenied as e:              # no (or a wrong) admin token: a setting to fix
            self._refused(e)
            return [False] * pages

    def _load(self, kdn_keys, bufs) -> list:
        try:
            return self.objects.load(self.ns, kdn_keys, bufs)
        except NetworkError as e:              # nobody answered: the pages are computed
            log.warning("KDN HiCache load of %d objects failed: %s", len(kdn_keys), e)
            return [False] * len(kdn_keys)
        except AccessDenied as e:              # a missing or wrong read token
            self._refused(e)
            return [False] * len(kdn_keys)

    def _refused(self, e: AccessDenied) -> None:
        """Count a refusal; log it as an error the first time its message is seen."""
        self.objects.counters["refused"] += 1
        if str(e) not in self._refusals:
            self._refusals.add(str(e))
            log.error("%s", e)

    # --- the tensor / pointer API -------------------------------------------------------------
    @staticmethod
    def _one(value, target_location, target_sizes):
        """(buffer, how to answer) of one value: a CPU tensor, or a pointer and a size."""
        if isinstance(value, torch.Tensor):
            return as_bytes(value.contiguous().view(torch.uint8).numpy()), value
        if isinstance(target_location, torch.Tensor):
            t = target_location
            return as_bytes(t.view(torch.uint8).numpy()), t
        if isinstance(target_location, int) and isinstance(target_sizes, int):
            return _buffer(target_location, target_sizes), True
        raise BadConfig("KDN HiCache: a value is a CPU tensor, or target_location (a pointer) "
                        "with target_sizes (its byte size)")

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        _check_key(key, "set")
        return self.batch_set([key], [value], [target_location], [target_sizes])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        n = len(_check_keys(keys, "batch_set"))
        given = zip(_per_key(values, n, "values", "batch_set"),
                    _per_key(target_locations, n, "target_locations", "batch_set"),
                    _per_key(target_sizes, n, "target_sizes", "batch_set"))
        bufs = [self._one(v, t, s)[0] for v, t, s in given]
        return all(self._set(self._whole(keys), bufs, n))

    def get(self, key, target_location=None, target_sizes=None):
        _check_key(key, "get")
        return self.batch_get([key], [target_location], [target_sizes])[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None) -> list:
        n = len(_check_keys(keys, "batch_get"))
        given = zip(_per_key(target_locations, n, "target_locations", "batch_get"),
                    _per_key(target_sizes, n, "target_sizes", "batch_get"))
        outs = [self._one(None, t, s) for t, s in given]
        oks = self._load(self._whole(keys), [b for b, _ in outs])
        return [answer if ok else (False if answer is True else None)
                for ok, (_, answer) in zip(oks, outs)]

    # --- exists -------------------------------------------------------------------------------
    def exists(self, key) -> bool:
        """Whether the network holds key's value, stored whole or as a page of entries."""
        _check_key(key, "exists")
        try:
            whole = self.objects.lookup(self.ns, self._whole([key]))[0]
        except NetworkError as e:
            log.warning("KDN HiCache lookup of %s failed: %s", key, e)
            return False
        except AccessDenied as e:
            self._refused(e)
            return False
        return whole or self.batch_exists([key]) == 1

    def batch_exists(self, keys, extra_info=None) -> int:
        """How many leading pages of keys the network holds (every entry of each)."""
        if not _check_keys(keys, "batch_exists"):
            return 0
        n = self.entries
        try:
            held = self.objects.lookup(self.ns, self._keys(keys, n))
        except NetworkError as e:
            log.warning("KDN HiCache lookup of %d pages failed: %s", len(keys), e)
            return 0
        except AccessDenied as e:
            self._refused(e)
            return 0
        pages = self._grouped(held, n)
        return next((i for i, h in enumerate(pages) if not h), len(keys))

    def get_stats(self):
        return self.objects.stats()

    def close(self) -> None:
        self.objects.close()
