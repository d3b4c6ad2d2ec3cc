"""The service's parts without Ray: requests checked (kdn.serve.api), chat prompts (kdn.serve.chat).

A KB's knowledge tokens must be an exact prefix of the full chat prompt, or the tokens KDN
serves would not be the ones the model reads; and token-by-token generation must give the
tokens Model.generate gives.
"""
import pytest

from kdn.core.auth import Tokens
from kdn.serve.chat import messages_tokens
from kdn.core.errors import BadRequest
from kdn.engines.transformers.model import MODEL_NAME
from kdn.serve.api import (MAX_CHAT_BODY_BYTES, ApiError, check_messages, credentials, model_list, parse_chat,
                           parse_json, tenant_of)

MSG = [{"role": "user", "content": "Who wrote it?"}]


# `model`: tests/conftest.py (the real model, one intra-op thread)


@pytest.mark.parametrize("body, kb, version", [
    ({"model": f"{MODEL_NAME}@rights"}, "rights", None),
    ({"model": f"{MODEL_NAME}@rights:3"}, "rights", 3),
    ({"model": MODEL_NAME, "kb": "rights:2"}, "rights", 2),
    ({"model": f"{MODEL_NAME}@rights", "kb": "rights"}, "rights", None),
])
def test_the_kb_is_named_by_model_or_by_kb(body, kb, version):
    r = parse_chat({"messages": MSG, **body}, MODEL_NAME)
    assert (r.kb, r.version, r.max_tokens, r.temperature, r.stream) == (kb, version, 256, 0.0, False)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "other@rights"}, 404, "model"),
    ({"model": f"{MODEL_NAME}@"}, 400, "model"),
    ({"model": f"{MODEL_NAME}@rights:0"}, 400, "model"),
    ({"model": f"{MODEL_NAME}@rights", "kb": "courts"}, 400, "kb"),
    ({"model": f"{MODEL_NAME}@rights", "messages": "hi"}, 400, "messages"),
    ({"model": f"{MODEL_NAME}@rights", "messages": [{"role": "user", "content": 3}]}, 400, "messages"),
    ({"model": f"{MODEL_NAME}@rights", "max_tokens": True}, 400, "max_tokens"),
    ({"model": f"{MODEL_NAME}@rights", "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ({"model": f"{MODEL_NAME}@rights", "stream": "yes"}, 400, "stream"),
    ({"model": f"{MODEL_NAME}@rights", "n": 2}, 400, "n"),
    ({"model": 7}, 400, "model"),
])
def test_bad_requests_name_the_field(body, status, param):
    with pytest.raises(ApiError) as err:
        parse_chat({"messages": MSG, **body}, MODEL_NAME)
    assert (err.value.status, err.value.param) == (status, param)
    assert err.value.body()["error"]["message"]


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("logprobs", True), ("top_logprobs", 2), ("stop", ["\n"]), ("stop", "END"), ("top_p", 0.5),
    ("presence_penalty", 0.5), ("frequency_penalty", -1), ("response_format", {"type": "json_object"}),
])
def test_what_the_service_does_not_do_is_refused_not_ignored(field, value):
    with pytest.raises(ApiError) as err:
        parse_chat({"model": f"{MODEL_NAME}@kb", "messages": MSG, field: value}, MODEL_NAME)
    assert (err.value.status, err.value.param, err.value.code) == (400, field, "unsupported_parameter")


def test_defaults_of_unsupported_fields_are_accepted_and_kdn_fetch_is_a_bool():
    r = parse_chat({"model": f"{MODEL_NAME}@kb", "messages": MSG, "tools": [], "tool_choice": "none",
                    "logprobs": False, "stop": None, "top_p": 1, "presence_penalty": 0,
                    "response_format": {"type": "text"}, "user": "u-1"}, MODEL_NAME)
    assert r.kdn_fetch is True
    assert parse_chat({"model": f"{MODEL_NAME}@kb", "messages": MSG, "kdn_fetch": False},
                      MODEL_NAME).kdn_fetch is False
    with pytest.raises(ApiError) as err:
        parse_chat({"model": f"{MODEL_NAME}@kb", "messages": MSG, "kdn_fetch": "no"}, MODEL_NAME)
    assert err.value.param == "kdn_fetch"


