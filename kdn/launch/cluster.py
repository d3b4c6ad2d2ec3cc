"""Launch: a KDN network on Ray, either on an embedded one-machine cluster or on a real one.

`LocalCluster` builds real Ray nodes on this machine with `ray.cluster_utils.Cluster`, one per
region, each labelled `region=<name>`, so locality is real even on one machine (and every node
is 127.0.0.1: see kdn.core.env). `start_network` places the origin on a node of the topology's
origin region and one edge actor per topology edge on a node of that edge's region (Ray label
selectors), all named actors in the `kdn` namespace, so any driver or worker finds them.

Restart settings are chosen on purpose: an edge restarts (max_restarts=-1) and comes back
empty, then refills by pull-through; the origin restarts and comes back from its store (a
directory, pinned to its node; or an S3 bucket, from any node of its region).

`kdn up` / `kdn down` use `up()` / `down()`: the embedded cluster's processes outlive the
`kdn up` process (shutdown_at_exit=False); their pids (with their start times) and the
address go to a state file so `kdn down` stops exactly what `up` started, and nothing else
on the machine: a pid reused by another process is never killed. A record whose cluster
has died (a crash, a reboot) is found out in about a second — its head no longer accepts
connections — so `kdn status` says so, `kdn down` clears it and `kdn up` replaces it,
instead of waiting minutes on Ray. Every setting is checked before anything starts.

Each edge gets a fixed HTTP port at start (a free one, chosen here), so an edge actor that
Ray restarts serves the same URL again and HTTP clients pinned to it keep working.
"""
import json
import os
import random
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from kdn.core.conversation import CONVERSATION_SHARE
from kdn.core.env import kdn_home
from kdn.core.errors import KDNError, NetworkError
from kdn.client.join import LOOPBACK, cluster_alive, ensure_ray_token, init_ray, read_state, state_path
from kdn.core.names import NAMESPACE, ORIGIN_NODE, check_node_name, edge_actor_name, origin_name

DEFAULT_REGIONS = ("us-east", "eu-west", "ap-south")
SPILL_THRESHOLD = 0.8        # Ray spills objects to disk once a node's object store is this full (its default)
IN_FLIGHT_BYTES = 256 << 20  # room beside the edges' memory for chunks in flight (pushes, replies)
KILLED_WAIT_S = 30.0         # how long `kdn down` waits for a process it killed to be gone
MAX_STORE_SHARE = 0.3        # of this machine's memory, the most one embedded node's object store gets


class LocalCluster:
    """Real Ray nodes on this machine, one per region, labelled `region=<name>`.

    The head node carries the first region (put the origin's region first). Each node gets
    `cpus` logical CPUs and its own object store; actors of KDN ask for num_cpus=0, so the
    logical CPUs are left for workers (tasks that run a model).

    log_monitor=False starts the head without Ray's log monitor, the process that tails every
    worker's log files to forward them to drivers. KDN's drivers do not take them
    (kdn.client.join.init_ray: log_to_driver=False); the files stay under the session's logs
    folder. The default keeps it for drivers of one's own that print their workers' output.
    """

    def __init__(self, regions=DEFAULT_REGIONS, cpus: int = 2, object_store_bytes: int = 1 << 30,
                 shutdown_at_exit: bool = True, log_monitor: bool = True):
        if not regions:
            raise KDNError("a local cluster needs at least one region")
        ensure_ray_token()
        from ray.cluster_utils import Cluster
        self.regions = list(regions)
        self._opts = dict(num_cpus=cpus, object_store_memory=object_store_bytes,
                          node_ip_address=LOOPBACK)
        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=shutdown_at_exit,
                               head_node_args=dict(labels={"region": self.regions[0]},
                                                   include_dashboard=False,
                                                   include_log_monitor=bool(log_monitor), **self._opts))
        self.nodes = {self.regions[0]: [self.cluster.head_node]}
        for r in self.regions[1:]:
            self.add_node(r)

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_node(self, region: str):
        """Start one more Ray node labelled with `region` (about 2 s here)."""
        node = self.cluster.add_node(labels={"region": region}, **self._opts)
        self.nodes.setdefault(region, []).append(node)
        if region not in self.regions:
            self.regions.append(region)
        return node

    def remove_node(self, node, graceful: bool = False) -> None:
        """Kill one worker node's processes, as a crashed machine would be."""
        self.cluster.remove_node(node, allow_graceful=graceful)
        for nodes in self.nodes.values():
            if node in nodes:
                nodes.remove(node)

    def await_dead(self, node, timeout_s: float = 60.0) -> None:
        """Wait until Ray has declared a removed node dead (~15 s after a crash): until then
        it may still place new actors there, which then die with it."""
        import ray
        deadline = time.monotonic() + timeout_s
        while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()):
            if time.monotonic() > deadline:
                raise KDNError(f"Ray still lists node {node.node_id} as alive {timeout_s:.0f} s "
                               "after it was removed")
            time.sleep(0.5)

    def pids(self) -> list:
        out = []
        for nodes in self.nodes.values():
            for node in nodes:
                for infos in node.all_processes.values():
                    out.extend(i.process.pid for i in infos if i.process is not None)
        return out

    def shutdown(self) -> None:
        import ray
        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()


