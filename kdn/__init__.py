"""KDN: a knowledge-delivery network — a CDN for the KV cache of shared LLM knowledge."""
__version__ = "0.1.0"
