"""KDN's process environment (kdn/core/env.py): loopback only, even when ray was imported first;
threads by the cores a process may use; the collector paused while a block loads."""
import os
import subprocess
import sys

import pytest

from kdn.core.env import is_loopback


def test_importing_ray_first_still_keeps_ray_on_loopback():
    code = ("import ray\n"
            "from ray._private import ray_constants\n"
            "before = ray_constants.ENABLE_RAY_CLUSTER\n"
            "import kdn.core.env\n"
            "kdn.core.env.prepare_ray_env()\n"
            "from ray._private import services\n"
            "print(before, ray_constants.ENABLE_RAY_CLUSTER, services.get_node_ip_address())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, ip = out.stdout.split()
    assert before == "True"            # ray read an environment without KDN's settings ...
    assert after == "False" and ip == "127.0.0.1"     # ... and KDN's took effect anyway


def test_loopback_addresses():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_usable_cpus_follows_the_affinity_mask_not_the_machine():
    """Threads are sized by the cores a process may run on (a scheduler's or a test worker's
    mask): on one core of two, one thread, not the machine's count."""
    one = min(os.sched_getaffinity(0))
    code = ("import os\n"
            "from kdn.core.env import usable_cpus\n"
            "before = usable_cpus()\n"
            f"os.sched_setaffinity(0, {{{one}}})\n"
            "print(before, usable_cpus(), os.cpu_count())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, machine = map(int, out.stdout.split())
    assert before == len(os.sched_getaffinity(0)) and after == 1 and machine == os.cpu_count()


def test_a_test_worker_runs_on_its_own_share_of_the_cores():
    """Under `make test` (two pytest-xdist workers, tests/conftest.py) this process and all it
    starts size their OpenMP threads by the worker's share of the cores (pinned to those cores
    by affinity mask with KDN_TEST_CORES=pin); run alone, all cores."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if "PYTEST_XDIST_WORKER" not in os.environ or count < 2 or (os.cpu_count() or 1) < count:
        pytest.skip("not one of several pytest-xdist workers on enough cores")
    share = {os.cpu_count() // count, -(-os.cpu_count() // count)}
    assert int(os.environ["OMP_NUM_THREADS"]) in share
    code = "from kdn.core.env import compute_threads; print(compute_threads(cap=64))"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert child.returncode == 0 and child.stdout.strip() == os.environ["OMP_NUM_THREADS"], child.stderr[-2000:]
    mine = os.sched_getaffinity(0)
    if os.environ.get("KDN_TEST_CORES", "share") == "pin":
        assert len(mine) in share
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, timeout=60)
        assert child.stdout.strip() == str(sorted(mine))          # what it starts inherits the mask
    else:
        assert len(mine) == os.cpu_count()                        # shared: any core runs it


def test_compute_threads_takes_the_least_of_its_cap_the_cores_and_omp_num_threads(monkeypatch):
    from kdn.core.env import compute_threads
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert compute_threads(cap=64) == cores and compute_threads(cap=1) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert compute_threads(cap=64) == 1
    for bad in ("", "0", "two", "-3"):             # unset, or not a count: the cores decide
        monkeypatch.setenv("OMP_NUM_THREADS", bad)
        assert compute_threads(cap=64) == cores


def _collections():
    """A list that gc.callbacks fills with the generation of each collection that starts."""
    import gc
    seen = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])
    gc.callbacks.append(cb)
    return seen, lambda: gc.callbacks.remove(cb)


def test_the_collector_is_off_inside_collector_paused_and_one_full_collection_frees_what_it_left():
    import gc
    import weakref
    from kdn.core.env import collector_paused

    class Node:
        pass
    assert gc.isenabled()
    done = None
    try:
        with collector_paused():
            seen, done = _collections()            # registered with the collector already off
            assert not gc.isenabled()
            with collector_paused():               # nested: the inner block neither resumes nor collects
                a, b = Node(), Node()
                a.other, b.other = b, a            # a cycle: only the collector frees it
                gone = weakref.ref(a)
                del a, b
                kept = [Node() for _ in range(20000)]   # far past the youngest generation's threshold (700)
            assert not gc.isenabled() and gone() is not None and seen == []
            del kept
        assert gc.isenabled() and gone() is None   # one collection at the end freed the cycle
        assert seen[:1] == [2]                     # (other threads may collect after it)
    finally:
        if done:
            done()


def test_collector_paused_resumes_after_an_error_and_leaves_an_off_collector_off():
    import gc
    from kdn.core.env import collector_paused
    with pytest.raises(ValueError, match="boom"):
        with collector_paused():
            raise ValueError("boom")
    assert gc.isenabled()
    gc.disable()                                   # a host that runs with the collector off
    try:
        seen, done = _collections()
        with collector_paused():
            pass
        done()
        assert not gc.isenabled() and seen == []   # left as it was, and nothing collected
    finally:
        gc.enable()
