"""`kdn bench frames`: chunk frame encode/decode speed against a plain memory copy.

One chunk of random bf16 KV (64 MiB by default: 64 layers x 2 x 8 heads x 256 tokens x 128)
is encoded and decoded repeatedly, and the same bytes are copied with np.copyto into a
preallocated buffer in the same run; figures are GB/s of chunk bytes and ratios to that copy.

- encode: encode_parts — header plus a view of kv; the cost is one xxh3 pass (target >= 0.5).
- encode_into: copy and hash block by block into a preallocated buffer (mmap, shm).
- encode_bytes: encode() to one bytes object — a join into fresh memory, compared with
  bytes() of the same size (memcpy_fresh), since fresh pages cost a fault each.
- decode: zero-copy view plus checksum verification (target >= 0.8); decode_noverify skips
  the checksum, leaving only the header checks.
- pack_encode: the same bytes as a cache layer's object (kdn.integrations.objects.pack into a
  buffer kept from the last store) framed for an HTTP write (encode_parts): one copy, both
  checksums hashed in that pass; pack_rehash: the same with the frame's checksum hashed in a
  pass of its own, as encode_parts does for a chunk without one (how stores went before
  session 43), its baseline in the same run.
"""
import argparse

import numpy as np

from kdn.bench import emit_json, median, table, timeit
from kdn.core.chunk import Chunk, decode, encode, encode_into, encode_parts
from kdn.core.keys import chunk_keys, namespace_digest
from kdn.integrations.objects import TRAILER, pack

ENCODE_TARGET = 0.5
DECODE_TARGET = 0.8


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench frames", description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="chunk size in MiB (1 MiB per layer)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--json", action="store_true", help="print one JSON object last")
    args = ap.parse_args(argv)

    ns = namespace_digest("bench", "bench-model")
    rng = np.random.default_rng(0)
    kv = rng.integers(0, 2**16, size=(args.mib, 2, 8, 256, 128), dtype=np.uint16)
    chunk = Chunk(chunk_keys(range(256), ns)[0], ns, kv, "bfloat16")
    frame = encode(chunk)
    assert decode(frame).equal(chunk)
    n = chunk.nbytes
    src = kv.reshape(-1).view(np.uint8)
    dst = np.empty_like(src)
    out = bytearray(len(frame))
    src_view = memoryview(src)
    obj_buf = np.empty(n + TRAILER, np.uint8)
    key = chunk_keys(range(256), ns)[0]

    def pack_encode(rehash: bool):
        c = pack(key, ns, src, into=obj_buf)
        if rehash:
            object.__setattr__(c, "_xxh", None)
        return encode_parts(c)

    cases = [
        ("memcpy", lambda: np.copyto(dst, src)),
        ("memcpy_fresh", lambda: bytes(src_view)),
        ("encode", lambda: encode_parts(chunk)),
        ("encode_into", lambda: encode_into(chunk, out)),
        ("encode_bytes", lambda: encode(chunk)),
        ("decode", lambda: decode(frame)),
        ("decode_noverify", lambda: decode(frame, verify=False)),
        ("pack_encode", lambda: pack_encode(False)),
        ("pack_rehash", lambda: pack_encode(True)),
    ]
    gbps = {}
    for name, fn in cases:
        gbps[name] = n / median(timeit(fn, reps=args.reps)) / 1e9
    assert bytes(out) == frame
    assert b"".join(pack_encode(False)) == b"".join(pack_encode(True))     # the same frame
    base = {"encode_bytes": "memcpy_fresh"}
    rows = [{"op": name, "GB/s": gbps[name],
             "ratio": gbps[name] / gbps[base.get(name, "memcpy")],
             "vs": base.get(name, "memcpy")} for name, _ in cases]
    table(rows)
    enc_ratio = gbps["encode"] / gbps["memcpy"]
    dec_ratio = gbps["decode"] / gbps["memcpy"]
    print(f"\n{n / 2**20:.0f} MiB chunk: encode {enc_ratio:.2f}x memcpy (target >= "
          f"{ENCODE_TARGET}: {'met' if enc_ratio >= ENCODE_TARGET else 'MISSED'}), decode "
          f"{dec_ratio:.2f}x memcpy (target >= {DECODE_TARGET}: "
          f"{'met' if dec_ratio >= DECODE_TARGET else 'MISSED'}); an object packed and framed "
          f"{gbps['pack_encode'] / gbps['pack_rehash']:.2f}x its frame checksum hashed in a pass of its own")
    if args.json:
        emit_json({"bench": "frames", "chunk_bytes": n, "frame_bytes": len(frame),
                   "encode_gbps": gbps["encode"], "encode_parts_gbps": gbps["encode"],
                   "encode_into_gbps": gbps["encode_into"],
                   "encode_bytes_gbps": gbps["encode_bytes"], "decode_gbps": gbps["decode"],
                   "decode_noverify_gbps": gbps["decode_noverify"],
                   "memcpy_gbps": gbps["memcpy"], "memcpy_fresh_gbps": gbps["memcpy_fresh"],
                   "encode_ratio": enc_ratio, "decode_ratio": dec_ratio,
                   "encode_into_ratio": gbps["encode_into"] / gbps["memcpy"],
                   "encode_bytes_ratio": gbps["encode_bytes"] / gbps["memcpy_fresh"],
                   "pack_encode_gbps": gbps["pack_encode"], "pack_rehash_gbps": gbps["pack_rehash"],
                   "pack_encode_over_rehash": gbps["pack_encode"] / gbps["pack_rehash"],
                   "encode_target": ENCODE_TARGET, "decode_target": DECODE_TARGET,
                   "targets_met": enc_ratio >= ENCODE_TARGET and dec_ratio >= DECODE_TARGET})
    return 0
