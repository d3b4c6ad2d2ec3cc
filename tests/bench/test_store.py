"""`kdn bench store`: both backends run and report the store beside plain I/O of the same bytes."""
import json

import pytest

from kdn.bench import store


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_bench_store_reports_both_sides(backend, capsys):
    assert store.main(["--backend", backend, "--chunks", "2", "--chunk-mib", "0.25", "--reps", "1",
                       "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["backend"] == backend and out["chunks"] == 2 and len(out["rows"]) == 5
    assert all(r["GB_s"] > 0 for r in out["rows"])
    assert [r["op"] for r in out["rows"]] == ["write", "write", "read", "read", "read"]


def test_bench_store_refuses_url_without_s3():
    with pytest.raises(SystemExit):
        store.main(["--url", "s3://kdn-origin/x"])
