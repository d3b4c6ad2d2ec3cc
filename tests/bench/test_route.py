"""`kdn bench route` without the model: the bound it prints beside its result, and its replay."""
import pytest

from kdn.bench import route

# costs as measured on 2 CPU cores (docs/figures.md, session 9): fetch + rebuild are small next
# to the question's own prefill
CPU = {"fetch_s": 0.012, "rebuild_s": 0.0112, "first_token_s": 0.267, "decode_step_s": 0.073,
       "kv_bytes": 90 << 20}


def test_the_bound_is_the_hit_miss_ratio_and_says_when_the_goal_is_out_of_reach():
    b = route.bound(CPU, new_tokens=16)
    assert b["hit_speedup"] == pytest.approx(1 + 0.0232 / 0.267) and 1.08 < b["hit_speedup"] < 1.1
    assert b["service_ratio"] == pytest.approx(1 + 0.0232 / (0.267 + 15 * 0.073))
    assert not b["goal_reachable"]
    slow_miss = dict(CPU, rebuild_s=0.2)          # a miss that costs a prefill: routing can win
    assert route.bound(slow_miss, 16)["goal_reachable"]


def test_on_cpu_costs_no_policy_beats_default_by_much_more_than_the_bound():
    trace = route.zipf_trace(400, 8, 1.1, rate_hz=2 * 0.7 / (0.267 + 0.0232 + 15 * 0.073), seed=0)
    rows = {pol: route.replay(pol, trace, CPU, 2, 2, 16, seed=0) for pol in ("kv", "default", "oracle")}
    assert rows["kv"]["engine_hit_pct"] > rows["default"]["engine_hit_pct"]
    b = route.bound(CPU, 16)
    for pol in ("kv", "oracle"):
        speedup = rows["default"]["ttft_p50_s"] / rows[pol]["ttft_p50_s"]
        assert speedup < b["hit_speedup"] * 1.1 < route.GOAL_P50_SPEEDUP
