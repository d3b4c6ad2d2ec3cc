"""`kdn serve` through the official openai client, on a real local network with the real model.

A KB ('rights', the Bill of Rights: a partial last chunk) is published with SmolLM2 to a
3-region network whose default tenant needs a read token; the service is deployed once for
the module in two regions (us-east, eu-west), each with one replica placed by node label.
Answers, plain and streamed, must be the tokens `kdn query --check` (kdn.engines.transformers.worker.answer with
check=True: both with KDN and with a full prefill) gives for the same KB and question, and
usage.prompt_tokens_details.cached_tokens the KB's tokens. Then every error the API promises,
concurrent clients in both regions, the routing counters (/metrics, `kdn status`), a replica
killed while requests run (none fails) and a replica killed in the middle of a stream.
"""
import collections
import json
import os
import threading
import time
import uuid

import httpx
import openai
import pytest
import ray

from kdn.client import Client
from kdn.launch.cluster import free_ports, start_network, stop_network
from kdn.cli.knowledge import bundled_documents
from kdn.engines.transformers.model import MODEL_NAME
from kdn.placement.topology import Topology
from kdn.client.publish import publish_documents
from kdn.engines.transformers.worker import answer

REGIONS = ("us-east", "eu-west", "ap-south")
SERVED = ["us-east", "eu-west"]
ADMIN = "admin-" + "a" * 32
READ = "read-default-" + "r" * 24
ACME = "read-acme-" + "c" * 24
QUESTION = "What does the first amendment protect?"
NEW_TOKENS = 12
ROUTERS = 3


# `model`: tests/conftest.py (the real model, one intra-op thread)


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory, model, kdn_cli):
    """The network, the KB, the expected answer and the service, deployed by `kdn serve`."""
    auth = {"admin": ADMIN, "readers": {"default": READ, "acme": ACME}}
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    name = f"s{uuid.uuid4().hex[:8]}"
    net = start_network(topo, tmp_path_factory.mktemp(name), network=name, auth=auth)
    pub = Client(network=name, region="us-east", fingerprint=model.fingerprint, admin_token=ADMIN)
    docs = dict(bundled_documents())
    receipt = publish_documents(pub, model, "rights", [("bill-of-rights", docs["bill-of-rights"])])
    reader = Client(network=name, region="eu-west", fingerprint=model.fingerprint, token=READ)
    expected = answer(reader, model, "rights", QUESTION, max_new_tokens=NEW_TOKENS, check=True)
    assert expected.identical
    # a fine-tuned variant served beside the model (the tiny recipe: the mechanics), with a
    # plan recomputing every layer from the base model's hidden states (stored beside its KV)
    from kdn.engines.family import Plan, save_plan
    from kdn.engines.transformers.crossmodel import publish_hidden
    from kdn.engines.transformers.model import load_model
    from kdn.engines.transformers.variant import TINY, build
    folder = build(bundled_documents()[-1:], TINY, root=tmp_path_factory.mktemp("variants"))[0]
    variant = load_model(variant=folder, warm=False)
    plans = tmp_path_factory.mktemp("plans")
    save_plan(Plan(variant.fingerprint, model.fingerprint, 0, variant.layers, variant.layers), plans)
    publish_hidden(pub, model, "rights", [("bill-of-rights", docs["bill-of-rights"])], [0])
    port = free_ports(1)[0]
    where = ["--address", ray_cluster.address, "--network", name]
    env = {"KDN_ADMIN_TOKEN": ADMIN, "KDN_READ_TOKENS": f"default={READ},acme={ACME}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # the settings come from a config file (a flag overrides its port): one replica per
    # region, 1 request admitted and 2 queued (more waiting ones are 429s), 3 routers
    config = tmp_path_factory.mktemp("config") / "serve.toml"
    config.write_text(f"regions = {json.dumps(SERVED)}\nport = 1\nreplica_cpus = 0\nrouters = {ROUTERS}\n"
                      "max_ongoing_requests = 1\nmax_queued_requests = 2\nmin_replicas = 1\n"
                      "max_replicas = 1\ntarget_ongoing_requests = 3.0\n"
                      f"variants = [{json.dumps(str(folder))}]\nplans = {json.dumps(str(plans))}\n")
    try:
        rc, out = kdn_cli("serve", *where, "--config", str(config), "--port", str(port), "--json")
        assert rc == 0, out
        info = json.loads(out)
        yield {"url": info["url"], "info": info, "network": name, "expected": expected,
               "kb_tokens": receipt["tokens"], "port": port, "where": where, "variant": variant,
               "kb_ids": reader.manifest("rights").token_ids().tolist()}
    finally:
        rc, out = kdn_cli("serve", *where, "--down")
        stop_network(net)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rc == 0 and "stopped" in out


def _client(url, token=READ, **kw):
    return openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=120, **kw)


def _text(model, tokens):
    return model.tokenizer.decode(tokens, skip_special_tokens=True)


def test_service_info_names_routes_and_replicas(service):
    info = service["info"]
    assert info["url"] == f"http://127.0.0.1:{service['port']}/v1"
    assert info["regions"] == {r: f"http://127.0.0.1:{service['port']}/{r}/v1" for r in SERVED}
    for r in SERVED:
        assert info["deployments"][r]["replicas"].get("RUNNING") == 1


