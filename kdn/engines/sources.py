"""Where an engine's KV connector gets knowledge from: the nearest edge, over Ray or HTTP.

A connector asks two questions of the network, from two places: the scheduler asks how many
leading tokens of a prompt the network holds (`match`: the prompt's KB keys, computed here
from the cached manifests, and one lookup at the nearest edge; no KV moves), and the worker
asks for the chunks themselves (`fetch`: verified against the KB manifest's checksums, the
longest good prefix). Both are bounded by a deadline: a dead, slow or lying edge costs the
engine at most that long, after which the tokens are simply computed.

`RaySource` reads through kdn.client (failover across edges, corrupt copies dropped and
refetched); `HTTPSource` reads edges' HTTP servers in the order given, for engines outside
Ray, and checks each chunk against the manifest itself. `Tenants` maps an engine request's
cache salt to the one tenant it may read; a salt it does not know reads nothing, never the
default tenant. A salt may narrow its tenant's conversations (kdn.core.conversation):
"<tenant's salt>|<narrowing>" reads as that tenant ("|<narrowing>": the default tenant), its
conversation KV under the narrowing, and vLLM's own prefix cache, which hashes the whole salt,
is split by it too. A RaySource also reads and keeps conversations (`history()`).
"""
import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass

from kdn.core.conversation import MAX_SALT_CHARS
from kdn.core.errors import BadRequest, FrameError, ManifestError, NoLiveEdge
from kdn.core.keys import namespace_digest
from kdn.core.manifest import best_prefix
from kdn.core.rpc import Unreachable

REFRESH_ON_MISS_S = 1.0       # a prompt that matches no KB re-lists the KBs at most this often
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


class RaySource:
    """match/fetch for one tenant through kdn.client (connects to Ray on first use)."""

    def __init__(self, network: str, region: str, tenant: Tenant, fingerprint: str,
                 address: str = None):
        self.network, self.region, self.tenant, self.fingerprint = network, region, tenant, fingerprint
        self.address = address
        self._client = None
        self._history = None
        self._lock = threading.Lock()
        self._listed = 0.0
        self.counters = collections.Counter()   # matches, relisted, fetches

    def client(self):
        with self._lock:
            if self._client is None:
                from kdn.client import connect
                self._client = connect(region=self.region, address=self.address, network=self.network,
                                       tenant=self.tenant.name, fingerprint=self.fingerprint,
                                       token=self.tenant.token)
            return self._client

    def history(self):
        """The tenant's conversations through this source's network view (kdn.client.history)."""
        cl = self.client()
        with self._lock:
            if self._history is None:
                from kdn.client.history import History
                self._history = History(cl.view, self.tenant.name, self.fingerprint,
                                        token=self.tenant.token)
            return self._history

    def match(self, tokens) -> Match:
        cl = self.client()
        self.counters["matches"] += 1
        keys, m = cl.keys_for(tokens)
        if m is None and time.monotonic() - self._listed > REFRESH_ON_MISS_S:
            self._listed = time.monotonic()   # a KB published seconds ago is found at once
            self.counters["relisted"] += 1
            cl.manifests(refresh=True)
            keys, m = cl.keys_for(tokens)
        if m is None:
            return NO_MATCH
        covers = min(m.n_tokens, len(tokens)) if len(keys) == len(m.keys) else len(keys) * m.chunk_tokens
        held = cl.lookup(tokens)
        n = min(held["chunks"], len(keys))
        return Match(tokens=held["tokens"] if n else 0, keys=tuple(keys[:n]), kb=m.name,
                     version=m.version, edge=held["edge"], covers=covers)

    def fetch(self, kb: str, version: int, keys, timeout_s: float) -> tuple:
        """(verified chunks of `keys` (of KB kb v`version`), the longest good prefix of them;
        {"edge": the edge that answered, "failovers": edges that failed first})."""
        cl = self.client()
        self.counters["fetches"] += 1
        f = cl.fetch_keys(keys, manifest=cl.manifest(kb, version), timeout_s=timeout_s)
        return f.chunks, {"edge": f.edge, "failovers": list(f.failovers)}

    def forget(self) -> None:
        """A KB was just published: list the KBs again on the next match."""
        self._listed = 0.0
        if self._client is not None:
            self._client.reader.forget_manifests()

    def stats(self) -> dict:
        return {"counters": dict(self.counters),
                "client": self._client.stats() if self._client else None}


