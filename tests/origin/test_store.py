"""The origin's durable chunk store: dedup, verified reads, atomic versions, crash recovery, GC."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kdn.core.chunk import Chunk, encode
from kdn.core.emphasis import emphasis_fingerprint
from kdn.core.errors import (ChunkNotFound, CorruptChunk, ManifestError, StoreError,
                             VersionNotFound)
from kdn.core.manifest import Manifest
from kdn.core.files import TEMP_SUFFIX
from kdn.origin.store import ChunkStore

SHAPE = (2, 2, 2, 16, 8)   # layers, k/v, kv_heads, tokens, head_dim: 2 KiB of bf16


def kv_for(key: bytes) -> np.ndarray:
    """Deterministic bf16 (uint16) KV derived from the key: contents can be re-derived to check."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 2**16, SHAPE, dtype=np.uint16)


def chunks_of(m: Manifest) -> list:
    return [Chunk(k, m.ns, kv_for(k), "bfloat16") for k in m.keys]


def kb(name="handbook", docs=(("a", 0, 1000),), layout="prefix", **kw) -> Manifest:
    return Manifest.build(name, "acme", "fp-1", [(d, np.arange(lo, hi)) for d, lo, hi in docs],
                          layout=layout, chunk_tokens=64, **kw)


def publish(store, m):
    for c in chunks_of(m):
        store.put(c)
    return store.commit(m)


def tree_files(root, suffix):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(suffix)]


def test_put_get_roundtrip_and_dedup(tmp_path):
    s = ChunkStore(tmp_path / "o")
    m = kb()
    cs = chunks_of(m)
    assert [s.put(c) for c in cs] == [True] * len(cs)
    assert [s.put(c) for c in cs] == [False] * len(cs)            # content addressed: no second write
    assert s.chunk_count == len(cs) == 16
    frame = encode(cs[3])
    assert s.bytes == len(frame) * len(cs)
    got = s.get(cs[3].key)
    assert got.equal(cs[3]) and got.dtype == "bfloat16"
    assert s.get_frame(cs[3].key) == frame
    assert s.has(cs[0].key) and set(s.keys()) == {c.key for c in cs}
    path = tmp_path / "o" / "chunks" / cs[0].key.hex()[:2] / (cs[0].key.hex() + ".kdnc")
    assert path.read_bytes() == encode(cs[0])                     # stored exactly as the frame
    st = s.stats()
    assert (st["writes"], st["deduplicated"], st["chunks"], st["reads"]) == (16, 16, 16, 2)
    missing = bytes(16)
    with pytest.raises(ChunkNotFound, match=f"chunk {missing.hex()} is not stored"):
        s.get(missing)
    with pytest.raises(StoreError, match="chunk key must be 16 bytes, got 5 bytes"):
        s.get(b"short")


def test_put_frame_verifies_before_writing(tmp_path):
    s = ChunkStore(tmp_path)
    c = chunks_of(kb())[0]
    frame = encode(c)
    assert s.put_frame(frame) == (c.key, True)
    assert s.put_frame(memoryview(frame)) == (c.key, False)
    other = chunks_of(kb())[1]
    bad = bytearray(encode(other))
    bad[-5] ^= 0x40                                                 # a flipped payload bit
    with pytest.raises(StoreError, match=f"refusing to store an invalid frame of {len(bad)} bytes: "
                                         "payload checksum mismatch"):
        s.put_frame(bytes(bad))
    assert not s.has(other.key) and s.chunk_count == 1
    assert not tree_files(tmp_path, TEMP_SUFFIX)


