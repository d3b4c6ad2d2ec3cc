"""Durable files: write a new file beside the old one, fsync it, rename it over, fsync the folder.

A reader sees the old file or the new one, never a torn one, and once write_atomic returns
the new file survives a power cut. Files are private to their owner (0600; folders 0700):
stores hold tenants' knowledge as token ids and the admin token.
"""
import itertools
import os
import threading
from pathlib import Path

TEMP_SUFFIX = ".kdntmp"
FILE_MODE, DIR_MODE = 0o600, 0o700
_ids = itertools.count()


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


def write_temp(path, parts, fsync: bool = True) -> tuple:
    """(temp path, bytes): parts written to a fresh private temp file beside path, flushed
    (and fsynced). On any error the temp file is removed and the error raised."""
    path = Path(path)
    make_dirs(path.parent)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_ids)}{TEMP_SUFFIX}")
    n, written = 0, False
    try:
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
    return tmp, n


def write_atomic(path, parts, fsync: bool = True) -> int:
    """Write parts (bytes-like pieces) as path's new contents, atomically; returns bytes written."""
    if isinstance(parts, (bytes, bytearray, memoryview)):
        parts = [parts]
    tmp, n = write_temp(path, parts, fsync)
    try:
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(Path(path).parent)
    return n
