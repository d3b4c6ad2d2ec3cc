"""The `kdn` command as a user runs it: separate processes, one embedded cluster, real model.

`kdn up` starts a 3-region cluster whose processes outlive it; every later command is a new
process that finds the network through $KDN_HOME/cluster.json (a temporary KDN_HOME here, so
nothing touches the user's own state), with edges and the origin storing chunks zstd-compressed
(after two bad codec settings are refused). The test publishes a small markdown file, publishes
it again (no prefill), queries it with --check, checks the errors a user meets (unknown KB,
missing file: exit status 2 and one line naming the culprit), and ends with `kdn down`,
after which no process of that cluster may remain. `kdn down` runs in a finally block.
Output goes to files, not pipes: the cluster's daemons must not hold a pipe of `kdn up` open.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kdn.knowledge import bundled_documents

REGIONS = ("us-east", "eu-west", "ap-south")


def _kdn_command() -> list:
    script = Path(sys.executable).with_name("kdn")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kdn.cli"]


class Runner:
    """Runs `kdn ARGS` with KDN_HOME set; returns (exit status, stdout, stderr)."""

    def __init__(self, home: Path, logs: Path):
        # One torch thread: on a busy 2-core machine two OpenMP threads per process fight
        # everything else for the cores and a prefill gets several times slower.
        self.env = dict(os.environ, KDN_HOME=str(home), OMP_NUM_THREADS="1")
        self.logs, self.n = logs, 0
        self.seconds = []                      # (command, wall seconds): where the time went

    def __call__(self, *args, timeout=180):
        self.n += 1
        out, err = self.logs / f"{self.n}.out", self.logs / f"{self.n}.err"
        t0 = time.perf_counter()
        with open(out, "w") as fo, open(err, "w") as fe:
            rc = subprocess.run(_kdn_command() + list(args), stdout=fo, stderr=fe, env=self.env,
                                stdin=subprocess.DEVNULL, timeout=timeout).returncode
        self.seconds.append((args[0], round(time.perf_counter() - t0, 1)))
        return rc, out.read_text(), err.read_text()


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


def _error_lines(err: str) -> list:
    return [line for line in err.splitlines() if line.startswith("kdn: error:")]


def test_up_status_publish_query_errors_down(tmp_path):
    home, logs = tmp_path / "home", tmp_path / "logs"
    logs.mkdir()
    kdn = Runner(home, logs)
    doc = tmp_path / "rights.md"
    doc.write_text(dict(bundled_documents())["bill-of-rights"], encoding="utf-8")
    state_file = home / "cluster.json"
    tree = {}
    try:
        rc, out, err = kdn("up", "--edge-codec", "gz")
        assert rc == 2 and not state_file.exists(), "a bad codec is refused before anything starts"
        lines = _error_lines(err)
        assert len(lines) == 1 and "edge store_codec must be one of" in lines[0] and "'gz'" in lines[0]
        rc, out, err = kdn("up", "--origin-codec", "q8z")
        assert rc == 2 and not state_file.exists() and "lossy codec 'q8z'" in err

        # edges and the origin store chunks zstd-compressed (lossless: answers stay identical)
        rc, out, err = kdn("up", "--edge-codec", "zstd", "--origin-codec", "zstd", timeout=240)
        assert rc == 0, err
        assert "is up on an embedded local cluster" in out
        state = json.loads(state_file.read_text())
        assert state["embedded"] and state["pids"] and state["network"] == "kdn"
        assert Path(state["root"]) == home / "origin"
        tree = _process_tree(state["pids"])
        assert set(state["pids"]) <= set(tree), "every recorded process runs after `kdn up`"

        rc, out, err = kdn("status")
        assert rc == 0 and "origin: up" in out, out + err
        edge_rows = [line.split() for line in out.splitlines() if line.split()[:1]
                     and line.split()[0] in {f"{r}-0" for r in REGIONS}]
        assert sorted((row[0], row[1], row[2], row[3]) for row in edge_rows) == sorted(
            (f"{r}-0", r, "up", "zstd") for r in REGIONS), out

        rc, out, err = kdn("publish", "rights", str(doc))
        assert rc == 0, err
        assert "default/rights v1 committed" in out and "reused 0 from the network" in out
        rc, out, err = kdn("publish", "rights", str(doc))
        assert rc == 0, err
        assert "default/rights v1 unchanged" in out
        assert "prefilled 0 tokens" in out and "sent 0 chunks" in out

        rc, out, err = kdn("query", "rights", "What does the Eighth Amendment forbid?",
                           "--check", "--max-new-tokens", "8")
        assert rc == 0, err
        assert out.strip(), "the answer is printed"
        assert "identical: yes" in err
        assert "prompt tokens from KDN" in err

        rc, out, err = kdn("query", "no-such-kb", "Anything?", "--max-new-tokens", "4")
        assert rc == 2
        lines = _error_lines(err)
        assert len(lines) == 1 and "'no-such-kb'" in lines[0], err

        missing = tmp_path / "missing.md"
        rc, out, err = kdn("publish", "rights", str(doc), str(missing))
        assert rc == 2
        lines = _error_lines(err)
        assert len(lines) == 1 and str(missing) in lines[0] and "no such file" in lines[0], err
    finally:
        if state_file.exists():
            tree.update(_process_tree(json.loads(state_file.read_text()).get("pids", [])))
            rc, out, err = kdn("down", timeout=120)
            assert rc == 0, err
    assert "stopped and its embedded cluster shut down" in out
    assert not state_file.exists()
    assert tree and not _still_running(tree), f"left running after `kdn down`: {_still_running(tree)}"
    rc, out, err = kdn("status")
    assert rc == 2 and "kdn up" in err
    print("seconds per command:", kdn.seconds)
