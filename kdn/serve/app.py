"""`kdn serve`: knowledge-aware inference workers behind an OpenAI-compatible API, on Ray Serve.

One Serve application per network (named `kdn-<network>`, route prefix "/"):
- one deployment per region (`<region>`, class `RegionWorker`) whose replicas are placed on
  that region's nodes by Ray's node label selector (ray_actor_options label_selector
  {"region": <region>}); each replica loads the model (kdn.engines.transformers.model.load_model, warmed up) and
  reads KV for its region from the nearest live edge (kdn.client.Client with region=), and
  answers with kdn.serve.chat (the KB's tokens, then the request's messages; token by token). It
  admits a few requests and answers them one at a time in arrival order, the model in a
  thread of its own; a caller that goes away stops its answer at the next token. With
  engine "vllm" the replicas are kdn.serve.vllm.VllmRegionWorker (vLLM and KDN's connector);
- an ingress deployment (`router`, class `Ingress`, no CPUs, 2 replicas) that speaks HTTP: it checks the
  token and the request (kdn.serve.api) before any replica is busy, picks the region and
  relays the answer; a stream that breaks (a replica died) ends with an OpenAI error event,
  which the openai client raises, never with a silent end a client could take as complete.

Routes: /<region>/v1/... goes to that region's deployment; /v1/... goes to the caller's
nearest region: the one named in an `X-KDN-Region` header (a regional load balancer or a
client that knows where it runs sets it), else the region where the request entered the
network — Serve's one proxy runs on the head node and the router is placed in the origin's
region, which is the head's under `kdn up` — when it is served, else the served region
nearest to it by the topology's latencies. The caller's address says nothing about its
region here (every node of an embedded cluster is 127.0.0.1), so no guess is made from it.
A chat request for a KB on /v1 may then be answered in another region, when that region's
expected time to first token beats the caller's by more than the round trip between them
(kdn.serve.regions; decided once, in the ingress, never again for that request). The round
trips between regions and the origin's link to each are what the edges measured of their own
links (kdn/placement/links.py, gathered every LINKS_PERIOD_S: measured_links), the topology's
declared figures only where nothing was measured yet. The answer's
X-KDN-Region and X-KDN-Route headers say where it went and why. GET /metrics is the whole
service's routing counters in Prometheus text (kdn.serve.metrics: every ingress replica's).
The proxy binds 127.0.0.1 (`kdn serve --port`, default 8000): nothing listens off loopback.

Errors are OpenAI-shaped: unknown model or KB 404, bad input 400, token missing 401 / wrong
403, overload (a full queue) 429 and no replica available 503, both with Retry-After.

Hostile bodies: the router decides who asks (the token) before it reads a byte of the body,
refuses a Content-Length over MAX_CHAT_BODY_BYTES (8 MiB) unread and reads a chunked body in
its pieces only up to the limit (kdn.serve.api.read_body), each a 413; a body refused unread is
answered with Connection: close, so nobody reads the rest. Serve's HTTP proxy (Ray 2.60,
ray/serve/_private/proxy.py) has no body limit of its own: from the moment a request arrives
a task of the proxy reads the body off the socket as fast as it comes (uvicorn's flow control
never pauses it) into an unbounded queue (http_util.MessageQueue) that the router drains
with receive_asgi_messages, and only when the answer is complete does it stop (the task is
cancelled) and drop the queue. So the body is bounded in the proxy itself, by an ASGI
middleware Serve installs there (kdn/serve/proxy.py, through the environment kdn.core.env sets
before Ray starts): an oversized Content-Length is answered before the proxy reads a byte,
a chunked body once it passes the limit; the router's own check stays for a cluster started
without it (tests/serve/rss_hostile_bodies.py measures each process).
"""
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import logging
import time

from kdn.core.checks import check_int, check_number
from kdn.core.errors import AccessDenied, BadRequest, KDNError, NetworkError
from kdn.core.wire import METRICS_TYPE
from kdn.engines.base import check_engine
from kdn.serve.affinity import Affinity, conversation_id
from kdn.serve.api import (MAX_CHAT_BODY_BYTES, RETRY_AFTER_S, ApiError, api_error, completion,
                           completion_id, credentials, error_body, model_list, parse_chat, parse_json,
                           kv_note, read_body, sse, sse_answer, usage)

log = logging.getLogger("kdn.serve.app")

DEFAULT_PORT = 8000
ROUTER = "router"
REGION_HEADER = "x-kdn-region"
DECISION_BUDGET_S = 0.0005  # the region decision stops weighing farther regions past this
WARM_TIMEOUT_S = 5.0        # the ingress's first call to a region, which makes its router exist
LINKS_PERIOD_S = 10.0       # the region decision's links refreshed from the edges' measurements
LINKS_TIMEOUT_S = 2.0       # an edge asked for its measured links, at most
STORE_WAIT_S = 2.0          # a request waits this long at most for the last answer's KV to be stored


def app_name(network: str) -> str:
    return f"kdn-{network}"


