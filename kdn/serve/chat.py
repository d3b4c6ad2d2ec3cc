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

Conversations (kdn.core.conversation, kdn.client.history): a request may name no KB (a plain
chat: the messages as the chat template renders them). Either way, after the KB's KV the
worker looks for the conversation's own KV (the earlier turns, which a worker computed and
kept), fetches it where that beats recomputing it, and computes only the rest; after the
answer, `keep()` stores the whole chunks it computed that the next turn's prompt will
reproduce (the answer put back through the chat template, compared token by token), and
the partial chunk after them (the tail), after the reply was sent: a next turn on another
replica computes only its new tokens. Only exact KV is kept: never over an emphasized or lossy cache.
"""
import collections
import time
from dataclasses import dataclass, field

from kdn.core.checks import check_int
from kdn.core.conversation import reproduced, whole_chunks
from kdn.core.emphasis import override_of
from kdn.core.errors import BadRequest, ModelError
from kdn.core.keys import CHUNK_TOKENS as CHUNK
from kdn.serve.api import check_messages
from kdn.serve.regions import tier_of

def messages_tokens(model, messages) -> list:
    """Token ids of the request's turns and the generation prompt, as they follow a system
    turn in the full rendered prompt (a KB's knowledge turn ends where these begin)."""
    return model.encode(model.turns_text(check_messages(messages)))


@dataclass
class Turn:
    """One request's prompt and engine cache, and what keep() needs after its answer."""
    prompt: list
    cache: object               # the engine cache (None: nothing cached and nothing to keep)
    cached: int                 # prompt tokens whose KV came from KDN (not computed here)
    messages: list
    kb_tokens: list = None      # the KB's token ids the prompt starts with (None: a plain chat)
    exact: bool = True          # False: emphasized, lossy or another model's KV; nothing of it is kept
    cross_model: dict = None    # another model's KV with a recompute plan: the plan's description
    salt: str = None
    retention: str = None       # prompt_cache_retention (kdn.core.conversation.retention_ttl)
    conversation: str = None    # the ingress's name for the conversation (kdn.serve.affinity)
    history: dict = field(default_factory=dict)   # where the conversation's KV came from

    @property
    def start_chunk(self) -> int:
        """The KB's whole chunks: conversation chunks are those after them."""
        return 0 if self.kb_tokens is None else whole_chunks(len(self.kb_tokens))


@dataclass
class Step:
    token: int            # the new token id (None on the last step when it stopped at EOS)
    text: str             # text this step adds (may be "" while a multi-byte character is incomplete)
    finish: str = None    # "stop" or "length" on the last step, else None


class Chat:
    """One replica's engine: a loaded model and its KDN client; answers one request at a time
    (the caller serialises: the model's arena lends one rebuild buffer per cache)."""

    def __init__(self, model, client, history: bool = True):
        if client.reader.fingerprint != model.fingerprint:
            raise ModelError(f"the client reads KV of model {client.reader.fingerprint!r}, "
                             f"not of {model.fingerprint!r}")
        self.model, self.client = model, client
        # requests, prompt_tokens, cached_tokens, completion_tokens, fetch_s, rebuild_s,
        # history_* (conversation KV found, fetched, kept), computed_tokens, compute_s
        self.counters = collections.Counter()
        self.engine_kv = None      # a replica's cache of its last rebuilt KBs (kdn.serve.router)
        # a replica's own engine caches of its last conversations (kdn.serve.router.EngineKV keyed
        # by the ingress's conversation name and salt; None: none kept): a next turn answered
        # here continues from the exact tokens the last one left, no fetch, no partial chunk
        self.conversation_kv = None
        self.history = None
        if history:
            from kdn.client.history import History
            self.history = History(client.view, client.tenant, model.fingerprint, token=client.token)

    def stats(self) -> dict:
        out = {"counters": dict(self.counters), "model": self.model.stats(), "client": self.client.stats()}
        if self.history is not None:
            out["history"] = dict(self.history.counters)
            out["history_links"] = self.history.links()     # region -> measured rtt_s, bytes_per_s
        return out

    def prepare(self, manifest, messages, max_tokens: int, fetch: bool = True, emphasis=None):
        """(prompt tokens, engine cache or None, cached tokens): begin() without its Turn."""
        t = self.begin(manifest, messages, max_tokens, fetch, emphasis)
        return t.prompt, t.cache, t.cached

    def begin(self, manifest, messages, max_tokens: int, fetch: bool = True, emphasis=None,
              salt: str = None, retention: str = None, hints=(), conversation: str = None) -> Turn:
        """The Turn for messages after the KB `manifest` (None: a plain chat).
        fetch=False: nothing is fetched, the whole prompt is computed (no KDN, for comparisons;
        a KB's emphasis override does not apply then, and nothing is kept). emphasis {document:
        int weight}: the KB's KV edited (kdn.engines.emphasis_variants); None: the KB's override, if
        an operator set one (kdn.core.emphasis.override_of); {}: the exact KV. An emphasized
        cache holds more entries than cached tokens (its `kdn_extra`), names its weights
        (`kdn_emphasis`), and is never exact. salt, retention: the conversation's narrower
        namespace and how long its KV is kept idle (kdn.core.conversation); hints: regions the conversation was
        answered in before (its KV is looked for there after this worker's own region);
        conversation: the ingress's name for it (kdn.serve.affinity), under which this replica
        keeps its engine cache after the answer (conversation_kv) and looks for it first."""
        if manifest is None:
            if emphasis:
                raise BadRequest("emphasis edits a KB's KV: name a knowledge base to use it")
            turn = Turn(self.model.chat_tokens(messages), None, 0, messages, salt=salt, retention=retention,
                        conversation=conversation)
            if fetch and self._local(turn, hints):
                return turn
            if fetch:
                turn = self._with_history(turn, [], hints)
            if not turn.cached:
                self._served_from("none")
            return self._keepable(turn) if fetch else turn
        ids = manifest.token_ids()
        if manifest.layout != "prefix":
            raise BadRequest(f"knowledge base {manifest.name!r} has layout {manifest.layout!r}; "
                             "the service answers over 'prefix' KBs only")
        if len(ids) == 0:
            raise BadRequest(f"knowledge base {manifest.name!r} version {manifest.version} was "
                             "published without its token ids; republish it to serve it")
        turn = Turn(ids.tolist() + messages_tokens(self.model, messages), None, 0, messages,
                    kb_tokens=ids.tolist(), salt=salt, retention=retention, conversation=conversation)
        if emphasis and not fetch:
            raise BadRequest("emphasis edits the KB's KV: it cannot be combined with kdn_fetch false")
        if not fetch:
            self._served_from("none")
            return turn
        if emphasis is None:
            emphasis = override_of(manifest)
            self.counters["emphasis_override"] += bool(emphasis)
        if emphasis and self._emphasized(turn, manifest, emphasis, max_tokens):
            return turn
        if not emphasis and self._local(turn, hints):
            return turn
        kb = f"{self.client.tenant}/{manifest.name}"
        kept = None if self.engine_kv is None else self.engine_kv.get(kb, manifest.version)
        if kept is not None:   # the engine's own cache of a KB it rebuilt (kdn.serve.router.EngineKV)
            cache, tokens = kept
            self.model.crop(cache, tokens)     # back to the KB's KV, bitwise as rebuilt
            self.counters["engine_hits"] += 1
            self._served_from("engine")
            turn.cache, turn.cached = cache, tokens
            return self._with_history(turn, None, hints, max_tokens)
        return self._fetched(turn, manifest, kb, hints, max_tokens)

    def _local(self, turn: Turn, hints) -> bool:
        """Give turn this replica's own engine cache of its conversation, cropped to the tokens
        the prompt repeats (compared token by token), when it covers more of the prompt than
        the KB alone, an edge still holds the conversation (so the tenant's idle TTL and an
        operator's drop govern this copy too) and none holds more of it (another replica may
        have answered the turns since); False otherwise (the cache is let go)."""
        if self.conversation_kv is None or turn.conversation is None or self.history is None:
            return False
        kept = self.conversation_kv.take(turn.conversation, turn.salt)
        if kept is None:
            return False
        cache, tokens = kept
        n = min(reproduced(tokens, turn.prompt), self.model.cache_tokens(cache), len(turn.prompt) - 1)
        if n <= turn.start_chunk * CHUNK:
            self.counters["conversation_engine_stale"] += 1
            return False
        found = self.history.find(turn.prompt, turn.start_chunk, turn.salt, hints)
        if found is None:               # expired, dropped or evicted at every edge: let it go too
            self.counters["conversation_engine_gone"] += 1
            return False
        if (turn.start_chunk + found.held) * CHUNK > n:
            self.counters["conversation_engine_behind"] += 1
            return False
        # whole chunks this region's home edge holds: a store after this turn sends the rest
        at_edge = turn.start_chunk + (found.held if found.region == self.client.view.region else 0)
        self.model.crop(cache, n)
        turn.cache, turn.cached = cache, n
        turn.history = {"region": self.client.view.region, "engine": True, "at_edge": at_edge}
        self.counters["conversation_engine_hits"] += 1
        self._served_from("engine")
        return True

    def _keep_local(self, turn: Turn, generated: list) -> None:
        """Keep turn's engine cache as its conversation's on this replica (conversation_kv):
        exact KV of the prompt and the tokens generated, as far as the cache holds them. Never
        a cache the KB's EngineKV holds too (another request would crop and overwrite it)."""
        if self.conversation_kv is None or turn.conversation is None or turn.cache is None \
                or not turn.exact or getattr(turn.cache, "kdn_shared", False):
            return
        have = self.model.cache_tokens(turn.cache)
        self.conversation_kv.put(turn.conversation, turn.salt, (turn.cache, (turn.prompt + list(generated))[:have]),
                                 self.model.cache_bytes(turn.cache), 0.0, "engine")

    def _emphasized(self, turn: Turn, manifest, emphasis: dict, max_tokens: int) -> bool:
        """Give turn the KB's KV edited by emphasis (kdn.engines.emphasis_variants); False when there
        is none to be had (the exact KV is read instead)."""
        from kdn.engines.emphasis_variants import emphasized_kv
        e = emphasized_kv(self.client, self.model, manifest, emphasis)
        if e is None:
            return False
        cache = self.model.cache_from_kv(e.parts, len(turn.prompt) - e.tokens + max_tokens)
        cache.kdn_extra, cache.kdn_emphasis = e.extra, e.weights
        self.counters["emphasized"] += 1
        self.counters[f"emphasized_{e.source}"] += 1
        turn.cache, turn.cached, turn.exact = cache, e.tokens, False
        return True

    def _fetched(self, turn: Turn, manifest, kb: str, hints, max_tokens: int) -> Turn:
        """turn with the KB's KV fetched from the nearest edge (and the conversation's after it,
        when an edge holds it), the whole KB's cache kept in the engine (EngineKV)."""
        prompt, n_kb = turn.prompt, len(turn.kb_tokens)
        t0 = time.perf_counter()
        f = self.client.fetch(prompt, kb=manifest.name, version=manifest.version)
        t1 = time.perf_counter()
        self.counters["fetch_s"] += t1 - t0
        turn.exact = f.exact
        parts = f.kv_parts()
        grown = self._with_history(turn, parts[:f.tokens // CHUNK], hints, max_tokens) \
            if f.tokens == n_kb and f.exact else turn
        if grown.cache is not None:
            return grown
        spare = len(prompt) - f.tokens + max_tokens
        cache = self.model.cache_from_kv(parts, spare) if f.tokens else None
        self.counters["rebuild_s"] += time.perf_counter() - t1
        tier = tier_of(f.source_counts()) if f.tokens else "none"
        self._served_from(tier)
        if self.engine_kv is not None and f.tokens == n_kb:   # the whole KB only
            cache.kdn_shared = True        # every request of the KB crops and grows it
            self.engine_kv.put(kb, manifest.version, (cache, f.tokens),
                               (f.tokens + spare) * self.model.kv_bytes_per_token, t1 - t0, tier)
        turn.cache, turn.cached = cache, f.tokens
        return self._keepable(turn)

    def _keepable(self, turn: Turn) -> Turn:
        """turn with an engine cache to compute into even when nothing was cached, so that
        what it computes can be kept (keep())."""
        if turn.cache is None and self.history is not None:
            turn.cache = self.model.new_cache()
        return turn

    def _with_history(self, turn: Turn, kb_parts, hints, max_tokens: int = None) -> Turn:
        """turn with the conversation's KV after the KB's whole chunks, when some edge holds
        it and fetching beats recomputing; turn unchanged otherwise. kb_parts: the KV of the
        KB's whole chunks ([] for a plain chat; None: take it from turn.cache, the engine's)."""
        if self.history is None:
            return turn
        start = turn.start_chunk
        found = self.history.find(turn.prompt, start, turn.salt, hints, tails=True)
        if found is None:
            self.counters["history_misses"] += 1
            return turn
        rate = self.counters["computed_tokens"] / self.counters["compute_s"] \
            if self.counters["compute_s"] else None
        if not self.history.worth_fetching(found, CHUNK * self.model.kv_bytes_per_token, rate):
            self.counters["history_recomputed"] += 1
            turn.history = {"region": found.region, "fetched": False}
            return turn
        t0 = time.perf_counter()
        chunks = self.history.fetch(found)
        if not chunks:
            return turn
        t1 = time.perf_counter()
        if kb_parts is None:                   # the KB's whole chunks, copied from the engine's cache
            kb_parts = [self.model.kv_from_cache(turn.cache, 0, start * CHUNK)] if start else []
        # whole chunks of the prompt, and its tail when fetched: never the whole prompt
        tail = chunks[-1].kv.shape[3] if found.tail and chunks[-1].key == found.tail[0] else 0
        tokens = start * CHUNK + sum(c.kv.shape[3] for c in chunks)
        turn.cache = self.model.cache_from_kv(kb_parts + [c.kv for c in chunks],
                                              len(turn.prompt) - tokens + (max_tokens or 0))
        turn.cached = tokens
        self.counters["fetch_s"] += t1 - t0
        self.counters["rebuild_s"] += time.perf_counter() - t1
        self.counters["history_hits"] += 1
        self.counters["history_tokens"] += tokens - start * CHUNK
        self.counters["history_tail_tokens"] += tail
        turn.history = {"region": found.region, "edge": found.edge, "fetched": True,
                        "chunks": len(chunks) - bool(tail), "tail": tail}
        self._served_from("history")
        return turn

    def to_keep(self, turn: Turn, generated: list, text: str) -> "dict | None":
        """What store() sends of this answer's conversation (None: nothing new to keep): the
        whole chunks it computed that the next turn's prompt reproduces, and the tail after
        them (kdn.core.conversation.tail_key). The answer's text put
        back through the chat template is compared token by token with the prompt and the
        tokens generated (whose KV the cache holds), and only their common prefix counts. In
        the model's thread, before the next request touches the cache (its KV is copied out)."""
        if self.history is None or turn.cache is None or not turn.exact:
            return None
        self._keep_local(turn, generated)
        history = list(turn.messages) + [{"role": "assistant", "content": text}]
        again = (self.model.chat_tokens(history, False) if turn.kb_tokens is None else
                 turn.kb_tokens + self.model.encode(self.model.turns_text(history, False)))
        have = self.model.cache_tokens(turn.cache) - getattr(turn.cache, "kdn_extra", 0)
        n = min(reproduced(turn.prompt + list(generated), again), have)
        first_new = turn.cached // CHUNK
        if turn.history.get("engine"):     # from this replica's own cache: send what no edge holds
            first_new = turn.history["at_edge"]
        if turn.history.get("fetched") and turn.history.get("region") != self.client.view.region:
            first_new = turn.start_chunk   # moved here: its history is kept at this region's home too
        end = whole_chunks(n) * CHUNK
        # new whole chunks, or a tail (the partial chunk after them) after one of this conversation's
        tail = end < n and turn.start_chunk * CHUNK < end and first_new * CHUNK <= end
        if end <= max(first_new, turn.start_chunk) * CHUNK and not tail:
            self.counters["history_nothing_new"] += 1
            return None
        n = n if tail else end
        return {"tokens": again[:n], "kv": self.model.kv_from_cache(turn.cache, first_new * CHUNK, n),
                "start_chunk": turn.start_chunk, "first_new_chunk": first_new, "salt": turn.salt,
                "retention": turn.retention, "tails": True}

    def store(self, kept: "dict | None") -> dict:
        """Send what to_keep() took to the conversation's home edge ({"chunks", "tokens", "edge"});
        any thread (the RPC waits on the edge, not on the model)."""
        if kept is None:
            return {"chunks": 0, "tokens": 0, "edge": None}
        got = self.history.store(**kept)
        self.counters["history_kept_chunks"] += got["chunks"]
        return got

    def keep(self, turn: Turn, generated: list, text: str) -> dict:
        """to_keep() then store(), in this thread."""
        return self.store(self.to_keep(turn, generated, text))

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
        t0, first = time.perf_counter(), True
        for step in stream(self.model, prompt, cache, cached_tokens, max_tokens, temperature, seed):
            if first:      # the prompt's uncached tokens took this long: the measured prefill rate
                self.counters["computed_tokens"] += len(prompt) - cached_tokens
                self.counters["compute_s"] += time.perf_counter() - t0
                first = False
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
