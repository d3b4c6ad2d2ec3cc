"""`kdn bench vllm`: time to first token in vLLM with KDN, against vLLM's own two bounds.

An unmodified vLLM (CPU build) runs SmolLM2-135M-Instruct with KDNConnector, in this
process, on a one-region network built for the run. For knowledge of about 1k, 2k and 4k
tokens plus a 32-token question it measures, back to back in each rep:

- full: vLLM prefills the whole prompt (its prefix cache and so KDN skipped);
- KDN: vLLM's prefix cache emptied, the knowledge's KV comes from the edge through the
  connector (lookup, fetch, copy into the paged cache), vLLM computes the question;
- hit: the same prompt again, its knowledge now in vLLM's own paged memory: the physical
  limit of any external cache, which must at least put the same bytes there.

`speedup` = full / KDN and `limit_speedup` = full / hit per length; the goal is KDN within
1.25x of the hit at 4k. The connector's load path (its copy into the paged cache, as the
connector reports it) is given in GB/s beside a memcpy of the same bytes. The KBs are
published by vLLM itself (kv_both), so the KV it loads is the KV it computes; the first
generated token of KDN and of the full prefill is compared.

--cross adds the cross-engine measurement: KV published by the transformers engine
(kdn.engines.transformers.model) read by vLLM, and KV published by vLLM read by the transformers worker, each
against that engine's own full prefill, on the bundled KB and on a KB written for it
(GREENHOUSE), over several questions; greedy tokens compared, 24 each.
"""
import argparse
import sys
import time
import uuid

from kdn.bench import emit_json, median, table
from kdn.bench.harness import row_at, scratch_dir, ttft_table
from kdn.engines.vllm.load import COPY_THREADS
from kdn.core.errors import BadRequest

LENGTHS = (1024, 2048, 4096)
TARGET_LENGTH, TARGET_RATIO = 4096, 1.25
REGION = "local"
CROSS_TOKENS = 24
CROSS_QUESTIONS = ("What is this text about?", "Summarize the main rules in one sentence.",
                   "Who is responsible for what, according to the text?")

# A knowledge base written for this benchmark (not in any training set): cross-engine
# agreement is measured on it as well as on the bundled founding documents.
GREENHOUSE = """# Operations manual: Kestrel Ridge orbital greenhouse, deck C

Deck C grows leafy greens and dwarf tomatoes for a crew of eleven. The deck is divided into
six racks, numbered C1 to C6 from the airlock inward. Racks C1 and C2 hold lettuce and chard,
C3 and C4 hold dwarf tomatoes, and C5 holds herbs: basil, chives and mint. Rack C6 is the
nursery, where seedlings spend their first nineteen days before they are moved outward.

Water. Each rack draws from its own reservoir of forty litres. The reservoirs are topped up
at 06:00 and 18:00 station time by the duty grower, who records the volume added in the
deck log. A reservoir that needs more than six litres at one top-up is checked for leaks
before the next shift. Nutrient solution is mixed on Tuesdays only, at an electrical
conductivity of 1.8 for greens and 2.4 for tomatoes.

Light. The lamps run a sixteen-hour day from 04:00 to 20:00. Tomatoes get an extra hour of
far-red light at the end of the day to encourage flowering. If the station switches to
reduced power, racks C5 and C6 keep full light and the other racks drop to sixty percent;
the nursery is never dimmed, because seedlings stretch and fall over within two days.

Air. Deck C shares its air loop with the galley. Carbon dioxide is held between 800 and
1,000 parts per million while the lamps are on. Above 1,400 the deck alarm sounds and the
duty grower opens the bypass valve V-17; nobody re-enters the deck without a mask until the
reading is back under 1,000.

People. The deck lead is Ines Okafor; her deputy is Tomas Lindqvist. Only the deck lead may
approve moving plants between racks, and only the deputy may sign off the weekly pest
inspection, which happens on Fridays. Harvests are logged by whoever cuts them, with the
rack, the plant count and the fresh weight in grams.

Pests. Aphids are the usual problem. A rack with more than five aphids on any leaf is
isolated by closing its curtain, and the ladybird cartridge from the cold store is released
into it. Chemical sprays are forbidden on deck C under any circumstances.
"""


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


