"""Which tests start Ray actors, how much CPU each test takes in its own pytest process, and its
share of the whole machine's: a pytest plugin for a suite run, and a reader of what it wrote.

Every actor a test's process starts costs a Ray worker's start-up (about 1 CPU-s here: `import
ray`, KDN's modules, the actor), so a module that starts a network per test pays that several
times over. Run the suite with the plugin, then read the log:

    KDN_ACTOR_LOG=actors.jsonl PYTHONPATH=tools .venv/bin/python -m pytest -p actor_count ...
    .venv/bin/python tools/actor_count.py actors.jsonl

Counted: calls that create actors through `ray.actor.ActorClass` in the processes that run
tests (the networks tests start, Serve's controller, vLLM's engines), not those that `kdn`
commands or other actors start (a `get_if_exists` call is counted whether it creates one or
not). Per test: CPU time of its own process (setup, call and teardown), not of the actors; its wall
time; and the machine's busy CPU while it ran (/proc/stat) divided by the workers running tests
side by side, its share of what the machine did then (the actors, replicas and `kdn` commands
it started included, but also whatever the other worker's test was doing: an estimate that
ranks modules, not an exact account). Each run starts the log afresh.
"""
import collections
import json
import os
import sys
import time

import pytest

LOG_ENV = "KDN_ACTOR_LOG"


def _write(record: dict) -> None:
    with open(os.environ[LOG_ENV], "a") as f:        # one line per record: workers append side by side
        f.write(json.dumps(record) + "\n")


def _count_actor_starts() -> None:
    import ray.actor
    remote = ray.actor.ActorClass._remote
    if getattr(remote, "_kdn_counted", False):
        return

    def counted(self, *args, **kwargs):
        meta = getattr(self, "__ray_metadata__", None)
        _write({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
                "actor": getattr(meta, "class_name", type(self).__name__)})
        return remote(self, *args, **kwargs)
    counted._kdn_counted = True
    ray.actor.ActorClass._remote = counted


def pytest_configure(config):
    if not os.environ.get(LOG_ENV):
        raise RuntimeError(f"actor_count: set {LOG_ENV} to the file to write")
    if hasattr(config, "workerinput"):          # a pytest-xdist worker: it runs tests
        _count_actor_starts()
        return
    open(os.environ[LOG_ENV], "w").close()      # the controller, or a run without workers: a fresh log
    if not config.getoption("numprocesses", None):
        _count_actor_starts()


def _busy_s() -> float:
    """Busy CPU-seconds of all cores since boot (/proc/stat: user, nice, system, irq, softirq;
    not idle, iowait, steal (another VM's), nor guest (counted in user already))."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, wall, busy = time.process_time(), time.monotonic(), _busy_s()
    yield
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _write({"test": item.nodeid, "cpu": time.process_time() - start, "wall": time.monotonic() - wall,
            "share": (_busy_s() - busy) / workers})


def main(argv) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    actors, cpu, module_cpu = collections.Counter(), collections.Counter(), collections.Counter()
    wall, share = collections.Counter(), collections.Counter()
    for line in open(argv[0]):
        r = json.loads(line)
        module = r["test"].split("::")[0]
        if "actor" in r:
            actors[(module, r["actor"])] += 1
        else:
            cpu[r["test"]] += r["cpu"]
            module_cpu[module] += r["cpu"]
            wall[module] += r.get("wall", 0.0)
            share[module] += r.get("share", 0.0)
    kinds = collections.Counter()
    for (_, actor), n in actors.items():
        kinds[actor] += n
    print("actors started:", ", ".join(f"{a} {n}" for a, n in kinds.most_common()))
    per_module = collections.Counter()
    for (module, _), n in actors.items():
        per_module[module] += n
    print(f"{'actors':>6}  module (most first)")
    for module, n in per_module.most_common(20):
        print(f"{n:6d}  {module}")
    print(f"{'CPU-s':>6}  module, in its pytest process (most first; {sum(module_cpu.values()):.0f} in all)")
    for module, s in module_cpu.most_common(20):
        print(f"{s:6.1f}  {module}")
    if share:
        print(f"{'share':>6} {'wall s':>6}  module: its share of the machine's busy CPU-s while it ran, and its "
              f"wall time (most first; {sum(share.values()):.0f} CPU-s in all)")
        for module, s in share.most_common(30):
            print(f"{s:6.1f} {wall[module]:6.1f}  {module}")
    print(f"{'CPU-s':>6}  test, in its pytest process (most first)")
    for test, s in cpu.most_common(20):
        print(f"{s:6.1f}  {test}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
