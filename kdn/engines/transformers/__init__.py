"""The HF transformers engine: SmolLM2 (or any Llama-shaped model) from a converted folder.

- model.py   loading (GGUF conversion once), fingerprint, prefill to KV, the cache adapter,
             prompts and generation;
- worker.py  an inference worker: the question computed over a KB's fetched KV;
- blend.py   blended reuse of per-document KV (segments) with a little recompute;
- arena.py   reusable memory for cache rebuilds.
"""
