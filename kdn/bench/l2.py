"""LMCache's own L2 bench (`lmcache bench l2`) on KDN beside LMCache's fs and resp adapters.

One run, one table: KDN read from the edge on the reader's node (`kdn-local`, stores answered
by that edge, then again once every push has landed: `kdn-local (warm)`; `kdn-ack-origin`, the
same with stores answered once durable at the origin), KDN read
from another region's edge on another Ray node (`kdn-remote`, and `kdn-remote (warm)` once its
pushes landed: the first run's loads share the cores with the origin's pushes of what it just
stored), LMCache's `fs` adapter over a
temp directory (the page cache) and its `resp` adapter over a `redis-server` started here on
127.0.0.1. Each row is one `lmcache bench l2 ... --no-skip-verify --format json` process
(LMCache's code measures; this module only starts servers and reads its JSON): load GB/s
(LMCache's mean of its rounds' throughputs, a slow round weighs in it), p50 and p99 load
latency (of one round of --num-keys objects), store GB/s, all keys verified.

The rows without KDN (`fs`, `resp`) run first, before KDN's cluster starts, so the references
run on a machine KDN is not using (no object stores' memory, no daemons beside them). That
did not settle them: in session 35 the fs adapter's stores ran at 0.23-1.98 GB/s from one run to
the next on the same machine, before and after this change, so a store ratio needs several runs.

A row whose stores an edge answers (`kdn-local`, `kdn-remote`, `kdn-remote-ray`) also says how many of them the
edges answered at once and how many only once durable at the origin (the edge had no room to
keep them until durable: its backlog's bound or its memory for pinned copies, kdn/edge/stores.py;
or they failed its check). Those run at the origin's pace, so the row's store GB/s mixes both.
It also says how long after the row the origin held them all (the network is settled before
the row). JSON: `stores acked at edge`, `stores acked at origin`, `stores waited for room` (in the
edge's backlog, kdn/edge/stores.py) and `waited for room s`.

`ray-ceiling` (with kdn-remote) is no adapter: the same rounds pulled by plain Ray from an
actor on kdn-remote's node into this process and copied once into buffers, with no KDN and no
checksum, the most any load over Ray from that node reaches on this machine; kdn-remote is
read against it and against the modelled WAN.

The KDN network: three regions on this machine (kdn.launch.cluster.LocalCluster), one edge each,
every key on every edge (replicas = 3, so the reader's edge is warm once stores are pushed),
memory enough for the whole run, its nodes moving stored objects between them over their HTTP
frames as `kdn up` starts them (the origin pulls what an edge answered from that edge's frames,
the edges pull the origin's pushes from its frames, and the adapter reads from and stores at an
edge on another node over its frames, kdn.client.dataplane; `--plane ray`: all of it over Ray
instead, as this bench ran before session 35). Nothing enforces the topology's WAN on loopback, so the
table gives the modelled floor of a cross-region load (bytes / link bandwidth + one-way
latency, kdn.placement.topology.default_local) beside the measured row. Before its first row
the bench waits until every edge has had its node's object store allocated ahead (each
edge's fill, kdn.core.prefault, which a started service has done before its first store; the
note and `waited for the fill s` say how long that took and how much it allocated).

`--hosts` puts each region on a host of its own (kdn/testing/netns.py: every region but the
reader's in a network namespace with its own address, `--cap RATE` a tc cap on kdn-remote's
link) and adds the bare TCP socket from kdn-remote's host to the reader's: the link's ceiling,
timed at the end (socket) and just before and after each kdn-remote row (socket-beside and
socket-beside-warm: their ratios' references, the same minutes; LMCache's bench runs in a
process of its own, so its rounds cannot be interleaved with the socket's one by one).
Its edges serve HTTP on their host's address (with the admin token, each row's tenant left
open to readers), so kdn-remote loads over the remote edge's HTTP frames, the adapter's
default data plane (kdn.client.dataplane), and `kdn-remote-ray` is the same over Ray
(`"data_plane": "ray"`).

`--breakdown` adds where a KDN load's time goes, measured in this process on the same
network (kdn.integrations.objects, no LMCache in between): per round of --num-keys objects never
read before, the fetch call (the reader's edge answers with object references), the first
touch of the objects' pages in this process, and the verified copy into the host's buffers;
then one more load() of objects already touched.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid

from kdn.bench import emit_json, table
from kdn.bench.harness import REGIONS, add_own_cores, check_host_flags, scratch_dir, start_redis, stop_process

MIB = 1 << 20        # LMCache's "mbps" are MiB/s (the mean of its rounds'); the table gives GB/s (1e9 B/s)
READER, REMOTE = "us-east", "eu-west"      # the bench process runs on the head node: us-east


def object_store_bytes(edge_capacity: int) -> int:
    """Each node's object store: what its edge may hold in memory, the origin's object pushes
    in flight and two store batches, below Ray's spilling threshold (80% full by default):
    smaller, Ray spills the edges' objects to disk mid-run and the rounds that read them
    back take several times longer."""
    from kdn.integrations.objects import PUT_BATCH_BYTES
    from kdn.launch.cluster import SPILL_THRESHOLD
    from kdn.origin.node import OBJECT_PUSH_BACKLOG_BYTES
    return int((edge_capacity + OBJECT_PUSH_BACKLOG_BYTES + 2 * PUT_BATCH_BYTES) / SPILL_THRESHOLD) + (512 << 20)


def lmcache_cmd(*args) -> list:
    """`lmcache ARGS` as LMCache's CLI module run by this interpreter: its console script's
    shebang may name another environment's Python (a copied venv), which would use that one's kdn."""
    return [sys.executable, "-m", "lmcache.cli.main", *args]


def lmcache_env() -> dict:
    """This environment for an LMCache process: no usage tracking, no banner."""
    return dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", LMCACHE_DISABLE_BANNER="1")


def lmcache_bench(adapter: dict, args, out_path: str) -> dict:
    """One `lmcache bench l2` process; its JSON metrics."""
    cmd = lmcache_cmd("bench", "l2", "--l2-adapter", json.dumps(adapter), "--num-keys", str(args.num_keys),
                      "--data-size-kb", str(args.data_size_kb), "--rounds", str(args.rounds),
                      "--no-skip-verify", "--format", "json", "--output", out_path, "-q")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=lmcache_env())
    if done.returncode != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"lmcache bench l2 failed ({done.returncode}):\n{done.stderr[-2000:]}")
    with open(out_path) as f:
        return json.load(f)["metrics"]


def settle_stores(net) -> None:
    """Wait until every store an edge answered is durable at the origin (admin)."""
    import ray
    from kdn.core.auth import ensure_admin_token
    from kdn.core.env import kdn_home
    token = ensure_admin_token(kdn_home())
    for name, edge in net.edges.items():
        got = ray.get(edge.stores_durable.remote(600.0, token=token))
        if not got["durable"]:
            raise RuntimeError(f"edge {name}: its stores are not durable after 600 s: {got}")


def settle_fills(net, timeout_s: float = 180.0) -> float:
    """Wait until every edge has had its node's object store allocated ahead (its fill,
    kdn.core.prefault: what a started service has done before its first store); the seconds
    waited."""
    import ray
    from kdn.core.auth import ensure_admin_token
    from kdn.core.env import kdn_home
    token, t0 = ensure_admin_token(kdn_home()), time.perf_counter()
    while any((ray.get(e.stats.remote(token=token)).get("object_store_fill") or {}).get("running")
              for e in net.edges.values()):
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"the edges' object stores are not filled after {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.perf_counter() - t0


def settle_pushes(net) -> None:
    """settle_stores, then wait until every object push the origin queued has landed (admin)."""
    from kdn.client.view import NetworkView
    from kdn.core.auth import ensure_admin_token
    from kdn.core.env import kdn_home
    settle_stores(net)
    NetworkView(net.name, region=READER, admin_token=ensure_admin_token(kdn_home())).origin(600).pushes_settled()


def store_acks(net, token: str = None) -> dict:
    """{"edge": stores the edges answered before the origin held them, "origin": those they
    answered once durable there, of which "backlog": the edge's backlog would have passed its
    bound, "room": its memory could not hold them pinned; "waits", "wait_us": stores that waited
    for room in the backlog, and the microseconds they waited; "adopted", "adopt_us": copies of
    arrivals into the edge's object store and the microseconds they took, kdn/edge/stores.py},
    "pushes_skipped": the origin's pushes of objects to ring owners it did not make (its
    queue of them full: kdn/origin/node.py), counted since each edge and the origin started;
    "filled": the bytes of their nodes' object stores the edges have had allocated ahead
    (kdn.core.prefault), "filling": whether one still is (the admin token: token, else this
    machine's)."""
    import ray
    from kdn.core.auth import ensure_admin_token
    from kdn.core.env import kdn_home
    token = token or ensure_admin_token(kdn_home())
    names = {"edge": "store_acked_edge", "origin": "store_acked_origin",
             "backlog": "store_origin_backlog_full", "room": "store_origin_no_room",
             "waits": "store_backlog_waits", "wait_us": "store_backlog_wait_us",
             "adopted": "store_adopted", "adopt_us": "store_adopt_us"}
    out = dict(dict.fromkeys(names, 0), filled=0, filling=False)
    for edge in net.edges.values():
        stats = ray.get(edge.stats.remote(token=token))
        c = stats["stores"]
        for k, counter in names.items():
            out[k] += c.get(counter, 0)
        fill = stats.get("object_store_fill") or {}
        out["filled"] += fill.get("filled_bytes", 0)
        out["filling"] |= bool(fill.get("running"))
    # the origin's pushes of them to the other regions' edges that it let go (its queue full)
    out["pushes_skipped"] = ray.get(net.origin.stats.remote(token=token))["counters"].get("object_pushes_skipped", 0)
    return out


def acks_note(before: dict, after: dict, durable_s: float, fill_s: float = None) -> str:
    """How a row's stores were answered, and how long the origin took after the row to hold
    them all: the cost an edge's answer defers, not removes."""
    edge, origin, backlog, room = (after[k] - before[k] for k in ("edge", "origin", "backlog", "room"))
    why = [f"{backlog} past the backlog's bound"] * bool(backlog) + [f"{room} not held pinned in memory"] * bool(room)
    if origin > backlog + room:
        why.append(f"{origin - backlog - room} failed the edge's check")
    rest = f" ({origin} once durable at the origin: {', '.join(why)})" if origin else ""
    waits, wait_s = after.get("waits", 0) - before.get("waits", 0), (after.get("wait_us", 0) - before.get("wait_us", 0)) / 1e6
    if waits:
        rest += f"; {waits} waited for room in the backlog, {wait_s:.1f} s in all"
    adopted, adopt_s = after["adopted"] - before["adopted"], (after["adopt_us"] - before["adopt_us"]) / 1e6
    copies = f"; the edges copied {adopted} arrivals into their object stores in {adopt_s:.1f} s" if adopted else ""
    if before.get("filled"):
        copies += (f"; the edges had allocated {before['filled'] / 2**30:.1f} GiB of their object stores ahead "
                   f"when the row began{', and were still at it' if before.get('filling') else ''}")
        if fill_s is not None:
            copies += f" (the bench waited {fill_s:.1f} s for that after the network started)"
    return (f"; stores answered at the edge {edge} of {edge + origin}{rest}, all durable {durable_s:.1f} s "
            f"after the row{copies}")


SERVED = ("local", "disk", "peer", "origin")     # kdn.core.names.SOURCE_KINDS


def served(net, region: str, token: str = None) -> dict:
    """{kind: chunks region's edges served from there (local, disk, peer, origin: the served_*
    counters of kdn/edge/reads.py), "repairs": read repairs they sent to owners that lacked
    what they fetched elsewhere (kdn/edge/pull.py)}, since each edge started (the admin token:
    token, else this machine's)."""
    import ray
    from kdn.core.auth import ensure_admin_token
    from kdn.core.env import kdn_home
    token = token or ensure_admin_token(kdn_home())
    out = dict.fromkeys([*SERVED, "repairs"], 0)
    for name, edge in net.edges.items():
        if net.topology.region_of(name) != region:
            continue
        c = ray.get(edge.stats.remote(token=token))["counters"]
        for kind in SERVED:
            out[kind] += c.get(f"served_{kind}", 0)
        out["repairs"] += c.get("repairs_sent", 0)
    return out


def served_note(before: dict, after: dict) -> str:
    """The row's loads by where its edge found them, and the read repairs that caused."""
    got = {k: after[k] - before[k] for k in after}
    kinds = ", ".join(f"{got[k]} {k}" for k in SERVED if got[k])
    return f"; its edge served {kinds or 'nothing'}" + (f", and sent {got['repairs']} read repairs" if got["repairs"] else "")


def row(name: str, metrics: dict, note: str = "") -> dict:
    ops = {m["operation"]: m for k, m in metrics.items() if k.startswith("op_")}
    load, store = ops["Load"], ops["Store"]
    return {"adapter": name,
            "load GB/s": load["throughput_avg_mbps"] * MIB / 1e9,
            "load p50 ms": load["duration_p50_ms"], "load p99 ms": load["duration_p99_ms"],
            "store GB/s": store["throughput_avg_mbps"] * MIB / 1e9,
            "verified": f"{load['total_success']}/{load['total_keys']}",
            "note": note}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench l2", description=__doc__.splitlines()[0])
    ap.add_argument("--num-keys", type=int, default=32, help="objects per round (default 32)")
    ap.add_argument("--data-size-kb", type=int, default=8192, help="KiB per object (default 8192)")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (default 5)")
    ap.add_argument("--only", nargs="*", default=None,
                    help="run only these rows (kdn-local kdn-ack-origin kdn-remote fs resp)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per lmcache bench process")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time a KDN load's parts in this process (fetch, first touch, verified copy)")
    ap.add_argument("--hosts", action="store_true",
                    help="each region a host of its own (network namespaces on a bridge, root "
                         "needed), with the bare-socket ceiling between the reader's host and "
                         f"{REMOTE}'s")
    ap.add_argument("--cap", default=None, metavar="RATE",
                    help=f"with --hosts: cap {REMOTE}'s link with tc (e.g. 2gbit, 800mbit)")
    add_own_cores(ap)
    ap.add_argument("--plane", choices=("http", "ray"), default="http",
                    help="how the network's nodes, and a reader or writer on another node than its "
                         "edge's, move objects: over the edges' and the origin's HTTP frames (the "
                         "default, as `kdn up` starts them) or over Ray (not with --hosts)")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    if args.hosts and args.plane == "ray":
        ap.error("--plane ray: with --hosts the edges serve HTTP on their hosts' addresses (the "
                 "kdn-remote-ray row reads over Ray)")
    want = args.only or ["kdn-local", "kdn-ack-origin", "kdn-remote", "fs", "resp"]
    if args.hosts and "kdn-remote" in want and "kdn-remote-ray" not in want:
        want.insert(want.index("kdn-remote") + 1, "kdn-remote-ray")
    check_host_flags(ap, args, REGIONS)
    if args.hosts:
        from kdn.testing.netns import available
        why = available()
        if why:
            ap.error(f"--hosts: {why}")
        if not any(n.startswith("kdn") for n in want):
            ap.error("--hosts measures KDN between hosts: keep a kdn row in --only")
    run_bytes = (args.rounds + 1) * args.num_keys * args.data_size_kb * 1024   # + a warmup round

    from kdn.client.join import init_ray
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.placement.topology import Topology
    work = scratch_dir("kdn-bench-l2-")
    rows, cluster, net, redis = [], None, None, None
    try:
        # every edge holds the whole run (replicas = 3; an edge's main tier is 75% of its
        # capacity)
        topo = Topology.default_local(list(REGIONS), capacity_bytes=int(1.6 * run_bytes))
        round_bytes = args.num_keys * args.data_size_kb * 1024
        wan_s = round_bytes / (topo.bandwidth_gbps(READER, REMOTE) * 1e9) + topo.latency_ms(READER, REMOTE) / 1e3
        if args.breakdown and not any(n.startswith("kdn") for n in want):
            raise SystemExit("--breakdown times KDN's load: keep a kdn row in --only")
        # the rows without KDN first, before its cluster starts: references on a machine KDN
        # is not using
        want = [n for n in want if not n.startswith("kdn")] + [n for n in want if n.startswith("kdn")]
        admin = None
        for which in want:
            out = os.path.join(work, f"{which}.json")
            if which.startswith("kdn") and cluster is None:     # KDN's cluster, at its first row
                os.sync()                # the rows before it leave no writes in flight
                if args.hosts:           # every region but the reader's in a network namespace
                    from kdn.testing.netns import HostCluster
                    cluster = HostCluster(REGIONS, cpus=2, object_store_bytes=object_store_bytes(int(1.6 * run_bytes)),
                                          cores="own" if args.own_cores else None)
                    if args.cap:
                        cluster.hosts.cap(REMOTE, args.cap)
                else:
                    cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=object_store_bytes(int(1.6 * run_bytes)))
                    init_ray(cluster.address)
                name = f"l2{uuid.uuid4().hex[:6]}"
                if args.hosts:           # edges serve HTTP on their host's address: that needs tokens
                    from kdn.core.auth import OPEN, ensure_admin_token
                    from kdn.core.env import kdn_home
                    admin = ensure_admin_token(kdn_home())
                    net = start_network(topo, os.path.join(work, name), network=name, replicas=len(REGIONS),
                                        http=True, edge_options={"http_host": "node"},
                                        auth={"admin": admin, "readers": {w: OPEN for w in [*want, "breakdown"]}})
                else:
                    net = start_network(topo, os.path.join(work, name), network=name, replicas=len(REGIONS),
                                        http=args.plane == "http")
                fill_s = settle_fills(net)    # a started service: its stores' memory allocated
                if args.breakdown:       # first, on the empty network (its objects are deleted after)
                    parts = breakdown(net, cluster.address, args)
            if which.startswith("kdn"):
                region = REMOTE if which.startswith("kdn-remote") else READER
                adapter = {"type": "plugin", "module_path": "kdn.integrations.lmcache",
                           "class_name": "KDNL2Adapter",
                           "adapter_params": {"network": net.name, "region": region,
                                              "address": cluster.address, "token": admin,
                                              "tenant": which}}      # each row stores anew
                if which == "kdn-ack-origin":
                    adapter["adapter_params"]["ack"] = "origin"
                if which == "kdn-remote-ray":
                    adapter["adapter_params"]["data_plane"] = "ray"
                note = {"kdn-local": "edge on the reader's node; stores answered there (ack edge)",
                        "kdn-ack-origin": "the same, stores answered once durable at the origin (ack origin)",
                        "kdn-remote-ray": f"{REMOTE}'s edge over Ray (data_plane ray), not its HTTP frames",
                        }.get(which, f"{REMOTE}'s edge, another node; modelled WAN floor "
                                     f"{round_bytes / wan_s / 1e9:.2f} GB/s, {wan_s * 1e3:.0f} ms a round")
            elif which == "fs":
                adapter = {"type": "fs", "base_path": os.path.join(work, "fs")}
                os.makedirs(adapter["base_path"])
                note = "page cache (tmp dir)"
            elif which == "resp":
                try:
                    redis, port = start_redis(work)
                except FileNotFoundError as e:
                    rows.append({"adapter": "resp", "note": f"skipped: {e}"})
                    continue
                adapter = {"type": "resp", "host": "127.0.0.1", "port": port}
                note = "redis-server on 127.0.0.1"
            else:
                raise SystemExit(f"unknown row {which!r}")
            bracket = args.hosts and which == "kdn-remote"
            # stores answered by an edge: how many it answered early, and how long they took
            # to be durable after the row
            acks = None
            if which.startswith("kdn") and which != "kdn-ack-origin":
                settle_pushes(net)           # what rows before left on its way: not this row's
                acks = store_acks(net)
            was = served(net, region, admin) if which.startswith("kdn") else None
            rows += bracketed(bracket, cluster, args, round_bytes, "socket-beside",
                              lambda: row(which, lmcache_bench(adapter, args, out), note))
            if was is not None:          # where the row's loads came from
                now = served(net, region, admin)
                mine = next(r for r in reversed(rows) if r["adapter"] == which)
                mine["note"] += served_note(was, now)
                mine["served"] = {k: now[k] - was[k] for k in now}
            if which == "fs":                # its files go: no dirty pages under KDN's rows
                shutil.rmtree(adapter["base_path"])
            if acks is not None:
                t0 = time.perf_counter()
                settle_stores(net)
                after = store_acks(net)
                mine = next(r for r in reversed(rows) if r["adapter"] == which)
                mine["waited for the fill s"] = fill_s
                mine["note"] += acks_note(acks, after, time.perf_counter() - t0, fill_s)
                fill_s = None            # the wait was once, before the first KDN row
                mine["stores acked at edge"] = after["edge"] - acks["edge"]
                mine["stores acked at origin"] = after["origin"] - acks["origin"]
                mine["stores acked at origin, backlog full"] = after["backlog"] - acks["backlog"]
                mine["stores acked at origin, no room"] = after["room"] - acks["room"]
                mine["edge copies s"] = (after["adopt_us"] - acks["adopt_us"]) / 1e6
                mine["stores waited for room"] = after["waits"] - acks["waits"]
                mine["waited for room s"] = (after["wait_us"] - acks["wait_us"]) / 1e6
                mine["pushes skipped"] = after["pushes_skipped"] - acks["pushes_skipped"]
                mine["object stores allocated ahead GiB"] = acks["filled"] / 2**30
            if which == "kdn-remote":
                rows.append(ray_ceiling(args))
            if which in ("kdn-local", "kdn-remote"):
                # a store is answered by the region's edge, the origin gets it after and pushes
                # it to the ring owners, so the run above may load some objects from wherever
                # they were then, and its loads share the 2 cores with those pushes. Once every
                # push has landed, the same run again (the same keys and bytes: every store is
                # deduplicated) loads from the warm edge; its stores were deduplicated.
                settle_pushes(net)
                rows += bracketed(bracket, cluster, args, round_bytes, "socket-beside-warm",
                                  lambda: {**row(f"{which} (warm)", lmcache_bench(adapter, args, out),
                                                 "the same, every push landed first: loads from a warm edge"),
                                           "store GB/s": None})
            stop_process(redis)
            redis = None
        if args.hosts:              # the link's ceiling for one connection, between the same hosts
            rows.append(socket_row("socket", link_times(cluster, args, round_bytes), round_bytes,
                                   f"bare TCP from {REMOTE}'s host ({cluster.address_of(REMOTE)}) to the "
                                   f"reader's ({cluster.address_of(READER)}), one round a send: the link's "
                                   f"ceiling" + (f"; capped at {args.cap}" if args.cap else "")))
    finally:
        stop_process(redis)
        teardown(net, cluster, work)
    print(f"lmcache bench l2: {args.num_keys} keys x {args.data_size_kb} KiB a round, "
          f"{args.rounds} rounds (+1 warmup), --no-skip-verify; the network's nodes move objects "
          f"over {'their HTTP frames' if args.plane == 'http' else 'Ray'}")
    table(rows, ["adapter", "load GB/s", "load p50 ms", "load p99 ms", "store GB/s", "verified", "note"])
    out = {"bench": "l2", "rows": rows, "hosts": args.hosts, "cap": args.cap, "plane": args.plane}
    by = {r["adapter"]: r.get("load GB/s") for r in rows}
    for name, beside in (("kdn-remote", "socket-beside"), ("kdn-remote (warm)", "socket-beside-warm")):
        if by.get(beside) and by.get(name):
            key = f"{name.replace('-', '_').replace(' (warm)', '_warm')}_over_socket_beside"
            out[key] = by[name] / by[beside]
            print(f"{name} {out[key]:.2f}x the bare socket timed just before and after it")
    if by.get("socket") and by.get("kdn-remote"):
        out["kdn_remote_over_socket"] = by["kdn-remote"] / by["socket"]
        if by.get("kdn-remote-ray"):
            out["kdn_remote_ray_over_socket"] = by["kdn-remote-ray"] / by["socket"]
        print(f"kdn-remote {out['kdn_remote_over_socket']:.2f}x the bare socket between the same hosts"
              + (f"; over Ray {out['kdn_remote_ray_over_socket']:.2f}x" if by.get("kdn-remote-ray") else "")
              + (f"; ray-ceiling {by['ray-ceiling'] / by['socket']:.2f}x" if by.get("ray-ceiling") else ""))
    if args.breakdown:
        print(f"\nwhere a KDN load of {args.num_keys} x {args.data_size_kb} KiB goes (this process, the "
              f"reader's edge; medians of {args.rounds} rounds of objects this process never read):")
        table(parts, ["store memory", "fetch ms", "first touch ms", "verified copy ms", "round ms", "GB/s",
                        "warm load() ms", "warm GB/s"])
        out["breakdown"] = parts
    if args.json:
        emit_json(out)
    return 0


