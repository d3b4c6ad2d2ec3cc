"""`kdn up`, `kdn down` and `kdn status`: a network started, stopped and looked at."""
import sys

from kdn.cli.common import gib, network_args, network_client
from kdn.cli.service import deploy_service, service_lines


def _up(args, rest):
    from kdn.launch.cluster import up
    state = up(topology_file=args.topology, address=args.address, root=args.root, network=args.network,
               edge_codec=args.edge_codec, origin_codec=args.origin_codec,
               edge_disk=args.edge_disk, edge_disk_dir=args.edge_disk_dir, origin=args.origin,
               kv_events=_kv_events_arg(args))
    where = "an embedded local cluster" if state["embedded"] else f"the cluster at {state['address']}"
    print(f"KDN network {state['network']!r} is up on {where}; origin store in {state['root']}")
    for line in state.get("warnings", []):
        print(f"kdn: warning: {line}", file=sys.stderr)
    if args.serve:          # the OpenAI-compatible service too, with `kdn serve`'s defaults
        return deploy_service(state["network"], {})
    print("next: kdn publish KB PATH...   kdn query KB \"question\"   kdn serve   kdn status   kdn down")
    return 0


def _kv_events_arg(args):
    if args.kv_events is None:
        return None
    return {"endpoint": args.kv_events, "block_size": args.kv_events_block_size,
            "encoding": args.kv_events_encoding, "remote": args.kv_events_remote}


def _down(args, rest):
    from kdn.launch.cluster import down
    from kdn.serve.app import undeploy
    state = down(before_stop=undeploy)
    print(f"KDN network {state['network']!r} stopped" + (" and its embedded cluster shut down"
                                                        if state.get("embedded") else ""))
    return 0


def push_line(counters: dict) -> str:
    """How the origin's pushes travelled (kdn/origin/push.py), or "" before any: chunks and
    pace per path, its bytes over the time the path had a batch in flight, each batch from the
    origin's call to the edge's answer (batches overlapping counted once: push_<path>_busy_us;
    an origin before it: the batches' own times added up)."""
    parts = []
    for path, how in (("http", "pulled by edges on other nodes from its HTTP frames"), ("ray", "over Ray")):
        n, nbytes = (counters.get(f"push_{path}_{k}", 0) for k in ("chunks", "bytes"))
        us = counters.get(f"push_{path}_busy_us") or counters.get(f"push_{path}_us", 0)
        if n:
            parts.append(f"{n} chunks {how} ({nbytes / max(us, 1) / 1e3:.2f} GB/s)")
    return "origin pushes: " + "; ".join(parts) if parts else ""


def writes_line(counters: dict, http: dict) -> str:
    """How bulk writes reached the origin from other nodes (kdn/client/ingest.py, kdn/origin/intake.py),
    or "" before any: clients' frames to its HTTP server, edges' write-behind pulled from their
    frames or handed over as references (Ray), each with its pace at the origin."""
    http, parts = http or {}, []
    for what in ("chunks", "objects"):
        n, nbytes = http.get(f"ingest_{what}_frames", 0), http.get(f"ingest_{what}_bytes", 0)
        us = http.get(f"ingest_{what}_receive_us", 0) + http.get(f"ingest_{what}_store_us", 0)
        if n:
            parts.append(f"{n} {what} written to its HTTP server ({nbytes / max(us, 1) / 1e3:.2f} GB/s, durable)")
    for how, n, nbytes, us in (("pulled from edges' frames", counters.get("objects_pulled_http", 0),
                                counters.get("object_pull_http_bytes", 0), counters.get("object_pull_http_us", 0)),
                               ("handed over by edges over Ray", counters.get("object_refs_read", 0),
                                counters.get("object_ref_bytes", 0), counters.get("object_ref_us", 0))):
        if n:
            parts.append(f"{n} stored objects {how} ({nbytes / max(us, 1) / 1e3:.2f} GB/s)")
    return "origin takes: " + "; ".join(parts) if parts else ""