def test_same_key_from_many_threads_writes_once(tmp_path):
    s = ChunkStore(tmp_path)
    c = chunks_of(kb())[0]
    results = []
    barrier = threading.Barrier(8)

    def go():
        barrier.wait()
        results.append(s.put(c))

    ts = [threading.Thread(target=go) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(results) == [False] * 7 + [True]
    assert s.chunk_count == 1 and s.get(c.key).equal(c)
    assert not tree_files(tmp_path, TEMP_SUFFIX)


def test_commit_assigns_versions_and_manifests_are_listed(tmp_path):
    s = ChunkStore(tmp_path)
    m = kb(meta={"pinned": ["eu"]})
    v1 = publish(s, m)
    assert v1.version == 1 and v1.meta == {"pinned": ["eu"]}
    v2 = publish(s, kb(docs=(("a", 0, 1000), ("b", 5000, 5300))))
    assert v2.version == 2
    assert s.manifest(m.ns, "handbook") == v2
    assert s.manifest(m.ns, "handbook", 1) == v1
    other = publish(s, kb(name="faq", docs=(("q", 9, 99),)))
    assert [x.label() for x in s.manifests()] == ["acme/faq@v1", "acme/handbook@v1", "acme/handbook@v2"]
    assert s.manifests(m.ns) == s.manifests() and s.manifests(bytes(16)) == []
    assert other.version == 1
    # v2 shares every chunk of the unchanged prefix with v1: only the tail was written
    shared = len(set(v1.keys) & set(v2.keys))
    assert shared == 15 and s.chunk_count == len(set(v1.keys) | set(v2.keys) | set(other.keys))
    with pytest.raises(ManifestError, match="cannot commit acme/handbook@v2: version 2 already exists"):
        s.commit(v2)
    assert s.commit(kb().with_version(7)).version == 7
    assert s.commit(kb()).version == 8
    with pytest.raises(VersionNotFound, match=r"KB 'handbook' of ns [0-9a-f]{32} has no committed "
                                              r"version 5 \(committed: 1, 2, 7, 8\)"):
        s.manifest(m.ns, "handbook", 5)
    with pytest.raises(VersionNotFound, match="KB 'nothing' of ns .* has no committed version$"):
        s.manifest(m.ns, "nothing")


def test_commit_refuses_missing_chunks_and_harms_nothing(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb())
    m = kb(docs=(("a", 0, 1000), ("b", 5000, 5300)))
    cs = chunks_of(m)
    for c in cs[:-2]:
        s.put(c)
    with pytest.raises(ManifestError, match=f"cannot commit acme/handbook@v\\?: 2 of 21 chunk\\(s\\) are not "
                                            f"stored \\(first: {cs[-2].key.hex()}"):
        s.commit(m)
    assert s.manifests() == [v1]
    assert all(s.get(k).equal(c) for k, c in zip(v1.keys, chunks_of(v1)))
    with pytest.raises(ManifestError, match="commit\\(\\) takes a Manifest, got dict"):
        s.commit(m.to_dict())
    with pytest.raises(ManifestError, match="KB name must match"):
        s.manifest(m.ns, "../../etc")
    with pytest.raises(StoreError, match="namespace digest must be 16 bytes, got 1 bytes"):
        s.manifest(b"x", "handbook")


def test_delete_version_retires_without_reusing_the_number_and_collect(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb(docs=(("a", 0, 1000),)))
    v2 = publish(s, kb(docs=(("a", 0, 500), ("c", 7000, 7400))))
    only_v1 = set(v1.keys) - set(v2.keys)
    assert s.collect() == dict(chunks=0, bytes=0, objects_kept=0, objects_expired=0)   # all live
    s.delete_version(v1.ns, "handbook", 1)
    with pytest.raises(VersionNotFound, match="no committed version 1 to delete"):
        s.delete_version(v1.ns, "handbook", 1)
    assert s.manifests() == [v2]
    frame_len = len(encode(chunks_of(v1)[0]))
    assert s.collect() == dict(chunks=len(only_v1), bytes=len(only_v1) * frame_len, objects_kept=0,
                               objects_expired=0)
    assert set(s.keys()) == set(v2.keys)
    assert all(s.get(k).equal(c) for k, c in zip(v2.keys, chunks_of(v2)))
    assert publish(s, kb()).version == 3                              # 1 is retired, never reused
    assert ChunkStore(tmp_path).manifest(v1.ns, "handbook").version == 3


def copy_of(m: Manifest, salt: int, version=None, meta=None) -> Manifest:
    """An emphasized copy of m, as kdn.engines.emphasis_variants stores one: its own tokens under a
    fingerprint derived from m's, its meta naming the version it edits."""
    meta = {"emphasis": {"a": salt + 2}, "of": {"kb": m.name, "version": m.version if version is None else version},
            "exact": False} if meta is None else meta
    return Manifest.build(m.name, m.tenant, emphasis_fingerprint(m.fingerprint, bytes([salt]) * 16),
                          [("emphasized", np.arange(20000 + 100 * salt, 20200 + 100 * salt))],
                          chunk_tokens=64, meta=meta)


def test_a_versions_emphasized_copies_are_retired_with_it_and_counted_apart(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb())
    v2 = publish(s, kb(docs=(("a", 0, 500), ("c", 7000, 7400))))
    of_v1 = [publish(s, copy_of(v1, i)) for i in range(3)]
    of_v2 = publish(s, copy_of(v2, 9))
    other = publish(s, Manifest.build("handbook", "zeta", "fp-1", [("z", np.arange(0, 300))], chunk_tokens=64))
    assert [m.version for m in of_v1] == [1, 1, 1]               # one edit, one namespace, its v1
    assert s.manifests(name="faq") == [] and set(s.manifests(name="handbook")) == {v1, v2, other, of_v2, *of_v1}
    st = s.stats()
    assert (st["versions"], st["emphasized_copies"]) == (3, 4)
    assert s.kbs() == [{"tenant": "acme", "name": "handbook", "fingerprint": "fp-1", "versions": [1, 2]},
                       {"tenant": "zeta", "name": "handbook", "fingerprint": "fp-1", "versions": [1]}]
    assert sorted(c.fingerprint for c in s.delete_version(v1.ns, "handbook", 1)) == \
        sorted(c.fingerprint for c in of_v1)
    assert set(s.manifests()) == {v2, of_v2, other}             # v2's copy and zeta's KB stay
    assert s.delete_version(other.ns, "handbook", 1) == []
    reopened = ChunkStore(tmp_path)                              # retired on disk, not in memory
    assert set(reopened.manifests()) == {v2, of_v2}
    assert (reopened.stats()["versions"], reopened.stats()["emphasized_copies"]) == (1, 1)
    assert reopened.kbs() == [{"tenant": "acme", "name": "handbook", "fingerprint": "fp-1", "versions": [2]}]
    gone = reopened.collect()["chunks"]
    assert gone and set(reopened.keys()) == set(v2.keys) | set(of_v2.keys)
    assert [c.fingerprint for c in reopened.delete_version(v2.ns, "handbook", 2)] == [of_v2.fingerprint]
    assert reopened.manifests() == [] and reopened.stats()["emphasized_copies"] == 0


def test_corrupt_chunk_is_never_served(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb())
    victim = v1.keys[5]
    path = tmp_path / "chunks" / victim.hex()[:2] / (victim.hex() + ".kdnc")
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptChunk, match=f"chunk {victim.hex()} is corrupt in {path}: payload checksum mismatch"):
        s.get(victim)
    with pytest.raises(CorruptChunk):
        s.get_frame(victim)
    with pytest.raises(CorruptChunk, match="payload checksum mismatch"):
        s.get_encoded(victim)                        # checked without decoding, still caught
    assert s.verify() == [victim]
    # A whole, valid frame of another key under this name is corrupt too.
    path.write_bytes(encode(chunks_of(v1)[6]))
    with pytest.raises(CorruptChunk, match=f"the file holds key {v1.keys[6].hex()}"):
        s.get(victim)
    assert s.stats()["corrupt_detected"] == 5
    assert s.get(v1.keys[4]).equal(chunks_of(v1)[4])


