"""Attention for a prefill continued over a cache, without a materialized mask.

A turn of a conversation, a question after a KB, or a chunk of a chunked prefill runs q new
tokens after p cached ones (1 < q, p > 0). transformers' "sdpa" path then builds a boolean
mask [q, p + q] and hands it to scaled_dot_product_attention, whose CPU kernel reads it for
every block: on the time-to-first-token path of every cached turn, the attention alone is most
of the prefill (SmolLM2, 1,000 new tokens over 3,700: 187 ms a layer on one core).

`kdn_sdpa` computes the same attention as two maskless parts of the flash kernel and merges
them by their log-sum-exp (the way FlashAttention combines blocks):
- the new queries over the cached keys, all visible (no mask); heads that share a KV head
  (grouped-query attention) are stacked along the query axis, so the cache is never copied;
- the new queries over their own keys, causal (`is_causal`, square: torch's alignment is
  right for it).
The two outputs are weighted by exp(lse_part - lse_all). The result equals the masked
attention up to floating-point rounding (~1e-7 relative in fp32): greedy answers are
token-identical to a full prefill (tests/engines/transformers/test_model.py), and the same
shapes on the same CPU give the same bytes, as before. 127 ms instead of 187 on the shapes
above (`kdn bench attention` measures it, and the whole forward, on
this machine).

Every other call (a first prefill, a decode step, a padded or custom mask, another device,
dropout, output_attentions) goes to transformers' own sdpa function, unchanged; where the mask
function skipped the mask but the call cannot take the fast path, the lower-right causal mask
it stands for is built for it (sdpa would read no mask as upper-left causal). The mask function
registered beside it returns no mask exactly when the mask would be the plain lower-right
causal one of a single unpadded sequence, which is the case this module handles.
"""
import torch

NAME = "kdn_sdpa"
_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_REGISTERED = []


def _flash(q, k, v, causal: bool, scale):
    """(out [b, h, n, d], lse [b, h, n] float32) of the CPU flash kernel."""
    out, lse = _FLASH(q, k, v, 0.0, causal, scale=scale)[:2]
    return out, lse


def continued(query, key, value, scale=None):
    """Attention of query [b, h, q, d] over key/value [b, kvh, p + q, d] whose last q positions
    are the queries' own (lower-right causal), as two maskless flash calls merged by their
    log-sum-exp. Output [b, h, q, d] in query's dtype."""
    b, h, q, d = query.shape
    kvh, total = key.shape[1], key.shape[2]
    p = total - q
    g = h // kvh
    # the cached part: every query sees every cached key; a KV head's g query heads as one
    # longer sequence of queries over that head (no copy of the cache)
    qg = query.reshape(b, kvh, g * q, d)
    o1, l1 = _flash(qg, key[:, :, :p], value[:, :, :p], False, scale)
    o1, l1 = o1.reshape(b, h, q, d), l1.reshape(b, h, q)
    # the new part: causal among the new tokens (square, so torch's alignment is right)
    k2, v2 = key[:, :, p:], value[:, :, p:]
    if g > 1:
        k2, v2 = k2.repeat_interleave(g, dim=1), v2.repeat_interleave(g, dim=1)
    o2, l2 = _flash(query, k2, v2, True, scale)
    lse = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(query.dtype)


def kdn_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling=None, is_causal=None, **kwargs):
    """transformers' attention-function signature: the continued case here, all else to sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q, total = query.shape[2], key.shape[2]
    if (attention_mask is None and 1 < q < total and query.device.type == "cpu" and dropout == 0.0
            and kwargs.get("position_bias") is None and not kwargs.get("output_attentions", False)
            and getattr(module, "is_causal", True) and is_causal is not False
            and query.shape[1] % key.shape[1] == 0):
        out = continued(query, key, value, scaling)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None and 1 < q < total:
        # kdn_sdpa_mask skipped the mask, which sdpa would read as upper-left causal (every
        # query missing the cache): the lower-right mask it stands for, built here
        attention_mask = torch.ones(q, total, dtype=torch.bool, device=query.device).tril(total - q)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def kdn_sdpa_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                  attention_mask=None, allow_is_causal_skip: bool = True, **kwargs):
    """No mask (None) where sdpa's would be the plain lower-right causal mask of one unpadded
    sequence whose queries are its last q_length positions; else sdpa's own mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask
    if (allow_is_causal_skip and attention_mask is None and batch_size == 1 and kv_offset == 0
            and q_offset == kv_length - q_length and mask_function is causal_mask_function
            and kwargs.get("local_size") is None and not kwargs.get("use_vmap", False)):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def implementation() -> str:
    """The attention implementation to load models with: "kdn_sdpa" once registered with this
    transformers, else its own "sdpa" (an older transformers, or a torch without the CPU flash op)."""
    if _REGISTERED:
        return _REGISTERED[0]
    name = "sdpa"
    if _FLASH is not None:
        try:
            from transformers import AttentionInterface
            from transformers.masking_utils import AttentionMaskInterface, causal_mask_function  # noqa: F401
        except ImportError:
            pass
        else:
            AttentionInterface.register(NAME, kdn_sdpa_forward)
            AttentionMaskInterface.register(NAME, kdn_sdpa_mask)
            name = NAME
    _REGISTERED.append(name)
    return name
