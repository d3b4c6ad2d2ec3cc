"""`kdn bench links`: compressed KV in the network: chunks an edge holds, bytes a link carries.

Real SmolLM2-135M KV of the bundled knowledge (first --docs documents, prefilled here), a
real two-region Ray cluster on loopback (LocalCluster: us-east with one edge and the origin,
eu-west with no edge, so its readers are served across the link), and a topology that
declares the link between them thin (--link-gbps, default 0.1 GB/s: a shared WAN link).
The edge's capacity holds --capacity-chunks raw chunks (main tier), fewer than the KB has.
For each edge store codec (raw, zstd, and the lossy q8z and k4v3z), one network is started,
the KB published (the origin stores it zstd), and:

- held: chunks the edge's main tier holds, how much KV (raw bytes) that is against its
  capacity, and holds_x: KV bytes per byte of memory (how many times more KV a full tier
  holds than a raw one);
- readers: a reader beside the edge (same node: the stored form, raw stays zero-copy) and
  readers in eu-west accepting the lossless codecs only, or lossy ones too
  (--lossy, default q8z,k4v3z). For each: the codec mix the edge chose, the bytes that
  crossed the link, the fetch's wall time here (loopback moves ~1 GB/s, so this is mostly
  encode/decode CPU), the modeled time on the declared link (wall + wire bytes at
  --link-gbps; on loopback the link itself costs almost nothing), the same for raw bytes,
  and whether the KV is exact (lossless: byte-identical to the published KV, checked).

Model quality of each lossy codec is `kdn bench codecs`'s job; this one measures placement
and transfer. --json prints one JSON object last.
"""
import argparse
import time
import uuid

import numpy as np

from kdn.bench import emit_json, median, table
from kdn.bench.harness import scratch_dir

FINGERPRINT = "bench-links"
KB = "bench-links"
STORE_CODECS = ("raw", "zstd", "q8z", "k4v3z")


