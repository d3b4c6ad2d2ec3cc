"""`kdn bench placement`: the placement simulator and the ring's figures (kdn.placement.sim).

Default: both; `--sim` the five-policy trace replay only, `--ring` the ring only (balance,
bounded loads, movement on join/leave, lookup speed); `--quick` a small run; `--json`
one JSON object last; `--plot PATH` the PNG (default ./kdn-placement.png).
"""
import argparse

import numpy as np

from kdn.bench import emit_json, table
from kdn.placement.sim import DISK_POLICY, ring_figures, simulate


def plot(result: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pol = result["policies"]
    names = list(pol)
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    x = np.arange(len(names))
    ax[0, 0].bar(x - 0.2, [pol[p]["mean_ms"] for p in names], 0.4, label="mean")
    ax[0, 0].bar(x + 0.2, [pol[p]["p99_ms"] for p in names], 0.4, label="p99")
    ax[0, 0].set_yscale("log")
    ax[0, 0].set_ylabel("fetch time (ms)")
    ax[0, 0].legend()
    ax[0, 1].bar(x, [pol[p]["stored_gb"] for p in names], color="tab:green")
    ax[0, 1].set_ylabel("peak stored at edges (GB)")
    ax[1, 0].bar(x, [pol[p]["local_share"] for p in names], color="tab:purple")
    ax[1, 0].set_ylabel("bytes served in the reader's region")
    ax[1, 0].set_ylim(0, 1)
    for a in (ax[0, 0], ax[0, 1], ax[1, 0]):
        a.set_xticks(x)
        a.set_xticklabels(names, rotation=15)
    dur = result["params"]["duration"]
    for p in names:
        s = pol[p]["series_ms"]
        ax[1, 1].plot(np.linspace(0, dur, len(s), endpoint=False), s, label=p)
    ax[1, 1].axvline(dur / 2, color="grey", ls=":", label="popularity shift")
    ax[1, 1].set_yscale("log")
    ax[1, 1].set_xlabel("simulated time (s)")
    ax[1, 1].set_ylabel("mean fetch time per window (ms)")
    ax[1, 1].legend(fontsize=7)
    fig.suptitle("KDN placement: %d regions, %d edges, %d KBs, Zipf %s" % (
        result["params"]["regions"], result["params"]["edges"], result["params"]["kbs"], result["params"]["alpha"]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kdn bench placement", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small trace and ring (tests, smoke runs)")
    ap.add_argument("--ring", action="store_true", help="only the ring figures")
    ap.add_argument("--sim", action="store_true", help="only the policy simulation")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    ap.add_argument("--plot", default="kdn-placement.png", help="PNG path ('' for none)")
    ap.add_argument("--topology", default=None, help="topology TOML (default: default_local)")
    ap.add_argument("--regions", type=int, default=4)
    ap.add_argument("--edges-per-region", type=int, default=4)
    ap.add_argument("--capacity-factor", type=float, default=2.0,
                    help="total edge bytes / bytes the ring stores (catalog x replicas)")
    ap.add_argument("--kbs", type=int, default=200)
    ap.add_argument("--chunks-min", type=int, default=4)
    ap.add_argument("--chunks-max", type=int, default=64)
    ap.add_argument("--chunk-mib", type=float, default=8.0)
    ap.add_argument("--requests", type=int, default=40000)
    ap.add_argument("--duration", type=float, default=1800.0, help="simulated seconds")
    ap.add_argument("--alpha", default="1.0", help="Zipf exponent, one or one per region (a,b,...)")
    ap.add_argument("--regional", type=float, default=0.5, help="share of demand on a region's own ranking")
    ap.add_argument("--replicas", type=int, default=1, help="ring owners per chunk")
    ap.add_argument("--half-life", type=float, default=60.0)
    ap.add_argument("--promote-rate", type=float, default=0.01)
    ap.add_argument("--demote-rate", type=float, default=0.002)
    ap.add_argument("--hot-budget", type=float, default=0.25)
    ap.add_argument("--decide-every", type=float, default=15.0)
    ap.add_argument("--displace-ratio", type=float, default=2.0)
    ap.add_argument("--ring-keys", type=int, default=1_000_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--disk-capacity-factor", type=float, default=0.0,
                    help="edges' disk tier bytes, all edges together, as a multiple of the catalog "
                         "(0: no disk tier; > 0 adds policy g_ring_hot_disk)")
    ap.add_argument("--disk-gbps", type=float, default=4.0,
                    help="an edge's disk read rate, GB/s (an NVMe drive: 3-7; see kdn bench tiers)")
    ap.add_argument("--disk-warm-passes", type=int, default=1,
                    help="unmeasured replays of the trace that fill the disks first (g only)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.kbs, a.requests, a.duration, a.chunks_max, a.ring_keys = 40, 3000, 600.0, 16, 20000
        a.decide_every = 10.0
    do_ring, do_sim = (a.ring or not a.sim), (a.sim or not a.ring)
    out = {}
    if do_sim:
        r = simulate(a)
        out["sim"] = r
        p = r["params"]
        print(f"placement simulation: {p['regions']} regions x {p['edges_per_region']} edges "
              f"({p['edge_capacity_gb']:.3g} GB each), {p['kbs']} KBs / {p['chunks']} chunks "
              f"({p['catalog_gb']:.3g} GB), {p['requests']} requests over {p['duration']:.0f} s, "
              f"Zipf {p['alpha']} regional {p['regional']}, r={p['replicas']}, shift at half")
        cols = ["policy", "mean_ms", "p99_ms", "mean_ms_after_shift", "local_share", "local_fetch_share",
                "origin_egress_gb",
                "wan_gb", "stored_gb", "join_moved_gb", "leave_moved_gb"]
        table([{c: v[c] for c in cols} for v in r["policies"].values()], cols)
        t = r["targets"]
        print(f"(d) vs oracle mean {t['d_over_oracle_mean']:.3f} (target <= 1.3), vs (b) mean "
              f"{t['d_over_b_mean']:.3f} (<= 0.5), stored vs (b) {t['d_over_b_stored']:.3f} (<= 1.5): "
              f"{'met' if t['met'] else 'NOT met'}; vs the budgeted oracle (f) {t['d_over_f_mean']:.3f}, "
              f"(f) vs oracle {t['f_over_oracle_mean']:.3f}   [{r['seconds']:.1f} s]")
        if "g_met" in t:
            g = r["policies"][DISK_POLICY]
            print(f"(g) with edge disks ({p['disk_capacity_factor']:g}x the catalog, {p['disk_gbps']:g} GB/s): "
                  f"in-region {t['g_local_share']:.3f} (target >= 0.9), mean vs oracle "
                  f"{t['g_over_oracle_mean']:.3f} (<= 2): {'met' if t['g_met'] else 'NOT met'}; "
                  f"cold first pass: in-region {g['local_share_cold']:.3f}, mean {g['mean_ms_cold']:.1f} ms")
        if a.plot:
            out["plot"] = plot(r, a.plot)
            print(f"plot: {out['plot']}")
    if do_ring:
        g = ring_figures(n_keys=a.ring_keys)
        out["ring"] = g
        print(f"\nring: {g['method']}, {g['edges']} edges in {g['regions']} regions, {g['keys']} keys")
        rows = [
            ("max/mean load", g["max_over_mean"], "<= 1.10"),
            ("max/mean, Zipf(1.0) loads, unbounded", g["zipf_max_over_mean_unbounded"], "(for contrast)"),
            (f"max/mean bounded c={g['c']}", g["bounded_max_over_mean"], f"<= {g['c']}"),
            (f"max/mean bounded c={g['c']}, Zipf(1.0) loads", g["bounded_zipf_max_over_mean"], f"<= {g['c']}"),
            ("heaviest Zipf key / mean edge load", g["zipf_top_key_over_mean"], "must be <= c for any bound"),
            ("join: fraction of keys moved", g["join_moved_fraction"], f"<= {1.1 * g['join_ideal_fraction']:.4f}"),
            ("join: moved only to the new edge", str(g["join_moved_only_to_new"]), "True"),
            ("leave: fraction of keys moved", g["leave_moved_fraction"], "its own share"),
            ("leave: moved only its own keys", str(g["leave_moved_only_its_own"]), "True"),
            ("join, r=3: copies moved", g["join_r3_copies_moved_fraction"], "~1/17 per copy"),
            ("owners_batch us/key r=1", g["owners_batch_us_per_key_r1"], "<= 5"),
            ("owners_batch us/key r=3", g["owners_batch_us_per_key_r3"], ""),
            ("owners() single us/key", g["owners_single_us_per_key"], ""),
        ]
        for v in g["vnode_ring"]:
            rows.append((f"vnode ring {v['vnodes']}/edge: max/mean", v["max_over_mean"], "(alternative)"))
            rows.append((f"vnode ring {v['vnodes']}/edge: join moved", v["join_moved_fraction"], "(alternative)"))
        table([{"figure": f, "value": v, "target": t} for f, v, t in rows], ["figure", "value", "target"])
        print(f"ring targets: {'met' if g['targets_met'] else 'NOT met'}")
    if a.json:
        for r in out.get("sim", {}).get("policies", {}).values():
            r.pop("series_ms", None)
        emit_json(out)
    return 0

