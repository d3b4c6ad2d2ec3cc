"""The package layout is the architecture: layers import downward only, the vocabulary and the
nodes never load torch, and the wheel holds every package folder.

The layers and what each may import are tools/code_health.py's LAYERS table (docs/architecture.md
draws it); these tests hold the tree to it.
"""
import ast
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kdn.core.errors import BadRequest

ROOT = Path(__file__).resolve().parents[1]


def _health():
    spec = importlib.util.spec_from_file_location("code_health", ROOT / "tools" / "code_health.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_module_imports_a_layer_above_its_own():
    health = _health()
    mods = health.modules()
    graph = health.import_graph(mods)
    assert health.layer_violations(graph) == []
    assert health.cycles(graph) == []
    # every module is in a layer or in the tooling (cli, bench, testing): nothing left loose
    loose = [m for m in mods if health.layer_of(m) is None
             and not m.startswith(("kdn.cli", "kdn.bench", "kdn.testing")) and m != "kdn"]
    assert loose == []


def test_no_import_circle_even_through_imports_inside_functions():
    """An import deferred into a function is still a dependency: the engine interface
    (kdn.engines.base) once imported both engines inside load_engine, and each engine
    imported base.Answer. The interface now names its implementations by module path."""
    health = _health()
    assert health.cycles(health.import_graph(health.modules(), deferred=True)) == []


def test_the_engine_interface_finds_its_engines_by_module_path():
    import types

    from kdn.engines import base
    model = types.SimpleNamespace(hf=types.SimpleNamespace(config=types.SimpleNamespace(max_position_embeddings=2048)))
    assert base.context_of("transformers", model) == (2048, "max_position_embeddings")
    assert base.context_of("vllm", model) == (2048, "vLLM's max_model_len")
    model.hf.config.max_position_embeddings = 1 << 20
    assert base.context_of("vllm", model)[0] == 8192              # vLLM's max_model_len
    assert base.engine_class("transformers").__name__ == "TransformersEngine"
    assert base.engine_class("vllm").name == "vllm"
    engine = base.load_engine("transformers", types.SimpleNamespace(fingerprint="fp"), "kv_both")
    assert (engine.name, engine.fingerprint) == ("transformers", "fp")
    with pytest.raises(BadRequest, match="engine must be one of transformers, vllm, got 'sglang'"):
        base.load_engine("sglang", model)


def test_no_function_outside_the_benchmarks_is_over_80_lines():
    """A function fits in a reader's head: the longest, outside kdn/bench, is at most 80
    lines (the simulator's run was 169, ReplicationPolicy.decide 108, ...)."""
    health = _health()
    longest = health.longest_functions(health.modules(), n=5)
    assert [(n, where) for n, where in longest if n > 80] == []


def test_no_node_method_is_called_by_a_string_and_one_module_reads():
    """Every call to a node goes through a stub of kdn.core.interfaces (its arguments checked
    against the method's signature before anything is sent), and prompt-to-keys through KB
    manifests is written once, in kdn/client/reader.py, for both transports."""
    health = _health()
    mods = health.modules()
    assert health.rpc_calls_by_string(mods) == []
    assert health.readers(mods) == ["kdn/client/reader.py"]


def test_the_rpc_paths_code_health_scans_exist():
    """tools/code_health.py counts broad excepts on the RPC paths: each path names a file or
    folder that is there (a list left behind by a move once scanned kdn/rpc, gone)."""
    health = _health()
    missing = [p for p in health.RPC_PATHS if not (ROOT / p).exists()]
    assert missing == []
    scanned = {str(p.relative_to(ROOT)) for p in health.modules().values()
               if str(p.relative_to(ROOT)).startswith(health.RPC_PATHS)}
    assert {"kdn/core/rpc.py", "kdn/client/operator.py", "kdn/client/reader.py", "kdn/launch/cluster.py",
            "kdn/edge/node.py", "kdn/origin/node.py"} <= scanned


def test_the_vocabulary_and_the_nodes_start_without_torch_or_the_upper_layers():
    """An edge or origin actor imports its node module and the vocabulary: neither loads torch
    (hundreds of MiB an actor that only moves bytes never needs), the client, the engines or
    the service."""
    health = _health()
    core = sorted(m for m in health.modules() if m.startswith("kdn.core"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core + ["kdn.edge.node", "kdn.origin.node"])
            + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(("
            "'kdn.client', 'kdn.engines', 'kdn.integrations', 'kdn.serve', 'kdn.launch', 'kdn.cli', 'kdn.bench')))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_the_wheel_holds_every_package_folder(tmp_path):
    """pyproject.toml finds the packages under kdn/: every module of the tree is in the
    wheel, under the path it has here (its import name)."""
    src = tmp_path / "src"            # a copy: the build leaves build/ and egg-info behind
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(ROOT / "kdn", src / "kdn", ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("kdn-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "kdn").rglob("*.py")}
    assert {"kdn/edge/node.py", "kdn/origin/node.py", "kdn/placement/ring.py"} <= expected
    assert expected <= names, sorted(expected - names)
    assert any(n.startswith("kdn/data/") and n.endswith(".md") for n in names)


def test_the_suites_longest_modules_named_first_exist():
    """tests/conftest.py starts the minutes-long modules first: a module renamed away would
    silently start last and leave one worker running it alone."""
    text = (ROOT / "tests" / "conftest.py").read_text()
    names = ast.literal_eval(text[text.index("LONGEST_FIRST = ") + len("LONGEST_FIRST = "):].split("\n\n")[0])
    assert len(names) > 10 and [p for p in names if not (ROOT / "tests" / p).exists()] == []
