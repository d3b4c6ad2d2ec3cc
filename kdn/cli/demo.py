"""`kdn demo`: the whole idea in one run, on a real 3-region Ray cluster on this machine.

1. Start a local network: one labelled Ray node per region, an origin, an edge per region.
2. Publish the bundled knowledge base (public-domain founding documents of the USA) with the
   real model: prefill once, store durably, push chunks to their ring owners.
3. In each region, a worker (a Ray task on that region's node) answers questions: it fetches
   the knowledge's KV from its nearest edge and computes only its question. The first
   answer in each region is also computed the plain way (full prefill) to show the speedup
   and that the generated tokens are identical. Workers warm their model as it loads, and
   a checked answer warms its fetch before timing, so both sides are compared warm.
4. A worker outside Ray reads the same KV over HTTP and checks it is byte-identical.
5. Print what KDN saved, re-publish the unchanged KB (no prefill, nothing sent), shut down.

With engine="vllm" (`kdn demo --engine vllm`), a vLLM worker in eu-west also publishes the
KB through vLLM (its KV under vLLM's own fingerprint) and answers from its edge through the
KDN connector, its first answer checked against vLLM's own full prefill.
"""
import dataclasses
import sys
import time

import numpy as np

REGIONS = ("us-east", "eu-west", "ap-south")
KB = "founding-documents"
NETWORK = "demo"


def _region_worker(network, kb, questions, max_new_tokens):
    """Runs on a node of one region: answers questions with KV from that region's edge."""
    import torch
    from kdn.client import Client
    from kdn.engines.transformers.model import load_model
    from kdn.engines.transformers.worker import answer
    torch.set_num_threads(2)
    model = load_model()      # warmed up as it loads: answers are timed, not first-call setup
    client = Client(network=network, fingerprint=model.fingerprint)
    out = []
    for i, q in enumerate(questions):
        a = answer(client, model, kb, q, max_new_tokens=max_new_tokens, check=(i == 0))
        d = dataclasses.asdict(a)
        d.pop("tokens"), d.pop("baseline_tokens")
        out.append(d)
    return client.region, out


def run(questions_per_region: int = 2, max_new_tokens: int = 24, out=None,
        engine: str = "transformers") -> dict:
    """The demo end to end (the module docstring's five steps); returns what it measured."""
    from kdn.client.join import init_ray
    from kdn.engines.base import check_engine
    from kdn.launch.cluster import LocalCluster, object_store_for, stop_network
    check_engine(engine)
    out = out or sys.stdout

    def say(*a):
        print(*a, file=out, flush=True)

    t_start = time.perf_counter()
    say("KDN demo: a CDN for the KV cache of shared knowledge\n")
    say("[1/5] starting a 3-region network on this machine (one labelled Ray node per region) ...")
    cluster = LocalCluster(REGIONS, cpus=2, object_store_bytes=object_store_for(_topology()))
    try:
        init_ray(cluster.address)
        net = _start(say)
        say("[2/5] publishing the bundled knowledge base with SmolLM2-135M-Instruct ...")
        client, model, receipt = _publish(net, say, out)
        say("[3/5] a worker in each region answers questions from its nearest edge ...")
        results = _ask_every_region(net.name, questions_per_region, max_new_tokens)
        if engine == "vllm":
            say("[3/5] ... and a vLLM worker in eu-west, publishing through vLLM, reads with the KDN connector ...")
            results += _vllm_worker(net.name, questions_per_region, max_new_tokens, say)
        say("[4/5] a worker outside Ray reads the same KV over HTTP ...")
        say("      " + _http_check(net, client, model))
        say("[5/5] results\n")
        _report(results, say, out)
        saved = _savings(client, model, results, say)
        say("\n[+] the same KB through `kdn serve`, an OpenAI-compatible API on Ray Serve, with the openai client ...")
        from kdn.serve import demo as serve_demo
        from kdn.cli.knowledge import bundled_questions
        saved["service"] = serve_demo.run(net.name, KB, bundled_questions()[0], say, replica_cpus=0.5)
        say(f"\ndemo finished in {time.perf_counter() - t_start:.0f} s; shutting the network down.")
        stop_network(net)
        return {"results": results, "receipt": receipt, **saved}
    finally:
        cluster.shutdown()


