"""The simulator's --quick run: every policy, sane orderings, a JSON last line and a PNG."""
import json

from kdn.cli import main as kdn_main
from kdn.bench import placement

POLICIES = {"a_origin", "b_ring", "c_ring_lru", "d_ring_hot", "e_oracle", "f_budget_oracle"}


def test_quick_run_reports_every_policy_and_writes_a_png(tmp_path, capsys):
    png = tmp_path / "placement.png"
    assert kdn_main(["bench", "placement", "--quick", "--json", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    lines = out.strip().splitlines()
    res = json.loads(lines[-1])
    assert "policy" in out and "ring:" in out and "d_ring_hot" in out     # the readable tables
    pol = res["sim"]["policies"]
    assert set(pol) == POLICIES
    for p in pol.values():
        for k in ("mean_ms", "p99_ms", "local_share", "origin_egress_gb", "stored_gb",
                  "join_moved_gb", "leave_moved_gb"):
            assert k in p and p[k] >= 0
        assert p["p99_ms"] >= p["mean_ms"]
    a, b, d, e, f = (pol[k] for k in ("a_origin", "b_ring", "d_ring_hot", "e_oracle", "f_budget_oracle"))
    assert e["local_share"] == 1.0 and e["mean_ms"] < f["mean_ms"] <= d["mean_ms"] < b["mean_ms"]
    assert a["stored_gb"] == 0 and a["join_moved_gb"] == 0
    assert b["stored_gb"] < d["stored_gb"] <= 1.5 * b["stored_gb"] + 1e-9 < e["stored_gb"]
    assert d["local_share"] > b["local_share"] and d["replication"]["promotions"] > 0
    assert 0 < b["join_moved_gb"] < b["stored_gb"] / 4
    t = res["sim"]["targets"]
    assert t["d_over_b_stored"] <= 1.5 + 1e-9 and t["d_over_f_mean"] >= 1.0
    ring = res["ring"]
    assert ring["max_over_mean"] <= 1.10 and ring["join_moved_only_to_new"] and ring["leave_moved_only_its_own"]
    assert ring["owners_batch_us_per_key_r1"] < 50
    assert res["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_bench_ring_only(capsys):
    assert placement.main(["--ring", "--quick", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res) == {"ring"} and res["ring"]["method"] == "rendezvous"
    assert {v["vnodes"] for v in res["ring"]["vnode_ring"]} == {100, 1000}


def test_edge_disks_add_policy_g_that_serves_more_in_region(capsys):
    assert placement.main(["--sim", "--quick", "--json", "--plot", "", "--disk-capacity-factor", "4"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sim"]
    pol = res["policies"]
    assert set(pol) == POLICIES | {"g_ring_hot_disk"}
    d, g = pol["d_ring_hot"], pol["g_ring_hot_disk"]
    assert g["local_share"] > d["local_share"] and g["mean_ms"] < d["mean_ms"]
    assert 0 < g["disk_gb"] <= g["disk_capacity_gb"] + 1e-9 and g["disk_hits"] > 0
    assert 0 < g["local_share_cold"] <= g["local_share"] + 0.05
    t = res["targets"]
    assert t["g_local_share"] == g["local_share"] and isinstance(t["g_met"], bool)
    assert res["params"]["disk_capacity_factor"] == 4.0
