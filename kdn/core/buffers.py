"""Receive buffers written again once nothing views them: a server's write bodies
(kdn.core.serving.FrameWrites) and a client's answers (kdn.client.http.EdgeHTTPClient).

New memory costs a page fault per 4 KiB as the bytes land in it: on a VM whose host takes
free memory back (free page reporting: docs/figures.md, session 42) 0.3-0.8 GB/s, against
several GB/s into memory written before. So a receiver keeps the buffers it received into and
writes one again once nothing views it any more: every view of a buffer (a chunk decoded from
it, a memoryview, a numpy slice) holds a reference to it, so its reference count tells.
Threads may share one KeptBuffers (an edge's pulling connections: kdn/edge/dataplane.py): a
buffer is taken under its lock, so two never get the same one."""
import sys
import threading

import numpy as np


class KeptBuffers:
    """At most `most` buffers and `most_bytes` bytes kept, from `least_bytes` up (a smaller
    one's faults cost little); a kept buffer is written again for n bytes when nothing views
    it, it holds n, and n fills at least `fill` of it. A new buffer is kept in place of the
    oldest free ones, else of the oldest still in use (those are freed once their views go),
    so a view that lives on never holds a place for good."""

    def __init__(self, most: int, most_bytes: int, least_bytes: int = 0, fill: float = 0.0):
        self.most, self.most_bytes = int(most), int(most_bytes)
        self.least_bytes, self.fill = int(least_bytes), float(fill)
        self._kept = []
        self._lock = threading.Lock()

    def take(self, n: int) -> tuple:
        """(a writable n-byte uint8 array, whether it is memory used before)."""
        with self._lock:
            for b in self._kept:
                # 3 references: the list's, b, getrefcount's argument: any more is a live view
                if n <= b.nbytes and n >= self.fill * b.nbytes and sys.getrefcount(b) <= 3:
                    return b[:n], True
        b = np.empty(max(n, 1), np.uint8)       # (new memory: outside the lock)
        if self.least_bytes <= n and b.nbytes <= self.most_bytes:
            with self._lock:
                self._keep(b)
        return b[:n], False

    def _keep(self, b) -> None:
        def fits() -> bool:
            return len(self._kept) < self.most and self.nbytes + b.nbytes <= self.most_bytes
        i = 0
        while i < len(self._kept) and not fits():          # the oldest free ones first
            if sys.getrefcount(self._kept[i]) <= 2:         # the list's, the argument: free
                del self._kept[i]
            else:
                i += 1
        while self._kept and not fits():                    # then the oldest in use
            del self._kept[0]
        self._kept.append(b)

    @property
    def nbytes(self) -> int:
        """The bytes of the buffers kept (free or in use)."""
        return sum(b.nbytes for b in list(self._kept))
