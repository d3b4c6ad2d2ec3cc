"""`kdn serve`: the OpenAI-compatible service, one Ray Serve deployment per region.

- api.py       the wire format: requests checked, responses and errors shaped (no Ray, no model);
- app.py       the application: the ingress (class `Ingress`, deployment `router`), the transformers replica,
               start and stop;
- regions.py   which region answers a request (expected time to first token per region);
- router.py    which replica of a region answers (Serve's request router, KV-aware);
- affinity.py  which region answered a conversation, so its next turn goes there;
- vllm.py      the vLLM replica (`--engine vllm`);
- chat.py      chat over a KB and a conversation's history, token by token, for the
               transformers replica;
- metrics.py   the service's counters, summed over ingress replicas, for /metrics and status;
- proxy.py     what Serve's HTTP proxy lets through (bounded bodies);
- demo.py      the demo's last step: a KB answered through the service with the openai client.
"""
