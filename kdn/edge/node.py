"""An edge node: the async Ray actor whose methods are an edge's RPC surface.

An edge serves the knowledge bases of one region: it holds chunks in two memory tiers
(kdn/edge/tiers.py), gets what it lacks by pull-through from the ring owners and the origin
(kdn/edge/pull.py), checks and re-encodes chunks for each link (kdn/edge/forms.py), knows the
published manifests and who may read what (kdn/edge/catalog.py), and routes by the membership
the origin broadcasts (kdn/edge/membership.py). A read is the same for Ray and HTTP
(kdn/edge/reads.py); HTTP (kdn/edge/http.py) runs on this actor's own event loop.

This class only wires those together and checks each caller's token: every method takes
`token=` (kdn.core.rpc passes it on every call); writes and node-to-node calls need the admin
token, reads the namespace's read token when one is configured. A background loop applies
the replication policy (hot copies in, cold ones out), expires TTLs and refreshes the
membership from the origin every membership_refresh_s, so an edge that missed a broadcast
converges by itself. With a disk tier (disk_bytes, disk_dir: kdn/edge/disk.py), a writer task
writes memory's victims and pulled-through fills to disk, off the readers' time. With
kv_events (kdn/edge/events.py), what the tiers hold and drop is published as vLLM KV events.
A thread has the kernel allocate the first `object_store_fill_bytes` of this node's object
store (the edge's capacity by default, or KDN_OBJECT_STORE_FILL_BYTES where the node's
environment sets it: kdn.edge.options.fill_bytes; kdn.core.prefault), so copies into it take
no page fault.
The origin's drops (kdn/edge/drops.py) win over every copy on its way in (kdn/edge/tombstones.py):
pushes and repairs carry the drop-log position their bytes were read at, and an owner asked
by an edge that applied more of the log than it has answers nothing until it catches up.

One event loop serves every RPC and HTTP reader, so nothing on it hashes, codes or copies a
chunk or touches a file: that work (verification, store forms, ray.put's copy, disk reads,
writes and unlinks) runs in worker threads, one asyncio.to_thread call per batch.
"""
import asyncio
import collections
import logging
import os
import time

from kdn.core.auth import Tokens
from kdn.core.chunk import Chunk, Encoded
from kdn.core.codecs import LOSSLESS
from kdn.edge.arrivals import Arrivals
from kdn.edge.catalog import Catalog
from kdn.edge.conversations import Conversations, held_object
from kdn.edge.dataplane import STREAMS as PEER_STREAMS, PeerPulls
from kdn.edge.disk import DiskTier
from kdn.edge.drops import Replay
from kdn.edge.forms import Forms, corrupted
from kdn.edge.membership import Membership
from kdn.edge.options import fill_bytes
from kdn.edge.peers import PEER_TIMEOUT_S, Peers
from kdn.edge.pull import Pull
from kdn.edge.reads import MAX_REPLY_BYTES, Reads, check_keys
from kdn.edge.stores import BACKLOG_BYTES, BACKLOG_WAIT_S, WriteBehind
from kdn.edge.tiers import ROLES, Held, Tiers, resolve_all
from kdn.core.errors import AccessDenied, BadRequest, KDNError, StoreError
from kdn.core.checks import check_int, check_number
from kdn.core.dataplane import NODE_HOST, reachable_url
from kdn.core.conversation import CONVERSATION_SHARE, conversation_namespace, home_of, retention_ttl
from kdn.core.keys import MAX_FETCH_KEYS, MAX_KEYS_PER_CALL, check_key
from kdn.core.manifest import check_ttl
from kdn.core.prefault import Prefaulter
from kdn.core.rpc import failover_errors
from kdn.placement.replication import ReplicationPolicy
from kdn.core.transfer import check_accept, fetch_deadline_s

log = logging.getLogger("kdn.edge")

MEMBERSHIP_REFRESH_S = 10.0   # how often an edge asks the origin for the membership
MEMBERSHIP_TIMEOUT_S = 5.0
WRITE_BACK_IDLE_S = 0.05      # how often the disk writer looks for victims when idle
POLICY_TICK_S = 1.0
PIN_BATCH_BYTES = 256 << 20   # a pinned conversation's chunks per call to the origin, in bytes
PIN_STORE_BUDGET_S = 20.0     # a pinned store's pull and sends to the origin, all together (a
                              # worker waits 30 s for the store: kdn/client/history.py)
PIN_LOOKUP_TIMEOUT_S = 1.0    # a lookup's pull from the origin (a worker waits 2 s for the lookup)
PIN_PULL_TIMEOUT_S = 60.0     # a pull-back that outlasts its caller's wait goes on this long, for the next turn
ADMIN_KEYS = MAX_KEYS_PER_CALL   # keys one operator or origin call may name (a KB's keys)
PUSH_ARRIVAL_BYTES = 128 << 20  # a push's copies answered before they are in the node's store, at most


