"""Shared fixtures: KDN's Ray environment, a 3-region Ray cluster on loopback, synthetic KV.

The cluster is real: three Ray nodes on this machine (ray.cluster_utils.Cluster), labelled
region=us-east / eu-west / ap-south. It is started once per session, only when a test asks
for it, and shut down at the end; each test module starts its own KDN network on it (its own
actor names and origin directory), so tests never see each other's state.
"""
import gc
import os
import uuid

import numpy as np
import pytest

from kdn.core.env import prepare_ray_env


def _own_cores() -> None:
    """Under pytest-xdist (`make test` runs two workers), size every process's OpenMP threads by
    the worker's share of the cores, before torch or Ray starts: every process a worker starts
    (Ray's nodes and actors, vLLM's engine, `kdn` commands) inherits OMP_NUM_THREADS and sizes
    its threads by it (kdn.core.env.compute_threads). Two workers whose OpenMP threads shared both
    cores spun against each other: an engine's setup took 3x longer beside another's prefill.
    KDN_TEST_CORES=pin also gives each worker its own cores by affinity mask; the default
    ("share") leaves the mask alone, so a core that one worker leaves idle while it waits on
    sockets and timeouts runs the other's processes."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if not worker or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:                 # fewer cores than workers: nothing to share out
        return
    mine = cores[int(worker.removeprefix("gw")) % count::count]
    if os.environ.get("KDN_TEST_CORES", "share") == "pin":
        os.sched_setaffinity(0, mine)
    os.environ["OMP_NUM_THREADS"] = str(len(mine))


_own_cores()
prepare_ray_env()
# Ray declares a crashed node dead after 5 missed health checks; at its default period (3 s)
# that is ~15 s that the tests removing a node wait through, CPU idle. At 1 s it is ~5 s. A
# node that is alive but slow still has the default 10 s per check to answer, 5 times running.
# Each node's dashboard agent samples every worker process's stats for Ray's own metrics,
# which no test reads, every 5 s by default: once a minute here (about 40% of its CPU).
# Edges do not allocate their node's object store ahead (KDN_OBJECT_STORE_FILL_BYTES=0,
# kdn.edge.options.fill_bytes): the suite starts hundreds of short-lived edges and dozens of
# nodes, and the fill costs 0.6-0.7 CPU-s per GiB here (tools/fill_cpu.py) for stores the
# tests barely use. The fill's own tests ask for it by name; the README's walk runs with the
# default.
for _k, _v in {"RAY_health_check_period_ms": "1000", "RAY_health_check_initial_delay_ms": "1000",
               "REPORTER_UPDATE_INTERVAL_MS": "60000", "KDN_OBJECT_STORE_FILL_BYTES": "0"}.items():
    os.environ.setdefault(_k, _v)

REGIONS = ("us-east", "eu-west", "ap-south")

# The modules that take minutes (engines, services, the README's whole walk), longest first:
# under `make test`'s workers (--dist loadfile) they start first, so no worker is left
# running one of them alone at the end. Everything else keeps its collected order.
LONGEST_FIRST = ("test_readme.py", "serve/test_serve.py", "engines/vllm/test_connector.py",
                 "serve/test_history.py", "serve/test_vllm.py", "integrations/test_lmcache.py",
                 "engines/transformers/test_model.py", "engines/transformers/test_blend.py",
                 "engines/transformers/test_worker.py", "engines/test_emphasis_variants.py",
                 "multinode/test_faults.py", "multinode/test_network.py",
                 "multinode/test_origin_bucket.py", "multinode/test_drop_races.py", "multinode/test_hosts.py",
                 "cli/test_cli.py")


def _cpu_jiffies() -> tuple:
    """(busy, total) clock ticks of all cores since boot, from /proc/stat's first line."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)        # idle + iowait
    return sum(ticks) - idle, sum(ticks)


