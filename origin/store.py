"""The origin's durable, content-addressed chunk store and KB manifest registry on local disk.

A chunk is stored as its encoded frame (kdn/chunk.py: header with an xxh3 checksum, then the
KV bytes) under its key: root/chunks/<2 hex>/<32 hex>.kdnc. Storing the frame, not a re-encoding,
means a read can be pushed to an edge or an HTTP client as is, and every read re-verifies
the checksum, so a rotted file raises CorruptChunk and is never served. Because the name is
the content's key, a chunk shared by two KB versions is written once (dedup for free).
With codec= set (kdn.codecs: "zstd" lossless, "q8z"/"q4z" quantized) put() stores frames
compressed, so the disk holds more chunks; every read decodes whatever codec a frame names.

Every file is written the diskcache way: to a temp file in the same directory (suffix
.kdntmp), flushed and fsynced, renamed over its final name, and the directory fsynced. A
crash therefore leaves whole files or temp files, and reopening the store deletes the temp
files. A KB version's manifest (root/manifests/<ns hex>/<name>/<version:010d>.kdnm) is
written last and only once every chunk it lists is stored, so a version is visible exactly
when it is complete; a crashed publish leaves only unreferenced chunks, which collect()
removes. Retiring a version renames its manifest to .retired: its number is never reused
(an edge that cached v3 must never see a different v3), and its chunks become collectable.

One process owns a root. Inside it, a lock serialises manifest commits, retirements and
collection; chunk writes run outside it (same-key writers each use their own temp file and
the rename is atomic), and keys a publisher has put but not yet committed are protected
from a concurrent collect() until it commits or release()s them. Calls block on disk I/O:
an async caller runs them in a thread (asyncio.to_thread).
"""
from __future__ import annotations

import itertools
import os
import re
import threading
from pathlib import Path

from kdn.chunk import MAX_HEADER, Chunk, Encoded, codecs, decode, encode_parts, read_header
from kdn.errors import (ChunkNotFound, CorruptChunk, FrameError, ManifestError, StoreError,
                        VersionNotFound)
from kdn.keys import KEY_BYTES
from kdn.manifest import Manifest, check_name