class EdgeNode:
    def __init__(self, network: str, name: str, region: str, capacity_bytes: int, topology: dict,
                 policy: str = "s3fifo", hot_fraction: float = 0.25, replicas: int = 2,
                 http_port=None, http_host: str = "127.0.0.1", replication: dict = None,
                 fault_injection: bool = False, auth: dict = None, store_codec: str = "raw",
                 membership_refresh_s: float = MEMBERSHIP_REFRESH_S,
                 max_reply_bytes: int = MAX_REPLY_BYTES, http_idle_s: float = None,
                 disk_bytes: int = None, disk_dir: str = None, kv_events=None,
                 conversation_bytes: int = None, store_backlog_bytes: int = BACKLOG_BYTES,
                 store_backlog_wait_s: float = BACKLOG_WAIT_S,
                 data_plane: str = "auto", peer_streams: int = PEER_STREAMS, pull_into: str = "process",
                 object_store_fill_bytes: int = None):
        import ray
        self.network, self.name, self.region = network, name, region
        # this node's id, to tell readers beside the edge (None outside Ray: a test's edge)
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.tokens = Tokens.from_dict(auth)
        self.fault_injection = bool(fault_injection)
        self.membership_refresh_s = float(membership_refresh_s)
        self.members = Membership(topology, replicas)
        # the disk tier: <disk_dir>/<edge name>, so edges of a node share a root, never files
        disk = None if not disk_bytes else DiskTier(os.path.join(disk_dir or _default_disk_dir(network), name),
                                                    disk_bytes, policy)
        self.tiers = Tiers(capacity_bytes, policy, hot_fraction, disk=disk)
        # conversation KV beside the tiers, in memory of its own and, with a disk tier, a
        # share of the disk beside it: <disk root>/<edge name>.conversations, wiped at start
        # (kdn/edge/conversations.py: its files hold no tenant and no idle time)
        self.conversations = Conversations(
            int(capacity_bytes * CONVERSATION_SHARE) if conversation_bytes is None else conversation_bytes,
            disk=None if disk is None else _conversation_disk(disk, name, policy))
        self.demand = ReplicationPolicy(**{"hot_budget_fraction": hot_fraction, **(replication or {})})
        self.peers = Peers(network, self.tokens.admin, edge=name)
        self.catalog = Catalog(self.tokens, self.peers)
        # the origin's drop log replayed: a copy of a key removed while this edge was away
        # never stands beside bytes stored later under that key (kdn/edge/drops.py)
        self.replay = Replay(self.tiers, self.peers, None if disk is None else disk.dir,
                             forget=lambda keys: self.stores.forget(keys))
        self.events = None if kv_events is None else self._start_events(kv_events)
        self._policies_wanted = None   # the origin's latest conversation policies, not applied yet
        self._policy_task = None
        self.forms = Forms(store_codec, self.catalog.sum_of, lambda: self.members.topology, region)
        # peer pulls over HTTP frames between nodes, Ray beside this one (kdn/edge/dataplane.py)
        self.pulls = PeerPulls(self.peers, self.node_id, data_plane,
                               ray.util.get_node_ip_address() if ray.is_initialized() else None,
                               check_int(peer_streams, "peer_streams", 1, 16), pull_into)
        self.pull = Pull(name, region, self.members, self.tiers, self.forms, self.peers,
                         self.catalog, self.demand, self.pulls)
        self.reads = Reads(name, region, self.members, self.tiers, self.pull, self.peers,
                           self.catalog, self.demand, max_reply_bytes)
        # what this edge answered for before copying it into its node's store (its stores,
        # the origin's pushes, pulled over HTTP or given over Ray), put there after
        self.arrivals = Arrivals(self.peers.later)
        # other cache layers' stores acknowledged here, durable at the origin after
        self.stores = WriteBehind(self.tiers, self.forms, self.peers,
                                  check_int(store_backlog_bytes, "store_backlog_bytes", 0),
                                  owns=lambda keys: [name in o for o in self.members.owners(keys)],
                                  name=name, serves_http=lambda: self.http is not None and self.pulls.mode != "ray",
                                  backlog_wait_s=check_number(store_backlog_wait_s, "store_backlog_wait_s", 0, 60),
                                  arrivals=self.arrivals)
        # this node's object store allocated ahead of the copies into it, up to this edge's
        # capacity by default: memory a busy edge takes anyway (kdn.core.prefault)
        fill = fill_bytes(object_store_fill_bytes, capacity_bytes)
        self.prefault = Prefaulter(fill_bytes=fill, map_resident=False).start() if ray.is_initialized() and fill else None
        self.counters = collections.Counter()
        self.started = time.time()
        self._bg = None
        self._writer = None
        self._events_started = False
        self.background_failure = None   # set when the background loop died of a bug
        self._pin_pulls = {}             # (tenant, ns, first key not held) -> its pull-back in flight
        self._last_refresh = 0.0
        self.http_port_wanted, self.http_host, self.http_idle_s = http_port, http_host, http_idle_s
        self.http = None
        self._http_lock = asyncio.Lock()

    def _start_events(self, options):
        """The KV-event publisher, told of every change in the tiers and every manifest."""
        from kdn.edge.events import KVEvents
        t = self.tiers

        def where(key):
            return t.peek(key) is not None, t.disk is not None and key in t.disk

        events = KVEvents(options, self.region, where, t.held)
        t.observer = events.note
        if t.disk is not None:
            t.disk.on_change = events.note
        self.catalog.on_add = events.learn
        return events

    @property
    def store_codec(self) -> str:
        return self.forms.store_codec

    # --- lifecycle ----------------------------------------------------------------------
    def _start_background(self):
        if self._bg is None:
            self._catch_up()                  # level with the drop log before long
            self._bg = asyncio.get_running_loop().create_task(self._background())
            self._bg.add_done_callback(self._background_ended)
        if self._writer is None and self.tiers.disk is not None:
            self._writer = asyncio.get_running_loop().create_task(self._write_backs())
            self._writer.add_done_callback(self._background_ended)
        if self.events is not None and not self._events_started:
            self._events_started = True    # a restarted edge learns manifests for its disk's keys
            self.peers.later(self.catalog.refresh(), "manifests for KV events")

    def _catch_up(self) -> None:
        """Replay the origin's drop log in the background (kdn/edge/drops.py). Only inside Ray: an
        edge outside it (a unit test's) has no origin, and a lookup would start Ray."""
        if self.node_id is not None:
            self.replay.start()

    async def _write_backs(self):
        """Write memory's victims (and fills) to the disk tier as they come, off the readers'
        time; a full device drops writes (counted by the disk tier), never reads."""
        while True:
            if not self.tiers.pending:
                await asyncio.sleep(WRITE_BACK_IDLE_S)
                continue
            try:
                await self.tiers.drain_write_backs(self.forms.intact)
            except (KDNError, OSError):   # an unreadable disk, a peer's copy gone: go on
                self.counters["background_errors"] += 1
                log.exception("edge %s: disk write-back failed", self.name)
            except failover_errors():     # a peer's copy vanished with its node: skip it
                self.counters["disk_write_back_lost"] += 1

    async def _background(self):
        while True:
            await asyncio.sleep(POLICY_TICK_S)
            try:
                await self._tick()
                if time.monotonic() - self._last_refresh > self.membership_refresh_s:
                    await self._refresh_membership()
            except (KDNError, OSError):   # a refusal, a bad broadcast, a full disk: next tick
                self.counters["background_errors"] += 1
                log.exception("edge %s: background tick failed", self.name)

    def _background_ended(self, task) -> None:
        """Anything else is a bug: it ends the loop, and says so in stats and the log rather
        than leaving an edge that silently never refreshes (as a broad except once did)."""
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.background_failure = f"{type(e).__name__}: {e}"
            log.error("edge %s: background loop died", self.name, exc_info=e)

    async def _tick(self):
        """Apply the replication policy: fetch newly hot chunks, drop cold ones; expire TTLs."""
        d = self.demand.decide(region_capacity_bytes={self.region: self.tiers.capacity},
                               owners_region=self.members.owner_regions)
        for key, region in d.demote:
            if region == self.region and self.tiers.hot.discard(key):
                self.counters["hot_demoted"] += 1
                self.tiers.note(key)
        wanted = [k for k, region in d.promote if region == self.region and self.tiers.peek(k) is None]
        if wanted:
            self.peers.later(self.pull.promote(wanted), "hot promotion")
        await self.tiers.sweep()
        await asyncio.to_thread(self.conversations.sweep)

    async def _refresh_membership(self):
        self._last_refresh = time.monotonic()
        m = await self.peers.origin(MEMBERSHIP_TIMEOUT_S).membership()
        if m is not None and self.members.apply(m):
            self.counters["membership_refreshed"] += 1

    async def ping(self, token=None, drops=None, conversation_policies=None) -> dict:
        """Alive; starts the background work (and HTTP) on the first call. drops: the origin's
        drop-log state its health pings carry; one this edge has not replayed starts a catch-up.
        conversation_policies: the tenants' conversation policies the origin keeps (its pings
        carry them: kdn/origin/conversations.py), applied here where they differ."""
        self._start_background()
        if conversation_policies is not None:
            self._policies_wanted = conversation_policies
            if self._policy_task is None or self._policy_task.done():
                self._policy_task = asyncio.get_running_loop().create_task(self._apply_policies())
        if drops is not None and self.replay.behind(drops):
            self._catch_up()
        if self.http_port_wanted is not None and self.http is None:
            await self.start_http(self.http_port_wanted, self.http_host, token=self.tokens.admin)
        return {"role": "edge", "name": self.name, "region": self.region, "pid": os.getpid(),
                "http": self.http_address()}

    async def _apply_policies(self) -> None:
        """The origin's latest conversation policies (a background task, so a ping is answered
        at once): which tenants are pinned (and their epochs), and each tenant's TTL, maximum
        TTL and budget where they differ from this edge's, in a worker thread (a smaller budget
        may move chunks to disk). A value this edge refuses is counted and logged, and the
        other tenants' policies still apply."""
        while self._policies_wanted is not None:
            policies, self._policies_wanted = self._policies_wanted, None
            self.conversations.set_pinned({t: p.get("epoch", 0) for t, p in policies.items() if p.get("pinned")})
            for tenant, p in policies.items():
                want = {k: p.get(k) for k in ("ttl_s", "budget_bytes", "max_ttl_s")}
                try:
                    if self.conversations.differs(tenant, **want):
                        await asyncio.to_thread(self.conversations.set_policy, tenant, **want)
                        self.counters["conversation_policies_applied"] += 1
                except BadRequest as e:
                    self.counters["conversation_policies_refused"] += 1
                    log.error("edge %s: the origin's conversation policy of tenant %.64r is refused: %s",
                              self.name, tenant, e)

    def http_address(self, token=None):
        """This edge's HTTP base URL (None when it serves none)."""
        return None if self.http is None else self.http.url

    async def data_address(self, token=None) -> dict:
        """Where this edge's frames are read from (a peer's pulls: kdn/edge/dataplane.py; a
        reader on another node: kdn.client.dataplane): {"url": its HTTP base URL or None,
        "node": its Ray node id, "ip": its node's address}. No token: an address is no
        secret, and the server it names checks every request's."""
        import ray
        return {"url": self.http_address(), "node": self.node_id,
                "ip": ray.util.get_node_ip_address() if ray.is_initialized() else None}

    async def start_http(self, port: int = 0, host: str = "127.0.0.1", token=None) -> str:
        """Serve this edge over HTTP too (kdn/edge/http.py); returns the base URL.

        host "node": the address of this edge's Ray node (a host of its own). Off loopback the
        listener is guarded or refused: it needs the network's admin token and read tokens
        (tenants left open with "*" are the operator's choice), else BadRequest naming them."""
        self.tokens.check_admin(token, "start_http")
        from kdn.edge.http import EdgeHTTP
        from kdn.core.env import is_loopback
        if host == NODE_HOST:
            import ray
            host = ray.util.get_node_ip_address()
        if not is_loopback(host) and (self.tokens.admin is None or not (self.tokens.readers or self.tokens.open)):
            missing = " and ".join(w for w, gone in (("an admin token", self.tokens.admin is None),
                                                     ("read tokens", not (self.tokens.readers or self.tokens.open)))
                                   if gone)
            raise BadRequest(f"edge {self.name} will not serve HTTP on {host}, off loopback, without "
                             f"{missing}: anyone who reaches the address would read or control it "
                             "(kdn.core.auth; `kdn up` makes an admin token, KDN_READ_TOKENS names readers)")
        async with self._http_lock:            # concurrent pings start one server
            if self.http is None:
                http = EdgeHTTP(self, host=host, port=port, idle_s=self.http_idle_s)
                await http.start()
                self.http, self.http_host = http, host
        return self.http_address()

    # --- membership ---------------------------------------------------------------------
    async def set_membership(self, m: dict, token=None) -> int:
        self.tokens.check_admin(token, "set_membership")
        if self.members.apply(m):
            self._last_refresh = time.monotonic()
        return self.members.version

    async def membership(self, token=None) -> dict:
        """The membership this edge routes by (clients use it while the origin is down)."""
        return self.members.to_dict()

    # --- what the origin and operators put here ---------------------------------------------
    async def have(self, keys, ns: bytes = None, token=None) -> list:
        """Which keys this edge holds (given ns: holds under that namespace)."""
        self.tokens.check_admin(token, "have")
        return [self.tiers.holds(k, ns) for k in check_keys(keys, ADMIN_KEYS, distinct=False)]

    async def put_chunks(self, chunks, role: str = "main", pin: bool = False, ttl_s=None,
                         token=None, drops=None) -> int:
        """Keep chunks the origin pushes (role main) or warms (role hot); how many were kept.
        Each is verified and kept in this edge's store form; one already held stays. drops:
        the origin's drop-log state when the bytes were read (a push; a repair: its load's):
        a chunk a drop applied here since is not kept (kdn/edge/tombstones.py).
        Those already in the store form are kept as they arrived (views into the call's
        argument, in this node's object store, which Ray keeps while this process maps it;
        an argument under Ray's inline size came inside the call, in this process's memory),
        and copied into the store as this node's own objects after the answer, as pull_chunks
        does (_adopt_pushes). Read repairs (kdn/edge/pull.py) are kept the same way, and
        counted with the pushes (pushes_ray_keep_us, pushes_adopted)."""
        self.tokens.check_admin(token, "put_chunks")
        t0 = time.perf_counter()
        n, arrived = await self._keep(chunks, role, pin, ttl_s, drops, arrival="pushes")
        await self._adopt_pushes(arrived)
        self.counters["pushes_ray_keep_us"] += int((time.perf_counter() - t0) * 1e6)
        return n

    async def _adopt_pushes(self, arrived) -> None:
        """A push's arrivals copied into the store after the answer (kdn/edge/arrivals.py), or
        now where the copies of pushes before still to make would pass PUSH_ARRIVAL_BYTES: the
        memory arrivals hold stays bounded, and the store keeps the pace of the pushes."""
        nbytes = sum(h.nbytes for h in arrived)
        if self.arrivals.pending_bytes + nbytes > PUSH_ARRIVAL_BYTES:
            await self.arrivals.adopt(arrived)
        else:
            self.arrivals.later(arrived)

    async def _keep(self, chunks, role: str, pin: bool, ttl_s, drops, arrival: str = None) -> tuple:
        """put_chunks' work: (how many of chunks were kept, the Helds kept as they arrived).
        arrival: the kind of arrivals chunks in the store form are kept as (Held.arrival,
        views into the buffer they came in), for the caller to adopt (kdn/edge/arrivals.py)."""
        if role not in ROLES:
            raise BadRequest(f"role must be one of {', '.join(ROLES)}, got {role!r:.40}")
        ttl_s = None if ttl_s is None else check_ttl(ttl_s)
        born = self.tiers.tombs.born_at(drops)
        if not isinstance(chunks, (list, tuple)):
            raise BadRequest(f"put_chunks takes a list of chunks, got {type(chunks).__name__}")
        chunks = [c for c in chunks if c is not None]
        bad = next((c for c in chunks if not isinstance(c, (Chunk, Encoded))), None)
        if bad is not None:
            raise BadRequest(f"put_chunks takes Chunks and Encoded frames, got a {type(bad).__name__}")
        tier = self.tiers.tier(role)
        new = [c for c in chunks if c.key not in tier]
        stored = dict(zip((c.key for c in new), await self.forms.to_store(new, arrival=arrival)))
        n, arrived = 0, []
        for c in chunks:
            held, fresh = tier.peek(c.key), False     # already held: keep the object we have
            if held is None:
                if c.key not in stored:      # held above, evicted while others were encoded
                    stored[c.key] = (await self.forms.to_store([c], arrival=arrival))[0]
                held, fresh = stored.pop(c.key), True
                if held is None:
                    continue                 # failed verification
                held.born = born
            if self.tiers.put(role, c.key, held, pin=pin):
                n += 1
                if fresh and held.arrived:
                    arrived.append(held)
            if ttl_s:
                self.tiers.expire_later(c.key, ttl_s)
        self.counters["received_" + role] += n
        return n, arrived

    async def pull_chunks(self, url: str, keys, role: str = "main", pin: bool = False, ttl_s=None,
                          token=None, drops=None, origin_ip: str = None) -> dict:
        """A push taken over the data plane: the chunks of keys pulled from the origin's frames
        at url (kdn/origin/http.py; origin_ip: its node's address), then kept as put_chunks
        keeps them, but as they arrived: the answer does not wait for their copy into this
        node's store, made right after it (_adopt_pushes).
        {"pulled": chunks received, "kept": of those, kept}; {"pulled": None} when
        this edge does not reach url, or its data_plane is "ray" (the origin then sends the
        chunks over Ray)."""
        self.tokens.check_admin(token, "pull_chunks")
        if role not in ROLES:
            raise BadRequest(f"role must be one of {', '.join(ROLES)}, got {role!r:.40}")
        keys = check_keys(keys)
        if not isinstance(url, str) or not url.startswith("http://"):
            raise BadRequest(f"url must be the origin's http:// URL, got {url!r:.80}")
        if self.pulls.mode == "ray" or reachable_url({"url": url, "ip": origin_ip},
                                                      self.pulls.addresses.node_ip) is None:
            return {"pulled": None, "kept": 0}
        got = await self.pulls.from_origin(url, keys)
        if got is None:
            return {"pulled": None, "kept": 0}
        objs = [o for o in got if o is not None]
        t0 = time.perf_counter()
        kept, arrived = await self._keep(objs, role, pin, ttl_s, drops, arrival="pushes")
        await self._adopt_pushes(arrived)
        self.counters["pushes_pulled_keep_us"] += int((time.perf_counter() - t0) * 1e6)
        return {"pulled": len(objs), "kept": kept}

    async def put_objects(self, chunks, token=None) -> dict:
        """Keep another cache layer's opaque objects (kdn.integrations.objects) here and answer
        before they are durable; the origin gets them in the background (kdn/edge/stores.py).
        {"received", "kept", "pending"}: pending, how many were answered before they are
        durable (the rest waited for the origin: a full backlog, or memory that would not
        hold them pinned)."""
        self.tokens.check_admin(token, "put_objects")
        return await self.stores.put(chunks)

    async def stores_durable(self, timeout_s: float = 60.0, token=None) -> dict:
        """Wait (up to timeout_s) until every store this edge answered is durable at the origin
        (benches, tests, an operator before a restart): the backlog's stats, "durable" whether
        it is empty."""
        self.tokens.check_admin(token, "stores_durable")
        if not 0 < timeout_s <= 3600:
            raise BadRequest(f"stores_durable: timeout_s must be in (0, 3600], got {timeout_s!r:.40}")
        return {"durable": await self.stores.drain(timeout_s), **self.stores.stats()}

    async def withdraw_stores(self, keys, timeout_s: float = 60.0, token=None) -> dict:
        """Before a host deletes keys at the origin (its eviction): this edge's stores of them
        not sent yet are not sent, and those on their way are waited for (up to timeout_s)
        until they have landed (kdn/edge/stores.py, WriteBehind.withdraw): {"withdrawn",
        "settled", "backlog_objects"}."""
        self.tokens.check_admin(token, "withdraw_stores")
        if not 0 < timeout_s <= 3600:
            raise BadRequest(f"withdraw_stores: timeout_s must be in (0, 3600], got {timeout_s!r:.40}")
        return await self.stores.withdraw(check_keys(keys, ADMIN_KEYS, distinct=False), timeout_s)

    async def pin_keys(self, keys, token=None) -> int:
        """Pin chunks this edge holds (an operator pinned their KB to this region)."""
        self.tokens.check_admin(token, "pin_keys")
        return self.tiers.pin(check_keys(keys, ADMIN_KEYS, distinct=False))

    async def set_ttl(self, keys, ttl_s, token=None) -> int:
        """Chunks of keys this edge holds now expire ttl_s seconds from now (an operator's TTL
        applies at once, not only to chunks pushed later); how many it holds."""
        self.tokens.check_admin(token, "set_ttl")
        return self.tiers.set_ttl(check_keys(keys, ADMIN_KEYS, distinct=False), check_ttl(ttl_s))

    async def drop(self, keys, token=None, drops=None) -> int:
        """Drop keys from every tier; how many were held. drops: the origin's drop-log state
        once it removed them (its broadcast of a delete): no copy on its way in that is older
        survives it (kdn/edge/tombstones.py). Without it, a plain removal."""
        self.tokens.check_admin(token, "drop")
        keys = check_keys(keys, ADMIN_KEYS, distinct=False)
        at = None
        if drops is not None:
            at = self.tiers.tombs.drop_position(drops)
            if self.replay.behind(drops):
                self._catch_up()
        self.stores.forget(keys)           # a delete wins over a store not yet durable
        return await self.tiers.drop(keys, at=at)

    # --- manifests (broadcast by the origin, so reads survive an origin outage) -----------
    async def add_manifest(self, m: dict, token=None) -> None:
        self.tokens.check_admin(token, "add_manifest")
        self.catalog.add(m)

    async def drop_manifest(self, ns, name, version, token=None) -> None:
        self.tokens.check_admin(token, "drop_manifest")
        self.catalog.drop(ns, name, version)

    async def list_manifests(self, tenant: str, fingerprint: str, token=None) -> list:
        """Manifests of one namespace: from the origin when it answers, else the broadcast copy."""
        return await self.catalog.list(tenant, fingerprint, token)

    # --- reads --------------------------------------------------------------------------
    async def fetch(self, keys, ns: bytes, region: str = None, resolve: bool = False, token=None,
                    node: str = None, accept=None, tenant: str = None, fingerprint: str = None) -> dict:
        """The longest prefix of `keys` that the network holds, with where each chunk came from.

        Returns object references ("refs"; kdn.core.rpc.resolve_refs: zero-copy on this node;
        a copy this edge received from a peer over HTTP and did not keep is the object itself,
        carried in the reply), each to a Chunk or an Encoded frame ("codecs" names each one's codec, "wire" its size in bytes),
        or with resolve=True the objects themselves as stored ("chunks"). node (the reader's
        Ray node id) and accept (codecs it takes besides raw; default the lossless ones) choose
        each chunk's form for the link (kdn/edge/forms.py); without node, chunks go as stored.
        At most MAX_FETCH_KEYS distinct keys; "more" is True when the reply stopped at
        max_reply_bytes: fetch the keys after the ones received again. tenant and
        fingerprint: what ns digests, for a namespace no manifest names (kdn/edge/catalog.py).
        """
        accept = check_accept(accept)
        self._start_background()
        same_node = node == self.node_id

        async def shape(helds, sources):
            if resolve:
                return await resolve_all(helds), len(helds), False
            if node is None:
                return helds, len(helds), False
            out, n = await self.forms.link_forms(helds, region or self.region, same_node, accept)
            return out, n, n < len(helds)

        got = await self.reads.fetch(keys, ns, region, token, shape, claim=(tenant, fingerprint))
        reply = {"sources": got["sources"], "edge": self.name, "region": self.region,
                 "ring": self.members.version, "more": got["more"]}
        if resolve:
            reply["chunks"] = got["out"]
            return reply
        arrived = [h for h in got["out"] if h.arrived]
        if arrived:        # a store's objects kept as they arrived: this node's own first, so
            await self.arrivals.adopt(arrived)   # the reader maps them (kdn/edge/arrivals.py)
        # (a copy received over HTTP and not kept has no reference: it rides in the reply)
        reply.update(refs=[h.ref if h.ref is not None else h.obj for h in got["out"]],
                     codecs=[h.codec for h in got["out"]],
                     wire=[h.nbytes for h in got["out"]])      # bytes of each object sent
        self.counters["wire_bytes"] += sum(reply["wire"])
        self.counters.update("sent_" + c for c in reply["codecs"])
        return reply

    async def lookup(self, keys, ns: bytes, token=None) -> dict:
        """How long a prefix of keys the network holds, without moving any KV."""
        return await self.reads.lookup(keys, ns, token)

    async def holds(self, keys, ns: bytes, token=None, tenant: str = None,
                    fingerprint: str = None) -> list:
        """Per key, whether the network holds it under ns (kdn/edge/reads.py: Reads.holds)."""
        return await self.reads.holds(keys, ns, token, claim=(tenant, fingerprint))

    async def peer_get(self, keys, token=None, region: str = None, drops=None) -> list:
        """What this edge holds of `keys` (None elsewhere); asked by other edges, never cascades.

        region: where the asker (and so its reader, who pulls the objects from this node)
        is; each chunk then goes in the lossless form that crosses that link soonest.
        drops: the drop-log state the asker applied; an edge that applied less answers
        nothing (its copies may predate a drop the asker applied) and catches up.
        """
        keys = check_keys(keys)
        out = await self.peer_held(keys, region, drops, token=token)
        if out is None:
            return [None] * len(keys)
        # kept as they arrived (a push, a store): this node's own first, so the asker maps a
        # reference instead of getting the bytes inside the answer (kdn/edge/arrivals.py)
        await self.arrivals.adopt([h for h in out if h is not None and h.arrived])
        return [None if h is None else h.wire() for h in out]

    async def peer_held(self, keys, region: str = None, drops=None, token=None):
        """peer_get's answer for either transport (Ray, or HTTP frames: kdn/edge/http.py): per
        key (checked by the caller) the Held to send in its form for the link to region, or
        None; None for all when this edge applied less of the drop log than drops (it catches
        up). Only with the admin token."""
        self.tokens.check_admin(token, "peer_get")
        if self.tiers.tombs.behind(drops):
            self.counters["peer_get_behind"] += 1
            self._catch_up()
            return None
        out = [self.tiers.get(k) for k in keys]
        on_disk = [i for i, h in enumerate(out) if h is None and self.tiers.on_disk(keys[i])]
        for i, h in zip(on_disk, await self.reads.read_disk([keys[i] for i in on_disk], None)):
            out[i] = h
        self.counters["peer_served"] += sum(h is not None for h in out)
        if region is not None and region != self.region:
            held = [h for h in out if h is not None]
            forms, n = await self.forms.link_forms(held, region, False, LOSSLESS,
                                                   budget_s=PEER_TIMEOUT_S / 3)
            if n < len(held):            # a copy found corrupt: not sent, and dropped here
                self.counters["peer_corrupt_skipped"] += 1
                await self.tiers.drop([held[n].key])
            forms = iter(forms[:n] + [None] * (len(held) - n))
            out = [None if h is None else next(forms) for h in out]
        return out

    # --- corruption ---------------------------------------------------------------------
    async def drop_corrupt(self, keys, ns: bytes, token=None) -> int:
        """A reader found these copies corrupt: drop them (they are fetched again elsewhere).

        The reader must be allowed to read ns, and its claim is checked: only a copy held
        under ns that really fails verification is dropped.
        """
        keys, ns = check_keys(keys), check_key(ns, "ns")
        await self.catalog.check_read(ns, token, "drop_corrupt")
        self.counters["corrupt_reported"] += len(keys)
        held = [h for h in (self.tiers.peek(k) for k in keys) if h is not None and h.ns == ns]
        objs = await asyncio.gather(*(h.resolve() for h in held))
        ok = await asyncio.to_thread(lambda: [self.forms.intact(o, reread=True) for o in objs])
        return await self.tiers.drop([h.key for h, good in zip(held, ok) if not good])

    async def inject_corruption(self, key, stale_checksum: bool = False, token=None) -> bool:
        """Tests only (edge option fault_injection=True): replace a held copy with a corrupt one;
        stale_checksum: it carries the checksum of the good bytes (Held.xxh), as a copy that
        went bad in the store after it was verified on arrival."""
        self.tokens.check_admin(token, "inject_corruption")
        if not self.fault_injection:
            raise AccessDenied("fault injection is disabled on this edge")
        for role in ROLES:
            held = self.tiers.tier(role).peek(key)
            if held is not None:
                obj = await held.resolve()
                bad = await asyncio.to_thread(lambda: Held.of(corrupted(obj)))
                if stale_checksum and obj.codec == "raw":
                    bad.xxh = obj.digest()
                self.tiers.tier(role).put(key, bad)
                return True
        return False

    # --- conversations (kdn/edge/conversations.py, kdn.core.conversation) ----------------------
    def _conversation(self, tenant, fingerprint, scope, token, what: str, ns=None) -> bytes:
        """The namespace of a conversation homed here, once the caller may read its tenant;
        BadRequest for a namespace that is not that claim's or a scope homed elsewhere."""
        want = conversation_namespace(tenant, fingerprint, scope)
        if ns is not None and check_key(ns, "ns") != want:
            raise BadRequest(f"{what}: ns is not the namespace of tenant {tenant!r:.64}, this "
                             "fingerprint and scope")
        if home_of(scope) != self.name:
            raise BadRequest(f"{what}: the conversation's home is edge {home_of(scope)!r:.64}, "
                             f"not {self.name!r}")
        self.tokens.check_read(tenant, token, what)
        return want

    async def put_conversation(self, chunks, tenant: str, fingerprint: str, scope: str,
                               retention: str = None, head=None, tail=None, token=None) -> int:
        """Keep a conversation's chunks (a worker computed them) for tenant, idle as long as
        retention asks within the tenant's bounds; how many are held now. Each is verified
        by its frame and must be of the conversation's namespace; one already held keeps its
        first bytes (and is renewed). head: the keys of the conversation's chunks before these
        (held here already), kept more recent than these (kdn/edge/conversations.py put_prefix).
        tail: the conversation's trailing partial chunk (a Chunk of fewer tokens, under
        kdn.core.conversation.tail_key), after the last of head and chunks: kept older than
        them (evicted first), listed by conversation_find, never sent to the origin; the tails
        kept after earlier chunks of head and chunks go (the chunks now hold their tokens)."""
        ns = self._conversation(tenant, fingerprint, scope, token, "put_conversation")
        if not isinstance(chunks, (list, tuple)) or len(chunks) > MAX_FETCH_KEYS:
            raise BadRequest(f"put_conversation takes a list of at most {MAX_FETCH_KEYS} chunks")
        bad = next((c for c in chunks if not isinstance(c, (Chunk, Encoded)) or c.ns != ns), None)
        if bad is not None:
            raise BadRequest("put_conversation takes Chunks and Encoded frames of the conversation's "
                             f"namespace, got {type(bad).__name__}"
                             + (" of another namespace" if isinstance(bad, (Chunk, Encoded)) else ""))
        retention_ttl(retention, self.conversations.ttl_of(tenant))    # BadRequest before anything
        head = [] if head is None else check_keys(head)
        keys = head + [c.key for c in chunks]
        if tail is not None:
            size = chunks[0].kv.shape[3] if chunks and isinstance(chunks[0], Chunk) else None
            if not (isinstance(tail, Chunk) and tail.ns == ns and keys and 0 < tail.kv.shape[3]
                    and (size is None or tail.kv.shape[3] < size)):
                raise BadRequest("put_conversation: a tail is a Chunk of the conversation's namespace, "
                                 "shorter than a chunk, after at least one chunk (head or chunks)")
        pinned = tenant in self.conversations.pinned
        deadline = time.monotonic() + PIN_STORE_BUDGET_S
        if pinned:     # what the origin holds of these keys first: a key keeps its first bytes
            await self._pull_pinned(tenant, ns, head + [c.key for c in chunks], deadline)
        new = [c for c in chunks if c.key not in self.conversations]
        stored = dict(zip((c.key for c in new), await self.forms.to_store(new)))
        items = [(c.key, stored.get(c.key)) for c in chunks]   # None: held already, renewed
        if tail is not None:       # first: the oldest of the conversation, evicted before its chunks
            kept = (await self.forms.to_store([tail]))[0]
            await asyncio.to_thread(self._put_tail, tenant, tail.key, kept, tail.kv.shape[3], keys, retention)
        held = await asyncio.to_thread(self.conversations.put_prefix, tenant, items, retention, head)
        if pinned:
            await self._pin(tenant, ns, head, [(c, stored[c.key]) for c in new], deadline)
            held = next((i for i, c in enumerate(chunks) if c.key not in self.conversations), len(chunks))
        return held

    def _put_tail(self, tenant: str, key, held, tokens: int, keys, retention) -> None:
        """Keep a conversation's tail (held: None when its frame failed) after keys[-1], and
        let go of its tails after earlier keys (a worker thread: the tier may write to disk)."""
        self.conversations.drop_tails_after(keys[:-1])
        if held is not None and self.conversations.put(tenant, key, held, retention, after=keys[-1],
                                                       tokens=tokens):
            self.counters["conversation_tails_kept"] += 1

    def _pin_failed(self, reason: str, tenant: str, n: int, e=None) -> None:
        self.counters[f"conversation_pin_{reason}"] += 1
        log.warning("edge %s: %d chunks of tenant %r's pinned conversation did not reach the origin "
                    "(%s)%s", self.name, n, tenant, reason, f": {e}" if e else "")

    async def _pin(self, tenant: str, ns: bytes, head, new, deadline: float) -> None:
        """Send the origin a pinned tenant's chunks it lacks (kdn/origin/conversations.py): the
        conversation's from head on, as held here (new: the chunks this store kept, sent as
        given; a conversation pinned midway sends its start too), before the worker's store is
        answered. A key the origin holds under other bytes (this edge had lost its copy when a
        worker recomputed it, and the pull did not answer in time) is replaced here by the
        origin's, the key's first. An origin that does not answer by the deadline, refuses (the
        tenant unpinned meanwhile) or fails to store is counted; the chunks stay here."""
        keys = list(head) + [c.key for c, _ in new]
        send = await asyncio.to_thread(self._unpinned_objects, ns, keys, {c.key: (c, h) for c, h in new})
        batches, size = [[]], 0
        for c in send:                     # by bytes: the origin takes at most 2 GiB per call
            if batches[-1] and size + c.nbytes > PIN_BATCH_BYTES:
                batches.append([])
                size = 0
            batches[-1].append(c)
            size += c.nbytes
        differ = []
        for batch in (b for b in batches if b):
            left = deadline - time.monotonic()
            if left <= 0:
                return self._pin_failed("failures", tenant, len(batch), "no time left")
            try:
                got = await self.peers.origin(left).put_conversation(tenant, ns, batch)
            except BadRequest as e:
                return self._pin_failed("refused", tenant, len(batch), e)
            except StoreError as e:
                return self._pin_failed("store_errors", tenant, len(batch), e)
            if got is None:
                return self._pin_failed("failures", tenant, len(batch))
            self.conversations.mark_at_origin([c.key for c in batch])
            self.counters["conversation_pinned_chunks"] += len(batch)
            differ += got.get("differ", [])
        if differ:        # the origin's bytes are the keys' first: this edge takes them
            self.counters["conversation_pin_replaced"] += len(differ)
            log.warning("edge %s: %d chunks of tenant %r's pinned conversation differ from the "
                        "origin's: taking the origin's", self.name, len(differ), tenant)
            first = keys.index(differ[0]) if differ[0] in keys else 0
            await asyncio.to_thread(self.conversations.drop, keys[first:])
            await self._pull_pinned(tenant, ns, keys, deadline)

    def _unpinned_objects(self, ns: bytes, keys, given: dict) -> list:
        """The chunks of keys held here that the origin lacks: as given (the chunks this store
        kept, so the very bytes held), else read from the tier (a worker thread: a chunk may
        be on disk). given: key -> (chunk, the Held this store kept of it)."""
        out = []
        for k in self.conversations.not_at_origin(keys):
            chunk, held = given.get(k, (None, None))
            if held is not None and self.conversations.peek(k) is held:
                out.append(chunk)
                continue
            held = self.conversations.get(k, ns)
            if held is not None:
                out.append(held_object(held))
        return out

    async def _pull_pinned(self, tenant: str, ns: bytes, keys, deadline: float) -> None:
        """A pinned tenant's conversation chunks this tier no longer holds (evicted, expired, or
        lost with a restart), read back from the origin into it: the held prefix of keys then
        reaches as far as the origin's, or as it was if the origin has not answered by the
        deadline (a monotonic time). A pull the deadline cut short goes on in the background
        (up to PIN_PULL_TIMEOUT_S; counted as conversation_pull_late) and lands for the next
        turn: under load one lookup's wait is shorter than the read, and every later lookup
        would start it over and give up the same way. One pull at a time from a conversation's
        first chunk not held: a caller naming more keys meanwhile waits for that one."""
        if tenant not in self.conversations.pinned:
            return
        held = next((i for i, k in enumerate(keys) if k not in self.conversations), len(keys))
        left = deadline - time.monotonic()
        if held == len(keys) or left <= 0:
            return
        flight = (tenant, ns, keys[held])
        task = self._pin_pulls.get(flight)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._pull_back(tenant, ns, keys, held))
            self._pin_pulls[flight] = task
            task.add_done_callback(lambda t: self._pulled_back(flight, t))
        try:
            await asyncio.wait_for(asyncio.shield(task), left)
        except asyncio.TimeoutError:
            self.counters["conversation_pull_late"] += 1

    def _pulled_back(self, flight, task) -> None:
        """A pull-back ended: no longer in flight; a failure nobody waited for is logged."""
        self._pin_pulls.pop(flight, None)
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.counters["conversation_pull_failures"] += 1
            log.error("edge %s: a pull-back of tenant %r's pinned conversation failed: %s: %s",
                      self.name, flight[0], type(e).__name__, e, exc_info=e)

    async def _pull_back(self, tenant: str, ns: bytes, keys, held: int) -> None:
        """The origin's chunks of keys[held:] put in the conversation tier (_pull_pinned), unless
        the tenant was unpinned, or pinned anew (its epoch moved on: the origin's copies were
        deleted), while they were on their way."""
        epoch = self.conversations.epoch_of(tenant)
        try:
            got = await self.peers.origin(PIN_PULL_TIMEOUT_S).conversation_chunks(tenant, ns, keys[held:])
        except StoreError as e:
            self.counters["conversation_pull_store_errors"] += 1
            log.warning("edge %s: the origin could not read tenant %r's pinned conversation: %s",
                        self.name, tenant, e)
            got = None
        got = got or []
        n = next((i for i, (c, k) in enumerate(zip(got, keys[held:]))
                  if c is None or c.key != k or c.ns != ns), len(got))
        if not n:
            return
        stored = await self.forms.to_store(got[:n])
        n = next((i for i, h in enumerate(stored) if h is None), n)
        if tenant not in self.conversations.pinned or self.conversations.epoch_of(tenant) != epoch:
            return
        items = list(zip(keys[held:held + n], stored[:n]))
        await asyncio.to_thread(self.conversations.put_prefix, tenant, items, None, keys[:held])
        # at the origin: the copies this pull put, not a worker's kept meanwhile (a key keeps its
        # first bytes here too), which a later store sends and the origin answers with "differ"
        self.conversations.mark_at_origin([k for k, h in items if self.conversations.peek(k) is h])
        self.counters["conversation_pulled_chunks"] += n

    async def conversation_lookup(self, keys, ns: bytes, tenant: str, fingerprint: str, scope: str,
                                  token=None) -> int:
        """How long a prefix of keys this edge holds of a conversation homed here (no KV moves)."""
        ns = self._conversation(tenant, fingerprint, scope, token, "conversation_lookup", ns)
        keys = check_keys(keys)
        await self._pull_pinned(tenant, ns, keys, time.monotonic() + PIN_LOOKUP_TIMEOUT_S)
        return next((i for i, k in enumerate(keys) if k not in self.conversations), len(keys))

    async def conversation_find(self, keys, ns: bytes, tenant: str, fingerprint: str, scope: str,
                                token=None) -> dict:
        """conversation_lookup, and the tails held after the last chunk held:
        {"held": chunks, "tails": [[tokens, tail key], ...] longest first}. The reader takes
        the longest tail whose key its own prompt's tokens give (kdn.core.conversation.tail_key)."""
        held = await self.conversation_lookup(keys, ns, tenant, fingerprint, scope, token=token)
        tails = self.conversations.tails_after(keys[held - 1]) if held else []
        return {"held": held, "tails": [[n, k] for n, k in tails]}

    async def conversation_fetch(self, keys, ns: bytes, tenant: str, fingerprint: str, scope: str,
                                 token=None) -> dict:
        """{"refs", "bytes"}: the held prefix of a conversation's keys, as object references
        (zero-copy beside this edge), each read renewing its idle TTL."""
        helds = await self.conversation_prefix(keys, ns, tenant, fingerprint, scope, token)
        return {"refs": [h.ref if h.ref is not None else h.obj for h in helds],
                "bytes": sum(h.nbytes for h in helds)}

    async def conversation_prefix(self, keys, ns: bytes, tenant: str, fingerprint: str, scope: str,
                                  token=None) -> list:
        """conversation_fetch's answer for either transport (Ray; HTTP frames, POST
        /v1/conversation: kdn/edge/http.py): the Held of the held prefix of keys, checked
        as conversation_fetch checks them."""
        ns = self._conversation(tenant, fingerprint, scope, token, "conversation_fetch", ns)
        keys = check_keys(keys)     # the pull: half of what the worker waits for this fetch
        await self._pull_pinned(tenant, ns, keys, time.monotonic() + fetch_deadline_s(len(keys)) / 2)
        helds = await asyncio.to_thread(self.conversations.get_prefix, keys, ns)
        self.counters["conversation_fetches"] += 1
        self.counters["conversation_chunks_served"] += len(helds)
        return helds

    async def conversations_of(self, tenant: str, token=None) -> dict:
        """A tenant's conversations here and its settings (its read token or the admin's)."""
        self.tokens.check_read(tenant, token, "listing conversations")
        return {"edge": self.name, "region": self.region, "policy": self.conversations.policy_of(tenant),
                "conversations": self.conversations.listing(tenant)}

    async def drop_conversations(self, tenant: str, token=None) -> int:
        """Drop every conversation chunk of tenant here (an operator's call); how many."""
        self.tokens.check_admin(token, "drop_conversations")
        return await asyncio.to_thread(self.conversations.drop_tenant, tenant)

    async def set_conversation_policy(self, tenant: str, ttl_s=None, budget_bytes=None, max_ttl_s=None,
                                      pinned=None, token=None) -> dict:
        """A tenant's idle TTL, longest TTL a request may ask for and byte budget here; pinned:
        whether the origin keeps its conversations (the origin decides: kdn.client.operator
        tells it first; this only spares the wait for its next ping)."""
        self.tokens.check_admin(token, "set_conversation_policy")
        if pinned is not None:
            if not isinstance(pinned, bool):
                raise BadRequest(f"pinned must be True or False, got {pinned!r:.40}")
            was = self.conversations.pinned
            self.conversations.set_pinned(was | {tenant} if pinned else was - {tenant})
        return {"edge": self.name, "region": self.region,
                **await asyncio.to_thread(self.conversations.set_policy, tenant, ttl_s, budget_bytes,
                                          max_ttl_s)}

    # --- stats --------------------------------------------------------------------------
    def all_counters(self, token=None) -> collections.Counter:
        """Every component's counters in one (their names do not overlap)."""
        out = collections.Counter(self.counters)
        for part in (self.members, self.tiers, self.forms, self.pull, self.pull.loads,
                     self.reads, self.catalog, self.peers, self.replay, self.stores, self.arrivals, self.pulls):
            out.update(part.counters)
        out.update(self.conversations.snapshot())     # (updated from worker threads)
        out.update(self.tiers.tombs.counters)         # drops_refused_stale (kdn/edge/tombstones.py)
        if self.tiers.disk is not None:
            out.update(self.tiers.disk.snapshot())
        if self.events is not None:
            out.update(self.events.snapshot())
        return out

    async def stats(self, token=None) -> dict:
        t = self.tiers.stats()
        return {"role": "edge", "name": self.name, "region": self.region, "pid": os.getpid(),
                "store_codec": self.store_codec, "node_id": self.node_id,
                "main": t["main"], "hot": t["hot"], "disk": t["disk"],
                "held_raw_bytes": t["held_raw_bytes"],
                "hot_copies": t["hot_copies"], "ring_version": self.members.version,
                "members": len(self.members.ring), "counters": dict(self.all_counters()),
                "uptime_s": time.time() - self.started, "http": self.http_address(),
                "demand": self.demand.stats(), "loads": self.pull.loads.stats(),
                "catalog": self.catalog.stats(), "background_failure": self.background_failure,
                "conversations": self.conversations.stats(), "stores": self.stores.stats(),
                "object_store_fill": None if self.prefault is None else self.prefault.stats(),
                "links": self.peers.links.stats(), "data_plane": self.pulls.stats(),
                "kv_events": None if self.events is None else self.events.options,
                "drops": t["drops"],          # where this edge is in the origin's drop log
                "limits": {"max_fetch_keys": MAX_FETCH_KEYS,
                           "max_reply_bytes": self.reads.max_reply_bytes}}


def _conversation_disk(disk, name: str, policy: str) -> DiskTier:
    """The conversation tier's own disk beside the KB disk tier: CONVERSATION_SHARE of its
    bytes, in <its root>/<name>.conversations, emptied first (see the constructor)."""
    import shutil
    path = os.path.join(os.path.dirname(disk.dir), name + ".conversations")
    shutil.rmtree(path, ignore_errors=True)
    return DiskTier(path, max(1, int(disk.capacity * CONVERSATION_SHARE)), policy)


def _default_disk_dir(network: str) -> str:
    """Where edges keep their disk tiers unless told: $KDN_HOME/edge-disk/<network>."""
    from kdn.core.env import kdn_home
    return str(kdn_home() / "edge-disk" / network)
