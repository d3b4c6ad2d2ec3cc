"""The edge's disk tier: a byte-bounded store of chunk frames on the node's local disk,
beneath the memory tiers (main and hot).

A record is one chunk's frame (kdn.core.chunk: magic, a header naming its key, namespace,
codec and sizes with the payload's checksum and the header's own, then the payload) in a
file of its own, <dir>/<first two hex digits of the key>/<key hex>.kdnc. A file per chunk
rather than slabs, by measurement (`kdn bench tiers`): a chunk is megabytes, so opening a
file costs well under 1% of reading it, and files give what slabs would have to build:
records of any size (compressed chunks differ), space freed the moment a record is
evicted (no compaction), and atomic replacement by rename.

The index is a ChunkCache (kdn/edge/cache.py, S3-FIFO or LRU) of Record: what a read needs
without touching the disk. Its victims' files are deleted. On start the index is rebuilt
by scanning the directory: each file's header is read and checked and its length compared
with what the header says; a torn or corrupt record, or one of another name, is deleted
(counted), never indexed; a crash's leftover temp files are deleted. An edge restarted on
the same directory therefore comes back warm.

A read takes the whole file into one buffer, hashing each block as it lands (while it is
still in the CPU's cache, so checking costs almost nothing over the read itself), and
checks the payload checksum, the key and the namespace; a record that fails is deleted and
the read is a miss (counted), so a bad record is never served. Writes go to a new file renamed into place (kdn.core.files), without
fsync: a cache need not survive a power cut, and a record torn by one is found and dropped
at the next start or read. A write that finds no room on the device (ENOSPC, EDQUOT, or
EFBIG past a file-size limit) is dropped and counted (`disk_full_dropped`), never raised:
the disk tier is a cache, and its writer runs off the readers' time.

Calls do file I/O: run them in a worker thread. The index has its own lock; two threads
writing one key each write a temp file and the last rename wins, with identical bytes.
"""
import collections
import errno
import os
import threading
from pathlib import Path

import numpy as np
import xxhash

from kdn.core.checks import check_int
from kdn.core.chunk import FRAME_SUFFIX, Encoded, decode, encode_parts, frame_size, read_header
from kdn.edge.cache import ChunkCache
from kdn.core.errors import BadRequest, ChecksumMismatch, FrameError, TruncatedFrame
from kdn.core.files import TEMP_SUFFIX, make_dirs, write_atomic

SUFFIX = FRAME_SUFFIX
HEADER_READ = 8 + 4096            # a frame's prefix and its longest header (kdn.core.chunk.MAX_HEADER)
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
READ_BLOCK = 512 << 10            # read and hash in blocks that stay in the CPU's cache


class Record:
    """A chunk on disk, as the index knows it: enough to route a read and size it."""
    __slots__ = ("key", "ns", "nbytes", "raw", "codec", "dtype")

    def __init__(self, key: bytes, ns: bytes, nbytes: int, raw: int, codec: str, dtype: str):
        self.key, self.ns, self.nbytes, self.raw = key, ns, nbytes, raw
        self.codec, self.dtype = codec, dtype


def frame_parts(obj) -> list:
    """A Chunk's or an Encoded's frame as bytes-like parts (no join copy)."""
    if isinstance(obj, Encoded):
        return [obj.frame]
    return encode_parts(obj, "raw")


def read_frame(path, nbytes: int) -> np.ndarray:
    """The nbytes-long frame in file path, its header and payload checksums checked
    (FrameError otherwise); each block is hashed right after it is read, while cached."""
    buf = np.empty(nbytes, dtype=np.uint8)
    mv = memoryview(buf)
    h, header, off, hashed = xxhash.xxh3_64(), None, 0, 0
    with open(path, "rb", buffering=0) as f:
        while off < nbytes:
            n = f.readinto(mv[off:off + READ_BLOCK])
            if not n:
                raise TruncatedFrame(f"{path}: record ends at byte {off} of {nbytes}")
            off += n
            if header is None and off >= min(nbytes, HEADER_READ):
                header, hashed = read_header(mv[:off])
                if frame_size(header, hashed) != nbytes:
                    raise TruncatedFrame(f"{path}: {nbytes} bytes, its frame says "
                                         f"{frame_size(header, hashed)}")
            if header is not None and off > hashed:
                h.update(mv[hashed:off])
                hashed = off
        if f.read(1):
            raise TruncatedFrame(f"{path}: longer than its {nbytes}-byte frame")
    if h.intdigest() != header["xxh"]:
        raise ChecksumMismatch(f"{path}: payload checksum mismatch")
    return buf


