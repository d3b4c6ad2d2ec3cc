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
"""
import collections
import concurrent.futures
from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

from kdn.core.errors import BadRequest, KDNError
from kdn.core.keys import CHUNK_TOKENS
from kdn.core.manifest import check_name
from kdn.engines.sources import NO_MATCH

MIN_TOKENS = 64           # a smaller hit costs a fetch round trip to save less compute than that


@dataclass
class Load:
    """Tokens [start, end) of request `req`: chunks `keys` of KB `kb` v`version` (the first
    covering token `first`) into blocks `block_ids` (the request's, from token 0).
    `unzeroed`: the blocks the load covers whole, which vLLM was told not to zero first."""
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
class Plan(KVConnectorMetadata):
    """One step's work for the worker side."""
    loads: list = field(default_factory=list)
    captures: list = field(default_factory=list)


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
    """Scheduler side (see the module). sources(tenant) -> a Source; deadline: sources.Deadline."""

    def __init__(self, tenants, sources, deadline, block_size: int, lookup_deadline_s: float,
                 min_tokens: int = MIN_TOKENS, producer: bool = False, published=None):
        self.tenants, self.sources, self.deadline = tenants, sources, deadline
        self.published = published or (lambda: None)   # called when a publish receipt arrives
        self.block_size = block_size
        self.lookup_deadline_s = lookup_deadline_s
        self.min_tokens = min_tokens
        self.producer = producer
        self.matches = {}          # req id -> Match (asked once per request)
        self.wanted = {}           # req id -> (match, salt, start, end) of the latest answer
        self.loads = []            # Loads for the next step
        self.publishing = {}       # req id -> _Publishing
        self.reports = collections.defaultdict(dict)   # req id -> what is known of it
        # requests, no_tenant, lookups, lookup_timeouts, lookup_errors, matched_requests,
        # matched_tokens, below_min, loads, unzeroed_blocks, captures, publish_refused
        self.counters = collections.Counter()

    def stats(self) -> dict:
        return {"counters": dict(self.counters)}

    # --- vLLM scheduler calls -------------------------------------------------------------
    def new_request(self, request) -> None:
        """A publishing request is noted; a malformed one is reported, never raised (this
        runs in vLLM's engine loop: an exception would stop the engine)."""
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
            self.matches[req] = self._match(salt, prompt)
        m = self.matches[req]
        usable = min(m.tokens, len(prompt) - 1)   # vLLM computes at least the last token
        gain = usable - num_computed
        if 0 < gain < self.min_tokens:
            self.counters["below_min"] += 1
            gain = 0
        gain = max(gain, 0)
        # held: what the network holds of the prompt; local: vLLM's own (block-aligned) hit;
        # external: what KDN is asked to load
        self.reports[req].update(held=m.tokens, kb=m.kb, version=m.version, edge=m.edge,
                                 local=num_computed, external=gain)
        if gain:
            self.wanted[req] = (m, salt, num_computed, usable)
        return gain

    def _match(self, salt, prompt):
        tenant = self.tenants.of(salt)
        if tenant is None or len(prompt) < 2:
            self.counters["no_tenant" if tenant is None else "too_short"] += 1
            return NO_MATCH
        self.counters["lookups"] += 1
        try:
            m = self.deadline.run(self.lookup_deadline_s, self.sources(salt).match, prompt)
        except concurrent.futures.TimeoutError:
            self.counters["lookup_timeouts"] += 1
            return NO_MATCH
        except KDNError:           # no edge answered, access refused, ...: compute the prompt
            self.counters["lookup_errors"] += 1
            return NO_MATCH
        if m.tokens:
            self.counters["matched_requests"] += 1
            self.counters["matched_tokens"] += m.tokens
        return m

    def allocated(self, request, block_ids, num_external: int) -> None:
        """vLLM gave the request its blocks; num_external of its tokens are ours to load."""
        want = self.wanted.pop(request.request_id, None)
        if num_external <= 0 or want is None:
            return
        m, salt, start, _ = want
        end = start + num_external
        first, last = start // CHUNK_TOKENS, -(-end // CHUNK_TOKENS)
        blocks = list(block_ids[:-(-end // self.block_size)])
        self.loads.append(Load(request.request_id, salt, m.kb, m.version, list(m.keys[first:last]),
                               first * CHUNK_TOKENS, start, end, blocks))
        self.counters["loads"] += 1

    def plan(self, scheduler_output) -> Plan:
        """This step's Loads, and Captures of publishing requests whose prefill completes.

        Blocks a load overwrites whole are taken out of the step's new_block_ids_to_zero (the
        one change vLLM allows a synchronous reader to make to its scheduler output): zeroing
        4k tokens of KV costs as much as a third of the load. A load that fails zeroes its own.
        """
        out = Plan(loads=self.loads)
        self.loads = []
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
        if reports is not None:
            for req, r in reports.reports.items():
                self.reports[req].update(r)
                if "publish" in r:
                    self.published()

    def finished(self, request) -> dict:
        """What KDN did for this request (its kv_transfer_params["kdn"]); forgets it."""
        req = request.request_id
        self.matches.pop(req, None)
        self.wanted.pop(req, None)
        self.publishing.pop(req, None)
        return dict(self.reports.pop(req, {}), tenant=self._tenant_name(request.cache_salt))

    def _tenant_name(self, salt):
        t = self.tenants.of(salt)
        return t.name if t else None
