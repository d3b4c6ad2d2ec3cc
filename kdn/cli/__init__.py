"""The `kdn` command: launch and stop a network, publish and query knowledge, benchmarks.

Each subcommand is a thin shell over the Python API. An error KDN raises on purpose
(KDNError, wherever in the network it was raised) prints one line naming the problem and
exits with status 2; an unexpected error inside a KDN node prints one line too (status 1).
No traceback and no terminal escape sequence from a remote message reaches the terminal.
"""
import argparse
import importlib
import re
import sys

from kdn.core.errors import KDNError
from kdn.engines.base import ENGINES

# CSI/OSC escape sequences, then any other control character (newlines included)
_ESCAPES = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)?|[@-Z\\-_])|[\x00-\x1f\x7f-\x9f]+")
MAX_ERROR_CHARS = 2000


def _bench(args, rest):
    from kdn.bench import NAMES
    if args.name not in NAMES:
        raise KDNError(f"unknown benchmark {args.name!r}; choose one of: {', '.join(NAMES)}")
    mod = importlib.import_module(f"kdn.bench.{args.name}")
    return mod.main(rest) or 0


def _connect(args, **kw):
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
        return _deploy_service(state["network"], {})
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


def _gib(n):
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def status_rows(st: dict) -> list:
    """One row per edge: the table `kdn status` prints; per tier (main, hot, and disk where
    the edge has one) its chunks, bytes and hits, and the disk's write-backs."""
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
            "bytes": _gib(e["main"]["bytes"] + e["hot"]["bytes"]),
            **{f"{t}": f"{e[t]['items']} / {_gib(e[t]['bytes'])}" for t in ("main", "hot")},
            **{f"{t} hits": e[t].get("hits", 0) for t in ("main", "hot")},
            "KV held": _gib(e.get("held_raw_bytes", e["main"]["bytes"] + e["hot"]["bytes"])),
            "hot copies": e["hot_copies"],
            "fetches": c.get("fetches", 0),
            "local %": f"{100 * c.get('served_local', 0) / served:.0f}",
            "disk %": f"{100 * c.get('served_disk', 0) / served:.0f}",
            "peer %": f"{100 * c.get('served_peer', 0) / served:.0f}",
            "origin %": f"{100 * c.get('served_origin', 0) / served:.0f}",
            "served": _gib(c.get("bytes_served", 0)),
            "sent": _gib(c.get("wire_bytes", 0)),
        })
        if e.get("conversations"):     # the conversation tier: chunks, bytes, tenants, hits, expiries
            cv = e["conversations"]
            rows[-1].update({"conversations": f"{cv['chunks']} / {_gib(cv['bytes'])}"
                             + (f" + {_gib(cv['disk_bytes'])} disk" if cv.get("disk_bytes") else ""),
                             "conv tenants": len(cv["tenant_bytes"]), "conv hits": cv.get("conv_hits", 0),
                             "conv expired": cv.get("conv_expired", 0)})
        if e.get("disk"):      # an edge with a disk tier: its bytes, items, hits, write-backs
            d = e["disk"]
            rows[-1].update({"disk chunks": d["items"], "disk": _gib(d["bytes"]),
                             "disk hits": d["hits"], "write-backs": d["write_backs"],
                             "dropped (full)": d["full_dropped"]})
    return rows


def _status(args, rest):
    from kdn.cli.table import table
    cl = _connect(args)
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
        print(f"origin: up, {s['versions']} KB versions{also}, {s['chunks']} chunks, {_gib(s['bytes'])} "
              f"in {s.get('backend', 'its store')}, {o['members']} edges "
              f"(membership v{o['membership_version']})")
    table(status_rows(st))
    by_tenant = {}
    for e in st["edges"]:
        for t, b in (e.get("conversations") or {}).get("tenant_bytes", {}).items():
            by_tenant[t] = by_tenant.get(t, 0) + b
    if by_tenant:
        print("conversation KV by tenant: " + ", ".join(f"{t} {_gib(b)}" for t, b in sorted(by_tenant.items())))
    print("\n".join(_service_lines(st["service"])))
    return 0 if all(not e.get("down") for e in st["edges"]) and "unreachable" not in o else 1


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
    return _deploy_service(network, opts, args.json)


