"""Code-health figures for reviews: longest functions, broad excepts, import cycles.

    python tools/code_health.py [--json]

- the ten longest functions outside benchmarks (kdn/bench) and tests, with line counts;
- `except Exception` clauses in the node, client and launch modules (the RPC paths), and
  how many of them carry a comment that says why (`# noqa: BLE001 - ...`);
- import cycles between KDN's modules (module-level imports, as Python resolves them).
"""
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"kdn": ROOT / "kdn", "kdn.edge": ROOT / "edge", "kdn.origin": ROOT / "origin",
            "kdn.placement": ROOT / "placement"}
RPC_PATHS = ("edge/", "origin/", "kdn/client", "kdn/reader", "kdn/operator", "kdn/rpc", "kdn/view",
             "kdn/cluster", "kdn/launch", "kdn/http_client", "kdn/publish")


def modules():
    """{module name: path} for every KDN source file."""
    out = {}
    for pkg, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([pkg] + parts)
            if name.startswith("kdn.edge") and pkg == "kdn" or name.startswith("kdn.origin") and pkg == "kdn":
                continue
            out[name] = path
    return out


def longest_functions(mods, n=10):
    rows = []
    for name, path in mods.items():
        if ".bench" in name:
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
        if ".bench" in name or not rel.startswith(RPC_PATHS):
            continue
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines, 1):
            s = line.strip()
            if s.startswith("except Exception") or s.startswith("except BaseException") or s == "except:":
                found.append({"where": f"{rel}:{i}", "why": "#" in s})
    return found


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
    print("ten longest functions (outside benchmarks):")
    for n, where in longest:
        print(f"  {n:4d}  {where}")
    print(f"broad excepts on RPC paths: {len(excepts)} ({sum(e['why'] for e in excepts)} with a comment)")
    for e in excepts:
        print(f"  {e['where']}{'' if e['why'] else '  (no comment)'}")
    print(f"import cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"import cycles through imports inside functions: {len(deferred)}")
    for c in deferred:
        print("  " + " <-> ".join(c))
    if "--json" in argv:
        print(json.dumps({"longest": longest, "broad_excepts": len(excepts), "cycles": cyc,
                          "deferred_cycles": deferred}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
