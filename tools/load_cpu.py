"""CPU-seconds of a fresh process that loads the model, with Python's collector paused during the
load (`load_model()`, as KDN runs it) and on (`load_model.__wrapped__()`, the same load without
kdn.core.env.collector_paused), the two alternating so that a machine whose speed drifts weighs
on both alike:

    .venv/bin/python tools/load_cpu.py [ROUNDS]     # default 3 rounds; one intra-op thread

Each process imports the model's module and loads the converted model from the cache (run
`make demo` or `kdn model` once first), then reports its own user + system CPU time.
"""
import os
import statistics
import subprocess
import sys

CODE = ("import resource\n"
        "from kdn.engines.transformers.model import load_model\n"
        "{call}\n"
        "r = resource.getrusage(resource.RUSAGE_SELF)\n"
        "print(r.ru_utime + r.ru_stime)\n")
MODES = {"paused": "load_model()", "on": "load_model.__wrapped__()"}


def one(call: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", CODE.format(call=call)], capture_output=True, text=True,
                       env=env, timeout=600)
    if p.returncode != 0:
        raise SystemExit(f"the load failed (exit {p.returncode}):\n{p.stderr[-2000:]}")
    return float(p.stdout.split()[-1])


def main(argv) -> int:
    rounds = int(argv[0]) if argv else 3
    got = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode, call in MODES.items():
            got[mode].append(one(call))
    for mode, xs in got.items():
        print(f"collector {mode:6s}: {' '.join(f'{x:.2f}' for x in xs)} CPU-s (median {statistics.median(xs):.2f})")
    print(f"paused / on: {statistics.median(got['paused']) / statistics.median(got['on']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
