"""Joining a network: the Ray connection and the record `kdn up` leaves for clients.

A client (a worker, a publisher, an operator's shell) finds a running network through the
state file `kdn up` wrote (kdn.launch.cluster) and joins its Ray cluster as a driver. This
module is the reading side only; starting and stopping nodes is the launcher's.
"""
import json
import os
import socket
from pathlib import Path

from kdn.core.env import kdn_home
from kdn.core.errors import NetworkError
from kdn.core.names import NAMESPACE

LOOPBACK = "127.0.0.1"   # every node of an embedded cluster, and every driver, binds loopback


def ensure_ray_token() -> None:
    """Ray 2.60 token auth needs ~/.ray/auth_token before a Cluster's head starts; make it once."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return
    from ray._private.authentication.authentication_token_setup import ensure_token_if_auth_enabled
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def init_ray(address: str, namespace: str = NAMESPACE, node_ip: str = None) -> None:
    """Connect this process to Ray at `address` ("local" starts a private one-node instance),
    as a driver on the node at node_ip: by default the head's own address when it is one of
    this machine's (a head on an address of its own: kdn.testing.netns), else loopback."""
    import ray
    if ray.is_initialized():
        return
    node_ip = node_ip or driver_ip(address)
    ray.init(address=address, namespace=namespace, include_dashboard=False, _node_ip_address=node_ip,
             log_to_driver=False, configure_logging=True, logging_level="WARNING")


def driver_ip(address: str) -> str:
    """The node address a driver of the cluster at `address` runs on: the head's host when it
    is an address of this machine other than loopback (this process is on the head's node),
    loopback otherwise."""
    from kdn.core.env import is_loopback
    host = str(address).rpartition(":")[0].strip("[]")
    if not host or is_loopback(host):
        return LOOPBACK
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))            # binds only to an address this machine has
    except (OSError, ValueError):
        return LOOPBACK
    return host


def state_path() -> Path:
    return kdn_home() / "cluster.json"


def read_state(require_alive: bool = False) -> dict:
    """The record `kdn up` wrote. require_alive: NetworkError at once (not after minutes of
    Ray retries) when the recorded cluster is not running any more."""
    try:
        state = json.loads(state_path().read_text())
    except FileNotFoundError:
        raise NetworkError("no KDN cluster is recorded: start one with `kdn up`") from None
    except ValueError:
        raise NetworkError(f"{state_path()} is not a KDN cluster record (not JSON): remove it, "
                           "or run `kdn down`") from None
    if not isinstance(state, dict) or "address" not in state or "network" not in state:
        raise NetworkError(f"{state_path()} is not a KDN cluster record: remove it, or run `kdn down`")
    if require_alive and not cluster_alive(state):
        raise NetworkError(f"the KDN cluster recorded in {state_path()} is not running (its Ray head "
                           f"at {state['address']} does not answer; the machine rebooted or it "
                           "crashed): run `kdn down` to clear the record, then `kdn up`")
    return state


def cluster_alive(state: dict, timeout_s: float = 1.0) -> bool:
    """Whether the recorded cluster's Ray head (its GCS address) accepts connections."""
    host, _, port = str(state.get("address", "")).rpartition(":")
    try:
        with socket.create_connection((host or LOOPBACK, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False