def _deploy_service(network: str, opts: dict, as_json: bool = False) -> int:
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


def _service_lines(info: dict) -> list:
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
                     + f" ({how}; admits {d.get('max_ongoing_requests')}, queues {d.get('max_queued_requests')})")
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


def _model_fingerprint(engine: str = "transformers"):
    """The fingerprint KV of the model gets with `engine`, from the folder kdn.engines.transformers.model converted,
    without loading the weights (a few seconds less than load_model(), and no warm-up); None
    before the first conversion. Lets a command refuse an unknown KB or a wrong admin token
    before the model loads; whatever loads later is checked against it."""
    from kdn.engines.base import check_engine
    from kdn.engines.fingerprint import fingerprints
    from kdn.engines.transformers import convert
    digest = convert.file_digest(convert.gguf_path())
    folder = convert.cache_root() / "models" / f"{convert.MODEL_NAME}-{digest[:16]}"
    if convert.read_meta(folder, digest) is None:
        return None
    return fingerprints(folder)[check_engine(engine)]


def _publish(args, rest):
    from kdn.client.documents import select_documents
    from kdn.client.publish import progress_bar
    from kdn.core.manifest import check_name
    from kdn.engines.base import context_of, load_engine
    from kdn.engines.transformers.model import load_model
    # what can be refused is refused before the model loads: names, the documents (sizes,
    # binary content, an empty selection), the network and the admin token
    check_name(args.kb, "knowledge base name")
    check_name(args.tenant, "tenant")
    selection = select_documents(args.paths, args.include, args.exclude)
    print(f"documents: {selection.summary()}, named relative to {selection.root}")
    from kdn.core.emphasis import check_weights, parse_weights
    emphasis = check_weights(parse_weights(args.emphasis), [n for n, _ in selection.documents])
    if emphasis and args.engine == "vllm":
        raise KDNError("--emphasis is served by the transformers engine only")
    fingerprint = _model_fingerprint(args.engine)
    if fingerprint is not None:
        _connect(args, tenant=args.tenant, fingerprint=fingerprint).publisher.check_access()
    # the KB's length is checked with the model's tokenizer before a slow engine starts
    model = load_model(warm=args.engine == "transformers")
    _check_length(args, model, selection.documents, *context_of(args.engine, model))
    cl = _connect(args, tenant=args.tenant, fingerprint=fingerprint or model.fingerprint)
    engine = load_engine(args.engine, model, "kv_both", **_connector_settings(args, cl, admin=True))
    if engine.fingerprint != cl.publisher.fingerprint:
        cl = _connect(args, tenant=args.tenant, fingerprint=engine.fingerprint)
    r = engine.publish(cl, args.kb, selection.documents, progress=progress_bar())
    state = "unchanged, no new version" if r.get("unchanged") else "committed"
    size = f" ({r['bytes'] / 2**20:.1f} MiB of KV)" if "bytes" in r else ""
    took = f" in {r['prefill_s']:.1f} s" if "prefill_s" in r else ""
    sent = f"; sent {r['sent_chunks']} chunks" if "sent_chunks" in r else ""
    print(f"{r['tenant']}/{r['kb']} v{r['version']} {state}: {r['tokens']} tokens in {r['chunks']} chunks"
          f"{size}; prefilled {r['prefilled_tokens']} tokens{took} with {engine.name}, reused "
          f"{r['reused_tokens']} from the network{sent}")
    if r.get("placement"):
        print("placement: " + ", ".join(f"{e} {n}" for e, n in sorted(r["placement"].items())))
    if emphasis:                   # the operator marks documents: the KB's emphasis override
        cl.set_emphasis(args.kb, emphasis)
    from kdn.core.emphasis import override_of
    weights = emphasis or override_of(cl.manifest(args.kb, r["version"]))
    if weights and (emphasis or not r.get("unchanged")):
        _store_emphasis(cl, model, args.kb, weights, r["version"])
    return 0


