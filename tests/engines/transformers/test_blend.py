"""kdn.engines.transformers.blend: segment KV re-positioned and blended, checked against full prefills of the same prompts.

Real model (SmolLM2-135M-Instruct), real tokens from the bundled knowledge; documents stay
short (the two shortest bundled ones, ~350 and ~520 tokens) to keep the module fast.
"""
import numpy as np
import pytest
import torch

from kdn.engines.transformers import blend as B
from kdn.client import Client
from kdn.launch.cluster import start_network, stop_network
from kdn.core.errors import BadRequest, KDNError, ManifestError
from kdn.cli.knowledge import bundled_documents, bundled_questions
from kdn.engines.transformers.model import load_model
from kdn.placement.topology import Topology

REGIONS = ("us-east", "eu-west", "ap-south")
NAMES = ("gettysburg-address", "constitution-article-iii")


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def segs(model):
    """{name: (segment tokens, segment KV from position 0)} for the two short documents."""
    docs = dict(bundled_documents())
    out = {}
    for n in NAMES:
        toks = B.segment_tokens(model, docs[n])
        out[n] = (toks, B.segment_kv(model, toks))
    return out


def test_rerotated_layer0_keys_equal_keys_computed_at_the_offset(model, segs):
    toks, kv0 = segs["gettysburg-address"]
    toks = toks[:120]
    filler = segs["constitution-article-iii"][0][:300]        # offset 300: off the 256 grid
    at0 = model.prefill(toks).kv
    atd = model.prefill(filler + toks).kv[:, :, :, len(filler):]
    moved = B.rotate_keys(model, torch.from_numpy(at0[0, 0]), len(filler)).numpy()
    scale = np.abs(atd[0, 0]).max()
    assert np.abs(moved - atd[0, 0]).max() <= 2e-5 * scale
    assert np.array_equal(at0[0, 1], atd[0, 1]) or np.allclose(at0[0, 1], atd[0, 1], atol=1e-6)
    # without the rotation the keys are far apart; rotating back restores the original
    assert np.abs(at0[0, 0] - atd[0, 0]).max() > 0.1 * scale
    back = B.rotate_keys(model, torch.from_numpy(moved), -len(filler)).numpy()
    assert np.allclose(back, at0[0, 0], atol=2e-5 * scale)
    # deeper layers depend on the context: only layer 0 may be moved exactly
    deep = B.rotate_keys(model, torch.from_numpy(at0[5, 0]), len(filler)).numpy()
    assert np.abs(deep - atd[5, 0]).max() > 1e-2 * np.abs(atd[5, 0]).max()


def test_full_recompute_equals_a_full_prefill(model, segs):
    order = ["constitution-article-iii", "gettysburg-address"]
    parts = [segs[n] for n in order]
    q = bundled_questions()[4]
    prompt = B.prompt_tokens(model, [t for t, _ in parts], q)
    full = model.generate(prompt, max_new_tokens=6)
    gen, blended = B.generate_blended(model, parts, q, share=1.0, max_new_tokens=6)
    assert blended.context_tokens == len(B.header_tokens(model)) + sum(len(t) for t, _ in parts)
    assert len(blended.selected) == blended.context_tokens
    assert torch.allclose(gen.logits, full.logits, atol=2e-3)
    assert gen.tokens == full.tokens
    ref_kv = model.prefill(prompt[:blended.context_tokens], chunk_tokens=4096).kv
    got_kv = blended.kv(model)
    assert np.abs(got_kv - ref_kv).max() < 2e-3 * np.abs(ref_kv).max()


def test_default_share_agrees_with_full_prefill_and_beats_naive(model, segs):
    qs = bundled_questions()
    cases = [(["gettysburg-address", "constitution-article-iii"], qs[4]),
             (["constitution-article-iii", "gettysburg-address"], qs[7]),
             (["gettysburg-address", "constitution-article-iii"], qs[0])]
    top1 = {0.0: 0, B.DEFAULT_SHARE: 0}
    dist = {0.0: 0.0, B.DEFAULT_SHARE: 0.0}
    for order, q in cases:
        parts = [segs[n] for n in order]
        full = model.generate(B.prompt_tokens(model, [t for t, _ in parts], q), max_new_tokens=1)
        for share in top1:
            gen, blended = B.generate_blended(model, parts, q, share=share, max_new_tokens=1)
            top1[share] += int(gen.logits.argmax()) == int(full.logits.argmax())
            dist[share] += float((gen.logits - full.logits).abs().max())
            assert len(blended.selected) == int(np.ceil(share * blended.context_tokens - 1e-9))
    assert top1[B.DEFAULT_SHARE] >= 2
    assert dist[B.DEFAULT_SHARE] < 0.7 * dist[0.0], "recompute must move logits toward the full prefill"


def test_bad_inputs_raise_clear_errors(model, segs):
    toks, kv = segs["gettysburg-address"]
    header = B.header_tokens(model)
    for bad in (-0.1, 1.5, "0.2", True, float("nan")):
        with pytest.raises(BadRequest, match="recompute share must be a number in \\[0, 1\\]"):
            B.blend(model, header, [(toks, kv)], share=bad)
    with pytest.raises(BadRequest, match="segment 0 has KV for .* tokens but 10 tokens"):
        B.blend(model, header, [(toks[:10], kv)])
    with pytest.raises(BadRequest, match="at least one segment"):
        B.blend(model, header, [])
    with pytest.raises(BadRequest, match="select_layer"):
        B.blend(model, header, [(toks, kv)], select_layer=model.layers)
    with pytest.raises(BadRequest, match="non-empty str"):
        B.segment_tokens(model, "   ")


@pytest.fixture
def net(ray_cluster, tmp_path, network_name):
    topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=256 << 20)
    n = start_network(topo, tmp_path / "origin", network=network_name)
    yield n
    stop_network(n)


def test_segments_travel_the_network_byte_identical(net, model, segs):
    docs = dict(bundled_documents())
    cl = Client(network=net.name, region="eu-west", fingerprint=model.fingerprint)
    receipt = B.publish_segments(cl, model, "founding", [(n, docs[n]) for n in NAMES])
    assert receipt["segment_tokens"] == {n: len(segs[n][0]) for n in NAMES}
    m = cl.manifest("founding")
    assert m.layout == "segments" and m.meta["segment_separator"] == B.SEPARATOR
    for n in NAMES:
        by_name = B.fetch_document(cl, "founding", n)
        by_tokens = B.fetch_segment(cl, segs[n][0])
        assert by_name.kv.dtype == np.float32
        assert np.array_equal(by_name.kv, segs[n][1]) and np.array_equal(by_tokens.kv, segs[n][1])
        assert by_name.keys == list(m.document_keys(n))
    # the blended answer from fetched segments equals the one from local KV
    q = bundled_questions()[4]
    order = list(reversed(NAMES))
    gen, _, fetched = B.answer_from_network(cl, model, [docs[n] for n in order], q, max_new_tokens=4)
    local, _ = B.generate_blended(model, [segs[n] for n in order], q, max_new_tokens=4)
    assert gen.tokens == local.tokens and len(fetched) == 2
    with pytest.raises(ManifestError, match="no document 'federalist-10'"):
        B.fetch_document(cl, "founding", "federalist-10")
    with pytest.raises(KDNError, match="holds 0 of its"):
        B.fetch_segment(cl, model.encode("A document nobody published.\n\n"))
