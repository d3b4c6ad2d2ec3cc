"""Where an engine's KV connector gets knowledge from: the nearest edge, over Ray or HTTP.

A connector asks two questions of the network, from two places: the scheduler asks how many
leading tokens of a prompt the network holds (`match`: the prompt's KB keys, computed here
from the cached manifests, and one lookup at the nearest edge; no KV moves), and the worker
asks for the chunks themselves (`fetch`: verified against the KB manifest's checksums, the
longest good prefix). Both are bounded by a deadline: a dead, slow or lying edge costs the
engine at most that long, after which the tokens are simply computed.

Both ask kdn.client.reader's one Reader (prompt to keys through the cached manifests, a
re-list on a miss, failover across edges, every chunk verified): `RaySource` over Ray
(kdn.client: edges ranked by the topology, corrupt copies dropped and refetched),
`HTTPSource` over edges' HTTP servers in the order given (kdn.client.http.HTTPEdges), for
engines outside Ray. `Tenants` maps an engine request's
cache salt to the one tenant it may read; a salt it does not know reads nothing, never the
default tenant. A salt may narrow its tenant's conversations (kdn.core.conversation):
"<tenant's salt>|<narrowing>" reads as that tenant ("|<narrowing>": the default tenant), its
conversation KV under the narrowing, and vLLM's own prefix cache, which hashes the whole salt,
is split by it too. A RaySource also reads and keeps conversations (`history()`).
"""
import collections
import concurrent.futures
import threading
from dataclasses import dataclass

from kdn.core.conversation import MAX_SALT_CHARS
from kdn.core.errors import BadRequest

LOOKUP_DEADLINE_S = 2.0       # a scheduler lookup; past it the prompt is computed
FETCH_DEADLINE_S = 10.0       # a worker fetch; past it the blocks are reported failed
DEADLINE_THREADS = 4          # calls stuck on a hung edge hold one each until their RPC times out
NARROW = "|"                  # "<tenant's salt>|<narrowing>": a salt narrowed inside its tenant


@dataclass(frozen=True)
class Match:
    """What the network holds of a prompt: `tokens` leading tokens, in chunks `keys`
    (held ones only) of KB `kb` version `version`, as the edge `edge` said. `covers`: the
    leading tokens of the prompt that are the KB's, held or not (a conversation's own chunks
    start after the KB's whole ones)."""
    tokens: int = 0
    keys: tuple = ()
    kb: str = None
    version: int = None
    edge: str = None
    covers: int = 0


NO_MATCH = Match()


@dataclass(frozen=True)
class Tenant:
    """Who a request reads as: a tenant name and its read token, and whose KV it reads
    (fingerprint None: the engine's own; a salt may name another engine's on purpose)."""
    name: str
    token: str = None
    fingerprint: str = None


class Tenants:
    """cache salt -> Tenant. Requests without a salt read as `default` (None: they read
    nothing); a salt that is not in the map reads nothing."""

    def __init__(self, default: Tenant = None, salts: dict = None):
        self.default = default
        self.salts = dict(salts or {})

    @classmethod
    def from_config(cls, cfg: dict) -> "Tenants":
        """From connector config: "tenant"/"token" (requests without a salt) and "tenants":
        {salt: tenant name or {"tenant": name, "token": token, "fingerprint": whose KV}}."""
        default = Tenant(cfg.get("tenant", "default"), cfg.get("token"))
        salts = {}
        for salt, t in (cfg.get("tenants") or {}).items():
            if isinstance(t, str):
                salts[salt] = Tenant(t)
            elif isinstance(t, dict) and isinstance(t.get("tenant"), str) \
                    and set(t) <= {"tenant", "token", "fingerprint"}:
                salts[salt] = Tenant(t["tenant"], t.get("token"), t.get("fingerprint"))
            else:
                raise BadRequest(f"tenants[{salt!r}] must be a tenant name or {{'tenant': name, "
                                 f"'token': token, 'fingerprint': fp}}, got {t!r}")
        return cls(default, salts)

    def split(self, salt) -> tuple:
        """(the tenant's salt, the narrowing or None) of a request's salt: a salt in the map
        is the tenant's own; "<salt>|<narrowing>" narrows it (an empty <salt>: the default
        tenant); a narrowing must be 1-MAX_SALT_CHARS characters, else the salt is taken whole
        (and, being in no map, reads nothing)."""
        if salt is None or salt in self.salts:
            return salt, None
        head, sep, narrowing = salt.partition(NARROW)
        if not sep or not 0 < len(narrowing) <= MAX_SALT_CHARS:
            return salt, None
        return head or None, narrowing

    def of(self, salt) -> "Tenant | None":
        head, _ = self.split(salt)
        return self.default if head is None else self.salts.get(head)


