"""Code-health figures for reviews: layers, longest functions, broad excepts, import cycles.

    python tools/code_health.py [--json]

- modules per folder, and imports that cross the layers the wrong way (LAYERS below);
- the ten longest functions and largest classes outside benchmarks (kdn/bench), testing tools
  (kdn/testing) and tests;
- constants defined under one name in several modules, and hand-written type checks
  (`isinstance(x, bool) or not isinstance(...)`) that a shared validator should do;
- `except Exception` clauses in the node, client and launch modules (the RPC paths), and
  how many of them carry a comment that says why (`# noqa: BLE001 - ...`);
- import cycles between KDN's modules (module-level imports, as Python resolves them);
- RPC calls that name their method by a string (a node interface method's name passed to a
  transport, or `getattr(handle, name).remote` outside kdn/core/rpc.py, the one place where
  a stub's attribute becomes Ray's method name), and readers: modules that turn a prompt into
  chunk keys through KB manifests (`best_prefix`), which kdn/client/reader.py alone should do.
"""
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kdn"          # every module's import name is its path under the root
# The modules that make node-to-node or client calls (Ray or HTTP), by path from the root:
# the nodes, the client, the calls' own module, the launcher, the service, and the engines'
# ways to the network. Each must exist (tests/test_layers.py): a path left behind by a move
# would silently scan nothing.
RPC_PATHS = ("kdn/edge/", "kdn/origin/", "kdn/client/", "kdn/core/rpc.py", "kdn/launch/", "kdn/serve/",
             "kdn/engines/sources.py", "kdn/integrations/objects.py")


def modules():
    """{module name: path} for every KDN source file."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out[".".join(p for p in rel.parts if p != "__init__")] = path
    return out


# What each layer may import at module level (besides itself). The vocabulary imports no other
# layer; edges and the origin meet only through it; the launcher imports the nodes, never the
# reverse. Tooling (the CLI, benchmarks, test servers) may import anything.
LAYERS = {
    "kdn.core": (),
    "kdn.placement": ("kdn.core",),
    "kdn.edge": ("kdn.core", "kdn.placement"),
    "kdn.origin": ("kdn.core", "kdn.placement"),
    "kdn.client": ("kdn.core", "kdn.placement"),
    "kdn.engines": ("kdn.core", "kdn.client"),
    "kdn.integrations": ("kdn.core", "kdn.client"),
    "kdn.serve": ("kdn.core", "kdn.client", "kdn.engines"),
    "kdn.launch": ("kdn.core", "kdn.client", "kdn.placement", "kdn.edge", "kdn.origin"),
}


def layer_of(module: str):
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def layer_violations(graph) -> list:
    """[(module, imported module)] for module-level imports a layer may not make."""
    out = []
    for mod, deps in graph.items():
        layer = layer_of(mod)
        if layer is None:
            continue
        for dep in deps:
            other = layer_of(dep) or dep
            if other != layer and other not in LAYERS[layer] and dep != "kdn":
                out.append((mod, dep))
    return out


def modules_per_folder(mods) -> dict:
    out = {}
    for path in mods.values():
        folder = str(path.parent.relative_to(ROOT))
        out[folder] = out.get(folder, 0) + 1
    return dict(sorted(out.items()))


def largest_classes(mods, n=10):
    rows = []
    for name, path in mods.items():
        if ".bench" in name or ".testing" in name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                rows.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)[:n]


def repeated_constants(mods) -> dict:
    """{NAME: [modules]} for module-level UPPER_CASE names bound in more than one module
    (defined there, not imported): one constant under one name in one place."""
    seen = {}
    for name, path in mods.items():
        if ".bench" in name or ".testing" in name:
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for tgt in targets:
                if isinstance(tgt, ast.Name) and tgt.id.isupper() and len(tgt.id) > 2 \
                        and not tgt.id.startswith("_"):
                    seen.setdefault(tgt.id, []).append(name)
    return {k: v for k, v in sorted(seen.items()) if len(v) > 1}


def hand_checks(mods) -> int:
    """How many hand-written `isinstance(x, bool) or not isinstance(...)` checks remain."""
    import re
    rx = re.compile(r"isinstance\([^()]*,\s*bool\)\s*or\s*not\s*isinstance")
    return sum(len(rx.findall(p.read_text())) for n, p in mods.items() if ".bench" not in n and ".testing" not in n)


def longest_functions(mods, n=10):
    rows = []
    for name, path in mods.items():
        if ".bench" in name or ".testing" in name:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(rows, reverse=True)[:n]


def broad_excepts(mods):
    found = []
    for name, path in mods.items():
        rel = str(path.relative_to(ROOT))
        if ".bench" in name or ".testing" in name or not rel.startswith(RPC_PATHS):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines, 1):
            s = line.strip()
            if s.startswith("except Exception") or s.startswith("except BaseException") or s == "except:":
                found.append({"where": f"{rel}:{i}", "why": "#" in s})
    return found


# Functions that send a call to a node, or wrap one that does: a node method's name passed
# to one of these as a string is a call that no signature checks.
TRANSPORTS = {"call", "call_sync", "try_call", "start", "ask", "edge_at", "broadcast", "_each_edge",
              "origin", "edge", "nearest", "at", "stub", "later"}


def _interface_methods() -> set:
    sys.path.insert(0, str(ROOT))
    from kdn.core.interfaces import EdgeAPI, OriginAPI, methods
    return set(methods(EdgeAPI)) | set(methods(OriginAPI))


def rpc_calls_by_string(mods) -> list:
    """Where a node method is named by a string: passed to a transport, or getattr'd for .remote."""
    names, found = _interface_methods(), []
    for path in mods.values():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            f = node.func
            named = f.attr in TRANSPORTS and any(
                isinstance(a, ast.Constant) and a.value in names for a in node.args[:2])
            by_getattr = (f.attr == "remote" and isinstance(f.value, ast.Call)
                          and getattr(f.value.func, "id", None) == "getattr"
                          and rel != "kdn/core/rpc.py")
            if named or by_getattr:
                found.append(f"{rel}:{node.lineno}")
    return found


