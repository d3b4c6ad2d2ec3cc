"""The README runs as written: every fenced command and code block, on a fresh local network.

Blocks run in the README's order, each as the reader would run it (bash blocks with `bash -e`
from the repository root, Python blocks with the venv's python), with a private $KDN_HOME so
`kdn up` records its network, and its admin token, where the Python block's `connect()` and
`load_admin_token()` then find them. Each block is placed in one group below, and a block
that is in none fails the test, so a new README block cannot go untested by accident:
- run here: `kdn up`, publish, query --check, status, the Python API, `kdn serve` and the
  openai client against it, `kdn down`; on the same cluster, between the README's blocks, the
  errors a user meets with these commands (bad codecs refused before anything starts, an
  unknown KB, a missing file: exit status 2 and one line naming the culprit; a second publish
  prefills nothing), and after `kdn down` no process of the cluster may remain;
- run only with KDN_README_ALL=1 (minutes each): `make demo` and the vLLM blocks;
- not run: `make test` (it is the run this test is part of).
Each command is a separate process that finds the network through $KDN_HOME/cluster.json;
output goes to files, not pipes (the cluster's daemons must not hold a pipe of `kdn up` open).
Commands named in prose are checked too: every `kdn bench NAME` exists and every `--flag`
the prose names is one its command takes.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KDN = ROOT / ".venv" / "bin" / "kdn"
SLOW = os.environ.get("KDN_README_ALL") == "1"
REGIONS = ("us-east", "eu-west", "ap-south")


def blocks() -> list:
    """[(language, text)] of every fenced block, in order."""
    return [(m.group(1), m.group(2)) for m in
            re.finditer(r"^```(\w*)\n(.*?)^```", README.read_text(), re.S | re.M)]


def group(lang: str, text: str) -> str:
    if lang not in ("bash", "python"):
        return "illustration"             # the architecture drawing, the layout listing
    if "make test" in text:
        return "self"
    if "make demo" in text or "vllm" in text.lower():
        return "slow"
    return "run"


def run_block(lang: str, text: str, env: dict, timeout: int) -> str:
    cmd = ["bash", "-e", "-c", text] if lang == "bash" else [sys.executable, "-c", text]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"README {lang} block failed (exit {p.returncode}):\n{text}\n--- output:\n{out[-4000:]}"
    return out


def test_every_block_is_in_a_group():
    got = [(group(lang, text), lang, text.splitlines()[0]) for lang, text in blocks()]
    runs = [g for g, lang, _ in got if lang in ("bash", "python")]
    assert runs.count("self") == 1 and runs.count("run") == 5, got
    assert runs.count("slow") == 3, got     # make demo; vLLM in Python; vLLM on the command line


def test_prose_commands_exist(capsys):
    """Every `kdn bench NAME` the README names is a bench that answers --help, and every
    --flag it names is a flag of a kdn command or of one of those benches."""
    import importlib
    from kdn.bench import NAMES
    from kdn.cli import build_parser
    text = README.read_text()
    benches = set(re.findall(r"kdn bench (\w+)", text)) | set(
        re.findall(r"`(\w+)`", text[text.index("| `kdn bench keys`"):].splitlines()[0]))
    assert benches and not benches - set(NAMES), sorted(benches - set(NAMES))
    flags = set()

    def collect(parser):                 # every command's flags, nested groups' too (kdn model plan)
        for a in parser._actions:
            flags.update(a.option_strings)
            for sub in (getattr(a, "choices", None) or {}).values() if isinstance(a, argparse._SubParsersAction) else ():
                collect(sub)
    collect(build_parser())
    for name in sorted(benches):
        with pytest.raises(SystemExit) as done:
            importlib.import_module(f"kdn.bench.{name}").main(["--help"])
        assert done.value.code == 0, name
        flags |= set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out))
    named = set(re.findall(r"`(?:kdn \w+ )?(--[a-z][a-z-]+)", text))
    assert named and not named - flags, sorted(named - flags)


@pytest.mark.skipif(not KDN.exists(), reason=f"{KDN} is missing: the README's commands use the "
                                              "venv `make` creates")
class Runner:
    """Runs `kdn ARGS` with KDN_HOME set; returns (exit status, stdout, stderr)."""

    def __init__(self, env: dict, logs: Path):
        self.env, self.logs, self.n = env, logs, 0

    def __call__(self, *args, timeout=180):
        self.n += 1
        out, err = self.logs / f"{self.n}.out", self.logs / f"{self.n}.err"
        with open(out, "w") as fo, open(err, "w") as fe:
            rc = subprocess.run([str(KDN)] + list(args), stdout=fo, stderr=fe, env=self.env, cwd=ROOT,
                                stdin=subprocess.DEVNULL, timeout=timeout).returncode
        return rc, out.read_text(), err.read_text()


def _error_lines(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("kdn: error:")]


def _recorded_pids(state: dict) -> list:
    """The pids `kdn up` recorded (each as [pid, start time], or a bare pid)."""
    return [r[0] if isinstance(r, (list, tuple)) else r for r in state.get("pids", [])]


def _process_tree(pids) -> dict:
    """{pid: create_time} of these processes and all their descendants (those alive now)."""
    out = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
            for q in [p] + p.children(recursive=True):
                out[q.pid] = q.create_time()
        except psutil.Error:
            continue
    return out


def _still_running(tree: dict) -> list:
    alive = []
    for pid, created in tree.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {p.name()}")
        except psutil.Error:
            continue
    return alive


def _refused_before_start(kdn, state_file):
    rc, out, err = kdn("up", "--edge-codec", "gz")
    assert rc == 2 and not state_file.exists(), "a bad codec is refused before anything starts"
    lines = _error_lines(err)
    assert len(lines) == 1 and "edge store codec must be one of" in lines[0] and "'gz'" in lines[0]
    rc, out, err = kdn("up", "--origin-codec", "q8z")
    assert rc == 2 and not state_file.exists() and "lossy codec 'q8z'" in err


def _errors_on_a_running_network(kdn, tmp_path):
    """What a user meets on the network `kdn up` started, after the README's first block."""
    rc, out, err = kdn("status")
    assert rc == 0 and "origin: up" in out, out + err
    edges = sorted(line.split()[:3] for line in out.splitlines()
                   if line.split()[:1] and line.split()[0] in {f"{r}-0" for r in REGIONS})
    assert edges == sorted([f"{r}-0", r, "up"] for r in REGIONS), out
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kdn" / "data").glob("0*.md"))
    rc, out, err = kdn("publish", "founding", *docs)       # the README's KB, again
    assert rc == 0, err
    assert "default/founding v1 unchanged" in out and "prefilled 0 tokens" in out and "sent 0 chunks" in out
    assert "fetched 0.0 MiB" in out, "an unchanged KB is found held by key: no KV read back"
    rc, out, err = kdn("query", "no-such-kb", "Anything?", "--max-new-tokens", "4")
    lines = _error_lines(err)
    assert rc == 2 and len(lines) == 1 and "'no-such-kb'" in lines[0], err
    missing = tmp_path / "missing.md"
    rc, out, err = kdn("publish", "founding", docs[0], str(missing))
    lines = _error_lines(err)
    assert rc == 2 and len(lines) == 1 and str(missing) in lines[0] and "no such file" in lines[0], err


