"""The worker side of keeping vLLM's conversations: a finished answer's KV out of its blocks, to its home edge.

When a request finishes its answer, the planner (kdn.engines.vllm.plan) asks vLLM to keep
its blocks (request_finished's delay) and hands the worker a `Keep` in the next step. The
keeper's threads then, off the engine's steps (one copies, one stores: a home edge that is
slow to take a store never keeps the next answer's blocks from being copied and freed):
1. asks the conversation's home edge in this region how much of it it holds already
   (kdn.client.history.History.held_here: a lookup, no KV moves), so a turn sends only the
   chunks after the ones an earlier turn kept;
2. copies the KV of the whole chunks after those out of the blocks (Loader.kv_range) and
   says so: the connector reports the request finished sending (get_finished) and vLLM frees
   its blocks;
3. sends them to the home edge (History.store: put_conversation), which keeps them under
   the tenant's budget and idle TTL.
What is kept is the KV vLLM computed for the prompt and the answer's tokens: the same KV
vLLM's own prefix cache reuses for them. A caller that knows how far the next turn's prompt
reproduces them (the answer put back through the chat template; kdn.serve.vllm) says so
before the keep is planned (`limit`), and the keep stops there; without it, every whole
chunk computed is kept (a chunk the next prompt does not reproduce is keyed by tokens it
does not have: never read, never wrong). A store that fails is counted and the next turn
recomputes; the blocks are always released.
"""
import collections
import concurrent.futures
import logging
import sys
import threading
import time

from kdn.core.errors import KDNError
from kdn.core.keys import CHUNK_TOKENS

log = logging.getLogger("kdn.engines.vllm")
RESULTS_KEPT = 64          # the last results, by request id (kept())
MAX_STORES_QUEUED = 4      # copies waiting for a slow home edge, at most; past them a turn is not kept


class Keeper:
    """Worker side of conversation keeping (see the module). loader: the connector's Loader
    (its blocks' layout); histories(salt) -> the request's kdn.client.history.History."""

    def __init__(self, loader, histories):
        self.loader, self.histories = loader, histories
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-keep")
        self._store_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kdn-keep-store")
        self._pending = []                  # futures of keeps not yet done
        self._copied = set()                # req ids whose blocks may be freed now
        self._limits = {}                   # req id -> tokens the next prompt reproduces
        self._queued = 0                    # stores submitted and not done
        self._lock = threading.Lock()
        self.results = collections.OrderedDict()   # req id -> {"chunks", "tokens", "edge", "held", "error"}
        # keeps, kept_chunks, kept_tokens, nothing_new, keep_errors, keep_failures, store_backlog,
        # copy_s, store_s
        self.counters = collections.Counter()

    def limit(self, limits: dict) -> None:
        """{req id: n}: keep only the first n tokens of these requests' conversations (the next
        prompt reproduces no more). Given before the step that plans their keeps; a limit
        that no keep used is dropped by the next wait()."""
        with self._lock:
            self._limits.update(limits)

    def submit(self, keep) -> None:
        """Start keeping one finished request's conversation (in this keeper's thread)."""
        self.counters["keeps"] += 1
        self._track(self._thread.submit(self._run, keep, self._keep))

    def _track(self, f) -> None:
        with self._lock:
            self._pending = [p for p in self._pending if not p.done()] + [f]

    def take_copied(self) -> set:
        """Requests whose blocks were copied (or are not needed) since the last call."""
        with self._lock:
            done, self._copied = self._copied, set()
        return done

    def wait(self, timeout_s: float) -> dict:
        """Wait (at most timeout_s) for every keep submitted so far; their results so far."""
        deadline = time.monotonic() + timeout_s
        while True:              # a copy done starts its store: wait for that too
            with self._lock:
                pending = [p for p in self._pending if not p.done()]
            left = deadline - time.monotonic()
            if not pending or left <= 0:
                break
            concurrent.futures.wait(pending, timeout=left)
        with self._lock:
            self._limits.clear()
            return dict(self.results)

    def _keep(self, keep) -> None:
        result = {"chunks": 0, "tokens": 0, "edge": None, "held": None, "error": None}
        try:
            with self._lock:
                limit = self._limits.pop(keep.req, None)
            tokens = keep.tokens if limit is None else keep.tokens[:max(0, limit)]
            whole = len(tokens) // CHUNK_TOKENS
            history = self.histories(keep.salt)
            kv = None
            if self.loader.refused:
                result["error"] = self.loader.refused
            elif history is not None and whole > keep.start_chunk:
                try:
                    held = history.held_here(tokens, keep.start_chunk, keep.narrowing)
                except KDNError as e:     # refused (the tenant's token): nothing is kept
                    self.counters["keep_errors"] += 1
                    result["error"] = f"{type(e).__name__}: {e}"
                    held = None
                first = None if held is None else keep.start_chunk + held
                result["held"] = held
                if first is not None and first < whole and self._queued >= MAX_STORES_QUEUED:
                    self.counters["store_backlog"] += 1      # the home edge is not keeping up
                    result["error"] = f"{self._queued} stores already wait for the home edge"
                elif first is not None and first < whole:
                    t0 = time.perf_counter()
                    kv = self.loader.kv_range(keep.block_ids, first * CHUNK_TOKENS, whole * CHUNK_TOKENS)
                    self.counters["copy_s"] += time.perf_counter() - t0
                elif first is not None:
                    self.counters["nothing_new"] += 1
        finally:
            with self._lock:
                self._copied.add(keep.req)    # vLLM may free the blocks: what is kept is copied
        if kv is None:
            self._result(keep.req, result)
            return
        with self._lock:
            self._queued += 1
        self._track(self._store_thread.submit(self._run, keep, lambda k: self._store(
            k, history, tokens[:whole * CHUNK_TOKENS], kv, first, result)))

    def _store(self, keep, history, tokens, kv, first: int, result: dict) -> None:
        """Send the copied chunks to the home edge (History.store)."""
        t0 = time.perf_counter()
        try:
            got = history.store(tokens, kv, keep.start_chunk, first, keep.narrowing, keep.retention)
            result.update(got)
            self.counters["kept_chunks"] += got["chunks"]
            self.counters["kept_tokens"] += got["chunks"] * CHUNK_TOKENS
        except KDNError as e:     # refused (token, budget), malformed: the next turn recomputes
            self.counters["keep_errors"] += 1
            result["error"] = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._queued -= 1
        self.counters["store_s"] += time.perf_counter() - t0
        self._result(keep.req, result)

    def _result(self, req, result: dict) -> None:
        with self._lock:
            self.results[req] = result
            while len(self.results) > RESULTS_KEPT:
                self.results.popitem(last=False)

    def _run(self, keep, step) -> None:
        """step(keep) (_keep, or its store); one that fails on a bug is logged, counted and its
        result says so before the error propagates (its blocks were released: _keep's finally)."""
        done = False
        try:
            step(keep)
            done = True
        finally:
            if not done:
                error = sys.exc_info()[1]
                self.counters["keep_failures"] += 1
                log.error("KDN: keeping the conversation of request %s failed", keep.req, exc_info=error)
                self._result(keep.req, {"chunks": 0, "tokens": 0, "edge": None, "held": None,
                                        "error": f"{type(error).__name__}: {error}"})

    def stats(self) -> dict:
        return {"counters": dict(self.counters)}

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        self._store_thread.shutdown(wait=False, cancel_futures=True)
