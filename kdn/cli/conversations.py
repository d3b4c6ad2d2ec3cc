"""`kdn conversations`: a tenant's conversation KV listed, dropped, pinned, and its policy set."""
from kdn.cli.common import gib, network_args, network_client


def _conversations(args, rest):
    """A tenant's conversation KV on every edge: list it, set its TTL and budget, or drop it."""
    from kdn.cli.table import table
    from kdn.core.manifest import check_name
    from kdn.launch.cluster import parse_size
    check_name(args.tenant, "tenant")
    budget = None if args.budget is None else parse_size(args.budget, "--budget")
    cl = network_client(args, tenant=args.tenant)
    if args.drop:
        got = cl.drop_conversations()
        print(f"dropped {sum(n or 0 for n in got.values())} conversation chunks of tenant {args.tenant!r} "
              f"({', '.join(f'{e} {n}' if n is not None else f'{e} DOWN' for e, n in got.items())})")
        return 0 if all(n is not None for n in got.values()) else 1
    if args.pin is not None:
        r = cl.pin_conversations(pinned=args.pin)
        print(f"tenant {args.tenant!r}: conversation KV " + ("pinned at the origin" if args.pin else
              f"unpinned ({r['deleted']} chunks deleted at the origin)"))
    if args.ttl is not None or args.budget is not None or args.max_ttl is not None:
        cl.set_conversation_policy(ttl_s=args.ttl, max_ttl_s=args.max_ttl, budget_bytes=budget)
    got = cl.conversations()
    at_origin = cl.pinned_conversations()
    if args.json:
        import json
        print(json.dumps({"edges": got, "origin": at_origin}))
        return 0
    rows = []
    for e in got:
        if e.get("down"):
            rows.append({"edge": e["edge"], "region": e["region"], "state": "DOWN"})
            continue
        p, convs = e["policy"], e["conversations"]
        rows.append({"edge": e["edge"], "region": e["region"], "conversations": len(convs),
                     "chunks": sum(c["chunks"] for c in convs), "bytes": gib(sum(c["bytes"] for c in convs)),
                     "on disk": gib(sum(c.get("on_disk", 0) for c in convs)),
                     "idle TTL s": f"{p['ttl_s']:g}", "max TTL s": f"{p['max_ttl_s']:g}",
                     "budget": gib(p["budget_bytes"])})
    print(f"conversation KV of tenant {args.tenant!r}:")
    table(rows)
    if at_origin["pinned"] or at_origin["chunks"]:
        print(f"pinned at the origin: {'yes' if at_origin['pinned'] else 'no'}, "
              f"{sum(at_origin['chunks'].values())} chunks in {len(at_origin['chunks'])} namespaces")
    return 0 if all(not e.get("down") for e in got) else 1


def _conversations_args(sub):
    c = sub.add_parser("conversations", help="a tenant's conversation KV on every edge (what `kdn serve` "
                                             "kept of its chats): list it, set its TTL and budget, pin "
                                             "it at the origin, drop it")
    c.add_argument("--tenant", default="default")
    c.add_argument("--ttl", type=float, default=None, metavar="SECONDS",
                   help="the tenant's idle TTL (default 1800; prompt_cache_retention in_memory)")
    c.add_argument("--max-ttl", dest="max_ttl", type=float, default=None, metavar="SECONDS",
                   help="the longest TTL a request may ask for (prompt_cache_retention 24h; default 86400)")
    c.add_argument("--budget", default=None, metavar="SIZE",
                   help="the tenant's conversation KV per edge, e.g. 512MiB (default 1GiB)")
    c.add_argument("--drop", action="store_true", help="drop the tenant's conversation KV everywhere")
    pin = c.add_mutually_exclusive_group()
    pin.add_argument("--pin", dest="pin", action="store_const", const=True, default=None,
                     help="keep the tenant's conversation KV at the origin too (a long-lived agent's "
                          "context outlives its home edge's restart, eviction and TTL)")
    pin.add_argument("--unpin", dest="pin", action="store_const", const=False,
                     help="no longer: the origin's copies are deleted")
    c.add_argument("--json", action="store_true")
    network_args(c)
    c.set_defaults(func=_conversations)


def add_parsers(sub) -> None:
    """This group's subcommands."""
    _conversations_args(sub)