class RegionWorker:
    """One replica of a region's deployment: the model, a KDN client per tenant, kdn.serve.chat."""

    def __init__(self, network: str, region: str, max_context: int = None, variants=(), plans: str = None):
        from kdn.engines.transformers.model import load_model
        from kdn.client.view import node_region
        where = node_region()
        if where != region:     # the label selector placed us; say so loudly if it did not
            raise NetworkError(f"a replica of region {region!r} started on a node of region {where!r}")
        self.network, self.region = network, region
        self.model = load_model()
        self.variants = self._load_variants(variants, plans)   # name -> (model, plan or why none)
        self._crosses = {}          # (tenant, token, name) -> CrossReader
        self._recompute = None      # their shared recompute thread, made on first use
        self.max_context = max_context or int(getattr(self.model.hf.config, "max_position_embeddings", 8192))
        self._chats = {}            # (tenant, token) -> kdn.serve.chat.Chat
        from kdn.serve.router import CONVERSATION_KV_BYTES, EngineKV
        self.engine_kv = EngineKV()  # the KV of its last KBs: what KV-aware routing aims at
        self.conversation_kv = EngineKV(CONVERSATION_KV_BYTES)   # ... and of its last conversations
        # The model runs in one thread of its own; requests take it one at a time in arrival
        # order (asyncio.Lock wakes its waiters first come, first served).
        self._model_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-model")
        # conversation KV goes to its home edge from here, never on the model's time
        self._store_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-keep")
        self._storing = None          # the last store sent there (its next turn may wait for it)
        self._turn = asyncio.Lock()
        # requests, streams, errors, models_calls, aborted (answers cut short: the caller left)
        self.counters = collections.Counter()
        # Warm the way to the edge before the first request, as the model was warmed: the
        # region's view of the network and the open tenant's KB list (a tenant that needs a
        # token is warmed by its first request instead).
        try:
            self._chat("default", None).client.manifests(refresh=True)
        except AccessDenied:
            self._chats.clear()

    def _load_variants(self, folders, plans) -> dict:
        """{name: (model, Plan or the reason there is none)}: the fine-tuned variants served beside
        the model, each with the recompute plan of its pair (kdn model plan) when there is one."""
        from kdn.engines.family import load_plan
        from kdn.engines.transformers.model import load_model
        from kdn.engines.transformers.variant import plans_root
        from kdn.core.errors import ModelError
        out = {}
        for folder in folders:
            m = load_model(variant=folder)
            try:
                plan = load_plan(plans or plans_root(), m.fingerprint, self.model.fingerprint)
            except ModelError as e:      # it reads its own KV; cross_model requests are refused
                plan = str(e)
            out[m.name] = (m, plan)
        return out

    def record_routing_stats(self) -> dict:
        """What its engine holds, for the router (kdn.serve.router; Serve calls it)."""
        return dict(self.engine_kv.routing_stats(),
                    conversations=sorted({c for c, _ in list(self.conversation_kv.entries)}))

    def stats(self) -> dict:
        return {"region": self.region, "counters": dict(self.counters),
                "engine_kv": self.engine_kv.stats(), "conversation_kv": self.conversation_kv.stats(),
                "chats": {"/".join(filter(None, (t, n))): c.stats()["counters"]
                          for (t, _, n), c in self._chats.items()}}

    def _chat(self, tenant: str, token, name: str = None):
        """The Chat of a tenant and token with the model named (None: the base model). A
        variant's has no engine caches of its own here (those the router aims at are the base
        model's): it reads its KV, and keeps its conversations, under its own fingerprint."""
        from kdn.serve.chat import Chat
        from kdn.client import Client
        variant = name is not None and name != self.model.name
        model = self.variants[name][0] if variant else self.model
        key = (tenant, token, model.name if variant else None)
        if key not in self._chats:
            client = Client(network=self.network, region=self.region, tenant=tenant,
                            fingerprint=model.fingerprint, token=token)
            self._chats[key] = Chat(model, client)
            if not variant:
                self._chats[key].engine_kv = self.engine_kv
                self._chats[key].conversation_kv = self.conversation_kv
        return self._chats[key]

    def _cross(self, tenant: str, token, name: str):
        """(Chat, CrossReader) of a variant reading the base model's KV with its pair's plan;
        ApiError 400 where the pair has none here."""
        from kdn.engines.family import Plan
        from kdn.engines.transformers.crossmodel import CrossReader
        model, plan = self.variants[name]
        if not isinstance(plan, Plan):
            raise ApiError(400, f"{name!r} cannot read {self.model.name!r}'s KV here: {plan}",
                           "cross_model_unavailable", "cross_model")
        chat = self._chat(tenant, token, name)
        key = (tenant, token, name)
        if key not in self._crosses:      # never keeps: a reader's token is not the admin's
            if self._recompute is None:   # one thread recomputes for every reader of this replica
                self._recompute = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-recompute")
            self._crosses[key] = CrossReader(chat.client, model, plan, keep=False, pool=self._recompute)
        return chat, self._crosses[key]

    def models(self, tenant: str, token) -> dict:
        """{"status", "body"}: the model list the tenant may read."""
        self.counters["models_calls"] += 1
        try:
            names = [m.name for m in self._chat(tenant, token).client.manifests(refresh=True)]
            own = {v: [m.name for m in self._chat(tenant, token, v).client.manifests(refresh=True)]
                   for v in self.variants}
        except KDNError as e:
            return self._error(api_error(e))
        return {"status": 200, "body": model_list(self.model.name, names, variants=own)}

    def _error(self, e: ApiError) -> dict:
        self.counters["errors"] += 1
        return {"status": e.status, "body": e.body(), "headers": e.headers()}

    def _start(self, req: dict, tenant: str, token):
        """(chat, Turn) for a checked request; KDNError otherwise. A store of the previous
        answer's conversation KV still on its way is waited for (at most STORE_WAIT_S): the
        next turn of a conversation often follows at once, and should find it."""
        if self._storing is not None:
            concurrent.futures.wait([self._storing], timeout=STORE_WAIT_S)
        name = req["model"].partition("@")[0]
        if req.get("cross_model"):
            return self._start_across(req, tenant, token, name)
        chat = self._chat(tenant, token, name)
        m = None if req.get("kb") is None else chat.client.manifest(req["kb"], req["version"])
        self._check_context(chat.model, m, req)
        turn = chat.begin(m, req["messages"], req["max_tokens"], req.get("kdn_fetch", True),
                          req.get("emphasis"), salt=req.get("salt"),
                          retention=req.get("prompt_cache_retention"), hints=req.get("history_regions") or (),
                          conversation=req.get("conversation"))
        return chat, turn

    def _check_context(self, model, m, req: dict) -> None:
        """ApiError 400 when the KB (m, or None), the messages and max_tokens pass the context."""
        if m is None:
            n = len(model.chat_tokens(req["messages"]))
            what = f"the messages' {n} tokens"
        else:
            from kdn.serve.chat import messages_tokens
            n = len(m.token_ids()) + len(messages_tokens(model, req["messages"]))
            what = f"the KB's {len(m.token_ids())} tokens and the messages' {n - len(m.token_ids())}"
        total = n + req["max_tokens"]
        if total > self.max_context:
            raise ApiError(400, f"{what} and max_tokens ({req['max_tokens']}) make {total} tokens; "
                                f"the model's context is {self.max_context} tokens",
                           "context_length_exceeded", "messages")

    def _start_across(self, req: dict, tenant: str, token, name: str):
        """(chat, Turn) of a variant over the base model's KV of the KB, the plan's layers
        recomputed (CrossReader.prepare); never exact, never kept."""
        from kdn.serve.chat import Turn, messages_tokens
        chat, reader = self._cross(tenant, token, name)
        m = reader.sender.manifest(req["kb"], req["version"])     # 404 where the base has no such KB
        self._check_context(chat.model, m, req)
        cache, n, f = reader.prepare(req["kb"], messages_tokens(chat.model, req["messages"]), req["max_tokens"],
                                     m.version)
        self.counters["cross_model"] += 1
        return chat, Turn(f["prompt"], cache, n, req["messages"], kb_tokens=f["know"], exact=False,
                          cross_model=reader.plan.describe())

    def _keep_later(self, chat, turn, steps) -> None:
        """After the reply: the conversation's new KV copied out in the model's thread (before
        the next request can touch the cache) and sent to its home edge from the store thread,
        so neither this answer nor the next waits for the edge. A store that fails on a bug is
        logged and counted (stats: keep_failures); the next turn then recomputes."""
        tokens = [s.token for s in steps if s.token is not None]
        text = "".join(s.text for s in steps)
        copied = self._model_thread.submit(chat.to_keep, turn, tokens, text)

        def send(f):
            if f.exception() is not None:
                self._kept(None, f.exception())
                return
            self._storing = self._store_thread.submit(chat.store, f.result())
            self._storing.add_done_callback(
                lambda g: self._kept(g.result() if g.exception() is None else None, g.exception()))
        copied.add_done_callback(send)

    def _kept(self, got, error) -> None:
        if error is not None:
            self.counters["keep_failures"] += 1
            log.error("kdn serve: keeping a conversation's KV failed", exc_info=error)
        elif got["chunks"]:
            self.counters["kept_chunks"] += got["chunks"]

    async def _on_model(self, fn, *args):
        """await fn(*args) in the model's own thread (the replica's event loop stays free)."""
        return await asyncio.get_running_loop().run_in_executor(self._model_thread, fn, *args)

    async def _steps(self, chat, turn, req: dict):
        """kdn.serve.chat's Steps, each computed in the model's thread. A caller that goes away
        (Serve cancels its request) stops the generation at the next token: the rest of the
        answer is not computed while later requests wait, and nothing of it is kept. A whole
        answer's conversation KV is kept after it (_keep_later)."""
        gen = chat.stream(turn.prompt, turn.cache, turn.cached, req["max_tokens"], req["temperature"],
                          req["seed"])
        done, steps = False, []
        try:
            while (step := await self._on_model(next, gen, None)) is not None:
                done = step.finish is not None
                steps.append(step)
                yield step
        finally:
            if not done:
                self.counters["aborted"] += 1
            self._model_thread.submit(gen.close)     # in its thread: never while a step runs
            if done:
                self._keep_later(chat, turn, steps)

    async def complete(self, req: dict, tenant: str, token) -> dict:
        """{"status", "body"[, "headers"]}: one plain chat completion."""
        self.counters["requests"] += 1
        async with self._turn:
            t0 = asyncio.get_running_loop().time()
            try:
                chat, turn = await self._on_model(self._start, req, tenant, token)
                async with contextlib.aclosing(self._steps(chat, turn, req)) as gen:
                    steps = [s async for s in gen]
            except KDNError as e:
                return self._error(api_error(e))
            self.engine_kv.served(asyncio.get_running_loop().time() - t0)
        text = "".join(s.text for s in steps)
        n = sum(1 for s in steps if s.token is not None)
        body = completion(completion_id(), req["model"], text, steps[-1].finish,
                          usage(len(turn.prompt), n, turn.cached),
                          kdn=kv_note(getattr(turn.cache, "kdn_emphasis", None), turn.cross_model))
        return {"status": 200, "body": body, "region": self.region}

    async def stream(self, req: dict, tenant: str, token):
        """Yields {"status", ...} first (200, or the error), then SSE bytes ending in [DONE]."""
        self.counters["streams"] += 1
        async with self._turn:
            try:
                chat, turn = await self._on_model(self._start, req, tenant, token)
            except KDNError as e:
                yield self._error(api_error(e))
                return
            yield {"status": 200, "region": self.region}
            async with contextlib.aclosing(self._steps(chat, turn, req)) as gen:
                pieces = ((s.text, int(s.token is not None), s.finish) async for s in gen)
                note = kv_note(getattr(turn.cache, "kdn_emphasis", None), turn.cross_model)
                async for event in sse_answer(req["model"], pieces, len(turn.prompt), turn.cached, note):
                    yield event


