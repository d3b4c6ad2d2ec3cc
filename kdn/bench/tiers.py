"""`kdn bench tiers`: the edge's disk tier against a plain file read of the same bytes.

The disk tier (kdn.edge.disk) writes N chunk records; then, in the same run and
alternating rep by rep, it reads them back as the tier does (a buffer per record, each
block hashed as it lands, header, key and namespace checked: a verified Chunk) and as a
plain file read does (open, readinto a preallocated buffer, nothing checked), over the very
same files. Both are measured warm (in the page cache) and cold where the machine lets the
page cache be dropped per file (fsync, then posix_fadvise DONTNEED; `cold_works` says
whether the cold figure really was slower than the warm one), and a plain O_DIRECT read
when the filesystem takes it. Goal: disk_over_file >= 0.8.

The file layout is measured too: a file per record against one slab file read at offsets
(pread), at the chunk size given and at a small (compressed-like) size, so the per-file
cost is visible. Each chunk the tier reads is dropped before the next is read, as an edge
does once it has put the chunk into its object store (so the allocator reuses the buffer). And what the tier buys: the memory one indexed record costs (tracemalloc
over the index), so how much more KV an edge holds per GB of memory with the disk tier.
"""
import argparse
import mmap
import os
import shutil
import tempfile
import time
import tracemalloc

import numpy as np

from kdn.bench import emit_json, median, table
from kdn.core.chunk import Chunk, encode
from kdn.edge.disk import DiskTier
from kdn.core.keys import chunk_keys, namespace_digest

NS = namespace_digest("bench", "tiers")
GB = 1e9


