"""kdn/engines/kv_edit.py: duplicating a token's KV k times adds exactly log k to its attention logit
on the real model, the question keeps the positions of the unedited prompt, a weight of 1 is
the KB's own KV bit for bit, and bad weights are refused naming the document."""
import math

import numpy as np
import pytest
import torch

from kdn.engines import kv_edit as E
from kdn.core.emphasis import check_weights, parse_weights
from kdn.serve.chat import stream
from kdn.core.errors import BadRequest
from kdn.client.publish import knowledge_documents

DOCS = [("old.md", "Policy B12, version 3 (2019). This version is superseded. The front office opens at 2 o'clock."),
        ("new.md", "Policy B12, version 4 (2024), in force. The front office opens at 8 o'clock.")]
QUESTION = "When does the front office open? Answer with one word."


@pytest.fixture(scope="module")
def kb(model):
    named = knowledge_documents(model, DOCS)
    tokens = [t for _, toks in named for t in toks]
    return named, tokens, model.prefill(tokens).kv


def test_bad_weights_are_refused_naming_the_document():
    names = ["old.md", "new.md"]
    for weights, msg in (({"new.md": 0}, "'new.md' must be an int in \\[1, 16\\].*got 0"),
                         ({"new.md": -2}, "'new.md' must be an int.*got -2"),
                         ({"new.md": 2.5}, "'new.md' must be an int.*got 2.5"),
                         ({"new.md": "4"}, "'new.md' must be an int.*got '4'"),
                         ({"new.md": True}, "'new.md' must be an int.*got True"),
                         ({"new.md": 17}, "got 17"),
                         ({"nope.md": 2}, "names document 'nope.md', which the knowledge base does not have"),
                         ([("new.md", 2)], "must be an object")):
        with pytest.raises(BadRequest, match=msg):
            check_weights(weights, names)
    assert check_weights({"new.md": 4.0, "old.md": 1}, names) == {"new.md": 4}
    assert check_weights(None, names) == {}
    assert parse_weights(["a=b.md=3", "new.md=4"]) == {"a=b.md": 3, "new.md": 4}
    for item in ("new.md", "=4"):
        with pytest.raises(BadRequest) as e:
            parse_weights([item])
        assert str(e.value) == f"emphasis {item!r}: expected DOCUMENT=K (K an integer in [1, 16]), e.g. policy.md=4"


def weight_message(got) -> str:
    """The one message every refused weight gets, from the CLI, the origin and the service."""
    return ("emphasis weight of document 'new.md' must be an int in [1, 16] (a weight k adds log k "
            f"to its tokens' attention logits), got {got!r}")


def test_a_weight_is_an_integer_in_1_to_16_in_ascii_digits_with_one_message():
    """One rule, one message: K in [1, 16] (1 is no emphasis), written in ASCII digits on a
    command line; whatever else is refused with the message the service gives."""
    assert parse_weights(["new.md=1", "old.md=16"]) == {"new.md": 1, "old.md": 16}
    assert parse_weights(["new.md=04"]) == {"new.md": 4}
    assert check_weights(parse_weights(["new.md=1", "old.md=3"])) == {"old.md": 3}
    for text, got in (("\u0664", "\u0664"), ("\uff14", "\uff14"), (" 4", " 4"), ("4 ", "4 "), ("+4", "+4"),
                      ("4.0", "4.0"), ("1_0", "1_0"), ("-1", "-1"), ("", ""), ("x", "x"),
                      ("0", 0), ("17", 17), ("0000000017", 17), ("99999999999", "99999999999")):
        with pytest.raises(BadRequest) as e:
            parse_weights([f"new.md={text}"])
        assert str(e.value) == weight_message(got), text
    for bad in (0, 17, "4", "\u0664", True):          # the origin's and the service's check: the same words
        with pytest.raises(BadRequest) as e:
            check_weights({"new.md": bad}, ["new.md"])
        assert str(e.value) == weight_message(bad)


def test_document_spans_leave_out_the_system_turn_frame(model, kb):
    named, tokens, _ = kb
    (n0, a0, b0), (n1, a1, b1) = E.document_spans(model, named)
    head, tail = E._frame(model)
    assert (n0, n1) == ("old.md", "new.md") and a0 == len(head) > 0 and b1 == len(tokens) - len(tail)
    assert b0 == a1 == len(named[0][1])
    assert model.tokenizer.decode(tokens[a1:b1]).strip() == DOCS[1][1]


