"""Reusable KV memory for cache rebuilds: fetched KV is copied once into memory that is
already faulted in, instead of into fresh pages.

A fresh 180 MB `torch.empty` is mapped by the kernel on first touch: every page is
zero-filled as the copy reaches it, and the rebuild ran at a third of memcpy speed (at 4k
tokens of SmolLM2, 50-111 ms where a memcpy of the same bytes took 15-19 ms; `kdn bench
ttft` measures both). An `Arena` keeps the buffers it once touched and lends them out
again. A loan ends when the object reading the buffer (the engine cache holding views of
it) is garbage, through `weakref.finalize`, so a buffer is never rewritten while a cache
can still read it: concurrent rebuilds each get their own buffer. The arena keeps at most
`max_bytes` of idle buffers; a request it cannot serve from them gets fresh memory
(counted), never an error.

A conversation grows every turn, so each turn's cache wanted a buffer a little larger than
the last one's and never found an idle one to reuse: fresh buffers above 64 MiB are
therefore sized in powers of two, so one serves a growing conversation for several turns.

Fresh memory is still slow where it is needed most: measured in `kdn bench agent` (replica
mode, a loaded 2-core machine), a fresh 512 MiB buffer took 1.0-1.5 s to fault in, against
0.02 s for a rebuild into a reused one, and every conversation crossing into a new class paid
it on its time to first token. So the arena keeps one buffer of each class it has just lent
in reserve (`refill`, on by default): when a loan leaves no idle buffer of its class, a
background thread faults one in while the request computes, within `max_bytes` of idle
memory, and the next request of that class finds it ready (`prefaulted` counts them;
`allocated` counts only the fresh buffers a request waited for).
"""
import collections
import threading
import weakref

import torch

from kdn.core.checks import check_int

DEFAULT_MAX_BYTES = 2 << 30     # idle buffers kept for reuse (a 4k-token SmolLM2 KV is 180 MiB)
ROUND_BYTES = 16 << 20          # buffers are sized in these steps, so near sizes share one
DOUBLING_BYTES = 64 << 20       # ... and above this, in powers of two (growing caches share one)


def size_class(nbytes: int) -> int:
    """The bytes of a fresh buffer for nbytes: ROUND_BYTES steps, powers of two above
    DOUBLING_BYTES."""
    size = -(-nbytes // ROUND_BYTES) * ROUND_BYTES
    return size if size <= DOUBLING_BYTES else 1 << (size - 1).bit_length()


class Arena:
    """Buffers lent out for the life of an owner object and reused after it."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, refill: bool = True):
        self.max_bytes = check_int(max_bytes, "arena max_bytes", 0)
        self.refill = bool(refill)
        self._idle = []             # flat uint8 tensors, touched, not lent
        self._making = {}           # size class -> the thread faulting one in
        self._lock = threading.Lock()
        self.counters = collections.Counter()

    def stats(self) -> dict:
        with self._lock:
            idle = sum(b.numel() for b in self._idle)
        return {"idle_bytes": idle, "idle_buffers": len(self._idle), "max_bytes": self.max_bytes,
                "counters": dict(self.counters)}

    def take(self, shape, dtype: torch.dtype, owner) -> torch.Tensor:
        """A tensor of `shape` and `dtype` over reused memory, lent until `owner` is garbage.

        Its contents are whatever the last borrower left: the caller overwrites all of it.
        """
        nbytes = 1
        for n in shape:
            nbytes *= int(n)
        nbytes *= torch.empty((), dtype=dtype).element_size()
        buf = self._reuse(nbytes)
        if buf is None:
            buf = self._fresh(size_class(nbytes))
        else:
            self.counters["reused"] += 1
        self.counters["lent_bytes"] += nbytes
        weakref.finalize(owner, self._give_back, buf)
        if self.refill:
            self._keep_one(size_class(nbytes))
        return buf[:nbytes].view(dtype).view(tuple(int(n) for n in shape))

    def _fresh(self, size: int, counter: str = "allocated") -> torch.Tensor:
        buf = torch.empty(size, dtype=torch.uint8)
        buf.zero_()                 # fault every page in now, once, not on a reader's copy
        self.counters[counter] += 1
        self.counters[f"{counter}_bytes"] += size
        return buf

    def _keep_one(self, size: int) -> None:
        """Start faulting in an idle buffer of class `size` in the background, unless one is
        idle or on its way, or it would take idle memory over max_bytes."""
        with self._lock:
            if size in self._making or any(size <= b.numel() <= 2 * size for b in self._idle) \
                    or sum(b.numel() for b in self._idle) + sum(self._making) + size > self.max_bytes:
                return
            t = threading.Thread(target=self._prefault, args=(size,), daemon=True, name="kdn-arena-refill")
            self._making[size] = t
        t.start()

    def _prefault(self, size: int) -> None:
        try:
            buf = self._fresh(size, "prefaulted")
        finally:
            with self._lock:
                self._making.pop(size, None)
        self._give_back(buf)

    def settle(self, timeout: float = None) -> None:
        """Wait for the buffers being faulted in (tests and benchmarks that count buffers)."""
        with self._lock:
            threads = list(self._making.values())
        for t in threads:
            t.join(timeout)

    def _reuse(self, nbytes: int):
        """The smallest idle buffer that holds nbytes and is at most twice its size class,
        taken out of the idle list (a small cache never holds a whole-context buffer: a
        replica keeps caches by the bytes they hold)."""
        most = 2 * size_class(nbytes)
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if nbytes <= b.numel() <= most]
            if not fits:
                return None
            return self._idle.pop(min(fits, key=lambda i: self._idle[i].numel()))

    def _give_back(self, buf: torch.Tensor) -> None:
        """Keep buf for reuse; over max_bytes, let the smallest idle buffers go."""
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=lambda b: b.numel(), reverse=True)
            while self._idle and sum(b.numel() for b in self._idle) > self.max_bytes:
                self._idle.pop()
                self.counters["released"] += 1
