"""Forms: a copy is verified against its manifest checksum, kept in the store form, and sent in
the form that reaches its reader soonest — the same decisions for Ray and HTTP."""
import asyncio

import pytest

from kdn.core.chunk import Chunk, Encoded, decode
from kdn.edge.forms import Forms, corrupted, link_codec
from kdn.core.errors import BadRequest
from kdn.placement.topology import Topology


def _forms(kit, chunks, store_codec="raw", slow_gbps=0.01):
    sums = {c.key: c.digest() for c in chunks}
    topo = Topology.from_dict(kit.topology(slow_gbps))
    return Forms(store_codec, sums.get, lambda: topo, "here")


def _read_only(kv):
    """A read-only copy of kv, as chunks held in Ray's object store are."""
    out = kv.copy()
    out.flags.writeable = False
    return out


def _decoded(parts):
    return decode(b"".join(bytes(p) for p in parts))


def test_link_codec_keeps_the_stored_form_beside_the_reader_and_for_lossy_kv(kit):
    c, = kit.make_chunks(1)
    assert link_codec(c, None, ("zstd",)) == "raw"
    assert link_codec(c, 0.01, ("zstd",)) == "zstd", "a thin link: compressing pays"
    assert link_codec(c, 100.0, ("zstd",)) == "raw", "a fat link: it does not"
    q = Encoded.of(c, "q8z")
    assert link_codec(q, 0.01, ("zstd",)) == "q8z", "lossy KV goes as it is"
    z = Encoded.of(c, "zstd")
    assert link_codec(z, None, ("zstd",)) == "zstd"


def test_intact_checks_the_manifest_checksum_and_counts_failures(kit):
    a, b = kit.make_chunks(2)
    f = _forms(kit, [a, b])
    assert f.intact(a) and f.intact(Encoded.of(b, "zstd"))
    assert not f.intact(corrupted(a)) and not f.intact(corrupted(Encoded.of(b, "zstd")))
    assert f.counters["corrupt_detected"] == 2
    lossy = Encoded.of(a, "q8z")
    assert f.intact(lossy), "lossy KV is vouched for by its frame checksums only"
    assert not f.intact(corrupted(lossy))


def test_store_form_verifies_and_encodes_as_the_edge_keeps_chunks(kit):
    a, = kit.make_chunks(1)
    raw, zstd = _forms(kit, [a]), _forms(kit, [a], store_codec="zstd")
    assert raw.store_form(Encoded.of(a, "zstd")).equal(a)
    kept = zstd.store_form(a)
    assert kept.codec == "zstd" and kept.decode().equal(a) and zstd.counters["stored_encoded"] == 1
    lossy = Encoded.of(a, "q8z")
    assert zstd.store_form(lossy) is lossy, "lossy KV is kept as it is: expanding restores nothing"
    assert raw.store_form(corrupted(a)) is None and zstd.store_form(corrupted(a)) is None
    with pytest.raises(BadRequest, match="edge store codec must be one of"):
        Forms("lzma", {}.get, None, "here")


def test_frame_codecs_follow_the_asked_codec_or_the_link(kit):
    a, b = kit.make_chunks(2)
    f = _forms(kit, [a, b])
    objs = [a, Encoded.of(b, "q8z")]
    assert f.frame_codecs(objs, None, "zstd") == ["zstd", "q8z"]
    assert f.frame_codecs(objs, None, "auto") == ["raw", "q8z"], "no region: beside the edge"
    assert f.frame_codecs(objs, "far", "auto") == ["zstd", "q8z"]
    assert _forms(kit, [a], slow_gbps=100).frame_codecs([a], "far", "auto") == ["raw"]


def test_frames_are_the_chunks_and_a_corrupt_copy_ends_them(kit):
    cs = kit.make_chunks(3)
    f = _forms(kit, cs)
    # a chunk whose hash is not known yet must be hashed: not on the event loop
    assert not f.nothing_to_compute(cs, ["raw"] * 3)
    frozen = [Chunk(c.key, c.ns, _read_only(c.kv), c.dtype) for c in cs]
    f.frames(frozen, ["raw"] * 3)                      # hashes them once (immutable: cached)
    assert f.nothing_to_compute(frozen, ["raw"] * 3)
    assert not f.nothing_to_compute(frozen, ["raw", "zstd", "raw"])
    parts, bad = f.frames(cs, ["raw", "zstd", "raw"])
    assert bad is None and [_decoded(p).equal(c) for p, c in zip(parts, cs)] == [True] * 3
    stored = Encoded.of(cs[1], "zstd")
    parts, bad = f.frames([stored], ["zstd"])
    assert bytes(parts[0][1]) == stored.frame.tobytes(), "a stored frame goes as it is"
    parts, bad = f.frames([cs[0], corrupted(cs[1]), cs[2]], ["raw"] * 3)
    assert bad == 1 and len(parts) == 1 and f.counters["corrupt_detected"] == 1
    parts, bad = f.frames([corrupted(stored)], ["zstd"])
    assert bad == 0 and parts == []


def test_a_raw_frame_of_a_corrupt_chunk_never_carries_a_checksum_of_its_bytes(kit):
    """Without the manifest check an edge would hash the corrupt bytes and frame them as valid."""
    a, = kit.make_chunks(1)
    bad = corrupted(a)
    bad.kv.flags.writeable = False            # as in the object store
    unchecked = Forms("raw", {}.get, None, "here")
    parts, _ = unchecked.frames([bad], ["raw"])
    assert _decoded(parts[0]).equal(bad), "no manifest: nothing to check against"
    parts, at = _forms(kit, [a]).frames([bad], ["raw"])
    assert at == 0 and parts == []


def test_corrupted_flips_one_payload_byte(kit):
    a, = kit.make_chunks(1)
    assert not corrupted(a).equal(a) and corrupted(a).key == a.key
    z = Encoded.of(a, "zstd")
    assert isinstance(corrupted(z), Encoded) and corrupted(z).nbytes == z.nbytes


def test_a_large_chunk_is_checked_and_kept_off_the_event_loop(kit):
    """to_store (what put_chunks and a kept peer copy go through) hashes and puts in a worker
    thread: the loop goes on ticking while 32 x 64 MiB are verified."""
    import ray  # noqa: F401 - an edge has imported it (Held.kept asks it): not the work timed

    def measure():
        cs = kit.big_chunks(32)
        f = Forms("raw", dict.fromkeys((c.key for c in cs), cs[0].digest()).get, None, "here")
        kept, stall, ticks, took = asyncio.run(kit.stalls(f.to_store(cs)))
        # kept in the object store (Ray is up) or here (it is not): each chunk, verified once
        assert [h.key for h in kept] == [c.key for c in cs] and all(c._xxh is not None for c in cs)
        return stall, ticks, took
    kit.assert_off_loop(measure)


def test_a_reported_copy_is_hashed_again_not_judged_by_the_checksum_it_arrived_with(kit):
    """A sealed copy keeps the checksum found when it arrived (kdn.edge.tiers.Held.of); when a
    reader reports it corrupt, drop_corrupt rereads its bytes rather than trusting it."""
    a, = kit.make_chunks(1)
    f = _forms(kit, [a])
    bad = corrupted(a)
    bad.kv.flags.writeable = False
    object.__setattr__(bad, "_xxh", a.digest())       # bytes gone bad after the arrival check
    assert f.intact(bad) is True
    assert f.intact(bad, reread=True) is False and f.counters["corrupt_detected"] == 1
    good = Chunk(a.key, a.ns, _read_only(a.kv), a.dtype)
    assert f.intact(good, reread=True) is True