@dataclass
class Network:
    """Handles of one running network: its name, origin and edges (name -> actor handle)."""
    name: str
    topology: object
    origin: object
    edges: dict = field(default_factory=dict)

    def edge(self, name):
        return self.edges[name]


def _edge_class():
    from kdn.edge.node import EdgeNode
    return EdgeNode


def edge_memory(topo) -> dict:
    """region -> what its edges may hold in the object store: their capacity for KBs and,
    beside it, their conversation tiers (kdn.core.conversation.CONVERSATION_SHARE)."""
    return {r: int(b * (1 + CONVERSATION_SHARE)) for r, b in topo.region_capacity_bytes().items()}


def object_store_for(topo, floor: int = 1 << 30) -> int:
    """A node's object store for an embedded cluster (one node per region): its region's edges'
    memory (they hold chunks in it) and chunks in flight, below Ray's spilling threshold, so
    Ray never moves what an edge holds to disk; at least floor, at most Ray's own default
    share of this machine's memory (30%: then `kdn up` warns, store_room_warnings)."""
    import psutil
    edges = max(edge_memory(topo).values(), default=0)
    most = max(floor, int(MAX_STORE_SHARE * psutil.virtual_memory().total))
    return min(most, max(floor, int((edges + IN_FLIGHT_BYTES) / SPILL_THRESHOLD)))


def store_room_warnings(topo) -> list:
    """One line per region whose edges' memory does not fit below Ray's spilling threshold in
    the object store of its smallest live node (`ray start --object-store-memory`): Ray would
    spill chunks the edges hold to disk, and reads of them would wait on it."""
    import ray
    smallest = {}
    for n in ray.nodes():
        region = (n.get("Labels") or {}).get("region")
        store = (n.get("Resources") or {}).get("object_store_memory")
        if n.get("Alive") and region and store:
            smallest[region] = min(store, smallest.get(region, store))
    out = []
    for region, need in sorted(edge_memory(topo).items()):
        store = smallest.get(region)
        if store and need + IN_FLIGHT_BYTES > SPILL_THRESHOLD * store:
            out.append(f"region {region}: its edges may hold {need / 2**30:.2f} GiB in memory, but a node "
                       f"there has a {store / 2**30:.2f} GiB object store, and Ray spills to disk past "
                       f"{SPILL_THRESHOLD:.0%} of it: give its nodes at least "
                       f"{(need + IN_FLIGHT_BYTES) / SPILL_THRESHOLD / 2**30:.2f} GiB "
                       f"(`ray start --object-store-memory`) or its edges less capacity_bytes")
    return out


def _origin_class():
    from kdn.origin.node import OriginNode
    return OriginNode