def test_corrupt_manifest_is_quarantined_named_and_blocks_collection(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb())
    (mpath,) = tree_files(tmp_path / "manifests", ".kdnm")
    raw = bytearray(open(mpath, "rb").read())
    raw[40] ^= 0xFF
    open(mpath, "wb").write(bytes(raw))
    with pytest.raises(ManifestError, match=f"manifest file {mpath} is unreadable: manifest checksum "
                                            f"mismatch.*; moved to 0000000001.corrupt"):
        s.manifest(v1.ns, "handbook", 1)
    assert not os.path.exists(mpath) and os.path.exists(mpath[:-len(".kdnm")] + ".corrupt")
    with pytest.raises(VersionNotFound, match="has no committed version$"):
        s.manifest(v1.ns, "handbook")
    assert s.manifests() == [] and s.stats()["manifests_quarantined"] == 1
    assert s.quarantined() == [f"{v1.ns.hex()}/handbook/0000000001.corrupt"]
    with pytest.raises(ManifestError, match="collect refused: 1 quarantined manifest file"):
        s.collect()                                  # cannot tell what is live: delete nothing
    assert s.chunk_count == len(v1.keys) and len(list(s.keys())) == len(v1.keys)
    assert publish(s, kb()).version == 2             # the quarantined number stays taken


