"""KDN: a knowledge-delivery network — a CDN for the KV cache of shared LLM knowledge."""
__version__ = "0.1.0"

# Ray reads its environment when it is imported: set KDN's (loopback only, no usage stats,
# token auth) before any kdn module can import ray.
from kdn.core.env import prepare_ray_env as _prepare_ray_env

_prepare_ray_env()
