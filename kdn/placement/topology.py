"""Where things are and how far apart: regions, the links between them, edges in them.

A topology names regions, gives the one-way latency (ms) and bandwidth between every pair
of regions and within each one, lists the edges of each region with their byte capacity,
and says which region holds the origin. It ranks candidate sources for a transfer by the
time the transfer would take, latency + (queued bytes + bytes) / bandwidth, not by latency
alone: a 1 GB chunk set comes faster over a fat far link than a thin near one, and a busy
source is further away than an idle one.

Bandwidth is in GB/s (10^9 bytes per second); the field is called `bandwidth_gbps`.
Links are symmetric. Users write it as TOML:

    origin_region = "us-east"

    [regions.us-east]
    latency_ms = 0.2            # within the region, one way
    bandwidth_gbps = 10.0
    edges = [ { name = "use-1", capacity_bytes = 8_000_000_000 } ]

    [regions.eu-west]
    latency_ms = 0.2
    bandwidth_gbps = 10.0
    edges = [ { name = "euw-1", capacity_bytes = 8_000_000_000 } ]

    [[links]]
    between = ["us-east", "eu-west"]
    latency_ms = 40.0
    bandwidth_gbps = 1.0

An edge's table may carry settings of the edge's own beside its capacity, which the topology
keeps as written and the launcher checks (kdn/edge/options.py) before starting anything: a
disk tier beneath its memory (kdn/edge/disk.py), `disk_bytes` (an integer > 0) and optionally
`disk_dir` (a directory on the edge's node; the edge keeps its records in disk_dir/<edge name>),
e.g. `{ name = "use-1", capacity_bytes = 8_000_000_000, disk_bytes = 500_000_000_000 }`; KV
events (kdn/edge/events.py): `kv_events = "tcp://127.0.0.1:5557"`, or a table
`{ endpoint = "tcp://127.0.0.1:5557", block_size = 16, topic = "use-1" }`.

Every problem is a TopologyError naming the file and the entry (`topo.toml: links[0]:
unknown region 'eu-wset'`), so a typo is one read away from fixed.
"""
from __future__ import annotations

import json
import os
import stat
import tomllib
from pathlib import Path

from kdn.core.checks import check_int, check_number
from kdn.core.errors import BadRequest, TopologyError
from kdn.core.names import check_node_name
from kdn.placement.ring import Edge

GB = 1e9


def _num(src, where, v, *, positive=False):
    return check_number(v, f"{src}: {where}", 0, open_lo=positive, error=TopologyError)


# Region and edge names become Ray actor names, node labels and "peer:<edge>" source
# strings, so they are plain words: kdn.core.names.check_node_name.
MAX_FILE_BYTES = 1 << 20      # a topology file is a few KB; never read a device or a log


def _name(src, where, v):
    try:
        return check_node_name(v, f"{src}: {where}:")
    except BadRequest as e:
        raise TopologyError(str(e)) from None


# --- reading a topology's dict: one function per table ---------------------------------
def _region(src, rname, r, edges: list, seen: dict, options: dict) -> tuple:
    """regions.<rname>: its (latency_ms, bandwidth_gbps); its edges appended to edges (seen:
    edge name -> where it was defined; options: edge name -> its other keys, as written)."""
    where = f"regions.{rname}"
    _name(src, where, rname)
    if not isinstance(r, dict):
        raise TopologyError(f"{src}: {where}: must be a table, got {r!r:.80}")
    extra = set(r) - {"latency_ms", "bandwidth_gbps", "edges"}
    if extra:
        raise TopologyError(f"{src}: {where}: unknown key(s) {sorted(extra)}")
    for k in ("latency_ms", "bandwidth_gbps"):
        if k not in r:
            raise TopologyError(f"{src}: {where}.{k} is missing (latency and bandwidth within the region)")
    within = (_num(src, f"{where}.latency_ms", r["latency_ms"]),
              _num(src, f"{where}.bandwidth_gbps", r["bandwidth_gbps"], positive=True))
    es = r.get("edges", [])
    if not isinstance(es, list):
        raise TopologyError(f"{src}: {where}.edges: must be a list of {{name, capacity_bytes}}, got {es!r:.80}")
    for i, e in enumerate(es):
        ew = f"{where}.edges[{i}]"
        if not isinstance(e, dict):
            raise TopologyError(f"{src}: {ew}: must be a table {{name, capacity_bytes}}, got {e!r:.80}")
        if "name" not in e:
            raise TopologyError(f"{src}: {ew}.name is missing")
        name = _name(src, f"{ew}.name", e["name"])
        if name in seen:
            raise TopologyError(f"{src}: {ew}: duplicate edge {name!r} (also in {seen[name]})")
        seen[name] = where
        if "capacity_bytes" not in e:
            raise TopologyError(f"{src}: {ew}.capacity_bytes is missing for edge {name!r}")
        cap = check_int(e["capacity_bytes"], f"{src}: {ew}.capacity_bytes", 1, error=TopologyError)
        edges.append((name, rname, cap))
        rest = {k: v for k, v in e.items() if k not in ("name", "capacity_bytes")}
        if rest:
            options[name] = rest      # the edge's own settings: kdn/edge/options.py checks them
    return within


