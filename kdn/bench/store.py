"""`kdn bench store`: origin chunk-store throughput against plain file I/O of the same bytes.

Writes: ChunkStore.put_frame (frame verified by its checksum, temp file, fsync, rename,
directory fsync) against writing each frame to a file and fsyncing it. Reads: ChunkStore.get
(read, checksum verified, zero-copy decode) and get_frame against reading each file back.
Both sides use the same frames in the same run, so the ratios say what durability and
verification cost on this machine whatever its disk; reads come from the page cache on both
sides (the files were just written), so they measure the store's overhead, not the disk.
Each repetition writes into a fresh directory (a store would deduplicate a second write);
everything is deleted afterwards.
"""
import argparse
import os
import shutil
import tempfile
import time

import numpy as np

from kdn.bench import emit_json, median, table
from kdn.chunk import Chunk, encode
from kdn.origin.store import ChunkStore


def make_frames(n: int, chunk_mib: float, seed: int = 0) -> list:
    """n frames of bf16 KV [layers, 2, 8 heads, 256 tokens, 64 dim] of about chunk_mib MiB each."""
    per_layer = 2 * 8 * 256 * 64 * 2
    layers = max(1, int(round(chunk_mib * (1 << 20) / per_layer)))
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        kv = rng.integers(0, 2**16, (layers, 2, 8, 256, 64), dtype=np.uint16)
        key = rng.bytes(16)
        frames.append(encode(Chunk(key, bytes(16), kv, "bfloat16")))
    return frames


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_rep(base: str, frames: list, fsync: bool) -> dict:
    rep_dir = tempfile.mkdtemp(prefix="kdn-bench-store-", dir=base)
    try:
        store = ChunkStore(os.path.join(rep_dir, "store"), fsync=fsync)
        raw_dir = os.path.join(rep_dir, "raw")
        os.mkdir(raw_dir)
        keys = []

        def store_write():
            for f in frames:
                keys.append(store.put_frame(f)[0])

        def raw_write():
            for i, f in enumerate(frames):
                with open(os.path.join(raw_dir, f"{i}.bin"), "wb") as fh:
                    fh.write(f)
                    fh.flush()
                    if fsync:
                        os.fsync(fh.fileno())

        def store_read():
            for k in keys:
                store.get(k)

        def store_read_frame():
            for k in keys:
                store.get_frame(k)

        def raw_read():
            for i in range(len(frames)):
                with open(os.path.join(raw_dir, f"{i}.bin"), "rb") as fh:
                    fh.read()

        out = dict(raw_write=_timed(raw_write), store_write=_timed(store_write))
        assert len(keys) == len(frames) and store.chunk_count == len(frames)
        out.update(raw_read=_timed(raw_read), store_get=_timed(store_read),
                   store_get_frame=_timed(store_read_frame))
        return out
    finally:
        shutil.rmtree(rep_dir, ignore_errors=True)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench store", description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=16, help="chunks per repetition (default 16)")
    ap.add_argument("--chunk-mib", type=float, default=8.0, help="MiB per chunk (default 8)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    ap.add_argument("--no-fsync", action="store_true", help="skip fsync on both sides")
    ap.add_argument("--dir", default=None, help="parent directory for the temp files (default: system temp)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.reps < 1 or args.chunk_mib <= 0:
        ap.error("--chunks and --reps must be >= 1 and --chunk-mib > 0")

    frames = make_frames(args.chunks, args.chunk_mib)
    total = sum(len(f) for f in frames)
    base = args.dir or tempfile.gettempdir()
    reps = [one_rep(base, frames, not args.no_fsync) for _ in range(args.reps)]
    med = {k: median([r[k] for r in reps]) for k in reps[0]}
    gbs = {k: total / v / 1e9 for k, v in med.items()}
    rows = [
        dict(op="write", path="raw file write" + ("" if args.no_fsync else " + fsync"),
             GB_s=gbs["raw_write"], ratio_vs_raw=1.0),
        dict(op="write", path="store.put_frame (verify, temp, " + ("" if args.no_fsync else "fsync, ") + "rename)",
             GB_s=gbs["store_write"], ratio_vs_raw=gbs["store_write"] / gbs["raw_write"]),
        dict(op="read", path="raw file read", GB_s=gbs["raw_read"], ratio_vs_raw=1.0),
        dict(op="read", path="store.get (verify + decode)",
             GB_s=gbs["store_get"], ratio_vs_raw=gbs["store_get"] / gbs["raw_read"]),
        dict(op="read", path="store.get_frame (verify)",
             GB_s=gbs["store_get_frame"], ratio_vs_raw=gbs["store_get_frame"] / gbs["raw_read"]),
    ]
    print(f"origin store: {args.chunks} chunks x {len(frames[0]) / (1 << 20):.2f} MiB = "
          f"{total / (1 << 20):.0f} MiB, median of {args.reps}, fsync={'off' if args.no_fsync else 'on'}, "
          f"reads warm (page cache) on both sides")
    table(rows)
    if args.json:
        emit_json(dict(bench="store", chunks=args.chunks, chunk_bytes=len(frames[0]), total_bytes=total,
                       reps=args.reps, fsync=not args.no_fsync, seconds=med, rows=rows))
    return 0