def link_times(cluster, args, round_bytes: int) -> list:
    """Seconds of args.rounds bare-TCP sends of a round's bytes from kdn-remote's host to the
    reader's (kdn.bench.transport.bare_socket; after one warm-up)."""
    from kdn.bench.transport import bare_socket
    return bare_socket(round_bytes, args.rounds, args.data_size_kb * 1024,
                       host=cluster.address_of(REMOTE), prefix=cluster.command(REMOTE, []))


def bracketed(on: bool, cluster, args, round_bytes: int, name: str, measure) -> list:
    """[measure()'s row], and with on, after it a socket row `name` timed just before and just
    after it: the link's ceiling in the same minutes as the row."""
    before = link_times(cluster, args, round_bytes) if on else []
    got = [measure()]
    if on:
        got.append(socket_row(name, before + link_times(cluster, args, round_bytes), round_bytes,
                              f"the same, just before and just after {got[0]['adapter']}'s run (its "
                              f"rounds in between): its ceiling in the same minutes"))
    return got


def socket_row(name: str, times: list, round_bytes: int, note: str) -> dict:
    """A table row of bare-socket times (seconds per round), its GB/s a mean of the rounds' as LMCache's."""
    return {"adapter": name, "load GB/s": statistics.mean(round_bytes / t for t in times) / 1e9,
            "load p50 ms": round(statistics.median(times) * 1e3, 2), "store GB/s": None,
            "verified": "no checksum", "note": note}