class HTTPSource:
    """match/fetch for one tenant from edges' HTTP servers, nearest first (one connection
    per thread: kdn.client.http is one connection per client)."""

    def __init__(self, urls, tenant: Tenant, fingerprint: str, allow_remote: bool = False):
        if not urls:
            raise BadRequest("the http transport needs at least one edge URL (\"edges\")")
        self.urls, self.tenant, self.fingerprint = list(urls), tenant, fingerprint
        self.ns = namespace_digest(tenant.name, fingerprint)
        self.allow_remote = allow_remote
        self._local = threading.local()
        self._listed = 0.0
        self._generation = 0            # bumped by forget(): each thread's KB list is then stale
        self.counters = collections.Counter()   # matches, relisted, fetches, failovers, corrupt_chunks

    def _clients(self):
        if not hasattr(self._local, "clients"):
            from kdn.client.http import EdgeHTTPClient
            self._local.clients = [EdgeHTTPClient(u, allow_remote=self.allow_remote,
                                                  token=self.tenant.token) for u in self.urls]
            self._local.generation = self._generation
        return self._local.clients

    def _kbs(self, refresh: bool = False) -> list:
        """The namespace's manifests, as the first edge that answers lists them."""
        self._clients()                 # this thread's connections (and KB list generation)
        if self._local.generation != self._generation:
            refresh, self._local.generation = True, self._generation
        ms, _ = self._first_answer(lambda c: c.kbs(self.tenant.name, self.fingerprint, refresh=refresh))
        return ms

    def _first_answer(self, call):
        """call(client) on the first edge that answers; NoLiveEdge when none does. An edge
        that answers with a fault of its own (RemoteError) is not failed over: it surfaces."""
        errors = []
        for c in self._clients():
            try:
                return call(c), c
            except Unreachable as e:
                self.counters["failovers"] += 1
                errors.append(str(e))
        raise NoLiveEdge("no edge answered: " + "; ".join(errors))

    def forget(self) -> None:
        """A KB was just published: list the KBs again on the next match."""
        self._listed = 0.0
        self._generation += 1

    def _manifest(self, tokens):
        keys, m = best_prefix(tokens, self.ns, self._kbs())
        if m is None and time.monotonic() - self._listed > REFRESH_ON_MISS_S:
            self._listed = time.monotonic()
            self.counters["relisted"] += 1
            keys, m = best_prefix(tokens, self.ns, self._kbs(refresh=True))
        return keys, m

    def match(self, tokens) -> Match:
        self.counters["matches"] += 1
        keys, m = self._manifest(tokens)
        if m is None:
            return NO_MATCH
        held, c = self._first_answer(lambda c: c.lookup(keys, self.ns))
        n = min(int(held["chunks"]), len(keys))
        if not n:
            return NO_MATCH
        covered = m.n_tokens if n == len(m.keys) else n * m.chunk_tokens
        return Match(tokens=min(covered, len(tokens)), keys=tuple(keys[:n]), kb=m.name,
                     version=m.version, edge=c.url)

    def fetch(self, kb: str, version: int, keys, timeout_s: float) -> tuple:
        """(chunks of `keys` (of KB kb v`version`), each checked against the manifest's
        checksum, the prefix before the first one that fails; {"edge", "failovers"}).
        (timeout_s: each edge's connection already times out on its own, EdgeHTTPClient.)"""
        def named(ms):
            return next((x for x in ms if x.name == kb and x.version == version), None)
        m = named(self._kbs()) or named(self._kbs(refresh=True))
        if m is None or not m.sums:
            raise ManifestError(f"no checksums for KB {kb!r} v{version} at the edges: nothing "
                                f"to verify its chunks against")
        sums = m.sum_of()
        self.counters["fetches"] += 1
        failed = self.counters["failovers"]
        got, c = self._first_answer(lambda c: c.fetch(list(keys), self.ns))
        info = {"edge": c.url, "failovers": self.counters["failovers"] - failed}
        out = []
        for chunk in got.chunks:
            try:
                chunk.verify(sums.get(chunk.key))
            except FrameError:          # the bytes are not the published ones
                self.counters["corrupt_chunks"] += 1
                break
            out.append(chunk)
        return out, info

    def stats(self) -> dict:
        return {"counters": dict(self.counters)}
