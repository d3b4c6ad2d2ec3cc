"""How long a cache layer's eviction takes right after stores acknowledged at the edge: the
time of `Objects.delete` (what LMCache's and SGLang's adapters call) of a few keys while the
edge's backlog still holds hundreds of MiB on their way to the origin, and whether the deleted
keys stay deleted once that backlog is durable.

    .venv/bin/python tools/evict_latency.py [ROUNDS]    # ROUNDS x 32 x 8 MiB stored first (default 3)

One region on a local Ray cluster (one node), its edge acknowledging stores (`ack` edge), the
origin on this machine's disk. Three keys are deleted: the first stored (durable already), one
from the middle and the last (in the backlog). Prints the backlog before the delete, the
delete's time, and what a lookup finds after.
"""
import sys
import tempfile
import time
import uuid

import numpy as np


def main(argv) -> int:
    rounds = int(argv[0]) if argv else 3
    from kdn.core.env import prepare_ray_env
    prepare_ray_env()
    import ray
    from kdn.client.join import init_ray
    from kdn.integrations.objects import Objects, object_key
    from kdn.launch.cluster import LocalCluster, start_network, stop_network
    from kdn.placement.topology import Topology
    admin = f"admin-{uuid.uuid4().hex}"
    cluster = LocalCluster(("us-east",), cpus=2, object_store_bytes=5 << 30, log_monitor=False)
    net = None
    try:
        init_ray(cluster.address)
        topo = Topology.default_local(["us-east"], edges_per_region=1, capacity_bytes=3 << 30)
        net = start_network(topo, tempfile.mkdtemp(prefix="kdn-evict-"), network=f"e{uuid.uuid4().hex[:6]}",
                            auth={"admin": admin, "readers": {}})
        objs = Objects.connect(net.name, "us-east", "lmcache", admin_token=admin)
        ns = objs.namespace("default", "evict")
        data = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
        keys = []
        for r in range(rounds):
            ks = [object_key(ns, f"{r}-{i}".encode()) for i in range(32)]
            objs.store([(ns, k) for k in ks], [data] * 32)
            keys += ks
        edge = net.edges["us-east-0"]
        st = ray.get(edge.stats.remote(token=admin), timeout=60)["stores"]
        print(f"backlog before the delete: {st['backlog_objects']} objects, {st['backlog_bytes'] / 2**20:.0f} MiB")
        victims = [keys[0], keys[len(keys) // 2], keys[-1]]
        t0 = time.perf_counter()
        objs.delete(ns, victims)
        took = time.perf_counter() - t0
        print(f"delete of 3 keys: {took * 1000:.0f} ms")
        durable = ray.get(edge.stores_durable.remote(300.0, token=admin), timeout=330)["durable"]
        found = objs.lookup(ns, victims)
        held = sum(bool(x) for x in objs.lookup(ns, [k for k in keys if k not in victims]))
        print(f"backlog durable after: {durable}; deleted keys found: {sum(bool(x) for x in found)} of 3; "
              f"the others held: {held} of {len(keys) - 3}")
        counters = {k: v for k, v in objs.counters.items() if k.startswith("delete")}
        print(f"the writer's counters: {counters}")
        return 0 if not any(found) and held == len(keys) - 3 else 1
    finally:
        if net is not None:
            stop_network(net)
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
