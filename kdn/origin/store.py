"""The origin's durable, content-addressed chunk store and KB manifest registry.

It keeps its objects in an kdn/origin/objects.py backend: a local directory or an S3-compatible
bucket. Everything below holds on both, because it is written once, above that interface.

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
manifests record per chunk), the publisher adopts it in its manifest, and commit() refuses
a manifest whose checksums are not those of the stored chunks. A corrupt copy is repaired
only with the bytes the committed versions name, so no valid copy is ever reported corrupt
because another machine computed it. With codec= set (kdn.core.codecs: "zstd"
lossless, "q8z"/"q4z" quantized) put() stores frames compressed; reads decode any codec.

Every object is written whole (on disk: temp file, fsync, rename, fsync the folder, files
0600, folders 0700; in a bucket a PUT is whole or absent). A crash therefore leaves whole
objects or temp files, and reopening a directory store deletes the temp files. A KB
version's manifest (manifests/<ns hex>/<name>/<version:010d>.kdnm) is written last and only
once every chunk it lists is stored, so a version is visible exactly when it is complete; a
crashed publish leaves only unreferenced chunks, which collect() removes. The manifest is
written with the backend's create-if-absent (a hard link; a PUT with If-None-Match: *), so
two publishers, even two origin processes over one bucket, never both commit one version:
the loser of an explicit number gets ManifestError, an automatic number takes the next.

Version numbers are never reused (an edge that cached v3 must never see a different v3):
retiring a version sets its manifest aside as .retired, a manifest that fails its checksum is
set aside as .corrupt (quarantined: reported, never served, the KB's other versions and every
other KB still are), and each KB keeps the highest number it ever committed in an object
`last_version`, so even a deleted manifest's number stays taken. (On disk "set aside" is a
rename; in a bucket it is a copy that leaves the .kdnm in place, so its name stays taken for
the conditional write: a version is visible while its .kdnm exists and no .retired or
.corrupt of the same number does.) Retiring a version retires its emphasized copies with it
(kdn.core.emphasis: edits of that version stored under a namespace of their own), and stats()
counts those copies apart from the KBs' versions.

Other cache layers' objects (LMCache's, SGLang's: opaque chunks, kdn.integrations.objects) are
stored the same way, but no manifest will ever name them: collect() tells them by their
frame header (dtype "opaque") and keeps them, across restarts, unless an object TTL is
given; delete_objects() removes a namespace's objects by key (the host layer's delete).
put_chunks() writes a batch and makes it durable together (each file fsynced after all are
written, then each folder once), rather than a file and a folder per chunk.

One process owns a store. Inside it, a lock serialises manifest commits, retirements and
collection; chunk writes run outside it (writers of one key wait for each other, so it is
written once), and keys a publisher has put but not yet committed are protected from a
concurrent collect() until it commits or release()s them. Calls block on I/O: an async
caller runs them in a thread (asyncio.to_thread).
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import re
import threading
import time

from kdn.core.chunk import FRAME_SUFFIX, MAX_HEADER, Chunk, Encoded, decode, encode_parts, read_header
from kdn.core.checks import check_number
from kdn.core.codecs import codecs
from kdn.core.dtypes import OPAQUE
from kdn.core.emphasis import copies_of, is_emphasized
from kdn.core.errors import (ChunkNotFound, CorruptChunk, FrameError, ManifestError, StoreError,
                             VersionNotFound)
from kdn.core.files import make_dirs
from kdn.core.keys import check_key
from kdn.core.manifest import Manifest, check_name
from kdn.origin.conversations import OriginConversations
from kdn.origin.drops import DropLog
from kdn.origin.objects import CORRUPT_SUFFIX, LocalObjects, open_objects

log = logging.getLogger(__name__)

CHUNK_SUFFIX = FRAME_SUFFIX
MANIFEST_SUFFIX = ".kdnm"
RETIRED_SUFFIX = ".retired"
LAST_VERSION = "last_version"     # per KB: the highest version number ever committed
COMMIT_TRIES = 8                  # automatic numbers tried when other publishers take them first
IO_THREADS = 16                   # calls of one map() in flight at once: a bucket answers each in a
                                  # round trip (10-100 ms), so one at a time would be slow
_CHUNK_NAME = re.compile(r"chunks/[0-9a-f]{2}/([0-9a-f]{32})" + re.escape(CHUNK_SUFFIX))
_VERSION_NAME = re.compile(r"(\d{10})\.(kdnm|retired|corrupt)")
_MANIFEST_NAME = re.compile(r"manifests/([0-9a-f]{32})/([^/]+)/(\d{10})\.(kdnm|retired|corrupt)")
# Counted from the start (0 until they happen), so stats() always names them.
COUNTERS = ("reads", "writes", "deduplicated", "repaired", "corrupt_detected",
            "cleaned_partials", "manifests_quarantined", "commit_conflicts", "sums_refused",
            "repairs_refused")
_GONE = object()                  # collect(): the chunk vanished while it looked
SUMS_KEPT = 1 << 18               # stored chunks' checksums remembered (immutable: never stale)


def _key(key) -> bytes:
    return check_key(key, "chunk key", error=StoreError)


def _ns(ns) -> bytes:
    return check_key(ns, "namespace digest", error=StoreError)


def _chunk_name(key: bytes) -> str:
    h = key.hex()
    return f"chunks/{h[:2]}/{h}{CHUNK_SUFFIX}"


def _visible(names) -> list:
    """Committed version numbers among a KB's object names: a .kdnm with no .retired or
    .corrupt of the same number, ascending."""
    found = collections.defaultdict(set)
    for n in names:
        m = _VERSION_NAME.fullmatch(n)
        if m:
            found[m.group(2)].add(int(m.group(1)))
    return sorted(found["kdnm"] - found["retired"] - found["corrupt"])


class ChunkStore:
    """Chunks (as verified frames) and KB manifests in one backend: a root directory, an
    s3://bucket/prefix, or an origin.objects backend."""

    def __init__(self, root, fsync: bool = True, codec: str = "raw"):
        if codec not in codecs():
            raise StoreError(f"codec {codec!r} is not registered; known: {', '.join(codecs())}")
        self.objects = open_objects(root, fsync=fsync)
        self.root = self.objects.where()
        self.fsync = fsync
        self.codec = codec        # how put() encodes chunks (kdn.core.codecs); reads decode any codec
        if isinstance(self.objects, LocalObjects):
            for d in ("chunks", "manifests"):
                make_dirs(self.objects.path(d))
        self._lock = threading.RLock()
        self._writing: dict = {}     # key -> [lock, users]: writers of one key take turns
        self._pending: set = set()   # keys put but not yet referenced by a commit
        self._sums = collections.OrderedDict()   # key -> its stored KV's xxh3_64 (LRU, SUMS_KEPT)
        self._ns_names = {}          # ns hex -> (tenant, fingerprint) it digests (stats, kbs)
        self._io = concurrent.futures.ThreadPoolExecutor(IO_THREADS, thread_name_prefix="store-io")
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self.counters["cleaned_partials"] = self.objects.clean_partials()
        self._count, self._bytes = self._scan_chunks()
        # every key removed is logged here first, for edges that miss the drop (kdn/origin/drops.py)
        self.drops = DropLog(self.objects)
        # pinned tenants' conversation KV and the records naming its keys (kdn/origin/conversations.py)
        self.conversations = OriginConversations(self.objects)

    # --- opening -----------------------------------------------------------------------
    def _scan_chunks(self):
        count = size = 0
        for _, n in self._chunk_objects():
            count += 1
            size += n
        return count, size

    def _chunk_objects(self):
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

    # --- chunks ------------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Store chunk durably; False (and no write) when an intact copy is already stored."""
        return self.put_chunk(chunk)[0]

    def put_chunk(self, chunk: Chunk, durable: bool = True) -> tuple:
        """Store chunk durably: (written, sum), sum the checksum of the bytes now stored under
        its key (the chunk's own, or those already there when the put was deduplicated).
        durable=False leaves the fsync to the caller (put_chunks: one sync for a batch)."""
        if not isinstance(chunk, Chunk):
            raise StoreError(f"put() takes a Chunk, got {type(chunk).__name__}")
        return self._store(_key(chunk.key), lambda: encode_parts(chunk, self.codec), chunk.digest,
                           durable)

    def put_chunks(self, chunks) -> list:
        """put_chunk for each chunk, several at once, made durable together: the files are
        fsynced after all are written, then each folder once (a deduplicated key's file too,
        which a concurrent batch may not have synced yet). [(written, sum)] in order; durable
        when it returns."""
        results = self.map(lambda c: self.put_chunk(c, durable=False), chunks)
        self.objects.sync(dict.fromkeys(_chunk_name(_key(c.key)) for c in chunks), self.map)
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
        key = _key(chunk.key)
        return key, self._store(key, lambda: [frame], chunk.digest)[0]

    def _store(self, key: bytes, parts, digest, durable: bool = True) -> tuple:
        name = _chunk_name(key)
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
        named = {m.sum_of().get(key) for m in self.manifests()} - {None}
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
        key = _key(key)
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
        key = _key(key)
        name = _chunk_name(key)
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
        return self._intact(_key(key))

    def ns_of(self, key: bytes):
        """The namespace digest in the chunk's frame header, without reading the payload (None
        when absent or unreadable): a cheap hint, not a verification."""
        try:
            head = self.objects.head(_chunk_name(_key(key)), 8 + MAX_HEADER)
            return read_header(head)[0]["ns"]
        except (OSError, FrameError):
            return None

    def size_of(self, key: bytes) -> int:
        """Bytes of the chunk's stored frame (0 when absent)."""
        return self.objects.size(_chunk_name(_key(key))) or 0

    def keys(self):
        """Every stored chunk key (a listing; order by hex name)."""
        for key, _ in self._chunk_objects():
            yield key

    @property
    def chunk_count(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    # --- manifests ---------------------------------------------------------------------
    def _kb_prefix(self, ns: bytes, name: str) -> str:
        return f"manifests/{_ns(ns).hex()}/{check_name(name, 'KB name')}/"

    def _kb_names(self, prefix: str) -> list:
        """The names (last path part) of a KB's objects."""
        return [n[len(prefix):] for n, _ in self.objects.list(prefix)]

    def _versions(self, prefix: str) -> list:
        """Committed (not retired, not quarantined) version numbers of a KB, ascending."""
        return _visible(self._kb_names(prefix))

    def _last_used(self, prefix: str) -> int:
        """The highest version number the KB ever took (0 for none): committed, retired,
        quarantined, or recorded in its last_version object though its manifest is gone."""
        files = [int(m.group(1)) for m in map(_VERSION_NAME.fullmatch, self._kb_names(prefix)) if m]
        try:
            recorded = int(self.objects.get(prefix + LAST_VERSION))
        except FileNotFoundError:
            recorded = 0
        except (ValueError, OSError) as e:   # the manifests present still name the numbers used
            log.warning("%s is unreadable (%s); versions are numbered from the manifests present",
                        self.objects.where(prefix + LAST_VERSION), e)
            recorded = 0
        return max([recorded, *files])

    def commit(self, manifest: Manifest) -> Manifest:
        """Make a KB version visible once all its chunks are stored; return it with its version."""
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"commit() takes a Manifest, got {type(manifest).__name__}")
        manifest.check_names()            # a new version's names; stored ones are read as they are
        prefix = self._kb_prefix(manifest.ns, manifest.name)
        self._check_sums(manifest)
        with self._lock:
            keys = list(dict.fromkeys(manifest.keys))
            sizes = self.map(lambda k: self.objects.size(_chunk_name(k)), keys)
            missing = [k for k, n in zip(keys, sizes) if n is None]
            if missing:
                shown = ", ".join(k.hex() for k in missing[:3])
                raise ManifestError(
                    f"cannot commit {manifest.label()}: {len(missing)} of {len(manifest.keys)} chunk(s) "
                    f"are not stored (first: {shown})")
            auto = manifest.version is None
            for _ in range(COMMIT_TRIES):
                last = self._last_used(prefix)
                if auto:
                    manifest = manifest.with_version(last + 1)
                elif manifest.version <= last:
                    raise ManifestError(f"cannot commit {manifest.label()}: version {manifest.version} "
                                        f"already exists or was used before (last: {last}); versions "
                                        f"are never reused")
                name = f"{prefix}{manifest.version:010d}{MANIFEST_SUFFIX}"
                if self.objects.put_new(name, manifest.to_bytes()):
                    break
                self.counters["commit_conflicts"] += 1    # another publisher took this number
                if not auto:
                    raise ManifestError(f"cannot commit {manifest.label()}: another publisher "
                                        f"committed version {manifest.version} first")
            else:
                raise ManifestError(f"cannot commit {manifest.label()}: other publishers took "
                                    f"{COMMIT_TRIES} version numbers in a row; try again")
            # Recorded after the manifest: until then the manifest itself holds the number.
            self.objects.put(prefix + LAST_VERSION, str(manifest.version).encode())
            self._pending.difference_update(manifest.keys)
            return manifest

    def _check_sums(self, manifest: Manifest) -> None:
        """ManifestError unless every checksum the manifest records is that of the chunk
        stored under its key (a key means one byte string: readers verify against these).
        Runs outside the store's lock: its reads run in the I/O threads, which take it."""
        want = manifest.sum_of()
        if not want:
            return
        keys = list(want)
        for k, got in zip(keys, self.map(lambda k: self.sum_of(k, fresh=False), keys)):
            if got is not None and got != want[k]:   # absent: the commit's own check names it
                self.counters["sums_refused"] += 1
                raise ManifestError(
                    f"cannot commit {manifest.label()}: chunk {k.hex()} is stored with checksum "
                    f"{got:016x} but the manifest says {want[k]:016x}; a key means the bytes "
                    f"stored first, so the manifest must carry their checksum (kdn.client.publish adopts it)")

    def _load(self, name: str, ns: bytes, kb: str, version: int) -> Manifest:
        """The manifest in object `name`; one that fails its checksum or holds another version
        is quarantined (set aside as .corrupt, counted, logged) and raises ManifestError."""
        try:
            m = Manifest.from_bytes(self.objects.get(name))
            if (m.ns, m.name, m.version) != (ns, kb, version):
                raise ManifestError(f"it holds {m.label()} (ns {m.ns.hex()}), not {kb}@v{version} "
                                    f"of ns {ns.hex()}")
        except ManifestError as e:
            aside = self._quarantine(name, e)
            raise ManifestError(f"manifest file {self.objects.where(name)} is unreadable: {e}; "
                                f"moved to {aside.rsplit('/', 1)[-1]}") from None
        return m

    def _quarantine(self, name: str, why) -> str:
        aside = name[:-len(MANIFEST_SUFFIX)] + CORRUPT_SUFFIX
        with self._lock:
            if not self.objects.set_aside(name, aside):   # another reader quarantined it first
                return aside
            self.counters["manifests_quarantined"] += 1
        log.error("quarantined corrupt manifest %s as %s: %s", self.objects.where(name),
                  aside.rsplit("/", 1)[-1], why)
        return aside

    def manifest(self, ns: bytes, name: str, version: "int | None" = None) -> Manifest:
        """A committed version (the latest intact one when version is None); VersionNotFound
        if none. A corrupt manifest is quarantined: asked for by number it raises
        ManifestError naming the file, and it is no longer the latest."""
        prefix = self._kb_prefix(ns, name)
        while True:
            versions = self._versions(prefix)
            if version is not None and version not in versions:
                have = ", ".join(map(str, versions)) or "none"
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version "
                                      f"{version!r} (committed: {have})")
            if not versions:
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version")
            if version is not None:
                return self._load(f"{prefix}{version:010d}{MANIFEST_SUFFIX}", bytes(ns), name, version)
            try:
                return self._load(f"{prefix}{versions[-1]:010d}{MANIFEST_SUFFIX}", bytes(ns), name,
                                  versions[-1])
            except (ManifestError, FileNotFoundError):
                continue    # quarantined (or retired meanwhile): the latest intact one is next

    def _manifest_objects(self, ns: "bytes | None" = None) -> dict:
        """{(ns hex, name): [object names]} of every KB's version objects."""
        prefix = "manifests/" + ("" if ns is None else _ns(ns).hex() + "/")
        kbs = collections.defaultdict(list)
        for obj, _ in self.objects.list(prefix):
            m = _MANIFEST_NAME.fullmatch(obj)
            if m:
                kbs[m.group(1), m.group(2)].append(obj.rsplit("/", 1)[-1])
        return kbs

    def manifests(self, ns: "bytes | None" = None, name: "str | None" = None) -> list:
        """Every committed (not retired) version, of one namespace or of all (and of the KBs
        called `name` only, when given), in (ns, name, version) order; emphasized copies
        included (kdn.core.emphasis.own_manifests leaves them out). A corrupt manifest is
        quarantined and left out: the rest are served."""
        out = []
        for (ns_hex, kb), names in sorted(self._manifest_objects(ns).items()):
            if name is not None and kb != name:
                continue
            for v in _visible(names):
                try:
                    out.append(self._load(f"manifests/{ns_hex}/{kb}/{v:010d}{MANIFEST_SUFFIX}",
                                          bytes.fromhex(ns_hex), kb, v))
                except (ManifestError, FileNotFoundError):
                    continue   # quarantined and logged by _load (or retired meanwhile)
        return out

    def quarantined(self) -> list:
        """Quarantined (corrupt) manifests, as ns/name/version.corrupt."""
        return sorted(f"{ns_hex}/{kb}/{n}" for (ns_hex, kb), names in self._manifest_objects().items()
                      for n in names if n.endswith(CORRUPT_SUFFIX))

    def delete_version(self, ns: bytes, name: str, version: int) -> list:
        """Retire a version: no longer visible, its number never reused, its chunks collectable;
        and with it every emphasized copy of it (kdn.core.emphasis.copies_of: an edit of that
        version stored under its own namespace), retired first, so an interrupted retirement
        leaves the version with fewer copies, never a copy without its version. The copies
        retired, as Manifests. A copy's own version is retired like any version."""
        prefix = self._kb_prefix(ns, name)
        with self._lock:
            if version not in self._versions(prefix):
                raise VersionNotFound(f"KB {name!r} of ns {bytes(ns).hex()} has no committed version "
                                      f"{version!r} to delete")
            name_of = f"{prefix}{version:010d}{MANIFEST_SUFFIX}"
            kb = self._load(name_of, bytes(ns), name, version)
            copies = copies_of(self.manifests(name=name), kb)
            for c in copies:
                at = f"{self._kb_prefix(c.ns, c.name)}{c.version:010d}"
                self.objects.set_aside(at + MANIFEST_SUFFIX, at + RETIRED_SUFFIX)
            self.objects.set_aside(name_of, f"{prefix}{version:010d}{RETIRED_SUFFIX}")
            return copies

    # --- maintenance -------------------------------------------------------------------
    def collect(self, object_ttl_s: "float | None" = None, now: "float | None" = None) -> dict:
        """Delete chunks no committed version references (and no publisher is still putting).

        Opaque objects (put_objects: no manifest names them) are live: they stay, unless
        object_ttl_s is given, when those written more than object_ttl_s seconds before now
        go too. Refused (ManifestError, nothing deleted) while a quarantined manifest exists:
        its chunks cannot be told apart, and restoring the file must find them still there."""
        if object_ttl_s is not None:
            object_ttl_s = check_number(object_ttl_s, "object_ttl_s", 0, error=StoreError)
        now = time.time() if now is None else now
        with self._lock:
            live = set(self._pending) | self.conversations.live()
            for m in self.manifests():
                live.update(m.keys)
            held = self.quarantined()
            if held:
                raise ManifestError(f"collect refused: {len(held)} quarantined manifest file(s) "
                                    f"({', '.join(held[:3])}) may reference chunks; restore or "
                                    f"delete them under {self.objects.where('manifests')} first")
            unnamed = [(k, n) for k, n in self._chunk_objects() if k not in live]
            # read in the I/O threads, which never take the lock held here
            kinds = self.map(lambda kn: self._object_age(kn[0], now), unnamed)
            n = size = kept = expired = 0
            doomed = []
            for (key, nbytes), age in zip(unnamed, kinds):
                if age is _GONE:
                    continue
                if age is not None:                  # an opaque object, written age s ago
                    if object_ttl_s is None or age <= object_ttl_s:
                        kept += 1
                        continue
                    expired += 1
                doomed.append((key, nbytes))
            self.drops.append([k for k, _ in doomed])   # logged before any is gone
            for key, nbytes in doomed:
                if self.objects.delete(_chunk_name(key)):
                    size += nbytes
                    n += 1
                    self._sums.pop(key, None)
            self._count -= n
            self._bytes -= size
            return dict(chunks=n, bytes=size, objects_kept=kept, objects_expired=expired)

    def _object_age(self, key: bytes, now: float):
        """Seconds since the opaque object under key was written; None when the chunk is not
        an intact opaque frame's header (garbage like any unreferenced chunk); _GONE when it
        vanished meanwhile. An unreadable one raises (StoreError, OSError): never deleted on
        a guess."""
        name = _chunk_name(key)
        try:
            header, _ = read_header(self.objects.head(name, 8 + MAX_HEADER))
            if header["dtype"] != OPAQUE:
                return None
            when = self.objects.modified(name)
        except FileNotFoundError:
            return _GONE
        except FrameError:
            return None
        return _GONE if when is None else max(0.0, now - when)

    # --- pinned conversations (kdn/origin/conversations.py) -----------------------------------
    def put_conversation(self, tenant: str, ns: bytes, chunks) -> list:
        """Store a pinned conversation's chunks (Chunks of namespace ns) durably and record them
        for (tenant, ns): [(written, sum)] in order. The keys are live (collect keeps them) from
        the put on: pending until the record is written, the record's after. BadRequest when
        the tenant is no longer pinned (kdn/origin/conversations.py record)."""
        ns = _ns(ns)
        bad = next((c for c in chunks if not isinstance(c, Chunk) or c.opaque or c.ns != ns), None)
        if bad is not None:
            raise StoreError(f"put_conversation() takes Chunks of namespace {ns.hex()}, got {bad!r:.80}")
        try:
            results = self.put_chunks(chunks)
            self.conversations.record(tenant, ns, [_key(c.key) for c in chunks])
        finally:     # recorded, or refused (an unpin raced it: collect takes the chunks)
            self.release(c.key for c in chunks)
        return results

    def conversation_prefix(self, tenant: str, ns: bytes, keys) -> list:
        """The longest prefix of keys that records of (tenant, ns) name: another tenant's or
        namespace's keys are never among them."""
        named = self.conversations.keys_of(tenant, _ns(ns))
        keys = [_key(k) for k in keys]
        return keys[:next((i for i, k in enumerate(keys) if k not in named), len(keys))]

    def delete_conversation(self, tenant: str) -> int:
        """Forget a tenant's pinned conversations and delete their chunks, each checked to be
        of the recorded namespace by its frame header. Not logged in the drop log: the home
        edge's copy is the bytes these were (kdn/origin/conversations.py). How many were deleted."""
        n = 0
        with self._lock:
            for ns, keys in self.conversations.forget(tenant).items():
                keys = sorted(keys - self._pending)
                mine = [k for k, k_ns in zip(keys, self.map(self.ns_of, keys)) if k_ns == ns]
                n += sum(self._delete_chunk(k) for k in mine)
        return n

    def _delete_chunk(self, key: bytes) -> bool:
        """Delete one chunk's object and its accounting (under the lock); False if it was gone."""
        size = self.objects.size(_chunk_name(key))
        if size is None or not self.objects.delete(_chunk_name(key)):
            return False
        self._count -= 1
        self._bytes -= size
        self._sums.pop(key, None)
        return True

    def delete_objects(self, keys, ns: bytes) -> list:
        """Delete the opaque objects of namespace ns under keys (a host layer's own delete);
        a key that is not such an object (absent, a KB's chunk, another namespace's) is left
        alone. The keys deleted."""
        ns = _ns(ns)
        keys = list(dict.fromkeys(_key(k) for k in keys))

        def ours(k):
            try:
                header, _ = read_header(self.objects.head(_chunk_name(k), 8 + MAX_HEADER))
            except (FileNotFoundError, FrameError):
                return False
            return header["dtype"] == OPAQUE and header["ns"] == ns
        with self._lock:
            mine = [k for k, m in zip(keys, self.map(ours, keys)) if m]
            self.drops.append(mine)                  # logged before any is gone
            gone = [k for k in mine if self._delete_chunk(k)]
        return gone

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

    def _namespace(self, ns_hex: str, kb: str, version: int) -> "tuple | None":
        """(tenant, fingerprint) a namespace digests, from one of its manifests, read once (a
        digest names one pair forever); None when that manifest is unreadable (quarantined or
        retired meanwhile: asked again next time)."""
        known = self._ns_names.get(ns_hex)
        if known is None:
            try:
                m = self._load(f"manifests/{ns_hex}/{kb}/{version:010d}{MANIFEST_SUFFIX}",
                               bytes.fromhex(ns_hex), kb, version)
            except (ManifestError, FileNotFoundError):
                return None
            known = self._ns_names[ns_hex] = (m.tenant, m.fingerprint)
        return known

    def _listing(self) -> list:
        """[(tenant, fingerprint, name, [visible versions])] of every KB and emphasized copy
        with a visible version (tenant and fingerprint None where no manifest could be read)."""
        out = []
        for (ns_hex, kb), names in sorted(self._manifest_objects().items()):
            visible = _visible(names)
            if visible:
                out.append((*(self._namespace(ns_hex, kb, visible[-1]) or (None, None)), kb, visible))
        return out

    def kbs(self) -> list:
        """The KBs' committed versions, emphasized copies left out (kdn.core.emphasis):
        [{"tenant", "name", "fingerprint", "versions"}] sorted by tenant, name, fingerprint;
        from object names, each namespace's manifest read once."""
        return sorted(({"tenant": t, "name": kb, "fingerprint": fp, "versions": vs}
                       for t, fp, kb, vs in self._listing() if fp is not None and not is_emphasized(fp)),
                      key=lambda d: (d["tenant"], d["name"], d["fingerprint"]))

    def stats(self) -> dict:
        """versions: the KBs' committed versions; emphasized_copies: the emphasized copies of
        them (kdn.core.emphasis), counted apart: a copy is not a KB version."""
        versions = copies = 0
        for _, fp, _, visible in self._listing():
            if fp is not None and is_emphasized(fp):
                copies += len(visible)
            else:
                versions += len(visible)
        with self._lock:
            return dict(chunks=self._count, bytes=self._bytes, versions=versions,
                        emphasized_copies=copies, codec=self.codec, pending=len(self._pending),
                        backend=self.objects.where(), **self.counters)
