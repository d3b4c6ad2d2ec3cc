"""`kdn serve`: the OpenAI-compatible service, one Ray Serve deployment per region.

- api.py     the wire format: requests checked, responses and errors shaped (no Ray, no model);
- app.py     the application: the router, the transformers replica, start and stop;
- vllm.py    the vLLM replica (`--engine vllm`);
- chat.py    chat over a KB, token by token, for the transformers replica;
- proxy.py   what Serve's HTTP proxy lets through (bounded bodies);
- demo.py    the demo's last step: a KB answered through the service with the openai client.
"""