CHUNK_SUFFIX = ".kdnc"
MANIFEST_SUFFIX = ".kdnm"
RETIRED_SUFFIX = ".retired"
TEMP_SUFFIX = ".kdntmp"
_CHUNK_NAME = re.compile(r"[0-9a-f]{32}\.kdnc")
_VERSION_NAME = re.compile(r"(\d{10})\.(kdnm|retired)")
_NS_DIR = re.compile(r"[0-9a-f]{32}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_key(key) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise StoreError(f"a chunk key is {KEY_BYTES} bytes, got {key!r:.80}")
    return bytes(key)


def _check_ns(ns) -> bytes:
    if not isinstance(ns, (bytes, bytearray, memoryview)) or len(ns) != KEY_BYTES:
        raise StoreError(f"a namespace digest is {KEY_BYTES} bytes, got {ns!r:.80}")
    return bytes(ns)


class ChunkStore:
    """Chunks (as verified frames) and KB manifests under one root directory."""

    def __init__(self, root, fsync: bool = True, codec: str = "raw"):
        if codec not in codecs():
            raise StoreError(f"codec {codec!r} is not registered; known: {', '.join(codecs())}")
        self.root = Path(root)
        self.fsync = fsync
        self.codec = codec        # how put() encodes chunks (kdn.codecs); reads decode any codec
        self._chunks_dir = self.root / "chunks"
        self._manifests_dir = self.root / "manifests"
        self._chunks_dir.mkdir(parents=True, exist_ok=True)
        self._manifests_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._temp_ids = itertools.count()
        self._pending: set = set()   # keys put but not yet referenced by a commit
        self._reads = self._writes = self._dedup = 0
        self._corrupt = 0
        self._cleaned = self._clean_partials()
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

    def _write_temp(self, path: Path, parts):
        """Write parts to a fresh temp file beside path, flushed and fsynced; return (temp, bytes)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}."
                             f"{next(self._temp_ids)}{TEMP_SUFFIX}")
        n = 0
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    n += f.write(part)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
        except OSError as e:     # disk full, quota, I/O error: fail cleanly, leave nothing behind
            tmp.unlink(missing_ok=True)
            raise StoreError(f"cannot write {path.name} under {self.root}: {e.strerror or e} "
                             f"(errno {e.errno}); nothing was stored") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp, n

    def _write_atomic(self, path: Path, parts) -> int:
        """Write parts to path: temp file + fsync, rename over path, fsync the directory."""
        tmp, n = self._write_temp(path, parts)
        os.rename(tmp, path)
        if self.fsync:
            _fsync_dir(path.parent)
        return n

    # --- chunks ------------------------------------------------------------------------
    def put(self, chunk: Chunk) -> bool:
        """Store chunk durably; False (and no write) when its key is already stored."""
        if not isinstance(chunk, Chunk):
            raise StoreError(f"put() takes a Chunk, got {type(chunk).__name__}")
        return self._store(_check_key(chunk.key), lambda: encode_parts(chunk, self.codec))

    def put_frame(self, frame) -> tuple:
        """Verify an encoded frame (checksum included) and store it as is; return (key, written)."""
        try:
            chunk = decode(frame, verify=True)
        except FrameError as e:
            raise StoreError(f"refusing to store an invalid frame of {len(frame)} bytes: {e}") from None
        key = _check_key(chunk.key)
        return key, self._store(key, lambda: [frame])

    def _store(self, key: bytes, parts) -> bool:
        path = self._chunk_path(key)
        with self._lock:
            self._pending.add(key)   # from here on a concurrent collect() leaves this key alone
            if path.exists():
                self._dedup += 1
                return False
        tmp, n = self._write_temp(path, parts())
        with self._lock:
            if path.exists():   # a same-key writer renamed first: identical bytes, keep theirs
                tmp.unlink()
                self._dedup += 1
                return False
            os.rename(tmp, path)
            self._writes += 1
            self._count += 1
            self._bytes += n
        if self.fsync:
            _fsync_dir(path.parent)
        return True

    def _file(self, key: bytes) -> tuple:
        """(key, path, the file's bytes); ChunkNotFound if absent."""
        key = _check_key(key)
        path = self._chunk_path(key)
        try:
            with open(path, "rb") as f:
                return key, path, f.read()
        except FileNotFoundError:
            raise ChunkNotFound(f"chunk {key.hex()} is not stored") from None

    def _read(self, key: bytes):
        key, path, buf = self._file(key)
        try:
            chunk = decode(buf, verify=True)
        except FrameError as e:
            self._note_corrupt()
            raise CorruptChunk(f"chunk {key.hex()} is corrupt in {path}: {e}") from None
        if chunk.key != key:
            self._note_corrupt()
            raise CorruptChunk(f"chunk {key.hex()} is corrupt in {path}: the file holds key {chunk.key.hex()}")
        with self._lock:
            self._reads += 1
        return buf, chunk

    def _note_corrupt(self):
        with self._lock:
            self._corrupt += 1

    def get(self, key: bytes) -> Chunk:
        """The chunk, checksum verified; ChunkNotFound if absent, CorruptChunk if it fails."""
        return self._read(key)[1]

    def get_encoded(self, key: bytes) -> Encoded:
        """The chunk as its stored frame (kdn.chunk.Encoded), to send on in the codec it is
        stored in: header and payload checksums verified, the payload not decoded."""
        key, path, buf = self._file(key)
        try:
            e = Encoded.from_frame(buf)
            e.verify()
        except FrameError as ex:
            self._note_corrupt()
            raise CorruptChunk(f"chunk {key.hex()} is corrupt in {path}: {ex}") from None
        if e.key != key:
            self._note_corrupt()
            raise CorruptChunk(f"chunk {key.hex()} is corrupt in {path}: the file holds key {e.key.hex()}")
        with self._lock:
            self._reads += 1
        return e

    def get_frame(self, key: bytes) -> bytes:
        """The chunk's verified frame bytes, to send on without re-encoding."""
        return self._read(key)[0]

    def has(self, key: bytes) -> bool:
        return self._chunk_path(_check_key(key)).exists()

    def ns_of(self, key: bytes):
        """The namespace digest in the chunk's frame header (None when absent or unreadable)."""
        try:
            with open(self._chunk_path(_check_key(key)), "rb") as f:
                head = f.read(8 + MAX_HEADER)
            return read_header(head)[0]["ns"]
        except (OSError, FrameError):
            return None

    def size_of(self, key: bytes) -> int:
        """Bytes of the chunk's stored frame (0 when absent)."""
        try:
            return self._chunk_path(_check_key(key)).stat().st_size
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
        return self._manifests_dir / _check_ns(ns).hex() / check_name(name, "KB name")

    def _versions(self, kb_dir: Path, retired: bool = False) -> list:
        """Committed version numbers in kb_dir, ascending (retired ones too if asked)."""
        if not kb_dir.is_dir():
            return []
        out = []
        for f in kb_dir.iterdir():
            m = _VERSION_NAME.fullmatch(f.name)
            if m and (retired or m.group(2) == "kdnm"):
                out.append(int(m.group(1)))
        return sorted(out)

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
            used = self._versions(kb_dir, retired=True)
            if manifest.version is None:
                manifest = manifest.with_version((used[-1] if used else 0) + 1)
            elif manifest.version in used:
                raise ManifestError(f"cannot commit {manifest.label()}: version {manifest.version} "
                                    f"already exists (or was retired); versions are never reused")
            new_dir = not kb_dir.exists()
            path = kb_dir / f"{manifest.version:010d}{MANIFEST_SUFFIX}"
            self._write_atomic(path, [manifest.to_bytes()])
            if new_dir and self.fsync:   # make the new ns/name directories themselves durable
                _fsync_dir(kb_dir.parent)
                _fsync_dir(self._manifests_dir)
            self._pending.difference_update(manifest.keys)
            return manifest

    def _load(self, path: Path, ns: bytes, name: str, version: int) -> Manifest:
        try:
            m = Manifest.from_bytes(path.read_bytes())
        except ManifestError as e:
            raise ManifestError(f"manifest file {path} is unreadable: {e}") from None
        if (m.ns, m.name, m.version) != (ns, name, version):
            raise ManifestError(f"manifest file {path} holds {m.label()} (ns {m.ns.hex()}), "
                                f"not {name}@v{version} of ns {ns.hex()}")
        return m

    def manifest(self, ns: bytes, name: str, version: "int | None" = None) -> Manifest:
        """A committed version (the latest when version is None); VersionNotFound if none."""
        kb_dir = self._kb_dir(ns, name)
        versions = self._versions(kb_dir)
        if version is None:
            if not versions:
                raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version")
            version = versions[-1]
        elif version not in versions:
            have = ", ".join(map(str, versions)) or "none"
            raise VersionNotFound(f"KB {name!r} of ns {ns.hex()} has no committed version {version!r} "
                                  f"(committed: {have})")
        return self._load(kb_dir / f"{version:010d}{MANIFEST_SUFFIX}", bytes(ns), name, version)

    def manifests(self, ns: "bytes | None" = None) -> list:
        """Every committed (not retired) version, of one namespace or of all, in (ns, name, version) order."""
        if ns is not None:
            ns_dirs = [self._manifests_dir / _check_ns(ns).hex()]
        else:
            ns_dirs = sorted(d for d in self._manifests_dir.iterdir() if _NS_DIR.fullmatch(d.name))
        out = []
        for ns_dir in ns_dirs:
            if not ns_dir.is_dir():
                continue
            for kb_dir in sorted(ns_dir.iterdir()):
                for v in self._versions(kb_dir):
                    out.append(self._load(kb_dir / f"{v:010d}{MANIFEST_SUFFIX}",
                                          bytes.fromhex(ns_dir.name), kb_dir.name, v))
        return out

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
                _fsync_dir(kb_dir)

    # --- maintenance -------------------------------------------------------------------
    def collect(self) -> dict:
        """Delete chunks no committed version references (and no publisher is still putting)."""
        with self._lock:
            live = set(self._pending)
            for m in self.manifests():
                live.update(m.keys)
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
                        corrupt_detected=self._corrupt, cleaned_partials=self._cleaned,
                        reads=self._reads, writes=self._writes, deduplicated=self._dedup,
                        pending=len(self._pending))