def measure(llm, client, kb: str, question_tokens, reps: int, log) -> dict:
    """One knowledge length: full, KDN and hit TTFT (interleaved reps) and the load path."""
    from kdn.engines.vllm.run import generate
    m = client.manifest(kb)
    prompt = m.token_ids().tolist() + list(question_tokens)
    full, kdn, hit, same, loads = [], [], [], [], []
    generate(llm, prompt, 2, full=True)     # warm against warm: each path once, untimed
    llm.reset_prefix_cache()
    generate(llm, prompt, 2)
    for i in range(reps):       # 2 tokens: the connector's report arrives after the first
        f = generate(llm, prompt, 2, full=True)
        llm.reset_prefix_cache()
        k = generate(llm, prompt, 2)
        h = generate(llm, prompt, 2)
        r = k["kdn"]
        if r.get("external") != m.n_tokens or r.get("loaded") != m.n_tokens:
            raise BadRequest(f"{kb}: KDN loaded {r.get('loaded')} of {m.n_tokens} knowledge "
                             f"tokens ({r})")
        if h["kdn"].get("local", 0) < m.n_tokens // 128 * 128:
            raise BadRequest(f"{kb}: the repeat was not a prefix-cache hit ({h['kdn']})")
        full.append(f["ttft_s"])
        kdn.append(k["ttft_s"])
        hit.append(h["ttft_s"])
        same.append(f["tokens"] == k["tokens"])
        loads.append(r)
        log(f"  {kb} rep {i + 1}/{reps}: full {f['ttft_s'] * 1000:.0f} ms, KDN {k['ttft_s'] * 1000:.0f} ms "
            f"(fetch {r['fetch_s'] * 1000:.0f}, copy {r.get('copy_s', 0) * 1000:.0f}), "
            f"hit {h['ttft_s'] * 1000:.0f} ms")
    from kdn.bench.ttft import memcpy_s
    nbytes = loads[0]["bytes"]
    copy_s, fetch_s, mem_s = median([r["copy_s"] for r in loads]), median([r["fetch_s"] for r in loads]), \
        memcpy_s(nbytes)
    full_s, kdn_s, hit_s = median(full), median(kdn), median(hit)
    return {"knowledge_tokens": m.n_tokens, "question_tokens": len(prompt) - m.n_tokens,
            "kv_bytes": nbytes, "reps": reps, "full_ttft_s": full_s, "kdn_ttft_s": kdn_s,
            "hit_ttft_s": hit_s, "speedup": full_s / kdn_s, "limit_speedup": full_s / hit_s,
            "kdn_over_hit": kdn_s / hit_s, "fetch_s": fetch_s, "copy_s": copy_s,
            "load_gbps": nbytes / copy_s / 1e9, "fetch_gbps": nbytes / fetch_s / 1e9,
            "memcpy_s": mem_s, "memcpy_gbps": nbytes / mem_s / 1e9,
            "first_token_identical": all(same),
            "full_all_s": full, "kdn_all_s": kdn, "hit_all_s": hit}


def ttft(lengths, reps: int, layerwise: bool, copy_threads: int, log) -> tuple:
    """(rows, info): the TTFT table on a fresh one-region network."""
    from kdn.bench.ttft import knowledge_texts, question_text
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.engines.fingerprint import fingerprints
    from kdn.engines.vllm.run import publish_with_vllm, start_engine
    from kdn.engines.transformers.model import load_model
    from kdn.placement.topology import Topology

    model = load_model(log=log)
    texts = knowledge_texts(model, lengths)
    question = model.question_tokens(question_text(model))
    kv_total = sum(lengths) * model.kv_bytes_per_token
    cluster = net = None
    root = scratch_dir("kdn-bench-vllm-")
    try:
        cluster = LocalCluster([REGION], cpus=2, object_store_bytes=max(1 << 30, 2 * kv_total))
        init_ray(cluster.address)
        topo = Topology.default_local([REGION], capacity_bytes=max(2 << 30, 2 * kv_total))
        net = start_network(topo, root, network=f"bench-vllm-{uuid.uuid4().hex[:6]}")
        t0 = time.perf_counter()
        llm = start_engine("kv_both", str(model.cache_path), network=net.name, region=REGION,
                           layerwise=layerwise, copy_threads=copy_threads)
        log(f"vLLM engine with KDNConnector up in {time.perf_counter() - t0:.1f} s")
        fp = fingerprints(model.cache_path)["vllm"]
        client = Client(network=net.name, region=REGION, fingerprint=fp)
        for n in sorted(lengths):            # shortest first: each longer one reuses its prefix
            r = publish_with_vllm(llm, f"vllm-{n}", [("knowledge", texts[n])], model=model)
            log(f"published vllm-{n} through vLLM: {r['tokens']} tokens, {r['sent_chunks']} chunks "
                f"sent; {r['prefilled_tokens']} prefilled, {r['reused_tokens']} loaded from KDN")
        rows = [measure(llm, client, f"vllm-{n}", question, reps, log) for n in lengths]
        return rows, {"model": model.name, "fingerprint": fp, "layerwise": layerwise,
                      "copy_threads": copy_threads}
    finally:
        teardown(net, cluster, root)


