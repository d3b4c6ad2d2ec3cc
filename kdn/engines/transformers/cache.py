"""The cache adapter: KDN's KV arrays [layers, 2, kv_heads, tokens, head_dim] into a
transformers cache and back.

Rebuilding the engine's cache is one copy of the fetched KV into one buffer, lent by the
model's arena (kdn.engines.transformers.arena: memory already faulted in, reused across
requests), whose per-layer slices become the cache's tensors, with room for the tokens the
engine appends in place (InPlaceLayer). `CacheAdapter` is that part of the model
(kdn.engines.transformers.model.Model); it needs the model's `layers`, `kv_heads`,
`head_dim`, `kv_dtype`, `arena` and `counters`.
"""
import time
import warnings

import numpy as np
import torch

from kdn.core.checks import check_int
from kdn.core.dtypes import DTYPES, name_of
from kdn.core.errors import ModelError

_GROW = []


def _in_place_layer():
    """transformers' DynamicLayer, made to append in place into room it was given (None
    where this transformers has no DynamicLayer: caches then concatenate as they always do)."""
    if not _GROW:
        try:
            from transformers.cache_utils import DynamicLayer
        except ImportError:
            _GROW.append(None)
            return None

        class InPlaceLayer(DynamicLayer):
            """A DynamicLayer whose keys and values are the first n positions of stores
            [1, heads, capacity, head_dim]: update() writes new tokens after them, in place,
            while they fit and the keys are still that prefix (a crop keeps it one), else it
            concatenates like DynamicLayer."""

            def __init__(self, k_store, v_store, n: int):
                super().__init__()
                self.lazy_initialization(k_store, v_store)
                self._stores = (k_store, v_store)
                self.keys, self.values = k_store[:, :, :n], v_store[:, :, :n]

            def update(self, key_states, value_states, *args, **kwargs):
                k_store, v_store = self._stores
                n, q = self.keys.shape[-2], key_states.shape[-2]
                if self.keys.data_ptr() == k_store.data_ptr() and self.values.data_ptr() == v_store.data_ptr() \
                        and n + q <= k_store.shape[-2]:
                    k_store[:, :, n:n + q].copy_(key_states)
                    v_store[:, :, n:n + q].copy_(value_states)
                    self.keys, self.values = k_store[:, :, :n + q], v_store[:, :, :n + q]
                    return self.keys, self.values
                return super().update(key_states, value_states, *args, **kwargs)

        _GROW.append(InPlaceLayer)
    return _GROW[0]