def test_the_config_file_was_read_and_flags_override_it(service):
    """Regions, routers, admission and queue from the file; the port from the flag."""
    info = service["info"]
    assert sorted(info["regions"]) == sorted(SERVED)           # the file's regions, not all three
    assert info["deployments"]["router"]["replicas"].get("RUNNING") == ROUTERS
    assert info["url"].startswith(f"http://127.0.0.1:{service['port']}/")   # not the file's port 1
    for r in SERVED:                                            # what Serve runs them with
        d = info["deployments"][r]
        assert (d["max_ongoing_requests"], d["max_queued_requests"]) == (1, 2)
        assert d["autoscaling"] == {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 3.0}
    assert info["deployments"]["router"]["num_replicas"] == ROUTERS


@pytest.mark.parametrize("text, says", [
    ("regions = 'us-east'", "regions must be a list"),
    ("replicas = 3", "unknown key(s) ['replicas']"),
    ("port = ", "not TOML"),
    ("engine = 'tensorrt'", "engine must be one of"),
    ("max_ongoing_requests = 0", "max_ongoing_requests must be an int >= 1, got 0"),
])
def test_a_bad_config_file_is_refused_naming_the_problem(service, tmp_path, capsys, kdn_cli, text,
                                                          says):
    bad = tmp_path / "bad.toml"
    bad.write_text(text + "\n")
    rc, out = kdn_cli("serve", *service["where"], "--config", str(bad))
    assert rc == 2 and says in capsys.readouterr().err
    assert kdn_cli("serve", *service["where"], "--config", str(tmp_path / "missing.toml"))[0] == 2
    # the running service is untouched
    assert serve_info(service)["deployments"]["router"]["replicas"].get("RUNNING") == ROUTERS


def serve_info(service):
    from kdn.serve.app import service_info
    return service_info(service["network"])


def test_status_json_has_the_service(service, kdn_cli):
    rc, out = kdn_cli("status", "--json", *service["where"])
    svc = json.loads(out)["service"]
    assert svc["url"] == service["info"]["url"] and svc["url"].endswith("/v1")
    assert sorted(svc["regions"]) == sorted(SERVED) and all(u.endswith("/v1") for u in svc["regions"].values())


