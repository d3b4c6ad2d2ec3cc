"""The README runs as written: every fenced command and code block, on a fresh local network.

Blocks run in the README's order, each as the reader would run it (bash blocks with `bash -e`
from the repository root, Python blocks with the venv's python), with a private $KDN_HOME so
`kdn up` records its network, and its admin token, where the Python block's `connect()` and
`load_admin_token()` then find them. Each block is placed in one group below, and a block
that is in none fails the test, so a new README block cannot go untested by accident:
- run here: `kdn up`, publish, query --check, status, the Python API, `kdn serve` and the
  openai client against it, `kdn down`;
- run only with KDN_README_ALL=1 (minutes each): `make demo` and the vLLM blocks;
- not run: `make test` (it is the run this test is part of).
Commands named in prose are checked too: every `kdn bench NAME` exists and every `--flag`
the prose names is one its command takes.
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KDN = ROOT / ".venv" / "bin" / "kdn"
SLOW = os.environ.get("KDN_README_ALL") == "1"


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
    parser = build_parser()
    for action in parser._subparsers._group_actions:
        for sub in action.choices.values():
            flags |= {o for a in sub._actions for o in a.option_strings}
    for name in sorted(benches):
        with pytest.raises(SystemExit) as done:
            importlib.import_module(f"kdn.bench.{name}").main(["--help"])
        assert done.value.code == 0, name
        flags |= set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out))
    named = set(re.findall(r"`(?:kdn \w+ )?(--[a-z][a-z-]+)", text))
    assert named and not named - flags, sorted(named - flags)


@pytest.mark.skipif(not KDN.exists(), reason=f"{KDN} is missing: the README's commands use the "
                                              "venv `make` creates")
def test_readme_runs_as_written(tmp_path):
    env = dict(os.environ, KDN_HOME=str(tmp_path / "kdn-home"))
    env.pop("RAY_ADDRESS", None)
    outputs = []
    try:
        for lang, text in blocks():
            g = group(lang, text)
            if g == "run" or (g == "slow" and SLOW):
                outputs.append((text, run_block(lang, text, env, timeout=1200 if g == "slow" else 600)))
    finally:
        if (tmp_path / "kdn-home" / "cluster.json").exists():
            subprocess.run([str(KDN), "down"], cwd=ROOT, env=env, capture_output=True, timeout=120)
    up, api, serve, openai, down = [out for text, out in outputs
                                    if "make demo" not in text and "vllm" not in text.lower()]
    # the query's answer was checked against a full prefill, both warm, in plain words
    assert "generated tokens identical: yes" in up, up[-2000:]
    assert re.search(r"KDN was \d+(\.\d+)?x faster than a full prefill", up), up[-2000:]
    assert "4520/" in up                   # the whole knowledge base came from KDN
    # the Python block answered, fetched every knowledge token exactly, and the operator calls ran
    lines = api.strip().splitlines()
    assert lines[-1].split()[:2] == ["4520", "True"], api[-2000:]
    assert "AccessDenied" not in api and "Traceback" not in api
    # the service answered through the openai client, the knowledge's KV from KDN
    assert "http://127.0.0.1:8000/v1" in serve, serve[-2000:]
    answer, cached = openai.strip().splitlines()[-2:]
    assert answer.strip() and cached == "4520", openai[-2000:]
    assert "is down" in down or "stopped" in down, down
    assert not (tmp_path / "kdn-home" / "cluster.json").exists()
    shutil.rmtree(tmp_path / "kdn-home", ignore_errors=True)
