"""The client: how an inference worker, a publisher or an operator talks to a KDN network.

`connect()` joins Ray and returns a `Client`, one object over three jobs that share one
view of the network (kdn.client.view: membership, the nearest live edge, failover):
- reads (kdn.client.reader): a prompt's keys, manifests, fetch with verification, lookup;
- publishing (kdn.client.publish): chunks to the origin, only those it lacks, manifest last;
- operator calls (kdn.client.operator): pin, replicas, TTL, warm, delete, add/remove edge, status,
  and a tenant's conversation KV (list, drop, TTL, budget, pinned at the origin).

Reads and publishing are per namespace, so they need the model's fingerprint
(`fingerprint=model.fingerprint`); operator calls do not, so `kdn status` connects without
a model.
"""
from kdn.client.join import init_ray, read_state, state_path
from kdn.core.errors import BadRequest
from kdn.core.keys import CHUNK_TOKENS
from kdn.client.operator import Operator
from kdn.client.publish import Publisher
from kdn.client.reader import Fetched, Reader  # noqa: F401 - Fetched is part of this API
from kdn.client.view import NetworkView


def connect(region: str = None, address: str = None, network: str = None, tenant: str = "default",
            fingerprint: str = None, token: str = None, admin_token: str = None,
            accept=None) -> "Client":
    """Connect to a running KDN network, joining Ray if this process has not: at `address`,
    else at the cluster `kdn up` recorded (its network too, unless `network` is named),
    else Ray's own 'auto' discovery. network defaults to "kdn".

    fingerprint: the model's (model.fingerprint), for reads and publishing. token: the
    tenant's read token (when the network requires one for it); admin_token: the network's
    admin token, for publishing and operator controls. accept: the codecs this reader takes
    over a slow link (default the lossless ones; name a lossy one, e.g. ("zstd", "q8z"), to
    trade exactness for bytes).
    """
    import ray
    if not ray.is_initialized():
        if address is None and state_path().exists():
            state = read_state(require_alive=True)
            address, network = state["address"], network or state["network"]
        init_ray(address or "auto")
    return Client(network=network or "kdn", region=region, tenant=tenant, fingerprint=fingerprint,
                  token=token, admin_token=admin_token, accept=accept)


