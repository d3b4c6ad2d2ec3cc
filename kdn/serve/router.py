"""KV-aware routing inside `kdn serve`: which replica of a region answers a request for KB k.

It is Ray Serve's own request router (`ray.serve.request_router.RequestRouter`, set with
`request_router_config` on each region's deployment), learned from Ray's prefix-cache
affinity router (ray.serve.llm.request_router.PrefixCacheAffinityRouter) but keyed by what
KDN knows exactly, the KB a request names, instead of a character prefix tree in an actor.

- What each replica's engine holds: the replica says (its `record_routing_stats`, which
  Serve calls every ROUTING_STATS_PERIOD_S: the KBs in its EngineKV cache, its mean service
  time and each KB's last fetch time), and this router remembers where it sent each KB
  since (a replica that just served k holds k now, before its next report).
- The decision (`decide`, pure, a few microseconds): among the replicas whose engine holds
  k, the least loaded; it answers unless its wait, queue x service time, exceeds the least
  loaded replica's wait plus the cost of fetching k from the edge, in which case the request
  is routed away to the least loaded ("queue"). A KB no engine holds goes to its rendezvous
  owner among the replicas (so KBs spread over the engines' caches instead of every cache
  churning through every KB), again unless that owner's queue costs more than fetching.
  A conversation's next turn (the ingress names it: kdn.serve.affinity) goes first to the
  replica whose engine still holds that conversation (its report, or where this router last
  sent it), under the same rule: unless its queue costs more than fetching the history from
  the edge ("conversation_hit", "conversation_routed_away_queue").
  The choice comes first in the ranks returned to Serve, the other replicas after it, so a
  full or dead replica costs Serve's retry, never a failed request; no loop: one pass.
- EngineKV: the transformers replica's engine-side cache of the KV of its last KBs
  (kdn.client.reader's Fetched, the edge's objects mapped), bounded in bytes, LRU. A hit skips the
  fetch; the cache rebuild (one copy) is done either way. A second one (CONVERSATION_KV_BYTES)
  holds the engine caches of the replica's last conversations (kdn.serve.chat.Chat._local).

Counters (`counters`, per region's router and summed by `routing_counters()`): engine
hits, misses, routed away and why. Where each answer's KV came from is counted by the
replica that answered (EngineKV.served_from: engine, edge memory, edge disk, peer, origin,
none) and reported with its routing stats; the router keeps each replica's latest counts,
also after the replica died (`replica_kv_sources`), so the service's sums only grow. Across regions, the ingress asks each region's router for
its View of a KB (`view`: the wait there and the fetch from the tier that holds it; see
kdn.serve.regions).
"""
import collections
import threading
import time

import xxhash
from ray.serve.request_router import RequestRouter

from kdn.serve.regions import DEFAULT_FETCH_S, KV_SOURCES, UNAVAILABLE, View

ROUTING_STATS_PERIOD_S = 1.0      # how often a replica reports what its engine holds
DEFAULT_SERVICE_S = 1.0           # a request's service time before any is measured
RECENT = 4096                     # KBs whose last replica this router remembers
ENGINE_KV_BYTES = 256 << 20       # the transformers replica's engine-side KV cache
CONVERSATION_KV_BYTES = 1 << 30   # ... and of its last conversations (kdn.serve.chat.Chat._local)

_ROUTERS = []                     # this process's routers, for routing_counters()
_lock = threading.Lock()


def kb_of(args) -> "str | None":
    """The KB a replica call names: complete/stream(body, tenant, token) -> "tenant/kb"."""
    if len(args) >= 2 and isinstance(args[0], dict) and args[0].get("kb") is not None:
        return f"{args[1]}/{args[0]['kb']}"
    return None


def conversation_of(args) -> "str | None":
    """The ingress's name for a replica call's conversation (kdn.serve.affinity), or None; None
    too for a first turn (no answer in it, no prompt_cache_key), which has no history to
    follow: the same question again is a new conversation, routed as any request."""
    body = args[0] if len(args) >= 2 and isinstance(args[0], dict) else {}
    if not body.get("conversation"):
        return None
    if body.get("prompt_cache_key") is None and \
            not any(isinstance(m, dict) and m.get("role") == "assistant" for m in body.get("messages") or ()):
        return None
    return str(body["conversation"])


def owner(kb: str, replicas) -> str:
    """KB kb's rendezvous owner among replica ids (the same in every router)."""
    return max(replicas, key=lambda r: xxhash.xxh3_64_intdigest(f"{kb}\0{r}".encode()))