def test_readme_runs_as_written(tmp_path):
    home, logs = tmp_path / "kdn-home", tmp_path / "logs"
    logs.mkdir()
    env = dict(os.environ, KDN_HOME=str(home))
    env.pop("RAY_ADDRESS", None)
    env.pop("KDN_OBJECT_STORE_FILL_BYTES", None)     # the reader's default (tests/conftest.py)
    kdn, state_file = Runner(env, logs), home / "cluster.json"
    _refused_before_start(kdn, state_file)
    outputs, tree, checked_up = [], {}, False
    try:
        for lang, text in blocks():
            g = group(lang, text)
            if not (g == "run" or (g == "slow" and SLOW)):
                continue
            if "kdn down" in text and state_file.exists():
                tree = _process_tree(_recorded_pids(json.loads(state_file.read_text())))
            outputs.append((text, run_block(lang, text, env, timeout=1200 if g == "slow" else 600)))
            if "kdn up" in text and not checked_up:     # the block that starts the network
                checked_up = True
                state = json.loads(state_file.read_text())
                assert state["embedded"] and state["pids"] and Path(state["root"]) == home / "origin"
                assert set(_recorded_pids(state)) <= set(_process_tree(_recorded_pids(state)))
                _errors_on_a_running_network(kdn, tmp_path)
    finally:
        if state_file.exists():
            subprocess.run([str(KDN), "down"], cwd=ROOT, env=env, capture_output=True, timeout=120)
    up, api, serve, openai, down = [out for text, out in outputs
                                    if "make demo" not in text and "vllm" not in text.lower()]
    # the query's answer was checked against a full prefill, both warm, in plain words
    assert "generated tokens identical: yes" in up, up[-2000:]
    assert re.search(r"KDN was \d+(\.\d+)?x faster than a full prefill", up), up[-2000:]
    assert "4520/" in up                   # the whole knowledge base came from KDN
    # the origin's pushes to the edges on the other Ray nodes went over its HTTP frames
    assert re.search(r"origin pushes: \d+ chunks pulled by edges on other nodes from its HTTP frames", up), up[-3000:]
    # the Python block answered, fetched every knowledge token exactly, and the operator calls ran
    lines = api.strip().splitlines()
    assert lines[-1].split()[:2] == ["4520", "True"], api[-2000:]
    assert "AccessDenied" not in api and "Traceback" not in api
    # the service answered through the openai client, the knowledge's KV from KDN
    assert "http://127.0.0.1:8000/v1" in serve, serve[-2000:]
    answer, cached, turns = openai.strip().splitlines()[-3:]
    assert answer.strip() and cached == "4520", openai[-2000:]
    # the conversation's second turn read the first turn's whole chunks from KDN
    first, second = map(int, turns.split())
    assert second >= first // 256 * 256 > 0, openai[-2000:]
    # `kdn down` stopped exactly what `kdn up` started, and nothing of it remains
    assert "stopped and its embedded cluster shut down" in down, down
    assert not state_file.exists()
    assert tree and not _still_running(tree), f"left running after `kdn down`: {_still_running(tree)}"
    rc, out, err = kdn("status")
    assert rc == 2 and "kdn up" in err
    shutil.rmtree(home, ignore_errors=True)