class Ingress:
    """The ingress: HTTP in, a region's deployment chosen, the answer relayed (see the module)."""

    def __init__(self, workers: dict, nearest: dict, auth: dict, base_model: str, links: dict = None,
                 network: str = None, variants=()):
        from kdn.core.auth import Tokens
        from kdn.client.view import node_region
        self.workers = workers                # region -> DeploymentHandle
        self.nearest = nearest                # region -> [regions with a deployment, nearest first]
        self.tokens = Tokens.from_dict(auth)
        self.base_model = base_model
        self.variants = tuple(variants)       # the fine-tuned variants' names the replicas run
        # links: "rtt_s" {home: {region: round trip s}}, "origin" {region: (latency s, bytes/s)}
        self.links = links or {"rtt_s": {}, "origin": {}}
        self.declared = self.links        # the topology's: what stands where nothing is measured
        self.network = network
        self._links_at = 0.0
        self.home = node_region()
        self.in_flight = collections.Counter()  # region -> this replica's requests there now
        self.affinity = Affinity()              # conversation -> the region that answered it
        # requests, streams, errors_<status>, broken_streams, streams_left (callers gone
        # mid-answer), region_<name>, route_<outcome>, tier_<tier>, route_decisions,
        # route_decision_us, retried_replica_died
        self.counters = collections.Counter()
        self._publisher = None
        self.publish_failure = None   # the bug that stopped the counter loop, if one did
        try:    # Serve runs the constructor on the replica's event loop: start at once
            self._start_publisher(asyncio.get_running_loop())
        except RuntimeError:    # no loop here (constructed outside Serve): the first request starts it
            pass

    def _start_publisher(self, loop) -> None:
        if self._publisher is None and self.network is not None:
            self._publisher = loop.create_task(self._publish_counters())
            self._publisher.add_done_callback(self._publisher_stopped)

    def _publisher_stopped(self, task) -> None:
        """The counter loop only ends on a bug (or the replica's shutdown): say so in stats()."""
        if not task.cancelled() and task.exception() is not None:
            e = task.exception()
            self.publish_failure = f"{type(e).__name__}: {e}"
            log.error("kdn serve: the ingress's counter loop stopped on a bug", exc_info=e)

    def stats(self) -> dict:
        from kdn.serve.router import routing_counters
        return {"home": self.home, "counters": dict(self.counters), "routing": routing_counters(),
                "publish_failure": self.publish_failure}

    def snapshot(self) -> dict:
        """This replica's counters for /metrics and `kdn status` (kdn.serve.metrics)."""
        from kdn.serve.router import replica_kv_sources, routing_counters_by_region
        app = app_name(self.network) if self.network else None
        return {"counters": dict(self.counters), "routing": routing_counters_by_region(app),
                "kv_sources": replica_kv_sources(app)}

    def pick(self, request, path_region: str, kb: str = None) -> tuple:
        """(region, why) for a request: the region its path names ("pinned"), else the
        caller's (X-KDN-Region, else where the request entered) unless, for a KB's request,
        another region's expected time to first token beats it by more than the round trip
        (kdn.serve.regions)."""
        if path_region is not None:
            if path_region not in self.workers:
                raise ApiError(404, f"no service in region {path_region!r:.64} (regions: "
                                    f"{', '.join(sorted(self.workers))})", "unknown_region")
            return path_region, "pinned"
        asked = request.headers.get(REGION_HEADER)
        if asked:
            if asked not in self.workers:
                raise ApiError(400, f"{REGION_HEADER} names region {asked!r:.64}; the service runs in "
                                    f"{', '.join(sorted(self.workers))}", "unknown_region")
            home = asked
        else:
            home = (self.nearest.get(self.home) or sorted(self.workers))[0]
        if kb is None:
            return home, "home"
        return self.across(home, kb)

    def across(self, home: str, kb: str) -> tuple:
        """(region, why) for a request for kb whose caller is in home (kdn.serve.regions), counted."""
        from kdn.serve.regions import View, decide_region
        from kdn.serve.router import region_routers
        t0 = time.perf_counter()
        routers = region_routers(app_name(self.network)) if self.network else {}
        views = {}
        for r in self.nearest.get(home) or sorted(self.workers):    # home first, then nearest first
            if views and time.perf_counter() - t0 > DECISION_BUDGET_S:   # home always; farther ones not
                self.counters["route_over_budget"] += 1
                break
            views[r] = routers[r].view(kb, self.in_flight[r]) if r in routers else None
        nbytes = next((n for rt in routers.values() if (n := rt.kv_bytes(kb)) is not None), None)
        for r, v in views.items():          # never fetched there: the origin's link, at the KB's size
            if v is not None and v.tier == "unknown" and nbytes is not None and r in self.links["origin"]:
                lat, bw = self.links["origin"][r]
                views[r] = View(v.wait_s, lat + nbytes / bw, "origin_estimate")
        region, why = decide_region(home, views, self.links["rtt_s"].get(home, {}))
        self.counters["route_decision_us"] += int((time.perf_counter() - t0) * 1e6)
        self.counters["route_decisions"] += 1
        self.counters[f"tier_{views[region].tier if views.get(region) else 'unknown'}"] += 1
        return region, why

    async def __call__(self, request):
        from ray.exceptions import RayTaskError
        from starlette.responses import JSONResponse
        self.counters["requests"] += 1
        try:
            return await self._handle(request)
        except KDNError as e:               # refusals: ApiError, or KDN's own named errors
            e = api_error(e)
            self.counters[f"errors_{e.status}"] += 1
            headers = e.headers()
            if request.method == "POST" and not getattr(request.state, "body_read", False):
                headers["Connection"] = "close"     # refused unread: not drained, not kept alive
            return JSONResponse(e.body(), status_code=e.status, headers=headers)
        except RayTaskError:                # a worker failed on a bug: logged, answered OpenAI-shaped
            log.exception("kdn serve: a worker failed on %s %s", request.method, request.url.path)
            self.counters["errors_500"] += 1
            return JSONResponse(error_body(500, "a worker of the KDN service failed (logged)", "internal_error"),
                                status_code=500)

    def _route(self, path: str) -> tuple:
        """(region or None, endpoint) for /v1/<endpoint> or /<region>/v1/<endpoint>."""
        parts = [p for p in path.split("/") if p]
        region = None
        if parts and parts[0] != "v1":
            region, parts = parts[0], parts[1:]
        if not parts or parts[0] != "v1":
            raise ApiError(404, f"no route {path!r:.120}: use /v1/... or /<region>/v1/...", "unknown_route")
        return region, "/".join(parts[1:])

    async def _metrics(self):
        """GET /metrics: the whole service's counters (every ingress replica's, kdn.serve.metrics)."""
        from starlette.responses import Response
        from kdn.serve import metrics
        await asyncio.to_thread(metrics.publish, self.network, self._replica_id(), self.snapshot())
        body = metrics.exposition(await asyncio.to_thread(metrics.gather, self.network))
        return Response(body, media_type=METRICS_TYPE)

    def _replica_id(self) -> str:
        from ray import serve
        return serve.get_replica_context().replica_tag

    async def _publish_counters(self):
        """Every PUBLISH_PERIOD_S: this replica's snapshot to the GCS store (kdn.serve.metrics),
        and each region's request router in this process made to exist (a region this replica
        never sent to would have no View). What the GCS store can answer (a Ray error, a lost
        connection, a timeout) is counted and logged, and the next period tries again; anything
        else is a bug: it ends the loop, and stats() shows it (publish_failure)."""
        from ray.exceptions import RayError
        from kdn.serve import metrics
        warmed = set()
        while True:
            try:
                await asyncio.to_thread(metrics.publish, self.network, self._replica_id(), self.snapshot())
                if len(warmed) < len(self.workers):
                    warmed |= await self._warm(set(self.workers) - warmed)
                if time.monotonic() - self._links_at > LINKS_PERIOD_S:
                    self._links_at = time.monotonic()
                    await self._measure_links()
            except (RayError, ConnectionError, TimeoutError) as e:
                self.counters["publish_failures"] += 1
                log.warning("kdn serve: publishing the ingress's counters failed (%s: %s); retrying",
                            type(e).__name__, e)
            await asyncio.sleep(metrics.PUBLISH_PERIOD_S)

    async def _measure_links(self) -> None:
        """The links the region decision uses, from what the network's edges measured of
        their own (measured_links); an edge that does not answer is left out this period."""
        from kdn.core.rpc import Actors
        actors = Actors(self.network, self.tokens.admin)
        m = await actors.origin(LINKS_TIMEOUT_S, "try").membership()
        if m is None:
            self.counters["links_unmeasured"] += 1
            return
        members = [(name, region) for name, region, _ in m["members"]]
        got = await asyncio.gather(*(actors.edge(name, LINKS_TIMEOUT_S, "try").stats() for name, _ in members))
        edges = {name: {"region": region, "links": st.get("links")}
                 for (name, region), st in zip(members, got) if st is not None}
        self.links = measured_links(self.declared, edges)
        self.counters["links_measured"] += 1

    async def _warm(self, regions) -> set:
        """The regions whose request router now exists in this process: a call through a
        handle creates it (Serve makes it for the first call); a region with no replica up
        yet, or a full one, is tried again next period."""
        from ray import serve
        from ray.exceptions import RayActorError

        async def one(r):
            try:
                await asyncio.wait_for(self.workers[r].stats.remote(), WARM_TIMEOUT_S)
                return r
            except (asyncio.TimeoutError, RayActorError, serve.exceptions.BackPressureError,
                    serve.exceptions.DeploymentUnavailableError, serve.exceptions.ReplicaUnavailableError):
                return None
        return {r for r in await asyncio.gather(*(one(r) for r in sorted(regions))) if r is not None}

    async def _handle(self, request):
        from ray import serve
        from ray.exceptions import RayActorError
        self._start_publisher(asyncio.get_running_loop())
        if request.url.path == "/metrics" and self.network is not None:
            if request.method != "GET":
                raise ApiError(405, f"/metrics takes GET, not {request.method}", "method_not_allowed")
            return await self._metrics()
        region, endpoint = self._route(request.url.path)
        routes = {"chat/completions": "POST", "models": "GET"}
        if endpoint not in routes:
            raise ApiError(404, f"no endpoint /v1/{endpoint:.80}: this service has /v1/chat/completions "
                                "and /v1/models", "unknown_route")
        if request.method != routes[endpoint]:
            raise ApiError(405, f"/v1/{endpoint} takes {routes[endpoint]}, not {request.method}",
                           "method_not_allowed")
        # who asks, before a byte of the body is read; token: what the edges are shown (the
        # caller's read token or the admin's, None for an open tenant: replicas keep a client
        # per token, so a caller's made-up keys must not each get one)
        tenant, token = credentials(self.tokens, request.headers.get("authorization"))
        if endpoint == "chat/completions":
            raw = await read_body(request, MAX_CHAT_BODY_BYTES)
            request.state.body_read = True
            req = parse_chat(parse_json(raw), self.base_model, self.variants)
        kb = None if endpoint == "models" or req.kb is None else f"{tenant}/{req.kb}"
        conversation = seen = None
        if endpoint == "chat/completions":
            conversation = req.conversation = conversation_id(tenant, kb, req.messages, req.prompt_cache_key)
            # a first turn (no answer in it yet, no prompt_cache_key) has no history to follow:
            # the same question asked again is a new conversation, routed as any request
            follows = req.prompt_cache_key is not None or any(m["role"] == "assistant" for m in req.messages)
            seen = self.affinity.region_of(conversation) if follows else None
        if seen in self.workers and region is None and not request.headers.get(REGION_HEADER):
            region, why = seen, "conversation"    # where its earlier turns' KV is
        else:
            region, why = self.pick(request, region, kb)
        if seen is not None and seen != region:
            req.history_regions = (seen,)         # the worker looks for the history there too
        if kb is not None or why == "conversation":   # a KB's or a conversation's region decision
            self.counters[f"route_{why}"] += 1
        self.counters[f"region_{region}"] += 1
        where = [region]                # the region answering (a retry may move it once: _cross_once)
        routed = {"X-KDN-Region": region, "X-KDN-Route": why}
        self.in_flight[region] += 1     # until its answer (a stream: its first event) came

        def again():
            self._cross_once(where, why, kb, routed)
        try:
            if endpoint == "models":
                return self._reply(await self.workers[region].models.remote(tenant, token))
            body = dict(req.__dict__)
            if not req.stream:
                r = await self._twice(lambda: self.workers[where[0]].complete.remote(body, tenant, token), again)
                if r["status"] == 200:
                    self.affinity.answered(conversation, where[0])
                return self._reply(r, routed)
            self.counters["streams"] += 1

            async def head_of():
                gen = self.workers[where[0]].options(stream=True).stream.remote(body, tenant, token)
                return gen, await gen.__anext__()
            gen, head = await self._twice(head_of, again)
            if head["status"] != 200:
                return self._reply(head, routed)
            self.affinity.answered(conversation, where[0])
            return self._streaming(gen, routed)
        except serve.exceptions.BackPressureError:
            raise ApiError(429, f"region {where[0]}'s workers are all busy and their queues full; retry",
                           "overloaded", retry_after=RETRY_AFTER_S) from None
        except (serve.exceptions.DeploymentUnavailableError, serve.exceptions.ReplicaUnavailableError,
                RayActorError, StopAsyncIteration) as e:
            raise ApiError(503, f"no worker of region {where[0]} could answer ({type(e).__name__}); retry",
                           "unavailable", retry_after=RETRY_AFTER_S) from None
        finally:
            self.in_flight[where[0]] -= 1

    def _cross_once(self, where: list, why: str, kb, routed: dict) -> None:
        """Before the retry of a request whose replica died: one that stayed home may now go
        to a neighbour, decided afresh (home may have no replica left: Serve dropped the dead
        one from its router); one that crossed regions, or named its region, stays."""
        if kb is None or why not in ("home", "no_view"):
            return
        region, now = self.across(where[0], kb)
        if region == where[0]:
            return
        self.in_flight[where[0]] -= 1
        self.in_flight[region] += 1
        self.counters[f"route_{now}"] += 1
        self.counters[f"region_{region}"] += 1
        where[0] = region
        routed.update({"X-KDN-Region": region, "X-KDN-Route": now})

    async def _twice(self, call, before_retry=None):
        """await call(), once more (after before_retry(), which may move it to another region)
        when the replica died before it answered (nothing of the answer was sent yet, so the
        retry is invisible to the caller)."""
        from ray import serve
        from ray.exceptions import RayActorError
        try:
            return await call()
        except (RayActorError, serve.exceptions.ReplicaUnavailableError):
            self.counters["retried_replica_died"] += 1
            if before_retry is not None:
                before_retry()
            return await call()

    def _reply(self, r: dict, routed: dict = None):
        from starlette.responses import JSONResponse
        if r["status"] != 200:
            self.counters[f"errors_{r['status']}"] += 1
        return JSONResponse(r["body"], status_code=r["status"], headers={**(r.get("headers") or {}),
                                                                         **(routed or {})})

    def _streaming(self, gen, routed: dict = None):
        from ray import serve
        from ray.exceptions import RayActorError, RayTaskError
        ended = []

        async def relay():
            try:
                async for piece in gen:
                    yield piece
            except (RayActorError, RayTaskError, serve.exceptions.RayServeException) as e:
                # the worker died or failed mid-answer: end with an error event (the openai
                # client raises APIError on it), never with an end that looks complete
                self.counters["broken_streams"] += 1
                yield sse(error_body(503, f"the answer broke off: its worker failed ({type(e).__name__}); "
                                          "retry the request", "stream_broken"))
            ended.append(True)

        def left():
            if not ended:       # the caller left mid-answer (the response cancelled or its send failed):
                self.counters["streams_left"] += 1
                gen.cancel()    # the worker stops now, not whenever Ray's cancel reaches it
        return _relayed_class()(relay(), left, media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache", **(routed or {})})


@functools.cache
def _relayed_class():
    """StreamingResponse with on_exit() run however its sending ends: sent, the caller gone (the
    response cancelled, a send failed), or before its body was first read. (A body generator's
    own finally runs only where the cancel finds it awaiting; otherwise when it is collected.)"""
    from starlette.responses import StreamingResponse

    class Relayed(StreamingResponse):
        def __init__(self, content, on_exit, **kw):
            super().__init__(content, **kw)
            self.on_exit = on_exit

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.on_exit()
    return Relayed


def nearest_regions(topology, regions) -> dict:
    """region -> the served regions, nearest first by the topology's latency (itself first)."""
    out = {}
    for src in topology.regions:
        out[src] = sorted(regions, key=lambda r: (0 if r == src else 1, topology.latency_ms(src, r), r))
    return out


def links_of(topology, regions) -> dict:
    """What the ingress's region decision needs of the topology (kdn.serve.regions): "rtt_s",
    {caller's region: {served region: the round trip between them, seconds}}, and "origin",
    {served region: (one-way latency s, bytes/s) of the origin's link to it}."""
    o = topology.origin_region
    return {"rtt_s": {src: {r: 2 * topology.latency_ms(src, r) / 1000 for r in regions} for src in topology.regions},
            "origin": {r: (topology.latency_ms(o, r) / 1000, topology.bandwidth_gbps(o, r) * 1e9) for r in regions}}


def measured_links(declared: dict, edges: dict) -> dict:
    """links_of's answer with what the edges measured of their own links (kdn/placement/links.py)
    standing in for the topology's declared figures wherever there is a measurement.

    edges: edge name -> {"region", "links": {node: {"round_trip_ms", "gbps"}}} (their stats).
    rtt_s[a][b] (a != b): the least round trip any edge of region a measured to an edge of b;
    origin[r]: half the least round trip an edge of r measured to the origin, and the best
    throughput one of them measured from it. What nobody measured keeps its declared value."""
    region_of = {name: e["region"] for name, e in edges.items()}
    rtt = {}                                      # (a, b) -> least round trip, s
    origin = {}                                   # r -> [least round trip s, best bytes/s]
    for name, e in edges.items():
        a = e["region"]
        for node, m in (e.get("links") or {}).items():
            ms, gbps = m.get("round_trip_ms"), m.get("gbps")
            if node == "origin":
                o = origin.setdefault(a, [None, None])
                if ms is not None:
                    o[0] = ms / 1e3 if o[0] is None else min(o[0], ms / 1e3)
                if gbps:
                    o[1] = gbps * 1e9 if o[1] is None else max(o[1], gbps * 1e9)
            elif ms is not None and node in region_of and region_of[node] != a:
                b = region_of[node]
                rtt[(a, b)] = min(rtt.get((a, b), ms / 1e3), ms / 1e3)
    out = {"rtt_s": {src: dict(row) for src, row in declared["rtt_s"].items()},
           "origin": dict(declared["origin"])}
    for (a, b), s in rtt.items():
        if a in out["rtt_s"] and b in out["rtt_s"][a]:
            out["rtt_s"][a][b] = s
    for r, (rt, bw) in origin.items():
        if r in out["origin"]:
            lat, dbw = out["origin"][r]
            out["origin"][r] = (lat if rt is None else rt / 2, dbw if bw is None else bw)
    return out


def check_autoscaling(min_replicas: int = 1, max_replicas: int = 1, target_ongoing_requests: float = 1.0) -> dict:
    for what, v in (("min_replicas", min_replicas), ("max_replicas", max_replicas)):
        check_int(v, what, 0)
    if max_replicas < max(1, min_replicas):
        raise BadRequest(f"max_replicas ({max_replicas}) must be at least min_replicas ({min_replicas}) and 1")
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": check_number(target_ongoing_requests, "target_ongoing_requests", 0,
                                                    open_lo=True)}