class Client:
    """Reads, publishing and operator calls of one tenant on one network (see the module)."""

    def __init__(self, network: str = "kdn", region: str = None, tenant: str = "default",
                 fingerprint: str = None, chunk_tokens: int = CHUNK_TOKENS,
                 token: str = None, admin_token: str = None, accept=None, data_plane: str = "auto"):
        self.view = NetworkView(network, region=region, admin_token=admin_token, data_plane=data_plane)
        self.network, self.tenant, self.fingerprint = network, tenant, fingerprint
        self.chunk_tokens = chunk_tokens
        self.token = token or admin_token
        self.operator = Operator(self.view, tenant)
        self._reader = self._publisher = None
        if fingerprint is not None:
            self._reader = Reader(self.view, tenant, fingerprint, token=self.token, accept=accept,
                                  chunk_tokens=chunk_tokens)
            self._publisher = Publisher(self.view, tenant, fingerprint, chunk_tokens=chunk_tokens)

    def _needs_model(self, what: str):
        raise BadRequest(f"{what} needs the model's fingerprint: connect with "
                         f"fingerprint=model.fingerprint (KV is only ever read or published "
                         f"under its own model)")

    @property
    def reader(self) -> Reader:
        return self._reader or self._needs_model("reading knowledge")

    @property
    def publisher(self) -> Publisher:
        return self._publisher or self._needs_model("publishing")

    # --- the network -----------------------------------------------------------------------
    region = property(lambda self: self.view.region)
    ring = property(lambda self: self.view.ring)
    topology = property(lambda self: self.view.topology)
    membership = property(lambda self: self.view.membership)
    ns = property(lambda self: self.reader.ns)
    accept = property(lambda self: self.reader.accept)
    counters = property(lambda self: self.reader.counters)

    def refresh(self) -> None:
        self.view.refresh()

    def ranked_edges(self) -> list:
        return self.view.ranked_edges()

    def stats(self) -> dict:
        """This process's counters: reads (fetches, chunks, corrupt_chunks) and publishing;
        data_plane: the reads that went over edges' HTTP frames (kdn.client.dataplane)."""
        reads = self._reader.counters if self._reader else {}
        published = self._publisher.counters if self._publisher else {}
        return {"network": self.network, "region": self.region,
                "counters": {**reads, **published}, "data_plane": self.view.plane.stats()}

    # --- reads (kdn.client.reader) ----------------------------------------------------------------
    def manifests(self, refresh: bool = False) -> list:
        return self.reader.manifests(refresh)

    def manifest(self, kb: str, version: int = None):
        return self.reader.manifest(kb, version)

    def keys_for(self, tokens, kb: str = None, version: int = None) -> tuple:
        return self.reader.keys_for(tokens, kb, version)

    def lookup(self, tokens, kb: str = None) -> dict:
        return self.reader.lookup(tokens, kb)

    def fetch(self, tokens, kb: str = None, timeout_s: float = None, version: int = None) -> Fetched:
        return self.reader.fetch(tokens, kb, timeout_s, version)

    def fetch_keys(self, keys, manifest=None, timeout_s: float = None) -> Fetched:
        return self.reader.fetch_keys(keys, manifest, timeout_s)

    # --- publishing (kdn.client.publish) ----------------------------------------------------------
    def publish(self, kb: str, documents, kv, layout: str = "prefix", meta: dict = None,
                dtype: str = None, **options) -> dict:
        """Publish a KB version whose KV the caller computed (kdn.client.publish.Publisher.publish)."""
        receipt = self.publisher.publish(kb, documents, kv, layout=layout, meta=meta, dtype=dtype,
                                         **options)
        self.reader.forget_manifests()
        return receipt

    # --- operator calls (kdn.client.operator) -----------------------------------------------------
    def delete(self, kb: str, version: int) -> dict:
        """Retire a version of one of this tenant's KBs: an operator call, so it needs no model
        (kdn.client.operator.Operator.delete); with a fingerprint, that model's version."""
        receipt = self.operator.delete(kb, version, self.fingerprint)
        if self._reader is not None:
            self._reader.forget_manifests()
        return receipt

    def collect(self, object_ttl_s: float = None) -> dict:
        """Delete the origin's chunks no version names (kdn.client.operator.Operator.collect)."""
        return self.operator.collect(object_ttl_s)

    def pin(self, kb: str, regions) -> dict:
        return self.operator.pin(kb, regions)

    def set_replicas(self, kb: str, n: int) -> dict:
        return self.operator.set_replicas(kb, n)

    def set_ttl(self, kb: str, seconds: float) -> dict:
        return self.operator.set_ttl(kb, seconds)

    def set_emphasis(self, kb: str, weights: dict) -> dict:
        receipt = self.operator.set_emphasis(kb, weights)
        if self._reader is not None:
            self._reader.forget_manifests()     # this process reads the KB with it at once
        return receipt

    def warm(self, kb: str, region: str) -> dict:
        return self.operator.warm(kb, region)

    def add_edge(self, name: str, region: str, capacity_bytes: int = 2 << 30, **edge_options) -> dict:
        return self.operator.add_edge(name, region, capacity_bytes, **edge_options)

    def remove_edge(self, name: str, kill: bool = True) -> dict:
        return self.operator.remove_edge(name, kill)

    def status(self, timeout_s: float = 3.0) -> dict:
        return self.operator.status(timeout_s)

    # --- conversation KV (kdn.client.operator; kept by the service: kdn.client.history) --------
    def conversations(self, tenant: str = None) -> list:
        return self.operator.conversations(tenant)

    def drop_conversations(self, tenant: str = None) -> dict:
        return self.operator.drop_conversations(tenant)

    def pin_conversations(self, tenant: str = None, pinned: bool = True) -> dict:
        return self.operator.pin_conversations(tenant, pinned)

    def pinned_conversations(self, tenant: str = None) -> dict:
        return self.operator.pinned_conversations(tenant)

    def set_conversation_policy(self, tenant: str = None, ttl_s: float = None, budget_bytes: int = None,
                                max_ttl_s: float = None) -> list:
        return self.operator.set_conversation_policy(tenant, ttl_s, budget_bytes, max_ttl_s)
