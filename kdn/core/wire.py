"""The edge HTTP API's wire format, shared by its server (kdn/edge/http.py) and KDN's HTTP client (kdn/client/http.py).

A fetch answer is kdn.core.chunk frames back to back (FRAMES_TYPE) with headers that describe
them. X-KDN-Sources says where each chunk came from, run-length coded so that its size
follows the number of changes of source, not of chunks: "local*120,peer:eu-west-0*3,origin"
(a run of one has no count). An answer stops at MAX_SOURCE_RUNS runs (X-KDN-More: 1), so
the header stays far below what HTTP parsers accept on one line (http.client: 64 KiB).
"""
from kdn.core.errors import BadRequest

FRAMES_TYPE = "application/x-kdn-frames"
MSGPACK_TYPE = "application/msgpack"
ORIGIN_UNREACHABLE = "origin_unreachable"   # an edge's 503 error: a store the origin had to take got no answer
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"   # Prometheus text 0.0.4: /metrics of
                                                            # an edge and of `kdn serve` alike
MAX_SOURCE_RUNS = 512            # runs of ~20 characters: ~10 KiB of header at most


def source_runs(sources) -> list:
    """[(source, count)] of consecutive equal sources."""
    runs = []
    for s in sources:
        if runs and runs[-1][0] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    return [tuple(r) for r in runs]


def pack_sources(sources) -> str:
    return ",".join(s if n == 1 else f"{s}*{n}" for s, n in source_runs(sources))


def unpack_sources(text: str, limit: int) -> list:
    """The source of each chunk from an X-KDN-Sources value (at most limit of them)."""
    out = []
    for part in filter(None, (text or "").split(",")):
        source, star, count = part.partition("*")
        n = int(count) if star and count.isdigit() else 1 if not star else -1
        if n < 1 or len(out) + n > limit:
            raise BadRequest(f"X-KDN-Sources entry {part[:80]!r} is not SOURCE or SOURCE*COUNT "
                             f"within {limit} chunks")
        out += [source] * n
    return out