def test_uncommitted_puts_survive_collect_until_the_process_is_gone(tmp_path):
    s = ChunkStore(tmp_path)
    m = kb()
    for c in chunks_of(m):
        s.put(c)
    assert s.collect()["chunks"] == 0 and s.stats()["pending"] == 16   # a publish in progress
    assert s.release(m.keys[:4]) == 4 and s.collect()["chunks"] == 4    # that publisher gave up on 4
    assert s.stats()["pending"] == 12 and s.stats()["versions"] == 0
    reopened = ChunkStore(tmp_path)                                     # the publisher is gone
    assert reopened.collect()["chunks"] == 12 and reopened.chunk_count == 0


CHILD = textwrap.dedent('''
    import os, stat, sys, time
    import numpy as np
    sys.path.insert(0, os.environ["KDN_TEST_DIR"])
    from test_store import chunks_of, kb
    from kdn.origin.store import ChunkStore

    root, point = sys.argv[1], sys.argv[2]
    store = ChunkStore(root)
    for c in chunks_of(kb(docs=(("a", 0, 1000),))):
        store.put(c)
    store.commit(kb(docs=(("a", 0, 1000),)))
    print("V1", flush=True)

    real_fsync, files = os.fsync, [0]
    hang_at = {"chunk": 3, "manifest": None}[point]
    v2 = kb(docs=(("a", 0, 1000), ("b", 5000, 6000)))
    new = [k for k in v2.keys if not store.has(k)]
    hang_at = hang_at or len(new) + 1          # the manifest is the file after the new chunks

    def fsync(fd):
        if stat.S_ISREG(os.fstat(fd).st_mode):
            files[0] += 1
            if files[0] == hang_at:
                print("HANG", flush=True)
                time.sleep(600)
        real_fsync(fd)

    os.fsync = fsync
    for c in chunks_of(v2):
        store.put(c)
    store.commit(v2)
    print("DONE", flush=True)
''')


@pytest.mark.parametrize("point", ["chunk", "manifest"])
def test_crash_mid_publish_leaves_previous_versions_whole(tmp_path, point):
    root = tmp_path / "origin"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, KDN_TEST_DIR=os.path.dirname(__file__))
    proc = subprocess.Popen([sys.executable, str(script), str(root), point], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "V1"
        assert proc.stdout.readline().strip() == "HANG"
        temps = tree_files(root, TEMP_SUFFIX)
        assert len(temps) == 1                         # killed with a write half done
        kind = ".kdnm." if point == "manifest" else ".kdnc."
        assert kind in os.path.basename(temps[0]) and temps[0].endswith(TEMP_SUFFIX)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    v1_manifest = kb(docs=(("a", 0, 1000),))
    s = ChunkStore(root)
    assert s.stats()["cleaned_partials"] == 1 and not tree_files(root, TEMP_SUFFIX)
    (only,) = s.manifests()
    assert only.version == 1 and only.keys == v1_manifest.keys
    assert s.manifest(only.ns, "handbook").version == 1     # the half-written v2 is not visible
    with pytest.raises(VersionNotFound):
        s.manifest(only.ns, "handbook", 2)
    assert all(s.get(k).equal(c) for k, c in zip(only.keys, chunks_of(v1_manifest)))
    assert s.verify() == []
    v2 = kb(docs=(("a", 0, 1000), ("b", 5000, 6000)))
    new = set(v2.keys) - set(only.keys)
    orphans = 2 if point == "chunk" else len(new)            # v2's chunks that made it to disk
    assert len(new) == 17 and s.chunk_count == len(only.keys) + orphans
    assert s.collect()["chunks"] == orphans
    assert set(s.keys()) == set(only.keys)
    assert publish(s, v2).version == 2                       # a retried publish succeeds
    assert s.verify() == [] and len(s.manifests()) == 2


def test_a_full_disk_fails_the_write_cleanly_and_harms_nothing(tmp_path, monkeypatch):
    """ENOSPC in the middle of a publish: a clear StoreError, no temp file, old versions intact."""
    import errno
    import numpy as np
    from kdn.core.chunk import Chunk
    from kdn.core.errors import StoreError
    from kdn.core.manifest import Manifest
    import kdn.origin.store as store_mod

    store = store_mod.ChunkStore(tmp_path)
    toks = list(range(300))
    m = Manifest.build("kb", "t", "fp", [("d", toks)])
    rng = np.random.default_rng(0)
    chunks = [Chunk(k, m.ns, rng.standard_normal((2, 2, 2, n, 8)).astype(np.float32), "float32")
              for k, n in zip(m.keys, (256, 44))]
    for c in chunks:
        store.put(c)
    v1 = store.commit(m)

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)   # kdn.core.files fsyncs every write
    m2 = Manifest.build("kb", "t", "fp", [("d", list(range(1000, 1300)))])
    c2 = Chunk(m2.keys[0], m2.ns, np.ones((2, 2, 2, 256, 8), np.float32), "float32")
    with pytest.raises(StoreError, match="No space left on device"):
        store.put(c2)
    monkeypatch.undo()
    assert not store.has(c2.key)
    assert not list(tmp_path.rglob("*.kdntmp")), "no temp file may be left behind"
    reopened = store_mod.ChunkStore(tmp_path)
    assert reopened.manifest(m.ns, "kb").version == v1.version
    assert all(reopened.get(c.key).equal(c) for c in chunks) and reopened.verify() == []
    assert reopened.put(c2)                       # with space again, the retry stores it