def test_overload_is_429_with_retry_after(service):
    """Twelve long answers at once to one region: one runs, two wait in each router's queue
    (Serve queues per caller, so 7 in all with 3 routers), and the rest are refused (a few
    more get in when an answer ends while the twelve still arrive)."""
    results = []

    def ask():
        try:
            r = httpx.post(service["info"]["regions"]["us-east"] + "/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {READ}"},
                           json=dict(model=f"{MODEL_NAME}@rights", max_tokens=20,
                                     messages=[{"role": "user", "content": QUESTION}]))
            results.append((r.status_code, r.headers.get("retry-after"), r.json()))
        except httpx.HTTPError as e:
            results.append((None, None, repr(e)))
    threads = [threading.Thread(target=ask) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    codes = sorted(r[0] for r in results)
    assert codes.count(200) >= 1 and set(codes) <= {200, 429}, results
    for status, retry, body in results:
        if status == 429:
            assert retry == "1" and body["error"]["type"] == "rate_limit_error"
    assert 429 in codes, results


def test_plain_answer_is_the_query_check_answer(service, model):
    e = service["expected"]
    r = _client(service["url"]).chat.completions.create(
        model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW_TOKENS)
    assert r.choices[0].message.content == _text(model, e.baseline_tokens)
    assert r.usage.completion_tokens == len(e.baseline_tokens)
    assert r.usage.prompt_tokens == e.prompt_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == service["kb_tokens"] == e.cached_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_kbs_second_request_is_routed_to_the_engine_that_holds_it(service, model):
    """KV-aware routing (kdn.serve.router): the replica that answered a KB keeps its KV in
    its engine cache and says so; the second request is routed there and fetches nothing
    (the answer the same, the KB's tokens still cached)."""
    from ray import serve as ray_serve
    from kdn.serve.app import ROUTER, app_name
    e = service["expected"]
    url = service["info"]["regions"]["us-east"]
    worker = ray_serve.get_deployment_handle("us-east", app_name=app_name(service["network"]))
    before = worker.stats.remote().result()["engine_kv"]
    for _ in range(2):
        r = _client(url).chat.completions.create(
            model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW_TOKENS)
        assert r.choices[0].message.content == _text(model, e.baseline_tokens)
        assert r.usage.prompt_tokens_details.cached_tokens == service["kb_tokens"]
    after = worker.stats.remote().result()["engine_kv"]
    assert after.get("engine_hits", 0) - before.get("engine_hits", 0) >= 1
    assert worker.record_routing_stats.remote().result()["kbs"] == ["default/rights"]
    routers = ray_serve.get_deployment_handle(ROUTER, app_name=app_name(service["network"]))
    full = [routers.stats.remote().result() for _ in range(3 * ROUTERS)]
    seen = [f["routing"] for f in full]
    assert any(s.get("engine_hit", 0) >= 1 for s in seen), seen
    # every router took the edges' measured links for its region decisions (measured_links)
    assert all(f["counters"].get("links_measured", 0) >= 1 and f["publish_failure"] is None
               for f in full), full
    # Each decision is timed and exported (how long they take is `kdn bench route`'s figure, not
    # a timed assertion: this machine's load decides it).
    assert all(s.get("decisions", 0) >= s.get("engine_hit", 0) for s in seen), seen
    assert all(s["decision_us"] > 0 for s in seen if s.get("decisions", 0)), seen


def test_streamed_answer_is_the_query_check_answer_and_kb_by_extra_body(service, model):
    e = service["expected"]
    url = service["info"]["regions"]["eu-west"]
    stream = _client(url).chat.completions.create(
        model=MODEL_NAME, extra_body={"kb": "rights:1"}, messages=[{"role": "user", "content": QUESTION}],
        max_completion_tokens=NEW_TOKENS, stream=True)
    pieces, finish, use = [], None, None
    for c in stream:
        assert c.object == "chat.completion.chunk"
        if c.choices:
            pieces.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
        use = c.usage or use
    assert "".join(pieces) == _text(model, e.baseline_tokens)
    assert len([p for p in pieces if p]) >= 2, "tokens arrive one by one"
    assert finish in ("stop", "length")
    assert use.prompt_tokens_details.cached_tokens == service["kb_tokens"]
    assert use.completion_tokens == len(e.baseline_tokens)


def test_emphasis_per_request_and_as_the_kbs_override_through_the_openai_client(service, model):
    """extra_body emphasis answers over the KB's KV edited (the tokens kdn.serve.chat computes
    for that edit in this process) and every answer says what its KV was ("kdn": exact or the
    weights); an operator's override (Client.set_emphasis) applies to requests that name none,
    plain and streamed, {} asks for the exact KV, and cleared, the exact answer is back."""
    from kdn.client.reader import MANIFEST_TTL_S
    from kdn.serve.chat import Chat
    e, kb = service["expected"], "rights"
    weights = {"bill-of-rights": 4}
    messages = [{"role": "user", "content": QUESTION}]
    c = _client(service["info"]["regions"]["us-east"])

    def ask(**extra):
        r = c.chat.completions.create(model=f"{MODEL_NAME}@{kb}", messages=messages, max_tokens=NEW_TOKENS,
                                      **({"extra_body": extra} if extra else {}))
        assert r.usage.prompt_tokens_details.cached_tokens == service["kb_tokens"]
        return r.choices[0].message.content, r.model_extra["kdn"]

    reader = Client(network=service["network"], region="us-east", fingerprint=model.fingerprint, token=READ)
    chat = Chat(model, reader)
    prompt, cache, cached = chat.prepare(reader.manifest(kb), messages, NEW_TOKENS, emphasis=weights)
    edited = _text(model, [s.token for s in chat.stream(prompt, cache, cached, NEW_TOKENS) if s.token is not None])
    plain = (_text(model, e.baseline_tokens), {"exact": True, "emphasis": {}})
    assert ask() == plain
    assert ask(emphasis=weights) == (edited, {"exact": False, "emphasis": weights})
    with pytest.raises(openai.BadRequestError, match="names document 'nope.md'") as bad:
        ask(emphasis={"nope.md": 2})
    assert bad.value.status_code == 400
    admin = Client(network=service["network"], region="us-east", fingerprint=model.fingerprint, admin_token=ADMIN)
    def settled(want_exact: bool):
        """The replica's answer once its manifest listing is fresh (at most MANIFEST_TTL_S old)."""
        deadline = time.monotonic() + MANIFEST_TTL_S + 5
        while (got := ask())[1]["exact"] != want_exact and time.monotonic() < deadline:
            time.sleep(0.5)
        return got

    admin.set_emphasis(kb, weights)
    try:
        assert settled(False) == (edited, {"exact": False, "emphasis": weights})
        assert ask(emphasis={}) == plain
        stream = c.chat.completions.create(model=f"{MODEL_NAME}@{kb}", messages=messages,
                                           max_tokens=NEW_TOKENS, stream=True)
        chunks = list(stream)
        assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == edited
        assert chunks[-1].model_extra["kdn"] == {"exact": False, "emphasis": weights}
    finally:
        admin.set_emphasis(kb, {})
    assert settled(True) == plain


def test_models_lists_what_the_tenant_may_read(service):
    ids = [m.id for m in _client(service["url"]).models.list()]
    # then the variant served, and its own KBs (a later test publishes one)
    assert ids[:3] == [MODEL_NAME, f"{MODEL_NAME}@rights", f"{MODEL_NAME}+tiny"]
    assert all(i.startswith(f"{MODEL_NAME}+tiny@") for i in ids[3:]), ids
    assert [m.id for m in _client(service["url"], ACME).models.list()] == [MODEL_NAME, f"{MODEL_NAME}+tiny"]


@pytest.mark.parametrize("kwargs, status, code", [
    (dict(model=f"{MODEL_NAME}@nope"), 404, "kb_not_found"),
    (dict(model=f"{MODEL_NAME}@rights:99"), 404, "kb_not_found"),
    (dict(model="gpt-4o@rights"), 404, "model_not_found"),
    (dict(model=f"{MODEL_NAME}@"), 400, "invalid_request"),
    (dict(model=MODEL_NAME, extra_body={"prompt_cache_retention": "1w"}), 400, "invalid_request"),
    (dict(model=MODEL_NAME, extra_body={"cache_salt": ""}), 400, "invalid_request"),
    (dict(model=f"{MODEL_NAME}@rights", messages=[]), 400, "invalid_request"),
    (dict(model=f"{MODEL_NAME}@rights", messages=[{"role": "robot", "content": "hi"}]), 400, "invalid_request"),
    (dict(model=f"{MODEL_NAME}@rights", temperature=7), 400, "invalid_request"),
    (dict(model=f"{MODEL_NAME}@rights", max_tokens=0), 400, "invalid_request"),
    (dict(model=f"{MODEL_NAME}@rights", extra_body={"kb": "other"}), 400, "invalid_request"),
    (dict(model=f"{MODEL_NAME}@bad name!"), 400, "invalid_request"),
])
def test_errors_are_openai_shaped(service, kwargs, status, code):
    args = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as err:
        _client(service["url"]).chat.completions.create(**args)
    assert err.value.status_code == status
    assert err.value.body["code"] == code and err.value.body["message"]


TOOL_OUTPUT = "\n".join(f"12:{i:02d} pump-{i} pressure={300 + 7 * i} status={'fail' if i % 9 == 4 else 'ok'}"
                        for i in range(60))


def test_a_conversations_second_turn_reports_the_first_turns_tokens_as_cached(service, model):
    """A plain chat (no KB) through the openai client, two turns: the first computes everything
    and its KV is kept after the answer; the second, sent as the README shows, reads the
    history's whole chunks and says so in usage.prompt_tokens_details.cached_tokens, with the
    tokens of a full prefill, and is routed to the region that answered the first turn."""
    from kdn.serve.chat import stream
    c = _client(service["url"])
    messages = [{"role": "user", "content": f"Tool output:\n{TOOL_OUTPUT}\nWhich pumps failed?"}]
    first = c.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=NEW_TOKENS, prompt_cache_key="pumps-1")
    one = first.parse()
    assert one.usage.prompt_tokens_details.cached_tokens == 0 and one.usage.prompt_tokens > 512
    messages += [{"role": "assistant", "content": one.choices[0].message.content},
                 {"role": "user", "content": "And which pump has the highest pressure?"}]
    time.sleep(1.0)                               # the first turn's KV is stored after its reply
    second = c.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=messages, max_tokens=NEW_TOKENS, prompt_cache_key="pumps-1")
    two = second.parse()
    # each ingress replica keeps its own affinity (kdn.serve.affinity): another one routes home
    assert second.headers["x-kdn-route"] in ("conversation", "home")
    assert second.headers["x-kdn-region"] == first.headers["x-kdn-region"]
    cached = two.usage.prompt_tokens_details.cached_tokens
    # every whole chunk the first turn computed (its prompt and answer) from an edge, or, where
    # it reached the replica that answered the first turn, every token that one's cache kept
    # and the new prompt repeats; never past them
    assert one.usage.prompt_tokens // 256 * 256 <= cached, (cached, one.usage)
    assert cached % 256 == 0 or cached > one.usage.prompt_tokens, (cached, one.usage)
    assert cached <= one.usage.prompt_tokens + one.usage.completion_tokens
    prompt = model.chat_tokens(messages)
    assert two.usage.prompt_tokens == len(prompt)
    full = [s.token for s in stream(model, prompt, None, 0, NEW_TOKENS) if s.token is not None]
    assert two.choices[0].message.content == _text(model, full)


