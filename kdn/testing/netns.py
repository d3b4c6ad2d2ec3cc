"""Hosts with their own addresses on one machine: Linux network namespaces on a bridge.

Each host is a network namespace (`kdn-<tag>-<i>`) with its own address on a private /24
that this module creates and removes: a bridge in the root namespace holds the first address
(the "head" host, where a test's driver runs), and each namespace reaches it through a veth
pair. A host's link can be capped with `tc` (token bucket, `tbf`, on both ends of its veth,
so traffic in and out of the host is held to the rate); latency cannot be added (the kernel
here has no `netem`), so every link's round trip is the veth's own, tens of microseconds.

Each veth end steers a flow's packets to one CPU (receive packet steering, `rps_cpus`). A
veth without it queues a packet on the sending thread's CPU; a sender moved between CPUs
mid-stream reorders its own segments, and TCP takes the reordering for loss: about 900
needless retransmissions per 640 MiB here, seen as duplicate data dropped at the receiver
(`kfree_skb` reason TCP_OLD_DATA) with no packet lost anywhere. With steering: a handful per
minute at most (tail loss probes). Where `rps_cpus` cannot be written (a read-only /sys, a
container without the host's CAP_NET_ADMIN), hosts still come up, unsteered, with a warning
(`Hosts.steered` says which).

Nothing leaves the machine: the subnet is private, namespaces have no route but the bridge,
and `Hosts.down()` (also at interpreter exit) deletes every namespace, veth and the bridge.
Root is needed; `available()` says why not where it is not.

    with Hosts(["use", "euw"]) as hosts:
        hosts.cap("euw", "2gbit")
        proc = hosts.popen("euw", [sys.executable, "-c", "..."])
"""
import atexit
import ipaddress
import logging
import os
import shutil
import subprocess
import tempfile
import uuid

from kdn.core.errors import KDNError

log = logging.getLogger("kdn.testing.netns")


class HostsError(KDNError):
    """A namespace, veth, bridge or tc command failed (the command and its stderr are named)."""


SUBNETS = "10.213.0.0/16"      # each Hosts takes a /24 of it that no interface here uses
# held while a /24 is chosen and its bridge made (several processes at once)
LOCK = os.path.join(tempfile.gettempdir(), "kdn-netns.lock")
MULTI_NODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"   # Ray's switch for nodes on several addresses
HEAD_TRIES = 3                  # starts of the Ray head, each on a port picked anew, before giving up


def available() -> "str | None":
    """None when namespaces can be made here; else why not, in a sentence."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespaces need the `{tool}` command (iproute2), not found on PATH"
    probe = f"kdn-probe-{uuid.uuid4().hex[:6]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"`ip netns add` failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of SUBNETS that no address or route on this machine falls in."""
    used = set()
    for line in _sh("ip", "-4", "-o", "addr", "show").splitlines() + _sh("ip", "-4", "route", "show").splitlines():
        for word in line.split():
            try:
                used.add(ipaddress.ip_network(word, strict=False).network_address.packed[:3])
            except ValueError:
                pass
    for net in ipaddress.ip_network(SUBNETS).subnets(new_prefix=24):
        if net.network_address.packed[:3] not in used:
            return net
    raise HostsError(f"every /24 of {SUBNETS} is in use on this machine")


def _cpu_mask(cpus=None) -> str:
    """CPUs (default: every CPU this process may run on) as `rps_cpus` takes them: hex words
    of 32 CPUs, most significant first, comma-separated."""
    mask = 0
    for c in (os.sched_getaffinity(0) if cpus is None else cpus):
        mask |= 1 << c
    words = []
    while True:
        words.append(f"{mask & 0xFFFFFFFF:08x}")
        mask >>= 32
        if not mask:
            break
    return ",".join(reversed(words))


def _steer(prefix, dev: str, cpus=None) -> None:
    """Receive packet steering on `dev`'s receive queues: each flow's packets to one CPU of
    `cpus` (default: any CPU; see the module's docstring: without it the veth reorders a flow
    when its sender moves CPUs)."""
    mask = _cpu_mask(cpus)
    _sh(*prefix, "sh", "-c", f'for q in /sys/class/net/{dev}/queues/rx-*; do echo {mask} > "$q/rps_cpus" || exit 1; done')


def _sh(*argv, check: bool = True) -> str:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode:
        raise HostsError(f"`{' '.join(argv)}` failed ({r.returncode}): {r.stderr.strip()}")
    return r.stdout


