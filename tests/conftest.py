"""Shared fixtures: KDN's Ray environment, a 3-region Ray cluster on loopback, synthetic KV.

The cluster is real: three Ray nodes on this machine (ray.cluster_utils.Cluster), labelled
region=us-east / eu-west / ap-south. It is started once per session, only when a test asks
for it, and shut down at the end; each test module starts its own KDN network on it (its own
actor names and origin directory), so tests never see each other's state.
"""
import os
import uuid

import numpy as np
import pytest

from kdn.core.env import prepare_ray_env

prepare_ray_env()
# Ray declares a crashed node dead after 5 missed health checks; at its default period (3 s)
# that is ~15 s that the tests removing a node wait through, CPU idle. At 1 s it is ~5 s. A
# node that is alive but slow still has the default 10 s per check to answer, 5 times running.
for _k, _v in {"RAY_health_check_period_ms": "1000", "RAY_health_check_initial_delay_ms": "1000"}.items():
    os.environ.setdefault(_k, _v)

REGIONS = ("us-east", "eu-west", "ap-south")


@pytest.fixture(scope="session")
def ray_cluster():
    from kdn.launch.cluster import LocalCluster
    from kdn.client.join import init_ray
    cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=768 << 20)
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