def test_a_conversation_past_the_context_is_openais_400_naming_both_numbers(service):
    long = " ".join(["tokens"] * 8300)
    with pytest.raises(openai.BadRequestError) as err:
        _client(service["url"]).chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": long}], max_tokens=8)
    assert err.value.body["code"] == "context_length_exceeded" and err.value.body["param"] == "messages"
    assert "the model's context is 8192 tokens" in err.value.body["message"]
    assert "make " in err.value.body["message"] and "max_tokens (8)" in err.value.body["message"]


def test_tokens_missing_401_wrong_403_other_tenant_404(service):
    msg = dict(model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
    r = httpx.post(service["url"] + "/chat/completions", json=msg, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.PermissionDeniedError) as err:
        _client(service["url"], "not-a-token-of-anyone").chat.completions.create(**msg)
    assert err.value.status_code == 403
    with pytest.raises(openai.NotFoundError):       # acme has no KB 'rights'
        _client(service["url"], ACME).chat.completions.create(**msg)


def test_bad_json_route_and_method(service):
    h = {"Authorization": f"Bearer {READ}"}
    base = f"http://127.0.0.1:{service['port']}"
    r = httpx.post(base + "/v1/chat/completions", content=b"{not json", headers=h, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.get(base + "/v1/chat/completions", headers=h, timeout=30)
    assert r.status_code == 405
    r = httpx.get(base + "/mars/v1/models", headers=h, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_region"
    r = httpx.get(base + "/v1/models", headers={**h, "X-KDN-Region": "eu-west"}, timeout=30)
    assert r.status_code == 200


def test_concurrent_clients_in_two_regions(service, model):
    want = _text(model, service["expected"].baseline_tokens)
    got, errors = [], []

    def ask(region, stream):
        try:
            c = _client(service["info"]["regions"][region])
            args = dict(model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}],
                        max_tokens=NEW_TOKENS)
            if stream:
                got.append("".join((c.choices[0].delta.content or "") for c in
                                   c.chat.completions.create(stream=True, **args) if c.choices))
            else:
                got.append(c.chat.completions.create(**args).choices[0].message.content)
        except openai.OpenAIError as e:
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(r, s)) for r in SERVED for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and got == [want] * 4


