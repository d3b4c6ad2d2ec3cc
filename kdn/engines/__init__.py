"""Engines: where KDN meets inference, tokens in and KV out, KV in and tokens out.

- base.py          the one engine interface (prefill to KV, answer over fetched KV, fingerprint),
                   and publish / answer written once over it;
- fingerprint.py   which engine computed a cache, as part of the model's fingerprint;
- sources.py       how a connector inside an engine reaches edges (Ray or HTTP), tenants by
                   cache salt, deadlines;
- kv_edit.py       KV edited so the model attends more to trusted documents (emphasis);
- emphasis_variants.py  emphasized KV in the network: apart from exact KV, served only on
                   request;
- transformers/    the HF transformers engine: the model, its cache adapter, blended reuse;
- vllm/            vLLM through its v1 KV connector (`kdn.engines.vllm`).

Only vllm/ imports vLLM. torch at module level: transformers/, vllm/ and fingerprint.py (the
rest import it where they need it). KDN under other systems' caches (LMCache, SGLang) is
kdn.integrations.
"""
