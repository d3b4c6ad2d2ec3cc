"""Durable files: write a new file beside the old one, fsync it, rename it over, fsync the folder.

A reader sees the old file or the new one, never a torn one, and once write_atomic returns
the new file survives a power cut. Files are private to their owner (0600; folders 0700):
stores hold tenants' knowledge as token ids and the admin token.

A durable write of DIRECT_MIN_BYTES or more may go around the page cache (direct=True:
O_DIRECT, through one of at most MAX_BOUNCES page-aligned buffers the process keeps and
reuses, or through the page cache while all are in use; the last partial block through the
page cache, as O_DIRECT takes whole blocks only): it is fsynced at once anyway, so caching its
pages buys a reader little, and filling new page-cache memory is what such a write cost most
(on session 42's VM, memory that lay free was given back to the host and paid its faults when
written again: 8 MiB files fsynced at 0.51-0.60 GB/s through the page cache, 1.23-1.33
with O_DIRECT, tools/first_touch.py). A file system that takes no O_DIRECT (tmpfs) is written through the
page cache, and remembered.
"""
import errno
import fcntl
import itertools
import mmap
import os
import threading
from pathlib import Path

TEMP_SUFFIX = ".kdntmp"
FILE_MODE, DIR_MODE = 0o600, 0o700
DIRECT_MIN_BYTES = 1 << 20       # a durable write this large goes around the page cache (direct=True)
DIRECT_BLOCK = 4096              # O_DIRECT's unit here: a page, a multiple of any disk's block
BOUNCE_BYTES = 4 << 20           # an aligned buffer those writes go through
MAX_BOUNCES = 8                  # such buffers a process keeps (32 MiB), reused, the newest first
_ids = itertools.count()
_bounces = []                    # the free ones
_bounces_made = 0
_bounce_lock = threading.Lock()
_no_direct = set()               # devices (st_dev) whose file system refused O_DIRECT


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path) -> Path:
    """path and its missing parents, each created 0700 (mkdir(parents=True) would make the
    parents 0755)."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir(mode=DIR_MODE)
        except FileExistsError:
            pass
    return path


def write_temp(path, parts, fsync: bool = True, direct: bool = False) -> tuple:
    """(temp path, bytes): parts written to a fresh private temp file beside path, flushed
    (and fsynced); with direct, around the page cache where the file system allows (see the
    module). On any error the temp file is removed and the error raised."""
    path = Path(path)
    make_dirs(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_ids)}{TEMP_SUFFIX}")
    n, written = 0, False
    bounce = _take_bounce() if direct else None
    try:
        fd = _open_direct(tmp) if bounce is not None else None
        if fd is not None:
            try:
                n = _write_direct(fd, parts, bounce)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        else:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
            with os.fdopen(fd, "wb") as f:
                for part in parts:
                    n += f.write(part)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
        written = True
    finally:
        if not written:          # whatever stopped it (a full disk, ^C): no temp file left
            tmp.unlink(missing_ok=True)
        if bounce is not None:
            with _bounce_lock:
                _bounces.append(bounce)
    return tmp, n


def _take_bounce():
    """A free aligned buffer (made if fewer than MAX_BOUNCES exist); None while all are in use."""
    global _bounces_made
    with _bounce_lock:
        if _bounces:
            return _bounces.pop()
        if _bounces_made >= MAX_BOUNCES:
            return None
        _bounces_made += 1
    return memoryview(mmap.mmap(-1, BOUNCE_BYTES))        # page-aligned


def _open_direct(tmp: Path):
    """tmp created for writing with O_DIRECT; None where its file system refuses O_DIRECT
    (remembered: the caller writes through the page cache)."""
    dev = os.stat(tmp.parent).st_dev
    if dev in _no_direct or not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, FILE_MODE)
    except OSError as e:
        if e.errno != errno.EINVAL:           # this file system takes no O_DIRECT
            raise
        _no_direct.add(dev)
        return None


def _write_direct(fd: int, parts, bounce: memoryview) -> int:
    """parts written to fd (opened with O_DIRECT) through bounce (aligned, BOUNCE_BYTES):
    whole blocks with O_DIRECT, the last partial block through the page cache; the bytes."""
    fill, total = 0, 0
    for part in parts:
        src = memoryview(part).cast("B")
        off = 0
        while off < len(src):
            k = min(len(src) - off, BOUNCE_BYTES - fill)
            bounce[fill:fill + k] = src[off:off + k]
            fill, off = fill + k, off + k
            if fill == BOUNCE_BYTES:
                _write_all(fd, bounce)
                total, fill = total + fill, 0
    whole = fill // DIRECT_BLOCK * DIRECT_BLOCK
    if whole:
        _write_all(fd, bounce[:whole])
    if fill > whole:             # the tail: O_DIRECT takes whole blocks only
        _buffered(fd)
        _write_all(fd, bounce[whole:fill])
    return total + fill


def _write_all(fd: int, data: memoryview) -> None:
    """All of data written to fd. After a short write (a disk filling up) the rest goes
    through the page cache, which takes any length (the next write then says what failed);
    so does a write O_DIRECT refuses (EINVAL: a file system that opens with it and writes
    without it)."""
    while len(data):
        try:
            n = os.write(fd, data)
        except OSError as e:
            if e.errno != errno.EINVAL or not _buffered(fd):
                raise
            continue
        if n < len(data):
            _buffered(fd)
        data = data[n:]


def _buffered(fd: int) -> bool:
    """fd's O_DIRECT turned off; whether it was on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if not flags & os.O_DIRECT:
        return False
    fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
    return True


def write_atomic(path, parts, fsync: bool = True, direct: bool = False) -> int:
    """Write parts (bytes-like pieces) as path's new contents, atomically; returns bytes
    written. direct: around the page cache where the file system allows (see the module)."""
    if isinstance(parts, (bytes, bytearray, memoryview)):
        parts = [parts]
    tmp, n = write_temp(path, parts, fsync, direct)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(Path(path).parent)
    return n
