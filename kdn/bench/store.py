"""`kdn bench store`: origin chunk-store throughput against plain I/O of the same bytes.

--backend local (default): ChunkStore.put_frame (frame verified by its checksum, temp file,
fsync, rename, directory fsync) against writing each frame to a file and fsyncing it; reads:
ChunkStore.get (read, checksum verified, zero-copy decode) and get_frame against reading
each file back. Reads come from the page cache on both sides (the files were just written),
so they measure the store's overhead, not the disk.

--backend s3: the same store over an S3-compatible bucket (kdn/origin/objects.py, obstore)
against a plain obstore put/get of the same frames to the same bucket. Without --url it
starts a real S3 server on loopback (moto's threaded server, in this process: its speed is
moto's, so the ratio is the figure to read, not the GB/s); with --url s3://bucket/prefix it
uses that bucket with the AWS_* variables of the environment. A first, unmeasured repetition
warms the server up. The store's own cost over a plain PUT is one HEAD (has an intact copy?)
and the frame's checksum pass; over a plain GET, the checksum pass.

Both sides use the same frames in the same run, so the ratios say what durability and
verification cost whatever the storage. Each repetition writes under a fresh directory or
prefix (a store would deduplicate a second write); everything is deleted afterwards.
"""
import argparse
import os
import shutil
import tempfile
import time
import uuid

import numpy as np

from kdn.bench import emit_json, median, table
from kdn.testing.s3 import LocalS3
from kdn.core.chunk import Chunk, encode
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


def _store_side(store, frames) -> dict:
    """Seconds of the store's write, get and get_frame of frames."""
    keys = []

    def write():
        for f in frames:
            keys.append(store.put_frame(f)[0])

    def get():
        for k in keys:
            store.get(k)

    def get_frame():
        for k in keys:
            store.get_frame(k)

    out = dict(store_write=_timed(write))
    assert len(keys) == len(frames) and store.chunk_count == len(frames)
    out.update(store_get=_timed(get), store_get_frame=_timed(get_frame))
    return out


def one_rep(base: str, frames: list, fsync: bool) -> dict:
    rep_dir = tempfile.mkdtemp(prefix="kdn-bench-store-", dir=base)
    try:
        raw_dir = os.path.join(rep_dir, "raw")
        os.mkdir(raw_dir)

        def raw_write():
            for i, f in enumerate(frames):
                with open(os.path.join(raw_dir, f"{i}.bin"), "wb") as fh:
                    fh.write(f)
                    fh.flush()
                    if fsync:
                        os.fsync(fh.fileno())

        def raw_read():
            for i in range(len(frames)):
                with open(os.path.join(raw_dir, f"{i}.bin"), "rb") as fh:
                    fh.read()

        out = dict(raw_write=_timed(raw_write))
        out.update(_store_side(ChunkStore(os.path.join(rep_dir, "store"), fsync=fsync), frames))
        out.update(raw_read=_timed(raw_read))
        return out
    finally:
        shutil.rmtree(rep_dir, ignore_errors=True)


def one_rep_s3(url: str, env: dict, frames: list) -> dict:
    import obstore
    from kdn.origin.objects import open_objects
    objects = open_objects(f"{url}/bench-{uuid.uuid4().hex[:8]}", env=env)
    raw, store = objects.child("raw"), ChunkStore(objects.child("store"))
    client = raw._store        # the same obstore client, used plainly: no verification, no names

    def raw_write():
        for i, f in enumerate(frames):
            obstore.put(client, f"{i}.bin", f, use_multipart=False)

    def raw_read():
        for i in range(len(frames)):
            bytes(obstore.get(client, f"{i}.bin").bytes())

    def clear():
        for name, _ in objects.list(""):
            objects.delete(name)

    try:       # one side at a time, each on an empty prefix: the server holds the same bytes for both
        out = dict(raw_write=_timed(raw_write), raw_read=_timed(raw_read))
        clear()
        out.update(_store_side(store, frames))
        return out
    finally:
        clear()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench store", description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("local", "s3"), default="local",
                    help="local directory (default) or an S3-compatible bucket")
    ap.add_argument("--url", help="with --backend s3: s3://bucket/prefix to use (AWS_* variables "
                                  "say how to reach it); default: a moto server on loopback")
    ap.add_argument("--chunks", type=int, default=16, help="chunks per repetition (default 16)")
    ap.add_argument("--chunk-mib", type=float, default=8.0, help="MiB per chunk (default 8)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported (default 3)")
    ap.add_argument("--no-fsync", action="store_true", help="local: skip fsync on both sides")
    ap.add_argument("--dir", default=None, help="local: parent directory for the temp files (default: system temp)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.chunks < 1 or args.reps < 1 or args.chunk_mib <= 0:
        ap.error("--chunks and --reps must be >= 1 and --chunk-mib > 0")
    if args.url and args.backend != "s3":
        ap.error("--url is for --backend s3")

    frames = make_frames(args.chunks, args.chunk_mib)
    total = sum(len(f) for f in frames)
    server = None
    if args.backend == "s3":
        if args.url:
            url, env, where = args.url, None, args.url
        else:
            server = LocalS3()
            url, env, where = server.url("bench"), server.env, f"moto S3 server at {server.endpoint}"
        try:
            one_rep_s3(url, env, frames)        # warm-up: a fresh server's first writes are slower
            reps = [one_rep_s3(url, env, frames) for _ in range(args.reps)]
        finally:
            if server is not None:
                server.stop()
        raw_w, store_w = "obstore.put (plain client)", "store.put_frame (verify, PUT)"
        raw_r = "obstore.get (plain client)"
    else:
        base = args.dir or tempfile.gettempdir()
        reps = [one_rep(base, frames, not args.no_fsync) for _ in range(args.reps)]
        where = f"local directory, fsync={'off' if args.no_fsync else 'on'}, reads warm (page cache)"
        raw_w = "raw file write" + ("" if args.no_fsync else " + fsync")
        store_w = "store.put_frame (verify, temp, " + ("" if args.no_fsync else "fsync, ") + "rename)"
        raw_r = "raw file read"
    med = {k: median([r[k] for r in reps]) for k in reps[0]}
    gbs = {k: total / v / 1e9 for k, v in med.items()}
    rows = [
        dict(op="write", path=raw_w, GB_s=gbs["raw_write"], ratio_vs_raw=1.0),
        dict(op="write", path=store_w, GB_s=gbs["store_write"], ratio_vs_raw=gbs["store_write"] / gbs["raw_write"]),
        dict(op="read", path=raw_r, GB_s=gbs["raw_read"], ratio_vs_raw=1.0),
        dict(op="read", path="store.get (verify + decode)",
             GB_s=gbs["store_get"], ratio_vs_raw=gbs["store_get"] / gbs["raw_read"]),
        dict(op="read", path="store.get_frame (verify)",
             GB_s=gbs["store_get_frame"], ratio_vs_raw=gbs["store_get_frame"] / gbs["raw_read"]),
    ]
    print(f"origin store ({args.backend}): {args.chunks} chunks x {len(frames[0]) / (1 << 20):.2f} MiB = "
          f"{total / (1 << 20):.0f} MiB, median of {args.reps}; {where}")
    table(rows)
    if args.json:
        emit_json(dict(bench="store", backend=args.backend, chunks=args.chunks, chunk_bytes=len(frames[0]),
                       total_bytes=total, reps=args.reps, fsync=None if args.backend == "s3" else not args.no_fsync,
                       seconds=med, rows=rows))
    return 0