def worker_class(engine: str):
    """The replica class of an engine (kdn.engines.base.ENGINES): RegionWorker (transformers,
    kdn.serve.chat) or, where vLLM is installed, kdn.serve.vllm.VllmRegionWorker (vLLM with
    the KDN connector)."""
    if check_engine(engine) == "transformers":
        return RegionWorker
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        raise BadRequest("engine 'vllm' needs vLLM, which is not installed here (the vllm extra: "
                         "see the README); the default engine is 'transformers'")
    from kdn.serve.vllm import VllmRegionWorker
    return VllmRegionWorker


def deploy(network: str = "kdn", regions=None, port: int = DEFAULT_PORT, auth: dict = None,
           min_replicas: int = 1, max_replicas: int = 1, target_ongoing_requests: float = 1.0,
           replica_cpus: float = 1.0, max_queued_requests: int = 16, base_model: str = None,
           engine: str = "transformers", routers: int = 2, max_ongoing_requests: int = 16,
           routing: str = "kv", variants=(), plans: str = None) -> dict:
    """Deploy (or update) the service of `network` on the connected Ray cluster; returns
    service_info(). variants: fine-tuned variants of the model the replicas run beside it
    (recipe names of kdn.engines.transformers.variant, built, or their folders), requested as
    "<model>+<recipe>"; plans: where their pairs' recompute plans are (default the model
    cache's, `kdn model plan`). regions: those to serve (default every region of the topology).
    auth: the network's tokens ({"admin", "readers"}, as `kdn up` configured them).
    engine: "transformers" (default) or "vllm" (worker_class). routers: replicas of the
    ingress, so one that dies does not take the API down while Serve replaces it.
    max_ongoing_requests: requests a replica admits; it answers them one at a time in arrival
    order. Past them, up to max_queued_requests per region wait in each router's queue
    (Serve queues per caller); more are answered 429. Admitting many keeps the order fair:
    Serve retries a full replica with backoff, out of order. 16 clients on one replica
    (`kdn bench serve`): p50/p99 12.5/13.0 s admitting 16, 7.2/19.2 s admitting 4.
    routing: "kv" (kdn.serve.router: to the replica whose engine holds the KB) or "default"
    (Serve's power of two choices)."""
    from ray import serve
    from kdn.client import Client
    from kdn.engines.transformers.model import MODEL_NAME
    scaling = check_autoscaling(min_replicas, max_replicas, target_ongoing_requests)
    worker = worker_class(engine)
    for what, v in (("routers", routers), ("max_ongoing_requests", max_ongoing_requests),
                    ("max_queued_requests", max_queued_requests)):
        check_int(v, what, 1)
    check_int(port, "port", 1, 65535)
    topo = Client(network=network).topology
    regions = list(regions or topo.regions)
    unknown = [r for r in regions if r not in topo.regions]
    if unknown:
        raise BadRequest(f"unknown region(s) {unknown}; the network has {topo.regions}")
    if routing not in ("kv", "default"):
        raise BadRequest(f"routing must be 'kv' or 'default', got {routing!r:.40}")
    folders, names = variant_folders(variants, engine)
    from pathlib import Path
    if plans is not None and not Path(plans).is_dir():
        raise BadRequest(f"plans {str(plans)!r:.200} is not a folder (`kdn model plan` writes the pairs' plans)")
    from ray.serve.config import RequestRouterConfig
    from kdn.serve.router import router_config
    routed = {"request_router_config": RequestRouterConfig(**router_config())} if routing == "kv" else {}
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    workers = {}
    for r in regions:
        d = serve.deployment(worker).options(
            name=r, max_ongoing_requests=max_ongoing_requests, max_queued_requests=max_queued_requests,
            autoscaling_config=scaling, health_check_period_s=5, health_check_timeout_s=60,
            graceful_shutdown_timeout_s=5, **routed,
            ray_actor_options={"label_selector": {"region": r}, "num_cpus": replica_cpus})
        workers[r] = d.bind(network, r, **({"auth": auth or {}} if engine == "vllm" else {}),
                            **({"variants": folders, "plans": plans and str(Path(plans).resolve())}
                               if folders else {}))
    router = serve.deployment(Ingress).options(
        name=ROUTER, num_replicas=routers, max_ongoing_requests=1000,
        ray_actor_options={"num_cpus": 0, "label_selector": {"region": topo.origin_region}})
    app = router.bind(workers, nearest_regions(topo, regions), auth or {}, base_model or MODEL_NAME,
                      links_of(topo, regions), network, names)
    serve.run(app, name=app_name(network), route_prefix="/")
    return service_info(network)      # the port Serve listens on (a running Serve keeps its own)


