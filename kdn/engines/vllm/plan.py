"""The scheduler side of KDN's vLLM connector: how many prompt tokens to load, and where.

vLLM asks, for each new request, how many tokens past its own prefix-cache hit an external
cache can supply. The planner answers from the network: the prompt's KB keys and one lookup
at the nearest edge (kdn.engines.sources, bounded by a deadline; once per request, since
vLLM may ask again). The answer follows vLLM's rules: counted from the block-aligned local
hit vLLM passes in, never the whole prompt (vLLM must compute the last prompt token itself to
have its logits), and nothing when the gain is below `min_tokens`. A request's cache salt
picks the only tenant it reads (sources.Tenants).

After vLLM allocates the request's blocks, the planner records a `Load` (the KB chunk keys
and block ids for tokens [start, end)) for the worker. A publishing request (kv_both,
`kv_transfer_params={"kdn_publish": ...}`) gets a `Capture` in the step its prefill
completes, with every block id it has by then. What the worker reports back (tokens loaded,
blocks failed, publish receipts) comes in through `update` and goes out with the request's
`kv_transfer_params["kdn"]`.

Conversations (`conversations` on; kdn.core.conversation, kdn.client.history): after the
KB's chunks the planner asks the conversation's home edge, its own region's first, then the
regions the request names (`kv_transfer_params={"kdn_conversation": {"hints": [...]}}`), then
the rest, for the longest held prefix of the prompt's conversation keys (the chunks after the
KB's whole ones, in the tenant's conversation namespace, narrowed by the salt), and counts
those tokens as the network's when they continue what vLLM's own cache or the KB supplies
and fetching them beats recomputing them (away from its region: the link against the
engine's prefill rate, measured from its steps). The Load then names the KB's chunks before
them and the conversation's (`Load.conv`), one contiguous range. Nothing is looked up when
vLLM's own cache already holds what a conversation could add (a turn on the engine that
answered the last one). When a request finishes its answer (stopped or at its length; not
aborted, not a full prefill, not a publish) the planner hands the worker a `Keep`: the
prompt and the answer's tokens whose KV was computed (the last sampled token has none), with
the blocks that hold them, which vLLM then keeps until the worker has copied them out
(request_finished's delay; kdn.engines.vllm.keep).
"""
import collections
import concurrent.futures
import dataclasses
import time
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)
from vllm.v1.request import RequestStatus

from kdn.core.conversation import RETENTIONS
from kdn.core.errors import BadRequest, KDNError
from kdn.core.keys import CHUNK_TOKENS
from kdn.core.manifest import check_name
from kdn.engines.sources import NO_MATCH, Match

KEPT_STATUSES = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
MAX_HINTS = 16

MIN_TOKENS = 64           # a smaller hit costs a fetch round trip to save less compute than that


