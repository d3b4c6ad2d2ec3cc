"""`kdn serve --engine vllm`: a replica of a region's deployment that answers with vLLM and KDN's KV connector.

`VllmRegionWorker` has RegionWorker's interface and wire protocol (kdn.serve.app: models,
complete, stream, stats; the ingress cannot tell them apart) but its engine is vLLM (the
in-process engine of kdn.engines.vllm.run.start_engine, role kv_consumer, `conversations` on)
whose KDNConnector reads the knowledge's KV from the region's nearest edge. It answers over
KBs published through vLLM (`kdn publish --engine vllm`): they are read under vLLM's own
fingerprint.

- The prompt is the KB manifest's token ids, then kdn.serve.chat.messages_tokens of the request's
  messages, as RegionWorker builds it; vLLM's connector then matches the KB's chunks. A plain
  chat (no KB) is the messages as the chat template renders them (Model.chat_tokens).
- Conversations (kdn.core.conversation): the connector keeps every answer's KV at the
  conversation's home edge in this region and reads earlier turns back, from this region's
  home edge first, then from the regions the ingress names (`history_regions`), so vLLM
  replicas share conversations across replicas and regions while vLLM's own prefix cache
  serves a turn on the replica that answered the last one. After the answer is sent, the
  engine's thread puts the answer's text back through the chat template, tells the
  connector how far the next turn's prompt reproduces the prompt and tokens generated
  (kdn.engines.vllm.run.keep_limit), and lets it keep that much (run.settle: the copy out of
  vLLM's blocks, then the store, waited for at most STORE_WAIT_S before the next request).
  `prompt_cache_retention` goes with it; kdn_fetch False keeps nothing.
- Tenants: the router has authenticated the caller and names its tenant. Each tenant of the
  network's read tokens but "default" gets a cache salt (`salt_of`), and the connector's
  `tenants` setting maps that salt to the tenant and its read token, so a request reads KV
  only as its own tenant, and vLLM's own prefix cache is split per tenant as well. The
  default tenant's requests carry no salt and read with readers["default"] (or no token). A
  request's own salt (cache_salt, safety_identifier, user) narrows it: vLLM's cache salt is
  then "<tenant's salt>|<digest of the salt>" (kdn.engines.sources.Tenants.split), which
  narrows both the conversation's namespace and vLLM's own prefix cache.
- Streaming is token by token: the request is added to vLLM's engine (LLM.llm_engine) with
  output_kind DELTA and the engine is stepped here; each step's new text goes out as an SSE
  chunk as soon as vLLM has sampled it, not after the whole generation.
- usage.prompt_tokens_details.cached_tokens is vLLM's RequestOutput.num_cached_tokens: the
  prompt tokens whose KV vLLM did not compute, whether they came from vLLM's own prefix cache
  (an earlier request of the tenant in this replica) or from KDN. What the connector itself
  did (kv_transfer_params["kdn"]: held, local, external and loaded tokens) is summed in
  stats()["kdn"] and the last request's report is stats()["last"]. completion_tokens counts
  every token vLLM generated, a closing EOS included (as vLLM's own server counts them).
- kdn_fetch False: vLLM's own full prefill (skip_reading_prefix_cache, so neither its prefix
  cache nor KDN is read), as vllm_run.generate(full=True) does, for comparisons.

A replica admits a few requests (deploy's max_ongoing_requests) and answers them one at a time
in arrival order (an asyncio.Lock, which is FIFO). complete and stream are coroutines on the
replica's event loop, and every call to vLLM runs in the engine's own thread: so a caller that
goes away mid-answer cancels its request (Serve cancels the coroutine) and vLLM aborts it, where
a sync generator would run on to max_tokens in Serve's thread pool before the next request.
"""
import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import logging

import xxhash

from kdn.core.emphasis import override_of
from kdn.core.env import compute_threads
from kdn.core.errors import AccessDenied, BadRequest, KDNError, ModelError, NetworkError
from kdn.engines.sources import NARROW
from kdn.serve.api import (DEFAULT_TENANT, ApiError, api_error, completion, completion_id, model_list,
                           kv_note, sse_answer, usage)

log = logging.getLogger("kdn.serve.vllm")

SALT_PREFIX = "kdn-tenant:"
KDN_REPORT_KEYS = ("held", "local", "external", "loaded")