def _topology():
    from kdn.placement.topology import Topology
    return Topology.default_local(list(REGIONS), edges_per_region=1)


def _start(say):
    """The demo's network: origin and one edge per region, HTTP on."""
    from kdn.bench.harness import scratch_dir
    from kdn.launch.cluster import start_network
    topo = _topology()
    net = start_network(topo, scratch_dir("kdn-demo-origin-"), network=NETWORK, http=True)
    say(f"      origin in {topo.origin_region}, edges: {', '.join(e.name for e in topo.edges)}; "
        f"WAN latency between regions {topo.latency_ms(REGIONS[0], REGIONS[1]):.0f}-"
        f"{topo.latency_ms(REGIONS[0], REGIONS[2]):.0f} ms (modelled)")
    return net


def _publish(net, say, out) -> tuple:
    """(client, model, receipt): the bundled documents prefilled once and published."""
    import torch
    from kdn.client import Client
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.transformers.model import load_model
    from kdn.client.publish import progress_bar, publish_documents
    torch.set_num_threads(2)
    model = load_model()
    docs = bundled_documents()
    client = Client(network=net.name, region=net.topology.origin_region, fingerprint=model.fingerprint)
    receipt = publish_documents(client, model, KB, docs, progress=progress_bar("      prefill", file=out))
    replicas = max(1, sum(receipt["placement"].values()) // max(1, receipt["chunks"]))
    say(f"      {len(docs)} documents, {receipt['tokens']} tokens -> {receipt['chunks']} chunks, "
        f"{receipt['bytes'] / 2**20:.1f} MiB of KV; prefill {receipt['prefill_s']:.1f} s (paid once); "
        f"placed on {len(receipt['placement'])} edges x {replicas} replicas")
    say("      text: U.S. National Archives and Library of Congress transcriptions, public domain "
        "(kdn/data/SOURCES.md)")
    return client, model, receipt


def _ask_every_region(network, questions_per_region, max_new_tokens) -> list:
    """Answers (dicts) of a worker task on each region's node, its first one checked."""
    import ray
    from kdn.cli.knowledge import bundled_questions
    qs = bundled_questions()
    worker = ray.remote(num_cpus=1)(_region_worker)
    results = []
    for i, region in enumerate(REGIONS):
        mine = [qs[(i * questions_per_region + j) % len(qs)] for j in range(questions_per_region)]
        reg, answers = ray.get(worker.options(label_selector={"region": region})
                               .remote(network, KB, mine, max_new_tokens), timeout=900)
        results += [dict(a, region=reg) for a in answers]
    return results


def _vllm_worker(network, questions_per_region, max_new_tokens, say) -> list:
    """Answers of a vLLM worker (kdn.engines) in eu-west, in _report's row format."""
    from kdn.engines.vllm.run import demo_answers
    from kdn.cli.knowledge import bundled_documents, bundled_questions
    qs = bundled_questions()[:questions_per_region]
    rows = demo_answers(network, "eu-west", KB + "-vllm", bundled_documents(), qs,
                        max_new_tokens=max_new_tokens)
    say(f"      vLLM answered {len(rows)} questions; first answer identical to vLLM's own full "
        f"prefill: {'yes' if rows and rows[0].get('identical') else 'NO'}")
    return [dict(r, region=r["region"] + " (vLLM)") for r in rows]


def _report(results, say, out) -> None:
    """The results table and every answer."""
    from kdn.cli.table import table
    rows = []
    for a in results:
        base = a["baseline_ttft_s"]
        rows.append({
            "region": a["region"], "edge": a["edge"], "question": a["question"][:44],
            "cached/prompt": f"{a['cached_tokens']}/{a['prompt_tokens']}",
            "TTFT KDN ms": round(a["ttft_s"] * 1000),
            "TTFT full ms": "" if base is None else round(base * 1000),
            "speedup": "" if base is None else f"{base / a['ttft_s']:.1f}x",
            "chunks from": ", ".join(f"{k} {v}" for k, v in sorted(a["sources"].items())),
            "MiB moved": f"{a['bytes_moved'] / 2**20:.1f}",
            "identical": "" if a["identical"] is None else ("yes" if a["identical"] else "NO"),
        })
    table(rows, file=out)
    say("")
    for a in results:
        say(f"  [{a['region']}] Q: {a['question']}\n             A: {a['text'][:160]}")


def _savings(client, model, results, say) -> dict:
    """What KDN saved, and a re-publish of the unchanged KB (nothing prefilled or sent)."""
    from kdn.cli.knowledge import bundled_documents
    from kdn.client.publish import publish_documents
    from kdn.core.names import SOURCE_KINDS
    from kdn.engines.transformers.worker import compared
    full = float(np.median([a["baseline_ttft_s"] for a in results if a["baseline_ttft_s"]]))
    kdn = float(np.median([a["ttft_s"] for a in results]))
    again = publish_documents(client, model, KB, bundled_documents())
    served = {k: sum(e.get("counters", {}).get(f"served_{k}", 0) for e in client.status()["edges"])
              for k in SOURCE_KINDS}
    computed = int(np.median([a["prompt_tokens"] - a["cached_tokens"] for a in results]))
    same = [a["identical"] for a in results if a["identical"] is not None]
    say("\nWhat KDN saved")
    say(f"  time to first token: {kdn * 1000:.0f} ms with KDN vs {full * 1000:.0f} ms with a full prefill "
        f"(medians, both sides warm): {compared(kdn, full)}")
    say(f"  prefill compute: {len(results)} answers each prefilled ~{computed} "
        f"question tokens instead of ~{results[0]['prompt_tokens']}: about {len(results) * (full - kdn):.0f} s of "
        f"CPU prefill saved in this run alone")
    say(f"  exactness: {sum(same)}/{len(same)} checked answers token-identical to a plain full prefill")
    say(f"  chunks served by edges: {served['local']} from the local edge's memory, {served['disk']} from "
        f"its disk, {served['peer']} from a peer, {served['origin']} from the origin")
    say(f"  re-publishing the unchanged KB: {again['prefilled_tokens']} tokens prefilled, "
        f"{again['sent_chunks']} chunks sent, version still v{again['version']}")
    return {"republish": again, "speedup": full / kdn}


def _http_check(net, client, model) -> str:
    from kdn.client.http import HTTPEdges
    from kdn.client.reader import Reader
    edge = net.topology.edges_in("eu-west")[0]
    url = client.view.at(edge, 30).ping()["http"]
    m = client.manifest(KB)
    prompt = m.token_ids().tolist() + model.question_tokens("What does the Eighth Amendment forbid?")
    edges = HTTPEdges([url])
    t0 = time.perf_counter()
    got = Reader(edges, client.tenant, client.fingerprint).fetch(prompt, kb=KB)
    dt = time.perf_counter() - t0
    ray_got = client.fetch(prompt, kb=KB)
    same = got.tokens == ray_got.tokens and all(
        np.array_equal(a.kv, b.kv) for a, b in zip(got.chunks, ray_got.chunks))
    edges.close()
    return (f"GET {url}/v1/fetch: {got.tokens} tokens, {got.nbytes / 2**20:.1f} MiB in {dt * 1000:.0f} ms, "
            f"checksums verified, {'byte-identical to' if same else 'DIFFERENT FROM'} the Ray path")
