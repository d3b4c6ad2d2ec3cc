"""Paged KV: KDN chunks into an engine's paged cache and back, one strided copy at a time.

An engine with a paged cache (vLLM) keeps each layer's KV in blocks of N tokens: token t of
a request lives in block block_ids[t // N], slot t % N. Where a (head, token, dim) of the keys
or of the values sits inside a block is the attention kernel's choice (vLLM's CPU kernel keeps
a head's keys transposed, [head_dim, N], before its values, [N, head_dim]), so it is measured,
not assumed: `BlockLayout.probe` has the engine's own cache writer fill a scratch block with
values that name their position, and reads back where each one landed. Every layout met so
far is affine (slot = offset + head*sh + token*sn + dim*sd), so the keys, and the values, of
all blocks are one strided view of the cache's memory. A chunk [layers, 2, heads, tokens,
head_dim] then goes into the cache with one copy per layer, K or V, and run of consecutive
blocks, read straight from the chunk's buffer: the only copy its bytes make. A layout that
is not affine is refused (LayoutError), so no load can put a value in the wrong slot.

Copies are numpy's (np.copyto): into vLLM's CPU layout, whose keys are transposed, numpy's
strided copy ran at 4-6 GB/s on this machine where torch's copy_ ran at 0.5-3 GB/s, and it
releases the GIL, so a copy thread runs beside the forward.
"""
from dataclasses import dataclass

import numpy as np
import torch

from kdn.core.errors import ModelError


class LayoutError(ModelError):
    """The engine's paged cache keeps KV in an order KDN cannot copy into exactly."""


@dataclass(frozen=True)
class Strides:
    """Where (head, token, dim) of the keys or of the values sits in a block, in elements."""
    offset: int
    head: int
    token: int
    dim: int


@dataclass(frozen=True)
class BlockLayout:
    """The measured layout of one block of a layer's paged cache (see the module)."""
    block_tokens: int
    heads: int
    head_dim: int
    block_elems: int          # elements from one block to the next
    k: Strides
    v: Strides

    @classmethod
    def probe(cls, scratch: torch.Tensor, write, block_tokens: int, heads: int,
              head_dim: int) -> "BlockLayout":
        """Measure the layout with the engine's writer.

        scratch: one block shaped and typed like the cache's ([1, ...], contiguous).
        write(key, value, scratch, slots): the engine's cache writer, storing key and value
        [tokens, heads, head_dim] at slots (int64) of scratch. Three passes write the token,
        head and dim index (+1; keys positive, values negative), so every value is an
        exact small integer in any float dtype.
        """
        n, h, d = block_tokens, heads, head_dim
        if max(n, h, d) + 1 > 256:      # bf16 holds integers exactly up to 256
            raise LayoutError(f"cannot probe blocks of {n} tokens x {h} heads x {d} dims exactly")
        if not scratch.is_contiguous() or scratch.shape[0] != 1:
            raise LayoutError(f"the probe needs one contiguous block, got {tuple(scratch.shape)}")
        grid = torch.meshgrid(torch.arange(n), torch.arange(h), torch.arange(d), indexing="ij")
        seen = []
        for axis in grid:                 # token, head, dim
            key = (axis + 1).to(scratch.dtype)
            scratch.zero_()
            write(key, -key, scratch, torch.arange(n, dtype=torch.int64))
            seen.append(scratch.reshape(-1).to(torch.float64).round().to(torch.int64))
        tok, head, dim = seen
        return cls(block_tokens=n, heads=h, head_dim=d, block_elems=scratch.numel(),
                   k=_affine(tok, head, dim, +1, (n, h, d), "keys"),
                   v=_affine(-tok, -head, -dim, +1, (n, h, d), "values"))

    def views(self, cache: np.ndarray) -> tuple:
        """(K, V): strided numpy views [blocks, heads, N, head_dim] of every block of `cache`
        (a C-contiguous array of blocks, e.g. a torch cache's .numpy())."""
        if not cache.flags.c_contiguous or cache[0].size != self.block_elems:
            raise LayoutError(f"a cache of shape {cache.shape} is not contiguous blocks of "
                              f"{self.block_elems} elements")
        flat, size = cache.reshape(-1), cache.itemsize
        shape = (cache.shape[0], self.heads, self.block_tokens, self.head_dim)

        def view(s: Strides):
            strides = tuple(size * e for e in (self.block_elems, s.head, s.token, s.dim))
            return np.lib.stride_tricks.as_strided(flat[s.offset:], shape, strides, writeable=True)
        return view(self.k), view(self.v)