def decide(kb, queues: dict, holders, service_s: float, fetch_s: float) -> tuple:
    """(replica id, why) for a request naming kb. queues: replica id -> requests queued or
    running there; holders: the replica ids whose engine holds kb. why: "engine_hit",
    "routed_away_queue" (a holder was busier than a fetch costs), "owner" (no engine holds
    it: its rendezvous owner), "owner_busy" (the owner was busier than a fetch costs)."""
    least = min(queues, key=lambda r: (queues[r], r))
    held = [r for r in holders if r in queues]
    if held:
        best = min(held, key=lambda r: (queues[r], r))
        if queues[best] * service_s > queues[least] * service_s + fetch_s:
            return least, "routed_away_queue"
        return best, "engine_hit"
    o = owner(kb, queues)
    if queues[o] * service_s > queues[least] * service_s + fetch_s:
        return least, "owner_busy"
    return o, "owner"


def routing_counters() -> dict:
    """This process's routers' counters, summed (the ingress reports them in its stats)."""
    out = collections.Counter()
    for c in routing_counters_by_region().values():
        out.update(c)
    return dict(out)


def routing_counters_by_region(app: str = None) -> dict:
    """region (the deployment's name) -> its routers' counters in this process (of app, if given)."""
    out = collections.defaultdict(collections.Counter)
    with _lock:
        for r in _ROUTERS:
            if app is None or r.app == app:
                out[r.region].update(r.counters)
    return {k: dict(v) for k, v in out.items()}


def replica_kv_sources(app: str = None) -> dict:
    """region -> replica id -> {source: answers} (kdn.serve.regions.KV_SOURCES), as this
    process's routers (of app, if given) last heard each replica, dead ones included."""
    out = collections.defaultdict(dict)
    with _lock:
        routers = [r for r in _ROUTERS if app is None or r.app == app]
    for r in routers:
        out[r.region].update(r.kv_sources_seen())
    return dict(out)


def region_routers(app: str) -> dict:
    """region -> this process's request router of that region's deployment in app (the ingress's)."""
    with _lock:
        return {r.region: r for r in _ROUTERS if r.app == app}