def status_rows(st: dict) -> list:
    """One row per edge: the table `kdn status` prints; per tier (main, hot, and disk where
    the edge has one) its chunks, bytes and hits, and the disk's write-backs; how much of its
    node's object store it has had allocated ahead."""
    rows = []
    for e in st["edges"]:
        if e.get("down"):
            rows.append({"edge": e["name"], "region": e.get("region", "?"), "state": "DOWN"})
            continue
        c = e.get("counters", {})
        served = max(1, c.get("chunks_served", 0))
        rows.append({
            "edge": e["name"], "region": e["region"], "state": "up",
            "codec": e.get("store_codec", "raw"),
            "chunks": e["main"]["items"] + e["hot"]["items"],
            "bytes": gib(e["main"]["bytes"] + e["hot"]["bytes"]),
            **{f"{t}": f"{e[t]['items']} / {gib(e[t]['bytes'])}" for t in ("main", "hot")},
            **{f"{t} hits": e[t].get("hits", 0) for t in ("main", "hot")},
            "KV held": gib(e.get("held_raw_bytes", e["main"]["bytes"] + e["hot"]["bytes"])),
            "hot copies": e["hot_copies"],
            "fetches": c.get("fetches", 0),
            "local %": f"{100 * c.get('served_local', 0) / served:.0f}",
            "disk %": f"{100 * c.get('served_disk', 0) / served:.0f}",
            "peer %": f"{100 * c.get('served_peer', 0) / served:.0f}",
            "origin %": f"{100 * c.get('served_origin', 0) / served:.0f}",
            "served": gib(c.get("bytes_served", 0)),
            "sent": gib(c.get("wire_bytes", 0)),
        })
        if e.get("conversations"):     # the conversation tier: chunks, bytes, tenants, hits, expiries
            cv = e["conversations"]
            rows[-1].update({"conversations": f"{cv['chunks']} / {gib(cv['bytes'])}"
                             + (f" + {gib(cv['disk_bytes'])} disk" if cv.get("disk_bytes") else ""),
                             "conv tenants": len(cv["tenant_bytes"]), "conv hits": cv.get("conv_hits", 0),
                             "conv expired": cv.get("conv_expired", 0)})
        if e.get("links"):    # what this edge measured of its links (kdn/placement/links.py)
            rows[-1]["links (rtt, GB/s)"] = "; ".join(
                f"{n} {'-' if l['round_trip_ms'] is None else format(l['round_trip_ms'], '.1f') + ' ms'}"
                f"{'' if l['gbps'] is None else format(l['gbps'], ' .2f')}"
                for n, l in sorted(e["links"].items()))
        dp = e.get("data_plane") or {}
        if dp.get("peer_http_pulls") or dp.get("peer_ray_pulls"):   # how its peer pulls moved
            rows[-1]["peer pulls (http / ray)"] = (f"{dp.get('peer_http_pulls', 0)} ({gib(dp.get('peer_http_bytes', 0))})"
                                                   f" / {dp.get('peer_ray_pulls', 0)}")
        if e.get("stores", {}).get("store_acked_edge"):   # stores acknowledged here: what is not durable yet
            w = e["stores"]
            rows[-1].update({"not durable": f"{w['backlog_objects']} / {gib(w['backlog_bytes'])}"})
        if e.get("stores", {}).get("store_acked_origin"):  # stores that waited for the origin, and why
            w = e["stores"]
            rows[-1]["waited for origin (bound / room)"] = (f"{w.get('store_origin_backlog_full', 0)} / "
                                                             f"{w.get('store_origin_no_room', 0)}")
        fill = e.get("object_store_fill")
        if fill:               # its node's object store allocated ahead (kdn.core.prefault)
            rows[-1]["store allocated ahead"] = gib(fill.get("filled_bytes", 0)) + (
                " (filling)" if fill.get("running") else " (stopped short)" if fill.get("fill_stopped_why") else "")
        if e.get("disk"):      # an edge with a disk tier: its bytes, items, hits, write-backs
            d = e["disk"]
            rows[-1].update({"disk chunks": d["items"], "disk": gib(d["bytes"]),
                             "disk hits": d["hits"], "write-backs": d["write_backs"],
                             "dropped (full)": d["full_dropped"]})
    return rows


