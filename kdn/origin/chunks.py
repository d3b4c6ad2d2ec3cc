"""The origin's chunks: content-addressed, durable, every read verified (one job of
kdn/origin/store.py's ChunkStore, beside its manifest registry and its collector).

Chunks live in a kdn/origin/objects.py backend: a local directory or an S3-compatible bucket;
everything below holds on both, because it is written once, above that interface.

A chunk is stored as its encoded frame (kdn/core/chunk.py: header with an xxh3 checksum, then the
KV bytes) under its key: chunks/<2 hex>/<32 hex>.kdnc. Storing the frame, not a re-encoding,
means a read can be pushed to an edge or an HTTP client as is, and every read re-verifies
the checksum, so a rotted object raises CorruptChunk and is never served. Because the name is
the content's key, a chunk shared by two KB versions is written once (dedup for free). A
chunk counts as stored only while its frame verifies: has() checks it, and put() rewrites a
corrupt copy, so re-publishing a KB repairs it.

A key means one byte string, forever. A key names tokens and their prefix, not bytes: two
publishers (two CPUs, two batch shapes, a GPU) can compute KV that differs in its last bits
for the same key. The first bytes stored are the bytes: a later put of other bytes is
deduplicated and answers the stored checksum (sum_of, the xxh3_64 of the stored KV that
manifests record per chunk). A corrupt copy is repaired only with the bytes the committed
versions name (`committed_sums`, the registry's), so no valid copy is ever reported corrupt
because another machine computed it. With codec= set (kdn.core.codecs: "zstd" lossless,
"q8z"/"q4z" quantized) put() stores frames compressed; reads decode any codec.

Every object is written whole (on disk: temp file, fsync, rename, fsync the folder, files
0600, folders 0700; in a bucket a PUT is whole or absent). put_chunks() writes a batch and
makes it durable together (each file fsynced after all are written, then each folder once).
Writers of one key wait for each other (it is written once); keys put but not yet committed
are pending, protected from a concurrent collect until a commit names them or release().
Calls block on I/O: an async caller runs them in a thread (asyncio.to_thread).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import re
import threading

from kdn.core.chunk import FRAME_SUFFIX, MAX_HEADER, Chunk, Encoded, decode, encode_parts, read_header
from kdn.core.codecs import codecs
from kdn.core.errors import ChunkNotFound, CorruptChunk, FrameError, StoreError
from kdn.core.keys import check_key

log = logging.getLogger(__name__)

CHUNK_SUFFIX = FRAME_SUFFIX
IO_THREADS = 16                   # calls of one map() in flight at once: a bucket answers each in a
                                  # round trip (10-100 ms), so one at a time would be slow
_CHUNK_NAME = re.compile(r"chunks/[0-9a-f]{2}/([0-9a-f]{32})" + re.escape(CHUNK_SUFFIX))
SUMS_KEPT = 1 << 18               # stored chunks' checksums remembered (immutable: never stale)


def chunk_key(key) -> bytes:
    return check_key(key, "chunk key", error=StoreError)


def ns_digest(ns) -> bytes:
    return check_key(ns, "namespace digest", error=StoreError)


def chunk_name(key: bytes) -> str:
    h = key.hex()
    return f"chunks/{h[:2]}/{h}{CHUNK_SUFFIX}"


class Chunks:
    """Chunks as verified frames in `objects`. lock and counters are the store's, shared with
    its registry and collector."""

    def __init__(self, objects, lock, counters, codec: str = "raw"):
        if codec not in codecs():
            raise StoreError(f"codec {codec!r} is not registered; known: {', '.join(codecs())}")
        self.objects, self._lock, self.counters = objects, lock, counters
        self.codec = codec        # how put() encodes chunks (kdn.core.codecs); reads decode any codec
        self._writing: dict = {}     # key -> [lock, users]: writers of one key take turns
        self._pending: set = set()   # keys put but not yet referenced by a commit
        self._sums = collections.OrderedDict()   # key -> its stored KV's xxh3_64 (LRU, SUMS_KEPT)
        self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="store-io")
        self._count, self._bytes = self._scan_chunks()
        # key -> checksums committed versions name for it (the registry's; none until it says)
        self.committed_sums = lambda key: set()

    def _scan_chunks(self):
        count = size = 0
        for _, n in self.chunk_objects():
            count += 1
            size += n
        return count, size

    def chunk_objects(self):
        """(key, size) of every stored chunk object, by hex name."""
        for name, size in self.objects.list("chunks/"):
            m = _CHUNK_NAME.fullmatch(name)
            if m:
                yield bytes.fromhex(m.group(1)), size

    def map(self, fn, items) -> list:
        """[fn(x) for x in items], IO_THREADS at a time (the first error raised is raised).
        Called holding the store's lock (a commit, a collect, a delete), on threads of its
        own: the shared pool's may all be busy with reads waiting for that lock, and a
        collect under readers then waited for them forever."""
        items = list(items)
        if len(items) < 2:
            return [fn(x) for x in items]
        if self._lock._is_owned():
            with concurrent.futures.ThreadPoolExecutor(IO_THREADS, "store-io-held") as pool:
                return list(pool.map(fn, items))
        return list(self._io.map(fn, items))

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    @contextlib.contextmanager
    def _turn(self, key: bytes):
        """Writers of one key, one at a time (the others then find it stored)."""
        with self._lock:
            slot = self._writing.setdefault(key, [threading.Lock(), 0])
            slot[1] += 1
        try:
            with slot[0]:
                yield
        finally:
            with self._lock:
                slot[1] -= 1
                if not slot[1]:
                    del self._writing[key]

    def put(self, chunk: Chunk) -> bool:
        """Store chunk durably; False (and no write) when an intact copy is already stored."""
        return self.put_chunk(chunk)[0]

    def put_chunk(self, chunk: Chunk, durable: bool = True) -> tuple:
        """Store chunk durably: (written, sum), sum the checksum of the bytes now stored under
        its key (the chunk's own, or those already there when the put was deduplicated).
        durable=False leaves the fsync to the caller (put_chunks: one sync for a batch)."""
        if not isinstance(chunk, Chunk):
            raise StoreError(f"put() takes a Chunk, got {type(chunk).__name__}")
        return self._store(chunk_key(chunk.key), lambda: encode_parts(chunk, self.codec), chunk.digest,
                           durable)

    def put_chunks(self, chunks) -> list:
        """put_chunk for each chunk, several at once, made durable together: the files are
        fsynced after all are written, then each folder once (a deduplicated key's file too,
        which a concurrent batch may not have synced yet). [(written, sum)] in order; durable
        when it returns."""
        results = self.map(lambda c: self.put_chunk(c, durable=False), chunks)
        self.objects.sync(dict.fromkeys(chunk_name(chunk_key(c.key)) for c in chunks), self.map)
        return results

    def put_objects(self, chunks) -> list:
        """put_chunks for opaque chunks (another cache layer's objects): no manifest will name
        them, so they are not held as pending; collect() keeps them by their frame header."""
        bad = next((c for c in chunks if not (isinstance(c, Chunk) and c.opaque)), None)
        if bad is not None:
            raise StoreError(f"put_objects() takes opaque Chunks, got {bad!r:.80}")
        results = self.put_chunks(chunks)
        self.release(c.key for c in chunks)
        return results

    def put_frame(self, frame) -> tuple:
        """Verify an encoded frame (checksum included) and store it as is; return (key, written)."""
        try:
            chunk = decode(frame, verify=True)
        except FrameError as e:
            raise StoreError(f"refusing to store an invalid frame of {len(frame)} bytes: {e}") from None
        key = chunk_key(chunk.key)
        return key, self._store(key, lambda: [frame], chunk.digest)[0]

    def _store(self, key: bytes, parts, digest, durable: bool = True) -> tuple:
        name = chunk_name(key)
        with self._lock:
            self._pending.add(key)   # from here on a concurrent collect() leaves this key alone
        with self._turn(key):
            seen = self.objects.size(name)
            if seen is not None:
                stored = self.sum_of(key)
                if stored is not None:
                    self._bump("deduplicated")
                    return False, stored
            ours = digest()
            if seen is not None:
                self._check_repair(key, ours)
            n = self.objects.put(name, parts(), durable)   # over nothing, or the corrupt copy seen
            with self._lock:
                self.counters["writes"] += 1
                if seen is None:
                    self._count += 1
                else:
                    self._bytes -= seen
                    self.counters["repaired"] += 1
                self._bytes += n
                self._remember(key, ours)
        return True, ours

    def _check_repair(self, key: bytes, ours: int) -> None:
        """A corrupt copy is replaced only by the bytes committed versions name for the key
        (StoreError otherwise): a key never comes to mean a second byte string."""
        named = self.committed_sums(key)
        if named and ours not in named:
            self._bump("repairs_refused")
            raise StoreError(f"chunk {key.hex()} is corrupt in the store, and committed versions "
                             f"name other bytes for it (checksum {min(named):016x}, these hash to "
                             f"{ours:016x}: KV computed on another machine or batch shape); it is "
                             f"not repaired with other bytes. Retire those versions and collect, "
                             f"or re-publish from the KV they were computed with")

    def _remember(self, key: bytes, xxh: int) -> None:
        with self._lock:
            self._sums[key] = xxh
            self._sums.move_to_end(key)
            while len(self._sums) > SUMS_KEPT:
                self._sums.popitem(last=False)

    def sum_of(self, key: bytes, fresh: bool = True) -> "int | None":
        """The xxh3_64 of the KV stored under key, as manifests record it (Chunk.digest); None
        when absent or corrupt. fresh: verify the stored frame now (else a checksum remembered
        from an earlier read or write is trusted: stored bytes never change). A raw frame's
        payload checksum is the sum; a compressed one is decoded once, then remembered."""
        key = chunk_key(key)
        with self._lock:
            known = self._sums.get(key)
            if known is not None:
                self._sums.move_to_end(key)
        if known is not None and not fresh:
            return known
        try:
            e = self._checked(key)
            xxh = read_header(e.frame)[0]["xxh"] if e.codec == "raw" \
                else known if known is not None else e.decode().digest()
        except (ChunkNotFound, CorruptChunk):
            return None
        except FrameError:   # a lossy frame the store never writes, decoded: as good as corrupt
            self._bump("corrupt_detected")
            return None
        except OSError as ex:   # EIO, permissions: as good as absent, and the operator is told
            log.warning("chunk %s is unreadable: %s", key.hex(), ex)
            self._bump("corrupt_detected")
            return None
        self._remember(key, xxh)
        return xxh

    def _object(self, key: bytes) -> tuple:
        """(key, name, the object's bytes); ChunkNotFound if absent."""
        key = chunk_key(key)
        name = chunk_name(key)
        try:
            return key, name, self.objects.get(name)
        except FileNotFoundError:
            raise ChunkNotFound(f"chunk {key.hex()} is not stored") from None

    def _corrupt(self, key, name, why) -> CorruptChunk:
        self._bump("corrupt_detected")
        with self._lock:
            self._sums.pop(key, None)
        return CorruptChunk(f"chunk {key.hex()} is corrupt in {self.objects.where(name)}: {why}")

    def _read(self, key: bytes):
        key, name, buf = self._object(key)
        try:
            chunk = decode(buf, verify=True)
        except FrameError as e:
            raise self._corrupt(key, name, e) from None
        if chunk.key != key:
            raise self._corrupt(key, name, f"the file holds key {chunk.key.hex()}")
        self._bump("reads")
        return buf, chunk

    def get(self, key: bytes) -> Chunk:
        """The chunk, checksum verified; ChunkNotFound if absent, CorruptChunk if it fails."""
        return self._read(key)[1]

    def get_encoded(self, key: bytes) -> Encoded:
        """The chunk as its stored frame (kdn.core.chunk.Encoded), to send on in the codec it is
        stored in: header and payload checksums verified, the payload not decoded."""
        e = self._checked(key)
        self._bump("reads")
        return e

    def _checked(self, key: bytes) -> Encoded:
        key, name, buf = self._object(key)
        try:
            e = Encoded.from_frame(buf)
            e.verify()
        except FrameError as ex:
            raise self._corrupt(key, name, ex) from None
        if e.key != key:
            raise self._corrupt(key, name, f"the file holds key {e.key.hex()}")
        return e

    def read_frame(self, key: bytes):
        """The chunk's stored frame as it is, unverified (for a reader that checks every frame
        itself: kdn/origin/http.py), None if absent."""
        key = chunk_key(key)
        try:
            buf = self.objects.get(chunk_name(key))
        except FileNotFoundError:
            return None
        self._bump("reads")
        return buf

    def get_frame(self, key: bytes) -> bytes:
        """The chunk's verified frame bytes, to send on without re-encoding."""
        return self._read(key)[0]

    def _intact(self, key: bytes) -> bool:
        """The chunk is stored and its frame verifies (without decoding). A corrupt or
        unreadable file is counted and reported as absent; an unreachable bucket raises
        StoreError (absent would be a guess)."""
        try:
            self._checked(key)
        except (ChunkNotFound, CorruptChunk):
            return False
        except OSError as ex:   # EIO, permissions: as good as absent, and the operator is told
            log.warning("chunk %s is unreadable: %s", key.hex(), ex)
            self._bump("corrupt_detected")
            return False
        return True

    def has(self, key: bytes) -> bool:
        """Whether an intact copy of the chunk is stored. Reads and verifies the frame: a
        corrupt chunk is missing, so a re-publish rewrites it."""
        return self._intact(chunk_key(key))

    def ns_of(self, key: bytes):
        """The namespace digest in the chunk's frame header, without reading the payload (None
        when absent or unreadable): a cheap hint, not a verification."""
        try:
            head = self.objects.head(chunk_name(chunk_key(key)), 8 + MAX_HEADER)
            return read_header(head)[0]["ns"]
        except (OSError, FrameError):
            return None

    def size_of(self, key: bytes) -> int:
        """Bytes of the chunk's stored frame (0 when absent)."""
        return self.objects.size(chunk_name(chunk_key(key))) or 0

    def keys(self):
        """Every stored chunk key (a listing; order by hex name)."""
        for key, _ in self.chunk_objects():
            yield key

    @property
    def chunk_count(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    def delete_chunk(self, key: bytes) -> bool:
        """Delete one chunk's object and its accounting (under the lock); False if it was gone."""
        size = self.objects.size(chunk_name(key))
        if size is None or not self.objects.delete(chunk_name(key)):
            return False
        self.deleted(key, size)
        return True

    def deleted(self, key: bytes, size: int) -> None:
        """Account for a chunk object of `size` bytes deleted (under the lock)."""
        self._count -= 1
        self._bytes -= size
        self._sums.pop(key, None)

    def pending(self) -> set:
        """Keys put but not yet named by a commit (a copy; call under the lock)."""
        return set(self._pending)

    def committed(self, keys) -> None:
        """A commit names keys: no longer pending (under the lock)."""
        self._pending.difference_update(keys)

    def verify(self) -> list:
        """Read and verify every stored chunk; return the keys of those that fail."""
        bad = []
        for key in list(self.keys()):
            try:
                self._read(key)
            except CorruptChunk:
                bad.append(key)
            except ChunkNotFound:   # collected meanwhile
                continue
        return bad

    def release(self, keys=None) -> int:
        """Drop collect() protection from keys put but never committed (all when None).

        For a publisher that gave up: its chunks become collectable without a restart.
        Returns how many keys were released.
        """
        with self._lock:
            if keys is None:
                n = len(self._pending)
                self._pending.clear()
                return n
            keys = {bytes(k) for k in keys}
            n = len(self._pending & keys)
            self._pending -= keys
            return n
