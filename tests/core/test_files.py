"""Durable files (kdn/core/files.py): atomic replacement, private modes, no temp file left."""
import os
import stat

import pytest

from kdn.core import files


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_write_atomic_replaces_and_is_private(tmp_path):
    target = tmp_path / "a" / "b" / "f.bin"
    assert files.write_atomic(target, [b"hello ", memoryview(b"world")]) == 11
    assert target.read_bytes() == b"hello world"
    assert _mode(target) == 0o600
    assert _mode(tmp_path / "a") == 0o700 and _mode(tmp_path / "a" / "b") == 0o700
    files.write_atomic(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "f.bin"
    files.write_atomic(target, b"old")

    def parts():
        yield b"partial"
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(target, parts())
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]