def _metric_samples(service) -> tuple:
    """(the service's /metrics as fetched, {(name, labels): value})."""
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(f"http://127.0.0.1:{service['port']}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text[:200]
    return r.content, {(x.name, tuple(sorted(x.labels.items()))): x.value
                       for f in text_string_to_metric_families(r.text) for x in f.samples}


def test_metrics_and_status_show_every_routing_decision(service, model, kdn_cli):
    """/metrics (no token: no counter names a tenant or a KB) sums every ingress replica's
    counters: each /v1 request's region decision (and its tier), each replica decision of
    each region, where each answer's KV came from as its replica measured it (its reports
    reach the ingress within a second or two); promtool finds nothing to fix in it; `kdn
    status` prints the same counters."""
    def decided(got):
        return sum(v for (name, _), v in got.items() if name == "kdn_serve_region_decisions_total")

    def kv_from(got, sources=("engine", "edge_memory", "edge_disk", "peer", "origin")):
        return sum(v for (name, labels), v in got.items()
                   if name == "kdn_serve_kv_source_total" and dict(labels)["source"] in sources)
    _, before = _metric_samples(service)
    r = _client(service["url"]).chat.completions.with_raw_response.create(
        model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}], max_tokens=NEW_TOKENS)
    assert r.parse().choices[0].message.content == _text(model, service["expected"].baseline_tokens)
    assert r.headers["x-kdn-region"] in SERVED and r.headers["x-kdn-route"] in ("home", "cross_region_queue",
                                                                               "cross_region_kv")
    deadline = time.monotonic() + 10         # another ingress replica's counters: within a second
    while (decided(got := _metric_samples(service)[1]) < decided(before) + 1
           or kv_from(got) < kv_from(before) + 1):
        assert time.monotonic() < deadline, got
        time.sleep(0.3)
    assert kv_from(got, ("none",)) == kv_from(before, ("none",)), "the answer read its KV from KDN"
    assert got[("kdn_serve_region_decisions_total", (("outcome", "pinned"),))] >= 1     # /<region>/v1 tests
    assert sum(v for (name, _), v in got.items() if name == "kdn_serve_region_tier_total") >= 1
    hits = {labels: v for (name, labels), v in got.items() if name == "kdn_serve_replica_decisions_total"}
    assert sum(hits.values()) >= 1 and {dict(k)["region"] for k in hits} == set(SERVED), hits
    assert got[("kdn_serve_ingress_replicas", ())] >= ROUTERS
    _promtool_check(_metric_samples(service)[0])
    rc, out = kdn_cli("status", *service["where"])
    assert "regions: " in out and "decisions" in out and "us-east replicas:" in out, out
    assert "answers' KV from: " in out, out
    print("\n" + out[out.index("service:"):])
    rc, out = kdn_cli("status", "--json", *service["where"])
    routing = json.loads(out)["service"]["routing"]
    assert routing["counters"]["route_decisions"] >= 1 and set(routing["routing"]) == set(SERVED)


