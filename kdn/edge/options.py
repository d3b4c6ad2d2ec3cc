"""An edge's settings from the topology file, checked: its disk tier and its KV events.

The topology (kdn/placement/topology.py) carries each edge's settings beside its capacity as
they are written and knows nothing of what they mean; they are the edge's: `disk_bytes` and
`disk_dir` (the disk tier beneath memory, kdn/edge/disk.py), `http_host` (the address its
HTTP server binds: "node" for its Ray node's, so peers on other hosts reach it), `kv_events` (KV events,
kdn/edge/events.py), `data_plane`, `peer_streams` and `pull_into` (how it pulls from peers,
kdn/edge/dataplane.py), `object_store_fill_bytes` (how much of its node's object store it has
allocated at start: 0 for none; where the file says nothing, KDN_OBJECT_STORE_FILL_BYTES in the
environment of the node's Ray processes, else its capacity: fill_bytes; kdn.core.prefault). The
launcher (kdn/launch/cluster.py) checks every edge's here before it starts anything, so a typo
or a bad value is one TopologyError naming the file and the edge (a bad environment value, one
BadRequest naming the variable).
"""
import ipaddress
import os

from kdn.core.checks import check_int
from kdn.core.errors import BadRequest, TopologyError
from kdn.core.dataplane import MODES
from kdn.edge.dataplane import INTO
from kdn.edge.events import check_kv_events

FILL_ENV = "KDN_OBJECT_STORE_FILL_BYTES"     # the default object_store_fill_bytes of a node's edges

OPTIONS = ("disk_bytes", "disk_dir", "kv_events", "data_plane", "peer_streams", "pull_into", "http_host",
           "object_store_fill_bytes")


def check_edge_options(options: dict, where: str) -> dict:
    """options checked and normalised (kv_events as check_kv_events makes it); `where` names
    the file and the edge in every error."""
    extra = set(options) - set(OPTIONS)
    if extra:
        raise TopologyError(f"{where}: unknown key(s) {sorted(extra)} (an edge takes name, "
                            f"capacity_bytes, {', '.join(OPTIONS)})")
    out = {}
    if "disk_bytes" in options:
        out["disk_bytes"] = check_int(options["disk_bytes"], f"{where}: disk_bytes", 1, error=TopologyError)
    if "disk_dir" in options:
        dd = options["disk_dir"]
        if "disk_bytes" not in options:
            raise TopologyError(f"{where}: disk_dir without disk_bytes")
        if not isinstance(dd, str) or not dd or "\0" in dd:
            raise TopologyError(f"{where}: disk_dir: must be a directory path, got {dd!r:.80}")
        out["disk_dir"] = dd
    if "kv_events" in options:
        kv = options["kv_events"]
        if not isinstance(kv, (str, dict)):
            raise TopologyError(f"{where}: kv_events: must be an endpoint (tcp://127.0.0.1:PORT) "
                                f"or a table, got {kv!r:.80}")
        try:
            out["kv_events"] = check_kv_events(kv)
        except BadRequest as e:
            raise TopologyError(f"{where}: {e}") from None
    for name, choices in (("data_plane", MODES), ("pull_into", INTO)):
        if name in options:
            if options[name] not in choices:
                raise TopologyError(f"{where}: {name}: must be one of {', '.join(choices)}, "
                                    f"got {options[name]!r:.80}")
            out[name] = options[name]
    if "http_host" in options:
        host = options["http_host"]
        try:
            ok = host == "node" or bool(ipaddress.ip_address(host))
        except ValueError:
            ok = False
        if not isinstance(host, str) or not ok:
            raise TopologyError(f"{where}: http_host: must be \"node\" (its Ray node's address) or "
                                f"an IP address, got {host!r:.80}")
        out["http_host"] = host
    if "object_store_fill_bytes" in options:
        out["object_store_fill_bytes"] = check_int(options["object_store_fill_bytes"],
                                                   f"{where}: object_store_fill_bytes", 0, error=TopologyError)
    if "peer_streams" in options:
        out["peer_streams"] = check_int(options["peer_streams"], f"{where}: peer_streams", 1, 16,
                                        error=TopologyError)
    return out


def fill_bytes(given, capacity_bytes: int, environ=None) -> int:
    """How much of its node's object store an edge allocates at start (kdn.core.prefault): its
    object_store_fill_bytes where given; else KDN_OBJECT_STORE_FILL_BYTES where the environment
    sets it (a node's default: 0 turns the fill off for every edge there, e.g. for short-lived
    networks, which would pay for memory they never use: 0.6-0.7 CPU-s per GiB on a 2-core VM,
    tools/fill_cpu.py); else the edge's capacity, memory a busy edge takes anyway."""
    if given is not None:
        return check_int(given, "object_store_fill_bytes", 0)
    raw = (os.environ if environ is None else environ).get(FILL_ENV, "").strip()
    if not raw:
        return capacity_bytes
    if not (raw.isascii() and raw.isdigit()):
        raise BadRequest(f"{FILL_ENV} must be a whole number of bytes >= 0, got {raw!r:.40}")
    return int(raw)