def _affine(tok, head, dim, sign, dims, what) -> Strides:
    """Strides of the slots whose probe values have `sign`; LayoutError unless every
    (token, head, dim) landed exactly once at an affine position."""
    n, h, d = dims
    slots = torch.nonzero(tok * sign > 0).flatten()
    if slots.numel() != n * h * d:
        raise LayoutError(f"the engine wrote {slots.numel()} slots of {what}, expected {n * h * d}")
    t, hh, dd = tok[slots] - 1, head[slots] - 1, dim[slots] - 1
    if min(t.min(), hh.min(), dd.min()) < 0 or t.max() >= n or hh.max() >= h or dd.max() >= d:
        raise LayoutError(f"the engine wrote {what} that are not the ones it was given")
    pos = torch.full((h, n, d), -1, dtype=torch.int64)
    pos[hh, t, dd] = slots
    if (pos < 0).any():
        raise LayoutError(f"some (head, token, dim) of the {what} was written twice, another never")
    base = int(pos[0, 0, 0])
    s = Strides(base, int(pos[1, 0, 0]) - base if h > 1 else 0,
                int(pos[0, 1, 0]) - base if n > 1 else 0, int(pos[0, 0, 1]) - base if d > 1 else 0)
    ih, it, idim = torch.meshgrid(torch.arange(h), torch.arange(n), torch.arange(d), indexing="ij")
    if not torch.equal(pos, base + ih * s.head + it * s.token + idim * s.dim):
        raise LayoutError(f"the engine's block layout of {what} is not a strided one; KDN does "
                          f"not copy into it")
    return s


# --- which slots a token range goes to --------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of a request, from source `part` at `src` (its own token index),
    into blocks `block` .. block+blocks-1: whole consecutive blocks, or a slice of one."""
    part: int
    src: int
    start: int
    end: int
    block: int
    blocks: int
    slot: int                 # first slot in the first block


def pieces(spans, start: int, end: int, block_ids, block_tokens: int) -> list:
    """How tokens [start, end) of a request map from source parts to cache blocks.

    spans: (first, last) token of each source part, in order (a chunk each, or one buffer).
    block_ids: the request's blocks from its first token. Whole blocks with consecutive ids
    inside one part become one piece (one copy); a block cut by the range or by a part's
    edge is a piece of its own.
    """
    n = block_tokens
    if end > len(block_ids) * n:
        raise LayoutError(f"tokens up to {end} need {-(-end // n)} blocks, the request has "
                          f"{len(block_ids)}")
    out = []
    for i, (p0, p1) in enumerate(spans):
        a, b = max(start, p0), min(end, p1)
        t = a
        while t < b:
            j, slot = divmod(t, n)
            if slot or b - t < n:        # a slice of one block
                e = min(b, (j + 1) * n)
                out.append(Piece(i, t - p0, t, e, block_ids[j], 1, slot))
                t = e
                continue
            k = 1                         # whole blocks with consecutive ids
            while t + (k + 1) * n <= b and block_ids[j + k] == block_ids[j] + k:
                k += 1
            out.append(Piece(i, t - p0, t, t + k * n, block_ids[j], k, 0))
            t += k * n
    return out


def _blocks(rows: np.ndarray, k: int) -> np.ndarray:
    """rows [heads, k*N, dim] as [heads, k, N, dim]: a view, never a copy (setting .shape
    raises where reshape would copy, and a copy written into would lose the values)."""
    v = rows.view()
    v.shape = (rows.shape[0], k, rows.shape[1] // k, rows.shape[2])
    return v


def copy_in(cache_k, cache_v, parts, plan) -> None:
    """One layer: every piece of `plan` from its part [2, heads, tokens, head_dim] (numpy) into
    the strided cache views cache_k / cache_v [blocks, heads, N, head_dim]."""
    for p in plan:
        src = parts[p.part]
        n = p.end - p.start
        for dst, s in ((cache_k, src[0]), (cache_v, src[1])):
            if p.blocks == 1 and (p.slot or n < dst.shape[2]):
                np.copyto(dst[p.block, :, p.slot:p.slot + n], s[:, p.src:p.src + n])
            else:
                rows = _blocks(s[:, p.src:p.src + n], p.blocks)   # [heads, k, N, dim]
                np.copyto(dst[p.block:p.block + p.blocks], rows.transpose(1, 0, 2, 3))


def copy_out(cache_k, cache_v, out, plan) -> None:
    """One layer, the other way: every piece of `plan` from the cache views into `out`
    [2, heads, tokens, head_dim] (numpy, a single part: its token 0 is the plan's first)."""
    for p in plan:
        n = p.end - p.start
        for src, d in ((cache_k, out[0]), (cache_v, out[1])):
            if p.blocks == 1 and (p.slot or n < src.shape[2]):
                np.copyto(d[:, p.src:p.src + n], src[p.block, :, p.slot:p.slot + n])
            else:
                np.copyto(_blocks(d[:, p.src:p.src + n], p.blocks),
                          src[p.block:p.block + p.blocks].transpose(1, 0, 2, 3))