def _links(src, ls, regions: dict) -> dict:
    """[[links]]: (region a, region b) sorted -> (latency_ms, bandwidth_gbps)."""
    links = {}
    if not isinstance(ls, list):
        raise TopologyError(f"{src}: links: must be an array of tables ([[links]]), got {ls!r:.80}")
    for i, link in enumerate(ls):
        where = f"links[{i}]"
        if not isinstance(link, dict):
            raise TopologyError(f"{src}: {where}: must be a table, got {link!r:.80}")
        extra = set(link) - {"between", "latency_ms", "bandwidth_gbps"}
        if extra:
            raise TopologyError(f"{src}: {where}: unknown key(s) {sorted(extra)}")
        pair = link.get("between")
        if not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(x, str) for x in pair):
            raise TopologyError(f"{src}: {where}.between: must be two region names, got {pair!r}")
        a, b = pair
        for x in (a, b):
            if x not in regions:
                raise TopologyError(f"{src}: {where}: unknown region {x!r} (regions: {sorted(regions)})")
        if a == b:
            raise TopologyError(f"{src}: {where}: links join two different regions; "
                                f"set regions.{a}.latency_ms/bandwidth_gbps for within {a!r}")
        key = tuple(sorted((a, b)))
        if key in links:
            raise TopologyError(f"{src}: {where}: duplicate link between {a!r} and {b!r}")
        for k in ("latency_ms", "bandwidth_gbps"):
            if k not in link:
                raise TopologyError(f"{src}: {where}.{k} is missing for the link {a!r}-{b!r}")
        links[key] = (_num(src, f"{where}.latency_ms", link["latency_ms"]),
                      _num(src, f"{where}.bandwidth_gbps", link["bandwidth_gbps"], positive=True))
    return links