def cross_engine(log, questions=CROSS_QUESTIONS, n_tokens: int = CROSS_TOKENS) -> dict:
    """Each engine reading KV the other one published, against its own full prefill.

    One vLLM engine reads both namespaces: unsalted requests its own KV, requests salted
    "tf" the transformers engine's (a salt may name another fingerprint on purpose)."""
    import numpy as np
    from kdn.bench import matching_prefix
    from kdn.client import Client
    from kdn.launch.cluster import LocalCluster, start_network, teardown
    from kdn.client.join import init_ray
    from kdn.engines.fingerprint import fingerprints
    from kdn.engines.vllm.run import generate, publish_with_vllm, start_engine
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers.model import load_model
    from kdn.placement.topology import Topology
    from kdn.client.publish import publish_documents

    model = load_model(log=log)
    fps = fingerprints(model.cache_path)
    kbs = {"founding": bundled_documents(), "greenhouse": [("greenhouse", GREENHOUSE)]}
    cluster = net = None
    root = scratch_dir("kdn-bench-cross-")
    try:
        cluster = LocalCluster([REGION], cpus=2, object_store_bytes=2 << 30)
        init_ray(cluster.address)
        net = start_network(Topology.default_local([REGION], capacity_bytes=2 << 30), root,
                            network=f"bench-cross-{uuid.uuid4().hex[:6]}")
        llm = start_engine("kv_both", str(model.cache_path), network=net.name, region=REGION,
                           tenants={"tf": {"tenant": "default", "fingerprint": "transformers"}})
        clients = {e: Client(network=net.name, region=REGION, fingerprint=fps[e])
                   for e in ("transformers", "vllm")}
        rows, kv_diff = [], {}
        for kb, docs in kbs.items():
            publish_documents(clients["transformers"], model, kb, docs)
            publish_with_vllm(llm, kb, docs, model=model)
            m = clients["vllm"].manifest(kb)
            both = [np.concatenate(clients[e].fetch(m.token_ids().tolist(), kb=kb).kv_parts(), axis=3)
                    for e in ("transformers", "vllm")]
            kv_diff[kb] = float(np.abs(both[0] - both[1]).max())
            log(f"{kb}: {m.n_tokens} tokens published by both engines; max |KV difference| "
                f"{kv_diff[kb]:.2e}")
            for q in questions:
                prompt = m.token_ids().tolist() + model.question_tokens(q)
                rows += _cross_rows(llm, model, clients, kb, q, prompt, n_tokens, m.n_tokens,
                                    generate, matching_prefix)
                log(f"  {kb} / {q[:40]}: " + ", ".join(
                    f"{r['reader']}<-{r['kv_from']} {'same' if r['identical'] else r['matching']}"
                    for r in rows[-4:]))
    finally:
        teardown(net, cluster, root)
    summary = {f"{reader}<-{kv_from}": sum(r["identical"] for r in rows
                                           if (r["reader"], r["kv_from"]) == (reader, kv_from))
               for reader in ("vllm", "transformers") for kv_from in ("vllm", "transformers")}
    return {"answers": rows, "identical": summary, "per_pair": len(questions) * len(kbs),
            "kv_max_abs_diff": kv_diff, "new_tokens": n_tokens,
            "fingerprints": fps}


