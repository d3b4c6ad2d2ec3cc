"""`kdn serve`: the OpenAI-compatible service over the network's KBs, started, listed or stopped."""
from kdn.cli.common import network_args
from kdn.engines.base import ENGINES


def _serve(args, rest):
    from kdn.serve import app as serve
    from kdn.client.join import init_ray
    opts = serve.load_config(args.config) if args.config and not args.down else {}  # a bad file: no connect
    address, network = _where(args)
    init_ray(address)
    if args.down:
        gone = serve.undeploy(network)
        print(f"service of network {network!r} " + ("stopped" if gone else "was not running"))
        return 0
    for key in serve.CONFIG_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            opts[key] = value.split(",") if key == "regions" else value
    return deploy_service(network, opts, args.json)


def deploy_service(network: str, opts: dict, as_json: bool = False) -> int:
    """Deploy (or update) the network's OpenAI-compatible service and say where it is."""
    import json
    from kdn.serve import app as serve
    from kdn.core.auth import load_admin_token, read_tokens_from_env
    info = serve.deploy(network, auth={"admin": load_admin_token(), "readers": read_tokens_from_env()}, **opts)
    if as_json:
        print(json.dumps(info))
        return 0
    print(f"KDN service of network {network!r}: {info['url']} (the caller's region, or a faster neighbour)")
    for region, url in info["regions"].items():
        print(f"  {region}: {url}")
    return 0


def service_lines(info: dict) -> list:
    if not info:
        return ["service: not running (start it with `kdn serve`)"]
    lines = [f"service: {info['status']} at {info['url']} (the caller's region, or a faster neighbour)"]
    for region, url in info["regions"].items():
        d = info["deployments"][region]
        scale = d.get("autoscaling")
        how = (f"autoscaling {scale['min_replicas']}-{scale['max_replicas']} at {scale['target_ongoing_requests']:g} "
               f"ongoing" if scale else f"{d.get('num_replicas')} fixed")
        lines.append(f"  {region}: {url}  replicas " + (", ".join(f"{n} {s}" for s, n in sorted(d["replicas"].items()))
                                                        or "none")
                     + f" ({how}; admits {d.get('max_ongoing_requests')}, queues {d.get('max_queued_requests')})"
                     + (f" on {', '.join(d['nodes'])}" if d.get("nodes") else ""))
    from kdn.serve.metrics import summary_lines
    return lines + summary_lines(info.get("routing") or {})


def _where(args) -> tuple:
    """(Ray address, network name): the ones given, else the ones `kdn up` recorded."""
    from kdn.client.join import read_state
    address, network = getattr(args, "address", None), getattr(args, "network", None)
    if address is None:
        state = read_state(require_alive=True)
        address, network = state["address"], network or state["network"]
    return address, network or "kdn"


def _serve_args(sub):
    s = sub.add_parser("serve", help="serve the network's KBs through an OpenAI-compatible API "
                                     "(Ray Serve, one deployment per region), or stop it (--down)")
    network_args(s)
    s.add_argument("--down", action="store_true", help="stop the service (the network keeps running)")
    s.add_argument("--config", help="TOML with regions, port, min_replicas, max_replicas, "
                                    "target_ongoing_requests, replica_cpus, max_ongoing_requests, "
                                    "max_queued_requests, engine, routers, variants, plans (flags given "
                                    "override it)")
    s.add_argument("--regions", help="regions to serve, comma-separated (default: all)")
    s.add_argument("--port", type=int, help="the port on 127.0.0.1 (default 8000)")
    s.add_argument("--min-replicas", dest="min_replicas", type=int, help="per region (default 1)")
    s.add_argument("--max-replicas", dest="max_replicas", type=int, help="per region (default 1)")
    s.add_argument("--target-ongoing-requests", dest="target_ongoing_requests", type=float,
                   help="autoscaling target per replica (default 1)")
    s.add_argument("--replica-cpus", dest="replica_cpus", type=float, help="CPUs per replica (default 1)")
    s.add_argument("--max-ongoing-requests", dest="max_ongoing_requests", type=int,
                   help="requests a replica admits, answered one at a time in arrival order (default 16)")
    s.add_argument("--max-queued-requests", dest="max_queued_requests", type=int,
                   help="per region and router replica, waiting beyond the replicas' admitted ones; more "
                        "are answered 429 (default 16)")
    s.add_argument("--engine", choices=ENGINES,
                   help="the replicas' engine (default transformers; vllm: vLLM with the KDN connector, "
                        "where vLLM is installed; it reads KBs published with --engine vllm)")
    s.add_argument("--routers", type=int, help="replicas of the ingress router (default 2)")
    s.add_argument("--variant", dest="variants", action="append", metavar="RECIPE",
                   help="also run this fine-tuned variant (`kdn model variant`) in every replica, as model "
                        "'<model>+RECIPE'; with its pair's plan (`kdn model plan`) its requests may opt in to "
                        "the base model's KV (extra_body cross_model); repeatable")
    s.add_argument("--plans", help="where the pairs' recompute plans are (default: the model cache's)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_serve)


def add_parsers(sub) -> None:
    """This group's subcommands."""
    _serve_args(sub)