CONFIG_KEYS = {"regions", "port", "min_replicas", "max_replicas", "target_ongoing_requests",
               "replica_cpus", "max_ongoing_requests", "max_queued_requests", "engine", "routers",
               "routing", "variants", "plans"}


def variant_folders(variants, engine: str = "transformers") -> tuple:
    """([folder], [model name]) of the variants named (a recipe name, built here, or a
    variant's folder); BadRequest for anything else."""
    from pathlib import Path
    if not variants:
        return [], []
    if isinstance(variants, str) or not all(isinstance(v, str) for v in variants):
        raise BadRequest(f"variants must be a list of recipe names or variant folders, got {variants!r:.80}")
    if check_engine(engine) != "transformers":
        raise BadRequest("variants are served by the transformers engine only")
    from kdn.engines.transformers import variant
    from kdn.engines.transformers.model import MODEL_NAME
    folders, names = [], []
    for v in variants:
        folder = (variant.built(v) if v in variant.RECIPES
                  else Path(v).resolve())         # the replicas' working folder is not ours
        record = variant.read_record(folder)
        if record is None:
            raise BadRequest(f"variant {v!r:.120} is neither a recipe ({', '.join(variant.RECIPES)}) nor a "
                             f"built variant's folder")
        folders.append(str(folder))
        names.append(f"{MODEL_NAME}+{record['recipe']['name']}")
    if len(set(names)) != len(names):
        raise BadRequest(f"variants name one model twice: {names}")
    return folders, names