@dataclass
class Load:
    """Tokens [start, end) of request `req`: chunks `keys` of KB `kb` v`version` (the first
    covering token `first`), then the conversation's chunks `conv` (a kdn.client.history.Found
    whose keys are those to load, None: none), into blocks `block_ids` (the request's, from
    token 0). `unzeroed`: the blocks the load covers whole, which vLLM was told not to zero first."""
    req: str
    salt: object
    kb: str
    version: int
    keys: list
    first: int
    start: int
    end: int
    block_ids: list
    unzeroed: list = field(default_factory=list)
    conv: object = None

    def whole_blocks(self, block_size: int) -> list:
        """Ids of the blocks whose every slot this load writes."""
        first, last = -(-self.start // block_size), self.end // block_size
        return self.block_ids[first:last]


@dataclass
class Capture:
    """Publish the KV of request `req`'s prompt `tokens` (in blocks `block_ids`) as KB `kb`:
    documents `documents` [(name, n_tokens)] in order, under the tenant of `salt`."""
    req: str
    salt: object
    kb: str
    documents: list
    tokens: list
    block_ids: list
    meta: dict = field(default_factory=dict)


@dataclass
class Keep:
    """Keep request `req`'s conversation: `tokens` (its prompt and the answer's tokens whose
    KV is computed), in blocks `block_ids` (from token 0), its whole chunks from `start_chunk`
    (after the KB's whole ones) on, under the tenant of `salt` narrowed by `narrowing`, idle
    as long as `retention` asks."""
    req: str
    salt: object
    narrowing: str
    tokens: list
    block_ids: list
    start_chunk: int
    retention: str = None


@dataclass
class Plan(KVConnectorMetadata):
    """One step's work for the worker side."""
    loads: list = field(default_factory=list)
    captures: list = field(default_factory=list)
    keeps: list = field(default_factory=list)


@dataclass(frozen=True)
class Held:
    """What the network holds of a prompt: the KB's chunks (`kb`), and the conversation's
    from chunk `start_chunk` (the KB's whole chunks) on (`conv`: a kdn.client.history.Found,
    None: none found or not worth fetching)."""
    kb: Match = NO_MATCH
    start_chunk: int = 0
    conv: object = None
    known: bool = True        # False: the KB lookup failed, start_chunk is unknown

    def reach(self, local: int) -> int:
        """The end of the held tokens that continue from `local` (vLLM's own hit): the
        conversation's chunks count once the KB or vLLM's cache reaches where they start."""
        if self.conv is not None and max(local, self.kb.tokens) >= self.start_chunk * CHUNK_TOKENS:
            return (self.start_chunk + self.conv.held) * CHUNK_TOKENS
        return self.kb.tokens


def conversation_request(params) -> dict:
    """{"retention", "hints", "keep"} of a request's kv_transfer_params["kdn_conversation"]
    (defaults when absent); BadRequest when it is malformed."""
    spec = (params or {}).get("kdn_conversation") or {}
    if not isinstance(spec, dict) or set(spec) - {"retention", "hints", "keep"}:
        raise BadRequest(f"kdn_conversation must be {{'retention': ..., 'hints': [regions], 'keep': "
                         f"bool}}, got {spec!r:.200}")
    retention, hints, keep = spec.get("retention"), spec.get("hints") or [], spec.get("keep", True)
    if retention is not None and retention not in RETENTIONS:
        raise BadRequest(f"kdn_conversation retention must be one of {', '.join(RETENTIONS)}, "
                         f"got {retention!r:.40}")
    if not isinstance(hints, (list, tuple)) or len(hints) > MAX_HINTS or \
            not all(isinstance(r, str) for r in hints) or not isinstance(keep, bool):
        raise BadRequest(f"kdn_conversation hints must be at most {MAX_HINTS} region names and "
                         f"keep a bool, got {spec!r:.200}")
    return {"retention": retention, "hints": tuple(hints), "keep": keep}


@dataclass
class Reports(KVConnectorWorkerMetadata):
    """What the worker side did, per request id (merged across workers)."""
    reports: dict = field(default_factory=dict)

    def aggregate(self, other: "Reports") -> "Reports":
        merged = {k: dict(v) for k, v in self.reports.items()}
        for req, r in other.reports.items():
            merged.setdefault(req, {}).update(r)
        return Reports(merged)


@dataclass
class _Publishing:
    kb: str
    documents: list
    meta: dict
    salt: object
    tokens: list
    block_ids: list = field(default_factory=list)
    computed: int = 0
    captured: bool = False


def publish_request(params) -> "tuple | None":
    """(kb, [(doc, n_tokens)], meta) of a request's kv_transfer_params["kdn_publish"], or None;
    BadRequest when it is malformed."""
    spec = (params or {}).get("kdn_publish")
    if spec is None:
        return None
    try:
        kb = check_name(spec["kb"], "knowledge base name")
        docs = [(check_name(str(n), "document name"), int(t)) for n, t in spec["documents"]]
        meta = dict(spec.get("meta") or {})
    except (KeyError, TypeError, ValueError) as e:
        raise BadRequest(f"kdn_publish must be {{'kb': name, 'documents': [[name, n_tokens], "
                         f"...]}}, got {spec!r:.200} ({e})") from None
    if not docs or any(t < 1 for _, t in docs):
        raise BadRequest(f"kdn_publish documents must each hold tokens, got {docs!r:.200}")
    return kb, docs, meta


def _unfit(request) -> "str | None":
    """Why a request's KV is not a function of its prompt token ids alone (None: it is)."""
    if getattr(request, "mm_features", None):
        return "multimodal inputs"
    if getattr(request, "lora_request", None) is not None:
        return "a LoRA adapter"
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings"
    return None


class Planner:
    """Scheduler side (see the module). sources(salt) -> a Source; deadline: sources.Deadline;
    converses(salt): whether a request's conversation is read and kept (conversations on, its
    tenant's KV is this engine's own), and histories(salt) -> its kdn.client.history.History
    (which may connect: called within the deadline); token_bytes: KV bytes of one token
    across every layer (what a conversation chunk costs to fetch)."""

    def __init__(self, tenants, sources, deadline, block_size: int, lookup_deadline_s: float,
                 min_tokens: int = MIN_TOKENS, producer: bool = False, published=None,
                 converses=None, histories=None, token_bytes: int = 0):
        self.tenants, self.sources, self.deadline = tenants, sources, deadline
        self.published = published or (lambda: None)   # called when a publish receipt arrives
        self.converses = converses or (lambda salt: False)
        self.histories = histories
        self.token_bytes = token_bytes
        self.block_size = block_size
        self.lookup_deadline_s = lookup_deadline_s
        self.min_tokens = min_tokens
        self.producer = producer
        self.matches = {}          # req id -> Held (asked once per request)
        self.wanted = {}           # req id -> (held, salt, start, end) of the latest answer
        self.loads = []            # Loads for the next step
        self.keeps = []            # Keeps for the next step
        self.publishing = {}       # req id -> _Publishing
        self.conversing = {}       # req id -> conversation_request() of a request that may keep
        self.reports = collections.defaultdict(dict)   # req id -> what is known of it
        self._step = None          # (when, tokens) of the step planned last: the prefill rate
        # requests, no_tenant, lookups, lookup_timeouts, lookup_errors, matched_requests,
        # matched_tokens, below_min, loads, unzeroed_blocks, captures, publish_refused,
        # history_lookups, history_hits, history_tokens, history_recomputed, history_timeouts,
        # history_errors, keeps, keep_tokens, computed_tokens, compute_s
        self.counters = collections.Counter()

    def stats(self) -> dict:
        return {"counters": dict(self.counters)}

    # --- vLLM scheduler calls -------------------------------------------------------------
    def new_request(self, request) -> None:
        """A publishing request is noted; a malformed one is reported, never raised (this
        runs in vLLM's engine loop: an exception would stop the engine)."""
        try:
            self.conversing[request.request_id] = conversation_request(request.kv_transfer_params)
        except BadRequest as e:
            self.reports[request.request_id]["error"] = str(e)
        try:
            spec = publish_request(request.kv_transfer_params)
            if spec is None:
                return
            if not self.producer:
                raise BadRequest("kdn_publish needs kv_role kv_both or kv_producer")
            kb, docs, meta = spec
            n, have = sum(t for _, t in docs), len(request.prompt_token_ids or ())
            if n != have:
                raise BadRequest(f"kdn_publish documents hold {n} tokens; the prompt has {have}")
        except BadRequest as e:
            self.counters["publish_refused"] += 1
            self.reports[request.request_id]["error"] = str(e)
            return
        self.publishing[request.request_id] = _Publishing(kb, docs, meta, request.cache_salt,
                                                          list(request.prompt_token_ids))

    def matched_tokens(self, request, num_computed: int) -> int:
        """Tokens past num_computed the network can supply for this request (vLLM's rules)."""
        req = request.request_id
        prompt = request.prompt_token_ids or []
        salt = request.cache_salt
        if getattr(request, "skip_reading_prefix_cache", False):
            self.reports[req].update(held=None, local=num_computed, external=0)
            return 0                # the request asked for a full prefill: no lookup either
        unfit = _unfit(request)
        if unfit:                   # its KV is not the tokens' alone: KDN's keys cannot name it
            self.counters["unfit_requests"] += 1
            self.reports[req].update(held=None, local=num_computed, external=0, skipped=unfit)
            return 0
        if req not in self.matches:
            self.counters["requests"] += 1
            m = self._match(salt, prompt)
            # a failed lookup leaves where the KB ends, and so the conversation's keys, unknown:
            # nothing of the conversation is asked for or kept (the network is already costing
            # this request a deadline)
            self.matches[req] = Held(NO_MATCH, known=False) if m is None else \
                self._conversation(req, salt, prompt, m, num_computed)
        h = self.matches[req]
        m = h.kb
        usable = min(h.reach(num_computed), len(prompt) - 1)   # vLLM computes at least the last token
        gain = usable - num_computed
        if 0 < gain < self.min_tokens:
            self.counters["below_min"] += 1
            gain = 0
        gain = max(gain, 0)
        # held: what the network holds of the prompt; local: vLLM's own (block-aligned) hit;
        # external: what KDN is asked to load
        self.reports[req].update(held=h.reach(num_computed), kb=m.kb, version=m.version, edge=m.edge,
                                 local=num_computed, external=gain)
        if gain:
            self.wanted[req] = (h, salt, num_computed, usable)
        return gain

    def _match(self, salt, prompt) -> "Match | None":
        """The KB match of a prompt (NO_MATCH: none); None when the lookup failed."""
        tenant = self.tenants.of(salt)
        if tenant is None or len(prompt) < 2:
            self.counters["no_tenant" if tenant is None else "too_short"] += 1
            return NO_MATCH
        self.counters["lookups"] += 1
        try:
            m = self.deadline.run(self.lookup_deadline_s, self.sources(salt).match, prompt)
        except concurrent.futures.TimeoutError:
            self.counters["lookup_timeouts"] += 1
            return None
        except KDNError:           # no edge answered, access refused, ...: compute the prompt
            self.counters["lookup_errors"] += 1
            return None
        if m.tokens:
            self.counters["matched_requests"] += 1
            self.counters["matched_tokens"] += m.tokens
        return m

    def _conversation(self, req, salt, prompt, m, local: int) -> Held:
        """Held for a prompt whose KB match is m: with the conversation's chunks after the
        KB's whole ones when a home edge holds some, they can continue what vLLM or the KB
        supplies by at least min_tokens, and fetching them beats recomputing them."""
        start = m.covers // CHUNK_TOKENS
        held = Held(m, start)
        ends = min(len(prompt) // CHUNK_TOKENS * CHUNK_TOKENS, len(prompt) - 1)
        if req not in self.conversing or not self.converses(salt) or \
                max(local, m.tokens) < start * CHUNK_TOKENS or ends - max(local, m.tokens) < max(self.min_tokens, 1):
            return held
        self.counters["history_lookups"] += 1
        narrowing = self.tenants.split(salt)[1]

        def find():
            history = self.histories(salt)
            return history, history.find(prompt, start, narrowing, self.conversing[req]["hints"])
        try:
            history, found = self.deadline.run(self.lookup_deadline_s, find)
        except concurrent.futures.TimeoutError:
            self.counters["history_timeouts"] += 1
            return held
        except KDNError:           # refused, malformed: compute those tokens
            self.counters["history_errors"] += 1
            return held
        if found is None:
            return held
        report = {"region": found.region, "edge": found.edge, "chunks": found.held}
        if not history.worth_fetching(found, CHUNK_TOKENS * self.token_bytes, self.prefill_rate()):
            self.counters["history_recomputed"] += 1
            self.reports[req]["history"] = dict(report, fetched=False)
            return held
        self.counters["history_hits"] += 1
        self.counters["history_tokens"] += found.held * CHUNK_TOKENS
        self.reports[req]["history"] = dict(report, fetched=True)
        return Held(m, start, found)

    def prefill_rate(self) -> "float | None":
        """Tokens per second of the engine's steps that computed a chunk or more (None: none yet)."""
        s = self.counters["compute_s"]
        return self.counters["computed_tokens"] / s if s else None

    def allocated(self, request, block_ids, num_external: int) -> None:
        """vLLM gave the request its blocks; num_external of its tokens are ours to load."""
        want = self.wanted.pop(request.request_id, None)
        if num_external <= 0 or want is None:
            return
        h, salt, start, _ = want
        m, end = h.kb, start + num_external
        first, last = start // CHUNK_TOKENS, -(-end // CHUNK_TOKENS)
        conv = None
        if h.conv is not None and last > h.start_chunk:      # the conversation's chunks after the KB's
            i, j = max(first, h.start_chunk) - h.start_chunk, last - h.start_chunk
            conv = dataclasses.replace(h.conv, keys=list(h.conv.keys[i:j]), held=j - i)
            last = max(first, h.start_chunk)
        blocks = list(block_ids[:-(-end // self.block_size)])
        self.loads.append(Load(request.request_id, salt, m.kb, m.version, list(m.keys[first:last]),
                               first * CHUNK_TOKENS, start, end, blocks, conv=conv))
        self.counters["loads"] += 1

    def plan(self, scheduler_output) -> Plan:
        """This step's Loads, and Captures of publishing requests whose prefill completes.

        Blocks a load overwrites whole are taken out of the step's new_block_ids_to_zero (the
        one change vLLM allows a synchronous reader to make to its scheduler output): zeroing
        4k tokens of KV costs as much as a third of the load. A load that fails zeroes its own.
        """
        out = Plan(loads=self.loads, keeps=self.keeps)
        self.loads, self.keeps = [], []
        self._step = (time.perf_counter(), getattr(scheduler_output, "total_num_scheduled_tokens", 0))
        zero = getattr(scheduler_output, "new_block_ids_to_zero", None)
        if zero and out.loads:
            zero = set(zero)
            for load in out.loads:
                load.unzeroed = [b for b in load.whole_blocks(self.block_size) if b in zero]
                zero.difference_update(load.unzeroed)
                self.counters["unzeroed_blocks"] += len(load.unzeroed)
            scheduler_output.new_block_ids_to_zero = \
                [b for b in scheduler_output.new_block_ids_to_zero if b in zero] or None
        if self.publishing:
            self._track_blocks(scheduler_output)
            for req, p in self.publishing.items():
                total = sum(t for _, t in p.documents)
                done = p.computed + scheduler_output.num_scheduled_tokens.get(req, 0)
                if not p.captured and done >= total and p.block_ids:
                    p.captured = True
                    out.captures.append(self._capture(req, p, total))
        return out

    def _track_blocks(self, so) -> None:
        for r in so.scheduled_new_reqs:
            if r.req_id in self.publishing:
                p = self.publishing[r.req_id]
                p.block_ids, p.computed = list(r.block_ids[0]), r.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req in enumerate(cached.req_ids):
            p = self.publishing.get(req)
            if p is None:
                continue
            new = cached.new_block_ids[i]
            if req in cached.resumed_req_ids:
                p.block_ids = list(new[0]) if new else []
            elif new:
                p.block_ids += list(new[0])
            p.computed = cached.num_computed_tokens[i]

    def _capture(self, req, p, total) -> Capture:
        self.counters["captures"] += 1
        return Capture(req, p.salt, p.kb, p.documents, p.tokens[:total], p.block_ids, p.meta)

    def update(self, reports: "Reports | None") -> None:
        """A step's worker reports (and the step's time, for the prefill rate)."""
        if self._step is not None and self._step[1] >= CHUNK_TOKENS:
            self.counters["computed_tokens"] += self._step[1]
            self.counters["compute_s"] += time.perf_counter() - self._step[0]
        self._step = None
        if reports is not None:
            for req, r in reports.reports.items():
                self.reports[req].update(r)
                if "publish" in r:
                    self.published()

    def keep(self, request, block_ids) -> bool:
        """Plan keeping a finished request's conversation (see the module); True when the
        worker will copy its blocks (vLLM must not free them until it says so)."""
        req = request.request_id
        h, conv = self.matches.get(req), self.conversing.get(req)
        if h is None or not h.known or conv is None or not conv["keep"] or req in self.publishing or \
                request.status not in KEPT_STATUSES or not self.converses(request.cache_salt):
            return False
        computed = request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0)
        tokens = list(request.all_token_ids[:computed])
        whole = len(tokens) // CHUNK_TOKENS
        if whole <= h.start_chunk or len(block_ids) * self.block_size < whole * CHUNK_TOKENS:
            return False
        self.keeps.append(Keep(req, request.cache_salt, self.tenants.split(request.cache_salt)[1],
                               tokens, list(block_ids), h.start_chunk, conv["retention"]))
        self.counters["keeps"] += 1
        self.counters["keep_tokens"] += (whole - h.start_chunk) * CHUNK_TOKENS
        self.reports[req]["keep"] = {"from_chunk": h.start_chunk, "chunks": whole - h.start_chunk}
        return True

    def finished(self, request) -> dict:
        """What KDN did for this request (its kv_transfer_params["kdn"]); forgets it."""
        req = request.request_id
        self.matches.pop(req, None)
        self.wanted.pop(req, None)
        self.publishing.pop(req, None)
        self.conversing.pop(req, None)
        return dict(self.reports.pop(req, {}), tenant=self._tenant_name(request.cache_salt))

    def _tenant_name(self, salt):
        t = self.tenants.of(salt)
        return t.name if t else None
