"""What the benchmarks share besides their output format (kdn.bench): the regions they build,
free ports, a folder for a run's files that goes when the run ends, a real redis-server
started and stopped for them, and the time-to-first-token table of the two TTFT benches.

Every benchmark that needs a network builds it with kdn.launch.cluster (LocalCluster,
start_network) and tears it down with its `teardown`; this module holds the rest that used
to be written once per benchmark.
"""
import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time

from kdn.launch.cluster import free_ports

REGIONS = ("us-east", "eu-west", "ap-south")   # the benches' three regions (the first is the origin's)
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on loopback now (the kernel picks it)."""
    return free_ports(1)[0]


def scratch_dir(prefix: str, parent: "str | None" = None) -> str:
    """A new folder for one run's files (an origin's, a disk tier's), under parent or the
    system's temporary folder, removed when this process exits: a bench that moves gigabytes
    leaves none behind, whether it ends or fails. KDN_KEEP_SCRATCH=1 keeps it, to look into."""
    path = tempfile.mkdtemp(prefix=prefix, dir=parent)
    if os.environ.get("KDN_KEEP_SCRATCH") != "1":
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def start_redis(workdir: str, timeout_s: float = 10.0):
    """A redis-server on loopback, no persistence, its files in workdir: (process, port) once
    it answers PING. FileNotFoundError when redis-server is not installed (the message says
    how to install it); RuntimeError, the process killed, when it does not answer in time."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (apt-get install -y redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--bind", LOOPBACK, "--port", str(port), "--save", "",
                             "--appendonly", "no", "--protected-mode", "yes", "--dir", workdir,
                             "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((LOOPBACK, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, port
        except OSError:
            time.sleep(0.05)
    stop_process(proc)
    raise RuntimeError(f"redis-server did not answer on {LOOPBACK}:{port} within {timeout_s:.0f} s")


def stop_process(proc, timeout_s: float = 10.0) -> None:
    """Terminate proc (None: nothing) and wait for it; kill it if it does not exit in time."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ttft_table(rows, limit: str, extra: dict) -> None:
    """The time-to-first-token table of `kdn bench ttft` and `kdn bench vllm`: the columns
    they share (knowledge, KV, full and KDN TTFT, speedup and its limit (the row's key
    `limit`), fetch, same first token) around `extra`, {column: row -> text}."""
    from kdn.bench import table
    table([{"knowledge": r["knowledge_tokens"], "KV MiB": f"{r['kv_bytes'] / 2**20:.0f}",
            "full ms": f"{r['full_ttft_s'] * 1000:.0f}", "KDN ms": f"{r['kdn_ttft_s'] * 1000:.0f}",
            "speedup": f"{r['speedup']:.1f}x", "limit": f"{r[limit]:.1f}x",
            "fetch ms": f"{r['fetch_s'] * 1000:.1f}", **{c: f(r) for c, f in extra.items()},
            "same 1st token": "yes" if r["first_token_identical"] else "NO"} for r in rows])


def row_at(rows, knowledge_tokens: int) -> "dict | None":
    """The row measured at a length (a goal's), if the run measured it."""
    return next((r for r in rows if r["knowledge_tokens"] == knowledge_tokens), None)


def add_own_cores(ap) -> None:
    """The --own-cores flag of the benches that take --hosts (kdn.testing.netns.HostCluster's cores)."""
    ap.add_argument("--own-cores", action="store_true",
                    help="with --hosts: each host's processes, and the receive work for packets "
                         "arriving at it, on CPUs of its own (this machine's split among the hosts)")


def check_host_flags(ap, args, regions) -> None:
    """--cap and --own-cores need --hosts, and --own-cores a CPU for each of `regions`: an
    argparse error naming the flag otherwise."""
    for flag, given in (("--cap", args.cap is not None), ("--own-cores", args.own_cores)):
        if given and not args.hosts:
            ap.error(f"{flag} needs --hosts")
    if args.own_cores:
        from kdn.testing.netns import own_cores
        try:
            own_cores(regions)
        except ValueError as e:
            ap.error(f"--own-cores: {e}")
