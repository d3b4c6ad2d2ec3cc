"""What the `kdn` command's groups share: the network `kdn up` recorded, its arguments, sizes."""


def network_client(args, **kw):
    """A client for the network `kdn up` recorded (or the one at --address)."""
    import os
    from kdn.core.auth import load_admin_token
    from kdn.client import connect
    from kdn.core.env import kdn_home
    from kdn.client.join import read_state
    address, network = getattr(args, "address", None), getattr(args, "network", None)
    if address is None:
        state = read_state(require_alive=True)     # a dead recorded cluster: an error now, no hang
        address, network = state["address"], network or state["network"]
    return connect(address=address, network=network or "kdn", admin_token=load_admin_token(kdn_home()),
                   token=os.environ.get("KDN_TOKEN"), **kw)


def network_args(p):
    """Where the network is: the one `kdn up` recorded, unless told."""
    p.add_argument("--address", help="the Ray cluster's address (default: the recorded one)")
    p.add_argument("--network", help="the network's name (default: the recorded one)")


def gib(n):
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"