def test_a_compressed_store_hands_out_its_frames_as_stored(tmp_path):
    s = ChunkStore(tmp_path, codec="zstd")
    v1 = publish(s, kb())
    e = s.get_encoded(v1.keys[0])
    assert e.codec == "zstd" and e.exact and e.key == v1.keys[0]
    assert e.decode().equal(s.get(v1.keys[0]))
    with pytest.raises(ChunkNotFound):
        s.get_encoded(b"\x01" * 16)


def chunk_file(root, key):
    return root / "chunks" / key.hex()[:2] / (key.hex() + ".kdnc")


def flip_byte(path, at=-100):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_corrupt_chunk_is_missing_and_a_second_put_repairs_it(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb())
    cs = chunks_of(v1)
    victim = cs[5]
    flip_byte(chunk_file(tmp_path, victim.key))
    assert [s.has(k) for k in v1.keys] == [i != 5 for i in range(len(v1.keys))]
    assert s.ns_of(v1.keys[4]) == v1.ns and s.ns_of(bytes(16)) is None
    bytes_before = s.bytes
    assert [s.put(c) for c in cs] == [i == 5 for i in range(len(cs))]   # only the corrupt one is rewritten
    assert s.get(victim.key).equal(victim) and s.verify() == []
    st = s.stats()
    assert (st["repaired"], st["chunks"], st["bytes"]) == (1, len(cs), bytes_before)
    assert st["corrupt_detected"] >= 1
    # A missing file and an unreadable one are missing too.
    chunk_file(tmp_path, cs[6].key).unlink()
    chunk_file(tmp_path, cs[7].key).write_bytes(b"KDNC")
    assert not s.has(cs[6].key) and not s.has(cs[7].key)


def other_bytes(c: Chunk) -> Chunk:
    """The same key with KV that differs in one last bit, as another CPU or batch shape computes it."""
    kv = c.kv.copy()
    kv.reshape(-1)[0] ^= 1
    return Chunk(c.key, c.ns, kv, c.dtype)


def with_sums(m: Manifest, cs) -> Manifest:
    import dataclasses
    return dataclasses.replace(m, sums=tuple(c.digest() for c in cs))


@pytest.mark.parametrize("codec", ["raw", "zstd"])
def test_a_key_keeps_the_bytes_stored_first_and_commit_refuses_other_checksums(tmp_path, codec):
    s = ChunkStore(tmp_path, codec=codec)
    m = kb()
    first = chunks_of(m)
    second = [other_bytes(c) for c in first]
    assert all(a.digest() != b.digest() for a, b in zip(first, second))
    assert [s.put_chunk(c) for c in first] == [(True, c.digest()) for c in first]
    # another publisher's bytes are deduplicated and answered with the stored checksum
    assert [s.put_chunk(c) for c in second] == [(False, c.digest()) for c in first]
    assert all(s.get(c.key).equal(c) for c in first), "the bytes stored first stay"
    assert [s.sum_of(k) for k in m.keys] == [c.digest() for c in first]
    s2 = ChunkStore(tmp_path, codec=codec)     # a restarted origin computes them from the frames
    assert [s2.sum_of(k) for k in m.keys] == [c.digest() for c in first]
    assert s2.sum_of(bytes(16)) is None
    with pytest.raises(ManifestError, match=r"chunk [0-9a-f]{32} is stored with checksum "
                                            r"[0-9a-f]{16} but the manifest says [0-9a-f]{16}; a key "
                                            r"means the bytes stored first"):
        s.commit(with_sums(m, second))
    assert s.manifests() == [] and s.stats()["sums_refused"] == 1
    v1 = s.commit(with_sums(m, first))
    assert v1.version == 1 and v1.sums == tuple(c.digest() for c in first)