def salt_of(tenant: str, narrowing: str = None):
    """The cache salt a tenant's requests carry (None for the default tenant), narrowed by a
    request's own salt (its digest: the salt itself never reaches vLLM or the edges)."""
    salt = None if tenant == DEFAULT_TENANT else SALT_PREFIX + tenant
    if narrowing is None:
        return salt
    return (salt or "") + NARROW + xxhash.xxh3_128_hexdigest(narrowing.encode())


class VllmRegionWorker:
    """One replica of a region's deployment with vLLM as its engine (see the module)."""

    def __init__(self, network: str, region: str, auth: dict = None, max_context: int = None):
        from kdn.core.auth import Tokens
        from kdn.client.view import node_region
        where = node_region()
        if where != region:     # the label selector placed us; say so loudly if it did not
            raise NetworkError(f"a replica of region {region!r} started on a node of region {where!r}")
        from kdn.engines.fingerprint import fingerprints
        from kdn.engines.vllm.run import MAX_MODEL_LEN
        from kdn.engines.transformers.model import load_model
        self.network, self.region = network, region
        self.readers = dict(Tokens.from_dict(auth).readers)
        self.model = load_model(warm=False)    # tokenizer and chat template
        self.fingerprint = fingerprints(self.model.cache_path)["vllm"]
        self.max_context = min(max_context or MAX_MODEL_LEN, MAX_MODEL_LEN)
        # vLLM's CPU backend binds its OpenMP threads in the thread that starts it and checks
        # each step's attention against that count (OpenMP settings are per thread): the
        # engine lives in one thread of its own, and every call to it runs there
        self._engine_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-vllm")
        self.llm = self._on_engine(self._start_engine)
        self.engine = self.llm.llm_engine
        self._ids = itertools.count()
        self._clients = {}          # (tenant, token) -> kdn.client.Client (vLLM's fingerprint)
        self._turn = asyncio.Lock()  # one request at a time, in arrival order (FIFO)
        # requests, streams, errors, models_calls, prompt_tokens, cached_tokens, completion_tokens,
        # aborted (answers cut short: the caller went away), kept_chunks, keep_errors, keep_failures
        self.counters = collections.Counter()
        # requests, held, local, external, loaded, errors: the connector's reports, summed
        self.kdn = collections.Counter()
        self.last = None            # the last answer: tokens, cached, prompt_tokens, kdn report
        try:                        # warm the way to the edge, as RegionWorker does
            self._client(DEFAULT_TENANT, None).manifests(refresh=True)
        except AccessDenied:
            self._clients.clear()

    def stats(self) -> dict:
        return {"region": self.region, "engine": "vllm", "counters": dict(self.counters),
                "kdn": dict(self.kdn), "last": self.last}

    def _on_engine(self, fn, *args):
        """fn(*args) in the engine's own thread."""
        return self._engine_thread.submit(fn, *args).result()

    def _start_engine(self):
        import torch
        from kdn.engines.vllm.run import start_engine
        torch.set_num_threads(compute_threads())
        tenants = {salt_of(t): {"tenant": t, "token": tok}
                   for t, tok in self.readers.items() if t != DEFAULT_TENANT}
        return start_engine("kv_consumer", str(self.model.cache_path), network=self.network,
                            region=self.region, tenant=DEFAULT_TENANT,
                            token=self.readers.get(DEFAULT_TENANT), tenants=tenants or None,
                            conversations=True)

    def _client(self, tenant: str, token):
        """A client reading as `tenant` with the read token the connector reads with (the
        caller's own token where the network configures none for the tenant)."""
        from kdn.client import Client
        if tenant != DEFAULT_TENANT and tenant not in self.readers:
            raise AccessDenied(f"tenant {tenant!r} has no read token in this service's configuration")
        token = self.readers.get(tenant) or token
        key = (tenant, token)
        if key not in self._clients:
            self._clients[key] = Client(network=self.network, region=self.region, tenant=tenant,
                                        fingerprint=self.fingerprint, token=token)
        return self._clients[key]

    def _error(self, e: ApiError) -> dict:
        self.counters["errors"] += 1
        return {"status": e.status, "body": e.body(), "headers": e.headers()}

    def models(self, tenant: str, token) -> dict:
        """{"status", "body"}: the model list the tenant may read (KBs published through vLLM)."""
        self.counters["models_calls"] += 1
        try:
            names = [m.name for m in self._client(tenant, token).manifests(refresh=True)]
        except KDNError as e:
            return self._error(api_error(e))
        return {"status": 200, "body": model_list(self.model.name, names)}

    def _prompt(self, req: dict, tenant: str, token) -> tuple:
        """(the prompt's token ids, the KB's or None) for a checked request: the KB's, then the
        messages'; a plain chat's messages as the chat template renders them."""
        from kdn.serve.chat import messages_tokens
        if req.get("kb") is None:
            if req.get("emphasis"):
                raise BadRequest("emphasis edits a KB's KV: name a knowledge base to use it")
            self._client(tenant, token)          # the tenant is one this service reads as
            prompt = self.model.chat_tokens(req["messages"])
            self._check_context(len(prompt), req, f"the messages' {len(prompt)} tokens")
            return prompt, None
        m = self._client(tenant, token).manifest(req["kb"], req["version"])
        if m.layout != "prefix":
            raise BadRequest(f"knowledge base {m.name!r} has layout {m.layout!r}; "
                             "the service answers over 'prefix' KBs only")
        ids = m.token_ids()
        if len(ids) == 0:
            raise BadRequest(f"knowledge base {m.name!r} version {m.version} was "
                             "published without its token ids; republish it to serve it")
        emphasis = req.get("emphasis")
        if emphasis or (emphasis is None and override_of(m)):
            what = "emphasis" if emphasis else (f"knowledge base {m.name!r} has an emphasis override "
                                                f"({override_of(m)}); it")
            raise BadRequest(f"{what} is answered by the transformers engine only (kdn serve "
                             "--engine transformers); vLLM's connector would need a block table "
                             "longer than the prompt's positions. Ask for the exact KV with "
                             "extra_body={\"emphasis\": {}}")
        prompt = ids.tolist() + messages_tokens(self.model, req["messages"])
        self._check_context(len(prompt), req, f"the KB's {len(ids)} tokens and the messages")
        return prompt, ids.tolist()

    def _check_context(self, n: int, req: dict, what: str) -> None:
        total = n + req["max_tokens"]
        if total > self.max_context:
            raise ApiError(400, f"{what} and max_tokens ({req['max_tokens']}) make {total} tokens; "
                                f"the model's context is {self.max_context}", "context_length_exceeded",
                           "messages")

    def _params(self, req: dict):
        """vLLM's SamplingParams of a request, with the connector's kdn_conversation: its
        retention, the regions its earlier turns were answered in, and (kdn_fetch False)
        nothing kept."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind
        fetch = req.get("kdn_fetch", True)
        extra = {} if fetch else {"skip_reading_prefix_cache": True}
        temperature = req["temperature"] or 0.0
        if temperature > 0:
            extra["seed"] = req.get("seed")
        conversation = {"retention": req.get("prompt_cache_retention"),
                        "hints": list(req.get("history_regions") or ()), "keep": bool(fetch)}
        return SamplingParams(max_tokens=req["max_tokens"], temperature=temperature,
                              output_kind=RequestOutputKind.DELTA,
                              extra_args={"kv_transfer_params": {"kdn_conversation": conversation}},
                              **extra)

    async def _engine_call(self, fn, *args):
        """await fn(*args) in the engine's own thread (the replica's event loop stays free)."""
        return await asyncio.get_running_loop().run_in_executor(self._engine_thread, fn, *args)

    async def _generate(self, prompt: list, salt, req: dict, ids: list):
        """Yield vLLM's RequestOutput deltas for one request, the first as soon as its first
        token is sampled (ids gets vLLM's own id of it). A request cancelled or left early (the
        caller went away) is aborted in vLLM: the engine's thread takes the abort before any
        later request."""
        from vllm.inputs import tokens_input
        name = f"kdn-{next(self._ids)}"
        finished = False
        try:
            ids.append(await self._engine_call(self.engine.add_request, name,
                                               tokens_input(prompt, cache_salt=salt), self._params(req)))
            while not finished and await self._engine_call(self.engine.has_unfinished_requests):
                for out in await self._engine_call(self.engine.step):
                    if out.request_id == name:
                        finished = out.finished
                        yield out
            if not finished:
                raise ModelError("vLLM dropped the request before it finished")
        finally:
            if not finished:           # by its name: also when cancelled while being added
                self.counters["aborted"] += 1
                self._engine_thread.submit(self.engine.abort_request, [name], False)

    async def _answer(self, req: dict, tenant: str, token):
        """(prompt, async generator of (text, token count, finish) steps, after whose last one
        self.last holds the answer's totals); KDNError before anything is generated."""
        prompt, kb_tokens = await asyncio.to_thread(self._prompt, req, tenant, token)   # KDN calls block
        return prompt, self._steps(prompt, kb_tokens, salt_of(tenant, req.get("salt")), req)

    async def _steps(self, prompt, kb_tokens, salt, req):
        tokens, cached, report, finish, text, ids = [], 0, {}, None, [], []
        try:
            async with contextlib.aclosing(self._generate(prompt, salt, req, ids)) as outs:
                async for out in outs:
                    o = out.outputs[0]
                    tokens += o.token_ids
                    text.append(o.text)
                    cached = out.num_cached_tokens or 0
                    if out.finished:
                        report = (out.kv_transfer_params or {}).get("kdn") or {}
                        finish = o.finish_reason
                    yield o.text, len(o.token_ids), finish
        finally:                       # an aborted answer counts what it generated
            self._count(prompt, tokens, cached, report)
        if report.get("keep"):         # the reply is out: keep its conversation, off its path
            kept = self._engine_thread.submit(self._keep, ids[0], req["messages"], prompt, tokens,
                                              "".join(text), kb_tokens)
            kept.add_done_callback(self._kept)

    def _keep(self, rid: str, messages, prompt, tokens, text: str, kb_tokens) -> dict:
        """In the engine's thread, after the answer: the connector keeps the conversation as
        far as the next turn's prompt reproduces it (run.keep_limit, run.settle); the next
        request waits for it at most STORE_WAIT_S. The keeper's result."""
        from kdn.engines.vllm.run import STORE_WAIT_S, keep_limit, settle
        limit = keep_limit(self.model, messages, prompt, tokens, text, kb_tokens)
        return settle(self.llm, {rid: limit}, STORE_WAIT_S).get(rid) or {}

    def _kept(self, f) -> None:
        """Count a keep; one that failed on a bug is logged and counted (keep_failures), and
        the next turn recomputes."""
        if f.exception() is not None:
            self.counters["keep_failures"] += 1
            log.error("kdn serve --engine vllm: keeping a conversation's KV failed", exc_info=f.exception())
            return
        got = f.result()
        self.counters["kept_chunks"] += got.get("chunks", 0)
        self.counters["keep_errors"] += got.get("error") is not None

    def _count(self, prompt, tokens, cached, report) -> None:
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cached_tokens"] += cached
        self.counters["completion_tokens"] += len(tokens)
        self.kdn["requests"] += 1
        for k in KDN_REPORT_KEYS:
            self.kdn[k] += int(report.get(k) or 0)
        self.kdn["errors"] += report.get("error") is not None
        self.last = {"tokens": list(tokens), "cached": cached, "prompt_tokens": len(prompt), "kdn": report}

    async def complete(self, req: dict, tenant: str, token) -> dict:
        """{"status", "body"[, "headers"]}: one plain chat completion."""
        self.counters["requests"] += 1
        async with self._turn:
            try:
                prompt, steps = await self._answer(req, tenant, token)
                async with contextlib.aclosing(steps):
                    pieces = [p async for p in steps]
            except KDNError as e:
                return self._error(api_error(e))
            last = self.last
        text = "".join(t for t, _, _ in pieces)
        body = completion(completion_id(), req["model"], text, pieces[-1][2],
                          usage(len(prompt), len(last["tokens"]), last["cached"]), kdn=kv_note())
        return {"status": 200, "body": body, "region": self.region}

    async def stream(self, req: dict, tenant: str, token):
        """Yields {"status", ...} first (200, or the error), then SSE bytes ending in [DONE]."""
        self.counters["streams"] += 1
        async with self._turn:
            try:
                prompt, steps = await self._answer(req, tenant, token)
            except KDNError as e:
                yield self._error(api_error(e))
                return
            yield {"status": 200, "region": self.region}
            async with contextlib.aclosing(steps):   # a caller gone mid-answer: vLLM's request aborted
                async for event in sse_answer(req["model"], steps, len(prompt), lambda: self.last["cached"],
                                              kv_note()):
                    yield event
