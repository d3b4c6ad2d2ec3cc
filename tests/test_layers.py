"""The package layout is the architecture: layers import downward only, the vocabulary and the
nodes never load torch, and the wheel holds every package folder.

The layers and what each may import are tools/code_health.py's LAYERS table (docs/architecture.md
draws it); these tests hold the tree to it.
"""
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_the_vocabulary_and_the_nodes_start_without_torch_or_the_upper_layers():
    """An edge or origin actor imports its node module and the vocabulary: neither loads torch
    (hundreds of MiB an actor that only moves bytes never needs), the client, the engines or
    the service."""
    health = _health()
    core = sorted(m for m in health.modules() if m.startswith("kdn.core"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in core + ["kdn.edge.node", "kdn.origin.node"])
            + "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(("
            "'kdn.client', 'kdn.engines', 'kdn.serve', 'kdn.launch', 'kdn.cli', 'kdn.bench')))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_the_wheel_holds_every_package_folder(tmp_path):
    """pyproject.toml lists packages by hand (the four code folders install as one namespace):
    a folder left off the list would be missing from an installed KDN."""
    src = tmp_path / "src"            # a copy: the build leaves build/ and egg-info behind
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("kdn", "edge", "origin", "placement"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(src)], check=True, capture_output=True, timeout=300)
    wheel = next(tmp_path.glob("kdn-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    folders = {"kdn": ROOT / "kdn", "kdn/edge": ROOT / "edge", "kdn/origin": ROOT / "origin",
               "kdn/placement": ROOT / "placement"}
    expected = set()
    for prefix, folder in folders.items():
        for init in folder.rglob("__init__.py"):
            expected.add(f"{prefix}/{init.relative_to(folder).as_posix()}")
    assert expected and expected <= names, sorted(expected - names)
    assert any(n.startswith("kdn/data/") and n.endswith(".md") for n in names)