class _Source:
    """An actor on kdn-remote's node holding objects for ray_ceiling to pull."""

    def put(self, n: int, size: int, seed: int) -> list:
        import numpy as np
        import ray
        base = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
        return [ray.put(base) for _ in range(n)]      # n objects, each its own copy in the store


def ray_ceiling(args) -> dict:
    """The ray-ceiling row (see the module): args.rounds rounds (+1 warmup) of --num-keys
    objects put on REMOTE's node, each round pulled into this process and copied once."""
    import numpy as np
    import ray
    from kdn.bench import p
    size, n = args.data_size_kb * 1024, args.num_keys
    src = ray.remote(num_cpus=0)(_Source).options(label_selector={"region": REMOTE}).remote()
    outs = [np.empty(size, np.uint8) for _ in range(n)]
    times = []
    try:
        for r in range(args.rounds + 1):
            refs = ray.get(src.put.remote(n, size, r))
            t0 = time.perf_counter()
            for a, o in zip(ray.get(refs), outs):
                np.copyto(o, a)
            if r:                                         # the first round warms up, as LMCache's
                times.append(time.perf_counter() - t0)
            del refs
    finally:
        ray.kill(src)
    return {"adapter": "ray-ceiling", "load GB/s": statistics.mean(n * size / t for t in times) / 1e9,  # as LMCache's
            "load p50 ms": round(statistics.median(times) * 1e3, 2),
            "load p99 ms": round(p(times, 99) * 1e3, 2), "store GB/s": None, "verified": "no checksum",
            "note": f"plain Ray pull from {REMOTE}'s node + one copy, no KDN: the Ray path's ceiling here"}