class Topology:
    """Regions, latency/bandwidth between them, edges and their capacities, the origin region."""

    def __init__(self, regions: dict[str, tuple[float, float]], links: dict[tuple[str, str], tuple[float, float]],
                 edges: list[tuple[str, str, int]], origin_region: str, source: str = "<topology>",
                 options: dict | None = None):
        """regions: name -> (latency_ms, bandwidth_gbps) within it; links: (a, b) -> the same
        between a and b (either order given once); edges: (name, region, capacity_bytes);
        options: edge name -> its other settings in the file, as written (the edge's own:
        kdn/edge/options.py checks them, placement does not read them)."""
        self.source = source
        self._regions = dict(regions)
        self._links: dict[tuple[str, str], tuple[float, float]] = {}
        for (a, b), v in links.items():
            self._links[(a, b)] = v
            self._links[(b, a)] = v
        for r, v in self._regions.items():
            self._links[(r, r)] = v
        self._edges: dict[str, tuple[str, int]] = {}
        self.origin_region = origin_region
        self.ranked = 0          # rank_sources() calls
        for name, region, cap in edges:
            self.add_edge(name, region, cap)
        self.options = {n: dict(v) for n, v in (options or {}).items()}
        self._check()

    def _check(self):
        src = self.source
        if not self._regions:
            raise TopologyError(f"{src}: no regions defined")
        if self.origin_region not in self._regions:
            raise TopologyError(f"{src}: origin_region: unknown region {self.origin_region!r} "
                                f"(regions: {sorted(self._regions)})")
        names = sorted(self._regions)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if (a, b) not in self._links:
                    raise TopologyError(f"{src}: links: no link between regions {a!r} and {b!r} "
                                        f"(every pair needs latency_ms and bandwidth_gbps)")

    # --- construction ----------------------------------------------------------------
    @classmethod
    def from_toml(cls, path) -> "Topology":
        path = Path(path)
        try:
            with open(path, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise TopologyError(f"{path}: not a regular file (a topology is a TOML file)")
                raw = f.read(MAX_FILE_BYTES + 1)
        except OSError as e:
            raise TopologyError(f"{path}: cannot read topology file: {e.strerror or e}") from e
        if len(raw) > MAX_FILE_BYTES:
            raise TopologyError(f"{path}: larger than {MAX_FILE_BYTES} bytes: not a topology file")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TopologyError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            d = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise TopologyError(f"{path}: not valid TOML: {e}") from e
        return cls.from_dict(d, source=str(path))

    @classmethod
    def from_dict(cls, d: dict, source: str = "<dict>") -> "Topology":
        """The topology of a TOML-shaped dict (to_dict's form); TopologyError naming the
        source and the key at fault."""
        src = source
        if not isinstance(d, dict):
            raise TopologyError(f"{src}: a topology must be a table, got {type(d).__name__}")
        unknown = set(d) - {"origin_region", "regions", "links"}
        if unknown:
            raise TopologyError(f"{src}: unknown top-level key(s) {sorted(unknown)} "
                                f"(expected origin_region, regions, links)")
        if "origin_region" not in d:
            raise TopologyError(f"{src}: origin_region is missing")
        origin = _name(src, "origin_region", d["origin_region"])
        regs = d.get("regions")
        if not isinstance(regs, dict) or not regs:
            raise TopologyError(f"{src}: regions: must be a non-empty table of regions, got {regs!r:.80}")
        regions, edges, seen, options = {}, [], {}, {}
        for rname, r in regs.items():
            regions[rname] = _region(src, rname, r, edges, seen, options)
        links = _links(src, d.get("links", []), regions)
        if origin not in regions:
            raise TopologyError(f"{src}: origin_region: unknown region {origin!r} (regions: {sorted(regions)})")
        return cls(regions, links, edges, origin, source=src, options=options)

    def to_dict(self) -> dict:
        """The TOML-shaped dict from_dict() reads back (round-trips)."""
        regions = {}
        for r in sorted(self._regions):
            lat, bw = self._regions[r]
            regions[r] = {"latency_ms": lat, "bandwidth_gbps": bw,
                          "edges": [{"name": n, "capacity_bytes": c, **self.options.get(n, {})}
                                    for n, (reg, c) in sorted(self._edges.items()) if reg == r]}
        names = sorted(self._regions)
        links = [{"between": [a, b], "latency_ms": self._links[(a, b)][0],
                  "bandwidth_gbps": self._links[(a, b)][1]}
                 for i, a in enumerate(names) for b in names[i + 1:]]
        return {"origin_region": self.origin_region, "regions": regions, "links": links}

    def to_toml(self) -> str:
        """The topology as a TOML file a user could have written."""
        d = self.to_dict()
        q = json.dumps                      # a JSON string is a valid TOML basic string
        out = [f'origin_region = {q(d["origin_region"])}', ""]
        for r, v in d["regions"].items():
            out += [f'[regions.{q(r)}]', f'latency_ms = {v["latency_ms"]!r}',
                    f'bandwidth_gbps = {v["bandwidth_gbps"]!r}', "edges = ["]
            out += [f'  {{ name = {q(e["name"])}, capacity_bytes = {e["capacity_bytes"]}'
                    + (f', disk_bytes = {e["disk_bytes"]}' if "disk_bytes" in e else "")
                    + (f', disk_dir = {q(e["disk_dir"])}' if "disk_dir" in e else "")
                    + (f', kv_events = {_inline(e["kv_events"])}' if "kv_events" in e else "") + ' },'
                    for e in v["edges"]]
            out += ["]", ""]
        for link in d["links"]:
            a, b = link["between"]
            out += ["[[links]]", f'between = [{q(a)}, {q(b)}]', f'latency_ms = {link["latency_ms"]!r}',
                    f'bandwidth_gbps = {link["bandwidth_gbps"]!r}', ""]
        return "\n".join(out)

    @classmethod
    def default_local(cls, regions: list[str], edges_per_region: int = 1,
                      capacity_bytes: int = 2 * 2**30, origin_region: str | None = None) -> "Topology":
        """A plausible topology for N regions simulated on one machine (the demo, tests):
        0.2 ms and 10 GB/s within a region; between regions 30-80 ms one way (spread by the
        regions' distance in the list) and 1 GB/s. Edges are named '<region>-<i>'."""
        regions = list(regions)
        if not regions or len(set(regions)) != len(regions):
            raise TopologyError(f"default_local: need distinct region names, got {regions!r}")
        n = len(regions)
        links = {}
        for i in range(n):
            for j in range(i + 1, n):
                gap = (j - i) / max(1, n - 1)            # 0..1: how far apart in the list
                links[(regions[i], regions[j])] = (30.0 + 50.0 * gap, 1.0)
        edges = [(f"{r}-{k}", r, int(capacity_bytes)) for r in regions for k in range(edges_per_region)]
        return cls({r: (0.2, 10.0) for r in regions}, links, edges,
                   origin_region or regions[0], source="default_local")

    def add_edge(self, name: str, region: str, capacity_bytes: int) -> Edge:
        """Add an edge (e.g. one started at runtime); returns it as a ring member."""
        src = self.source
        _name(src, "edge name", name)
        if region not in self._regions:
            raise TopologyError(f"{src}: edge {name!r}: unknown region {region!r} (regions: {sorted(self._regions)})")
        if name in self._edges:
            raise TopologyError(f"{src}: duplicate edge {name!r} (already in region {self._edges[name][0]!r})")
        check_int(capacity_bytes, f"{src}: edge {name!r}: capacity_bytes", 1, error=TopologyError)
        self._edges[name] = (region, capacity_bytes)
        return self.edge(name)

    def remove_edge(self, name: str) -> None:
        if name not in self._edges:
            raise TopologyError(f"{self.source}: unknown edge {name!r}")
        del self._edges[name]
        self.options.pop(name, None)

    def edge_options(self, edge_name: str) -> dict:
        """The edge's settings in the file beside its capacity (its disk tier, its KV events:
        the edge's, kdn/edge/options.py), as written; {} when it names none."""
        self.region_of(edge_name)
        return dict(self.options.get(edge_name, {}))

    # --- queries ---------------------------------------------------------------------
    @property
    def regions(self) -> list[str]:
        return sorted(self._regions)

    def edge(self, name: str) -> Edge:
        """The ring member for an edge: weight = capacity in GiB (only ratios matter)."""
        region, cap = self._edges[name] if name in self._edges else self._unknown_edge(name)
        return Edge(name, region, cap / 2**30)

    @property
    def edges(self) -> list[Edge]:
        return [self.edge(n) for n in sorted(self._edges)]

    def edges_in(self, region: str) -> list[str]:
        self._region(region)
        return sorted(n for n, (r, _) in self._edges.items() if r == region)

    def _unknown_edge(self, name):
        raise TopologyError(f"{self.source}: unknown edge {name!r} (edges: {sorted(self._edges)})")

    def _region(self, r):
        if r not in self._regions:
            raise TopologyError(f"{self.source}: unknown region {r!r} (regions: {sorted(self._regions)})")
        return r

    def region_of(self, edge_name: str) -> str:
        return self._edges[edge_name][0] if edge_name in self._edges else self._unknown_edge(edge_name)

    def capacity_bytes(self, edge_name: str) -> int:
        return self._edges[edge_name][1] if edge_name in self._edges else self._unknown_edge(edge_name)

    def region_capacity_bytes(self) -> dict[str, int]:
        out = {r: 0 for r in self._regions}
        for r, c in self._edges.values():
            out[r] += c
        return out

    def latency_ms(self, src_region: str, dst_region: str) -> float:
        return self._links[(self._region(src_region), self._region(dst_region))][0]

    def bandwidth_gbps(self, src_region: str, dst_region: str) -> float:
        return self._links[(self._region(src_region), self._region(dst_region))][1]

    def transfer_time(self, src_region: str, dst_region: str, nbytes: int, queue_bytes: int = 0) -> float:
        """Seconds to move nbytes from src to dst behind queue_bytes already waiting at the source."""
        lat, bw = self._links[(self._region(src_region), self._region(dst_region))]
        return lat / 1000.0 + (queue_bytes + nbytes) / (bw * GB)

    def rank_sources(self, reader_region: str, candidates: list[tuple[str, str]], nbytes: int,
                     queue_bytes: dict | None = None) -> list[str]:
        """Candidate names (name, region) nearest first by estimated transfer time to the
        reader; equal times keep the given order (e.g. ring preference)."""
        self.ranked += 1
        q = queue_bytes or {}
        timed = [(self.transfer_time(reg, reader_region, nbytes, q.get(name, 0)), i, name)
                 for i, (name, reg) in enumerate(candidates)]
        return [name for _, _, name in sorted(timed)]

    def stats(self) -> dict:
        return {"regions": len(self._regions), "edges": len(self._edges), "ranked": self.ranked}

    def __repr__(self) -> str:
        return (f"Topology({len(self._regions)} regions, {len(self._edges)} edges, "
                f"origin in {self.origin_region!r}, from {self.source})")


def _inline(v) -> str:
    """A str, or a flat table of str/int/bool, as TOML (an edge's kv_events)."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_inline(x)}" for k, x in v.items()) + " }"
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v) if isinstance(v, str) else repr(v)
