"""kdn.engines.vllm.keep: a finished answer's new whole chunks are copied out of its blocks and
sent to the home edge after what it holds; the blocks are released whatever happens; a
reproduced limit cuts the keep. Fakes for the loader and the history: no vLLM, no network."""
import logging

import numpy as np

from kdn.core.errors import AccessDenied
from kdn.engines.vllm.keep import Keeper
from kdn.engines.vllm.plan import Keep


class Loader:
    refused = None

    def __init__(self, broken=False):
        self.copied, self.broken = [], broken

    def kv_range(self, block_ids, start, end):
        if self.broken:
            raise ValueError("a layout bug")
        self.copied.append((list(block_ids), start, end))
        return np.zeros((1, 2, 1, end - start, 1), np.float32)


class History:
    def __init__(self, held=0, error=None):
        self.held, self.error, self.stored = held, error, []

    def held_here(self, tokens, start_chunk, salt=None):
        return self.held

    def store(self, tokens, kv, start_chunk, first_new_chunk, salt=None, retention=None):
        if self.error:
            raise self.error
        self.stored.append((len(tokens), kv.shape[3], start_chunk, first_new_chunk, salt, retention))
        return {"edge": "us-east-0", "chunks": len(tokens) // 256 - first_new_chunk, "tokens": len(tokens)}


def keep(n=1100, start=0, req="r1"):
    return Keep(req, None, "alice", list(range(n)), list(range(9)), start, "24h")


def test_only_the_chunks_after_those_the_home_edge_holds_are_copied_and_sent():
    loader, hist = Loader(), History(held=1)
    k = Keeper(loader, lambda salt: hist)
    k.submit(keep())
    got = k.wait(5.0)["r1"]
    assert loader.copied == [(list(range(9)), 256, 1024)]
    assert hist.stored == [(1024, 768, 0, 1, "alice", "24h")]
    assert got["chunks"] == 3 and got["held"] == 1 and k.take_copied() == {"r1"}


def test_a_reproduced_limit_cuts_the_keep_and_nothing_new_sends_nothing():
    loader, hist = Loader(), History()
    k = Keeper(loader, lambda salt: hist)
    k.limit({"r1": 600, "r2": 300})
    k.submit(keep(req="r1"))
    k.submit(keep(n=700, start=2, req="r2"))           # 2 whole chunks, both the KB's
    k.wait(5.0)
    assert loader.copied == [(list(range(9)), 0, 512)] and hist.stored[0][0] == 512
    assert k.take_copied() == {"r1", "r2"}
    hist.held = 4
    k.submit(keep(req="r3"))
    assert k.wait(5.0)["r3"]["chunks"] == 0 and len(loader.copied) == 1 and k.counters["nothing_new"] == 1


def test_a_refused_store_is_counted_and_the_blocks_are_released():
    k = Keeper(Loader(), lambda salt: History(error=AccessDenied("no read token for tenant 'acme'")))
    k.submit(keep())
    got = k.wait(5.0)["r1"]
    assert got["chunks"] == 0 and "AccessDenied" in got["error"] and k.counters["keep_errors"] == 1
    assert k.take_copied() == {"r1"}


def test_a_keep_that_fails_on_a_bug_is_logged_and_the_blocks_are_still_released(caplog):
    k = Keeper(Loader(broken=True), lambda salt: History())
    with caplog.at_level(logging.ERROR, "kdn.engines.vllm"):
        k.submit(keep())
        got = k.wait(5.0)["r1"]
    assert "ValueError: a layout bug" == got["error"] and k.counters["keep_failures"] == 1
    assert k.take_copied() == {"r1"} and "keeping the conversation" in caplog.text


def test_a_slow_home_edge_never_holds_the_next_answers_blocks_and_a_backlog_is_dropped():
    import threading
    gate = threading.Event()

    class Slow(History):
        def store(self, *a, **kw):
            gate.wait(10)
            return super().store(*a, **kw)
    loader = Loader()
    k = Keeper(loader, lambda salt: Slow())
    for i in range(6):
        k.submit(keep(req=f"r{i}"))
    k.wait(0.5)                                          # the stores wait; the copies do not
    assert k.take_copied() == {f"r{i}" for i in range(6)}
    assert len(loader.copied) == 4 and k.counters["store_backlog"] == 2   # r4, r5: not kept
    gate.set()
    got = k.wait(5.0)
    assert [got[f"r{i}"]["chunks"] for i in range(6)] == [4, 4, 4, 4, 0, 0]
    assert "stores already wait" in got["r5"]["error"]
