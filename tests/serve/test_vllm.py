"""`kdn serve --engine vllm` through the official openai client, on a real local network.

A vLLM engine with role kv_both (a Ray actor in us-east) publishes the Bill of Rights (644
tokens: two full chunks and a partial one) as KB 'rights' to a network whose tenants need
read tokens, computes vLLM's own full prefill of the question's prompt as the expected
answer, and is killed. The service is deployed once by `kdn serve --engine vllm` in one
region (eu-west: its replica's KV comes from its own edge); the two engines start together
to keep the module near 100 s on 2 cores. Answers, streamed and plain, must be that full
prefill's tokens; the first one, on the replica's fresh engine, must have the whole KB's KV
from KDN (cached_tokens, and the connector's report); the stream must arrive token by token;
an unknown KB, or another tenant's, is 404, a prompt past the context 400; concurrent
requests are answered in turn, and a stream its caller leaves is aborted in vLLM. A plain
chat (no KB) is answered and kept: its next turn's prompt starts with the history the
replica kept at its home edge, narrowed by the caller's salt, and answers as vLLM alone.
"""
import json
import os
import threading
import time
import uuid

import pytest
import ray

try:
    import vllm  # noqa: F401
except (ImportError, RuntimeError) as e:   # a broken install (media packages built for another torch) raises RuntimeError
    pytest.skip(f"vLLM is not importable ({type(e).__name__}: {e}); install the vllm extra (README)",
                allow_module_level=True)

import openai

from kdn.launch.cluster import free_ports, start_network, stop_network
from kdn.engines.vllm.run import EngineWorker
from kdn.cli.knowledge import bundled_documents
from kdn.engines.transformers.model import MODEL_NAME
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west")
SERVED = "eu-west"
ADMIN = "admin-" + "a" * 32
READ = "read-default-" + "r" * 24
ACME = "read-acme-" + "c" * 24
QUESTION = "What does the first amendment protect?"
NEW_TOKENS = 24
BILL_TOKENS = 644


@pytest.fixture(scope="module")
def service(ray_cluster, tmp_path_factory, kdn_cli):
    """The network, KB 'rights' published through vLLM, vLLM's full-prefill answer, and the
    service deployed by `kdn serve --engine vllm` in eu-west."""
    auth = {"admin": ADMIN, "readers": {"default": READ, "acme": ACME}}
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    name = f"v{uuid.uuid4().hex[:8]}"
    net = start_network(topo, tmp_path_factory.mktemp(name), network=name, auth=auth)
    # the publisher's engine starts while `kdn serve` starts the replica's
    pub = ray.remote(num_cpus=1)(EngineWorker).options(label_selector={"region": "us-east"}).remote(
        "kv_both", network=name, region="us-east", admin_token=ADMIN)
    port = free_ports(1)[0]
    where = ["--address", ray_cluster.address, "--network", name]
    env = {"KDN_ADMIN_TOKEN": ADMIN, "KDN_READ_TOKENS": f"default={READ},acme={ACME}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc, out = kdn_cli("serve", *where, "--engine", "vllm", "--regions", SERVED, "--port", str(port),
                      "--replica-cpus", "0", "--routers", "1", "--json")
        assert rc == 0, out
        info = json.loads(out)
        docs = dict(bundled_documents())
        receipt = ray.get(pub.publish.remote("rights", [("bill-of-rights", docs["bill-of-rights"])]),
                          timeout=600)
        prompt = ray.get(pub.prompt.remote({"network": name, "region": "us-east", "token": READ},
                                           "rights", QUESTION))
        full = ray.get(pub.generate.remote(prompt, NEW_TOKENS, full=True), timeout=600)
        ray.kill(pub)
        pub = None
        yield {"url": info["url"], "info": info, "network": name, "kb_tokens": receipt["tokens"],
               "prompt": prompt, "full": full}
    finally:
        if pub is not None:
            ray.kill(pub)
        rc, out = kdn_cli("serve", *where, "--down")
        stop_network(net)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rc == 0 and "stopped" in out


def _client(url, token=READ):
    return openai.OpenAI(base_url=url, api_key=token, max_retries=0, timeout=300)


def _replica_stats(service) -> dict:
    from ray import serve
    from kdn.serve.app import app_name
    return serve.get_deployment_handle(SERVED, app_name(service["network"])).stats.remote().result()


def _ask(**kw) -> dict:
    return dict(model=f"{MODEL_NAME}@rights", messages=[{"role": "user", "content": QUESTION}],
                max_tokens=NEW_TOKENS, **kw)


