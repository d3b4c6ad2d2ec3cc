"""kdn.engines.vllm.load: chunks land where vLLM's writer would put them, layer by layer; what
did not arrive is reported as failed blocks, within the deadline; captures read back exactly.
A fake cache writer (vLLM's CPU layout) and fake sources: no vLLM, no network."""
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kdn.core.chunk import Chunk
from kdn.engines.sources import Deadline
from kdn.engines.vllm.load import Loader
from kdn.core.errors import NoLiveEdge

L, H, D, N = 3, 2, 4, 8          # layers, KV heads, head dim, tokens per block
NS = b"n" * 16


def cpu_writer(key, value, cache, slots):
    """vLLM's CPU kernel layout: per block and head, keys transposed [D, N], then values [N, D]."""
    b, h, n, c = cache.shape
    area = cache.view(b, h, 2 * n, c // 2)
    for i, s in enumerate(slots.tolist()):
        blk, off = divmod(s, n)
        area[blk, :, :n].reshape(h, -1)[:, off::n] = key[i]     # element (off, d) at d*n + off
        area[blk, :, n + off] = value[i]


def names():
    return [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def make_loader(source, publisher=None, deadline_s=5.0, layerwise=True, blocks=16, dtype=torch.float32):
    caches = {n: torch.zeros(blocks, H, N, 2 * D, dtype=dtype) for n in names()}
    loader = Loader(lambda salt: source, publisher, Deadline(), deadline_s, layerwise)
    loader.register(caches, lambda n: int(n.split(".")[2]), lambda n: cpu_writer, N, H, D)
    return loader, caches


def kv(tokens, seed=0):
    return np.random.default_rng(seed).standard_normal((L, 2, H, tokens, D)).astype(np.float32)


class Source:
    def __init__(self, chunks=(), delay=0.0, error=None):
        self.chunks, self.delay, self.error = list(chunks), delay, error

    def fetch(self, kb, version, keys, timeout_s):
        time.sleep(self.delay)
        if self.error:
            raise self.error
        return [c for c in self.chunks if c.key in keys], {"edge": "e-0", "failovers": []}


def chunks_of(full, size=16):
    return [Chunk(bytes([i + 1]) * 16, NS, np.ascontiguousarray(full[:, :, :, a:a + size]), "float32")
            for i, a in enumerate(range(0, full.shape[3], size))]


def load(chunks, start, end, block_ids, first=0, unzeroed=()):
    return SimpleNamespace(req="r", salt=None, kb="kb", version=1, keys=[c.key for c in chunks],
                           first=first, start=start, end=end, block_ids=block_ids,
                           unzeroed=list(unzeroed))


def expected(full, start, end, block_ids):
    caches = {n: torch.zeros(16, H, N, 2 * D) for n in names()}
    slots = torch.tensor([block_ids[t // N] * N + t % N for t in range(start, end)])
    for i, n in enumerate(names()):
        t = torch.from_numpy(full[i, :, :, start:end])
        cpu_writer(t[0].transpose(0, 1).contiguous(), t[1].transpose(0, 1).contiguous(), caches[n], slots)
    return caches


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_load_writes_each_layer_as_vllm_would_and_fails_nothing(layerwise):
    full = kv(40)                                  # chunks of 16, 16, 8 tokens
    cs = chunks_of(full)
    loader, caches = make_loader(Source(cs), layerwise=layerwise)
    blocks = [9, 2, 3, 11, 4]
    loader.start([load(cs, 8, 40, blocks)])        # vLLM's own hit covered block 0
    for n in names():
        loader.wait_layer(n)
    loader.finish()
    want = expected(full, 8, 40, blocks)
    assert all(torch.equal(caches[n], want[n]) for n in names())
    assert loader.take_failed() == set()
    assert loader.take_reports()["r"]["loaded"] == 32


def test_a_short_prefix_fails_the_blocks_from_the_first_missing_token():
    full = kv(40)
    cs = chunks_of(full)
    loader, caches = make_loader(Source(cs[:1]))   # only tokens 0..16 arrive
    loader.start([load(cs, 0, 40, [1, 2, 3, 4, 5])])
    loader.finish()
    assert loader.take_failed() == {3, 4, 5}       # token 16 is in block index 2 (id 3)
    report = loader.take_reports()["r"]
    assert report["loaded"] == 16 and report["failed_from"] == 16
    want = expected(full, 0, 16, [1, 2, 3, 4, 5])
    assert all(torch.equal(caches[n], want[n]) for n in names())


def test_failed_blocks_vllm_did_not_zero_are_zeroed_not_left_stale():
    full = kv(40)
    cs = chunks_of(full)
    loader, caches = make_loader(Source(cs[:1]))   # tokens 16.. never arrive
    for n in names():
        caches[n][3:6] = 7.0                       # what another request left there
    loader.start([load(cs, 0, 40, [1, 2, 3, 4, 5], unzeroed=[1, 2, 3, 4])])
    loader.finish()
    assert loader.take_failed() == {3, 4, 5}
    for n in names():
        assert not caches[n][3:5].any(), "unzeroed failed blocks are zeroed"
        assert (caches[n][5] == 7.0).all(), "vLLM zeroed block 5 itself (not ours to touch)"


def test_a_hung_edge_costs_at_most_the_deadline_and_fails_every_block():
    loader, _ = make_loader(Source(chunks_of(kv(16)), delay=5.0), deadline_s=0.3)
    t0 = time.monotonic()
    loader.start([load(chunks_of(kv(16)), 0, 16, [6, 7])])
    loader.finish()
    assert time.monotonic() - t0 < 1.5
    assert loader.take_failed() == {6, 7}
    assert "deadline" in loader.take_reports()["r"]["error"]


def test_no_live_edge_fails_the_blocks_and_says_why():
    loader, _ = make_loader(Source(error=NoLiveEdge("no edge of network 'n' answered fetch")))
    loader.start([load(chunks_of(kv(16)), 0, 16, [6, 7])])
    assert loader.take_failed() == {6, 7}
    assert "NoLiveEdge" in loader.take_reports()["r"]["error"]


def test_a_chunk_of_another_model_shape_is_never_copied():
    other = np.zeros((L, 2, H + 1, 16, D), np.float32)
    bad = Chunk(b"\1" * 16, NS, other, "float32")
    loader, caches = make_loader(Source([bad]))
    loader.start([load([bad], 0, 16, [0, 1])])
    loader.finish()
    assert loader.take_failed() == {0, 1} and loader.counters["shape_mismatch"] == 1
    assert all(not caches[n].any() for n in names())


def test_a_capture_reads_the_prompt_kv_back_and_publishes_it_by_document():
    full = kv(20, seed=3)
    got = {}

    class Publisher:
        def publish(self, kb, documents, kv, meta=None):
            got.update(kb=kb, documents=documents, kv=kv)
            return {"version": 1}
    loader, caches = make_loader(Source(), publisher=lambda salt: Publisher())
    blocks = [4, 2, 8]
    src = expected(full, 0, 20, blocks)
    for n in names():
        caches[n].copy_(src[n])
    cap = SimpleNamespace(req="p", salt=None, kb="kb", documents=[("a", 12), ("b", 8)],
                          tokens=list(range(20)), block_ids=blocks, meta={})
    assert loader.capture(cap) == {"version": 1}
    assert np.array_equal(got["kv"], full)
    assert got["documents"] == [("a", list(range(12))), ("b", list(range(12, 20)))]


def test_a_cache_kdn_cannot_copy_into_loads_nothing_and_says_why():
    def scrambling(key, value, cache, slots):
        cache.view(-1)[: key.numel()] = key.reshape(-1)     # not a strided layout
    caches = {n: torch.zeros(4, H, N, 2 * D) for n in names()}
    loader = Loader(lambda salt: Source(), None, Deadline(), 1.0)
    loader.register(caches, lambda n: int(n.split(".")[2]), lambda n: scrambling, N, H, D)
    assert loader.refused
    loader.start([load(chunks_of(kv(16)), 0, 16, [0, 1])])
    assert loader.take_failed() == {0, 1}
    assert loader.take_reports()["r"]["error"] == loader.refused


def test_bf16_chunks_load_bit_for_bit_into_a_bf16_cache():
    full = torch.from_numpy(kv(16)).to(torch.bfloat16)
    bits = full.view(torch.int16).numpy().view(np.uint16)          # KDN keeps bf16 as uint16
    c = Chunk(b"\1" * 16, NS, np.ascontiguousarray(bits), "bfloat16")
    loader, caches = make_loader(Source([c]), dtype=torch.bfloat16)
    loader.start([load([c], 0, 16, [3, 4])])
    loader.finish()
    assert loader.take_failed() == set()
    slots = torch.tensor([3 * N + t % N if t < N else 4 * N + t % N for t in range(16)])
    for i, n in enumerate(names()):
        want = torch.zeros_like(caches[n])
        cpu_writer(full[i, 0].transpose(0, 1).contiguous(), full[i, 1].transpose(0, 1).contiguous(),
                   want, slots)
        assert torch.equal(caches[n].view(torch.int16), want.view(torch.int16))


def test_a_copy_that_fails_fails_every_block_of_the_step_and_the_error_surfaces(monkeypatch):
    import threading
    from kdn.engines.vllm import load as vllm_load
    full = kv(40)
    cs = chunks_of(full)
    loader, caches = make_loader(Source(cs), layerwise=False)
    seen = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_type))

    def broken(*a, **kw):
        raise ValueError("a layout bug")
    monkeypatch.setattr(vllm_load, "copy_in", broken)
    loader.start([load(cs, 0, 40, [1, 2, 3, 4, 5])])
    loader.finish()
    assert loader.take_failed() == {1, 2, 3, 4, 5}             # vLLM recomputes them all
    assert loader.take_reports()["r"]["error"] == "copy failed: ValueError: a layout bug"
    assert ValueError in seen                                   # the bug is not swallowed


class History:
    def __init__(self, chunks=()):
        self.chunks, self.asked = list(chunks), []

    def fetch(self, found):
        self.asked.append(list(found.keys))
        return [c for c in self.chunks if c.key in found.keys]


def test_a_conversation_after_the_kbs_chunks_loads_as_one_range():
    full = kv(48)                                  # KB chunks 0..16, conversation 16..48
    cs = chunks_of(full)
    hist = History(cs[1:])
    caches = {n: torch.zeros(16, H, N, 2 * D) for n in names()}
    loader = Loader(lambda salt: Source(cs[:1]), None, Deadline(), 5.0, histories=lambda salt: hist)
    loader.register(caches, lambda n: int(n.split(".")[2]), lambda n: cpu_writer, N, H, D)
    blocks = [3, 9, 4, 5, 6, 7]
    ld = load(cs[:1], 8, 48, blocks)
    ld.conv = SimpleNamespace(keys=[c.key for c in cs[1:]], edge="eu-west-0")
    loader.start([ld])
    loader.finish()
    assert hist.asked == [[c.key for c in cs[1:]]]
    want = expected(full, 8, 48, blocks)
    assert all(torch.equal(caches[n], want[n]) for n in names())
    report = loader.take_reports()["r"]
    assert loader.take_failed() == set() and report["loaded"] == 40 and report["history_from"] == "eu-west-0"


def test_a_conversation_only_load_and_a_missing_chunk_fails_from_there():
    full = kv(48)
    cs = chunks_of(full)
    hist = History(cs[:2])                         # the edge lost the third chunk
    caches = {n: torch.zeros(16, H, N, 2 * D) for n in names()}
    loader = Loader(lambda salt: Source(), None, Deadline(), 5.0, histories=lambda salt: hist)
    loader.register(caches, lambda n: int(n.split(".")[2]), lambda n: cpu_writer, N, H, D)
    ld = SimpleNamespace(req="r", salt=None, kb=None, version=None, keys=[], first=0, start=0, end=48,
                         block_ids=[1, 2, 3, 4, 5, 6], unzeroed=[],
                         conv=SimpleNamespace(keys=[c.key for c in cs], edge="us-east-0"))
    loader.start([ld])
    loader.finish()
    assert loader.take_failed() == {5, 6} and loader.take_reports()["r"]["loaded"] == 32


def test_kv_range_reads_a_token_range_back_from_the_blocks():
    full = kv(40, seed=5)
    loader, caches = make_loader(Source())
    blocks = [7, 2, 3, 11, 4]
    src = expected(full, 0, 40, blocks)
    for n in names():
        caches[n].copy_(src[n])
    assert np.array_equal(loader.kv_range(blocks, 12, 37), full[:, :, :, 12:37])
    assert np.array_equal(loader.kv_of(blocks, 40), full)
