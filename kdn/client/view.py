"""A client process's view of one KDN network: who the members are, and how to reach them.

The view reads the membership and topology once (from the origin, else from any edge that
answers) and from then on routes every call itself. A read goes to the nearest live edge
from the client's region: nearest by the topology's declared links, or by what this view
measured of an edge where that is slower (its calls' round trips and the throughput of its
fetches over the edge's HTTP frames, once LINK_MIN_FETCHES were; kdn/placement/links.py
`rank_by_region`, each measurement trusted for LINK_FRESH_S); a call that fails over
(kdn.core.rpc.Unreachable: the edge died, is restarting, is missing or too slow) moves to
the next edge at once, so a dead edge costs one timeout, never Ray's ~15 s node-death
detection, and is tried last for SUSPECT_S. An origin call is retried until its deadline
while the origin restarts (Ray brings it back from disk; every origin method is idempotent).
Any other error raises: a KDNError the remote raised on purpose as itself, anything else as
the bug it is. Bulk bytes to or from an edge on another node (a fetch, a cache layer's
put_objects) take that edge's HTTP frames where the data plane says so (kdn.client.dataplane),
inside the same failover.
"""
import functools
import time

from kdn.client.dataplane import ReaderPlane
from kdn.client.ingest import OriginWrites
from kdn.core.codecs import LOSSLESS
from kdn.core.errors import BadRequest, NetworkError, NoLiveEdge
from kdn.core.names import NAMESPACE, ORIGIN_NODE, edge_actor_name
from kdn.placement.links import Links, rank_by_region
from kdn.placement.ring import Edge, Ring
from kdn.placement.topology import Topology
from kdn.core.interfaces import EdgeAPI, OriginAPI
from kdn.core.rpc import Actors, Stub, Unreachable

CALL_TIMEOUT_S = 5.0          # a control call
SUSPECT_S = 10.0              # a failed edge is tried last for this long
RETRY_PAUSE_S = 0.2           # between tries of a restarting origin
EDGE_MEMBERSHIP_TIMEOUT_S = 2.0
LINK_FRESH_S = 60.0           # a link's measurement ranks edges this long after its last fetch
RECHECK_S = 5.0               # a view re-reads membership for a region it holds no edge of at most this often
RECHECK_TIMEOUT_S = 1.0       # and gives the origin this long to answer
LINK_MIN_FETCHES = 2          # fetches over an edge's HTTP frames measured before they rank it


def node_region() -> "str | None":
    """The `region` label of the Ray node this process runs on (None when unlabelled)."""
    import ray
    labels = ray.get_runtime_context().get_node_labels() or {}
    return labels.get("region")


def node_id() -> str:
    """The Ray node this process runs on (an edge sends raw, zero-copy, to its own node)."""
    import ray
    return ray.get_runtime_context().get_node_id()