class KBAffinityRouter(RequestRouter):
    """A region's replicas, chosen by where the KB's KV already is (see the module)."""

    def initialize_state(self, **kwargs):
        self.counters = collections.Counter()
        self.recent = collections.OrderedDict()     # kb -> replica id it was last sent to
        self.recent_conversations = collections.OrderedDict()   # "conv:<name>" -> the same
        self._held = {}                             # replica id -> (its report, the KBs it lists)
        self._deciding = collections.OrderedDict()  # ids of requests decided, not yet routed
        self._kv_sources = {}                       # replica id -> its last reported kv_sources
        dep = getattr(self, "_deployment_id", None)  # Serve sets it before this call
        self.region = getattr(dep, "name", None)
        self.app = getattr(dep, "app_name", None)
        # Serve pickles this class by value: the registry is reached through the module
        # imported here, never captured (a lock does not pickle)
        import kdn.serve.router as here
        with here._lock:
            here._ROUTERS.append(self)

    def _stats(self, replica) -> dict:
        s = getattr(replica, "routing_stats", None)
        return s if isinstance(s, dict) else {}

    def kv_sources_seen(self) -> dict:
        """replica id -> {source: answers}: each replica's latest report, kept after its death."""
        for r in list(self.curr_replicas.values()):     # (another thread's dict: copied at once)
            got = self._stats(r).get("kv_sources")
            if isinstance(got, dict):
                self._kv_sources[r.replica_id.to_full_id_str()] = dict(got)
        return dict(self._kv_sources)

    def _holds(self, replica, kb: str) -> bool:
        """Whether the replica's last report lists kb in its engine, or (kb "conv:<name>") the
        conversation (a set per report, so a decision costs the same with 4,096 KBs held as
        with one)."""
        s = self._stats(replica)
        rid = replica.replica_id
        seen = self._held.get(rid)
        if seen is None or seen[0] is not s:
            seen = self._held[rid] = (s, frozenset(s.get("kbs", ()))
                                      | frozenset("conv:" + c for c in s.get("conversations", ())))
        return kb in seen[1]

    def _conversation_choice(self, conv: str, by_id: dict, queues: dict, service: float):
        """(replica id, why) for a conversation's next turn where a replica's engine holds it
        (its report or where this router last sent it): that replica unless its queue costs
        more than fetching the history from the edge; None where none holds it."""
        key = "conv:" + conv
        holders = {rid for rid, r in by_id.items() if self._holds(r, key)}
        if self.recent_conversations.get(key) in queues:
            holders.add(self.recent_conversations[key])
        if not holders:
            return None
        chosen, why = decide(key, queues, holders, service, DEFAULT_FETCH_S)
        return chosen, "conversation_hit" if why == "engine_hit" else "conversation_" + why

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        if not candidate_replicas:
            return []
        context = getattr(pending_request, "routing_context", None)
        if context is not None:
            # Serve's loop asks again at once, in a tight loop, while every replica it was
            # given is full, unless told to back off (as Ray's own routers do): 14,107 asks
            # for 15 requests to one busy replica were measured before this
            context.should_backoff = True
        kb = None if pending_request is None else kb_of(pending_request.args)
        conv = None if pending_request is None else conversation_of(pending_request.args)
        if kb is None and conv is None:   # /v1/models and the like: Serve's own choice suffices
            return [list(candidate_replicas)]
        t0 = time.perf_counter()
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        queues, holders, service, fetch = {}, set(), [], []
        for rid, r in by_id.items():
            q = self._replica_queue_len_cache.get(r.replica_id)
            queues[rid] = 0 if q is None else q
            s = self._stats(r)
            if self._holds(r, kb):
                holders.add(rid)
                fetch.append(s.get("fetch_s", {}).get(kb, DEFAULT_FETCH_S))
            service.append(s.get("service_s") or DEFAULT_SERVICE_S)
        got = None if conv is None else self._conversation_choice(conv, by_id, queues, max(service))
        if got is None and kb is None:    # a plain chat no engine holds: Serve's own choice
            return [list(candidate_replicas)]
        if got is not None:
            chosen, why = got
        else:
            if self.recent.get(kb) in queues:
                holders.add(self.recent[kb])
            chosen, why = decide(kb, queues, holders, max(service), max(fetch or [DEFAULT_FETCH_S]))
        if self._first_time(pending_request):
            self.counters[why] += 1
            self.counters["decisions"] += 1
            self.counters["decision_us"] += int((time.perf_counter() - t0) * 1e6)
        else:       # Serve asks again while the replicas it was given are full: not a new request
            self.counters["rechosen"] += 1
        rest = [r for rid, r in by_id.items() if rid != chosen]
        return [[by_id[chosen]], rest] if rest else [[by_id[chosen]]]

    def _first_time(self, pending_request) -> bool:
        """Whether this is the request's first decision (Serve calls choose_replicas again,
        with backoff, until a replica it was given accepts); a request without an id counts
        every time."""
        rid = getattr(getattr(pending_request, "metadata", None), "internal_request_id", None)
        if rid is None:
            return True
        if rid in self._deciding:
            return False
        self._deciding[rid] = None
        while len(self._deciding) > RECENT:       # a request cancelled before it was routed
            self._deciding.popitem(last=False)
        return True

    def view(self, kb: str, in_flight: int = 0) -> View:
        """This region's View of kb (kdn.serve.regions): requests ahead per replica (the larger
        of its replicas' queue lengths as Serve last heard them and in_flight, the caller's own
        requests there) x the replicas' service time, plus nothing when an engine holds kb,
        else the region's last measured fetch of it and its tier ("unknown" when none)."""
        replicas = list(self.curr_replicas.values())
        if not replicas:
            return UNAVAILABLE
        queued, service, held, fetch, tier = 0, [], False, None, "unknown"
        for r in replicas:
            queued += self._replica_queue_len_cache.get(r.replica_id) or 0
            s = self._stats(r)
            service.append(s.get("service_s") or DEFAULT_SERVICE_S)
            held = held or self._holds(r, kb)
            f = s.get("fetch_s", {}).get(kb)
            if f is not None and (fetch is None or f < fetch):
                fetch, tier = f, s.get("tiers", {}).get(kb, "edge_memory")
        held = held or self.recent.get(kb) in {r.replica_id.to_full_id_str() for r in replicas}
        wait = max(queued, in_flight) / len(replicas) * max(service)
        if held:
            return View(wait, 0.0, "engine")
        return View(wait, DEFAULT_FETCH_S if fetch is None else fetch, tier)

    def kv_bytes(self, kb: str):
        """The bytes of kb's KV, as a replica of this region last fetched it (None: none did)."""
        for r in self.curr_replicas.values():
            n = self._stats(r).get("kv_bytes", {}).get(kb)
            if n is not None:
                return n
        return None

    def on_request_routed(self, pending_request, replica_id, result):
        self._deciding.pop(getattr(getattr(pending_request, "metadata", None), "internal_request_id", None), None)
        body = pending_request.args[0] if pending_request.args and isinstance(pending_request.args[0], dict) else {}
        conv = body.get("conversation")     # a first turn's too: its second follows it here
        for recent, key in ((self.recent, kb_of(pending_request.args)),
                            (self.recent_conversations, None if not conv else "conv:" + str(conv))):
            if key is not None:
                recent[key] = replica_id.to_full_id_str()
                recent.move_to_end(key)
                while len(recent) > RECENT:
                    recent.popitem(last=False)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        dead = replica_id.to_full_id_str()
        self._held.pop(replica_id, None)
        for recent in (self.recent, self.recent_conversations):
            for kb in [k for k, r in recent.items() if r == dead]:
                del recent[kb]
        self.counters["replicas_died"] += 1