def start_edge(network: str, edge, topology, detached: bool = False, capacity_bytes=None,
               http_port=None, replicas: int = 2, auth=None, **edge_options):
    """Start one edge actor on a node of its region; returns the handle."""
    import ray
    from kdn.core.transfer import check_store_codec
    from kdn.edge.events import check_kv_events
    from kdn.edge.options import check_edge_options
    check_store_codec(edge_options.get("store_codec", "raw"), "edge")
    from_file = check_edge_options(topology.edge_options(edge.name),
                                   f"{topology.source}: edge {edge.name!r}")
    if edge_options.get("kv_events") is not None:               # checked here, not in the actor
        edge_options = {**edge_options, "kv_events": check_kv_events(edge_options["kv_events"])}
    edge_options = {**edge_options, **from_file}                # the file's settings win
    cls = ray.remote(_edge_class())
    opts = dict(name=edge_actor_name(network, edge.name), namespace=NAMESPACE, num_cpus=0,
                max_restarts=-1, max_task_retries=0, max_concurrency=1000,
                label_selector={"region": edge.region}, get_if_exists=False)
    if detached:
        opts["lifetime"] = "detached"
    cap = capacity_bytes or topology.capacity_bytes(edge.name)
    # Creating the actor is Ray's own call, not a call to a node (kdn.core.rpc.Actors reaches
    # actors that exist, by name): it is the one direct .remote() here.
    return cls.options(**opts).remote(network=network, name=edge.name, region=edge.region,
                                      capacity_bytes=cap, topology=topology.to_dict(),
                                      http_port=http_port, replicas=replicas,
                                      auth=_auth_dict(auth), **edge_options)


def _edge_k(edge_options, k: int) -> dict:
    """The k-th edge's options: one kv_events endpoint for all becomes PORT + 2k (PUB) and
    PORT + 2k + 1 (replay) for edge k (kdn.edge.events.offset_ports)."""
    opts = dict(edge_options or {})
    if opts.get("kv_events") is not None:
        from kdn.edge.events import offset_ports
        opts["kv_events"] = offset_ports(opts["kv_events"], k)
    return opts


FIXED_PORTS = (20000, 32767)   # where free_ports draws: above Ray's worker ports (10002-19999 by
                               # default), below Linux's ephemeral range (32768-60999 by default)


def ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = LOOPBACK) -> list:
    """n distinct TCP ports that are free on host now, for listeners that keep their port (an
    edge serves the same URL after a restart). They are drawn at random below the kernel's
    ephemeral range: a port the kernel picked (bind to 0) is one it also gives outgoing
    connections, and one of those took an edge's port between the pick and its bind (seen
    in the suite: EADDRINUSE). The kernel picks where that range is too small."""
    lo, hi = FIXED_PORTS[0], min(FIXED_PORTS[1], ephemeral_low() - 1)
    got, socks = [], []
    try:
        if hi - lo >= 64 * n:
            for port in random.SystemRandom().sample(range(lo, hi + 1), 16 * n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, port))
                except OSError:
                    s.close()
                    continue
                socks.append(s)
                got.append(port)
                if len(got) == n:
                    return got
        while len(got) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
            got.append(s.getsockname()[1])
        return got
    finally:
        for s in socks:
            s.close()


def _auth_dict(auth):
    from kdn.core.auth import Tokens
    if auth is None or isinstance(auth, dict):
        return Tokens.from_dict(auth).to_dict()
    return auth.to_dict()