def _promtool_check(text: bytes) -> None:
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("serve_test_metrics", pathlib.Path(__file__).with_name("test_metrics.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.promtool_check(text)


def test_the_demo_step_answers_through_the_openai_client(service, model):
    from kdn.serve.demo import ask
    said = []
    got = ask(service["info"], "rights", QUESTION, said.append, api_key=READ, max_tokens=NEW_TOKENS)
    want = _text(model, service["expected"].baseline_tokens).strip()
    assert got["streamed"] == want and got["regions"] == {r: want for r in SERVED}
    assert got["cached_tokens"] == service["kb_tokens"] and len(said) == 2 + len(SERVED)


def test_a_killed_router_is_no_outage(service, model):
    """One of the ingress's replicas dies (its process killed): the others answer every
    request meanwhile, and Serve starts a replacement."""
    want = _text(model, service["expected"].baseline_tokens)
    prefix = f"SERVE_REPLICA::kdn-{service['network']}#router#"
    routers = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(routers) == ROUTERS, routers
    ray.kill(ray.get_actor(routers[0], namespace="serve"), no_restart=True)
    c = _client(service["info"]["regions"]["us-east"])
    for _ in range(2 * ROUTERS):
        r = c.chat.completions.create(model=f"{MODEL_NAME}@rights", max_tokens=NEW_TOKENS,
                                      messages=[{"role": "user", "content": QUESTION}])
        assert r.choices[0].message.content == want
    _wait_replaced(service, "router", routers[0], n=ROUTERS, timeout_s=60)


def test_a_stream_left_mid_answer_stops_and_the_next_is_answered(service, model):
    """A caller that goes away after a few tokens of a long answer: the router counts it gone
    and cancels the answer at its worker, whose replica stops generating (the rest would hold
    up every request behind it) and answers the next."""
    from ray import serve as ray_serve
    from kdn.serve import metrics
    from kdn.serve.app import app_name
    handle = ray_serve.get_deployment_handle("us-east", app_name=app_name(service["network"]))

    def generated():
        st = handle.stats.remote().result()
        return st["counters"].get("aborted", 0), sum(c.get("completion_tokens", 0) for c in st["chats"].values())
    def left():      # streams the routers saw their callers leave (kdn_serve_events_total)
        return metrics.gather(service["network"])["counters"].get("streams_left", 0)
    aborted, tokens = generated()
    was_left = left()
    c = _client(service["info"]["regions"]["us-east"])
    stream = c.chat.completions.create(model=f"{MODEL_NAME}@rights", max_tokens=400, stream=True,
                                       messages=[{"role": "user", "content": "Recite every amendment."}])
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    r = c.chat.completions.create(model=f"{MODEL_NAME}@rights", max_tokens=NEW_TOKENS,
                                  messages=[{"role": "user", "content": QUESTION}])
    assert r.choices[0].message.content == _text(model, service["expected"].baseline_tokens)
    deadline = time.monotonic() + 30
    while generated()[0] == aborted:
        assert time.monotonic() < deadline, "the replica never saw its caller go"
        time.sleep(0.2)
    now_aborted, now_tokens = generated()
    assert now_aborted == aborted + 1
    assert now_tokens - tokens - r.usage.completion_tokens < 100     # not the 400 asked for
    while left() == was_left:       # the router cancelled it at the worker (published every period)
        assert time.monotonic() < deadline, "the router never counted its caller gone"
        time.sleep(0.2)
    assert left() == was_left + 1


def test_the_bench_measures_this_service(service):
    """kdn bench serve's measurements, on this service: the API and the worker direct give
    the same text with the KB's tokens cached; with KDN off nothing is cached and it is slower."""
    from ray import serve as ray_serve
    from kdn.bench.serve import load, measure_ttft
    from kdn.serve.app import app_name
    url = service["info"]["regions"]["eu-west"]
    handle = ray_serve.get_deployment_handle("eu-west", app_name=app_name(service["network"]))
    row = measure_ttft(url, handle, f"{MODEL_NAME}@rights", QUESTION, reps=2, max_tokens=4,
                       kb_tokens=service["kb_tokens"], off_reps=1, token=READ)
    assert row["same_text"] and len(row["api_all_s"]) == len(row["direct_all_s"]) == 2
    assert len(row["no_kdn_all_s"]) == 1 and row["ttft_speedup"] > 1
    assert 0 < row["direct_ttft_s"] and 0 < row["api_ttft_s"]
    got = load(list(service["info"]["regions"].values()), f"{MODEL_NAME}@rights", QUESTION, clients=2,
               per_client=1, max_tokens=4, kb_tokens=service["kb_tokens"], token=READ)
    assert got["ok"] == got["requests"] == 2 and got["n_errors"] == 0 and got["rps"] > 0


def test_a_replica_killed_mid_run_costs_no_failed_request(service, model):
    """us-east's only replica is killed while three /v1 requests (the caller's region:
    us-east) run or wait there: the one it was answering is sent once more (to eu-west when
    Serve already dropped the dead replica: it had not crossed regions yet), those waiting
    get the replacement, and requests that arrive while us-east has no replica go to eu-west
    (home_unavailable). Every answer is the unkilled one, token for token (temperature 0)."""
    from kdn.serve import metrics
    want = _text(model, service["expected"].baseline_tokens)
    c = _client(service["url"])
    args = dict(model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}],
                max_tokens=NEW_TOKENS, temperature=0)
    t0 = time.monotonic()
    assert c.chat.completions.create(**args).choices[0].message.content == want
    one_s = time.monotonic() - t0
    retried = metrics.gather(service["network"])["counters"].get("retried_replica_died", 0)
    prefix = f"SERVE_REPLICA::kdn-{service['network']}#us-east#"
    victims = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(victims) == 1, victims
    got, errors = [], []

    def ask():
        try:
            r = c.chat.completions.with_raw_response.create(**args)
            got.append((r.parse().choices[0].message.content, r.headers["x-kdn-region"], r.headers["x-kdn-route"]))
        except openai.OpenAIError as e:
            errors.append(e)
    threads = [threading.Thread(target=ask) for _ in range(3)]   # 3: none is refused (1 + 2 queued per router)
    for t in threads:
        t.start()
    time.sleep(one_s / 2)                    # the first is being answered
    ray.kill(ray.get_actor(victims[0], namespace="serve"), no_restart=True)
    killed = time.monotonic()
    while serve_info(service)["deployments"]["us-east"]["replicas"].get("RUNNING", 0):
        assert time.monotonic() < killed + 30, "Serve never saw the replica die"
        time.sleep(0.2)
    time.sleep(1.0)                          # the routers hear it from the controller
    for _ in range(3):                       # meanwhile, one at a time
        if serve_info(service)["deployments"]["us-east"]["replicas"].get("RUNNING"):
            break
        ask()
    for t in threads:
        t.join(300)
    replaced = time.monotonic()
    print(f"\none answer {one_s:.2f} s; killed after {one_s / 2:.2f} s; answers (region, route): "
          f"{[g[1:] for g in got]}; retried {metrics.gather(service['network'])['counters'].get('retried_replica_died', 0) - retried}")
    assert not errors, errors
    assert [g[0] for g in got] == [want] * len(got) and len(got) >= 4
    assert ("eu-west", "home_unavailable") in [g[1:] for g in got], got
    _wait_replaced(service, "us-east", victims[0])   # it loads the model: later tests find it
    print(f"replacement running {time.monotonic() - killed:.1f} s after the kill "
          f"({replaced - killed:.1f} s until every request was answered)")