def test_streamed_answer_reads_the_kb_from_kdn_token_by_token_and_is_vllms_full_prefill(service):
    """First request of the replica's fresh engine: the KB's KV can only come from KDN."""
    full = service["full"]
    assert service["kb_tokens"] == BILL_TOKENS and len(full["tokens"]) == NEW_TOKENS
    t0 = time.perf_counter()
    stream = _client(service["url"]).chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **_ask())
    pieces, arrivals, finish, use = [], [], None, None
    for c in stream:
        if c.choices and c.choices[0].delta.content:
            pieces.append(c.choices[0].delta.content)
            arrivals.append(time.perf_counter() - t0)
        if c.choices:
            finish = c.choices[0].finish_reason or finish
        use = c.usage or use
    end = time.perf_counter() - t0
    assert "".join(pieces) == full["text"]
    assert finish == "length"
    assert use.prompt_tokens == len(service["prompt"]) and use.completion_tokens == NEW_TOKENS
    assert use.prompt_tokens_details.cached_tokens == BILL_TOKENS, "the whole KB, from KDN"
    last = _replica_stats(service)["last"]
    assert last["tokens"] == full["tokens"]
    k = last["kdn"]
    assert (k["held"], k["local"], k["external"], k["loaded"]) == (BILL_TOKENS, 0, BILL_TOKENS, BILL_TOKENS), k
    assert k["tenant"] == "default" and k["kb"] == "rights" and k["error"] is None, k
    # token by token: the first piece came while vLLM was still decoding the rest
    assert len(pieces) >= NEW_TOKENS // 2, pieces
    assert arrivals[0] < arrivals[-1] - 0.05 and arrivals[-1] <= end, (arrivals, end)