def test_max_completion_tokens_wins_and_text_parts_join():
    r = parse_chat({"model": f"{MODEL_NAME}@kb", "max_tokens": 5, "max_completion_tokens": 7,
                    "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                   {"type": "text", "text": "b"}]}]},
                   MODEL_NAME)
    assert r.max_tokens == 7 and r.messages == [{"role": "system", "content": "ab"}]


def test_tenants_from_bearer_tokens():
    admin, read, acme = "a" * 20, "r" * 20, "c" * 20
    locked = Tokens(admin, {"default": read, "acme": acme})
    assert tenant_of(locked, f"Bearer {read}") == "default"
    assert tenant_of(locked, f"Bearer {acme}") == "acme"
    assert tenant_of(locked, f"Bearer {admin}") == "default"
    for header, status in ((None, 401), ("Basic xyz", 401), ("Bearer " + "x" * 20, 403)):
        with pytest.raises(ApiError) as err:
            tenant_of(locked, header)
        assert err.value.status == status
    assert tenant_of(Tokens(admin, {"acme": acme}), f"Bearer {acme}") == "acme"
    for header in (None, "Bearer sk-anything"):       # read tokens off: anyone reads "default"
        assert tenant_of(Tokens(admin), header) == "default"


def test_with_read_tokens_on_the_default_tenant_is_closed_unless_left_open():
    """A KB published without --tenant is not readable with any token or none just because
    "default" has no read token of its own: 401 without one, 403 for a wrong one, unless
    the operator says default=* (then any key, or none, reads it, as the edges let it)."""
    admin, acme = "a" * 20, "c" * 20
    no_default = Tokens(admin, {"acme": acme})
    for header, status, code in ((None, 401, "missing_token"), ("Bearer sk-anything", 403, "invalid_token")):
        with pytest.raises(ApiError) as err:
            tenant_of(no_default, header)
        assert (err.value.status, err.value.code) == (status, code)
        assert err.value.body()["error"]["message"]
    assert credentials(no_default, f"Bearer {acme}") == ("acme", acme)
    assert credentials(no_default, f"Bearer {admin}") == ("default", admin)
    left_open = Tokens.from_dict({"admin": admin, "readers": {"acme": acme, "default": "*"}})
    for header in (None, "Bearer sk-anything"):       # the token is not passed on: an open tenant needs none
        assert credentials(left_open, header) == ("default", None)
    assert credentials(left_open, f"Bearer {acme}") == ("acme", acme)


def test_deeply_nested_and_oversized_bodies_are_refused_naming_the_problem():
    for raw in (b"[" * 100_000, b'{"a":' * 100_000, b'{"model": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"):
        with pytest.raises(ApiError) as err:
            parse_json(raw)
        assert (err.value.status, err.value.code) == (400, "json_too_deep")
        assert "nests JSON" in err.value.body()["error"]["message"]
    assert parse_json(b'{"a": ' + b"[" * 200 + b"]" * 200 + b"}") == {"a": eval("[" * 200 + "]" * 200)}
    with pytest.raises(ApiError) as err:
        parse_json(b" " * (MAX_CHAT_BODY_BYTES + 1))
    assert (err.value.status, err.value.code, err.value.headers()) == (413, "body_too_large", {"Connection": "close"})


def test_model_list():
    assert [m["id"] for m in model_list("m", ["b", "a", "a"])["data"]] == ["m", "m@a", "m@b"]


def test_check_messages_refuses_unknown_roles():
    with pytest.raises(BadRequest, match="role"):
        check_messages([{"role": "tool", "content": "x"}])


def test_knowledge_is_an_exact_prefix_of_the_chat_prompt(model):
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who wrote it?"}]
    kb = model.knowledge_tokens("We the People of the United States.")
    whole = model.tokenizer.apply_chat_template(
        [{"role": "system", "content": "We the People of the United States."}] + msgs,
        tokenize=False, add_generation_prompt=True)
    assert kb + messages_tokens(model, msgs) == model.encode(whole)
    q = "Who wrote it?"       # one user message is exactly `kdn query`'s question turn
    assert messages_tokens(model, [{"role": "user", "content": q}]) == model.question_tokens(q)


def test_streamed_tokens_are_generate_tokens(model):
    from kdn.serve.chat import stream
    prompt = model.prompt_tokens("The sky is blue. Grass is green.", "What colour is grass?")
    want = model.generate(prompt, max_new_tokens=8)
    steps = list(stream(model, prompt, None, 0, 8))
    assert [s.token for s in steps if s.token is not None] == want.tokens
    assert "".join(s.text for s in steps) == want.text
    assert steps[-1].finish == ("length" if want.finish == "length" else "stop")
    # from a cache holding the first part of the prompt, as a KDN fetch gives it
    pre = model.prefill(prompt[:20])
    steps = list(stream(model, prompt, model.cache_from_kv([pre.kv], len(prompt)), 20, 8))
    assert [s.token for s in steps if s.token is not None] == want.tokens


def test_sampling_with_a_seed_repeats(model):
    from kdn.serve.chat import stream
    prompt = model.prompt_tokens("The sky is blue.", "Say something.")
    runs = [[s.token for s in stream(model, prompt, None, 0, 6, temperature=1.0, seed=7)] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0]


def test_the_prompt_cache_fields_are_checked_and_the_salts_travel_as_one_digest():
    from kdn.serve.api import prompt_cache
    got = prompt_cache({"cache_salt": "x" * 1024, "user": "y" * 1024, "safety_identifier": "z" * 1024,
                        "prompt_cache_key": "conv-1", "prompt_cache_retention": "24h"})
    assert len(got["salt"]) == 32 and got["prompt_cache_key"] == "conv-1" and got["prompt_cache_retention"] == "24h"
    assert prompt_cache({"user": "alice"})["salt"] != prompt_cache({"cache_salt": "alice"})["salt"]
    assert prompt_cache({}) == {"prompt_cache_key": None, "prompt_cache_retention": None, "salt": None}


def test_a_model_without_a_kb_is_a_plain_chat():
    r = parse_chat({"model": MODEL_NAME, "messages": MSG}, MODEL_NAME)
    assert r.kb is None and r.version is None and r.messages == MSG


def test_errors_map_to_statuses_a_node_that_did_not_answer_503_one_that_failed_502():
    from kdn.core.errors import RemoteError
    from kdn.core.rpc import Unreachable
    from kdn.serve.api import api_error
    down, fault, bad = api_error(Unreachable("edge x")), api_error(RemoteError("edge x: 500")), api_error(BadRequest("no"))
    assert (down.status, down.code, down.retry_after is not None) == (503, "network_unavailable", True)
    assert (fault.status, fault.code, fault.body()["error"]["type"]) == (502, "network_fault", "server_error")
    assert bad.status == 400


def test_a_variant_is_named_beside_the_model_and_cross_model_is_its_opt_in_only():
    """A service running a variant takes '<model>+<variant>' (another name is still 404);
    cross_model is a bool, only for a variant, only over a KB, never with emphasis or without
    KDN; the answer's note says it is not exact and names the plan."""
    from kdn.serve.api import kv_note
    v = f"{MODEL_NAME}+legal"
    r = parse_chat({"model": f"{v}@kb", "messages": MSG, "cross_model": True}, MODEL_NAME, (v,))
    assert (r.model, r.kb, r.cross_model) == (f"{v}@kb", "kb", True)
    assert parse_chat({"model": f"{v}@kb", "messages": MSG}, MODEL_NAME, (v,)).cross_model is False
    with pytest.raises(ApiError) as err:
        parse_chat({"model": f"{v}@kb", "messages": MSG}, MODEL_NAME)        # not served
    assert (err.value.status, err.value.code) == (404, "model_not_found")
    for body in ({"model": f"{MODEL_NAME}@kb", "cross_model": True}, {"model": v, "cross_model": True},
                 {"model": f"{v}@kb", "cross_model": 1}, {"model": f"{v}@kb", "cross_model": True, "kdn_fetch": False},
                 {"model": f"{v}@kb", "cross_model": True, "emphasis": {"a.md": 2}}):
        with pytest.raises(ApiError) as err:
            parse_chat({"messages": MSG, **body}, MODEL_NAME, (v,))
        assert (err.value.status, err.value.param) == (400, "cross_model"), body
    plan = {"sender": "base", "plan": "p", "recompute": [12, 24], "layers": 30}
    assert kv_note(None, plan) == {"exact": False, "emphasis": {}, "cross_model": plan}
    assert kv_note() == {"exact": True, "emphasis": {}}
    assert [m["id"] for m in model_list(MODEL_NAME, ["kb"], variants=[v])["data"]] == [MODEL_NAME, f"{MODEL_NAME}@kb", v]
    assert [m["id"] for m in model_list(MODEL_NAME, ["kb"], variants={v: ["z", "a"]})["data"]] == [
        MODEL_NAME, f"{MODEL_NAME}@kb", v, f"{v}@a", f"{v}@z"]