def start_network(topology, root, network: str = "kdn", detached: bool = False,
                  replicas: int = 2, http: bool = False, timeout_s: float = 60.0,
                  edge_options: dict = None, auth=None, origin_options: dict = None) -> Network:
    """Start the origin and every edge of `topology` on the connected Ray cluster.

    The origin keeps its durable store under `root`; every chunk goes to `replicas` ring
    owners. edge_options go to each EdgeNode (policy, hot_fraction, replication settings,
    store_codec), origin_options to the OriginNode (store_codec: "raw" or a lossless codec).
    Returns when every actor answers.
    """
    import ray
    from kdn.core.rpc import Actors, Unreachable, remote_error
    from kdn.core.transfer import check_store_codec
    check_node_name(network, "network name")                                # before anything starts
    check_store_codec((origin_options or {}).get("store_codec", "raw"), "origin")
    check_store_codec((edge_options or {}).get("store_codec", "raw"), "edge")
    from kdn.edge.options import check_edge_options, fill_bytes
    for e in topology.edges:                                  # every edge's, before anything starts
        check_edge_options(topology.edge_options(e.name), f"{topology.source}: edge {e.name!r}")
    fill_bytes(None, 0)          # KDN_OBJECT_STORE_FILL_BYTES here (an embedded cluster's nodes inherit it)
    from kdn.origin.objects import is_bucket
    root = str(root) if is_bucket(str(root)) else str(Path(root).absolute())
    ocls = ray.remote(_origin_class())
    # A store on one node's disk: where a node is labelled kdn-role=origin (see
    # ray_cluster.yaml), pin the origin (and its restarts) there, not just to its region. A
    # store in a bucket (s3://) is reachable from any node: the origin restarts anywhere in it.
    selector = {"region": topology.origin_region}
    if not is_bucket(root) and any(n.get("Alive") and (n.get("Labels") or {}).get("kdn-role") == "origin"
                                   for n in ray.nodes()):
        selector["kdn-role"] = "origin"
    opts = dict(name=origin_name(network), namespace=NAMESPACE, num_cpus=0, max_restarts=-1,
                max_task_retries=0, max_concurrency=1000, label_selector=selector)
    if detached:
        opts["lifetime"] = "detached"
    auth = _auth_dict(auth)
    ports = free_ports(len(topology.edges)) if http else [None] * len(topology.edges)
    # Creating the actors is Ray's own call (as in start_edge); every call to them after it
    # goes through Actors, which fails over on exactly what kdn.core.rpc says.
    origin_options = dict(origin_options or {})
    if http:      # the origin serves its frames where the edges serve theirs (its pushes' data plane)
        origin_options.setdefault("http_host", (edge_options or {}).get("http_host", "127.0.0.1"))
    origin = ocls.options(**opts).remote(network=network, root=root, topology=topology.to_dict(),
                                         replicas=replicas, auth=auth, **origin_options)
    edges = {e.name: start_edge(network, e, topology, detached=detached, http_port=port,
                                replicas=replicas, auth=auth, **_edge_k(edge_options, k))
             for k, (e, port) in enumerate(zip(topology.edges, ports))}
    actors = Actors(network, auth["admin"])
    deadline = time.monotonic() + timeout_s
    try:
        pings = {node: actors.stub(node, how="start").ping() for node in (ORIGIN_NODE, *edges)}   # all at once
        for node, ref in pings.items():
            actors.get_sync(node, ref, timeout=max(0.1, deadline - time.monotonic()))
        actors.origin(timeout_s, "sync").set_members([(e.name, e.region, e.weight) for e in topology.edges])
    except Unreachable as e:
        stop_network(network)        # nothing half-started is left behind
        raise NetworkError(f"network {network!r} did not start within {timeout_s:.0f} s: {e}") from None
    except ray.exceptions.RayTaskError as e:          # a ping that raised: a bug, or a refusal
        stop_network(network)
        raise remote_error(e) from None
    except KDNError:                                  # the origin refused the members
        stop_network(network)
        raise
    return Network(network, topology, origin, edges)


def stop_network(net_or_name) -> None:
    """Kill the origin and edge actors of a network (its durable store stays on disk)."""
    import ray
    name = net_or_name.name if isinstance(net_or_name, Network) else net_or_name
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor.get("namespace") == NAMESPACE and actor["name"].startswith(f"{name}:"):
            try:
                ray.kill(ray.get_actor(actor["name"], namespace=NAMESPACE), no_restart=True)
            except ValueError:
                pass


def teardown(net=None, cluster=None, root=None) -> None:
    """Stop a network, then its cluster, then remove a scratch directory; never raises.

    For benchmarks and demos that build everything themselves: whatever failed half-way,
    nothing they started is left running.
    """
    import shutil
    if net is not None:
        try:
            stop_network(net)
        except Exception:  # noqa: BLE001 - the cluster goes next anyway
            pass
    if cluster is not None:
        try:
            cluster.shutdown()
        except Exception:  # noqa: BLE001
            pass
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


# --- kdn up / kdn down ---------------------------------------------------------------------
_SIZE_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
               "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
               "tb": 10**12}


def parse_size(text, what: str = "size") -> int:
    """Bytes from '200G', '512MiB', '1.5T', '10GB' or a plain integer (K/M/G/T and KiB..TiB
    binary, KB..TB decimal); BadRequest naming the problem."""
    import re
    from kdn.core.errors import BadRequest
    if isinstance(text, int) and not isinstance(text, bool):
        n = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m and _SIZE_UNITS.get(m.group(2).lower())
        if not m or unit is None:
            raise BadRequest(f"{what}: {text!r:.40} is not a size (e.g. 200G, 512MiB, 10GB)")
        n = int(float(m.group(1)) * unit)
    if n <= 0:
        raise BadRequest(f"{what}: must be more than 0 bytes, got {text!r:.40}")
    return n


