"""The process environment KDN sets: Ray's settings before Ray starts (loopback only, no usage
stats, token auth), and how a process starts up (its threads, the collector while it loads).

Decided once here and used by the CLI, the demo, the tests and CI alike:
- RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps every node on 127.0.0.1 (no traffic off loopback);
- RAY_USAGE_STATS_ENABLED=0: nothing is reported anywhere;
- RAY_AUTH_MODE=token: Ray's token auth on (token in ~/.ray/auth_token, made if missing);
- RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH: Serve's proxy bounds request bodies (kdn/serve/proxy.py).

A process's intra-op threads: compute_threads. Python's cyclic collector held off while a
process loads a model or an engine: collector_paused.
"""
import contextlib
import gc
import ipaddress
import os
import sys
from pathlib import Path

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_DEDUP_LOGS": "0",
    # Serve's HTTP proxy refuses oversized request bodies before reading them (kdn/serve/proxy.py)
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "kdn.serve.proxy:middlewares",
}


def prepare_ray_env() -> None:
    """Set KDN's Ray environment in this process (and so in every process it starts)."""
    for k, v in RAY_ENV.items():
        os.environ.setdefault(k, v)
    if "ray" in sys.modules:
        # ray was imported first: its constants were read from the environment before we
        # set it. Re-read the ones KDN depends on, or a driver resolves a non-loopback node
        # address and hangs (ENABLE_RAY_CLUSTER), and re-read the auth mode.
        from ray._private import ray_constants
        from ray._raylet import Config
        ray_constants.ENABLE_RAY_CLUSTER = ray_constants.env_bool(
            ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, not ray_constants.IS_WINDOWS_OR_OSX)
        Config.initialize("")


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, which a scheduler or a test
    runner may have narrowed), not the machine's count: threads beyond it only spin."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:                     # no affinity API on this OS
        return os.cpu_count() or 1


def compute_threads(cap: int = 2) -> int:
    """Intra-op threads for a model or engine in this process: at most `cap`, no more than the
    usable cores, and no more than OMP_NUM_THREADS where the environment sets it (a scheduler
    or a test runner sharing the cores out: threads past it spin against other processes)."""
    n = min(cap, usable_cpus())
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        n = min(n, int(omp))
    return max(1, n)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while the block runs, then one full collection.

    Loading the model (transformers, its weights) makes about 400,000 long-lived objects, an
    engine (vLLM) more; with the collector on, its full collections on the way walk them again
    and again: 0.4-0.5 CPU-s of a 5-5.7 CPU-s load in a fresh process (`tools/load_cpu.py`).
    Paused, they are walked once, at the end. Nested blocks collect once, when the outermost
    ends; where the collector was already off, it is left off. The switch is process-wide: a
    block in another thread may see the collector resume before it ends (a lost saving, never a
    collector left off)."""
    was_on = gc.isenabled()
    try:
        gc.disable()
        yield
    finally:
        if was_on:
            gc.enable()
            gc.collect()


def kdn_home() -> Path:
    """Where KDN keeps state by default: $KDN_HOME, else ~/.cache/kdn."""
    return Path(os.environ.get("KDN_HOME") or Path.home() / ".cache" / "kdn")


def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 / ::1: where KDN serves and connects by default."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
