"""kdn.engines.transformers.attention: a prefill continued over a cache, maskless, equals the
masked attention it replaces, and every other call takes transformers' own sdpa path."""
import pytest
import torch

from kdn.engines.transformers import attention
from kdn.engines.transformers.model import load_model


def masked(q, k, v):
    """Reference: sdpa with the materialized lower-right causal mask (what "sdpa" ran before)."""
    n, total = q.shape[2], k.shape[2]
    g = q.shape[1] // k.shape[1]
    mask = (torch.arange(n)[:, None] + total - n >= torch.arange(total)[None, :])[None, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)


@pytest.mark.parametrize("heads,kv_heads,past,new", [(9, 3, 700, 300), (4, 4, 33, 2), (6, 2, 1, 257)])
def test_continued_equals_the_masked_attention(heads, kv_heads, past, new):
    torch.manual_seed(heads * past + new)
    q = torch.randn(1, heads, new, 64)
    k, v = torch.randn(1, kv_heads, past + new, 64), torch.randn(1, kv_heads, past + new, 64)
    got, want = attention.continued(q, k, v), masked(q, k, v)
    assert got.shape == want.shape == (1, heads, new, 64) and got.dtype == torch.float32
    assert torch.allclose(got, want, atol=2e-6, rtol=1e-5), (got - want).abs().max()


def test_continued_in_bfloat16_stays_bfloat16_and_close():
    torch.manual_seed(1)
    q = torch.randn(1, 9, 100, 64).bfloat16()
    k, v = torch.randn(1, 3, 400, 64).bfloat16(), torch.randn(1, 3, 400, 64).bfloat16()
    got = attention.continued(q, k, v)
    assert got.dtype == torch.bfloat16
    assert (got.float() - masked(q.float(), k.float(), v.float())).abs().max() < 0.05


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_the_model_runs_kdn_sdpa_and_a_continued_prefill_agrees_with_sdpa(model):
    assert model.hf.config._attn_implementation == attention.NAME
    ids = torch.tensor([list(range(1000, 1600))])
    logits = {}
    for impl in ("sdpa", attention.NAME):
        model.hf.set_attn_implementation(impl)
        cache = model.new_cache()
        with torch.inference_mode():
            model.hf(input_ids=ids[:, :400], past_key_values=cache, use_cache=True)
            logits[impl] = model.hf(input_ids=ids[:, 400:], past_key_values=cache, use_cache=True).logits[0]
    assert model.hf.config._attn_implementation == attention.NAME
    a, b = logits["sdpa"], logits[attention.NAME]
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max() < 1e-3


def test_a_padded_batch_takes_sdpas_own_masked_path(model):
    """A 2-D attention mask with padding is not the case kdn_sdpa handles: sdpa's mask is built
    and the answers equal sdpa's exactly (the same kernels on the same mask)."""
    ids = torch.tensor([list(range(2000, 2040)), list(range(3000, 3040))])
    pad = torch.ones_like(ids)
    pad[1, :5] = 0
    out = {}
    for impl in ("sdpa", attention.NAME):
        model.hf.set_attn_implementation(impl)
        with torch.inference_mode():
            out[impl] = model.hf(input_ids=ids, attention_mask=pad).logits
    model.hf.set_attn_implementation(attention.NAME)
    assert torch.equal(out["sdpa"], out[attention.NAME])


def test_the_mask_is_skipped_only_for_one_unpadded_lower_right_causal_sequence():
    from transformers.masking_utils import causal_mask_function
    assert attention.kdn_sdpa_mask(1, 10, 50, q_offset=40, mask_function=causal_mask_function) is None
    for kwargs in ({"batch_size": 2, "q_offset": 40}, {"batch_size": 1, "q_offset": 30},
                   {"batch_size": 1, "q_offset": 40, "allow_is_causal_skip": False}):
        mask = attention.kdn_sdpa_mask(q_length=10, kv_length=50, mask_function=causal_mask_function, **kwargs)
        assert mask is not None and mask.dtype == torch.bool and mask.shape[-2:] == (10, 50)


class _Layer:
    is_causal = True
    num_key_value_groups = 3
    training = False


def test_a_skipped_mask_that_cannot_take_the_fast_path_is_built_lower_right():
    """The mask function skipped the mask, but the call falls back (here: dropout, which the
    flash path does not take): sdpa gets the lower-right causal mask, not upper-left."""
    torch.manual_seed(3)
    q = torch.randn(1, 9, 20, 64)
    k, v = torch.randn(1, 3, 70, 64), torch.randn(1, 3, 70, 64)
    torch.manual_seed(0)
    out, _ = attention.kdn_sdpa_forward(_Layer(), q, k, v, None, dropout=1e-9)
    want = masked(q, k, v).transpose(1, 2)
    assert out.shape == want.shape
    assert torch.allclose(out, want, atol=1e-4), (out - want).abs().max()