def check_edge_disk(edge_disk, edge_disk_dir, embedded: bool) -> dict:
    """edge_options for `kdn up --edge-disk SIZE [--edge-disk-dir DIR]`, checked before
    anything starts; on an embedded cluster the directory must be creatable and writable here."""
    from kdn.core.errors import BadRequest
    from kdn.core.files import make_dirs
    if edge_disk is None:
        if edge_disk_dir is not None:
            raise BadRequest("--edge-disk-dir needs --edge-disk SIZE")
        return {}
    out = {"disk_bytes": parse_size(edge_disk, "--edge-disk")}
    if edge_disk_dir is not None:
        out["disk_dir"] = str(Path(edge_disk_dir).expanduser().absolute())
        if embedded:
            try:
                make_dirs(out["disk_dir"])
            except OSError as e:
                raise BadRequest(f"--edge-disk-dir {edge_disk_dir}: cannot create it: "
                                 f"{e.strerror or e}") from None
            if not os.access(out["disk_dir"], os.W_OK | os.X_OK):
                raise BadRequest(f"--edge-disk-dir {edge_disk_dir}: not writable")
    return out


def check_origin(root=None, origin=None) -> tuple:
    """(location, origin_options) for `kdn up --origin DIR|s3://bucket/prefix` (--root DIR
    is the older spelling): a bucket is reached and listed now with the AWS_* variables
    (StoreError naming the bucket and the reason: wrong credentials, no such bucket, no
    answer), and those settings go to the origin actor, so it reaches the bucket from any node."""
    from kdn.core.errors import BadRequest
    from kdn.origin.objects import is_bucket, open_objects, s3_settings
    if root is not None and origin is not None:
        raise BadRequest("give the origin's store once: --origin (a directory or s3://bucket/prefix), "
                         "or --root DIR")
    location = origin if origin is not None else root
    if location is None:
        return str((kdn_home() / "origin").absolute()), {}
    if not is_bucket(str(location)):
        if "://" in str(location):
            raise BadRequest(f"--origin {location}: only a directory or s3://bucket/prefix is supported")
        return str(Path(location).expanduser().absolute()), {}
    env = s3_settings()
    open_objects(str(location), env=env, timeout_s=10.0, retries=1).check()
    return str(location), {"store_env": env}


def up(topology_file=None, address=None, root=None, network: str = "kdn", http: bool = True,
       edge_codec: str = "raw", origin_codec: str = "raw", edge_disk=None, edge_disk_dir=None,
       origin=None, kv_events=None):
    """Start a network: on an embedded local cluster (no address) or on the cluster at address.

    edge_codec / origin_codec: how edges and the origin store chunks (kdn.core.codecs; the origin
    only losslessly). edge_disk / edge_disk_dir: a disk tier of that size beneath every
    edge's memory, kept in edge_disk_dir/<edge> (check_edge_disk; the topology file may set
    one per edge instead). origin: where the origin keeps everything, a directory (the same
    as root=) or s3://bucket/prefix reached with the AWS_* variables of this environment
    (check_origin: a wrong key or an unreachable bucket fails here). Checked before anything
    starts. kv_events: every edge publishes vLLM KV events (kdn/edge/events.py), edge k of the
    topology on PORT + 2k (replay PORT + 2k + 1); off by default.

    Returns the state written for `kdn down` and `kdn status`.
    """
    from kdn.core.auth import Tokens, ensure_admin_token, read_tokens_from_env
    from kdn.placement.topology import Topology
    from kdn.core.transfer import check_store_codec
    # Every setting is checked before anything starts: a bad one must not leave a cluster behind.
    check_node_name(network, "network name")
    check_store_codec(edge_codec, "edge")
    check_store_codec(origin_codec, "origin")
    disk_options = check_edge_disk(edge_disk, edge_disk_dir, embedded=address is None)
    if kv_events is not None:
        from kdn.edge.events import check_kv_events
        disk_options["kv_events"] = check_kv_events(kv_events)
    topo = Topology.from_toml(topology_file) if topology_file else Topology.default_local(list(DEFAULT_REGIONS))
    readers = read_tokens_from_env()
    root, origin_store = check_origin(root, origin)
    state = {"network": network, "root": root, "started": time.time()}
    stale = None
    if address is None and state_path().exists():
        old = read_state()
        if cluster_alive(old):
            raise KDNError(f"a KDN cluster started by `kdn up` is running (recorded in {state_path()}); "
                           "run `kdn down` first")
        stale = _clear_stale(old)
    auth = {"admin": ensure_admin_token(kdn_home()), "readers": readers}
    Tokens.from_dict(auth)                       # token lengths checked here, not in an actor
    if address is None:
        regions = [topo.origin_region] + [r for r in topo.regions if r != topo.origin_region]
        cluster = LocalCluster(regions, shutdown_at_exit=False, object_store_bytes=object_store_for(topo))
        state.update(address=cluster.address, pids=process_records(cluster.pids()), embedded=True)
    else:
        state.update(address=address, pids=[], embedded=False)
    if stale is not None:
        state["replaced_stale"] = stale
    started = False
    try:
        init_ray(state["address"])
        state["warnings"] = store_room_warnings(topo)
        start_network(topo, root, network=network, detached=True, http=http, auth=auth,
                      edge_options={"store_codec": edge_codec, **disk_options},
                      origin_options={"store_codec": origin_codec, **origin_store})
        started = True
    finally:
        if not started and state["embedded"]:   # nothing recorded yet (even after ^C): stop
            _stop_processes(_ours(state["pids"]))  # what this call started
    state_path().parent.mkdir(parents=True, exist_ok=True)
    state_path().write_text(json.dumps(state, indent=1))
    return state


