"""KDN inside vLLM, through its v1 KV connector API, with no patch to vLLM.

- connector.py  KDNConnector, what vLLM loads: `kv_connector_module_path="kdn.engines.vllm"`
                (users write this path in their configs: it stays this package);
- plan.py       its scheduler side: how many prompt tokens the network holds, per request;
- load.py       its worker side: chunks into the paged cache layer by layer, KV out to publish;
- paged.py      the paged-cache block layout, measured, and the strided copies in and out;
- run.py        an engine wired to a network: publish, answer, the region worker's engine.

vLLM imports `KDNConnector` from this package by name; it is loaded on first use, so the
planner, the loader and the paged copies import without vLLM's connector base.
"""


def __getattr__(name):
    if name in ("KDNConnector", "Settings"):
        from kdn.engines.vllm import connector
        return getattr(connector, name)
    raise AttributeError(f"module 'kdn.engines.vllm' has no attribute {name!r}")