class CacheAdapter:
    def new_cache(self):
        """An empty engine cache for this model."""
        from transformers import DynamicCache
        return DynamicCache(config=self.hf.config)

    def _layer_kv(self, cache):
        """[(keys, values)] per layer, tensors [1, heads, T, hd]."""
        if hasattr(cache, "layers"):
            pairs = [(layer.keys, layer.values) for layer in cache.layers]
        else:  # transformers < 4.56
            pairs = list(zip(cache.key_cache, cache.value_cache))
        if len(pairs) != self.layers:
            raise ModelError(f"cache has {len(pairs)} layers; {self.name} has {self.layers}")
        return pairs

    @staticmethod
    def cache_tokens(cache) -> int:
        return 0 if cache is None else int(cache.get_seq_length())

    def cache_bytes(self, cache) -> int:
        """The memory a cache holds: every distinct buffer under its layers' keys and values
        (an arena buffer with its spare room counts whole, once)."""
        seen = {}
        for k, v in self._layer_kv(cache):
            for t in (k, v):
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    def kv_from_cache(self, cache, start: int = 0, end: int | None = None) -> np.ndarray:
        """KV of cache positions [start, end) as one contiguous array [layers, 2, heads, T, hd].

        In the model's KV dtype: float32 by default (bfloat16 comes back as uint16 bits).
        """
        n = self.cache_tokens(cache)
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise ModelError(f"KV range [{start}, {end}) is outside the cache's {n} tokens")
        out = np.empty((self.layers, 2, self.kv_heads, end - start, self.head_dim),
                       dtype=DTYPES[self.kv_dtype][0])
        dst = torch.from_numpy(out)
        if self.kv_dtype == "bfloat16":
            dst = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
        if end > start:
            with torch.inference_mode():
                for i, (k, v) in enumerate(self._layer_kv(cache)):
                    dst[i, 0].copy_(k[0, :, start:end])
                    dst[i, 1].copy_(v[0, :, start:end])
        return out

    def kv_tensor(self, part, index: int = 0) -> torch.Tensor:
        """part (numpy, torch or a Chunk) as a torch tensor [layers, 2, kv_heads, tokens,
        head_dim] of this model's shape, without a copy; ModelError naming the axis that differs."""
        if hasattr(part, "to_torch"):  # a kdn Chunk
            part = part.to_torch()
        if isinstance(part, np.ndarray):
            if part.dtype == np.uint16:  # bfloat16 bits, as KDN chunks store them
                part = part.view(np.int16)
                with warnings.catch_warnings():  # read-only buffers are fine: we only read
                    warnings.simplefilter("ignore", UserWarning)
                    part = torch.from_numpy(part).view(torch.bfloat16)
            elif part.dtype in (np.float32, np.float16):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    part = torch.from_numpy(part)
            else:
                raise ModelError(f"KV part {index} has dtype {part.dtype}; expected float32, float16 "
                                 "or uint16 (bfloat16 bits)")
        if not isinstance(part, torch.Tensor):
            raise ModelError(f"KV part {index} is a {type(part).__name__}; expected a numpy array, "
                             "a torch tensor or a Chunk")
        if name_of(part.dtype) is None:
            raise ModelError(f"KV part {index} has dtype {part.dtype}; expected a float dtype")
        want = {1: ("layer count", self.layers), 2: ("K/V pair axis", 2),
                3: ("KV head count", self.kv_heads), 5: ("head dim", self.head_dim)}
        if part.dim() != 5:
            raise ModelError(f"KV part {index} has shape {tuple(part.shape)}; expected 5 axes "
                             f"[layers={self.layers}, 2, kv_heads={self.kv_heads}, tokens, "
                             f"head_dim={self.head_dim}]")
        for axis, (label, value) in want.items():
            got = part.shape[axis - 1]
            if got != value:
                raise ModelError(f"KV part {index} has {label} {got}; {self.name} has {value} "
                                 f"(shape {tuple(part.shape)})")
        return part

    def cache_from_kv(self, kv_parts, spare_tokens: int = 0):
        """An engine cache holding the concatenation of kv_parts along tokens.

        Each part is [layers, 2, kv_heads, tokens, head_dim] (numpy, torch or a Chunk). One
        copy: every part goes once into a [layers, 2, 1, heads, T + spare, hd] buffer lent by
        the arena for the cache's life (memory already faulted in; converted to the model's
        dtype on the way), and each layer's keys and values are views of it handed to the
        cache as they are. spare_tokens: room for the tokens the engine will append (the
        question, the answer): they are written in place, where transformers would otherwise
        concatenate, copying the whole KV again into fresh memory on the first forward.
        """
        t0 = time.perf_counter()
        check_int(spare_tokens, "spare_tokens", 0, error=ModelError)
        parts = [self.kv_tensor(p, i) for i, p in enumerate(kv_parts)]
        total = sum(p.shape[3] for p in parts)
        cache = self.new_cache()
        if total:
            buf = self.arena.take((self.layers, 2, 1, self.kv_heads, total + spare_tokens, self.head_dim),
                                  self.hf.dtype, owner=cache)
            with torch.inference_mode():
                at = 0
                for p in parts:
                    n = p.shape[3]
                    buf[:, :, 0, :, at:at + n].copy_(p)
                    at += n
            self.fill_cache(cache, buf, total)
        self.counters["cache_from_kv_calls"] += 1
        self.counters["cache_from_kv_bytes"] += total * self.kv_bytes_per_token
        self.counters["cache_from_kv_s"] += time.perf_counter() - t0
        return cache

    def fill_cache(self, cache, buf, tokens: int = None) -> None:
        """Hand the first `tokens` positions of buf [layers, 2, 1, kv_heads, capacity,
        head_dim] (default all) to an empty engine cache as its KV: each layer's keys and
        values become views of buf, no copy, and tokens the engine appends go into the rest
        of buf in place while they fit (then it concatenates, as it always would)."""
        n = buf.shape[4] if tokens is None else tokens
        layers = getattr(cache, "layers", None)
        grow = _in_place_layer()
        if layers and len(layers) == self.layers and grow is not None \
                and all(type(l) is grow.__base__ for l in layers):
            for i in range(self.layers):
                layers[i] = grow(buf[i, 0], buf[i, 1], n)
        elif layers and len(layers) == self.layers and all(hasattr(l, "lazy_initialization") for l in layers):
            for i, layer in enumerate(layers):
                k, v = buf[i, 0, :, :, :n], buf[i, 1, :, :, :n]
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        else:  # other cache layouts: the public update path (one more copy)
            for i in range(self.layers):
                cache.update(buf[i, 0, :, :, :n], buf[i, 1, :, :, :n], i)
        if self.cache_tokens(cache) != n:
            raise ModelError(f"engine cache reports {self.cache_tokens(cache)} tokens after loading "
                             f"{n}; this transformers version's cache API is not supported")

    def crop(self, cache, n: int) -> None:
        """Keep the first n cached tokens (the crop() signature changed across transformers versions)."""
        if hasattr(cache, "layers"):
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]
        else:
            cache.crop(n)