def _store_emphasis(cl, model, kb: str, weights: dict, version: int = None) -> None:
    """Store the edit `weights` of a KB version in the network (kdn.engines.emphasized), so
    readers fetch its edited chunks instead of editing the KB's KV themselves."""
    from kdn.engines.emphasized import publish_emphasis
    e = publish_emphasis(cl, model, kb, weights, version)
    print(f"emphasis {e['weights']} on v{e['of_version']}: {e['extra_tokens']} duplicated KV entries; the "
          f"first {e['kb_chunks']} chunks are the KB's own, sent {e['sent_chunks']} edited chunks "
          f"({e['sent_bytes'] / 2**20:.1f} MiB), exact=False")


def _emphasize(args, rest):
    """Set (or clear) a published KB's emphasis override and store its edited chunks."""
    from kdn.core.emphasis import MAX_EMPHASIS, parse_weights
    from kdn.core.manifest import check_name
    check_name(args.kb, "knowledge base name")
    check_name(args.tenant, "tenant")
    if bool(args.weights) == args.clear:
        raise KDNError(f"name the weights (DOC=K, K an integer in [1, {MAX_EMPHASIS}]; 1: no emphasis) "
                       "or --clear" + (", not both" if args.clear else ""))
    weights = parse_weights(args.weights)            # each K an integer in [1, MAX_EMPHASIS]
    cl = _connect(args, tenant=args.tenant, fingerprint=_model_fingerprint("transformers"))
    # checked there against the KB's documents (a weight of 1 too); all 1s clear it as --clear does
    r = cl.set_emphasis(args.kb, weights)
    now = r["override"].get("emphasis", {})
    print(f"{args.tenant}/{args.kb}: emphasis " + (f"{now}: answers attend more to these documents "
          "unless a request names its own (extra_body emphasis; {} for the exact KV)" if now
          else "cleared: answers use the exact KV"))
    if now:
        from kdn.engines.transformers.model import load_model
        model = load_model(warm=False)
        if cl.fingerprint != model.fingerprint:
            cl = _connect(args, tenant=args.tenant, fingerprint=model.fingerprint)
        _store_emphasis(cl, model, args.kb, now)
    return 0


def _delete(args, rest):
    """Retire one version of a KB (kdn.client.operator: Operator.delete)."""
    from kdn.core.manifest import check_name
    check_name(args.kb, "knowledge base name")
    check_name(args.tenant, "tenant")
    r = _connect(args, tenant=args.tenant, fingerprint=args.fingerprint).delete(args.kb, args.version)
    copies = r.get("emphasized_copies", 0)
    also = f" with its {copies} emphasized cop{'y' if copies == 1 else 'ies'}" if copies else ""
    print(f"{args.tenant}/{r['deleted']} retired{also}: its chunks no other version names go at the next "
          f"`kdn collect`")
    return 0


def _collect(args, rest):
    """Delete the origin's unreferenced chunks (kdn.client.operator: Operator.collect)."""
    from kdn.core.checks import check_number
    ttl = None if args.object_ttl is None else check_number(args.object_ttl, "--object-ttl", 0)
    r = _connect(args).collect(object_ttl_s=ttl)
    print(f"collected {r['chunks']} chunks ({r['bytes'] / 2**20:.1f} MiB); other layers' objects: "
          f"{r['objects_kept']} kept, {r['objects_expired']} expired; edges drop their copies as "
          f"they replay the origin's drop log (within a second or two)")
    return 0


