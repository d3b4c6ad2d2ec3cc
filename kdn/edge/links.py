"""Links measured, not declared: what an edge saw of the nodes it talks to.

The topology declares each link's latency and bandwidth; on real hosts the declared figures
are a guess. An edge measures its own links from its own traffic, per node it talks to (a
peer edge by name, or the origin):

- round trip: the shortest of its last ROUND_TRIPS calls' times (a call's time is the link's
  round trip plus the callee's work; the least of several is the nearest to the link's own,
  as TCP estimates its minimum RTT);
- throughput: an exponentially weighted mean (weight ALPHA) of bytes / seconds of its
  transfers of at least MIN_TRANSFER_BYTES (smaller ones measure the round trip, not the pipe).

`transfer_s(node, nbytes)` is what ranking uses (kdn/edge/membership.py `sources`): half a
round trip plus the bytes over the throughput, once both are measured; None before, and
the topology's declared figures stand in. `kdn status` prints them (`links`).
"""
import collections

ROUND_TRIPS = 16
ALPHA = 0.3
MIN_TRANSFER_BYTES = 256 << 10


class Links:
    def __init__(self):
        self._calls = collections.defaultdict(lambda: collections.deque(maxlen=ROUND_TRIPS))
        self._rate = {}                   # node -> bytes per second (EWMA)
        self._moved = collections.Counter()
        self._transfers = collections.Counter()

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
        self._moved[node] += nbytes
        self._transfers[node] += 1

    def round_trip_s(self, node: str):
        calls = self._calls.get(node)
        return min(calls) if calls else None

    def gbps(self, node: str):
        rate = self._rate.get(node)
        return None if rate is None else rate / 1e9

    def transfer_s(self, node: str, nbytes: int):
        """Seconds to move nbytes from node by what was measured; None until both its round
        trip and its throughput were."""
        rtt, rate = self.round_trip_s(node), self._rate.get(node)
        if rtt is None or rate is None:
            return None
        return rtt / 2 + nbytes / rate

    def stats(self) -> dict:
        nodes = sorted(set(self._calls) | set(self._rate), key=str)
        return {str(n): {"round_trip_ms": None if self.round_trip_s(n) is None else self.round_trip_s(n) * 1e3,
                         "gbps": self.gbps(n), "calls": len(self._calls.get(n, ())),
                         "transfers": self._transfers[n], "bytes": self._moved[n]} for n in nodes}
