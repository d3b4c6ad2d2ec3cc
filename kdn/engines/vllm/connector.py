"""KDN for vLLM: a v1 KV connector, so an unmodified vLLM reads knowledge KV from its nearest edge.

Switched on by configuration, as LMCache or Mooncake are:

    LLM(model=FOLDER, kv_transfer_config={
        "kv_connector": "KDNConnector", "kv_connector_module_path": "kdn.engines.vllm",
        "kv_role": "kv_consumer",                    # "kv_both": also publish (kdn_publish)
        "kv_load_failure_policy": "recompute",       # a failed load recomputes, never fails
        "kv_connector_extra_config": {"network": "kdn", "region": "eu-west", ...}})

(kdn.engines.vllm.run.kv_transfer_config builds that dict; `Settings` lists every key.)

vLLM runs the connector twice: in its scheduler, where the planner (kdn.engines.vllm.plan)
answers how many prompt tokens the network holds, and in each worker, where the loader
(kdn.engines.vllm.load) fetches those chunks and copies them into the paged cache layer by
layer. This class only maps vLLM's calls to those two. What KDN did for a request comes
back in its output's kv_transfer_params["kdn"] (held, local, external and loaded tokens, the
KB, the conversation's history, failures, a publish receipt).

With `conversations` on (transport "ray"), every finished answer's KV is kept as conversation
KV (kdn.core.conversation) and a later prompt that starts with the same turns reads it back,
in any engine of the network: the planner looks the conversation up after the KB's chunks;
request_finished asks vLLM to keep the answer's blocks until the worker's keeper
(kdn.engines.vllm.keep) has copied their new whole chunks out, and the keeper sends them to
the conversation's home edge, never on the engine's steps. `settle()` (kdn.engines.vllm.run)
lets an engine stepped by its caller finish that at once; `keep_limits` and `kept` are the
worker-side calls it makes through vLLM's collective_rpc.

KV is read under this engine's own fingerprint (kdn.engines.fingerprint) unless the config
names another: vLLM's numerics are not transformers', and KV is never served across them
by accident. Conversations are read and kept only under this engine's own fingerprint: a
tenant mapped to another engine's KV keeps nothing.
"""
import collections
import logging
from dataclasses import dataclass, fields

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kdn.core.errors import BadRequest
from kdn.engines.fingerprint import fingerprints
from kdn.engines.sources import (FETCH_DEADLINE_S, LOOKUP_DEADLINE_S, Deadline, HTTPSource,
                                 RaySource, Tenants)
from kdn.engines.vllm.keep import Keeper
from kdn.engines.vllm.load import COPY_THREADS, Loader
from kdn.engines.vllm.plan import MIN_TOKENS, Planner, Reports

log = logging.getLogger("kdn.engines.vllm")


@dataclass
class Settings:
    """kv_connector_extra_config: how the connector reaches KDN and whom it reads as."""
    network: str = "kdn"             # the KDN network's name
    transport: str = "ray"           # "ray" (kdn.client) or "http" (edges' HTTP servers)
    address: str = None              # Ray address to join if this process is not in Ray ("auto")
    edges: tuple = ()                # http: edge URLs, nearest first
    allow_remote: bool = False       # http: edges off loopback
    region: str = None               # the reader's region (default its Ray node's label)
    tenant: str = "default"          # requests without a cache salt read as this tenant ...
    token: str = None                # ... with this read token
    tenants: dict = None             # cache salt -> tenant name, or {"tenant", "token", "fingerprint"}
    fingerprint: str = "vllm"        # whose KV: "vllm" (this engine's), "transformers", or a hex one
    admin_token: str = None          # kv_both: the network's admin token (if it has one), to publish
    lookup_deadline_s: float = LOOKUP_DEADLINE_S   # a scheduler lookup, past it: compute
    fetch_deadline_s: float = FETCH_DEADLINE_S     # a worker fetch, past it: recompute
    min_tokens: int = MIN_TOKENS     # smaller hits are computed (a fetch costs a round trip)
    # the forward starts when layer 0 is in rather than all layers: it pays where cores are
    # spare; on 2 cores the copy and the forward slow each other (KDN 1.45x of vLLM's own
    # prefix hit at 4k tokens with it, 1.35x without, kdn bench vllm)
    layerwise: bool = False
    copy_threads: int = COPY_THREADS  # threads copying chunks into the paged cache
    conversations: bool = False      # keep every answer's KV as conversation KV, and read it back

    @classmethod
    def from_extra(cls, extra: dict) -> "Settings":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra or {}) - known)
        if unknown:
            raise BadRequest(f"unknown KDN connector setting(s) {unknown}; known: {sorted(known)}")
        s = cls(**(extra or {}))
        if s.transport not in ("ray", "http"):
            raise BadRequest(f"transport must be 'ray' or 'http', got {s.transport!r}")
        if s.conversations and s.transport != "ray":
            raise BadRequest("conversations need transport 'ray' (a conversation's home edge is "
                             "reached by its Ray actor)")
        return s