def make_chunks(n: int, nbytes: int, seed: int = 0) -> list:
    """n chunks of about nbytes each: fp16 KV [layers, 2, 8 heads, 256 tokens, 64]."""
    per_layer = 2 * 8 * 256 * 64 * 2
    layers = max(1, nbytes // per_layer)
    tokens = 256 if layers > 1 else max(1, nbytes // (2 * 8 * 64 * 2))
    rng = np.random.default_rng(seed)
    keys = chunk_keys(range(n * tokens), NS, tokens)
    kv = rng.standard_normal((layers, 2, 8, tokens, 64)).astype(np.float16)
    out = []
    for k in keys:
        out.append(Chunk(k, NS, kv.copy(), "float16"))
        kv[0, 0, 0, 0, 0] += 1                    # distinct bytes per chunk
    return out


def drop_cache(paths) -> None:
    """Ask the kernel to drop these files' pages (they are clean: fsynced first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_plain(paths, sizes, bufs) -> int:
    n = 0
    for p, size, buf in zip(paths, sizes, bufs):
        with open(p, "rb", buffering=0) as f:
            n += f.readinto(buf[:size])
    return n


def read_direct(paths, sizes):
    """O_DIRECT reads into one page-aligned buffer; None when the filesystem refuses."""
    big = max(sizes)
    buf = mmap.mmap(-1, (big + 4095) // 4096 * 4096)
    n = 0
    try:
        for p, size in zip(paths, sizes):
            fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
            try:
                n += os.readv(fd, [buf])
            finally:
                os.close(fd)
    except OSError:
        return None
    finally:
        buf.close()
    return n


def read_slab(path, offsets, sizes, bufs) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, size, buf in zip(offsets, sizes, bufs):
            n += os.preadv(fd, [memoryview(buf)[:size]], off)
    finally:
        os.close(fd)
    return n


def index_bytes_per_record(n: int = 20000) -> float:
    """Memory one record costs the disk index (Record + cache entry + S3-FIFO entry)."""
    from kdn.edge.cache import ChunkCache
    from kdn.edge.disk import Record
    keys = [os.urandom(16) for _ in range(n)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = ChunkCache(1 << 60, "s3fifo")
    for k in keys:
        cache.put(k, Record(k, NS, 8 << 20, 8 << 20, "raw", "float16"), 8 << 20)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / n


def layout(d, chunks, reps: int) -> dict:
    """GB/s of file-per-record vs one slab, both warm, the same bytes."""
    frames = [encode(c) for c in chunks]
    sizes = [len(f) for f in frames]
    paths = []
    for i, f in enumerate(frames):
        p = os.path.join(d, f"rec{i}")
        with open(p, "wb") as out:
            out.write(f)
        paths.append(p)
    slab = os.path.join(d, "slab")
    with open(slab, "wb") as out:
        for f in frames:
            out.write(f)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    bufs = [np.empty(s, np.uint8) for s in sizes]
    total = sum(sizes)
    tf, ts = [], []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        read_plain(paths, sizes, bufs)
        tf.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        read_slab(slab, offsets, sizes, bufs)
        ts.append(time.perf_counter() - t0)
    return {"record_bytes": sizes[0], "files_gbps": total / median(tf[1:]) / GB,
            "slab_gbps": total / median(ts[1:]) / GB,
            "per_file_us": max(0.0, (median(tf[1:]) - median(ts[1:])) / len(paths) * 1e6)}


def run(a) -> dict:
    chunk_bytes = int(a.chunk_mib * 2**20)
    root = tempfile.mkdtemp(prefix="kdn-bench-tiers-", dir=a.dir)
    try:
        chunks = make_chunks(a.chunks, chunk_bytes)
        disk = DiskTier(os.path.join(root, "tier"), 1 << 62)
        t0 = time.perf_counter()
        for c in chunks:
            assert disk.write(c)
        write_s = time.perf_counter() - t0
        keys = [c.key for c in chunks]
        paths = [str(disk.path(k)) for k in keys]
        sizes = [os.path.getsize(p) for p in paths]
        total = sum(sizes)
        bufs = [np.empty(s, np.uint8) for s in sizes]

        def tier_pass():
            # as an edge does: each verified chunk is handed on (into the object store) and
            # dropped before the next is read
            for k in keys:
                assert disk.read(k, NS) is not None

        out = {"chunks": a.chunks, "chunk_bytes": sizes[0], "bytes": total,
               "disk_write_gbps": total / write_s / GB}
        for mode in ("warm", "cold"):
            td, tf = [], []
            for _ in range(a.reps + (mode == "warm")):       # warm: one unmeasured pass first
                if mode == "cold":
                    drop_cache(paths)
                t0 = time.perf_counter()
                tier_pass()
                td.append(time.perf_counter() - t0)
                if mode == "cold":
                    drop_cache(paths)
                t0 = time.perf_counter()
                read_plain(paths, sizes, bufs)
                tf.append(time.perf_counter() - t0)
            if mode == "warm":
                td, tf = td[1:], tf[1:]
            out[f"{mode}_disk_read_gbps"] = total / median(td) / GB
            out[f"{mode}_file_read_gbps"] = total / median(tf) / GB
        tdir = []
        for _ in range(a.reps):
            drop_cache(paths)
            t0 = time.perf_counter()
            ok = read_direct(paths, sizes)
            tdir.append(time.perf_counter() - t0)
            if ok is None:
                break
        out["direct_file_read_gbps"] = None if ok is None else total / median(tdir) / GB
        out["cold_works"] = out["cold_file_read_gbps"] < 0.7 * out["warm_file_read_gbps"]
        # the headline: warm (the page cache is part of what a disk tier is on Linux)
        out["disk_read_gbps"] = out["warm_disk_read_gbps"]
        out["file_read_gbps"] = out["warm_file_read_gbps"]
        out["disk_over_file"] = out["disk_read_gbps"] / out["file_read_gbps"]
        out["cold_disk_over_file"] = out["cold_disk_read_gbps"] / out["cold_file_read_gbps"]
        out["goal_met"] = out["disk_over_file"] >= 0.8 and out["cold_disk_over_file"] >= 0.8
        out["layout"] = []
        for nbytes, n in ((chunk_bytes, a.chunks), (64 << 10, 512)):
            d = os.path.join(root, f"layout{nbytes}")
            os.mkdir(d)
            out["layout"].append(layout(d, make_chunks(n, nbytes, seed=1), a.reps))
            shutil.rmtree(d)
        idx = index_bytes_per_record()
        mem, dsk = a.memory_gib * 2**30, a.disk_gib * 2**30
        out["index_bytes_per_chunk"] = idx
        out["disk_kv_per_index_memory"] = sizes[0] / idx
        out["example"] = {"memory_gib": a.memory_gib, "disk_gib": a.disk_gib,
                          "chunk_bytes": sizes[0]}
        # KV held per byte of memory: memory tiers alone hold 1; with the disk tier, memory
        # holds its own KV plus the index of the disk's records
        out["kv_per_memory_gb_with_disk"] = (mem + dsk) / (mem + dsk / sizes[0] * idx)
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)


def build_parser():
    ap = argparse.ArgumentParser(prog="kdn bench tiers", description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=32, help="records written and read")
    ap.add_argument("--chunk-mib", type=float, default=8.0, help="record size (MiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where to write (default: the temp directory)")
    ap.add_argument("--memory-gib", type=float, default=8.0, help="an edge's memory, for the example")
    ap.add_argument("--disk-gib", type=float, default=500.0, help="an edge's disk tier, for the example")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    r = run(a)
    print(f"disk tier vs plain file read: {r['chunks']} records of {r['chunk_bytes'] / 2**20:.1f} MiB "
          f"({r['bytes'] / 2**20:.0f} MiB), median of {a.reps}")
    rows = [{"read": "warm (page cache)", "disk tier GB/s": r["warm_disk_read_gbps"],
             "plain file GB/s": r["warm_file_read_gbps"], "ratio": r["disk_over_file"]},
            {"read": "cold (fadvise DONTNEED)" + ("" if r["cold_works"] else " - NOT dropped"),
             "disk tier GB/s": r["cold_disk_read_gbps"], "plain file GB/s": r["cold_file_read_gbps"],
             "ratio": r["cold_disk_over_file"]}]
    table(rows)
    d = r["direct_file_read_gbps"]
    print(f"plain O_DIRECT read: {'refused by this filesystem' if d is None else f'{d:.3g} GB/s'}; "
          f"disk tier write {r['disk_write_gbps']:.3g} GB/s")
    print(f"goal disk/file >= 0.8: {'met' if r['goal_met'] else 'NOT met'}")
    table([{"record": f"{x['record_bytes'] / 2**10:.0f} KiB", "file per record GB/s": x["files_gbps"],
            "one slab GB/s": x["slab_gbps"], "cost per file us": x["per_file_us"]}
           for x in r["layout"]])
    print(f"index: {r['index_bytes_per_chunk']:.0f} B of memory per record on disk: the index "
          f"costs 1/{r['disk_kv_per_index_memory']:.0f} of the KV it indexes; an edge with {a.memory_gib:g} GiB of "
          f"memory and a {a.disk_gib:g} GiB disk tier holds {r['kv_per_memory_gb_with_disk']:.1f} GB of "
          f"KV per GB of memory (1.0 without the disk tier)")
    if a.json:
        emit_json(r)
    return 0
