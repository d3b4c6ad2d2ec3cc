"""The worker side of KDN's vLLM connector: chunks into the paged cache, KV out to publish.

When vLLM registers its paged caches, the loader measures their block layout once with
vLLM's own cache writer (kdn.engines.vllm.paged) and keeps strided K and V views of every layer.

A step with loads (kdn.engines.vllm.plan.Load) first fetches every load's chunks: the KB's
verified against their manifest checksums, then the conversation's from its home edge
(kdn.client.history.History.fetch: verified by their frames, and checked to be the keys and
namespace asked for), the longest good prefix, within a deadline. Then threads
copy them, layer by layer, straight from the chunks' buffers into the request's blocks
(numpy releases the GIL: two threads copy about twice as fast). By default the forward
starts once every layer is in; with `layerwise`, vLLM's attention of layer i waits only for
layer i (wait_for_layer_load), which pays where cores are spare. Tokens that did not arrive
(an edge dead or too slow, a corrupt copy with no good one left, a chunk of another shape)
put their blocks in the failed set vLLM collects after the step; vLLM then recomputes from
the first failed block (kv_load_failure_policy="recompute"). A load never holds a step past
its deadline and never leaves a wrong value where vLLM will read it.

A capture (a publishing request whose prefill completed this step) is copied out of its
blocks into one array [layers, 2, heads, tokens, head_dim] after the forward and published
with the admin token: the KV served to vLLM is then what vLLM itself computed. A kept
conversation is copied out the same way (`kv_range`), by kdn.engines.vllm.keep.
"""
import collections
import concurrent.futures
import sys
import threading
import time

import numpy as np
import torch

from kdn.core.dtypes import DTYPES, name_of, torch_dtype
from kdn.core.errors import KDNError
from kdn.engines.vllm.paged import BlockLayout, LayoutError, copy_in, copy_out, pieces

COPY_THREADS = 2      # numpy copies release the GIL: two threads copy about twice as fast