def load_config(path) -> dict:
    """deploy()'s settings from a TOML file (the keys of CONFIG_KEYS, top level); BadRequest
    naming the file and the key otherwise."""
    import tomllib
    try:
        with open(path, "rb") as f:
            d = tomllib.load(f)
    except FileNotFoundError:
        raise BadRequest(f"serve config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise BadRequest(f"serve config {path}: not TOML: {e}") from None
    unknown = sorted(set(d) - CONFIG_KEYS)
    if unknown:
        raise BadRequest(f"serve config {path}: unknown key(s) {unknown}; known: {sorted(CONFIG_KEYS)}")
    for key in ("regions", "variants"):
        if key in d and (not isinstance(d[key], list) or not all(isinstance(r, str) for r in d[key])):
            raise BadRequest(f"serve config {path}: {key} must be a list of names")
    return d


def running_info(network: str = "kdn") -> dict:
    """service_info() when Serve runs on the connected cluster, with "routing", the counters
    of its ingress summed (kdn.serve.metrics.gather: {} before its first request), else {}
    (starts nothing)."""
    from ray.serve.context import _get_global_client
    from kdn.serve.metrics import gather
    if _get_global_client(raise_if_no_controller_running=False) is None:
        return {}
    info = service_info(network)
    if info:
        info["routing"] = gather(network)
    return info


SETTINGS = ("max_ongoing_requests", "max_queued_requests")
SCALING = ("min_replicas", "max_replicas", "target_ongoing_requests")


def service_info(network: str = "kdn", port: int = None) -> dict:
    """The service's URLs, regions, and per deployment its replicas (by state, and the
    addresses of the nodes the running ones are on), and the settings Serve runs it with
    (admission, queue, autoscaling or a fixed count) ({} when none is deployed)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    st = serve.status()
    app = st.applications.get(app_name(network))
    if app is None:
        return {}
    client = _get_global_client()
    if port is None:
        port = client.http_config.port
    base = f"http://127.0.0.1:{port}"
    details = client.get_serve_details().get("applications", {}).get(app_name(network), {})
    deps = {}
    for name, d in app.deployments.items():
        detail = details.get("deployments", {}).get(name, {})
        cfg = detail.get("deployment_config", {})
        scaling = cfg.get("autoscaling_config")
        running = [r for r in detail.get("replicas", []) if str(r.get("state")).endswith("RUNNING")]
        deps[name] = {"status": str(d.status.value if hasattr(d.status, "value") else d.status),
                      "replicas": {str(k.value if hasattr(k, "value") else k): v
                                   for k, v in (d.replica_states or {}).items()},
                      "nodes": sorted(r.get("node_ip") or "?" for r in running),
                      **{k: cfg.get(k) for k in SETTINGS},
                      "autoscaling": {k: scaling.get(k) for k in SCALING} if scaling else None,
                      "num_replicas": None if scaling else cfg.get("num_replicas")}
    regions = sorted(n for n in deps if n != ROUTER)
    return {"app": app_name(network), "status": str(app.status.value if hasattr(app.status, "value") else app.status),
            "url": f"{base}/v1", "regions": {r: f"{base}/{r}/v1" for r in regions},
            "deployments": deps}


def undeploy(network: str = "kdn") -> bool:
    """Delete the network's service; Serve itself stops when it serves nothing else. False
    when there was none (starts nothing)."""
    from ray import serve
    from ray.serve.context import _get_global_client
    if _get_global_client(raise_if_no_controller_running=False) is None:
        return False
    if app_name(network) not in serve.status().applications:
        return False
    serve.delete(app_name(network))
    from kdn.serve.metrics import forget
    forget(network)
    if not serve.status().applications:
        serve.shutdown()
    return True