def _status(args, rest):
    from kdn.cli.table import table
    cl = network_client(args)
    st = cl.status()
    from kdn.serve.app import running_info
    st["service"] = running_info(cl.network) or None
    if args.json:
        import json
        print(json.dumps(st, default=str))
        return 0
    o = st["origin"]
    if "unreachable" in o:
        print(f"origin: DOWN ({o['unreachable']})")
    else:
        s = o["store"]
        copies = s.get("emphasized_copies", 0)
        also = f" (and {copies} emphasized cop{'y' if copies == 1 else 'ies'})" if copies else ""
        print(f"origin: up, {s['versions']} KB versions{also}, {s['chunks']} chunks, {gib(s['bytes'])} "
              f"in {s.get('backend', 'its store')}, {o['members']} edges "
              f"(membership v{o['membership_version']})")
        for line in (push_line(o.get("counters", {})), writes_line(o.get("counters", {}), o.get("http"))):
            if line:
                print(line)
    table(status_rows(st))
    by_tenant = {}
    for e in st["edges"]:
        for t, b in (e.get("conversations") or {}).get("tenant_bytes", {}).items():
            by_tenant[t] = by_tenant.get(t, 0) + b
    if by_tenant:
        print("conversation KV by tenant: " + ", ".join(f"{t} {gib(b)}" for t, b in sorted(by_tenant.items())))
    print("\n".join(service_lines(st["service"])))
    return 0 if all(not e.get("down") for e in st["edges"]) and "unreachable" not in o else 1


def _up_args(sub):
    u = sub.add_parser("up", help="start a network (embedded local cluster unless --address)")
    u.add_argument("--topology", help="topology TOML (default: 3 local regions)")
    u.add_argument("--address", help="join the Ray cluster at this address instead of starting one")
    u.add_argument("--origin", metavar="DIR|s3://BUCKET/PREFIX",
                   help="where the origin keeps chunks, manifests and membership: a directory "
                        "(default $KDN_HOME/origin) or an S3-compatible bucket, reached with "
                        "AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION "
                        "(checked before anything starts)")
    u.add_argument("--root", help="origin store directory (the older spelling of --origin DIR)")
    u.add_argument("--network", default="kdn")
    u.add_argument("--edge-codec", default="raw",
                   help="how edges store chunks: raw, zstd (lossless, ~1.2x), or a lossy codec "
                        "(q8z ~3.9x, k4v3z ~8.7x of fp32: docs/figures.md, kdn bench codecs)")
    u.add_argument("--origin-codec", default="raw", help="how the origin stores chunks: raw or zstd")
    u.add_argument("--serve", action="store_true",
                   help="also start the OpenAI-compatible service (`kdn serve` with its defaults)")
    u.add_argument("--edge-disk", metavar="SIZE", default=None,
                   help="give every edge a disk tier of SIZE bytes beneath its memory (e.g. 200G, "
                        "512MiB; K/M/G/T binary, KB/MB/GB/TB decimal); per edge: disk_bytes in "
                        "the topology file")
    u.add_argument("--edge-disk-dir", metavar="DIR", default=None,
                   help="where edges keep their disk tiers, DIR/<edge> on each edge's node "
                        "(default $KDN_HOME/edge-disk/<network>)")
    u.add_argument("--kv-events", metavar="tcp://127.0.0.1:PORT", default=None,
                   help="every edge publishes what it holds as vLLM KV events (ZMQ PUB; edge k "
                        "of the topology on PORT+2k, its replay socket on PORT+2k+1); off by "
                        "default; per edge: kv_events in the topology file")
    u.add_argument("--kv-events-block-size", type=int, default=16, metavar="N",
                   help="announce each 256-token chunk as blocks of N tokens (the subscribers' "
                        "block size; vLLM's default 16)")
    u.add_argument("--kv-events-encoding", choices=("map", "array"), default="map",
                   help="events as tagged maps (current vLLM; default) or arrays (older vLLM)")
    u.add_argument("--kv-events-remote", action="store_true",
                   help="allow a non-loopback --kv-events host")
    u.set_defaults(func=_up)


def _down_args(sub):
    sub.add_parser("down", help="stop what `kdn up` started").set_defaults(func=_down)


def _status_args(sub):
    s = sub.add_parser("status", help="edges, regions, bytes, hit rates, hot copies, origin state")
    network_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)


def add_parsers(sub) -> None:
    """This group's subcommands."""
    _up_args(sub)
    _down_args(sub)
    _status_args(sub)
