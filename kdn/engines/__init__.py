"""Engines: where KDN meets inference, tokens in and KV out, KV in and tokens out.

- base.py          the one engine interface (prefill to KV, answer over fetched KV, fingerprint),
                   and publish / answer written once over it;
- fingerprint.py   which engine computed a cache, as part of the model's fingerprint;
- sources.py       how a connector inside an engine reaches edges (Ray or HTTP), tenants by
                   cache salt, deadlines;
- objects.py       another cache layer's opaque objects in KDN (LMCache's and SGLang's);
- lmcache.py       KDN as LMCache's L2 adapter (its multiprocess server), over objects.py;
- sglang.py        KDN as SGLang's HiCache storage backend, over objects.py;
- prefault.py      page tables over Ray's object store kept filled, off the load path;
- emphasis.py      KV edited so the model attends more to trusted documents;
- emphasized.py    emphasized KV in the network: apart from exact KV, served only on request;
- transformers/    the HF transformers engine: the model, its cache adapter, blended reuse;
- vllm/            vLLM through its v1 KV connector (`kdn.engines.vllm`).

Only vllm/ imports vLLM. torch at module level: transformers/, vllm/, fingerprint.py and
sglang.py (the rest import it where they need it).
"""
