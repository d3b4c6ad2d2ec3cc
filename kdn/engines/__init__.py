"""Engines other than kdn.model's transformers one: where KDN meets an inference server.

vLLM reads and publishes knowledge KV through its v1 KV connector API, with no patch:
- vllm.py        KDNConnector, what vLLM loads (kv_connector_module_path="kdn.engines.vllm");
- vllm_plan.py   its scheduler side: how many prompt tokens the network holds, per request;
- vllm_load.py   its worker side: chunks into the paged cache layer by layer, KV out to publish;
- paged.py       the paged-cache block layout, measured, and the strided copies in and out;
- sources.py     how a connector reaches edges (Ray or HTTP), tenants by cache salt, deadlines;
- fingerprint.py which engine computed a cache, as part of the model's fingerprint;
- vllm_run.py    an engine wired to a network: publish_with_vllm, query_with_vllm, EngineWorker.

Only vllm*.py import vLLM; the rest is plain KDN and torch.
"""
