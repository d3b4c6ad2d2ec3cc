"""The one engine interface: what the CLI, the demo and the service ask of an inference engine.

An engine publishes documents as a KB (it computes their KV, and KDN stores it) and answers a
question over a KB (KV in from the nearest edge, tokens out). The transformers engine
(kdn.engines.transformers.engine) computes KV itself and rebuilds a cache from fetched chunks;
vLLM (kdn.engines.vllm.run) does both inside the engine, through KDN's KV connector. Callers
name an engine (ENGINES), check the name once (`check_engine`), and from then on see only:

- `name`, `fingerprint`: which engine computed a cache is part of the model's name
  (kdn.engines.fingerprint): KV is never read across engines by accident;
- `publish(client, kb, documents, meta=None, progress=None)` -> the origin's receipt;
- `answer(client, kb, question, max_new_tokens=48, check=False)` -> `Answer`, with `check`
  also the engine's own full prefill and whether the greedy tokens are identical;
`load_engine(name, model, role, **settings)` makes one; `context_of(name, model)` is the
longest prompt it takes, known before a slow engine starts.

This module knows its implementations by module path only (IMPLEMENTATIONS, imported when
one is asked for, as vLLM finds KDN's connector by path): each engine class answers
`load(model, role, **settings)` and `context(model)` itself, and imports `Answer` from here
with no import circle.
"""
import importlib
from dataclasses import dataclass, field
from typing import Protocol

from kdn.core.errors import BadRequest

IMPLEMENTATIONS = {"transformers": "kdn.engines.transformers.engine:TransformersEngine",
                   "vllm": "kdn.engines.vllm.run:VllmEngine"}
ENGINES = tuple(IMPLEMENTATIONS)


def check_engine(name: str) -> str:
    """name, or BadRequest naming the engines there are."""
    if name not in ENGINES:
        raise BadRequest(f"engine must be one of {', '.join(ENGINES)}, got {name!r:.40}")
    return name


@dataclass
class Answer:
    """One answer over a KB, by either engine (fields an engine does not measure stay empty)."""
    question: str
    text: str
    tokens: list
    prompt_tokens: int
    ttft_s: float                    # with KDN: fetch + cache rebuild + prefill of the rest
    cached_tokens: int = 0           # prompt tokens whose KV came from KDN
    engine: str = "transformers"
    fetch_s: float = 0.0
    sources: dict = field(default_factory=dict)   # local / peer / origin -> chunk count
    edge: str = None
    bytes_moved: int = 0
    exact: bool = True               # False when the KV came through a lossy codec the client accepted
    wire_bytes: int = 0              # bytes of KV that crossed the link (compressed where a codec was used)
    baseline_ttft_s: float = None    # the engine's own full prefill, no KDN (check=True)
    baseline_tokens: list = None
    identical: bool = None
    max_logit_diff: float = None
    kdn: dict = field(default_factory=dict)       # vLLM: the connector's report (held, loaded, ...)
    cross_model: dict = None         # KV of another model of the family, read with a recompute plan
                                     # (kdn.engines.family): sender, plan, recompute; never exact
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self):
        return None if not self.baseline_ttft_s else self.baseline_ttft_s / self.ttft_s


class Engine(Protocol):
    name: str
    fingerprint: str

    @classmethod
    def load(cls, model, role: str = "kv_consumer", **settings) -> "Engine": ...

    @staticmethod
    def context(model) -> tuple: ...

    def publish(self, client, kb: str, documents, meta: dict = None, progress=None) -> dict: ...

    def answer(self, client, kb: str, question: str, max_new_tokens: int = 48,
               check: bool = False) -> Answer: ...


def engine_class(name: str):
    """The class of engine `name`, imported from its module path (IMPLEMENTATIONS)."""
    module, _, cls = IMPLEMENTATIONS[check_engine(name)].partition(":")
    return getattr(importlib.import_module(module), cls)


def context_of(name: str, model) -> tuple:
    """(tokens, what names that limit): the longest prompt engine `name` takes over `model`."""
    return engine_class(name).context(model)


def load_engine(name: str, model, role: str = "kv_consumer", **settings) -> Engine:
    """Engine `name` over `model` (the transformers Model of the converted folder: vLLM takes
    its weights, tokenizer and chat template). vLLM starts in this process with KDN's
    connector as `role`; settings are the connector's (network, region, tenant, token,
    admin_token; kdn.engines.vllm.connector.Settings)."""
    return engine_class(name).load(model, role, **settings)
