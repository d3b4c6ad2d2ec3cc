"""Which form of a chunk crosses a link soonest, and which forms readers and stores accept.

The link cost model: a chunk sent as codec C over a link of B GB/s costs its encode time
(free when it is already stored as C), its compressed bytes at B, and its decode time
(PROFILE, measured with `kdn bench codecs`). choose_codec() compresses only when that beats
sending the bytes as they are by a clear margin (MIN_GAIN); on the same node it never does.

The policy: a reader takes lossless codecs unless it accepts lossy ones by name
(check_accept); an edge may store any codec, lossy as an operator's deliberate choice, and
the origin only lossless ones, because it keeps the exact KV every copy is checked against
(check_store_codec).

The deadline: how long a reader waits for one edge's answer before failing over to the next
(fetch_deadline_s) grows with the work asked, keys and bytes, never a fixed figure that a
large request cannot meet on a healthy edge.
"""
import numpy as np

from kdn.core.codecs import LOSSLESS, LOSSY, codecs
from kdn.core.dtypes import DTYPES
from kdn.core.errors import BadRequest

# Measured with `kdn bench codecs` on this machine (one core, SmolLM2-135M KV, 256-token
# chunks): size ratio against the raw bytes per KV dtype, encode and decode GB/s of raw bytes.
# Lossy ratios are fixed by the format (bits per element plus fp16 scales); "zstd"'s
# depends on the data. A deployment can pass its own measurements (measure_profile()).
PROFILE = {
    "raw": {"ratio": {"float32": 1.0, "float16": 1.0, "bfloat16": 1.0},
            "encode_gbps": float("inf"), "decode_gbps": float("inf")},
    "zstd": {"ratio": {"float32": 1.18, "float16": 1.16, "bfloat16": 1.16},
             "encode_gbps": 1.0, "decode_gbps": 2.4},
    "q8": {"ratio": {"float32": 3.73, "float16": 1.86, "bfloat16": 1.86},
           "encode_gbps": 0.8, "decode_gbps": 6.0},
    "q8z": {"ratio": {"float32": 3.88, "float16": 1.94, "bfloat16": 1.94},
            "encode_gbps": 0.7, "decode_gbps": 3.0},
    "q4": {"ratio": {"float32": 7.0, "float16": 3.5, "bfloat16": 3.5},
           "encode_gbps": 0.9, "decode_gbps": 6.0},
    "q4z": {"ratio": {"float32": 7.47, "float16": 3.73, "bfloat16": 3.73},
            "encode_gbps": 0.7, "decode_gbps": 3.7},
    "k4v3z": {"ratio": {"float32": 8.73, "float16": 4.36, "bfloat16": 4.36},
              "encode_gbps": 0.6, "decode_gbps": 3.2},
}


# A reader's deadline for one edge's answer: a healthy edge on a busy 2-core machine meets
# it, a hung one costs a bounded time proportional to the work asked. A fixed 4 s (+ bytes)
# had a load of 16,384 small objects (10-40 s of healthy work) fail over on every edge and
# load nothing; hosts (kdn.integrations.objects) also split large loads so one answer stays short.
DEADLINE_BASE_S = 4.0          # any call: Ray's dispatch, an actor's queue on a busy machine
DEADLINE_PER_KEY_S = 0.005     # per key: 2-20x the 0.25-2.4 ms measured for small objects
                               # (warm refs; cold ones, 2 cores at a load average of 10-15)
DEADLINE_PER_MB_S = 0.02       # per MB: 50 MB/s, a slow WAN link


def fetch_deadline_s(n_keys: int, nbytes: int = 0) -> float:
    """Seconds one edge gets to answer a request naming n_keys keys that carries about
    nbytes: DEADLINE_BASE_S + DEADLINE_PER_KEY_S a key + DEADLINE_PER_MB_S a MB."""
    if n_keys < 0 or nbytes < 0:
        raise BadRequest(f"a deadline for {n_keys} keys and {nbytes} bytes: both must be >= 0")
    return DEADLINE_BASE_S + DEADLINE_PER_KEY_S * n_keys + DEADLINE_PER_MB_S * nbytes / 1e6


MIN_GAIN = 0.9   # re-encoding for a link must be estimated to take <= 90% of sending raw


