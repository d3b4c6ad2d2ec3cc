"""Which path KV takes between nodes: the data plane's modes, and which edge addresses a host
reaches.

Bulk KV between Ray nodes travels over an edge's HTTP frames (kdn/edge/http.py), at about a
socket's pace, where Ray's object manager carries a third of it; Ray stays the control plane
and carries what sits on the reader's own node, zero-copy. The same modes hold for an edge
pulling from a peer (kdn/edge/dataplane.py) and for a reader fetching from an edge
(kdn/client/dataplane.py):
- "auto" (default): HTTP frames from an edge on another Ray node that serves HTTP; Ray else.
- "http": HTTP frames whenever the edge serves HTTP, on the same node too (tests, benches).
- "ray": always Ray.
"""
import time
from urllib.parse import urlsplit

from kdn.core.env import is_loopback
from kdn.core.errors import BadRequest

MODES = ("auto", "http", "ray")
NODE_HOST = "node"           # a node's http_host: bind the address of its Ray node
UNSPECIFIED = ("0.0.0.0", "::")     # a server bound to every address names none
ADDRESS_RETRY_S = 30.0       # an edge that served no HTTP is asked for its address again after this
STREAMS = 2                  # parallel connections one pull or fetch over HTTP may use
STREAM_MIN_KEYS = 4          # one of fewer keys takes one connection


def slices(keys, streams: int) -> list:
    """keys cut into at most `streams` contiguous slices of near-equal length, one per parallel
    connection (one slice when there are fewer than STREAM_MIN_KEYS keys)."""
    keys = list(keys)
    n = streams if len(keys) >= STREAM_MIN_KEYS else 1
    step = max(1, -(-len(keys) // n))
    return [keys[i:i + step] for i in range(0, len(keys), step)] or [keys]


def check_data_plane(mode) -> str:
    if mode not in MODES:
        raise BadRequest(f"data_plane must be one of {', '.join(MODES)}, got {mode!r:.80}")
    return mode


def reachable_url(address: dict, here_ip: str):
    """An edge's HTTP URL from its data_address ({"url", "node", "ip"}) if a process on the
    host at here_ip can reach it, else None: an edge bound to loopback is reachable only from
    its own host (its 127.0.0.1 is nobody's elsewhere); one bound to every address (0.0.0.0)
    at its node's address."""
    url = address.get("url")
    if url is None:
        return None
    host = urlsplit(url).hostname or ""
    if host in UNSPECIFIED:          # bound to every address: reach it at its node's
        ip = address.get("ip")
        if not ip:
            return None
        port = urlsplit(url).port
        return f"http://{f'[{ip}]' if ':' in ip else ip}:{port}"
    if is_loopback(host) and address.get("ip") != here_ip:
        return None
    return url


class Addresses:
    """Edges' data addresses as one process learned them (EdgeAPI.data_address, asked once;
    an edge without HTTP asked again after ADDRESS_RETRY_S), and per edge the URL to read its
    frames from under mode, or None for Ray. node_id and node_ip: this process's Ray node
    and its address."""

    def __init__(self, mode: str, node_id, node_ip):
        self.mode, self.node_id, self.node_ip = check_data_plane(mode), node_id, node_ip
        self._known = {}             # edge -> (url or None, node, when asked)

    def stale(self, edge: str) -> bool:
        """Whether edge's address must be asked (never asked, or no HTTP a while ago)."""
        known = self._known.get(edge)
        return known is None or (known[0] is None and time.monotonic() - known[2] > ADDRESS_RETRY_S)

    def note(self, edge: str, address: dict) -> None:
        self._known[edge] = (reachable_url(address, self.node_ip), address.get("node"), time.monotonic())

    def url(self, edge: str):
        """The URL to read edge over HTTP (its address known), or None: Ray."""
        url, node, _ = self._known.get(edge, (None, None, 0))
        if self.mode == "ray" or url is None or (self.mode == "auto" and node == self.node_id):
            return None
        return url

    def forget(self, edge: str) -> None:
        """edge did not answer over HTTP: its address is asked again next time."""
        self._known.pop(edge, None)

    def with_http(self) -> list:
        return sorted(e for e, (u, _, _) in self._known.items() if u)
