"""Engines: where KDN meets inference, tokens in and KV out, KV in and tokens out.

- base.py          the one engine interface (prefill to KV, answer over fetched KV, fingerprint),
                   and publish / answer written once over it;
- fingerprint.py   which engine computed a cache, as part of the model's fingerprint;
- sources.py       how a connector inside an engine reaches edges (Ray or HTTP), tenants by
                   cache salt, deadlines;
- transformers/    the HF transformers engine: the model, its cache adapter, blended reuse;
- vllm/            vLLM through its v1 KV connector (`kdn.engines.vllm`).

Only vllm/ imports vLLM; only transformers/ and vllm/ import torch at module level.
"""