class Reader:
    """A worker process on some region's node that fetches the KB and reports what came."""

    def __init__(self, network: str, accept):
        from kdn.client import Client
        self.client = Client(network=network, fingerprint=FINGERPRINT, accept=accept)

    def fetch(self, tokens, reps: int, expected_sum: int):
        import xxhash
        times, f = [], None
        for _ in range(reps):
            t0 = time.perf_counter()
            f = self.client.fetch(tokens, kb=KB)
            times.append(time.perf_counter() - t0)
        kv = np.concatenate([c.kv for c in f.chunks], axis=3)
        same = xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(kv)).cast("B")) == expected_sum
        return {"region": self.client.region, "edge": f.edge, "tokens": f.tokens,
                "codecs": f.codecs, "wire_bytes": f.wire_bytes, "nbytes": f.nbytes,
                "exact": f.exact, "identical": same, "seconds": median(times),
                "sources": f.source_counts()}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kdn bench links", description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=5, help="bundled documents in the KB (1-5)")
    ap.add_argument("--link-gbps", type=float, default=0.1, help="declared us-east <-> eu-west GB/s")
    ap.add_argument("--capacity-chunks", type=int, default=6,
                    help="raw 256-token chunks the edge's main tier holds")
    ap.add_argument("--codecs", default=",".join(STORE_CODECS), help="edge store codecs to run")
    ap.add_argument("--lossy", default="q8z,k4v3z", help="codecs the lossy readers accept")
    ap.add_argument("--reps", type=int, default=3, help="fetches per reader (median kept)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from kdn.core.chunk import codecs as registered
    stores = [c for c in args.codecs.split(",") if c]
    lossy = [c for c in args.lossy.split(",") if c]
    bad = [c for c in stores + lossy if c not in registered()]
    if bad or not 1 <= args.docs <= 5 or args.link_gbps <= 0 or args.capacity_chunks < 1:
        ap.error(f"bad arguments (unknown codecs: {bad}); see --help")

    import ray
    import xxhash
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers.model import load_model
    from kdn.placement.topology import Topology

    model = load_model(log=print)
    docs = bundled_documents()[:args.docs]
    tokens = model.knowledge_tokens("\n\n".join(text for _, text in docs))
    t0 = time.perf_counter()
    kv = model.prefill(tokens, chunk_tokens=256).kv
    n_chunks = -(-len(tokens) // 256)
    chunk_bytes = kv.nbytes * 256 // len(tokens)
    print(f"KB: {args.docs} documents, {len(tokens)} tokens, {n_chunks} chunks, "
          f"{kv.nbytes / 1e6:.1f} MB fp32 KV (prefill {time.perf_counter() - t0:.1f} s); "
          f"link {args.link_gbps} GB/s; edge main tier {args.capacity_chunks} raw chunks", flush=True)
    expected = xxhash.xxh3_64_intdigest(memoryview(kv).cast("B"))
    capacity = int(args.capacity_chunks * chunk_bytes / 0.75) + 1     # main = 75% (hot 25%)
    topo = Topology({"us-east": (0.2, 10.0), "eu-west": (0.2, 10.0)},
                    {("us-east", "eu-west"): (40.0, args.link_gbps)},
                    [("us-east-0", "us-east", capacity)], "us-east", source="bench-links")

    cluster = root = net = None
    held_rows, read_rows = [], []
    try:
        cluster = LocalCluster(["us-east", "eu-west"], cpus=1, object_store_bytes=1 << 30)
        init_ray(cluster.address)
        root = scratch_dir("kdn-bench-links-")
        reader_cls = ray.remote(num_cpus=0)(Reader)
        for store in stores:
            name = f"bl{uuid.uuid4().hex[:6]}"
            net = start_network(topo, f"{root}/{name}", network=name, replicas=1,
                                edge_options={"store_codec": store},
                                origin_options={"store_codec": "zstd"})
            Client(network=name, region="us-east", fingerprint=FINGERPRINT).publish(
                KB, [("knowledge", tokens)], kv)
            st = ray.get(net.edge("us-east-0").stats.remote(), timeout=60)
            ost = ray.get(net.origin.stats.remote(), timeout=60)
            held_rows.append({"store": store, "chunks_held": st["main"]["items"],
                              "of": n_chunks, "kv_held_MB": st["held_raw_bytes"] / 1e6,
                              "capacity_MB": st["main"]["capacity"] / 1e6,
                              "kv_per_capacity": st["held_raw_bytes"] / st["main"]["capacity"],
                              "holds_x": st["held_raw_bytes"] / max(1, st["main"]["bytes"]),
                              "origin_disk_MB": ost["store"]["bytes"] / 1e6})
            readers = [("beside the edge", "us-east", None), ("eu-west, lossless", "eu-west", None),
                       ("eu-west, lossy ok", "eu-west", lossy)]
            for label, region, accept in readers:
                r = reader_cls.options(label_selector={"region": region}).remote(name, accept)
                got = ray.get(r.fetch.remote(tokens, args.reps, expected), timeout=600)
                ray.kill(r)
                link = 0.0 if region == "us-east" else got["wire_bytes"] / (args.link_gbps * 1e9)
                raw_link = 0.0 if region == "us-east" else got["nbytes"] / (args.link_gbps * 1e9)
                read_rows.append({
                    "store": store, "reader": label,
                    "codecs": ",".join(f"{k}:{v}" for k, v in sorted(got["codecs"].items())),
                    "from": ",".join(f"{k}:{v}" for k, v in sorted(got["sources"].items())),
                    "wire_MB": got["wire_bytes"] / 1e6, "kv_MB": got["nbytes"] / 1e6,
                    "wall_s": got["seconds"], "model_s": got["seconds"] + link,
                    "raw_model_s": raw_link, "exact": got["exact"],
                    "identical": got["identical"]})
            teardown(net)
            net = None
    finally:
        teardown(net, cluster, root)
    print("\nwhat an edge holds in its main tier, by store codec:")
    table(held_rows)
    print(f"\nwhat readers got (model_s = wall_s + wire bytes at {args.link_gbps} GB/s; "
          f"raw_model_s = the KV's raw bytes alone at that rate):")
    table(read_rows)
    if args.json:
        emit_json({"bench": "links", "tokens": len(tokens), "chunks": n_chunks,
                   "link_gbps": args.link_gbps, "held": held_rows, "reads": read_rows})
