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


@pytest.mark.parametrize("sizes", [
    [4096],                                                   # one whole block
    [1],                                                      # a tail only
    [files.DIRECT_BLOCK * 3 + 17],                            # blocks and a tail
    [100, files.BOUNCE_BYTES, files.BOUNCE_BYTES - 99, 5],    # parts across the buffer's edge
    [files.BOUNCE_BYTES * 2],                                 # the buffer filled twice exactly
    [],                                                       # nothing
])
def test_direct_writes_keep_every_byte(tmp_path, sizes):
    parts = [os.urandom(n) for n in sizes]
    target = tmp_path / "d" / "f.bin"
    assert files.write_atomic(target, [memoryview(p) for p in parts], direct=True) == sum(sizes)
    assert target.read_bytes() == b"".join(parts)
    assert _mode(target) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]


def _needs_o_direct(d):
    """Skip unless d's file system opens files with O_DIRECT."""
    try:
        os.close(os.open(d / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as e:
        pytest.skip(f"this tmp dir's file system takes no O_DIRECT ({e.strerror})")
    os.unlink(d / "probe")


def test_direct_writes_open_with_o_direct_where_the_file_system_takes_it(tmp_path, monkeypatch):
    """The temp file is opened with O_DIRECT, and kept so where the file system takes it
    (this machine's tmp dir: ext4 or tmpfs since Linux 6.6); plain writes never are."""
    _needs_o_direct(tmp_path)
    real_open, flags = os.open, []
    monkeypatch.setattr(os, "open", lambda path, f, *a: flags.append(f) or real_open(path, f, *a))
    monkeypatch.setattr(files, "_no_direct", set())
    files.write_atomic(tmp_path / "f.bin", os.urandom(files.DIRECT_BLOCK * 2), direct=True)
    files.write_atomic(tmp_path / "g.bin", os.urandom(files.DIRECT_BLOCK * 2))
    monkeypatch.setattr(files, "_bounces", [])             # every aligned buffer in use:
    monkeypatch.setattr(files, "_bounces_made", files.MAX_BOUNCES)     # through the page cache
    data = os.urandom(files.DIRECT_BLOCK * 2)
    files.write_atomic(tmp_path / "h.bin", data, direct=True)
    assert (tmp_path / "h.bin").read_bytes() == data
    opened = [f for f in flags if f & os.O_CREAT]
    assert [bool(f & os.O_DIRECT) for f in opened] == [True, False, False]
    assert files._no_direct == set() and files._bounces == []


def test_a_file_system_without_o_direct_is_written_through_the_page_cache(tmp_path, monkeypatch):
    """A file system that refuses O_DIRECT (EINVAL at open: tmpfs before Linux 6.6, some
    network file systems) is written through the page cache, whole, and remembered."""
    import errno
    real_open, tried = os.open, []

    def no_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            tried.append(path)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(os, "open", no_direct)
    monkeypatch.setattr(files, "_no_direct", set())
    data = os.urandom(files.DIRECT_BLOCK + 5)
    for name in ("a.bin", "b.bin"):
        assert files.write_atomic(tmp_path / name, data, direct=True) == len(data)
        assert (tmp_path / name).read_bytes() == data
    assert len(tried) == 1 and files._no_direct == {os.stat(tmp_path).st_dev}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "b.bin"]


def test_a_write_o_direct_refuses_goes_through_the_page_cache(tmp_path, monkeypatch):
    """A file system that opens with O_DIRECT and refuses its writes (EINVAL) loses nothing:
    the write goes on through the page cache; other errors are raised as they were."""
    import errno
    import fcntl
    real_write, refused = os.write, []

    def write(fd, data):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)
    _needs_o_direct(tmp_path)
    monkeypatch.setattr(os, "write", write)
    data = os.urandom(files.BOUNCE_BYTES + files.DIRECT_BLOCK + 3)
    assert files.write_atomic(tmp_path / "f.bin", data, direct=True) == len(data)
    assert (tmp_path / "f.bin").read_bytes() == data
    assert refused == [files.BOUNCE_BYTES]           # once: the file went on without O_DIRECT

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        files.write_atomic(tmp_path / "f.bin", data, direct=True)
    assert (tmp_path / "f.bin").read_bytes() == data                 # the old file stands
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]          # no temp file left


def test_origin_objects_write_large_objects_direct_and_small_ones_cached(tmp_path, monkeypatch):
    from kdn.origin.objects import LocalObjects
    seen = []
    real = files.write_temp
    monkeypatch.setattr(files, "write_temp", lambda p, parts, fsync=True, direct=False:
                        seen.append(direct) or real(p, parts, fsync, direct))
    store = LocalObjects(tmp_path / "o")
    big = os.urandom(files.DIRECT_MIN_BYTES)
    assert store.put("big", [big[:10], big[10:]]) == len(big)
    assert store.put("small", b"x" * 100) == 100
    assert LocalObjects(tmp_path / "n", fsync=False).put("big", [big]) == len(big)
    assert seen == [True, False, False]
    assert store.get("big") == big and store.get("small") == b"x" * 100