def test_replica_killed_mid_stream_is_a_clear_error_never_a_cut_answer(service, model):
    """The answer is long (200 tokens, seconds of decoding) so the kill lands mid-stream: the
    client must get an error, never a cut answer that ends like a complete one. The test ends
    once the replacement (which loads the model again) runs, so that later tests measure a
    settled service."""
    want = _text(model, service["expected"].baseline_tokens)
    prefix = f"SERVE_REPLICA::kdn-{service['network']}#eu-west#"
    victims = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert len(victims) == 1, victims
    victim = ray.get_actor(victims[0]["name"], namespace="serve")
    stream = _client(service["info"]["regions"]["eu-west"]).chat.completions.create(
        model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=200, stream=True)
    text, finish = "", None
    with pytest.raises(openai.APIError) as err:
        for i, c in enumerate(stream):
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            if i == 2:
                ray.kill(victim, no_restart=True)
    assert "broke off" in str(err.value), err.value
    assert finish is None and want.startswith(text[:len(want)]) and text
    _wait_replaced(service, "eu-west", victims[0]["name"])


def _wait_running(service, deployment, n, timeout_s=180):
    """Until Serve runs n replicas of the deployment (a replacement loads the model first)."""
    deadline = time.monotonic() + timeout_s
    while serve_info(service)["deployments"][deployment]["replicas"].get("RUNNING") != n:
        assert time.monotonic() < deadline, serve_info(service)["deployments"][deployment]
        time.sleep(0.5)


def _wait_replaced(service, deployment, victim, n=1, timeout_s=180):
    """Until the deployment's killed replica (its actor's name) is gone from Serve's replicas
    and n run: right after a kill, Serve still counts the dead one as running."""
    from ray.serve.context import _get_global_client
    from kdn.serve.app import app_name
    deadline = time.monotonic() + timeout_s
    while True:
        app = _get_global_client().get_serve_details().get("applications", {}).get(app_name(service["network"]), {})
        replicas = app.get("deployments", {}).get(deployment, {}).get("replicas", [])
        running = [r for r in replicas if str(r.get("state")).endswith("RUNNING")]
        if victim not in {r.get("actor_name") for r in replicas} and len(running) == n:
            return
        assert time.monotonic() < deadline, replicas
        time.sleep(0.5)


def test_a_deeply_nested_body_is_a_400_naming_the_problem(service):
    """100,000 levels of nesting: Python's json gives up (RecursionError); the API answers
    400 json_too_deep, OpenAI-shaped, and the router keeps answering."""
    h = {"Authorization": f"Bearer {READ}", "Content-Type": "application/json"}
    for raw in (b"[" * 100_000, b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
        r = httpx.post(service["url"] + "/chat/completions", content=raw, headers=h, timeout=30)
        assert r.status_code == 400, r.text[:200]
        err = r.json()["error"]
        assert err["code"] == "json_too_deep" and "nests JSON" in err["message"]
        assert err["type"] == "invalid_request_error"


def test_a_chunked_body_is_read_in_pieces_and_answered(service, model):
    """A body without Content-Length (chunked) within the limit is read and answered."""
    msg = json.dumps(dict(model=f"{MODEL_NAME}@rights", max_tokens=NEW_TOKENS,
                          messages=[{"role": "user", "content": QUESTION}])).encode()
    r = httpx.post(service["url"] + "/chat/completions", timeout=120,
                   content=(msg[i:i + 7] for i in range(0, len(msg), 7)),
                   headers={"Authorization": f"Bearer {READ}", "Content-Type": "application/json"})
    assert r.status_code == 200 and "content-length" not in r.request.headers
    assert r.json()["choices"][0]["message"]["content"] == _text(model, service["expected"].baseline_tokens)


def test_oversized_bodies_are_refused_before_they_are_read_and_memory_stays_bounded(service):
    """8 concurrent 300 MB bodies, with a Content-Length and chunked: each a 413, sent before
    the body is read (Content-Length) or once 8 MiB arrived (chunked), the connection closed
    so nobody reads the rest; neither Serve's proxy nor a router nor a replica keeps the
    bodies (RSS grows by less than BOUND_MIB, BOUND_CHUNKED_MIB chunked)."""
    hostile_bodies = _rss_helpers().hostile_bodies
    for r in SERVED:                 # no replica is loading its model while RSS is measured
        _wait_running(service, r, 1)
    _wait_running(service, "router", ROUTERS)
    for chunked in (False, True):
        t0 = time.monotonic()
        rep = hostile_bodies(service["network"], service["url"] + "/chat/completions", 8, 300 * 10**6,
                             chunked, settle_s=0.5)
        assert [r[:2] for r in rep["results"]] == [(413, "body_too_large")] * 8, rep["results"]
        assert time.monotonic() - t0 < 30, rep["results"]
        grew = {k: v["grew"] for k, v in rep["rss_mib"].items()}
        print(f"\n8 x 300 MB bodies, {'chunked' if chunked else 'Content-Length'}: RSS grew (MiB) {grew}")
        # the proxy, every router (a killed one's replacement too) and every replica measured
        kinds = collections.Counter(k.split("#")[0] for k in grew)
        assert kinds["proxy"] == 1 and kinds["router"] >= ROUTERS, grew
        assert all(kinds[r] >= 1 for r in SERVED), grew
        # the proxy and the routers are on a body's path; a replica never sees one, and is
        # settled (running, its model loaded), so it keeps within the proxy's bound
        bound = BOUND_CHUNKED_MIB if chunked else BOUND_MIB
        on_path = {k: v for k, v in grew.items() if k == "proxy" or k.startswith("router#")}
        assert max(on_path.values()) < bound, rep["rss_mib"]
        assert max(grew.values()) < max(bound, 64), rep["rss_mib"]


# RSS growth allowed per process (8 x 300 MB bodies; before the fix a router grew 1,130-1,280
# MiB and the proxy 260 with Content-Length). Now Serve's proxy refuses them itself
# (kdn/serve/proxy.py): with Content-Length nothing is read (measured +0.5 MiB proxy, <0.5
# per router); chunked, each body reaches the 8 MiB limit in the proxy before its 413, so
# 8 x 8 MiB is the bound there, plus the allocator's slack (measured +69 and +96 MiB proxy,
# <18 MiB per router; tests/serve/rss_hostile_bodies.py)
BOUND_MIB = 32
BOUND_CHUNKED_MIB = 8 * 8 + 64


def _rss_helpers():
    """tests/serve/rss_hostile_bodies.py (not a test module; pytest imports in importlib mode,
    so it is loaded by path)."""
    import importlib.util
    import pathlib
    import sys
    if "rss_hostile_bodies" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "rss_hostile_bodies", pathlib.Path(__file__).with_name("rss_hostile_bodies.py"))
        sys.modules["rss_hostile_bodies"] = mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return sys.modules["rss_hostile_bodies"]


