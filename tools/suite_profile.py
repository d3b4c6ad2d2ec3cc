"""Where a run's CPU went, from a system-wide `perf` recording: by process kind, and how much of
it was Python's cyclic garbage collector and Python compiling source.

Record beside the run, then read the samples:

    perf record -e cpu-clock -a -F 49 -o suite.perf -- sleep 830 &   # as long as the run; no -g
    make test
    python3 tools/suite_profile.py suite.perf

A process is named by the most specific name it took (a Ray actor's `ray::EdgeNode`, a
`kdn` command, a pytest worker), so a Ray worker's start-up counts for the actor it became.
"""
import collections
import re
import subprocess
import sys

SAMPLE = re.compile(r"\s*(.+?)\s+(\d+)/(\d+)\s+[0-9a-f]+\s+(.*)\((.*)\)\s*$")
COMM = re.compile(r"PERF_RECORD_COMM(?: exec)?: (.+):(\d+)/(\d+)\s*$")
GC = {"gc_collect_main", "visit_decref", "visit_reachable", "move_unreachable", "deduce_unreachable",
      "gc_collect_with_callback", "visit_move", "update_refs", "subtract_refs", "move_legacy_finalizers"}
COMPILE = re.compile(r"^(_PyPegen|tok_|assemble|compiler_|_PyAST|symtable|_PyCfg|astfold|makecode|_PyTokenizer)")


def _perf(data: str, *fields) -> list:
    return subprocess.run(["perf", "script", "-i", data, *fields], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    data, names = argv[0], collections.defaultdict(set)
    for line in _perf(data, "--show-task-events", "-F", "comm,pid,tid"):
        m = COMM.search(line)
        if m:
            names[int(m.group(2))].add(m.group(1))

    def kind(pid: int, comm: str) -> str:
        seen = names.get(pid, set()) | {comm}
        actors = [n for n in seen if n.startswith("ray::") and n != "ray::IDLE"]
        if actors:
            return re.sub(r"\..*", "", min(actors, key=len))
        return next((k for k in ("pytest-xdist", "kdn", "raylet", "gcs_server") if any(k in n for n in seen)), comm)

    cpu, gc, compiling, rate = collections.Counter(), collections.Counter(), collections.Counter(), 49.0
    for line in _perf(data, "-F", "comm,pid,tid,ip,sym,dso"):
        m = SAMPLE.match(line)
        if not m or m.group(1) == "swapper":          # swapper: an idle core
            continue
        comm, pid, _, sym, dso = m.groups()
        k, sym = kind(int(pid), comm), sym.split("+")[0].strip()
        cpu[k] += 1
        if "libpython" in dso and (sym in GC or sym.endswith("_traverse")):
            gc[k] += 1
        elif "libpython" in dso and COMPILE.match(sym):
            compiling[k] += 1
    for line in _perf(data, "--header-only"):
        m = re.search(r"sample_freq \} = (\d+)", line)     # { sample_period, sample_freq } = 49
        if m:
            rate = float(m.group(1))
            break
    total = sum(cpu.values())
    print(f"busy: {total / rate:.0f} CPU-s; Python's collector {sum(gc.values()) / rate:.0f}, "
          f"compiling source {sum(compiling.values()) / rate:.0f}")
    print(f"{'CPU-s':>7} {'gc':>6} {'compile':>7}  process")
    for k, n in cpu.most_common(20):
        print(f"{n / rate:7.1f} {gc[k] / rate:6.1f} {compiling[k] / rate:7.1f}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
