"""X-KDN-Sources stays small: run-length coded, read back exactly, and refused when it lies."""
import http.client

import pytest

from kdn.core.wire import MAX_SOURCE_RUNS, pack_sources, source_runs, unpack_sources
from kdn.core.errors import BadRequest


def test_sources_round_trip_run_length_coded():
    sources = ["local"] * 120 + ["peer:eu-west-0"] * 3 + ["origin"] + ["local"] * 2
    text = pack_sources(sources)
    assert text == "local*120,peer:eu-west-0*3,origin,local*2"
    assert unpack_sources(text, len(sources)) == sources
    assert source_runs(["a", "a", "b"]) == [("a", 2), ("b", 1)]
    assert pack_sources([]) == "" and unpack_sources("", 0) == []
    assert unpack_sources("local,origin", 2) == ["local", "origin"], "the old form still reads"


def test_a_long_fetch_has_a_short_header():
    """16384 chunks from three sources: once ~200 KB of header (LineTooLong past ~11,000)."""
    sources = ["local"] * 9000 + ["peer:ap-south-0"] * 5000 + ["origin"] * 2384
    text = pack_sources(sources)
    assert len(text) < 64 and unpack_sources(text, 16384) == sources
    worst = pack_sources(["local", "peer:ap-south-0"] * (MAX_SOURCE_RUNS // 2))
    assert len(worst) < http.client._MAXLINE // 4, "an answer of MAX_SOURCE_RUNS runs still fits"


@pytest.mark.parametrize("text", ["local*0", "local*-1", "local*x", "local*99", "local*3,origin*7"])
def test_a_header_that_does_not_add_up_is_refused(text):
    with pytest.raises(BadRequest, match="X-KDN-Sources entry"):
        unpack_sources(text, 8)