def readers(mods) -> list:
    """Modules that compute a prompt's chunk keys through KB manifests (call best_prefix)."""
    out = []
    for name, path in mods.items():
        if name == "kdn.core.manifest":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "best_prefix":
                out.append(str(path.relative_to(ROOT)))
                break
    return out


def import_graph(mods, deferred=False):
    """module -> KDN modules it imports: at module level, or (deferred) anywhere, function
    bodies included (an import hidden in a function is still a dependency)."""
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        deps = set()
        for node in (ast.walk(tree) if deferred else tree.body):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                base = node.module
                deps.add(base)
                deps |= {f"{base}.{a.name}" for a in node.names}
        graph[name] = sorted(d for d in deps if d in mods and d != name)
    return graph


def cycles(graph):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    mods = modules()
    longest = longest_functions(mods)
    excepts = broad_excepts(mods)
    cyc = cycles(import_graph(mods))
    deferred = [c for c in cycles(import_graph(mods, deferred=True)) if c not in cyc]
    folders = modules_per_folder(mods)
    violations = layer_violations(import_graph(mods))
    classes = largest_classes(mods)
    repeated = repeated_constants(mods)
    checks = hand_checks(mods)
    by_string = rpc_calls_by_string(mods)
    reading = readers(mods)
    print("modules per folder:")
    for folder, n in folders.items():
        print(f"  {n:4d}  {folder}")
    print(f"imports across layers the wrong way: {len(violations)}")
    for mod, dep in violations:
        print(f"  {mod} -> {dep}")
    print("ten largest classes (outside benchmarks):")
    for n, where in classes:
        print(f"  {n:4d}  {where}")
    print(f"constants bound under one name in several modules: {len(repeated)}")
    for name, where in repeated.items():
        print(f"  {name}: {', '.join(where)}")
    print(f"hand-written bool/int checks: {checks}")
    print("ten longest functions (outside benchmarks):")
    for n, where in longest:
        print(f"  {n:4d}  {where}")
    print(f"broad excepts on RPC paths: {len(excepts)} ({sum(e['why'] for e in excepts)} with a comment)")
    for e in excepts:
        print(f"  {e['where']}{'' if e['why'] else '  (no comment)'}")
    print(f"RPC calls naming their method by a string: {len(by_string)}")
    for where in by_string:
        print(f"  {where}")
    print(f"readers (prompt to keys through manifests): {len(reading)}")
    for where in reading:
        print(f"  {where}")
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"import cycles through imports inside functions: {len(deferred)}")
    for c in deferred:
        print("  " + " <-> ".join(c))
    if "--json" in argv:
        print(json.dumps({"folders": folders, "layer_violations": violations, "classes": classes,
                          "repeated_constants": repeated, "hand_checks": checks, "longest": longest, "broad_excepts": len(excepts), "cycles": cyc,
                          "rpc_calls_by_string": by_string, "readers": reading,
                          "deferred_cycles": deferred}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
