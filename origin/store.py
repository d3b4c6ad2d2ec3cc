"""The origin's durable, content-addressed chunk store and KB manifest registry on local disk.

A chunk is stored as its encoded frame (kdn/chunk.py: header with an xxh3 checksum, then the
KV bytes) under its key: root/chunks/<2 hex>/<32 hex>.kdnc. Storing the frame, not a re-encoding,
means a read can be pushed to an edge or an HTTP client as is, and every read re-verifies
the checksum, so a rotted file raises CorruptChunk and is never served. Because the name is
the content's key, a chunk shared by two KB versions is written once (dedup for free). A
chunk counts as stored only while its frame verifies: has() checks it, and put() rewrites a
corrupt copy, so re-publishing a KB repairs it. With codec= set (kdn.codecs: "zstd"
lossless, "q8z"/"q4z" quantized) put() stores frames compressed; reads decode any codec.

Every file is written by kdn.files (temp file beside it, fsync, rename, fsync the folder;
files 0600, folders 0700). A crash therefore leaves whole files or temp files, and reopening
the store deletes the temp files. A KB version's manifest
(root/manifests/<ns hex>/<name>/<version:010d>.kdnm) is written last and only once every
chunk it lists is stored, so a version is visible exactly when it is complete; a crashed
publish leaves only unreferenced chunks, which collect() removes.

Version numbers are never reused (an edge that cached v3 must never see a different v3):
retiring a version renames its manifest to .retired, a manifest that fails its checksum is
renamed to .corrupt (quarantined: reported, never served, the KB's other versions and every
other KB still are), and each KB keeps the highest number it ever committed in a file
`last_version`, so even a deleted manifest file's number stays taken.

One process owns a root. Inside it, a lock serialises manifest commits, retirements and
collection; chunk writes run outside it (same-key writers each use their own temp file and
the rename is atomic), and keys a publisher has put but not yet committed are protected
from a concurrent collect() until it commits or release()s them. Calls block on disk I/O:
an async caller runs them in a thread (asyncio.to_thread).
"""
from __future__ import annotations

import collections
import logging
import os
import re
import threading
from pathlib import Path

from kdn.chunk import MAX_HEADER, Chunk, Encoded, decode, encode_parts, read_header
from kdn.codecs import codecs
from kdn.errors import (ChunkNotFound, CorruptChunk, FrameError, ManifestError, StoreError,
                        VersionNotFound)
from kdn.files import DIR_MODE, TEMP_SUFFIX, fsync_dir, make_dirs, write_atomic, write_temp
from kdn.keys import check_key
from kdn.manifest import Manifest, check_name

log = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kdnc"
MANIFEST_SUFFIX = ".kdnm"
RETIRED_SUFFIX = ".retired"
CORRUPT_SUFFIX = ".corrupt"
LAST_VERSION = "last_version"     # per KB: the highest version number ever committed
_CHUNK_NAME = re.compile(r"[0-9a-f]{32}\.kdnc")
_VERSION_NAME = re.compile(r"(\d{10})\.(kdnm|retired|corrupt)")
_NS_DIR = re.compile(r"[0-9a-f]{32}")
# Counted from the start (0 until they happen), so stats() always names them.
COUNTERS = ("reads", "writes", "deduplicated", "repaired", "corrupt_detected",
            "cleaned_partials", "manifests_quarantined")


def _key(key) -> bytes:
    return check_key(key, "chunk key", error=StoreError)


def _ns(ns) -> bytes:
    return check_key(ns, "namespace digest", error=StoreError)