class NetworkView:
    """Membership, topology and ring of network `network` seen from `region`, and calls
    routed by them.

    region: where this process is (default its Ray node's `region` label, else the origin's
    region). admin_token: what origin calls carry (publishing and operator controls); an
    edge call carries the token its caller names (a tenant's read token for reads).
    """

    def __init__(self, network: str, region: str = None, admin_token: str = None,
                 data_plane: str = "auto"):
        self.network = network
        self.admin_token = admin_token
        self.actors = Actors(network)
        self._suspect = {}           # edge -> monotonic time until which it is tried last
        self.links = Links()         # what this view measured of the edges it called
        self.membership = self.topology = self.ring = None
        self.refresh()
        self.node_id = node_id()
        import ray
        self.plane = ReaderPlane(data_plane, self.node_id, ray.util.get_node_ip_address(),
                                 self._data_address)
        self._writes = {}            # token -> OriginWrites
        self.region = region or node_region() or self.topology.origin_region
        if self.region not in self.topology.regions:
            raise BadRequest(f"region {self.region!r} is not in the network's topology "
                             f"(regions: {', '.join(self.topology.regions)})")

    # --- membership ----------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read membership and topology (from the origin, else the newest an edge has)."""
        self._read_at = time.monotonic()
        try:
            m = self.origin().membership()
        except Unreachable:
            m = self._membership_from_edges()
        self._take(m)

    def _take(self, m: dict) -> None:
        self.membership = m
        self.topology = Topology.from_dict(m["topology"])
        self.ring = Ring([Edge(*e) for e in m["members"]])

    def _membership_from_edges(self) -> dict:
        """The newest membership any live edge holds (the origin is down or restarting)."""
        import ray
        prefix = edge_actor_name(self.network, "")
        names = [a["name"][len(prefix):] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and a["name"].startswith(prefix)]
        best = None
        for name in names:
            try:
                got = self.actors.edge(name, EDGE_MEMBERSHIP_TIMEOUT_S, "sync").membership()
            except Unreachable:
                continue                 # dead or restarting edge: ask the next
            if best is None or got["version"] > best["version"]:
                best = got
        if best is None:
            raise NetworkError(f"network {self.network!r}: neither the origin nor any edge answers")
        return best

    def follow(self, ring_version: int) -> None:
        """An edge answered with a newer ring than ours: re-read membership (best effort:
        the answer in hand stays good if nobody answers now)."""
        if ring_version > self.membership.get("version", 0):
            try:
                self.refresh()
            except NetworkError:
                pass

    def recheck(self) -> bool:
        """Re-read membership unless this view read it within RECHECK_S; True when that gave a
        newer one. For a caller that found no edge where its region should have one: an edge
        the origin's health watch dropped comes back under a newer version, and a caller that
        then calls no edge (so follow() never runs) would not learn it otherwise. Best effort,
        as follow(), and bounded: the origin gets RECHECK_TIMEOUT_S, and while it is down the
        caller goes on with the ring in hand (at most one such wait every RECHECK_S)."""
        if time.monotonic() - self._read_at < RECHECK_S:
            return False
        self._read_at = time.monotonic()
        try:            # the origin only, briefly: this runs in a request's path
            m = self.origin(RECHECK_TIMEOUT_S).membership()
        except Unreachable:
            return False
        if m["version"] <= self.membership.get("version", 0):
            return False
        self._take(m)
        return True

    # --- calls: stubs of kdn.core.interfaces ---------------------------------------------
    def writes(self, token: str = None) -> OriginWrites:
        """This process's bulk writes to the origin carrying token (None: the admin token): over
        its HTTP server from another node, over Ray from its own (kdn/client/ingest.py)."""
        got = self._writes.get(token)
        if got is None:
            got = self._writes[token] = OriginWrites(self, self.plane.mode, self.node_id,
                                                     self.plane.addresses.node_ip, token)
        return got

    def origin(self, timeout: float = CALL_TIMEOUT_S) -> OriginAPI:
        """The origin's interface, with the admin token; each call answers the origin's reply.
        While the origin is unreachable (it restarts from disk) a call is retried until
        `timeout`; then Unreachable."""
        return Stub(OriginAPI, functools.partial(self._origin_call, timeout), "the origin")

    def _origin_call(self, timeout, method, args, kw):
        kw.setdefault("token", self.admin_token)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self.actors.call_sync(ORIGIN_NODE, method, *args, timeout=max(0.1, left), **kw)
            except Unreachable as e:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise Unreachable(f"the origin of network {self.network!r} did not answer "
                                      f"{method} within {timeout:.0f} s ({e})") from None
            time.sleep(RETRY_PAUSE_S)

    def ranked_edges(self) -> list:
        """Edge names nearest first from this process's region (measured links where fresh,
        declared ones otherwise); recently failed ones last."""
        now = time.monotonic()
        cands = [(e.name, e.region) for e in self.ring.edges]
        ranked = rank_by_region(self.topology, self.region, cands, self.links, max_age_s=LINK_FRESH_S,
                                min_transfers=LINK_MIN_FETCHES)
        return sorted(ranked, key=lambda n: self._suspect.get(n, 0) > now)

    def nearest(self, timeout: float = CALL_TIMEOUT_S, resolve_refs: bool = False) -> EdgeAPI:
        """The edges' interface, each call answered by the nearest live edge that answers:
        (reply, edge, [edges that failed]); NoLiveEdge when none does.

        With resolve_refs, the reply's object references ("refs") are fetched into
        reply["chunks"] inside the same failover: an edge that dies between answering and
        the transfer costs a retry on the next edge.
        """
        return Stub(EdgeAPI, functools.partial(self._nearest_call, timeout, resolve_refs),
                    "the nearest edge")

    def _nearest_call(self, timeout, resolve_refs, method, args, kw) -> tuple:
        failed = []
        for edge in self.ranked_edges():
            t0 = time.monotonic()
            try:
                if method == "fetch" and resolve_refs:
                    reply = self._fetch_over_http(edge, timeout, *args, **kw)
                    if reply is not None:
                        return self._measured(edge, t0, reply), edge, failed
                if method == "put_objects":
                    reply = self._put_over_http(edge, timeout, *args, **kw)
                    if reply is not None:
                        return self._measured(edge, t0, reply), edge, failed
                reply = self.actors.call_sync(edge, method, *args, timeout=timeout, **dict(kw))
                if resolve_refs:
                    left = max(0.5, timeout - (time.monotonic() - t0))
                    refs = reply.pop("refs")
                    reply["chunks"] = self.actors.get_sync(edge, refs, timeout=left) if refs else []
                return self._measured(edge, t0, reply), edge, failed
            except Unreachable:
                failed.append(edge)
                self._suspect[edge] = time.monotonic() + SUSPECT_S
        raise NoLiveEdge(f"no edge of network {self.network!r} answered {method} "
                         f"(tried {', '.join(failed) or 'none'})")

    def _measured(self, edge: str, t0: float, reply):
        """Note the call's time in `links`, and a fetch's bytes over HTTP ("wire") over the
        time they took to move ("move_s": the body, after the edge answered, so an edge that
        first pulled them from a slow source is not taken for a slow link); the reply. A reply
        over Ray is no measure of a link: Ray's object manager, zero-copy on the same node."""
        moved = reply.get("move_s", 0.0) if isinstance(reply, dict) else 0.0
        self.links.call(edge, time.monotonic() - t0 - moved)      # to the answer's headers
        if moved and reply.get("wire"):
            self.links.transfer(edge, sum(reply["wire"]), moved)
        return reply

    def _fetch_over_http(self, edge, timeout, keys, ns, region=None, resolve=False, token=None,
                         node=None, accept=None, tenant=None, fingerprint=None):
        """edge's fetch reply over its HTTP frames when the data plane says so
        (kdn.client.dataplane), else None (Ray carries it)."""
        accept = LOSSLESS if accept is None else accept
        url = self.plane.url_of(edge, accept)
        if url is None:
            return None
        try:
            return self.plane.fetch(url, timeout, token, keys, ns, region, accept, tenant, fingerprint)
        except Unreachable:
            self.plane.forget(edge)
            raise

    def _put_over_http(self, edge, timeout, chunks, token=None):
        """edge's put_objects answer over its HTTP server (POST /v1/objects, raw frames) when
        the data plane says so (an edge on another node), else None (Ray carries it, as it
        does a write larger than one body takes: kdn.core.serving.MAX_INGEST_BYTES)."""
        from kdn.client.ingest import FRAME_BYTES
        from kdn.core.serving import MAX_INGEST_BYTES
        if not chunks or sum(c.nbytes + FRAME_BYTES for c in chunks) > MAX_INGEST_BYTES:
            return None
        url = self.plane.url_of(edge, LOSSLESS)
        if url is None:
            return None
        try:
            return self.plane.put_objects(url, timeout, token, chunks)
        except Unreachable:
            self.plane.forget(edge)
            raise

    def _data_address(self, edge: str):
        """edge's data_address, or None when it does not answer now."""
        try:
            return self.actors.edge(edge, CALL_TIMEOUT_S, "sync").data_address()
        except Unreachable:
            return None

    def at(self, edge: str, timeout: float = CALL_TIMEOUT_S) -> EdgeAPI:
        """One named edge's interface (a call raises Unreachable if it gets no answer)."""
        return self.actors.edge(edge, timeout, "sync")