def _conversations(args, rest):
    """A tenant's conversation KV on every edge: list it, set its TTL and budget, or drop it."""
    from kdn.cli.table import table
    from kdn.core.manifest import check_name
    from kdn.launch.cluster import parse_size
    check_name(args.tenant, "tenant")
    budget = None if args.budget is None else parse_size(args.budget, "--budget")
    cl = _connect(args, tenant=args.tenant)
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
                     "chunks": sum(c["chunks"] for c in convs), "bytes": _gib(sum(c["bytes"] for c in convs)),
                     "on disk": _gib(sum(c.get("on_disk", 0) for c in convs)),
                     "idle TTL s": f"{p['ttl_s']:g}", "max TTL s": f"{p['max_ttl_s']:g}",
                     "budget": _gib(p["budget_bytes"])})
    print(f"conversation KV of tenant {args.tenant!r}:")
    table(rows)
    if at_origin["pinned"] or at_origin["chunks"]:
        print(f"pinned at the origin: {'yes' if at_origin['pinned'] else 'no'}, "
              f"{sum(at_origin['chunks'].values())} chunks in {len(at_origin['chunks'])} namespaces")
    return 0 if all(not e.get("down") for e in got) else 1


def _connector_settings(args, client, admin: bool = False) -> dict:
    """What an engine with KDN's connector needs to reach this network (vLLM)."""
    import os
    from kdn.core.auth import load_admin_token
    settings = {"network": client.network, "region": client.region, "tenant": args.tenant,
                "token": os.environ.get("KDN_TOKEN")}
    if admin:
        settings["admin_token"] = os.environ.get("KDN_ADMIN_TOKEN") or load_admin_token()
    return settings


def _check_length(args, model, documents, context: int = None,
                  context_name: str = "max_position_embeddings") -> int:
    """The KB's tokens; BadRequest before any prefill when they exceed the origin's limit or
    the engine's context (kdn.client.documents.check_kb_tokens), a warning when they nearly
    fill it. --allow-over-context overrides the model's context only (vLLM's is a hard limit)."""
    from kdn.client.documents import check_kb_tokens, join_documents
    tokens = len(model.knowledge_tokens(join_documents(documents)[0]))
    override = "--allow-over-context" if context_name == "max_position_embeddings" else None
    warning = check_kb_tokens(args.kb, tokens, context, allow_over_context=args.allow_over_context and bool(override),
                              flag=override, context_name=context_name)
    if warning:
        print(warning, file=sys.stderr)
    return tokens