class KDNConnector(KVConnectorBase_V1):
    """vLLM's v1 KV connector for KDN (see the module)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self.settings = Settings.from_extra(cfg.kv_connector_extra_config)
        self.tenants = Tenants.from_config({"tenant": self.settings.tenant, "token": self.settings.token,
                                            "tenants": self.settings.tenants})
        mc = vllm_config.model_config
        self.fingerprints = fingerprints(mc.model, mc.dtype, vllm_config.device_config.device_type)
        self.fingerprint = self._named(self.settings.fingerprint or "vllm")
        self.block_size = vllm_config.cache_config.block_size
        self.deadline = Deadline()
        self._sources, self._publishers = {}, {}
        if cfg.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a KV load that fails fails its request; "
                        "'recompute' computes those tokens instead", cfg.kv_load_failure_policy)
        self.planner = self.loader = self.keeper = None
        self.counters = collections.Counter()     # load_steps, capture_steps, keep_steps
        if role == KVConnectorRole.SCHEDULER:
            s = self.settings
            pc = vllm_config.parallel_config
            token_bytes = mc.get_num_layers(pc) * 2 * mc.get_num_kv_heads(pc) * mc.get_head_size() * \
                mc.dtype.itemsize
            self.planner = Planner(self.tenants, self._source, self.deadline, self.block_size,
                                   s.lookup_deadline_s, s.min_tokens, producer=cfg.is_kv_producer,
                                   published=self._forget_kbs, converses=self._converses,
                                   histories=self._history, token_bytes=token_bytes)
        else:
            self.loader = Loader(self._source, self._publisher, self.deadline,
                                 self.settings.fetch_deadline_s, self.settings.layerwise,
                                 self.settings.copy_threads, histories=self._history)
            self.keeper = Keeper(self.loader, self._history)
            self._heads = mc.get_num_kv_heads(vllm_config.parallel_config)
            self._head_dim = mc.get_head_size()
            self._ranks = vllm_config.parallel_config.world_size

    @property
    def requires_kv_delivery(self) -> bool:
        return False               # a capture that does not happen is a publish that failed, said so

    def stats(self) -> dict:
        part = self.planner or self.loader
        out = {"role": self.role.name.lower(), "fingerprint": self.fingerprint,
               "connector": dict(self.counters), **part.stats()}
        if self.keeper is not None:
            out["keeper"] = self.keeper.stats()
        return out

    # --- whom a request reads as -----------------------------------------------------------
    def _named(self, fingerprint):
        """A fingerprint by engine name ("vllm", "transformers") or as given."""
        if fingerprint is None:
            return self.fingerprint
        got = self.fingerprints.get(fingerprint, fingerprint)
        if got is None:
            raise BadRequest(f"no {fingerprint!r} fingerprint for this model and dtype")
        return got

    def _source(self, salt):
        """The Source of a salt's tenant (one per tenant's salt: narrowings share it)."""
        head = self.tenants.split(salt)[0]
        if head not in self._sources:
            tenant, s = self.tenants.of(salt), self.settings
            if tenant is None:
                raise BadRequest(f"cache salt {salt!r} maps to no tenant: it reads nothing")
            fp = self._named(tenant.fingerprint)
            if s.transport == "http":
                self._sources[head] = HTTPSource(s.edges, tenant, fp, s.allow_remote)
            else:
                self._sources[head] = RaySource(s.network, s.region, tenant, fp, s.address)
        return self._sources[head]

    def _converses(self, salt) -> bool:
        """Whether a request's conversation is read and kept: conversations on, a tenant, and
        that tenant reading this engine's own KV (what vLLM computes is kept under its own
        fingerprint only)."""
        if not self.settings.conversations:
            return False
        tenant = self.tenants.of(salt)
        return tenant is not None and self._named(tenant.fingerprint) == self.fingerprints["vllm"]

    def _history(self, salt):
        """The kdn.client.history.History of a salt's tenant (connects on first use)."""
        return self._source(salt).history() if self._converses(salt) else None

    def _forget_kbs(self) -> None:
        for source in self._sources.values():
            source.forget()

    def _publisher(self, salt):
        s = self.settings
        if s.transport != "ray":
            raise BadRequest("publishing from vLLM needs transport 'ray' (the origin is a Ray actor)")
        if salt not in self._publishers:
            from kdn.client import connect
            tenant = self.tenants.of(salt)
            if tenant is None:
                raise BadRequest(f"cache salt {salt!r} maps to no tenant: nothing is published for it")
            if self._named(tenant.fingerprint) != self.fingerprint:
                raise BadRequest(f"cache salt {salt!r} reads another engine's KV; vLLM publishes "
                                 f"only under its own fingerprint")
            self._publishers[salt] = connect(region=s.region, address=s.address, network=s.network,
                                             tenant=tenant.name, fingerprint=self.fingerprint,
                                             admin_token=s.admin_token)
        return self._publishers[salt]

    # --- scheduler side --------------------------------------------------------------------
    def on_new_request(self, request) -> None:
        self.planner.new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.planner.matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.planner.allocated(request, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        return self.planner.plan(scheduler_output)

    def update_connector_output(self, connector_output):
        meta = connector_output.kv_connector_worker_meta
        self.planner.update(meta if isinstance(meta, Reports) else None)

    def request_finished(self, request, block_ids):
        """(whether vLLM keeps the blocks until the keeper copied them, the request's report)."""
        keeping = self.planner.keep(request, block_ids)
        return keeping, {"kdn": self.planner.finished(request)}

    # --- worker side -----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        from vllm.model_executor.models.utils import extract_layer_index
        layers = self._vllm_config.compilation_config.static_forward_context

        def writer(name):
            layer = layers[name]
            return lambda k, v, cache, slots: layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
        self.loader.register(kv_caches, extract_layer_index, writer, self.block_size,
                             self._heads, self._head_dim)
        if self._ranks > 1:       # each rank holds a slice of the heads; chunks hold them all
            self.loader.refused = f"{self._ranks} ranks (tensor/pipeline parallel) are not supported yet"
        if self.loader.refused:
            log.warning("KDN loads nothing into this engine: %s", self.loader.refused)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        plan = self._get_connector_metadata()
        if plan.loads:
            self.counters["load_steps"] += 1
            self.loader.start(plan.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.loader.wait_layer(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return                     # captures read the whole prompt once, after the forward

    def wait_for_save(self):
        self.loader.finish()
        plan = self._get_connector_metadata()
        if plan.captures:
            self.counters["capture_steps"] += 1
        for cap in plan.captures:
            self.loader.capture(cap)
        if plan.keeps:
            self.counters["keep_steps"] += 1
        for keep in plan.keeps:           # copied out in the keeper's thread, after this step
            self.keeper.submit(keep)

    def get_finished(self, finished_req_ids):
        """Requests whose kept blocks the keeper has copied out: vLLM frees them now."""
        return self.keeper.take_copied() or None, None

    def get_block_ids_with_load_errors(self) -> set:
        return self.loader.take_failed()

    def build_connector_worker_meta(self):
        reports = self.loader.take_reports()
        return Reports(reports) if reports else None

    def shutdown(self):
        self.deadline.close()
        if self.keeper is not None:
            self.keeper.close()


# --- worker-side calls through vLLM's collective_rpc (kdn.engines.vllm.run.settle) ----------
def _worker_connector() -> "KDNConnector | None":
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    c = get_kv_transfer_group() if has_kv_transfer_group() else None
    return c if isinstance(c, KDNConnector) and c.keeper is not None else None


def keep_limits(worker, limits: dict) -> None:
    """{vLLM request id: n}: keep only n tokens of these finished requests' conversations."""
    c = _worker_connector()
    if c is not None:
        c.keeper.limit(limits)


def kept(worker, timeout_s: float) -> dict:
    """Wait (at most timeout_s) for the keeps under way; {req id: result} of the last ones."""
    c = _worker_connector()
    return {} if c is None else c.keeper.wait(timeout_s)
