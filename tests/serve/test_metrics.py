"""The service's Prometheus exposition and `kdn status` lines (kdn.serve.metrics), from a
snapshot as the ingress writes it; the live service's /metrics and `kdn status` are checked
in tests/serve/test_serve.py, with promtool on the real output there too."""
import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kdn.serve.metrics import exposition, merged, summary_lines

SNAPSHOT = {"replicas": 2,
            "counters": {"requests": 9, "region_us-east": 5, "region_eu-west": 3, "route_home": 4,
                         "route_cross_region_queue": 2, "route_pinned": 2, "route_decisions": 6,
                         "route_decision_us": 120, "tier_engine": 5, "tier_unknown": 1, "errors_429": 1,
                         "retried_replica_died": 1},
            "routing": {"us-east": {"engine_hit": 3, "owner": 2, "decisions": 5, "decision_us": 40, "rechosen": 7},
                        "eu-west": {"routed_away_queue": 1, "decisions": 1, "decision_us": 9,
                                    "replicas_died": 1}},
            "kv_sources": {"us-east": {"engine": 3, "edge_memory": 1, "edge_disk": 1},
                           "eu-west": {"peer": 1, "none": 1}}}


def _samples(text: str) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_every_decision_is_exported_by_outcome_tier_and_region():
    got = _samples(exposition(SNAPSHOT).decode())
    assert got[("kdn_serve_region_decisions_total", (("outcome", "cross_region_queue"),))] == 2
    assert got[("kdn_serve_region_decisions_total", (("outcome", "pinned"),))] == 2
    assert got[("kdn_serve_region_tier_total", (("tier", "engine"),))] == 5
    assert got[("kdn_serve_region_requests_total", (("region", "eu-west"),))] == 3
    assert got[("kdn_serve_replica_decisions_total", (("outcome", "engine_hit"), ("region", "us-east")))] == 3
    assert got[("kdn_serve_replica_decisions_total", (("outcome", "routed_away_queue"), ("region", "eu-west")))] == 1
    assert got[("kdn_serve_replica_decision_seconds_count", (("region", "us-east"),))] == 5
    assert got[("kdn_serve_replica_decision_seconds_sum", (("region", "us-east"),))] == pytest.approx(40e-6)
    assert got[("kdn_serve_region_decision_seconds_count", ())] == 6
    assert got[("kdn_serve_replicas_died_total", (("region", "eu-west"),))] == 1
    assert got[("kdn_serve_replica_rechosen_total", (("region", "us-east"),))] == 7
    assert got[("kdn_serve_errors_total", (("code", "429"),))] == 1
    assert got[("kdn_serve_retries_total", ())] == 1 and got[("kdn_serve_ingress_replicas", ())] == 2
    assert got[("kdn_serve_kv_source_total", (("region", "us-east"), ("source", "edge_disk")))] == 1
    assert got[("kdn_serve_kv_source_total", (("region", "us-east"), ("source", "engine")))] == 3
    assert got[("kdn_serve_kv_source_total", (("region", "eu-west"), ("source", "origin")))] == 0


def test_region_replicas_kv_sources_are_merged_per_replica_then_summed():
    """Both ingress replicas hear of the same region replicas: a replica's count is the
    largest either heard (one heard it later), never the two added."""
    a = {"counters": {"requests": 2}, "kv_sources": {"us-east": {"r1": {"engine": 4, "edge_memory": 1},
                                                                "r2": {"edge_disk": 2}}}}
    b = {"counters": {"requests": 3}, "kv_sources": {"us-east": {"r1": {"engine": 5}},
                                                     "eu-west": {"r9": {"origin": 1}}}}
    got = merged([a, b])
    assert got["counters"] == {"requests": 5} and got["replicas"] == 2
    assert got["kv_sources"] == {"us-east": {"engine": 5, "edge_memory": 1, "edge_disk": 2},
                                 "eu-west": {"origin": 1}}
    assert merged([]) == {}


def test_an_empty_service_exports_zeros_not_an_error():
    got = _samples(exposition({}).decode())
    assert got[("kdn_serve_requests_total", ())] == 0


def promtool_check(text: bytes) -> None:
    """`promtool check metrics` on an exposition (skipped, saying so, where promtool is absent)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=60)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), (r.stdout, r.stderr)


def test_promtool_finds_nothing_to_fix():
    promtool_check(exposition(SNAPSHOT))


def test_status_lines_say_each_kind_of_decision():
    lines = "\n".join(summary_lines(SNAPSHOT))
    assert "regions: 6 decisions (20 us mean): home 4, cross region queue 2, pinned 2" in lines
    assert "KV expected in: engine 5, unknown 1" in lines
    assert "us-east replicas: 5 decisions (8 us mean): engine hit 3, owner 2; asked again 7 times" in lines
    assert "eu-west replicas: 1 decisions (9 us mean): routed away queue 1, 1 replicas died" in lines
    assert "9 requests, 1 retried (replica died)" in lines
    assert "us-east answers' KV from: engine 3, edge memory 1, edge disk 1" in lines
    assert "eu-west answers' KV from: peer 1, none 1" in lines
    assert summary_lines({}) == ["  routing: no decisions yet"]