def test_a_corrupt_chunk_is_repaired_only_with_the_bytes_committed_versions_name(tmp_path):
    s = ChunkStore(tmp_path)
    m = kb()
    cs = chunks_of(m)
    for c in cs:
        s.put(c)
    s.commit(with_sums(m, cs))
    flip_byte(chunk_file(tmp_path, cs[3].key))
    assert s.sum_of(cs[3].key) is None                   # corrupt: absent, so it is sent again
    with pytest.raises(StoreError, match=r"committed versions name other bytes for it"):
        s.put_chunk(other_bytes(cs[3]))
    assert s.stats()["repairs_refused"] == 1 and not s.has(cs[3].key)
    assert s.put_chunk(cs[3]) == (True, cs[3].digest())   # the named bytes repair it
    assert s.get(cs[3].key).equal(cs[3]) and s.verify() == []


def test_many_writers_repair_a_corrupt_chunk_once(tmp_path):
    s = ChunkStore(tmp_path)
    c = chunks_of(kb())[0]
    s.put(c)
    flip_byte(chunk_file(tmp_path, c.key))
    results, barrier = [], threading.Barrier(8)

    def go():
        barrier.wait()
        results.append(s.put(c))

    ts = [threading.Thread(target=go) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(results) == [False] * 7 + [True]
    assert s.get(c.key).equal(c) and s.chunk_count == 1 and s.stats()["repaired"] == 1
    assert not tree_files(tmp_path, TEMP_SUFFIX)


def test_one_corrupt_manifest_leaves_every_other_version_and_kb_served(tmp_path):
    s = ChunkStore(tmp_path)
    v1 = publish(s, kb())
    v2 = publish(s, kb(docs=(("a", 0, 1000), ("b", 5000, 5300))))
    faq = publish(s, kb(name="faq", docs=(("q", 9, 99),)))
    other = Manifest.build("handbook", "zeta", "fp-1", [("z", np.arange(0, 300))], chunk_tokens=64)
    other = publish(s, other)
    v2_path = [p for p in tree_files(tmp_path / "manifests", ".kdnm") if p.endswith("0000000002.kdnm")][0]
    flip_byte(Path(v2_path), at=60)
    reopened = ChunkStore(tmp_path)                     # an origin restart
    served = reopened.manifests()
    assert sorted(m.label() for m in served) == ["acme/faq@v1", "acme/handbook@v1", "zeta/handbook@v1"]
    assert set(served) == {v1, faq, other}
    assert reopened.manifest(v1.ns, "handbook") == v1   # the latest intact version is served
    assert reopened.manifests(v1.ns) == [m for m in reopened.manifests() if m.ns == v1.ns]
    assert reopened.stats()["manifests_quarantined"] == 1 and reopened.stats()["versions"] == 3
    assert len(reopened.quarantined()) == 1
    assert publish(reopened, kb(docs=(("a", 0, 1000), ("b", 5000, 5300)))).version == 3


def test_a_deleted_manifest_file_does_not_free_its_version_number(tmp_path):
    s = ChunkStore(tmp_path)
    publish(s, kb())
    v2 = publish(s, kb(docs=(("a", 0, 1000), ("b", 5000, 5300))))
    (tmp_path / "manifests" / v2.ns.hex() / "handbook" / "0000000002.kdnm").unlink()
    v3 = publish(ChunkStore(tmp_path), kb(docs=(("a", 0, 1000), ("c", 7000, 7100))))
    assert v3.version == 3 and v3.keys != v2.keys      # never a different v2
    with pytest.raises(ManifestError, match="version 2 already exists or was used before \\(last: 3\\)"):
        s.commit(kb().with_version(2))


def test_store_files_are_private(tmp_path):
    root = tmp_path / "o"
    s = ChunkStore(root)
    v1 = publish(s, kb())
    modes = {p: os.stat(p).st_mode & 0o777 for p in [str(root)] + [os.path.join(d, x) for d, ds, fs in os.walk(root)
                                                                    for x in ds + fs]}
    files = [p for p in modes if os.path.isfile(p)]
    assert len(files) == len(v1.keys) + 3                # chunks, the manifest, last_version, drops/log-id
    assert {modes[p] for p in files} == {0o600}
    assert {modes[p] for p in modes if os.path.isdir(p)} == {0o700}


# --- the same store over an S3 bucket (a real S3 server on loopback: the `bucket` fixture) ---
def s3_store(bucket, **kw):
    from kdn.origin.objects import open_objects
    return ChunkStore(open_objects(bucket.url, env=bucket.env), **kw)


def test_an_s3_store_publishes_dedups_verifies_retires_and_collects(bucket):
    s = s3_store(bucket, codec="zstd")
    v1 = publish(s, kb())
    v2 = publish(s, kb(docs=(("a", 0, 1000), ("b", 5000, 5300))))
    assert (v1.version, v2.version) == (1, 2)
    assert [s.put(c) for c in chunks_of(v1)] == [False] * len(v1.keys)       # dedup
    again = s3_store(bucket)                    # a new process over the same bucket sees it all
    assert [m.version for m in again.manifests()] == [1, 2] and again.manifest(v1.ns, "handbook") == v2
    assert all(again.get(c.key).equal(c) for c in chunks_of(v2)) and again.verify() == []
    assert again.chunk_count == s.chunk_count and again.bytes == s.bytes > 0
    assert again.get_encoded(v1.keys[0]).codec == "zstd" and again.ns_of(v1.keys[0]) == v1.ns
    again.delete_version(v1.ns, "handbook", 2)
    names = [n for n, _ in again.objects.list(f"manifests/{v1.ns.hex()}/handbook/")]
    assert [n.rsplit("/", 1)[1] for n in names] == ["0000000001.kdnm", "0000000002.kdnm",
                                                    "0000000002.retired", "last_version"]
    assert [m.version for m in again.manifests()] == [1] and again.stats()["versions"] == 1
    obj = Chunk(bytes(16), v1.ns, np.arange(256, dtype=np.uint8), "opaque")
    assert again.put_objects([obj]) == [(True, obj.digest())]
    gone = again.collect()
    assert gone["chunks"] == len(set(v2.keys) - set(v1.keys)) and again.verify() == []
    assert gone["objects_kept"] == 1 and again.get(obj.key).kv.tobytes() == obj.kv.tobytes()
    assert again.collect(object_ttl_s=60, now=time.time() + 120)["objects_expired"] == 1
    assert publish(again, kb(docs=(("c", 0, 100),))).version == 3     # 2 is never reused


def test_a_corrupt_object_in_the_bucket_is_never_served_and_is_repaired(bucket):
    s = s3_store(bucket)
    v1 = publish(s, kb())
    name = f"chunks/{v1.keys[3].hex()[:2]}/{v1.keys[3].hex()}.kdnc"
    raw = bytearray(s.objects.get(name))
    raw[-100] ^= 1
    s.objects.put(name, bytes(raw))
    assert not s.has(v1.keys[3])
    with pytest.raises(CorruptChunk, match=f"is corrupt in {bucket.url}/{name}: payload checksum"):
        s.get(v1.keys[3])
    assert s.verify() == [v1.keys[3]]
    assert s.put(chunks_of(v1)[3]) and s.verify() == [] and s.stats()["repaired"] == 1
    mname = f"manifests/{v1.ns.hex()}/handbook/0000000001.kdnm"
    raw = bytearray(s.objects.get(mname))
    raw[40] ^= 0xFF
    s.objects.put(mname, bytes(raw))
    with pytest.raises(ManifestError, match=f"manifest file {bucket.url}/{mname} is unreadable.*"
                                            f"moved to 0000000001.corrupt"):
        s.manifest(v1.ns, "handbook", 1)
    assert s.manifests() == [] and s.quarantined() == [f"{v1.ns.hex()}/handbook/0000000001.corrupt"]
    with pytest.raises(ManifestError, match="collect refused"):
        s.collect()
    assert publish(s, kb()).version == 2


def test_two_publishers_over_one_bucket_never_commit_the_same_version(bucket):
    """Two origin processes (two stores) over one bucket: the manifest's conditional PUT lets
    one take a number; the other gets a clear error (an explicit number) or the next one."""
    a, b = s3_store(bucket), s3_store(bucket)
    base = kb()
    for c in chunks_of(base):
        a.put(c)
    ms = [kb(docs=(("a", 0, 1000), (f"d{i}", 9000 + 100 * i, 9050 + 100 * i))) for i in range(8)]
    for m in ms:
        for c in chunks_of(m):
            a.put(c)
    results, barrier = [], threading.Barrier(2)

    def explicit(store, m):
        barrier.wait()
        try:
            results.append(store.commit(m.with_version(1)).keys)
        except ManifestError as e:
            results.append(str(e))

    ts = [threading.Thread(target=explicit, args=(st, m)) for st, m in ((a, ms[0]), (b, ms[1]))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    won = [r for r in results if not isinstance(r, str)]
    lost = [r for r in results if isinstance(r, str)]
    assert len(won) == 1 and len(lost) == 1 and a.manifest(base.ns, "handbook", 1).keys == won[0]
    assert "another publisher committed version 1 first" in lost[0] or "was used before" in lost[0]
    committed, barrier = [], threading.Barrier(6)

    def auto(store, m):
        barrier.wait()
        committed.append((store.commit(m).version, m.keys))

    ts = [threading.Thread(target=auto, args=((a, b)[i % 2], ms[2 + i])) for i in range(6)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(v for v, _ in committed) == [2, 3, 4, 5, 6, 7]
    for v, keys in committed:                          # each number holds its own publisher's KB
        assert b.manifest(base.ns, "handbook", v).keys == keys


def test_a_refusing_or_silent_bucket_fails_the_publish_and_shows_nothing(bucket):
    from kdn.origin.objects import S3Objects
    good = s3_store(bucket)
    v1 = publish(good, kb())
    m2 = kb(docs=(("a", 0, 1000), ("z", 7000, 7300)))
    for c in chunks_of(m2)[:5]:
        good.put(c)                                    # half a publish reached the bucket
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        dead = S3Objects("kdn-origin", bucket.url.split("/", 3)[3],
                         {**bucket.env, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{silent.getsockname()[1]}"},
                         timeout_s=0.5, retries=0)
        with pytest.raises(StoreError, match=f"bucket {bucket.url}: cannot list chunks/"):
            ChunkStore(dead)
        store = s3_store(bucket)
        store.objects = dead                            # opened while the bucket answered
        with pytest.raises(StoreError, match="cannot read chunks/"):
            store.put(chunks_of(m2)[5])
        with pytest.raises(StoreError, match="cannot read chunks/"):
            store.commit(m2)
    finally:
        silent.close()
    assert [m.version for m in good.manifests()] == [1] and good.manifest(v1.ns, "handbook") == v1
    assert good.verify() == []


# --- opaque objects (another cache layer's, put_objects) -----------------------------------
def objects_of(ns: bytes, n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [Chunk(rng.bytes(16), ns, rng.integers(0, 256, 4096 + i, dtype=np.uint8), "opaque")
            for i in range(n)]


def test_objects_outlive_a_restart_and_collect_and_go_by_ttl_or_delete(tmp_path):
    s = ChunkStore(tmp_path)
    ns_a, ns_b = bytes(range(16)), bytes(range(1, 17))
    objs_a, objs_b = objects_of(ns_a, 3), objects_of(ns_b, 1, seed=1)
    assert [w for w, _ in s.put_objects(objs_a + objs_b)] == [True] * 4
    assert s.stats()["pending"] == 0                   # never waiting for a commit
    orphan = chunks_of(kb())[0]
    s.put(orphan)                                      # a publish that never committed
    reopened = ChunkStore(tmp_path)                    # the origin restarts: nothing is pending
    assert reopened.collect() == dict(chunks=1, bytes=len(encode(orphan)), objects_kept=4,
                                      objects_expired=0)
    for o in objs_a + objs_b:                          # byte-identical after the restart
        got = reopened.get(o.key)
        assert got.opaque and got.kv.tobytes() == o.kv.tobytes() and got.ns == o.ns
    assert reopened.collect(object_ttl_s=3600)["objects_kept"] == 4
    assert reopened.delete_objects([o.key for o in objs_a[:2]] + [objs_b[0].key], ns_a) \
        == ([o.key for o in objs_a[:2]], [])           # another namespace's object is not ns_a's
    later = reopened.collect(object_ttl_s=60, now=time.time() + 120)
    assert (later["objects_expired"], later["chunks"]) == (2, 2) and reopened.chunk_count == 0
    with pytest.raises(StoreError, match="object_ttl_s"):
        reopened.collect(object_ttl_s=-1)


def test_put_chunks_is_durable_with_one_fsync_per_file_and_folder(tmp_path, monkeypatch):
    s = ChunkStore(tmp_path)
    objs = objects_of(bytes(16), 24)
    folders = {o.key.hex()[:2] for o in objs}
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd))[1])
    s.put_objects(objs)
    assert len(synced) == len(objs) + len(folders)     # per object it was a file and a folder
    assert all(s.get(o.key).kv.tobytes() == o.kv.tobytes() for o in objs)