def _check_query_args(args) -> list:
    """The codecs --accept names (None: the lossless ones); BadRequest for a bad argument."""
    from kdn.core.errors import BadRequest
    from kdn.core.manifest import check_name
    from kdn.core.transfer import check_accept
    check_name(args.kb, "knowledge base name")
    check_name(args.tenant, "tenant")
    if not args.question.strip():
        raise BadRequest("the question is empty")
    if args.max_new_tokens < 1:
        raise BadRequest(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    accept = [c for c in (args.accept or "").split(",") if c] or None
    if accept is not None:
        check_accept(accept)
    return accept


def _query(args, rest):
    from kdn.engines.base import load_engine
    from kdn.engines.transformers.model import load_model
    from kdn.engines.transformers.worker import compared
    # bad arguments, an unknown region and an unknown KB fail before the model loads
    accept = _check_query_args(args)
    fingerprint = _model_fingerprint(args.engine)
    cl = None
    if fingerprint is not None:
        cl = _connect(args, tenant=args.tenant, fingerprint=fingerprint, region=args.region, accept=accept)
        cl.manifest(args.kb)                 # ManifestError naming the KB when there is none
    model = load_model(warm=args.engine == "transformers")
    if cl is None:
        cl = _connect(args, tenant=args.tenant, fingerprint=model.fingerprint, region=args.region,
                      accept=accept)
    engine = load_engine(args.engine, model, "kv_consumer", **_connector_settings(args, cl))
    if cl.reader.fingerprint != engine.fingerprint:
        cl = _connect(args, tenant=args.tenant, fingerprint=engine.fingerprint, region=args.region,
                      accept=accept)
    a = engine.answer(cl, args.kb, args.question, max_new_tokens=args.max_new_tokens, check=args.check)
    print(a.text)
    from kdn.core.emphasis import override_of
    if override_of(cl.manifest(args.kb)):
        print(f"note: {args.kb} has an emphasis override {override_of(cl.manifest(args.kb))}; `kdn query` "
              "answers over its exact KV, `kdn serve` applies the override", file=sys.stderr)
    src = ", ".join(f"{k} {v}" for k, v in sorted(a.sources.items())) or "none"
    lossy = "" if a.exact else ", LOSSY codec accepted"
    print(f"\n[{cl.region} via {a.edge}, {engine.name}] {a.cached_tokens}/{a.prompt_tokens} prompt tokens "
          f"from KDN (chunks: {src}; {a.bytes_moved / 2**20:.1f} MiB of KV, {a.wire_bytes / 2**20:.1f} MiB "
          f"moved{lossy}); time to first token {a.ttft_s * 1000:.0f} ms", file=sys.stderr)
    if args.check:
        baseline = "a full prefill" if engine.name == "transformers" else f"{engine.name} without it"
        diff = "" if a.max_logit_diff is None else f" (max logit difference {a.max_logit_diff:.2e})"
        print(f"full prefill without KDN: time to first token {a.baseline_ttft_s * 1000:.0f} ms, both "
              f"warm: {compared(a.ttft_s, a.baseline_ttft_s, baseline)}; generated tokens identical: "
              f"{'yes' if a.identical else 'NO'}{diff}", file=sys.stderr)
        return 0 if a.identical else 1
    return 0


def _demo(args, rest):
    from kdn.cli.demo import run
    run(questions_per_region=args.questions, max_new_tokens=args.max_new_tokens, engine=args.engine)
    return 0


def build_parser():
    ap = argparse.ArgumentParser(prog="kdn", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for add in (_up_args, _down_args, _status_args, _serve_args, _publish_args, _emphasize_args, _query_args,
                _delete_args, _collect_args, _conversations_args, _demo_args, _bench_args):
        add(sub)
    return ap


def _network_args(p):
    """Where the network is: the one `kdn up` recorded, unless told."""
    p.add_argument("--address", help="the Ray cluster's address (default: the recorded one)")
    p.add_argument("--network", help="the network's name (default: the recorded one)")


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
    _network_args(s)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)


def _serve_args(sub):
    s = sub.add_parser("serve", help="serve the network's KBs through an OpenAI-compatible API "
                                     "(Ray Serve, one deployment per region), or stop it (--down)")
    _network_args(s)
    s.add_argument("--down", action="store_true", help="stop the service (the network keeps running)")
    s.add_argument("--config", help="TOML with regions, port, min_replicas, max_replicas, "
                                    "target_ongoing_requests, replica_cpus, max_ongoing_requests, "
                                    "max_queued_requests, engine, routers (flags given override it)")
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
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_serve)


def _publish_args(sub):
    p = sub.add_parser("publish", help="prefill text files and folders (prose, code, data) with the model "
                                       "and publish them as a KB")
    p.add_argument("kb", help="knowledge-base name")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="UTF-8 text files and folders, in order; a folder is walked recursively in "
                        "sorted order (hidden entries, __pycache__ and node_modules skipped; binary and "
                        "empty files skipped and counted); documents are named by their paths relative "
                        "to the folder (or to the folder holding all the files named)")
    p.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="publish only the files of folders matching GLOB (repeatable; e.g. '*.py'; a "
                        "glob without '/' also matches any file or folder name at any depth)")
    p.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="leave out files and folders matching GLOB (repeatable; e.g. 'tests/*', 'tests')")
    p.add_argument("--allow-over-context", action="store_true",
                   help="publish even a KB longer than the model's context (refused by default: no "
                        "prompt can use it whole)")
    p.add_argument("--tenant", default="default")
    p.add_argument("--engine", choices=ENGINES, default="transformers",
                   help="which engine prefills the KB (vLLM's KV gets its own fingerprint)")
    p.add_argument("--emphasis", action="append", default=[], metavar="DOC=K",
                   help="mark document DOC with weight K (an integer in [1, 16]): answers over the KB attend "
                        "K times more to it (the KB's emphasis override, as `kdn emphasize` sets; "
                        "its edited KV is stored under its own keys, flagged inexact); repeatable")
    _network_args(p)
    p.set_defaults(func=_publish)