def breakdown(net, address: str, args) -> list:
    """The parts of a KDN load (see the module), medians over args.rounds rounds: one row for
    objects in object-store memory this process never touched, one for objects stored after
    those were deleted (memory the store hands out again, this process's pages mapped)."""
    import numpy as np
    from kdn.core.auth import ensure_admin_token
    from kdn.core.env import kdn_home
    from kdn.integrations import objects
    size, n = args.data_size_kb * 1024, args.num_keys
    obj = objects.Objects.connect(net.name, READER, "bench", admin_token=ensure_admin_token(kdn_home()),
                                  address=address)
    ns = obj.namespace("breakdown", "bench")
    data = [np.frombuffer(os.urandom(size), np.uint8) for _ in range(n)]
    outs = [bytearray(size) for _ in range(n)]
    rows = []
    for memory in ("fresh", "reused"):
        rows.append({"store memory": memory, **_load_parts(obj, ns, data, outs, args.rounds)})
    return rows


def _load_parts(obj, ns, data, outs, n_rounds: int) -> dict:
    """Store n_rounds rounds of objects, wait for every push, time each round's load in
    parts, load the last round once more (warm), delete them all."""
    from kdn.bench import median
    from kdn.integrations import objects
    n, size = len(data), data[0].nbytes
    rounds = [[os.urandom(16) for _ in range(n)] for _ in range(n_rounds)]
    for keys in rounds:
        obj.store([(ns, k) for k in keys], data)
    obj.view.origin(300).pushes_settled(token=obj.token)  # every edge holds every key
    reader, fetch, touch, copy = obj._reader(ns), [], [], []
    for keys in rounds:
        t0 = time.perf_counter()
        got = reader.fetch_objects(keys, timeout_s=60)
        t1 = time.perf_counter()
        for c in got.chunks:
            int(c.kv[::4096].sum())                 # one byte a page
        t2 = time.perf_counter()
        ok = list(objects._UNPACK.map(obj._unpacked, got.chunks, outs))
        t3 = time.perf_counter()
        if sum(ok) != n:
            raise SystemExit(f"breakdown: {n - sum(ok)} of {n} objects did not load intact")
        fetch.append(t1 - t0)
        touch.append(t2 - t1)
        copy.append(t3 - t2)
        del got
    t0 = time.perf_counter()
    ok = obj.load(ns, rounds[-1], outs)
    warm = time.perf_counter() - t0
    for keys in rounds:                            # room for what comes after
        obj.delete(ns, keys)
    whole = median(fetch) + median(touch) + median(copy)
    return {"fetch ms": round(median(fetch) * 1e3, 1), "first touch ms": round(median(touch) * 1e3, 1),
            "verified copy ms": round(median(copy) * 1e3, 1), "round ms": round(whole * 1e3, 1),
            "GB/s": round(n * size / whole / 1e9, 2), "warm load() ms": round(warm * 1e3, 1),
            "warm GB/s": round(n * size / warm / 1e9, 2) if sum(ok) == n else None}
