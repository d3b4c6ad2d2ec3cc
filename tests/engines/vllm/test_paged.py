"""kdn.engines.vllm.paged: the block layout is measured with the engine's writer, and a chunk's KV
lands exactly where that writer would have put it (fake writers of two layouts, no vLLM)."""
import numpy as np
import pytest
import torch

from kdn.engines.vllm.paged import BlockLayout, LayoutError, Piece, copy_in, copy_out, pieces

N, H, D = 8, 3, 4        # tokens per block, KV heads, head dim


def cpu_writer(key, value, cache, slots):
    """vLLM's CPU kernel: per block and head, keys transposed [D, N], then values [N, D]."""
    b, h, n, c = cache.shape
    k_area = cache.view(b, h, 2 * n, c // 2)[:, :, :n].reshape(b, h, -1)   # [b, h, N*D] as [D, N]
    v_area = cache.view(b, h, 2 * n, c // 2)[:, :, n:]
    for i, s in enumerate(slots.tolist()):
        blk, off = divmod(s, n)
        for d in range(c // 2):
            k_area[blk, :, d * n + off] = key[i, :, d]
        v_area[blk, :, off] = value[i]


def nhd_writer(key, value, cache, slots):
    """Token-major blocks [N, H, 2D]: keys then values of each head side by side."""
    b, n = cache.shape[:2]
    flat = cache.view(b * n, cache.shape[2], cache.shape[3])
    flat[slots, :, :key.shape[2]] = key
    flat[slots, :, key.shape[2]:] = value


def cpu_cache(blocks):
    return torch.zeros(blocks, H, N, 2 * D)


def nhd_cache(blocks):
    return torch.zeros(blocks, N, H, 2 * D)


LAYOUTS = [(cpu_writer, cpu_cache), (nhd_writer, nhd_cache)]


def test_the_cpu_layout_is_measured_as_transposed_keys_then_values():
    lay = BlockLayout.probe(cpu_cache(1), cpu_writer, N, H, D)
    # keys: token stride 1, dim stride N (transposed); values: row-major after N*D keys
    assert (lay.k.head, lay.k.token, lay.k.dim, lay.k.offset) == (2 * N * D, 1, N, 0)
    assert (lay.v.head, lay.v.token, lay.v.dim, lay.v.offset) == (2 * N * D, D, 1, N * D)
    assert lay.block_elems == H * N * 2 * D


@pytest.mark.parametrize("writer,make", LAYOUTS)
def test_copy_in_puts_every_value_where_the_engine_writer_would(writer, make):
    lay = BlockLayout.probe(make(1), writer, N, H, D)
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, H, 29, D)).astype(np.float32)    # one layer, 29 tokens
    block_ids = [5, 6, 2, 9]                                      # 6 is 5+1: one run of two
    start, end = 8, 29                                            # from block 1 to mid block 3
    ours, theirs = make(10), make(10)
    k, v = lay.views(ours.numpy())
    plan = pieces([(0, 13), (13, 29)], start, end, block_ids, N)   # two source parts
    parts = [np.ascontiguousarray(kv[:, :, :13]), np.ascontiguousarray(kv[:, :, 13:])]
    copy_in(k, v, parts, plan)
    slots = torch.tensor([block_ids[t // N] * N + t % N for t in range(start, end)])
    key = torch.from_numpy(kv[0, :, start:end]).transpose(0, 1).contiguous()
    value = torch.from_numpy(kv[1, :, start:end]).transpose(0, 1).contiguous()
    writer(key, value, theirs, slots)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("writer,make", LAYOUTS)
def test_copy_out_reads_back_what_the_engine_wrote(writer, make):
    lay = BlockLayout.probe(make(1), writer, N, H, D)
    rng = np.random.default_rng(1)
    kv = torch.from_numpy(rng.standard_normal((2, H, 20, D)).astype(np.float32))
    block_ids = [3, 4, 7]
    cache = make(8)
    writer(kv[0].transpose(0, 1).contiguous(), kv[1].transpose(0, 1).contiguous(), cache,
           torch.tensor([block_ids[t // N] * N + t % N for t in range(20)]))
    out = np.full((2, H, 20, D), np.nan, dtype=np.float32)
    k, v = lay.views(cache.numpy())
    copy_out(k, v, out, pieces([(0, 20)], 0, 20, block_ids, N))
    assert np.array_equal(out, kv.numpy())


def test_pieces_merge_consecutive_whole_blocks_within_a_part_only():
    got = pieces([(0, 32)], 0, 30, [4, 5, 6, 9], N)
    assert got == [Piece(0, 0, 0, 24, 4, 3, 0), Piece(0, 24, 24, 30, 9, 1, 0)]
    # a part boundary inside a block cuts it; a start inside a block is a slice
    got = pieces([(0, 12), (12, 20)], 4, 20, [0, 1, 2], N)
    assert got == [Piece(0, 4, 4, 8, 0, 1, 4), Piece(0, 8, 8, 12, 1, 1, 0),
                   Piece(1, 0, 12, 16, 1, 1, 4), Piece(1, 4, 16, 20, 2, 1, 0)]


def test_pieces_refuse_a_range_past_the_request_blocks():
    with pytest.raises(LayoutError, match="need 3 blocks"):
        pieces([(0, 20)], 0, 20, [0, 1], N)


def test_a_layout_that_is_not_strided_is_refused():
    perm = torch.randperm(N * H * 2 * D, generator=torch.Generator().manual_seed(0))

    def scrambled(key, value, cache, slots):
        plain = torch.zeros_like(cache)
        nhd_writer(key, value, plain, slots)
        cache.view(-1)[perm] = plain.view(-1)
    with pytest.raises(LayoutError, match="not a strided one"):
        BlockLayout.probe(nhd_cache(1), scrambled, N, H, D)


def test_a_writer_that_loses_tokens_is_refused():
    def lossy(key, value, cache, slots):
        nhd_writer(key[:-1], value[:-1], cache, slots[:-1])
    with pytest.raises(LayoutError, match="wrote .* slots of keys"):
        BlockLayout.probe(nhd_cache(1), lossy, N, H, D)


def test_bf16_blocks_are_probed_exactly():
    lay = BlockLayout.probe(cpu_cache(1).to(torch.bfloat16), cpu_writer, N, H, D)
    assert lay == BlockLayout.probe(cpu_cache(1), cpu_writer, N, H, D)
