"""Which region answered a conversation: the ingress's memory, so a next turn goes where its KV is.

A conversation's KV lives at its home edge in the region that computed it (kdn.client.history).
The ingress cannot compute chunk keys (it has no tokenizer and no CPU to spare), so it names
a conversation by what it sees: OpenAI's `prompt_cache_key` when the caller gives one, else
the digest of the conversation's opening (the tenant, the KB, and the messages up to and
including the first user message), which every later turn of it repeats — prefix affinity
at the grain of messages, as Ray's prefix-aware router does by characters. Two conversations
that open alike share an entry; that is harmless, since it only says where to look first.

`Affinity` remembers conversation -> region for the last MAX_CONVERSATIONS conversations
(least recently answered first out). Pure: no Ray, no model.
"""
import collections
import json

import xxhash

MAX_CONVERSATIONS = 100_000


def conversation_id(tenant: str, kb, messages, prompt_cache_key: str = None) -> str:
    """The ingress's name for a request's conversation (see the module)."""
    if prompt_cache_key is not None:
        return "key:" + xxhash.xxh3_64_hexdigest(f"{tenant}\0{prompt_cache_key}".encode())
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), len(messages) - 1)
    opening = json.dumps([tenant, kb, messages[:first_user + 1]], ensure_ascii=False, sort_keys=True)
    return "open:" + xxhash.xxh3_64_hexdigest(opening.encode())


class Affinity:
    """conversation -> the region that last answered it, bounded (see the module)."""

    def __init__(self, capacity: int = MAX_CONVERSATIONS):
        self.capacity = int(capacity)
        self._regions = collections.OrderedDict()
        self.counters = collections.Counter()

    def region_of(self, conversation: str):
        region = self._regions.get(conversation)
        self.counters["conversation_seen" if region else "conversation_new"] += 1
        return region

    def answered(self, conversation: str, region: str) -> None:
        self._regions.pop(conversation, None)
        self._regions[conversation] = region
        while len(self._regions) > self.capacity:
            self._regions.popitem(last=False)

    def __len__(self) -> int:
        return len(self._regions)