def _cross_rows(llm, model, clients, kb, q, prompt, n_tokens, kb_tokens, generate, matching_prefix):
    """Four answers (each reader from each engine's KV) against each reader's full prefill."""
    rows = []
    base = generate(llm, prompt, n_tokens, full=True)["tokens"]
    for kv_from, salt in (("vllm", None), ("transformers", "tf")):
        llm.reset_prefix_cache()
        got = generate(llm, prompt, n_tokens, salt=salt)
        if got["kdn"].get("loaded") != kb_tokens:
            raise BadRequest(f"{kb}: vLLM loaded {got['kdn'].get('loaded')} of {kb_tokens} tokens "
                             f"of {kv_from} KV ({got['kdn']})")
        rows.append({"kb": kb, "question": q, "reader": "vllm", "kv_from": kv_from,
                     "identical": got["tokens"] == base, "matching": matching_prefix(got["tokens"], base)})
    base = model.generate(prompt, max_new_tokens=n_tokens).tokens
    for kv_from in ("vllm", "transformers"):
        f = clients[kv_from].fetch(prompt, kb=kb)
        if f.tokens != kb_tokens:
            raise BadRequest(f"{kb}: fetched {f.tokens} of {kb_tokens} tokens of {kv_from} KV")
        g = model.generate(prompt, cache=model.cache_from_kv(f.kv_parts()), cached_tokens=f.tokens,
                           max_new_tokens=n_tokens).tokens
        rows.append({"kb": kb, "question": q, "reader": "transformers", "kv_from": kv_from,
                     "identical": g == base, "matching": matching_prefix(g, base)})
    return rows


def report_ttft(rows, reps: int) -> "dict | None":
    """Print the TTFT table and the goal's verdict; the row at the target length."""
    print(f"time to first token in vLLM (CPU), {rows[0]['question_tokens']}-token question, "
          f"median of {reps}; KV published by vLLM itself")
    ttft_table(rows, "limit_speedup", {
        "hit ms": lambda r: f"{r['hit_ttft_s'] * 1000:.0f}",
        "KDN/hit": lambda r: f"{r['kdn_over_hit']:.2f}",
        "load GB/s": lambda r: f"{r['load_gbps']:.2f}",
        "memcpy GB/s": lambda r: f"{r['memcpy_gbps']:.2f}"})
    at = row_at(rows, TARGET_LENGTH)
    if at:
        verdict = "met" if at["kdn_over_hit"] <= TARGET_RATIO else "NOT met"
        print(f"goal KDN within {TARGET_RATIO}x of vLLM's own prefix-cache hit at {TARGET_LENGTH} "
              f"tokens: {at['kdn_over_hit']:.2f}x, {verdict}")
    return at


def report_cross(cross) -> None:
    print(f"\ncross-engine reuse: answers token-identical to the reader's own full prefill "
          f"(of {cross['per_pair']} per pair, {cross['new_tokens']} greedy tokens each)")
    table([{"reader": k.split("<-")[0], "KV computed by": k.split("<-")[1],
            "identical": f"{v}/{cross['per_pair']}"} for k, v in cross["identical"].items()])
    print("max |KV difference| between the engines: " + ", ".join(
        f"{kb} {d:.1e}" for kb, d in cross["kv_max_abs_diff"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kdn bench vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")],
                    help="comma-separated knowledge lengths in tokens (default 1024,2048,4096)")
    ap.add_argument("--reps", type=int, default=3, help="timed reps per length (median reported)")
    ap.add_argument("--layerwise", action="store_true",
                    help="start the forward when layer 0 is in (copy the rest beside it)")
    ap.add_argument("--copy-threads", type=int, default=COPY_THREADS,
                    help=f"threads copying into the paged cache (default {COPY_THREADS})")
    ap.add_argument("--cross", action="store_true", help="also measure cross-engine reuse")
    ap.add_argument("--cross-only", action="store_true", help="only the cross-engine measurement")
    ap.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = ap.parse_args(argv)
    lengths = args.lengths or LENGTHS
    if args.reps < 1 or any(n < 256 for n in lengths):
        raise BadRequest(f"need --reps >= 1 and lengths >= 256 tokens, got reps={args.reps}, "
                         f"lengths={lengths}")
    rows, info, at, cross = [], {}, None, None
    if not args.cross_only:
        rows, info = ttft(list(lengths), args.reps, args.layerwise, args.copy_threads, _log)
        at = report_ttft(rows, args.reps)
    if args.cross or args.cross_only:
        cross = cross_engine(_log)
        report_cross(cross)
    if args.json:
        emit_json({"bench": "vllm", **info, "reps": args.reps, "lengths": rows,
                   "target": {"knowledge_tokens": TARGET_LENGTH, "kdn_over_hit": TARGET_RATIO},
                   "kdn_over_hit_at_target": at["kdn_over_hit"] if at else None, "cross": cross})
    return 0 if all(r["first_token_identical"] for r in rows) else 1