class DiskTier:
    """Chunk frames in files under one directory, indexed by a byte-bounded ChunkCache."""

    def __init__(self, directory, capacity_bytes: int, policy: str = "s3fifo"):
        check_int(capacity_bytes, "edge disk capacity (bytes)", 1)
        self.dir = make_dirs(Path(directory).absolute())
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise BadRequest(f"edge disk directory {self.dir} is not writable")
        self.capacity = capacity_bytes
        self.index = ChunkCache(capacity_bytes, policy, on_evict=self._evicted)
        self.counters = collections.Counter()
        self._lock = threading.Lock()       # guards counters touched from worker threads
        self.on_change = None               # note(key) on a write, an eviction, a discard
        self.scan()

    def path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / (h + SUFFIX)

    # --- start ------------------------------------------------------------------------------
    def scan(self) -> int:
        """Rebuild the index from the directory (oldest file first, so recency is kept
        roughly); how many records were indexed."""
        found = []
        for sub in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            for p in sub.iterdir():
                if p.name.endswith(TEMP_SUFFIX):
                    self._remove(p, "disk_temp_removed")     # a write a crash cut short
                elif p.name.endswith(SUFFIX):
                    rec = self._check_file(p)
                    if rec is not None:
                        found.append((p.stat().st_mtime_ns, rec))
        for _, rec in sorted(found, key=lambda x: x[0]):
            self.index.put(rec.key, rec, rec.nbytes)
        self._count("disk_scanned", len(found))
        return len(found)

    def _check_file(self, p: Path):
        """The Record of file p, or None after deleting it when its header is bad, its
        length is not the frame's, or its name is not its key."""
        try:
            with open(p, "rb") as f:
                head = f.read(HEADER_READ)
                size = os.fstat(f.fileno()).st_size
            header, off = read_header(head)
            if size != frame_size(header, off):
                raise FrameError(f"{size} bytes, frame says {frame_size(header, off)}")
            if p.name != header["key"].hex() + SUFFIX:
                raise FrameError(f"holds chunk {header['key'].hex()}")
        except FrameError:
            self._remove(p, "disk_dropped_corrupt")
            return None
        except OSError:
            self._count("disk_read_errors")
            return None
        return Record(header["key"], header["ns"], size, header["raw"], header["codec"],
                      header["dtype"])

    # --- reads ------------------------------------------------------------------------------
    def record(self, key: bytes, ns: bytes = None):
        """The Record for key (given ns: held under that namespace), without disk I/O and
        without counting."""
        rec = self.index.peek(key)
        return rec if rec is not None and (ns is None or rec.ns == ns) else None

    def __contains__(self, key) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index)

    def read(self, key: bytes, ns: bytes = None):
        """The chunk of key (a Chunk for raw KV, else an Encoded), verified: its frame's
        checksums, key and namespace. None when absent, of another namespace, or found bad
        (then deleted and counted)."""
        rec = self.index.get(key, None if ns is None else (lambda r: r.ns == ns))
        if rec is None:
            self._count("disk_misses")
            return None
        p = self.path(key)
        try:
            buf = read_frame(p, rec.nbytes)
            obj = decode(buf, verify=False) if rec.codec == "raw" else Encoded.from_frame(buf)
            if obj.key != key or obj.ns != rec.ns:
                raise FrameError(f"record holds chunk {obj.key.hex()}")
        except FrameError:
            self.discard(key)
            self._remove(p, "disk_dropped_corrupt")
            return None
        except OSError:                    # gone under us (evicted meanwhile) or unreadable
            self.discard(key)
            self._count("disk_read_errors")
            return None
        self._count("disk_reads")
        self._count("disk_read_bytes", rec.nbytes)
        return obj

    # --- writes -----------------------------------------------------------------------------
    def write(self, obj) -> bool:
        """Keep obj (a Chunk or an Encoded) on disk; True when it is held after the call.
        Already held: nothing written. No room on the device: dropped and counted."""
        if obj.key in self.index:
            self._count("disk_write_skipped_held")
            return True
        parts = frame_parts(obj)
        size = sum(memoryview(x).nbytes for x in parts)
        if size > self.capacity:
            self._count("disk_rejected")
            return False
        p = self.path(obj.key)
        try:
            write_atomic(p, parts, fsync=False)
        except OSError as e:
            if e.errno not in NO_ROOM:
                self._count("disk_write_errors")
                raise
            self._count("disk_full_dropped")
            return False
        self.index.put(obj.key, Record(obj.key, obj.ns, size, obj.raw, obj.codec, obj.dtype), size)
        self._changed(obj.key)
        self._count("disk_writes")
        self._count("disk_write_bytes", size)
        return True

    def discard(self, key: bytes) -> bool:
        """Forget key and delete its file; True if it was held."""
        held = self.index.discard(key)
        if held:
            self._remove(self.path(key), None)
            self._changed(key)
        return held

    def _evicted(self, key, rec) -> None:
        self._remove(self.path(key), "disk_evicted")
        self._changed(key)

    def _changed(self, key) -> None:
        if self.on_change is not None:
            self.on_change(key)

    def _remove(self, p: Path, counter) -> None:
        try:
            p.unlink(missing_ok=True)
        except OSError:
            self._count("disk_remove_errors")
            return
        if counter:
            self._count(counter)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def snapshot(self) -> dict:
        """The counters, copied under the lock (worker threads update them)."""
        with self._lock:
            return dict(self.counters)

    def stats(self) -> dict:
        s = self.index.stats()
        c = self.snapshot()
        return dict(s, dir=str(self.dir), write_backs=c.get("disk_writes", 0),
                    full_dropped=c.get("disk_full_dropped", 0), counters=c)