def test_a_variant_reads_the_base_models_kv_only_when_it_opts_in_and_is_told_so(service, model):
    """The tiny variant runs in every replica as '<model>+tiny'. Over its own KV it has no
    'rights' (404: never the base model's KV unasked); with extra_body cross_model it answers
    over the base model's KV with every layer recomputed, its own full prefill's answer, and
    the answer says exact false and names the sender and plan. The base model cannot opt in."""
    from kdn.serve.chat import messages_tokens
    variant = service["variant"]
    c = _client(service["url"])
    assert variant.name == f"{MODEL_NAME}+tiny" and variant.name in [m.id for m in c.models.list().data]
    messages = [{"role": "user", "content": QUESTION}]
    with pytest.raises(openai.NotFoundError, match="no knowledge base 'rights'"):
        c.chat.completions.create(model=f"{variant.name}@rights", messages=messages, max_tokens=6)
    r = c.chat.completions.create(model=f"{variant.name}@rights", messages=messages, max_tokens=6,
                                  extra_body={"cross_model": True})
    prompt = service["kb_ids"] + messages_tokens(variant, messages)
    own = variant.generate(prompt, max_new_tokens=6)                  # the variant's own full prefill
    assert r.choices[0].message.content == _text(variant, own.tokens)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.prompt_tokens_details.cached_tokens == service["kb_tokens"]
    note = r.model_extra["kdn"]
    assert note["exact"] is False and note["cross_model"]["sender"] == model.fingerprint
    assert note["cross_model"]["recompute"] == [0, variant.layers]
    for who, body in ((MODEL_NAME, {"cross_model": True}), (variant.name, {"cross_model": "yes"})):
        with pytest.raises(openai.BadRequestError, match="cross_model"):
            c.chat.completions.create(model=f"{who}@rights", messages=messages, max_tokens=2, extra_body=body)
    # a KB published under the variant's own fingerprint: listed as its model, read exactly
    docs = [("gettysburg", bundled_documents()[-1][1][:600])]
    own_pub = Client(network=service["network"], region="us-east", fingerprint=variant.fingerprint,
                     admin_token=ADMIN)
    receipt = publish_documents(own_pub, variant, "motto", docs)
    assert f"{variant.name}@motto" in [m.id for m in c.models.list().data]
    r = c.chat.completions.create(model=f"{variant.name}@motto", messages=messages, max_tokens=6)
    # the same read here (its KV fetched, the question computed over it): the same work on this CPU
    mine = answer(Client(network=service["network"], region="eu-west", fingerprint=variant.fingerprint,
                         token=READ), variant, "motto", QUESTION, max_new_tokens=6)
    assert mine.cached_tokens == receipt["tokens"] and r.usage.prompt_tokens == mine.prompt_tokens
    assert r.choices[0].message.content == _text(variant, mine.tokens)
    assert r.model_extra["kdn"]["exact"] is True and "cross_model" not in r.model_extra["kdn"]
    assert r.usage.prompt_tokens_details.cached_tokens == receipt["tokens"]
