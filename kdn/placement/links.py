"""Links measured, not declared: what an edge (or a client's view) saw of the nodes it talks to.

The topology declares each link's latency and bandwidth; on real hosts the declared figures
are a guess. An edge measures its own links from its own traffic, per node it talks to (a
peer edge by name, or the origin), and a client's view its own to each edge:

- round trip: the shortest of its last ROUND_TRIPS calls' times (a call's time is the link's
  round trip plus the callee's work; the least of several is the nearest to the link's own,
  as TCP estimates its minimum RTT);
- throughput: an exponentially weighted mean (weight ALPHA) of bytes / seconds of its
  transfers of at least MIN_TRANSFER_BYTES (smaller ones measure the round trip, not the pipe).

`transfer_s(node, nbytes)` is what ranking uses: half a round trip plus the bytes over the
throughput, once both are measured; None before, and the topology's declared figures stand
in. An edge ranks the owners it pulls from by it (kdn/edge/membership.py `sources`), and
`kdn status` prints what each edge measured (`links`). A client's view ranks the edges it
reads from with `rank_by_region` (kdn/client/view.py): by region, the declared time or, where
longer, the least measured time of a region's edges, each measurement trusted for `max_age_s`
after its last transfer, so a link that measured slow once is tried again later instead of
shunned for good.
"""
import collections
import time

ROUND_TRIPS = 16
ALPHA = 0.3
MIN_TRANSFER_BYTES = 256 << 10
RANK_BYTES = 1 << 20      # sources are ranked by the time this takes from each: about a chunk


class Links:
    def __init__(self):
        self._calls = collections.defaultdict(lambda: collections.deque(maxlen=ROUND_TRIPS))
        self._rate = {}                   # node -> bytes per second (EWMA)
        self._moved = collections.Counter()
        self._transfers = collections.Counter()
        self._when = {}                   # node -> time.monotonic() of its last transfer

    def call(self, node: str, seconds: float) -> None:
        """A call to node took seconds (request and answer)."""
        if seconds >= 0:
            self._calls[node].append(seconds)

    def transfer(self, node: str, nbytes: int, seconds: float) -> None:
        """nbytes came from node in seconds."""
        if nbytes < MIN_TRANSFER_BYTES or seconds <= 0:
            return
        rate = nbytes / seconds
        old = self._rate.get(node)
        self._rate[node] = rate if old is None else ALPHA * rate + (1 - ALPHA) * old
        self._when[node] = time.monotonic()      # (before the count: a reader in another thread)
        self._moved[node] += nbytes
        self._transfers[node] += 1

    def round_trip_s(self, node: str):
        calls = self._calls.get(node)
        return min(calls) if calls else None

    def gbps(self, node: str):
        rate = self._rate.get(node)
        return None if rate is None else rate / 1e9

    def transfer_s(self, node: str, nbytes: int, max_age_s: float = None, min_transfers: int = 1):
        """Seconds to move nbytes from node by what was measured; None until both its round
        trip and its throughput (over min_transfers transfers at least) were, or when its last
        transfer is older than max_age_s."""
        rtt, rate = self.round_trip_s(node), self._rate.get(node)
        if rtt is None or rate is None or self._transfers[node] < min_transfers:
            return None
        if max_age_s is not None and time.monotonic() - self._when[node] > max_age_s:
            return None
        return rtt / 2 + nbytes / rate

    def stats(self) -> dict:
        nodes = sorted(set(self._calls) | set(self._rate), key=str)
        return {str(n): {"round_trip_ms": None if self.round_trip_s(n) is None else self.round_trip_s(n) * 1e3,
                         "gbps": self.gbps(n), "calls": len(self._calls.get(n, ())),
                         "transfers": self._transfers[n], "bytes": self._moved[n]} for n in nodes}


def rank_by_region(topology, reader_region: str, candidates, links=None, nbytes: int = RANK_BYTES,
                   max_age_s: float = None, min_transfers: int = 1) -> list:
    """Candidate names, from (name, region) pairs, nearest region first. A region's time is the
    topology's declared transfer time from it to reader_region, or the least `links.transfer_s`
    of its candidates measured within max_age_s where that is longer: a measurement makes a
    region farther than declared (a capped or congested link), never nearer. A call's time
    includes the callee's work (an edge pulling a chunk through first), so measured times of two
    regions are no fair race: on one machine, where every region is as near as another, a
    remote edge that answered from memory once would take the readers of a local edge that
    pulled. An edge counts once min_transfers of its transfers were measured (a first one may
    carry a connection's set-up). Equal times, and the candidates of one region, keep the given
    order (a ring's preference): one edge measured beside an unmeasured one of its own region
    never sends readers from it to the other and back."""
    candidates = list(candidates)
    measured = {}
    for name, region in candidates:
        t = None if links is None else links.transfer_s(name, nbytes, max_age_s, min_transfers)
        if t is not None:
            measured[region] = min(t, measured.get(region, t))
    timed = {r: max(topology.transfer_time(r, reader_region, nbytes), measured.get(r, 0.0))
             for r in {region for _, region in candidates}}
    return [name for _, _, name in sorted((timed[region], i, name) for i, (name, region) in enumerate(candidates))]