class Deadline:
    """Runs calls in a few daemon threads and gives up waiting on one after its deadline
    (the call runs on until its own RPC timeout; its result is dropped)."""

    def __init__(self, threads: int = DEADLINE_THREADS):
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="kdn-deadline")

    def run(self, seconds: float, fn, *args):
        """fn(*args), or TimeoutError after `seconds`."""
        return self._pool.submit(fn, *args).result(timeout=seconds)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Source:
    """match/fetch for one tenant over a kdn.client.reader.Reader (see the module)."""

    def reader(self):
        raise NotImplementedError

    def match(self, tokens) -> Match:
        reader = self.reader()
        self.counters["matches"] += 1
        keys, m = reader.keys_for(tokens)
        if m is None:
            return NO_MATCH
        covers = min(m.n_tokens, len(tokens)) if len(keys) == len(m.keys) else len(keys) * m.chunk_tokens
        held, edge, _ = reader.view.nearest().lookup(keys, reader.ns, token=reader.token)
        n = min(int(held["chunks"]), len(keys))
        return Match(tokens=reader.tokens_of(n, len(tokens), m) if n else 0, keys=tuple(keys[:n]),
                     kb=m.name, version=m.version, edge=edge, covers=covers)

    def fetch(self, kb: str, version: int, keys, timeout_s: float) -> tuple:
        """(verified chunks of `keys` (of KB kb v`version`), the longest good prefix of them;
        {"edge": the edge that answered, "failovers": edges that failed first})."""
        reader = self.reader()
        self.counters["fetches"] += 1
        f = reader.fetch_keys(keys, manifest=reader.manifest(kb, version), timeout_s=timeout_s)
        return f.chunks, {"edge": f.edge, "failovers": list(f.failovers)}

    def forget(self) -> None:
        """A KB was just published: list the KBs again on the next match."""
        raise NotImplementedError


class RaySource(Source):
    """match/fetch for one tenant through kdn.client (connects to Ray on first use); its
    conversations too (`history()`)."""

    def __init__(self, network: str, region: str, tenant: Tenant, fingerprint: str,
                 address: str = None):
        self.network, self.region, self.tenant, self.fingerprint = network, region, tenant, fingerprint
        self.address = address
        self._client = None
        self._history = None
        self._lock = threading.Lock()
        self.counters = collections.Counter()   # matches, fetches

    def client(self):
        with self._lock:
            if self._client is None:
                from kdn.client import connect
                self._client = connect(region=self.region, address=self.address, network=self.network,
                                       tenant=self.tenant.name, fingerprint=self.fingerprint,
                                       token=self.tenant.token)
            return self._client

    def reader(self):
        return self.client().reader

    def history(self):
        """The tenant's conversations through this source's network view (kdn.client.history)."""
        cl = self.client()
        with self._lock:
            if self._history is None:
                from kdn.client.history import History
                self._history = History(cl.view, self.tenant.name, self.fingerprint,
                                        token=self.tenant.token)
            return self._history

    def forget(self) -> None:
        if self._client is not None:
            self._client.reader.forget_manifests()

    def stats(self) -> dict:
        return {"counters": dict(self.counters),
                "client": self._client.stats() if self._client else None}


class HTTPSource(Source):
    """match/fetch for one tenant from edges' HTTP servers, nearest first."""

    def __init__(self, urls, tenant: Tenant, fingerprint: str, allow_remote: bool = False):
        from kdn.client.http import HTTPEdges
        from kdn.client.reader import Reader
        self.tenant, self.fingerprint = tenant, fingerprint
        self.edges = HTTPEdges(urls, token=tenant.token, allow_remote=allow_remote)
        self._reader = Reader(self.edges, tenant.name, fingerprint, token=tenant.token)
        self.counters = collections.Counter()   # matches, fetches

    def reader(self):
        return self._reader

    def forget(self) -> None:
        self._reader.forget_manifests()

    def stats(self) -> dict:
        return {"counters": {**self.counters, **self.edges.counters, **self._reader.counters}}