def _emphasize_args(sub):
    e = sub.add_parser("emphasize", help="set a published KB's emphasis: answers attend more to "
                                         "the documents named (an operator override, like pin/TTL)")
    e.add_argument("kb", help="knowledge-base name")
    e.add_argument("weights", nargs="*", metavar="DOC=K",
                   help="document DOC of the KB gets weight K (an integer in [1, 16], ASCII digits: "
                        "+log K on its attention logits; 1: none); requests override it with "
                        "extra_body emphasis")
    e.add_argument("--clear", action="store_true", help="remove the KB's emphasis (exact KV again)")
    e.add_argument("--tenant", default="default")
    _network_args(e)
    e.set_defaults(func=_emphasize)


def _delete_args(sub):
    d = sub.add_parser("delete", help="retire one version of a KB (its chunks go at the next `kdn collect`)")
    d.add_argument("kb", help="knowledge-base name")
    d.add_argument("version", type=int, help="the version to retire (`kdn status --json` lists them)")
    d.add_argument("--tenant", default="default")
    d.add_argument("--fingerprint", default=None,
                   help="the model's fingerprint, where several models published this version")
    _network_args(d)
    d.set_defaults(func=_delete)


def _collect_args(sub):
    c = sub.add_parser("collect", help="delete the origin's chunks no version names; edges drop "
                                       "their copies as they replay the origin's drop log")
    c.add_argument("--object-ttl", type=float, default=None, metavar="SECONDS",
                   help="also delete other cache layers' objects (LMCache's, SGLang's) written "
                        "more than SECONDS ago (default: keep them all)")
    _network_args(c)
    c.set_defaults(func=_collect)


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
    _network_args(c)
    c.set_defaults(func=_conversations)


def _query_args(sub):
    q = sub.add_parser("query", help="answer a question over a KB with KV from the nearest edge")
    q.add_argument("kb")
    q.add_argument("question")
    q.add_argument("--region", help="the worker's region (default: its Ray node's label)")
    q.add_argument("--tenant", default="default")
    q.add_argument("--accept", help="codecs this worker takes over a slow link, comma-separated "
                                    "(default: the lossless ones; e.g. zstd,q8z to allow lossy q8z)")
    q.add_argument("--max-new-tokens", type=int, default=64)
    q.add_argument("--engine", choices=ENGINES, default="transformers",
                   help="answer with KDN's transformers worker or with vLLM and its KDN connector")
    q.add_argument("--check", action="store_true",
                   help="also run a plain full prefill; exit 1 unless the generated tokens are identical")
    _network_args(q)
    q.set_defaults(func=_query)


def _demo_args(sub):
    dm = sub.add_parser("demo", help="start a local 3-region network, publish, query from every region, report")
    dm.add_argument("--questions", type=int, default=2, help="questions per region")
    dm.add_argument("--max-new-tokens", type=int, default=24)
    dm.add_argument("--engine", choices=ENGINES, default="transformers",
                    help="vllm: also a vLLM worker with the KDN connector, beside the transformers ones")
    dm.set_defaults(func=_demo)


def _bench_args(sub):
    b = sub.add_parser("bench", help="run a benchmark (kdn bench NAME --help)", add_help=False)
    b.add_argument("name")
    b.set_defaults(func=_bench, passthrough=True)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args, rest = ap.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest)
    except KDNError as e:
        print(f"kdn: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except _ray_errors() as e:       # a bug in a node: its message, not Ray's remote traceback
        cause = getattr(e, "cause", None) or e
        print(f"kdn: error: unexpected {type(cause).__name__} in a KDN node: "
              f"{one_line(str(cause))}", file=sys.stderr)
        return 1


def one_line(message: str) -> str:
    """message as one printable line: escape sequences and control characters removed
    (a remote message must not drive the user's terminal), bounded in length."""
    text = " ".join(_ESCAPES.sub(" ", message).split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " ..."


def _ray_errors() -> tuple:
    """Ray's error base when Ray is loaded (a command that never imported it raises none)."""
    ray = sys.modules.get("ray")
    return (ray.exceptions.RayError,) if ray is not None else ()