def _machine() -> str:
    """The CPU model, its usable cores and vector extensions, from /proc/cpuinfo."""
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    ext = [x for x in ("avx2", "avx512f", "amx_tile") if x in flags] or ["no avx2"]
    return f"{model}, {len(os.sched_getaffinity(0))} usable cores, {' '.join(ext)}"


def pytest_sessionstart(session):
    if os.path.exists("/proc/stat"):
        session.config._kdn_cpu_start = _cpu_jiffies()


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """Collection imports torch, transformers, vLLM and Ray: about a million long-lived objects,
    through which Python's cyclic collector would run again and again while they load and in
    every full collection after. It is off while they load; then one collection frees what
    they left, and what remains is frozen (gc.freeze), so later collections scan only what
    the tests make. In every process that collects (xdist's workers, a plain run) and in
    xdist's controller, whose collection is the workers'; on in all of them after, whatever
    collection raised."""
    gc.disable()
    try:
        yield
    finally:
        gc.collect()
        gc.enable()
        gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    """The machine and how busy its cores were over the run (CI's logs show both; the suite's
    time depends on them)."""
    start = getattr(config, "_kdn_cpu_start", None)
    if start is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    busy, total = (a - b for a, b in zip(_cpu_jiffies(), start))
    terminalreporter.write_line(f"machine: {_machine()}; cores busy {100 * busy / max(total, 1):.0f}% "
                                f"of the run; workers' cores: {os.environ.get('KDN_TEST_CORES', 'share')}")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0].removeprefix("tests/")
        return rank.get(path, len(rank))
    items.sort(key=key)                    # stable: each module's own order is kept


@pytest.fixture(scope="session")
def ray_cluster():
    from kdn.launch.cluster import LocalCluster
    from kdn.client.join import init_ray
    # no log monitor: the tests' drivers do not take workers' logs (init_ray), and tailing every
    # worker's files cost it 12-15 CPU-seconds per session cluster (a worker's whole run)
    cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=768 << 20, log_monitor=False)
    init_ray(cluster.address)
    yield cluster
    cluster.shutdown()


def make_kv(n_tokens, layers=2, heads=2, head_dim=8, seed=0, dtype=np.float32):
    """Deterministic KV [layers, 2, heads, n_tokens, head_dim] that differs per token position."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((layers, 2, heads, n_tokens, head_dim)).astype(dtype)


def make_tokens(n, seed=0, vocab=49152):
    return np.random.default_rng(seed + 1000).integers(0, vocab, n).tolist()


@pytest.fixture
def network_name():
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def synth():
    """Synthetic inputs: synth.kv(n_tokens, ...) and synth.tokens(n, seed)."""
    import types
    return types.SimpleNamespace(kv=make_kv, tokens=make_tokens)


@pytest.fixture(scope="module")
def small_network(ray_cluster, tmp_path_factory):
    """start(auth=None, **options) -> a KDN network with one edge in each of REGIONS, on the
    session's cluster; every network a module starts is stopped when the module ends."""
    from kdn.launch.cluster import start_network, stop_network
    from kdn.placement.topology import Topology
    started = []

    def start(auth=None, capacity_bytes=64 << 20, **options):
        topo = Topology.default_local(list(REGIONS), edges_per_region=1, capacity_bytes=capacity_bytes)
        name = f"n{uuid.uuid4().hex[:8]}"
        net = start_network(topo, tmp_path_factory.mktemp(name), network=name, auth=auth, **options)
        started.append(net)
        return net
    yield start
    for net in started:
        stop_network(net)


@pytest.fixture(scope="module")
def model():
    """The real model (SmolLM2-135M-Instruct), warmed up. One intra-op thread: on a busy 2-core
    machine two OpenMP threads fight other processes for the cores and a prefill gets several
    times slower, not faster. Modules that need other settings define their own `model`."""
    import torch
    from kdn.engines.transformers.model import load_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model()
    torch.set_num_threads(threads)