def _identity(path: Path):
    """What tells one file at path from another (None when there is none)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class ChunkStore:
    """Chunks (as verified frames) and KB manifests under one root directory."""

    def __init__(self, root, fsync: bool = True, codec: str = "raw"):
        if codec not in codecs():
            raise StoreError(f"codec {codec!r} is not registered; known: {', '.join(codecs())}")
        self.root = make_dirs(root)
        os.chmod(self.root, DIR_MODE)    # a store made before files were private: close it now
        self.fsync = fsync
        self.codec = codec        # how put() encodes chunks (kdn.codecs); reads decode any codec
        self._chunks_dir = make_dirs(self.root / "chunks")
        self._manifests_dir = make_dirs(self.root / "manifests")
        self._lock = threading.RLock()
        self._pending: set = set()   # keys put but not yet referenced by a commit
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self.counters["cleaned_partials"] = self._clean_partials()
        self._count, self._bytes = self._scan_chunks()

    # --- opening -----------------------------------------------------------------------
    def _clean_partials(self) -> int:
        """Delete temp files a crashed writer left behind; return how many."""
        n = 0
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                if f.endswith(TEMP_SUFFIX):
                    os.unlink(os.path.join(dirpath, f))
                    n += 1
        return n

    def _scan_chunks(self):
        count = size = 0
        for path in self._chunk_files():
            count += 1
            size += path.stat().st_size
        return count, size

    def _chunk_files(self):
        for sub in sorted(self._chunks_dir.iterdir()):
            if sub.is_dir():
                for path in sorted(sub.iterdir()):
                    if _CHUNK_NAME.fullmatch(path.name):
                        yield path

    # --- files -------------------------------------------------------------------------
    def _chunk_path(self, key: bytes) -> Path:
        h = key.hex()
        return self._chunks_dir / h[:2] / (h + CHUNK_SUFFIX)

    def _write_temp(self, path: Path, parts) -> tuple:
        try:
            return write_temp(path, parts, self.fsync)
        except OSError as e:     # disk full, quota, I/O error: kdn.files left nothing behind
            raise StoreError(f"cannot write {path.name} under {self.root}: {e.strerror or e} "
                             f"(errno {e.errno}); nothing was stored") from None

    def _write_atomic(self, path: Path, data: bytes) -> int:
        try:
            return write_atomic(path, data, self.fsync)
        except OSError as e:
            raise StoreError(f"cannot write {path.name} under {self.root}: {e.strerror or e} "
                             f"(errno {e.errno}); nothing was stored") from None

    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    # --- chunks ------------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Store chunk durably; False (and no write) when an intact copy is already stored."""
        if not isinstance(chunk, Chunk):
            raise StoreError(f"put() takes a Chunk, got {type(chunk).__name__}")
        return self._store(_key(chunk.key), lambda: encode_parts(chunk, self.codec))

    def put_frame(self, frame) -> tuple:
        """Verify an encoded frame (checksum included) and store it as is; return (key, written)."""
        try:
            chunk = decode(frame, verify=True)
        except FrameError as e:
            raise StoreError(f"refusing to store an invalid frame of {len(frame)} bytes: {e}") from None
        key = _key(chunk.key)
        return key, self._store(key, lambda: [frame])

    def _store(self, key: bytes, parts) -> bool:
        path = self._chunk_path(key)
        with self._lock:
            self._pending.add(key)   # from here on a concurrent collect() leaves this key alone
        seen = _identity(path)
        if seen is not None and self._intact(key):
            self._bump("deduplicated")
            return False
        tmp, n = self._write_temp(path, parts())
        with self._lock:
            now = _identity(path)
            if now is not None and now != seen:   # a same-key writer renamed first: keep theirs
                tmp.unlink()
                self.counters["deduplicated"] += 1
                return False
            os.replace(tmp, path)                  # over nothing, or over the corrupt copy seen
            self.counters["writes"] += 1
            if now is None:
                self._count += 1
            else:
                self._bytes -= now[1]
                self.counters["repaired"] += 1
            self._bytes += n
        if self.fsync:
            fsync_dir(path.parent)
        return True

    def _file(self, key: bytes) -> tuple:
        """(key, path, the file's bytes); ChunkNotFound if absent."""
        key = _key(key)
        path = self._chunk_path(key)
        try:
            with open(path, "rb") as f:
                return key, path, f.read()
        except FileNotFoundError:
            raise ChunkNotFound(f"chunk {key.hex()} is not stored") from None

    def _corrupt(self, key, path, why) -> CorruptChunk:
        self._bump("corrupt_detected")
        return CorruptChunk(f"chunk {key.hex()} is corrupt in {path}: {why}")

    def _read(self, key: bytes):
        key, path, buf = self._file(key)
        try:
            chunk = decode(buf, verify=True)
        except FrameError as e:
            raise self._corrupt(key, path, e) from None
        if chunk.key != key:
            raise self._corrupt(key, path, f"the file holds key {chunk.key.hex()}")
        self._bump("reads")
        return buf, chunk

    def get(self, key: bytes) -> Chunk:
        """The chunk, checksum verified; ChunkNotFound if absent, CorruptChunk if it fails."""
        return self._read(key)[1]

    def get_encoded(self, key: bytes) -> Encoded:
        """The chunk as its stored frame (kdn.chunk.Encoded), to send on in the codec it is
        stored in: header and payload checksums verified, the payload not decoded."""
        e = self._checked(key)
        self._bump("reads")
        return e

    def _checked(self, key: bytes) -> Encoded:
        key, path, buf = self._file(key)
        try:
            e = Encoded.from_frame(buf)
            e.verify()
        except FrameError as ex:
            raise self._corrupt(key, path, ex) from None
        if e.key != key:
            raise self._corrupt(key, path, f"the file holds key {e.key.hex()}")
        return e

    def get_frame(self, key: bytes) -> bytes:
        """The chunk's verified frame bytes, to send on without re-encoding."""
        return self._read(key)[0]

    def _intact(self, key: bytes) -> bool:
        """The chunk is stored and its frame verifies (without decoding). A corrupt or
        unreadable copy is counted and reported as absent."""
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
            with open(self._chunk_path(_key(key)), "rb") as f:
                head = f.read(8 + MAX_HEADER)
            return read_header(head)[0]["ns"]
        except (OSError, FrameError):
            return None

    def size_of(self, key: bytes) -> int:
        """Bytes of the chunk's stored frame (0 when absent)."""
        try:
            return self._chunk_path(_key(key)).stat().st_size
        except FileNotFoundError:
            return 0

    def keys(self):
        """Every stored chunk key (a directory scan; order by hex name)."""
        for path in self._chunk_files():
            yield bytes.fromhex(path.name[:32])

    @property
    def chunk_count(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    # --- manifests ---------------------------------------------------------------------
    def _kb_dir(self, ns: bytes, name: str) -> Path:
        return self._manifests_dir / _ns(ns).hex() / check_name(name, "KB name")

    def _versions(self, kb_dir: Path) -> list:
        """Committed (not retired, not quarantined) version numbers in kb_dir, ascending."""
        if not kb_dir.is_dir():
            return []
        return sorted(int(m.group(1)) for m in map(_VERSION_NAME.fullmatch, os.listdir(kb_dir))
                      if m and m.group(2) == "kdnm")

    def _last_used(self, kb_dir: Path) -> int:
        """The highest version number kb_dir's KB ever took (0 for none): committed, retired,
        quarantined, or recorded in its last_version file though its manifest is gone."""
        if not kb_dir.is_dir():
            return 0
        files = [int(m.group(1)) for m in map(_VERSION_NAME.fullmatch, os.listdir(kb_dir)) if m]
        try:
            recorded = int((kb_dir / LAST_VERSION).read_text())
        except FileNotFoundError:
            recorded = 0
        except (ValueError, OSError) as e:   # the manifests on disk still name the numbers used
            log.warning("%s is unreadable (%s); versions are numbered from the manifests present",
                        kb_dir / LAST_VERSION, e)
            recorded = 0
        return max([recorded, *files])

    def commit(self, manifest: Manifest) -> Manifest:
        """Make a KB version visible once all its chunks are stored; return it with its version."""
        if not isinstance(manifest, Manifest):
            raise ManifestError(f"commit() takes a Manifest, got {type(manifest).__name__}")
        kb_dir = self._kb_dir(manifest.ns, manifest.name)
        with self._lock:
            missing = [k for k in dict.fromkeys(manifest.keys) if not self._chunk_path(k).exists()]
            if missing:
                shown = ", ".join(k.hex() for k in missing[:3])
                raise ManifestError(
                    f"cannot commit {manifest.label()}: {len(missing)} of {len(manifest.keys)} chunk(s) "
                    f"are not stored (first: {shown})")
            last = self._last_used(kb_dir)
            if manifest.version is None:
                manifest = manifest.with_version(last + 1)
            elif manifest.version <= last:
                raise ManifestError(f"cannot commit {manifest.label()}: version {manifest.version} "
                                    f"already exists or was used before (last: {last}); versions "
                                    f"are never reused")
            new_dir = not kb_dir.exists()
            for d in (kb_dir.parent, kb_dir):   # one at a time: mkdir(parents=True) ignores mode
                make_dirs(d)
            self._write_atomic(kb_dir / f"{manifest.version:010d}{MANIFEST_SUFFIX}", manifest.to_bytes())
            # Recorded after the manifest: until then the manifest file itself holds the number.
            self._write_atomic(kb_dir / LAST_VERSION, str(manifest.version).encode())
            if new_dir and self.fsync:   # make the new ns/name directories themselves durable
                fsync_dir(kb_dir.parent)
                fsync_dir(self._manifests_dir)
            self._pending.difference_update(manifest.keys)
            return manifest

    def _load(self, path: Path, ns: bytes, name: str, version: int) -> Manifest:
        """The manifest in path; a file that fails its checksum or holds another version is
        quarantined (renamed .corrupt, counted, logged) and raises ManifestError."""
        try:
            m = Manifest.from_bytes(path.read_bytes())
            if (m.ns, m.name, m.version) != (ns, name, version):
                raise ManifestError(f"it holds {m.label()} (ns {m.ns.hex()}), not {name}@v{version} "
                                    f"of ns {ns.hex()}")
        except ManifestError as e:
            aside = self._quarantine(path, e)
            raise ManifestError(f"manifest file {path} is unreadable: {e}; moved to {aside.name}") from None
        return m

    def _quarantine(self, path: Path, why) -> Path:
        aside = path.with_suffix(CORRUPT_SUFFIX)
        with self._lock:
            try:
                os.replace(path, aside)
            except FileNotFoundError:   # another reader quarantined it first
                return aside
            self.counters["manifests_quarantined"] += 1
        if self.fsync:
            fsync_dir(path.parent)
        log.error("quarantined corrupt manifest %s as %s: %s", path, aside.name, why)
        return aside

    def manifest(self, ns: bytes, name: str, version: "int | None" = None) -> Manifest:
        """A committed version (the latest intact one when version is None); VersionNotFound
        if none. A corrupt manifest is quarantined: asked for by number it raises
        ManifestError naming the file, and it is no longer the latest."""
        kb_dir = self._kb_dir(ns, name)
        while True:
            versions = self._versions(kb_dir)
            if version is not None and version not in versions:
                have = ", ".join(map(str, versions)) or "none"
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version "
                                      f"{version!r} (committed: {have})")
            if not versions:
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version")
            if version is not None:
                return self._load(kb_dir / f"{version:010d}{MANIFEST_SUFFIX}", bytes(ns), name, version)
            try:
                return self._load(kb_dir / f"{versions[-1]:010d}{MANIFEST_SUFFIX}", bytes(ns), name,
                                  versions[-1])
            except (ManifestError, FileNotFoundError):
                continue    # quarantined (or retired meanwhile): the latest intact one is next

    def manifests(self, ns: "bytes | None" = None) -> list:
        """Every committed (not retired) version, of one namespace or of all, in (ns, name,
        version) order. A corrupt manifest is quarantined and left out: the rest are served."""
        if ns is not None:
            ns_dirs = [self._manifests_dir / _ns(ns).hex()]
        else:
            ns_dirs = sorted(d for d in self._manifests_dir.iterdir() if _NS_DIR.fullmatch(d.name))
        out = []
        for ns_dir in ns_dirs:
            if not ns_dir.is_dir():
                continue
            for kb_dir in sorted(ns_dir.iterdir()):
                for v in self._versions(kb_dir):
                    try:
                        out.append(self._load(kb_dir / f"{v:010d}{MANIFEST_SUFFIX}",
                                              bytes.fromhex(ns_dir.name), kb_dir.name, v))
                    except (ManifestError, FileNotFoundError):
                        continue   # quarantined and logged by _load (or retired meanwhile)
        return out

    def quarantined(self) -> list:
        """Paths of quarantined (corrupt) manifest files, relative to the manifests folder."""
        return sorted(str(p.relative_to(self._manifests_dir))
                      for p in self._manifests_dir.glob(f"*/*/*{CORRUPT_SUFFIX}"))

    def delete_version(self, ns: bytes, name: str, version: int) -> None:
        """Retire a version: no longer visible, its number never reused, its chunks collectable."""
        kb_dir = self._kb_dir(ns, name)
        with self._lock:
            if version not in self._versions(kb_dir):
                raise VersionNotFound(f"KB {name!r} of ns {bytes(ns).hex()} has no committed version "
                                      f"{version!r} to delete")
            path = kb_dir / f"{version:010d}{MANIFEST_SUFFIX}"
            os.rename(path, path.with_suffix(RETIRED_SUFFIX))
            if self.fsync:
                fsync_dir(kb_dir)

    # --- maintenance -------------------------------------------------------------------
    def collect(self) -> dict:
        """Delete chunks no committed version references (and no publisher is still putting).

        Refused (ManifestError, nothing deleted) while a quarantined manifest exists: its
        chunks cannot be told apart, and restoring the file must find them still there."""
        with self._lock:
            live = set(self._pending)
            for m in self.manifests():
                live.update(m.keys)
            held = self.quarantined()
            if held:
                raise ManifestError(f"collect refused: {len(held)} quarantined manifest file(s) "
                                    f"({', '.join(held[:3])}) may reference chunks; restore or "
                                    f"delete them under {self._manifests_dir} first")
            n = size = 0
            for path in list(self._chunk_files()):
                if bytes.fromhex(path.name[:32]) in live:
                    continue
                size += path.stat().st_size
                path.unlink()
                n += 1
            self._count -= n
            self._bytes -= size
            return dict(chunks=n, bytes=size)

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

    def stats(self) -> dict:
        versions = sum(1 for d, _, fs in os.walk(self._manifests_dir)
                       for f in fs if _VERSION_NAME.fullmatch(f) and f.endswith(MANIFEST_SUFFIX))
        with self._lock:
            return dict(chunks=self._count, bytes=self._bytes, versions=versions, codec=self.codec,
                        pending=len(self._pending), **self.counters)