def router_config() -> dict:
    """request_router_config for a region's deployment."""
    return {"request_router_class": "kdn.serve.router.KBAffinityRouter",
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
            "request_routing_stats_timeout_s": 5.0}


# --- the replica's side ---------------------------------------------------------------------------
class EngineKV:
    """The KV of a replica's last KBs (Fetched objects, keyed "tenant/kb" and version),
    bounded in bytes, least recently used first out; with the measures the router uses."""

    def __init__(self, capacity_bytes: int = ENGINE_KV_BYTES):
        self.capacity = int(capacity_bytes)
        self.entries = collections.OrderedDict()     # (kb, version) -> (Fetched, nbytes)
        self.bytes = 0
        self.fetch_s = {}                            # kb -> seconds its last fetch took
        self.tiers = {}                              # kb -> where that fetch came from (regions.tier_of)
        self.kv_bytes = {}                           # kb -> bytes of its KV
        self.service_s = None                        # mean seconds per request (EWMA)
        self.counters = collections.Counter()

    def take(self, kb: str, version):
        """get() and forget: for a value one request uses and may change (a conversation's
        engine cache, put back after its answer)."""
        got = self.get(kb, version)
        if got is not None:
            _, n = self.entries.pop((kb, version))
            self.bytes -= n
        return got

    def get(self, kb: str, version):
        got = self.entries.get((kb, version))
        if got is None:
            self.counters["engine_misses"] += 1
            return None
        self.entries.move_to_end((kb, version))
        self.counters["engine_hits"] += 1
        return got[0]

    def put(self, kb: str, version, fetched, nbytes: int, fetch_s: float, tier: str = "edge_memory") -> bool:
        """Keep fetched (nbytes of KV, fetched in fetch_s from `tier`); False when it is larger
        than the whole cache."""
        for table, v in ((self.fetch_s, fetch_s), (self.tiers, tier), (self.kv_bytes, nbytes)):
            table.pop(kb, None)
            table[kb] = v                            # the latest last: the oldest goes first
            if len(table) > RECENT:
                table.pop(next(iter(table)))
        self.counters[f"fetched_{tier}"] += tier != "engine"
        if nbytes > self.capacity:
            self.counters["engine_rejected"] += 1
            return False
        old = self.entries.pop((kb, version), None)
        if old is not None:
            self.bytes -= old[1]
        while self.entries and self.bytes + nbytes > self.capacity:
            _, (_, n) = self.entries.popitem(last=False)
            self.bytes -= n
            self.counters["engine_evictions"] += 1
        self.entries[(kb, version)] = (fetched, nbytes)
        self.bytes += nbytes
        return True

    def served_from(self, source: str) -> None:
        """Count where one answer's knowledge KV came from (kdn.serve.regions.KV_SOURCES)."""
        if source not in KV_SOURCES:
            raise ValueError(f"unknown KV source {source!r} (expected one of {', '.join(KV_SOURCES)})")
        self.counters[f"kv_{source}"] += 1

    def served(self, seconds: float) -> None:
        self.service_s = seconds if self.service_s is None else 0.8 * self.service_s + 0.2 * seconds

    def routing_stats(self) -> dict:
        """What the router reads (record_routing_stats)."""
        return {"kbs": sorted({kb for kb, _ in self.entries}), "service_s": self.service_s,
                "fetch_s": dict(self.fetch_s), "tiers": dict(self.tiers), "kv_bytes": dict(self.kv_bytes),
                "kv_sources": {s: self.counters[f"kv_{s}"] for s in KV_SOURCES if self.counters[f"kv_{s}"]},
                "bytes": self.bytes}

    def stats(self) -> dict:
        return {"kbs": len(self.entries), "bytes": self.bytes, "capacity": self.capacity,
                **self.counters}
