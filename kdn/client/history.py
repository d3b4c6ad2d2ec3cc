"""Conversation KV from a worker's side: find a prompt's cached history, and keep a new turn's.

A worker that answered a turn keeps the KV it computed (kdn.core.conversation): the whole
chunks after the knowledge base's whole chunks, keyed in the conversation's namespace, at
the conversation's home edge in the worker's region (rendezvous hashing on the
conversation's first key among the region's edges). The next turn, wherever it lands:
- `find` asks each region's home edge for the longest held prefix of the prompt's keys,
  the worker's own region first, then the regions it is told the conversation was in, then
  the others nearest first (declared latency, or its lookups' measured round trips where
  those are longer), with a lookup (no KV moves) and stops at the first that holds
  any of it;
- `worth_fetching` weighs fetching those chunks over the link against recomputing them
  (the worker's measured prefill rate; the link to that region as this History measured it,
  its lookups' round trips and its fetches' throughput, each an EWMA, or the topology's
  declared latency and bandwidth until it has measured one: `links()`);
- `fetch` brings the held prefix from that edge, every chunk's frame verified and its key
  and namespace the ones asked for (no manifest vouches for conversation KV: its frame does),
  over the edge's HTTP frames where it is on another node that serves them (the reader's
  data plane, kdn.client.dataplane; POST /v1/conversation with the tenant's read token), else
  over Ray.
With tails=True (a transformers worker: its cache takes any number of tokens), `find` also
takes the conversation's tail after the held chunks (kdn.core.conversation.tail_key), the
longest one the edge lists whose key the prompt's own tokens give, leaving at least one
token to compute; `fetch` brings it after the chunks, and `store` keeps the new turn's tail.
A dead or slow home edge costs one timeout (kdn.core.rpc.Unreachable) and the turn is
recomputed; nothing else is caught.
"""
import collections
import time
from dataclasses import dataclass

from kdn.core.conversation import (conversation_keys, conversation_namespace, conversation_scope, tail_key,
                                   first_key)
from kdn.core.chunk import cut
from kdn.core.errors import FrameError, PlacementError, RemoteError
from kdn.core.keys import CHUNK_TOKENS
from kdn.core.rpc import Unreachable
from kdn.core.transfer import fetch_deadline_s

LOOKUP_TIMEOUT_S = 2.0
STORE_TIMEOUT_S = 30.0
LINK_WEIGHT = 0.3          # each new measurement's weight in a link's moving average


@dataclass
class Found:
    """Where a prompt's conversation KV is held: the home edge, its region, the scope and
    namespace, the keys from start_chunk on, and how many of them the edge holds."""
    edge: str
    region: str
    scope: str
    ns: bytes
    keys: list
    start_chunk: int
    held: int
    tail: tuple = None      # (key, tokens) of the conversation's tail after the held chunks