def test_plain_answer_is_vllms_full_prefill(service):
    full = service["full"]
    r = _client(service["url"]).chat.completions.create(**_ask())
    assert r.choices[0].message.content == full["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(service["prompt"]) and r.usage.completion_tokens == NEW_TOKENS
    last = _replica_stats(service)["last"]
    assert last["tokens"] == full["tokens"]
    # the KB's blocks are in vLLM's own prefix cache now (or KDN's): none of it was computed
    k = last["kdn"]
    assert r.usage.prompt_tokens_details.cached_tokens == last["cached"] == k["local"] + k["external"]
    assert last["cached"] >= BILL_TOKENS - 128, last


def test_without_kdn_fetch_vllm_computes_everything_and_answers_the_same(service):
    r = _client(service["info"]["regions"][SERVED]).chat.completions.create(
        extra_body={"kdn_fetch": False}, **_ask())
    assert r.choices[0].message.content == service["full"]["text"]
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert _replica_stats(service)["last"]["tokens"] == service["full"]["tokens"]


def test_models_and_unknown_or_other_tenants_kb_is_404(service):
    c = _client(service["url"])
    assert [m.id for m in c.models.list()] == [MODEL_NAME, f"{MODEL_NAME}@rights"]
    assert [m.id for m in _client(service["url"], ACME).models.list()] == [MODEL_NAME]
    before = _replica_stats(service)
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as err:
            c.chat.completions.create(stream=stream, **dict(_ask(), model=f"{MODEL_NAME}@nope"))
        assert err.value.body["code"] == "kb_not_found"
    with pytest.raises(openai.NotFoundError):        # acme reads with its own salt and token
        _client(service["url"], ACME).chat.completions.create(**_ask())
    after = _replica_stats(service)
    assert after["engine"] == "vllm" and after["kdn"] == before["kdn"], "refused before vLLM runs"
    assert after["counters"]["errors"] == before["counters"].get("errors", 0) + 3


def test_concurrent_requests_are_answered_one_at_a_time_and_right(service):
    got, errors = [], []

    def ask(stream):
        try:
            c = _client(service["url"])
            if stream:
                got.append("".join((x.choices[0].delta.content or "") for x in
                                   c.chat.completions.create(stream=True, **_ask()) if x.choices))
            else:
                got.append(c.chat.completions.create(**_ask()).choices[0].message.content)
        except openai.OpenAIError as e:
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(s,)) for s in (True, False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and got == [service["full"]["text"]] * 3


def test_context_too_long_is_400(service):
    long = " ".join(["liberty"] * 9000)        # ~9,000 tokens: past vLLM's 8,192
    with pytest.raises(openai.BadRequestError) as err:
        _client(service["url"]).chat.completions.create(
            **dict(_ask(), messages=[{"role": "user", "content": long}]))
    assert err.value.body["code"] == "context_length_exceeded"


def test_a_stream_left_mid_answer_is_aborted_and_the_next_answer_is_right(service):
    before = _replica_stats(service)["counters"]
    stream = _client(service["url"]).chat.completions.create(stream=True, **dict(_ask(), max_tokens=400))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    r = _client(service["url"]).chat.completions.create(**_ask())
    assert r.choices[0].message.content == service["full"]["text"]
    after = _replica_stats(service)
    assert after["last"]["tokens"] == service["full"]["tokens"]
    assert after["counters"].get("aborted", 0) == before.get("aborted", 0) + 1, after
    # the abandoned answer never reached max_tokens: vLLM stopped it
    left = after["counters"]["completion_tokens"] - before["completion_tokens"] - NEW_TOKENS
    assert 3 <= left < 400, after       # the client read 3 tokens; vLLM stopped soon after


def test_emphasis_is_refused_naming_the_engine_and_the_exact_kv_is_still_answered(service):
    """vLLM cannot apply emphasis (its block table would need more entries than positions):
    asked per request, or set on the KB by an operator, it is a 400 that says so; a request
    asking for the exact KV ({}) is answered as always, and every answer says it is exact."""
    from kdn.client import Client
    from kdn.client.reader import MANIFEST_TTL_S
    c = _client(service["url"])
    with pytest.raises(openai.BadRequestError, match="transformers engine only"):
        c.chat.completions.create(**_ask(extra_body={"emphasis": {"bill-of-rights": 2}}))
    admin = Client(network=service["network"], region="eu-west", admin_token=ADMIN)   # no model: operator calls
    admin.set_emphasis("rights", {"bill-of-rights": 2})
    try:
        deadline, err = time.monotonic() + MANIFEST_TTL_S + 5, None
        while err is None and time.monotonic() < deadline:   # until the replica's listing is fresh
            try:
                c.chat.completions.create(**dict(_ask(), max_tokens=1))
                time.sleep(0.5)
            except openai.BadRequestError as e:
                err = e
        assert err is not None and "has an emphasis override ({'bill-of-rights': 2})" in str(err)
        r = c.chat.completions.create(**_ask(extra_body={"emphasis": {}}))
        assert r.choices[0].message.content == service["full"]["text"]
        assert r.model_extra["kdn"] == {"exact": True, "emphasis": {}}
    finally:
        admin.set_emphasis("rights", {})


TOOL = " ".join(f"Row {i}: sensor {i % 7} read {20 + i % 13} degrees at {i % 24}:00." for i in range(40))


def test_a_plain_chat_is_kept_at_its_home_edge_and_its_next_turn_answers_as_vllm_alone(service, model):
    from kdn.client import Client
    from kdn.client.history import History
    from kdn.engines.fingerprint import fingerprints
    from kdn.serve.vllm import salt_of
    c = _client(service["url"])
    first = [{"role": "user", "content": "Here is the tool output:\n" + TOOL + "\nWhich sensor is warmest?"}]
    ask = dict(model=MODEL_NAME, max_tokens=NEW_TOKENS, user="alice",
               extra_body={"prompt_cache_retention": "24h"})
    r1 = c.chat.completions.create(messages=first, **ask)
    assert r1.usage.prompt_tokens == len(model.chat_tokens(first))
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And which is coldest? One word."}]
    r2 = c.chat.completions.create(messages=second, **ask)
    whole = r1.usage.prompt_tokens // 256 * 256
    assert r2.usage.prompt_tokens_details.cached_tokens >= whole, r2.usage
    full = c.chat.completions.create(messages=second, **dict(ask, extra_body={"kdn_fetch": False}))
    assert r2.choices[0].message.content == full.choices[0].message.content
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert _replica_stats(service)["counters"]["kept_chunks"] >= whole // 256
    # the replica kept it at its region's home edge, in the salt's narrower namespace
    fp = fingerprints(model.cache_path)["vllm"]
    view = Client(network=service["network"], region=SERVED, fingerprint=fp, token=READ).view
    history = History(view, "default", fp, token=READ)
    prompt = model.chat_tokens(second)
    from kdn.serve.api import prompt_cache
    salt = prompt_cache({"user": "alice"})["salt"]          # the API's one digest of the caller's salts
    found = history.find(prompt, 0, salt_of("default", salt).partition("|")[2])
    assert found is not None and found.region == SERVED and found.held >= whole // 256
    assert history.find(prompt, 0) is None, "without the salt, nothing"