class Loader:
    """Worker side (see the module). sources(salt) -> a Source for reads; publisher(salt) ->
    a kdn Client with the admin token, for captures; deadline: sources.Deadline;
    histories(salt) -> the kdn.client.history.History conversations are read through."""

    def __init__(self, sources, publisher, deadline, fetch_deadline_s: float, layerwise: bool = False,
                 copy_threads: int = COPY_THREADS, histories=None):
        self.sources, self.publisher, self.deadline = sources, publisher, deadline
        self.histories = histories or (lambda salt: None)
        self.fetch_deadline_s = fetch_deadline_s
        self.layerwise = layerwise
        self.copy_threads = max(1, copy_threads)
        self.layout = None
        self.block_size = None       # tokens per block (vLLM's), known at registration
        self.views = []              # per layer (K, V) [blocks, heads, N, head_dim]
        self.caches = []             # per layer, the cache's memory (numpy)
        self.index = {}              # vLLM layer name -> layer index
        self.dtype = None
        self.refused = None          # why this cache cannot be loaded into (no loads then)
        self.failed = set()          # block ids that failed to load this step
        self.reports = {}            # req id -> what was done for it this step
        self._done = []              # per-layer events of the running copy
        self._threads = []
        self._jobs, self._ends = [], []
        self._copy_t0 = 0.0
        # loads, loaded_tokens, failed_loads, failed_blocks, fetch_timeouts, fetch_errors,
        # shape_mismatch, copy_errors, fetch_s, copy_s, captures, published, publish_errors,
        # history_chunks (conversation chunks fetched)
        self.counters = collections.Counter()

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "refused": self.refused,
                "layout": None if self.layout is None else str(self.layout)}

    # --- registration ----------------------------------------------------------------------
    def register(self, caches: dict, order, write, block_size: int, heads: int, head_dim: int) -> None:
        """caches: vLLM layer name -> paged cache tensor; order(name) -> layer index;
        write(name)(key, value, cache, slots): that layer's cache writer."""
        names = sorted(caches, key=order)
        self.index = {n: i for i, n in enumerate(names)}
        self.block_size = block_size
        first = caches[names[0]]
        self.dtype = first.dtype
        try:
            self.layout = BlockLayout.probe(torch.zeros_like(first[:1]), write(names[0]),
                                            block_size, heads, head_dim)
            self.caches = [_as_numpy(caches[n]) for n in names]
            self.views = [self.layout.views(c) for c in self.caches]
        except LayoutError as e:
            self.refused = str(e)    # the engine runs on; KDN loads nothing into this cache
            self.views = []

    # --- loads -----------------------------------------------------------------------------
    def start(self, loads) -> None:
        """Fetch every load's chunks, then start copying them into the cache (see the module)."""
        self.failed, self.reports = set(), {}
        jobs = []
        for load in loads:
            job = self._prepare(load)
            if job is not None:
                jobs.append(job)
        if not jobs:
            return
        # Thread j copies layers j, j+W, j+2W, ...: every thread starts at the front, so layer 0
        # is ready first, and the copy uses the cores before the forward needs them.
        self._done = [threading.Event() for _ in self.views]
        self._jobs, self._copy_t0, self._ends = jobs, time.perf_counter(), []
        w = min(self.copy_threads, len(self.views))
        self._threads = [threading.Thread(target=self._copy, args=(jobs, range(j, len(self.views), w)),
                                          name=f"kdn-copy-{j}", daemon=True) for j in range(w)]
        for t in self._threads:
            t.start()
        if not self.layerwise:
            self.finish()

    def _prepare(self, load):
        """(load, plan, parts) of one load after its fetch; failed blocks noted."""
        n = self.block_size
        t0 = time.perf_counter()
        chunks, info, error = self._fetch(load)
        fetch_s = time.perf_counter() - t0
        got, at = [], load.first
        for c in chunks:                  # the prefix of chunks that fit this cache
            if not self._fits(c):
                self.counters["shape_mismatch"] += 1
                error = error or f"chunk {c.key.hex()} does not fit this model's cache"
                break
            got.append((at, at + c.tokens, c))
            at += c.tokens
        arrived = min(load.end, at)
        end = load.end if arrived >= load.end else max(load.start, arrived // n * n)
        if end < load.end:
            bad = load.block_ids[end // n:-(-load.end // n)]
            self._zero(set(bad) & set(load.unzeroed))
            self.failed.update(bad)
            self.counters["failed_loads"] += 1
            self.counters["failed_blocks"] += len(bad)
        self.counters["loads"] += 1
        self.counters["loaded_tokens"] += end - load.start
        self.counters["fetch_s"] += fetch_s
        self.reports[load.req] = {"loaded": end - load.start, "failed_from": None if end == load.end
                                  else end, "fetch_s": round(fetch_s, 4), "error": error,
                                  "bytes": (end - load.start) * self.token_bytes(),
                                  "fetched_from": info.get("edge"), "failovers": info.get("failovers")}
        if getattr(load, "conv", None) is not None:
            self.reports[load.req]["history_from"] = load.conv.edge
        if end <= load.start:
            return None
        plan = pieces([(a, b) for a, b, _ in got], load.start, end, load.block_ids, n)
        return load, plan, [c.kv for _, _, c in got]

    def _zero(self, blocks) -> None:
        """Zero blocks vLLM left unzeroed for this load, which will not be written now."""
        for b in sorted(blocks):
            for cache in self.caches:
                cache[b] = 0

    def token_bytes(self) -> int:
        """KV bytes of one token across every layer."""
        lay = self.layout
        return 0 if lay is None else len(self.views) * 2 * lay.heads * lay.head_dim * self.dtype.itemsize

    def _fetch(self, load) -> tuple:
        """(verified chunks, {"edge", "failovers"}, error or None): no chunks when the cache
        was refused, the fetch failed or the deadline passed."""
        if self.refused:
            return [], {}, self.refused
        try:
            chunks, info = self.deadline.run(self.fetch_deadline_s, self._chunks, load)
            return chunks, info, None
        except concurrent.futures.TimeoutError:
            self.counters["fetch_timeouts"] += 1
            return [], {}, f"no chunks within the {self.fetch_deadline_s:g} s deadline"
        except KDNError as e:          # no edge answered, KB gone, access refused: recompute
            self.counters["fetch_errors"] += 1
            return [], {}, f"{type(e).__name__}: {e}"

    def _chunks(self, load) -> tuple:
        """The KB's chunks of a load, then its conversation's when every KB chunk came."""
        chunks, info = [], {}
        if load.keys:
            chunks, info = self.sources(load.salt).fetch(load.kb, load.version, load.keys,
                                                         self.fetch_deadline_s)
        conv = getattr(load, "conv", None)
        if conv is not None and len(chunks) == len(load.keys):
            got = self.histories(load.salt).fetch(conv)
            self.counters["history_chunks"] += len(got)
            chunks = list(chunks) + got
        return chunks, info

    def _fits(self, c) -> bool:
        lay = self.layout
        return (c.layers == len(self.views) and c.kv_heads == lay.heads
                and c.head_dim == lay.head_dim and torch_dtype(c.dtype) == self.dtype)

    def _copy(self, jobs, layers) -> None:
        """Copy every job for `layers`, marking each layer done, always (even on error)."""
        copied = False
        try:
            for i in layers:
                k, v = self.views[i]
                for _, plan, parts in jobs:
                    copy_in(k, v, [p[i] for p in parts], plan)
                self._done[i].set()
            copied = True
        finally:
            if not copied:
                # Whatever stopped the copy (the error still propagates, and the thread's
                # traceback is printed), vLLM must never read half-copied blocks: every block
                # of the step is reported failed, so vLLM recomputes it.
                e = sys.exc_info()[1]
                self.counters["copy_errors"] += 1
                for load, _, _ in jobs:
                    self._zero(load.unzeroed)
                    self.failed.update(load.block_ids[load.start // self.block_size:])
                    self.reports[load.req]["error"] = f"copy failed: {type(e).__name__}: {e}"
            for i in layers:
                self._done[i].set()
            self._ends.append(time.perf_counter())

    def wait_layer(self, name: str) -> None:
        """Return once layer `name` of this step's loads is in the cache."""
        i = self.index.get(name)
        if self._done and i is not None:
            self._done[i].wait()

    def finish(self) -> None:
        """Wait for the copy threads (the forward is over, or has not started)."""
        if not self._threads:
            return
        for t in self._threads:
            t.join()
        copy_s = max(self._ends) - self._copy_t0
        self.counters["copy_s"] += copy_s
        for load, _, _ in self._jobs:          # the whole step's copy, shared by its loads
            self.reports[load.req]["copy_s"] = round(copy_s, 4)
        self._threads, self._jobs, self._done = [], [], []

    def take_failed(self) -> set:
        failed, self.failed = self.failed, set()
        return failed

    def take_reports(self) -> dict:
        reports, self.reports = self.reports, {}
        return reports

    # --- captures --------------------------------------------------------------------------
    def capture(self, cap) -> dict:
        """Publish the KV of cap's prompt from its blocks; the receipt, or {"error": ...}
        (also reported for the request, as "publish")."""
        self.counters["captures"] += 1
        receipt = self._publish(cap)
        self.reports.setdefault(cap.req, {})["publish"] = receipt
        return receipt

    def _publish(self, cap) -> dict:
        if self.refused:
            return {"error": self.refused}
        kv = self.kv_of(cap.block_ids, len(cap.tokens))
        docs, at = [], 0
        for name, n in cap.documents:
            docs.append((name, cap.tokens[at:at + n]))
            at += n
        try:
            receipt = self.publisher(cap.salt).publish(cap.kb, docs, kv, meta=cap.meta)
        except KDNError as e:          # refused or unreachable origin: the request still answers
            self.counters["publish_errors"] += 1
            return {"error": f"{type(e).__name__}: {e}"}
        self.counters["published"] += 1
        return receipt

    def kv_of(self, block_ids, n_tokens: int) -> np.ndarray:
        """KV of tokens [0, n_tokens) in blocks block_ids as [layers, 2, heads, tokens, head_dim]."""
        return self.kv_range(block_ids, 0, n_tokens)

    def kv_range(self, block_ids, start: int, end: int) -> np.ndarray:
        """KV of a request's tokens [start, end) in its blocks block_ids (from its token 0) as
        [layers, 2, heads, end - start, head_dim]."""
        lay = self.layout
        out = np.empty((len(self.views), 2, lay.heads, end - start, lay.head_dim),
                       dtype=DTYPES[name_of(self.dtype)][0])
        plan = pieces([(start, end)], start, end, block_ids, lay.block_tokens)
        for i, (k, v) in enumerate(self.views):
            copy_out(k, v, out[i], plan)
        return out


def _as_numpy(cache: torch.Tensor) -> np.ndarray:
    """The cache's memory as numpy, in KDN's storage dtype (bf16 as uint16 bits, as chunks)."""
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16)
    return cache.numpy()
