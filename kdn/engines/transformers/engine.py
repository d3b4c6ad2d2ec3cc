"""The transformers engine behind the engine interface (kdn.engines.base.Engine).

KDN's own engine: the model prefills what the network lacks and KDN publishes the KV
(kdn.client.publish.publish_documents); an answer rebuilds the model's cache from the
fetched chunks and computes only the question (kdn.engines.transformers.worker.answer).
"""
from kdn.client.documents import model_context
from kdn.client.publish import publish_documents
from kdn.engines.transformers.worker import answer


class TransformersEngine:
    name = "transformers"

    def __init__(self, model):
        self.model = model
        self.fingerprint = model.fingerprint

    @classmethod
    def load(cls, model, role: str = "kv_consumer", **settings) -> "TransformersEngine":
        """The engine over model (role and settings are vLLM's connector's: this engine
        computes, publishes and fetches through the client it is handed)."""
        return cls(model)

    @staticmethod
    def context(model) -> tuple:
        """(the longest prompt, what names that limit): the model's own context."""
        return model_context(model), "max_position_embeddings"

    def publish(self, client, kb: str, documents, meta: dict = None, progress=None) -> dict:
        return publish_documents(client, self.model, kb, documents, progress=progress, meta=meta)

    def answer(self, client, kb: str, question: str, max_new_tokens: int = 48, check: bool = False):
        return answer(client, self.model, kb, question, max_new_tokens=max_new_tokens, check=check)
