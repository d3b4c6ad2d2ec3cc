"""`kdn bench attention`: a prefill continued over a cache, with transformers' sdpa and with kdn_sdpa.

kdn_sdpa (kdn/engines/transformers/attention.py) runs the attention of new tokens over a
cache as two maskless flash-attention calls merged by log-sum-exp, where sdpa reads a
materialized mask. This bench times both on this machine's threads, in one run: one layer's
attention on random tensors of SmolLM2's shapes (and the largest difference between them),
then the model's whole forward of the new tokens over a real cache of the cached ones (and
whether both choose the same next token). Run it pinned for steady figures:
`OMP_NUM_THREADS=1 taskset -c 0 kdn bench attention`.
"""
import argparse

import torch

from kdn.bench import emit_json, timeit
from kdn.engines.transformers.attention import NAME, continued


def best(fn, reps: int) -> float:
    return min(timeit(fn, reps=reps))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("--past", type=int, default=3700, help="cached tokens (default 3700)")
    ap.add_argument("--new", type=int, default=1000, help="new tokens computed over them (default 1000)")
    ap.add_argument("--reps", type=int, default=3, help="timed reps, the fastest reported (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    from kdn.engines.transformers.model import load_model
    past, new = args.past, args.new
    model = load_model()
    heads, kv_heads = model.hf.config.num_attention_heads, model.kv_heads
    torch.manual_seed(0)
    q = torch.randn(1, heads, new, model.head_dim)
    k, v = (torch.randn(1, kv_heads, past + new, model.head_dim) for _ in range(2))
    mask = (torch.arange(new)[:, None] + past >= torch.arange(past + new)[None, :])[None, None]
    kr, vr = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)

    def masked():
        return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
    a, b = best(masked, args.reps), best(lambda: continued(q, k, v), args.reps)
    diff = (masked() - continued(q, k, v)).abs().max().item()
    print(f"one layer, {new} new tokens over {past} cached, {heads} heads ({kv_heads} KV), "
          f"{torch.get_num_threads()} threads: masked sdpa {a * 1e3:.1f} ms, {NAME} {b * 1e3:.1f} ms "
          f"({a / b:.2f}x); max |difference| {diff:.1e}")
    ids = torch.randint(100, model.vocab_size - 100, (1, past + new), generator=torch.Generator().manual_seed(0))
    took, last = {}, {}
    for impl in ("sdpa", NAME):
        model.hf.set_attn_implementation(impl)
        cache = model.new_cache()
        with torch.inference_mode():
            model.hf(input_ids=ids[:, :past], **model.cache_kwargs(cache))

            def run():
                model.crop(cache, past)
                last[impl] = model.hf(input_ids=ids[:, past:], logits_to_keep=1, **model.cache_kwargs(cache)).logits
            took[impl] = best(run, max(1, args.reps - 1))
    model.hf.set_attn_implementation(NAME)
    same = torch.equal(last["sdpa"].argmax(-1), last[NAME].argmax(-1))
    print(f"the model's forward, {new} tokens over {past} cached: sdpa {took['sdpa']:.2f} s, {NAME} "
          f"{took[NAME]:.2f} s ({took['sdpa'] / took[NAME]:.2f}x); the same next token: {same}")
    if args.json:
        emit_json({"past": past, "new": new, "threads": torch.get_num_threads(), "layer_masked_s": a,
                   "layer_kdn_sdpa_s": b, "max_difference": diff, "forward_sdpa_s": took["sdpa"],
                   "forward_kdn_sdpa_s": took[NAME], "same_next_token": same})
    return 0