class Hosts:
    """Namespaced hosts on a bridge: `address(name)`, `popen(name, argv)`, `cap(name, rate)`."""

    def __init__(self, names):
        names = list(names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"Hosts needs distinct host names, got {names!r}")
        if len(names) > 250:
            raise ValueError(f"a /24 has no room for {len(names)} hosts")
        self.names = names
        self.prefixlen = 24
        self.tag = uuid.uuid4().hex[:5]
        self.head, self.addresses = None, {}                # chosen by up(): a /24 nobody uses
        self.namespaces = {n: f"kdn-{self.tag}-{i}" for i, n in enumerate(names)}
        self._veth = {n: f"kv{self.tag}{i}" for i, n in enumerate(names)}   # root side; <= 15 chars
        self.bridge = f"kb{self.tag}"
        self.caps = {}
        self.steered = None        # up(): whether every veth end steers its flows (rps_cpus)
        self._up = False

    def __enter__(self):
        self.up()
        return self

    def __exit__(self, *exc):
        self.down()

    def address(self, name: str) -> str:
        return self.addresses[name]

    def up(self) -> "Hosts":
        """Create the bridge, the namespaces and their links (removed again on failure)."""
        import fcntl
        why = available()
        if why:
            raise HostsError(why)
        atexit.register(self.down)
        self._up = True
        try:
            with open(LOCK, "w") as lock:            # two test processes never take one /24
                fcntl.flock(lock, fcntl.LOCK_EX)
                net = _free_subnet()
                addrs = list(net.hosts())
                self.head = str(addrs[0])                     # the bridge: the root namespace
                self.addresses = {n: str(addrs[i + 1]) for i, n in enumerate(self.names)}
                _sh("ip", "link", "add", self.bridge, "type", "bridge")
                _sh("ip", "addr", "add", f"{self.head}/{self.prefixlen}", "dev", self.bridge)
            _sh("ip", "link", "set", self.bridge, "up")
            for n in self.names:
                ns, veth = self.namespaces[n], self._veth[n]
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _sh("ip", "link", "set", veth, "master", self.bridge)
                _sh("ip", "link", "set", veth, "up")
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add",
                    f"{self.addresses[n]}/{self.prefixlen}", "dev", "eth0")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                _sh("ip", "netns", "exec", ns, "ip", "route", "add", "default", "via", self.head)
                if self.steered is not False:
                    try:
                        _steer((), veth)
                        _steer(("ip", "netns", "exec", ns), "eth0")
                        self.steered = True
                    except HostsError as e:      # a read-only /sys, no CAP_NET_ADMIN of the host
                        self.steered = False
                        log.warning("hosts' links left unsteered, so a flow may arrive out of order "
                                    "and be retransmitted needlessly: %s", e)
        except BaseException:
            self.down()
            raise
        return self

    def cap(self, name: str, rate: str, burst: str = "4mb") -> None:
        """Hold host `name`'s link to `rate` (tc's units: "2gbit", "500mbit") both ways: a
        token bucket on the veth's root end (traffic into the host) and on its eth0 (out)."""
        ns = self.namespaces[name]
        for prefix, dev in (((), self._veth[name]), (("ip", "netns", "exec", ns), "eth0")):
            _sh(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", rate, "burst", burst, "latency", "50ms")
        self.caps[name] = rate

    def uncap(self, name: str) -> None:
        ns = self.namespaces[name]
        for prefix, dev in (((), self._veth[name]), (("ip", "netns", "exec", ns), "eth0")):
            _sh(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        self.caps.pop(name, None)

    def steer(self, name: str, host_cpus, head_cpus) -> None:
        """Receive work where each end's own CPUs are: packets arriving in host `name` are
        handled on host_cpus, packets from it arriving here on head_cpus (HostCluster's cores)."""
        _steer(("ip", "netns", "exec", self.namespaces[name]), "eth0", host_cpus)
        _steer((), self._veth[name], head_cpus)

    def retransmitted(self, name: "str | None" = None) -> int:
        """TCP segments sent twice so far by host `name` (None: this namespace, the head), from
        its own /proc/net/snmp: a bench prints the difference over its run, so a lossy minute
        shows."""
        argv = ["cat", "/proc/net/snmp"]
        rows = [line.split() for line in _sh(*(self.command(name, argv) if name else argv)).splitlines()
                if line.startswith("Tcp:")]
        return int(rows[1][rows[0].index("RetransSegs")])

    def cut(self, name: str, down: bool = True) -> None:
        """Cut host `name` off the network (its link down), or reconnect it (down=False)."""
        _sh("ip", "link", "set", self._veth[name], "down" if down else "up")

    def command(self, name: str, argv) -> list:
        """argv run inside host `name`'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[name], *argv]

    def popen(self, name: str, argv, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(name, argv), **kw)

    def run(self, name: str, argv, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(name, argv), **kw)

    def down(self) -> None:
        """Remove every namespace (processes still inside lose their network), veth and the bridge."""
        if not self._up:
            return
        self._up = False
        for n in self.names:
            _sh("ip", "netns", "pids", self.namespaces[n], check=False)
            _sh("ip", "link", "del", self._veth[n], check=False)
            _sh("ip", "netns", "del", self.namespaces[n], check=False)
        _sh("ip", "link", "del", self.bridge, check=False)


def _check_cores(regions, cores) -> "dict | None":
    """HostCluster's cores as {region: set of CPUs}, each a non-empty set of CPUs this process
    may use, for exactly the cluster's regions; ValueError naming what is wrong."""
    if cores is None:
        return None
    if cores == "own":
        cores = own_cores(regions)
    if not isinstance(cores, dict):
        raise ValueError(f'cores must be "own" or {{region: CPUs}}, got {cores!r}')
    if set(cores) != set(regions):
        raise ValueError(f"cores names regions {sorted(cores)}, the cluster has {sorted(regions)}")
    mine = os.sched_getaffinity(0)
    out = {r: set(c) for r, c in cores.items()}
    for r, c in out.items():
        if not c or not c <= mine:
            raise ValueError(f"region {r}'s cores {sorted(c)} must be a non-empty subset of the CPUs this "
                             f"process may use, {sorted(mine)}")
    if shutil.which("taskset") is None:
        raise ValueError("hosts with cores of their own need the `taskset` command (util-linux), not found on PATH")
    return out


def own_cores(regions) -> dict:
    """{region: CPUs}: this process's CPUs split among the regions, round robin (HostCluster's
    cores="own"); a ValueError when there are fewer CPUs than regions."""
    mine = sorted(os.sched_getaffinity(0))
    regions = list(regions)
    if len(mine) < len(regions):
        raise ValueError(f"{len(regions)} hosts with cores of their own need as many CPUs; this process "
                         f"may use {len(mine)}")
    return {r: {c for j, c in enumerate(mine) if j % len(regions) == i} for i, r in enumerate(regions)}


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class HostCluster:
    """A real Ray cluster whose regions are hosts with their own addresses: the first region's
    node is the head, on the bridge's address in this namespace (a driver must run on a node
    of its cluster: this process joins through it); every other region's node runs in its own
    namespace (`Hosts`), started with `ray start --block` there. Each node is labelled
    `region=<name>`, as LocalCluster's are, so `start_network` places edges the same way.

    `kill(region)` ends a region's node as a crashed host would; `hosts` caps and cuts links.

    cores ({region: CPUs}, or "own" to split this process's CPUs among the regions, round
    robin, siblings of one physical core not told apart): each region's node, everything it
    starts, and the receive work for packets arriving at that host run on those CPUs only, as
    on hosts with cores of their own (`taskset`). The head's CPUs also hold the thread that
    made the cluster, and every thread it starts, from then until shutdown() (threads already
    running keep theirs). Packets between two namespaced hosts are forwarded by the bridge on
    the head's CPUs. Default: every process on every CPU, as the machine schedules it.
    """

    def __init__(self, regions, cpus: int = 1, object_store_bytes: int = 512 << 20,
                 start_timeout_s: float = 90.0, cores=None):
        import sys
        from pathlib import Path
        from kdn.client.join import ensure_ray_token
        from kdn.core.env import prepare_ray_env
        self.regions = list(regions)
        if len(self.regions) < 2:
            raise ValueError("a host cluster needs at least two regions (the head's and one more)")
        self.cores = _check_cores(self.regions, cores)
        prepare_ray_env()
        ensure_ray_token()
        self.hosts = Hosts(self.regions[1:]).up()
        self._affinity = None
        self._ray = str(Path(sys.executable).parent / "ray")
        self._procs = {}
        # KDN keeps Ray to one address (kdn.core.env): these nodes have addresses of their own
        self._env = {**os.environ, MULTI_NODE: "1"}
        self._was = None
        self.logs = Path(tempfile.mkdtemp(prefix="kdn-hosts-"))    # each node's `ray start` output
        common = ["--block", f"--num-cpus={cpus}", f"--object-store-memory={object_store_bytes}",
                  "--disable-usage-stats"]
        try:
            if self.cores is not None:
                for r in self.regions[1:]:
                    self.hosts.steer(r, self.cores[r], self.cores[self.regions[0]])
                self._affinity = os.sched_getaffinity(0)
                os.sched_setaffinity(0, self.cores[self.regions[0]])   # the driver, the head: inherited
            for attempt in range(HEAD_TRIES):
                # the port is free when picked, not when the head binds it: another process on
                # this machine may take it first (the head exits, "Failed to start GCS"): again
                port = _free_port(self.hosts.head)
                self.address = f"{self.hosts.head}:{port}"
                self._procs[self.regions[0]] = subprocess.Popen(
                    self.command(self.regions[0], [
                        self._ray, "start", "--head", f"--port={port}", f"--node-ip-address={self.hosts.head}",
                        f"--labels=region={self.regions[0]}", "--include-dashboard=false", *common]),
                    stdout=self._log(self.regions[0]), stderr=subprocess.STDOUT, start_new_session=True,
                    env=self._env)
                try:
                    self._await_gcs(start_timeout_s)
                    break
                except HostsError:
                    head = self._procs[self.regions[0]]
                    if head.poll() is None or attempt == HEAD_TRIES - 1:
                        raise
                    del self._procs[self.regions[0]]    # exited: nothing of it to stop
            self._await_nodes(1, start_timeout_s)
            # one at a time: nodes of one machine share the session's folder, and two starting
            # at once can race for one socket name there (a raylet died of "bind: Address
            # already in use" on a busy machine)
            for i, r in enumerate(self.regions[1:], start=2):
                self._procs[r] = subprocess.Popen(
                    self.command(r, [self._ray, "start", f"--address={self.address}",
                                     f"--node-ip-address={self.hosts.address(r)}", f"--labels=region={r}",
                                     *common]),
                    stdout=self._log(r), stderr=subprocess.STDOUT, start_new_session=True, env=self._env)
                self._await_nodes(i, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def address_of(self, region: str) -> str:
        return self.hosts.head if region == self.regions[0] else self.hosts.address(region)

    def command(self, region: str, argv) -> list:
        """argv run on region's host: in its namespace (none for the head's), on its cores
        when the cluster has them (`taskset`)."""
        pinned = ["taskset", "-c", ",".join(map(str, sorted(self.cores[region])))] if self.cores else []
        argv = [*pinned, *argv]
        return argv if region == self.regions[0] else self.hosts.command(region, argv)

    def _await_gcs(self, timeout_s: float) -> None:
        import socket
        import time
        host, port = self.address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with socket.create_connection((host, int(port)), timeout=1.0):
                    return
            except OSError:
                if self._procs[self.regions[0]].poll() is not None or time.monotonic() > deadline:
                    raise HostsError(f"the Ray head on {self.address} did not start")
                time.sleep(0.2)

    def _await_nodes(self, n: int, timeout_s: float) -> None:
        """Until n nodes are alive, checked by `ray.nodes()` from this process (joined here)."""
        import time
        import ray
        from kdn.client.join import init_ray
        if not ray.is_initialized():
            self._multi_node(True)
            init_ray(self.address, node_ip=self.hosts.head)
        deadline = time.monotonic() + timeout_s
        while sum(1 for x in ray.nodes() if x["Alive"]) < n:
            dead = [r for r, p in self._procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = "; ".join(f"{r}: ...{self._tail(r)}" for r in dead)
                raise HostsError(f"Ray nodes of {dead or 'some regions'} did not join {self.address} "
                                 f"within {timeout_s:.0f} s {tails}")
            time.sleep(0.5)

    def _log(self, region: str):
        return open(self.logs / f"{region}.log", "wb")

    def _tail(self, region: str, n: int = 600) -> str:
        try:
            return (self.logs / f"{region}.log").read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _multi_node(self, on: bool) -> None:
        """Let this process drive a cluster of several addresses (on), or put back what it had."""
        from ray._private import ray_constants
        if on:
            self._was = (os.environ.get(MULTI_NODE), ray_constants.ENABLE_RAY_CLUSTER)
            os.environ[MULTI_NODE] = "1"
            ray_constants.ENABLE_RAY_CLUSTER = True
        elif self._was is not None:
            env, const = self._was
            if env is None:
                os.environ.pop(MULTI_NODE, None)
            else:
                os.environ[MULTI_NODE] = env
            ray_constants.ENABLE_RAY_CLUSTER = const
            self._was = None

    def kill(self, region: str) -> None:
        """End region's node and everything it runs, as a crashed host (SIGKILL to each process
        in its namespace)."""
        import signal
        if region == self.regions[0]:
            raise ValueError("the head's node carries this process's driver: kill another region")
        ns = self.hosts.namespaces[region]
        for pid in _sh("ip", "netns", "pids", ns, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._procs.pop(region).wait(timeout=30)

    def shutdown(self) -> None:
        import signal
        if self._affinity is not None:        # first: nothing below may skip it
            os.sched_setaffinity(0, self._affinity)
            self._affinity = None
        try:
            import ray
            if ray.is_initialized():
                ray.shutdown()
        finally:
            for r in [r for r in self._procs if r != self.regions[0]]:
                self.kill(r)
            self._multi_node(False)
            head = self._procs.pop(self.regions[0], None)
            import shutil
            if head is not None:                      # it and every process it started
                import psutil
                try:
                    procs = psutil.Process(head.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    procs = []
                try:
                    os.killpg(head.pid, signal.SIGKILL)
                except ProcessLookupError:            # it had exited already (a failed start)
                    pass
                for p in procs:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                head.wait(timeout=30)
            self.hosts.down()
            shutil.rmtree(self.logs, ignore_errors=True)