def process_records(pids) -> list:
    """[[pid, start time]] for live pids: what `kdn down` checks before it kills anything."""
    import psutil
    out = []
    for pid in pids:
        try:
            out.append([pid, psutil.Process(pid).create_time()])
        except psutil.Error:
            continue
    return out


def _ours(records) -> list:
    """The recorded processes still running as the same processes (pid and start time match;
    a bare pid from an older record is trusted only while its name looks like Ray's)."""
    import psutil
    out = []
    for rec in records:
        pid, started = (rec, None) if isinstance(rec, int) else (rec[0], rec[1])
        try:
            p = psutil.Process(pid)
            same = (abs(p.create_time() - started) < 0.01 if started is not None
                    else any(w in " ".join(p.cmdline()) for w in ("ray", "gcs_server", "raylet")))
        except psutil.Error:
            continue
        if same:
            out.append(pid)
    return out


def _clear_stale(state: dict) -> float:
    """Stop what is left of a dead recorded cluster (only our processes) and drop its record."""
    _stop_processes(_ours(state.get("pids", [])))
    state_path().unlink(missing_ok=True)
    return state.get("started")


def _stop_processes(pids, grace_s: float = 5.0) -> None:
    """Terminate these processes and everything they started (agents, workers); kill stragglers."""
    import psutil
    procs = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs += [p] + p.children(recursive=True)
        except psutil.Error:
            continue
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    # a killed process is gone only once the kernel has freed its memory (a raylet's object
    # store, its pages all allocated: kdn.core.prefault), so wait for that too; a zombie has
    # (nothing may reap an orphan in a container): it counts as gone
    deadline = time.monotonic() + KILLED_WAIT_S
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _exiting(p)]
        if alive:
            time.sleep(0.05)


def _exiting(p) -> bool:
    """Whether a killed process is still on its way out (not gone, not a zombie)."""
    import psutil
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def down(before_stop=None) -> dict:
    """Stop what `kdn up` started: the network's actors, then the embedded cluster's processes.
    before_stop(network), when given, runs first on a live cluster (`kdn down` stops the
    network's `kdn serve` application with it)."""
    state = read_state()
    if cluster_alive(state):
        init_ray(state["address"])
        if before_stop is not None:         # the CLI's: stop `kdn serve`'s application first
            before_stop(state["network"])
        stop_network(state["network"])
        import ray
        ray.shutdown()
    else:
        state["was_dead"] = True
    _stop_processes(_ours(state.get("pids", [])))
    state_path().unlink(missing_ok=True)
    return state
