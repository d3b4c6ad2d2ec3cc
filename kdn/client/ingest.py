"""A client's bulk writes to the origin: over its HTTP server from another Ray node, over Ray
from its own.

A publisher's chunks (put_chunks) and a cache layer's objects acknowledged at the origin
(put_objects, kdn.integrations.objects) are the bytes a client sends the origin. From a
process on another Ray node (another host) Ray's object manager carries them at about a third
of what one TCP connection does (`kdn bench transport --hosts`), so they go as raw frames to
the origin's own HTTP server (POST /v1/chunks, /v1/objects: kdn/origin/http.py, with the
admin token), which verifies every frame and stores them as the call over Ray would: the
answer is that call's, once they are durable. From the origin's node Ray carries them,
zero-copy.

mode (the view's `data_plane`): kdn.core.dataplane's. The origin's address (its URL, Ray node
and node address: OriginAPI.data_address) is asked once and kept; an origin without an HTTP
server (started without http_host) is asked again after a while. A write that gets no answer
over HTTP (refused, reset, silent past the timeout) is sent again over Ray (the origin
deduplicates what it stored already), and so do the writes after it for ADDRESS_RETRY_S,
when the address is asked again; a refusal (a bad token, bad input) raises as over Ray. A
write larger than the server takes at once (its data address says how much) goes over Ray.

Counters (stats()): http_writes, http_frames, http_bytes, http_us (from the request to the
answer), http_failures (writes sent again over Ray); ray_writes, ray_bytes, ray_us (likewise).
"""
import collections
import time

from kdn.core.dataplane import ADDRESS_RETRY_S, Addresses
from kdn.core.rpc import Unreachable

ORIGIN = "origin"               # the origin's entry in the address book
FRAME_BYTES = 512               # a frame's header, at most, beside its payload


class OriginWrites:
    """`put(what, chunks, timeout_s)`: what "chunks" (put_chunks) or "objects" (put_objects),
    over the origin's HTTP server where this process is on another Ray node, else over Ray;
    the origin's answer."""

    def __init__(self, view, mode: str, node_id, node_ip, token=None):
        """token: the admin token the writes carry (None: the view's)."""
        self.view, self.token = view, token
        self.addresses = Addresses(mode, node_id, node_ip)
        self.counters = collections.Counter()
        self._ray_until = 0.0        # after a write the server did not answer: Ray until then
        self._most = 0               # the most one write over HTTP carries (the origin says)

    def put(self, what: str, chunks, timeout_s: float) -> dict:
        url = self._url(timeout_s)
        if url is not None and chunks and sum(c.nbytes for c in chunks) + FRAME_BYTES * len(chunks) <= self._most:
            t0 = time.perf_counter()
            try:
                got = self._http(url, what, chunks, timeout_s)
            except Unreachable:
                self._ray_until = time.monotonic() + ADDRESS_RETRY_S
                self.addresses.forget(ORIGIN)
                self.counters["http_failures"] += 1
            else:
                self.counters["http_writes"] += 1
                self.counters["http_frames"] += len(chunks)
                self.counters["http_bytes"] += sum(c.nbytes for c in chunks)
                self.counters["http_us"] += int((time.perf_counter() - t0) * 1e6)
                return got
        kw = {} if self.token is None else {"token": self.token}     # else the view's admin token
        t0 = time.perf_counter()
        got = getattr(self.view.origin(timeout_s), f"put_{what}")(chunks, **kw)
        self.counters["ray_writes"] += 1
        self.counters["ray_bytes"] += sum(c.nbytes for c in chunks)
        self.counters["ray_us"] += int((time.perf_counter() - t0) * 1e6)
        return got

    def _url(self, timeout_s: float):
        """The origin's URL when this process writes over HTTP, else None (Ray)."""
        if self.addresses.mode == "ray" or time.monotonic() < self._ray_until:
            return None
        if self.addresses.stale(ORIGIN):
            try:
                got = self.view.origin(min(timeout_s, 10.0)).data_address()
            except Unreachable:             # the write over Ray says so in turn
                return None
            self.addresses.note(ORIGIN, got)
            self._most = int(got.get("max_write_bytes") or 0)
        return self.addresses.url(ORIGIN)

    def _http(self, url: str, what: str, chunks, timeout_s: float) -> dict:
        """The write on a keep-alive connection of the view's pool (kdn.client.dataplane)."""
        return self.view.plane.on_connection(url, timeout_s, self.token or self.view.admin_token,
                                             lambda client: client.put_frames(what, chunks))

    def stats(self) -> dict:
        return {"mode": self.addresses.mode, **self.counters}