class History:
    """Conversation KV of one tenant and model through a network view (see the module)."""

    def __init__(self, view, tenant: str, fingerprint: str, token: str = None,
                 chunk_tokens: int = CHUNK_TOKENS):
        self.view, self.tenant, self.fingerprint = view, tenant, fingerprint
        self.token, self.chunk_tokens = token, chunk_tokens
        self.counters = collections.Counter()
        self._links = {}           # region -> {"rtt_s", "bytes_per_s"}: measured (see links())

    def _measured(self, region: str, name: str, value: float) -> None:
        link = self._links.setdefault(region, {})
        old = link.get(name)
        link[name] = value if old is None else (1 - LINK_WEIGHT) * old + LINK_WEIGHT * value

    def links(self) -> dict:
        """region -> {"rtt_s": a lookup's round trip, "bytes_per_s": a fetch's throughput},
        each a moving average of what this History measured (absent until measured)."""
        return {r: dict(v) for r, v in self._links.items()}

    def home(self, tokens, start_chunk: int, region: str, salt: str = None):
        """(edge, scope, ns) of the prompt's conversation in region, or None when the prompt
        has no whole chunk after start_chunk (or the region has no edge)."""
        key = first_key(tokens, self.tenant, self.fingerprint, start_chunk, self.chunk_tokens)
        if key is None:
            return None
        edge = self._owner(key, region)
        if edge is None:
            return None
        scope = conversation_scope(edge, salt)
        return edge, scope, conversation_namespace(self.tenant, self.fingerprint, scope)

    def _owner(self, key: bytes, region: str):
        """The key's owner among region's edges; None when the ring has none there, after
        membership re-read once (NetworkView.recheck: the ring in hand may predate an edge's return)."""
        for last in (False, True):
            try:
                return self.view.ring.owners_in(key, region)[0]
            except PlacementError:        # no edge in that region (any more, or not yet in this view)
                if last or not self.view.recheck():
                    return None

    def regions(self, hints=()) -> list:
        """Regions to look in: this worker's, the hinted ones, then the rest nearest first (by
        the declared latency, or half the moving average of the lookups' round trips this History
        measured to a region where that is longer: a measurement makes a region farther than
        declared, never nearer)."""
        here = self.view.region

        def one_way_ms(r):
            rtt_s = self._links.get(r, {}).get("rtt_s", 0.0)
            return max(self.view.topology.latency_ms(r, here), rtt_s * 1000.0 / 2)
        rest = sorted((r for r in self.view.topology.regions if r != here), key=one_way_ms)
        out = [here] + [r for r in hints if r in rest]
        return out + [r for r in rest if r not in out]

    def find(self, tokens, start_chunk: int, salt: str = None, hints=(), tails: bool = False) -> "Found | None":
        """The first region's home edge (see regions()) holding a prefix of the prompt's
        conversation keys from start_chunk; None when none does. tails: also the longest tail
        after that prefix that the prompt reproduces (see the module)."""
        for region in self.regions(hints):
            home = self.home(tokens, start_chunk, region, salt)
            if home is None:
                continue
            edge, scope, ns = home
            keys = conversation_keys(tokens, ns, self.chunk_tokens)[start_chunk:]
            t0 = time.perf_counter()
            try:
                at = self.view.at(edge, LOOKUP_TIMEOUT_S)
                got = (at.conversation_find if tails else at.conversation_lookup)(
                    keys, ns, self.tenant, self.fingerprint, scope, token=self.token)
            except Unreachable:
                self.counters["lookup_unreachable"] += 1
                continue
            self._measured(region, "rtt_s", time.perf_counter() - t0)
            held = got["held"] if tails else got
            if held:
                self.counters["found_" + ("here" if region == self.view.region else "away")] += 1
                tail = self._tail(tokens, keys[held - 1], start_chunk + held, got["tails"]) if tails else None
                return Found(edge, region, scope, ns, keys, start_chunk, held, tail)
        self.counters["not_found"] += 1
        return None

    def _tail(self, tokens, after: bytes, chunks: int, offered) -> "tuple | None":
        """(key, tokens) of the longest offered tail that tokens reproduce after their first
        `chunks` whole chunks, leaving at least one token to compute; None when none does."""
        at = chunks * self.chunk_tokens
        for n, key in offered:
            if 0 < n < self.chunk_tokens and at + n < len(tokens) and \
                    tail_key(after, tokens[at:at + n], self.chunk_tokens) == key:
                self.counters["tails_found"] += 1
                return key, n
        return None

    def held_here(self, tokens, start_chunk: int, salt: str = None) -> int:
        """How many of the conversation's chunks from start_chunk on the home edge of this
        worker's region holds (a lookup, no KV moves; 0 when it has no home here or is
        unreachable): a worker that keeps a turn sends only the chunks after them."""
        home = self.home(tokens, start_chunk, self.view.region, salt)
        if home is None:
            return 0
        edge, scope, ns = home
        keys = conversation_keys(tokens, ns, self.chunk_tokens)[start_chunk:]
        try:
            return int(self.view.at(edge, LOOKUP_TIMEOUT_S).conversation_lookup(
                keys, ns, self.tenant, self.fingerprint, scope, token=self.token))
        except Unreachable:
            self.counters["lookup_unreachable"] += 1
            return 0

    def worth_fetching(self, found: Found, chunk_bytes: int, prefill_tokens_per_s: float) -> bool:
        """Whether fetching found's chunks beats recomputing them: transfer over the link
        (its measured round trip and throughput, links(); the topology's declared latency and
        bandwidth for what is not measured yet) against prefill at the worker's measured
        rate. In the worker's own region it always is."""
        if found.region == self.view.region or not prefill_tokens_per_s:
            return True
        topo, link = self.view.topology, self._links.get(found.region, {})
        nbytes = found.held * chunk_bytes
        one_way_s = topo.latency_ms(self.view.region, found.region) / 1000.0    # declared
        rtt_s = link.get("rtt_s", 2 * one_way_s)
        move_s = nbytes / link["bytes_per_s"] if "bytes_per_s" in link else \
            topo.transfer_time(found.region, self.view.region, nbytes) - one_way_s
        fetch_s = rtt_s + move_s
        recompute_s = found.held * self.chunk_tokens / prefill_tokens_per_s
        return fetch_s < recompute_s

    def fetch(self, found: Found) -> list:
        """The verified chunks of found's held prefix, in order, and its tail after them when
        found has one (fewer when the edge lost some since the lookup; [] when it is
        unreachable). A tail is the last chunk, of fewer tokens."""
        keys = found.keys[:found.held] + ([found.tail[0]] if found.tail else [])
        t0 = time.perf_counter()
        objs = self._over_http(found, keys)
        if objs == [] and keys:             # over HTTP, no answer (counted): recomputed
            return []
        if objs is None:
            try:
                reply = self.view.at(found.edge, fetch_deadline_s(len(keys))).conversation_fetch(
                    keys, found.ns, self.tenant, self.fingerprint, found.scope, token=self.token)
                refs = reply["refs"]
                t1 = time.perf_counter()
                objs = self.view.actors.get_sync(found.edge, refs, timeout=fetch_deadline_s(
                    len(refs), reply["bytes"])) if refs else []
            except Unreachable:
                self.counters["fetch_unreachable"] += 1
                return []
            if reply["bytes"]:      # the bytes' move alone (the reply's round trip is the rtt's)
                self._measured(found.region, "bytes_per_s", reply["bytes"] / max(time.perf_counter() - t1, 1e-6))
        chunks = []
        for key, obj in zip(keys, objs):
            if obj is None:         # over HTTP: the held prefix ends here (or a frame arrived corrupt)
                break
            if obj.key != key or obj.ns != found.ns:
                raise RemoteError(f"edge {found.edge} answered a conversation chunk that is not "
                                   "the one asked for")
            try:
                chunk = obj.decode()
                chunk.verify(None)
            except FrameError:
                self.counters["corrupt_chunks"] += 1
                break
            chunks.append(chunk)
        self.counters["fetches"] += 1
        self.counters["chunks_fetched"] += len(chunks)
        self.counters["fetch_s"] += time.perf_counter() - t0
        return chunks

    def _over_http(self, found: Found, keys):
        """The home edge's answer over its HTTP frames (per key the verified object, None after
        the held prefix) where it is on another node that serves them (kdn.client.dataplane:
        the reader's data plane), else None (Ray). An edge that gives no answer over HTTP, or
        answers with a fault of its own, costs this one timeout as over Ray: nothing is
        fetched (the turn is recomputed) and its address is asked again next time."""
        plane = self.view.plane
        url = plane.url_of(found.edge, ())         # frames as held: raw, or a lossless codec
        if url is None or not keys:
            return None
        t0 = time.perf_counter()
        try:
            objs, nbytes = plane.conversation(url, fetch_deadline_s(len(keys)), self.token, keys, found.ns,
                                              self.tenant, self.fingerprint, found.scope)
        except (Unreachable, RemoteError) as e:
            plane.forget(found.edge)
            self.counters["fetch_unreachable" if isinstance(e, Unreachable) else "fetch_http_errors"] += 1
            return []
        self.counters["fetches_http"] += 1
        if nbytes:              # request to the last frame: the link's pace as this reader sees it
            self._measured(found.region, "bytes_per_s", nbytes / max(time.perf_counter() - t0, 1e-6))
        return objs

    def store(self, tokens, kv, start_chunk: int, first_new_chunk: int, salt: str = None,
              retention: str = None, tails: bool = False) -> dict:
        """Keep the whole chunks of tokens from first_new_chunk on (those the worker computed;
        the ones before it were fetched and are held already) at the home edge in this
        worker's region, and with tails=True the partial chunk after them (the tail). kv: the
        KV of tokens[first_new_chunk * chunk_tokens:] as far as it goes, [layers, 2, kv_heads,
        T, head_dim]. retention: prompt_cache_retention, which the edge turns into an idle TTL
        within the tenant's bounds. {"edge", "chunks" kept, "tokens" covered}."""
        home = self.home(tokens, start_chunk, self.view.region, salt)
        c = self.chunk_tokens
        n_whole = len(tokens) // c
        first = max(start_chunk, first_new_chunk)
        n_tail = len(tokens) - n_whole * c if tails and start_chunk < n_whole and first_new_chunk <= n_whole else 0
        if home is None or (n_whole <= first and not n_tail):
            return {"edge": None, "chunks": 0, "tokens": 0}
        edge, scope, ns = home
        every = conversation_keys(tokens, ns, c)
        keys = every[first:n_whole]
        span = max(n_whole - first, 0) * c
        offset = (first - first_new_chunk) * c
        chunks = cut(kv[:, :, :, offset:offset + span], keys, ns, c) if keys else []
        tail = None
        if n_tail:
            at = (n_whole - first_new_chunk) * c
            tail = cut(kv[:, :, :, at:at + n_tail], [tail_key(every[n_whole - 1], tokens[n_whole * c:], c)],
                       ns, c)[0]
        try:
            kept = self.view.at(edge, STORE_TIMEOUT_S).put_conversation(
                chunks, self.tenant, self.fingerprint, scope, retention,
                head=every[start_chunk:min(first, n_whole)], tail=tail, token=self.token)
        except Unreachable:
            self.counters["store_unreachable"] += 1
            return {"edge": edge, "chunks": 0, "tokens": 0}
        self.counters["stored_tails"] += tail is not None
        self.counters["stored_chunks"] += kept
        return {"edge": edge, "chunks": kept, "tokens": n_whole * c + (n_tail if tail is not None else 0)}
