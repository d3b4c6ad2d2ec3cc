"""kdn bench agent's arithmetic on made-up turns (no model, no network): the cached share of
what earlier turns computed excepts only the last partial chunk, identical tokens are counted
against the off mode on the conversations both ran, and the table prints every mode."""
from kdn.bench.agent import MODES, report, summarize


def turn(prompt, cached, tokens=(1, 2), ttft=1.0, chunks=0):
    return {"ttft_s": ttft, "prompt": prompt, "cached": cached, "tokens": list(tokens), "text": "x",
            "fetched_bytes": chunks * 256 * 10, "region": None}


def results():
    r = {}
    for m in MODES:
        n = 1 if m in ("off", "kb") else 2
        r[m] = [[turn(1100, 0 if m == "off" else 1000), turn(2000, 0 if m in ("off", "kb") else 1024,
                                                                 tokens=(9,) if m == "kb" else (1, 2))]
                for _ in range(n)] + [[None, None] for _ in range(2 - n)]
    return r


def test_the_cached_share_excepts_only_the_last_partial_chunk(capsys):
    out = summarize(results(), conversations=2, turns=2, baseline=1, kb_tokens=1000, kv_bytes_per_token=10)
    row = {(x["mode"], x["turn"]): x for x in out["rows"]}
    # turn 2: turn 1 computed 1,100 prompt tokens and 2 answer tokens: 1,024 of them whole chunks
    assert row[("cached", 2)]["cached_share"] == 1.0 and row[("kb", 2)]["cached_share"] == 0.0
    assert row[("cached", 1)]["cached_share"] == 1.0          # turn 1: the KB's 1,000 tokens
    assert row[("cached", 2)]["conversations"] == 2 and row[("off", 2)]["conversations"] == 1
    assert out["identical_to_off"] == {"off": 1.0, "kb": 0.5, "cached": 1.0, "replica": 1.0, "moved": 1.0,
                                       "limit": 1.0}     # vLLM's own kernels: never compared
    report(dict(out, move_at=1), 1)
    printed = capsys.readouterr().out
    assert "cached/limit" in printed and "replica/limit" in printed and "vllm p50 s" in printed and "identical greedy tokens to off: off 100%, kb 50%" in printed


def test_a_mode_that_did_not_run_has_no_rows_and_the_table_says_so(capsys):
    r = results()
    r["vllm"] = [[None, None], [None, None]]         # vLLM not installed
    out = summarize(r, conversations=2, turns=2, baseline=1, kb_tokens=1000, kv_bytes_per_token=10)
    assert not [x for x in out["rows"] if x["mode"] == "vllm"]
    report(dict(out, move_at=1), 1)
    printed = capsys.readouterr().out
    assert "vllm p50 s" not in printed and "the single-engine anchor did not run" in printed


def test_a_run_of_some_modes_reports_those_and_their_ratios_only(capsys):
    r = {m: v for m, v in results().items() if m in ("replica", "limit")}
    out = summarize(r, conversations=2, turns=2, baseline=1, kb_tokens=1000, kv_bytes_per_token=10)
    assert {x["mode"] for x in out["rows"]} == {"replica", "limit"}
    report(dict(out, move_at=1), 1)
    printed = capsys.readouterr().out
    assert "replica p50 s" in printed and "cached p50 s" not in printed and "1.00x" in printed