def test_weight_one_is_the_kb_itself_bitwise_and_token_identical(model, kb):
    named, tokens, kv = kb
    ones = E.token_weights(E.document_spans(model, named), {}, len(tokens))
    for method in E.METHODS:
        assert E.edit(kv, ones, method) is kv
    assert check_weights({"new.md": 1}, ["new.md"]) == {}
    q = model.question_tokens(QUESTION)
    plain = model.generate(tokens + q, cache=model.cache_from_kv([kv], len(q) + 8),
                           cached_tokens=len(tokens), max_new_tokens=8)
    steps = list(stream(model, tokens + q, model.cache_from_kv([E.edit(kv, ones)], len(q) + 8),
                        len(tokens), 8))
    assert [s.token for s in steps if s.token is not None] == plain.tokens


def _layer0_probs(model, kv, tokens, q, extra):
    """Layer 0's attention probabilities [heads, q, cache + q] of the question after kv, and
    the cache (eager attention, the same math as SDPA, so the probabilities can be read)."""
    seen = []
    hook = model.hf.model.layers[0].self_attn.register_forward_hook(lambda m, a, out: seen.append(out[1]))
    model.hf.set_attn_implementation("eager")
    try:
        cache = model.cache_from_kv([kv], len(q))
        E.forward(model, q, cache, len(tokens), extra)
    finally:
        model.hf.set_attn_implementation("sdpa")
        hook.remove()
    return seen[0][0].double(), cache


@pytest.mark.parametrize("k", [2, 5])
def test_duplicating_a_document_adds_log_k_to_its_attention_logits_on_real_attention(model, kb, k):
    named, tokens, kv = kb
    q = model.question_tokens(QUESTION)
    reps = E.token_weights(E.document_spans(model, named), {"new.md": k}, len(tokens))
    edited = E.edit(kv, reps)
    extra = E.extra_tokens(reps)
    assert edited.shape[3] == len(tokens) + extra and extra == (k - 1) * int((reps == k).sum())
    plain, _ = _layer0_probs(model, kv, tokens, q, 0)
    emph, _ = _layer0_probs(model, edited, tokens, q, extra)
    n = len(tokens)
    # logit change per original token: log(sum of its copies' probabilities) - log(its probability)
    owner = np.repeat(np.arange(n), reps)                                     # cache entry -> token
    copies = torch.zeros(*emph.shape[:2], n, dtype=torch.float64).index_add_(2, torch.from_numpy(owner),
                                                                              emph[:, :, :len(owner)])
    delta = torch.log(copies) - torch.log(plain[:, :, :n])                    # [heads, q, n]
    delta_q = torch.log(emph[:, :, len(owner):]) - torch.log(plain[:, :, n:])  # the question's own tokens
    causal = torch.isfinite(delta_q)                  # a query does not see the question tokens after it
    base = delta[:, :, reps == 1]
    shift = base.mean(-1, keepdim=True)               # the softmax's normalisation, per head and query
    bias = delta[:, :, reps == k] - shift
    assert (base - shift).abs().max() < 1e-4
    assert (delta_q - shift)[causal].abs().max() < 1e-4
    assert (bias - math.log(k)).abs().max() < 1e-4, float((bias - math.log(k)).abs().max())


