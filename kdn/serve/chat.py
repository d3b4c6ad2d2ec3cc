"""Chat over a knowledge base, token by token: the engine side of `kdn serve`.

A chat request's prompt is the KB's knowledge tokens (its manifest's token ids: the system
turn it was published in) followed by the request's messages rendered with the model's chat
template and the assistant's generation prompt (Model.turns_text, which Model.question_text
uses for one question), so the KB's tokens are an exact prefix of the full prompt and every one of them
can come from KDN; a single user message renders exactly as `kdn query` renders its question.

`stream()` runs Model.steps, the decoding loop Model.generate runs (the KV fetched from the
nearest edge rebuilt into a cache with room for the rest, the rest of the prompt in one
forward pass, then one token per step), so greedy tokens are identical to `kdn query
--check`; each token is yielded as soon as its logits are known. temperature > 0 samples
from softmax(logits / temperature) instead (seeded when the request gives a seed).
"""
import collections
import time
from dataclasses import dataclass

from kdn.core.checks import check_int
from kdn.core.emphasis import override_of
from kdn.core.errors import BadRequest, ModelError
from kdn.serve.api import check_messages
from kdn.serve.regions import tier_of

def messages_tokens(model, messages) -> list:
    """Token ids of the request's turns and the generation prompt, as they follow a system
    turn in the full rendered prompt (a KB's knowledge turn ends where these begin)."""
    return model.encode(model.turns_text(check_messages(messages)))


@dataclass
class Step:
    token: int            # the new token id (None on the last step when it stopped at EOS)
    text: str             # text this step adds (may be "" while a multi-byte character is incomplete)
    finish: str = None    # "stop" or "length" on the last step, else None


class Chat:
    """One replica's engine: a loaded model and its KDN client; answers one request at a time
    (the caller serialises: the model's arena lends one rebuild buffer per cache)."""

    def __init__(self, model, client):
        if client.reader.fingerprint != model.fingerprint:
            raise ModelError(f"the client reads KV of model {client.reader.fingerprint!r}, "
                             f"not of {model.fingerprint!r}")
        self.model, self.client = model, client
        # requests, prompt_tokens, cached_tokens, completion_tokens, fetch_s, rebuild_s
        self.counters = collections.Counter()
        self.engine_kv = None      # a replica's cache of its last rebuilt KBs (kdn.serve.router)

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "model": self.model.stats(), "client": self.client.stats()}

    def prepare(self, manifest, messages, max_tokens: int, fetch: bool = True, emphasis=None):
        """(prompt tokens, engine cache or None, cached tokens) for messages after the KB.
        fetch=False: nothing is fetched, the whole prompt is computed (no KDN, for comparisons;
        a KB's emphasis override does not apply then). emphasis {document: int weight}: the KB's
        KV edited (kdn.engines.emphasized); None: the KB's override, if an operator set one
        (kdn.core.emphasis.override_of); {}: the exact KV. An emphasized cache holds more entries
        than cached tokens (its `kdn_extra`), names its weights (`kdn_emphasis`), and is never
        exact."""
        ids = manifest.token_ids()
        if manifest.layout != "prefix":
            raise BadRequest(f"knowledge base {manifest.name!r} has layout {manifest.layout!r}; "
                             "the service answers over 'prefix' KBs only")
        if len(ids) == 0:
            raise BadRequest(f"knowledge base {manifest.name!r} version {manifest.version} was "
                             "published without its token ids; republish it to serve it")
        prompt = ids.tolist() + messages_tokens(self.model, messages)
        if emphasis and not fetch:
            raise BadRequest("emphasis edits the KB's KV: it cannot be combined with kdn_fetch false")
        if not fetch:
            self._served_from("none")
            return prompt, None, 0
        if emphasis is None:
            emphasis = override_of(manifest)
            self.counters["emphasis_override"] += bool(emphasis)
        if emphasis:
            from kdn.engines.emphasized import emphasized_kv
            e = emphasized_kv(self.client, self.model, manifest, emphasis)
            if e is not None:
                cache = self.model.cache_from_kv(e.parts, len(prompt) - e.tokens + max_tokens)
                cache.kdn_extra, cache.kdn_emphasis = e.extra, e.weights
                self.counters["emphasized"] += 1
                self.counters[f"emphasized_{e.source}"] += 1
                return prompt, cache, e.tokens
        kb = f"{self.client.tenant}/{manifest.name}"
        kept = None if self.engine_kv is None else self.engine_kv.get(kb, manifest.version)
        if kept is not None:   # the engine's own cache of a KB it rebuilt (kdn.serve.router.EngineKV)
            cache, tokens = kept
            self.model.crop(cache, tokens)     # back to the KB's KV, bitwise as rebuilt
            self.counters["engine_hits"] += 1
            self._served_from("engine")
            return prompt, cache, tokens
        t0 = time.perf_counter()
        f = self.client.fetch(prompt, kb=manifest.name, version=manifest.version)
        t1 = time.perf_counter()
        spare = len(prompt) - f.tokens + max_tokens
        cache = self.model.cache_from_kv(f.kv_parts(), spare) if f.tokens else None
        self.counters["fetch_s"] += t1 - t0
        self.counters["rebuild_s"] += time.perf_counter() - t1
        tier = tier_of(f.source_counts()) if f.tokens else "none"
        self._served_from(tier)
        if self.engine_kv is not None and f.tokens == len(ids):   # the whole KB only
            self.engine_kv.put(kb, manifest.version, (cache, f.tokens),
                               (f.tokens + spare) * self.model.kv_bytes_per_token, t1 - t0, tier)
        return prompt, cache, f.tokens

    def _served_from(self, source: str) -> None:
        """Count where this answer's exact knowledge KV came from, for the router's report
        (an emphasized answer is counted under emphasized_*, not here)."""
        if self.engine_kv is not None:
            self.engine_kv.served_from(source)

    def stream(self, prompt, cache, cached_tokens: int, max_tokens: int, temperature: float = 0.0,
               seed: int = None):
        """Yield a Step per generated token, the first as soon as its logits are known (stream())."""
        self.counters["requests"] += 1
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["cached_tokens"] += cached_tokens
        for step in stream(self.model, prompt, cache, cached_tokens, max_tokens, temperature, seed):
            self.counters["completion_tokens"] += step.token is not None
            yield step



def stream(model, prompt, cache, cached_tokens: int, max_tokens: int, temperature: float = 0.0,
           seed: int = None):
    """Yield a Step per token generated after `prompt`, whose first cached_tokens have their
    KV in `cache` (None: nothing cached), the first as soon as its logits are known: the
    decoding loop of Model.generate (Model.steps), with each token's text as it is known."""
    check_int(max_tokens, "max_tokens", 1)
    out, said = [], ""
    for token, _, finish in model.steps(prompt, cache, cached_tokens, max_tokens, temperature, seed):
        if token is None:
            yield Step(None, _tail(model, out, said), finish)
            return
        out.append(token)
        text = model.tokenizer.decode(out, skip_special_tokens=True)
        # hold back an incomplete multi-byte character until its last token arrives
        new = text[len(said):] if not text.endswith("\ufffd") else ""
        said += new
        yield Step(token, new + (_tail(model, out, said) if finish else ""), finish)


def _tail(model, out, said: str) -> str:
    """Text not yet said when generation ends (a character held back, if any)."""
    text = model.tokenizer.decode(out, skip_special_tokens=True)
    return text[len(said):] if text.startswith(said) else ""
