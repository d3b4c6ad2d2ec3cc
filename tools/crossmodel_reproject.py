"""An experiment of issue 38 (calibration split only, nothing chosen or reported on the report
split): does a variant agree more with its own answers when, instead of using the base model's
KV raw, it re-projects K and V with its own weights from the base model's hidden states at
every layer (a K/V projection a layer, far cheaper than recomputing the layer)?

    .venv/bin/python tools/crossmodel_reproject.py [RECIPE]     # default founding-docs-light

Per calibration KB it prints the mean |KV - the reader's own KV| raw and re-projected, then the
running count of greedy answers (16 tokens) identical to the reader's own, per way: raw,
re-projected everywhere, the reader's own layers [0, a) with the rest re-projected or raw, and
re-projected layers [0, a) under a recompute of [a, 30). Results: docs/figures.md.
"""
import sys

import numpy as np
import torch
from kdn.cli.knowledge import bundled_documents
from kdn.engines.transformers import crossmodel as X
from kdn.engines.transformers.model import load_model
from kdn.engines.transformers.variant import built
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

recipe = sys.argv[1] if len(sys.argv) > 1 else "founding-docs-light"
torch.set_num_threads(2)
reader = load_model(variant=built(recipe))
sender = load_model()
L = reader.layers
docs = bundled_documents()
calib = X.windows(reader, docs, X.CALIBRATION_DOCS, 600)


def reproject(model, hidden_by_layer, layers):
    m = model.hf.model
    out = {}
    with torch.inference_mode():
        for i in layers:
            h = torch.as_tensor(hidden_by_layer[i]).unsqueeze(0)
            t = h.shape[1]
            pos = torch.arange(t).unsqueeze(0)
            cos, sin = m.rotary_emb(h, position_ids=pos)
            lay = m.layers[i]
            x = lay.input_layernorm(h)
            k = lay.self_attn.k_proj(x).view(1, t, model.kv_heads, model.head_dim).transpose(1, 2)
            v = lay.self_attn.v_proj(x).view(1, t, model.kv_heads, model.head_dim).transpose(1, 2)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
            out[i] = np.stack([k[0].float().numpy(), v[0].float().numpy()])
    return out


ways = {}
def score(name, same, first):
    s = ways.setdefault(name, [0, 0, 0]); s[0] += 1; s[1] += same; s[2] += first

for label, text in calib:
    know = reader.knowledge_tokens(text)
    sender_kv, hidden = X.prefill_with_hidden(sender, know, range(L))
    own = reader.prefill(know).kv
    _, own_hidden = X.prefill_with_hidden(reader, know, range(L))
    rep = reproject(reader, hidden, range(L))
    # sanity: reprojecting the reader's own hidden states gives its own KV
    own_rep = reproject(reader, own_hidden, [0, L - 1])
    print(label, "sanity max|d|", max(float(np.abs(own_rep[i] - own[i]).max()) for i in (0, L - 1)),
          "raw d", float(np.abs(sender_kv - own).mean()),
          "rep d", float(np.mean([np.abs(rep[i] - own[i]).mean() for i in range(L)])), flush=True)
    refs = []
    for q in X.CALIBRATION_QUESTIONS:
        tail = reader.question_tokens(q)
        g = reader.generate(know + tail, cache=reader.cache_from_kv([own], len(tail) + 17), cached_tokens=len(know), max_new_tokens=16)
        refs.append((tail, g.tokens, g.finish))
    def run(name, kv):
        cache = reader.cache_from_kv([kv], 16 + 64)
        for tail, ref, finish in refs:
            score(name, *X.agreement(reader, cache, len(know), tail, ref, finish))
    run("raw", sender_kv)
    full_rep = np.stack([rep[i] for i in range(L)])
    run("reproject all", full_rep)
    for a in (3, 6, 9, 12):
        own_first = X.recompute(reader, hidden[0], 0, a)      # the reader's own layers [0, a)
        kv = full_rep.copy(); kv[:a] = own_first
        run(f"recompute 0-{a} + reproject rest", kv)
        kv2 = np.array(sender_kv, copy=True); kv2[:a] = own_first
        run(f"recompute 0-{a} + raw rest", kv2)
    for a in (12, 18):
        r = X.recompute(reader, hidden[a], a, L)
        kv = full_rep.copy(); kv[a:] = r
        run(f"reproject 0-{a} + recompute {a}-{L}", kv)
    for name, s in ways.items():
        print(f"  {name:40s} {s[1]}/{s[0]} identical, first {s[2]}/{s[0]}", flush=True)