def test_the_question_keeps_the_positions_of_the_unedited_prompt(model, kb):
    named, tokens, kv = kb
    q = model.question_tokens(QUESTION)
    reps = E.token_weights(E.document_spans(model, named), {"new.md": 4}, len(tokens))
    edited, extra = E.edit(kv, reps), E.extra_tokens(reps)
    plain = model.cache_from_kv([kv], len(q))
    E.forward(model, q, plain, len(tokens), 0)
    emph = model.cache_from_kv([edited], len(q))
    E.forward(model, q, emph, len(tokens), extra)
    wrong = model.cache_from_kv([edited], len(q))
    E.forward(model, q, wrong, len(tokens), 0)        # the engine's own positions: shifted by extra
    k_plain = model.kv_from_cache(plain, len(tokens))[0, 0]      # layer 0 keys of the question, rotated
    k_emph = model.kv_from_cache(emph, len(tokens) + extra)[0, 0]
    k_wrong = model.kv_from_cache(wrong, len(tokens) + extra)[0, 0]
    # bitwise on any CPU: a layer-0 key is RoPE(W_k x) of the token's own embedding, computed
    # for the same question tokens in the same batch shape; the cache before it never enters
    assert np.array_equal(k_plain, k_emph)
    assert not np.allclose(k_plain, k_wrong, atol=1e-3)
    # the copies keep the positions already rotated into the KB's keys
    first = E.first_edited(reps)
    assert np.array_equal(edited[:, :, :, :first], kv[:, :, :, :first])
    assert np.array_equal(edited[:, :, :, first:first + 4], np.repeat(kv[:, :, :, first:first + 1], 4, axis=3))


def test_scaling_edits_keep_the_length_and_scale_only_the_span(model, kb):
    named, tokens, kv = kb
    reps = E.token_weights(E.document_spans(model, named), {"new.md": 3}, len(tokens)).astype(np.float32)
    hit = reps == 3
    v = E.edit(kv, reps, "vscale")
    assert v.shape == kv.shape and np.array_equal(v[:, 0], kv[:, 0])
    assert np.allclose(v[:, 1][:, :, hit], 3 * kv[:, 1][:, :, hit]) and np.array_equal(v[:, 1][:, :, ~hit], kv[:, 1][:, :, ~hit])
    k = E.edit(torch.from_numpy(kv), reps, "kscale")
    assert torch.equal(k[:, 1], torch.from_numpy(kv[:, 1]))
    with pytest.raises(BadRequest, match="method must be one of"):
        E.edit(kv, reps, "shout")
    with pytest.raises(BadRequest, match="positive integer weights"):
        E.edit(kv, reps * 0.5 + 1, "duplicate")


def test_the_edit_salt_names_kb_version_and_weights():
    s = E.edit_salt("kb", 1, {"a.md": 2})
    assert len(s) == 16 and s == E.edit_salt("kb", 1, {"a.md": 2})
    assert len({s, E.edit_salt("kb", 2, {"a.md": 2}), E.edit_salt("kb", 1, {"a.md": 3}),
                E.edit_salt("kc", 1, {"a.md": 2}), E.edit_salt("kb", 1, {"b.md": 2})}) == 5


def test_kdn_publish_refuses_bad_emphasis_before_the_model_loads(tmp_path, capsys):
    from kdn.cli import main
    (tmp_path / "new.md").write_text(DOCS[1][1])
    for flag, msg in (("nope.md=2", "names document 'nope.md', which the knowledge base does not have"),
                      ("new.md=0", "'new.md' must be an int in [1, 16]"),
                      ("new.md=x", weight_message("x")),
                      ("new.md=\u0664", weight_message("\u0664")),
                      ("new.md", "emphasis 'new.md': expected DOCUMENT=K (K an integer in [1, 16])")):
        assert main(["publish", "kb", str(tmp_path), "--emphasis", flag, "--network", "nowhere"]) == 2
        assert msg in capsys.readouterr().err


def test_kdn_emphasize_refuses_bad_arguments_before_it_connects(capsys):
    from kdn.cli import main
    neither = "kdn: error: name the weights (DOC=K, K an integer in [1, 16]; 1: no emphasis) or --clear"
    for args, msg in ((["kb"], neither + "\n"),
                      (["kb", "new.md=2", "--clear"], neither + ", not both\n"),
                      (["kb", "new.md=17"], weight_message(17)),
                      (["kb", "new.md=\u0664"], weight_message("\u0664")),    # a non-ASCII digit
                      (["kb", "new.md= 4"], weight_message(" 4")),
                      (["kb", "new.md=0"], weight_message(0)),
                      (["kb", "new.md"], "emphasis 'new.md': expected DOCUMENT=K"),
                      (["../kb", "new.md=2"], "knowledge base name must match")):
        assert main(["emphasize", *args, "--network", "nowhere", "--address", "127.0.0.1:1"]) == 2
        assert msg in capsys.readouterr().err, args