def transfer_seconds(codec: str, nbytes: int, bandwidth_gbps: float, dtype: str = "float32",
                     stored: str = "raw", profile: dict = None) -> float:
    """Estimated seconds to move nbytes of KV (raw size) as codec over the link.

    stored: the codec the sender already holds the chunk in (its encode is then free; any
    other codec costs decoding the stored form first).
    """
    profile = profile or PROFILE
    for name in (codec, stored):
        if name not in profile:
            raise BadRequest(f"codec {name!r} has no profile; known: {', '.join(sorted(profile))}")
    if dtype not in DTYPES:
        raise BadRequest(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not bandwidth_gbps > 0:
        raise BadRequest(f"bandwidth_gbps must be > 0, got {bandwidth_gbps!r}")
    p = profile[codec]
    seconds = nbytes / p["ratio"][dtype] / (bandwidth_gbps * 1e9) + nbytes / (p["decode_gbps"] * 1e9)
    if codec != stored:
        seconds += nbytes / (p["encode_gbps"] * 1e9)
        if stored != "raw":
            seconds += nbytes / (profile[stored]["decode_gbps"] * 1e9)
    return seconds


def choose_codec(nbytes: int, bandwidth_gbps: float, same_node: bool, dtype: str = "float32",
                 allowed=LOSSLESS, stored: str = "raw", profile: dict = None) -> str:
    """The codec that moves nbytes of KV over this link soonest: "raw" unless compressing pays.

    Raw on the same node (the object store shares memory: nothing to save). Otherwise each
    allowed codec's estimated encode + transfer + decode time (transfer_seconds) is compared
    with sending the bytes as they are. allowed defaults to the lossless codecs: a lossy
    codec changes the model's output slightly and must be opted into (e.g. allowed=("q8z",)).
    """
    if same_node or nbytes <= 0:
        return "raw"
    seconds = {name: transfer_seconds(name, nbytes, bandwidth_gbps, dtype, stored, profile)
               for name in ("raw",) + tuple(allowed)}
    best = min(seconds, key=seconds.get)
    # The form needing the least work: the stored one, if allowed (raw always is).
    keep = stored if stored in seconds else "raw"
    if best != keep and seconds[best] > MIN_GAIN * seconds[keep]:
        # A marginal estimated gain is no gain: the profile is measured on a quiet core, and
        # an edge encoding under load is slower (kdn bench links measured 0.9 s, not 0.2 s,
        # for 208 MB at a modeled 1% gain). Re-encoding must promise a clear win.
        return keep
    return best


def check_accept(accept) -> tuple:
    """The codecs a reader takes besides raw (None: the lossless ones), checked."""
    if accept is None:
        return LOSSLESS
    if not isinstance(accept, (list, tuple, set, frozenset)) or \
            not all(isinstance(c, str) for c in accept):
        raise BadRequest(f"accept must be a list of codec names, got {accept!r:.80}")
    unknown = [c for c in accept if c not in codecs()]
    if unknown:
        raise BadRequest(f"accept names unknown codec(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(codecs())}")
    return tuple(c for c in accept if c != "raw")


def measure_profile(kv: np.ndarray, dtype: str, codecs=LOSSLESS + LOSSY, reps: int = 3) -> dict:
    """PROFILE entries measured on this machine for kv (one chunk): ratio, encode/decode GB/s.

    The ratio is measured for dtype and assumed to scale by itemsize for the other dtypes.
    """
    import time
    from kdn.core.codecs import _CODECS
    header = {"layers": kv.shape[0], "heads": kv.shape[2], "tokens": kv.shape[3],
              "head_dim": kv.shape[4], "dtype": dtype, "raw": kv.nbytes}
    out = {"raw": PROFILE["raw"]}
    for name in codecs:
        enc, dec = _CODECS[name]
        best_e = best_d = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            payload = memoryview(enc(kv, dtype)).cast("B")
            t1 = time.perf_counter()
            dec(payload, dict(header, nbytes=payload.nbytes))
            t2 = time.perf_counter()
            best_e, best_d = min(best_e, t1 - t0), min(best_d, t2 - t1)
        ratio = kv.nbytes / payload.nbytes
        size = DTYPES[dtype][2]
        by_dtype = {d: (ratio * DTYPES[d][2] / size if name in LOSSY else ratio) for d in DTYPES}
        out[name] = {"ratio": by_dtype, "encode_gbps": kv.nbytes / best_e / 1e9,
                     "decode_gbps": kv.nbytes / best_d / 1e9}
    return out


def check_store_codec(codec, role: str = "edge") -> str:
    """How a node of `role` ("edge" or "origin") may store chunks: "raw" or a registered codec;
    the origin only losslessly."""
    if not isinstance(codec, str) or codec not in codecs():
        raise BadRequest(f"{role} store codec must be one of {', '.join(codecs())}, got {codec!r:.60}")
    if role == "origin" and codec in LOSSY:
        raise BadRequest(f"the origin cannot store chunks with lossy codec {codec!r}: it holds the "
                         f"exact KV every copy is checked against; use one of raw, "
                         f"{', '.join(LOSSLESS)} (lossy codecs are for edges: edge store_codec)")
    return codec
