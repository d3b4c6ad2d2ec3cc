"""`kdn publish`, `query`, `emphasize`, `delete` and `collect`: knowledge bases in the network."""
import sys

from kdn.cli.common import network_args, network_client
from kdn.core.errors import KDNError
from kdn.engines.base import ENGINES

# kdn.engines.transformers.variant.RECIPES' names (named here: parsing never imports torch)
VARIANTS = ("founding-docs", "founding-docs-light", "founding-docs-upper")


def _model_folder(variant=None):
    """The folder kdn.engines.transformers.convert converted the model into (or the variant's
    folder); None before the first conversion."""
    from kdn.engines.transformers import convert
    if variant is not None:
        return variant
    digest = convert.file_digest(convert.gguf_path())
    folder = convert.cache_root() / "models" / f"{convert.MODEL_NAME}-{digest[:16]}"
    return None if convert.read_meta(folder, digest) is None else folder


def _model_fingerprint(engine: str = "transformers", variant=None):
    """The fingerprint KV of the model gets with `engine`, from its folder (_model_folder),
    without loading the weights (a few seconds less than load_model(), and no warm-up); None
    before the first conversion. Lets a command refuse an unknown KB or a wrong admin token
    before the model loads; whatever loads later is checked against it."""
    from kdn.engines.base import check_engine
    from kdn.engines.fingerprint import fingerprints
    folder = _model_folder(variant)
    return None if folder is None else fingerprints(folder)[check_engine(engine)]


def _variant(args):
    """The folder of the variant --variant names (already built), or None; BadRequest where
    the engine cannot load a variant."""
    from kdn.core.errors import BadRequest
    if args.variant is None:
        return None
    if args.engine != "transformers":
        raise BadRequest("--variant is served by the transformers engine only")
    from kdn.engines.transformers import variant
    return variant.built(args.variant)


def _plan(reader_folder, sender_fingerprint: str):
    """The recompute plan stored for the pair (`kdn model plan`), or ModelError saying how to
    make one."""
    from kdn.engines.family import load_plan
    from kdn.engines.transformers import variant
    return load_plan(variant.plans_root(), _model_fingerprint("transformers", reader_folder), sender_fingerprint)


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
    if args.hidden_for and args.engine != "transformers":
        raise KDNError("--hidden-for is served by the transformers engine only")
    folder = _variant(args)
    fingerprint = _model_fingerprint(args.engine, folder)
    plans = [_plan(_hidden_reader(name), fingerprint) for name in args.hidden_for] if fingerprint else []
    checked = False                # the KB's length against the model's context
    if fingerprint is not None:
        cl = network_client(args, tenant=args.tenant, fingerprint=fingerprint)
        cl.publisher.check_access()
        if args.engine == "transformers" and not plans and not emphasis:
            # an unchanged KB (the origin holds every chunk) commits with the tokenizer alone
            from kdn.client.publish import publish_if_held
            from kdn.engines.transformers.prompts import Text
            text = Text(_model_folder(folder), "transformers")
            _check_length(args, text, selection.documents, *context_of(args.engine, text))
            checked = True
            r = publish_if_held(cl, text, args.kb, selection.documents, progress=progress_bar())
            if r is not None:
                _print_receipt(r, "transformers")
                from kdn.core.emphasis import override_of     # a KB's override on a new version
                weights = override_of(cl.manifest(args.kb, r["version"]))
                if weights and not r.get("unchanged"):
                    _store_emphasis(cl, load_model(variant=folder), args.kb, weights, r["version"])
                return 0
    # the KB's length is checked with the model's tokenizer before a slow engine starts
    model = load_model(warm=args.engine == "transformers", variant=folder)
    if not plans and args.hidden_for:          # the model converted just now: the plans' sender known
        plans = [_plan(_hidden_reader(name), model.fingerprint) for name in args.hidden_for]
    if not checked:
        _check_length(args, model, selection.documents, *context_of(args.engine, model))
    cl = network_client(args, tenant=args.tenant, fingerprint=fingerprint or model.fingerprint)
    engine = load_engine(args.engine, model, "kv_both", **_connector_settings(args, cl, admin=True))
    if engine.fingerprint != cl.publisher.fingerprint:
        cl = network_client(args, tenant=args.tenant, fingerprint=engine.fingerprint)
    r = engine.publish(cl, args.kb, selection.documents, progress=progress_bar())
    _print_receipt(r, engine.name)
    if plans:
        _publish_hidden(cl, model, args.kb, selection.documents, args.hidden_for, plans)
    if emphasis:                   # the operator marks documents: the KB's emphasis override
        cl.set_emphasis(args.kb, emphasis)
    from kdn.core.emphasis import override_of
    weights = emphasis or override_of(cl.manifest(args.kb, r["version"]))
    if weights and (emphasis or not r.get("unchanged")):
        _store_emphasis(cl, model, args.kb, weights, r["version"])
    return 0


def _print_receipt(r: dict, engine: str) -> None:
    state = "unchanged, no new version" if r.get("unchanged") else "committed"
    size = f" ({r['bytes'] / 2**20:.1f} MiB of KV)" if "bytes" in r else ""
    took = f" in {r['prefill_s']:.1f} s" if "prefill_s" in r else ""
    sent = f"; sent {r['sent_chunks']} chunks" if "sent_chunks" in r else ""
    if "fetched_bytes" in r:       # KV read back to continue from (an unchanged KB: none)
        sent += f", fetched {r['fetched_bytes'] / 2**20:.1f} MiB"
    print(f"{r['tenant']}/{r['kb']} v{r['version']} {state}: {r['tokens']} tokens in {r['chunks']} chunks"
          f"{size}; prefilled {r['prefilled_tokens']} tokens{took} with {engine}, reused "
          f"{r['reused_tokens']} from the network{sent}")
    if r.get("placement"):
        print("placement: " + ", ".join(f"{e} {n}" for e, n in sorted(r["placement"].items())))


def _hidden_reader(name: str):
    """The folder of the variant --hidden-for names (already built)."""
    from kdn.engines.transformers import variant
    return variant.built(name)


def _publish_hidden(cl, model, kb: str, documents, names, plans) -> None:
    """Store the hidden states each variant's plan recomputes from, beside the KB's KV (one
    namespace per layer; layers two plans share are stored once)."""
    from kdn.engines.transformers.crossmodel import publish_hidden
    layers = sorted({p.start for p in plans})
    h = publish_hidden(cl, model, kb, documents, layers)
    for name, p in zip(names, plans):
        print(f"hidden states entering layer {p.start} stored for {name} (its plan recomputes layers "
              f"{p.start}-{p.end} of {p.layers}): a reader of that variant may opt in to this KV "
              f"(`kdn query --variant {name} --cross-model`)")
    print(f"hidden states: {h['tokens']} tokens at layers {layers}, {h['bytes'] / 2**20:.1f} MiB")


def _store_emphasis(cl, model, kb: str, weights: dict, version: int = None) -> None:
    """Store the edit `weights` of a KB version in the network (kdn.engines.emphasis_variants), so
    readers fetch its edited chunks instead of editing the KB's KV themselves."""
    from kdn.engines.emphasis_variants import publish_emphasis
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
    cl = network_client(args, tenant=args.tenant, fingerprint=_model_fingerprint("transformers"))
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
            cl = network_client(args, tenant=args.tenant, fingerprint=model.fingerprint)
        _store_emphasis(cl, model, args.kb, now)
    return 0


def _delete(args, rest):
    """Retire one version of a KB (kdn.client.operator: Operator.delete)."""
    from kdn.core.manifest import check_name
    check_name(args.kb, "knowledge base name")
    check_name(args.tenant, "tenant")
    r = network_client(args, tenant=args.tenant, fingerprint=args.fingerprint).delete(args.kb, args.version)
    copies = r.get("emphasized_copies", 0)
    also = f" with its {copies} emphasized cop{'y' if copies == 1 else 'ies'}" if copies else ""
    print(f"{args.tenant}/{r['deleted']} retired{also}: its chunks no other version names go at the next "
          f"`kdn collect`")
    return 0


def _collect(args, rest):
    """Delete the origin's unreferenced chunks (kdn.client.operator: Operator.collect)."""
    from kdn.core.checks import check_number
    ttl = None if args.object_ttl is None else check_number(args.object_ttl, "--object-ttl", 0)
    r = network_client(args).collect(object_ttl_s=ttl)
    print(f"collected {r['chunks']} chunks ({r['bytes'] / 2**20:.1f} MiB); other layers' objects: "
          f"{r['objects_kept']} kept, {r['objects_expired']} expired; edges drop their copies as "
          f"they replay the origin's drop log (within a second or two)")
    return 0


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
    # bad arguments, an unknown region and an unknown KB fail before the model loads
    accept = _check_query_args(args)
    folder = _variant(args)
    if args.cross_model:
        return _query_across(args, folder, accept)
    fingerprint = _model_fingerprint(args.engine, folder)
    cl = None
    if fingerprint is not None:
        cl = network_client(args, tenant=args.tenant, fingerprint=fingerprint, region=args.region, accept=accept)
        cl.manifest(args.kb)                 # ManifestError naming the KB when there is none
    model = load_model(warm=args.engine == "transformers", variant=folder)
    if cl is None:
        cl = network_client(args, tenant=args.tenant, fingerprint=model.fingerprint, region=args.region,
                      accept=accept)
    engine = load_engine(args.engine, model, "kv_consumer", **_connector_settings(args, cl))
    if cl.reader.fingerprint != engine.fingerprint:
        cl = network_client(args, tenant=args.tenant, fingerprint=engine.fingerprint, region=args.region,
                      accept=accept)
    a = engine.answer(cl, args.kb, args.question, max_new_tokens=args.max_new_tokens, check=args.check)
    print(a.text)
    from kdn.core.emphasis import override_of
    if override_of(cl.manifest(args.kb)):
        print(f"note: {args.kb} has an emphasis override {override_of(cl.manifest(args.kb))}; `kdn query` "
              "answers over its exact KV, `kdn serve` applies the override", file=sys.stderr)
    return _report(args, cl, engine.name, a)


def _report(args, cl, engine: str, a, across: str = "") -> int:
    """The answer's line on stderr (where its KV came from, how fast), and --check's verdict."""
    from kdn.engines.transformers.worker import compared
    src = ", ".join(f"{k} {v}" for k, v in sorted(a.sources.items())) or "none"
    lossy = "" if a.exact or across else ", LOSSY codec accepted"
    print(f"\n[{cl.region} via {a.edge}, {engine}] {a.cached_tokens}/{a.prompt_tokens} prompt tokens "
          f"from KDN{across} (chunks: {src}; {a.bytes_moved / 2**20:.1f} MiB of KV, {a.wire_bytes / 2**20:.1f} MiB "
          f"moved{lossy}); time to first token {a.ttft_s * 1000:.0f} ms", file=sys.stderr)
    if args.check:
        baseline = "a full prefill" if engine == "transformers" else f"{engine} without it"
        diff = "" if a.max_logit_diff is None else f" (max logit difference {a.max_logit_diff:.2e})"
        print(f"full prefill without KDN: time to first token {a.baseline_ttft_s * 1000:.0f} ms, both "
              f"warm: {compared(a.ttft_s, a.baseline_ttft_s, baseline)}; generated tokens identical: "
              f"{'yes' if a.identical else 'NO'}{diff}", file=sys.stderr)
        return 0 if a.identical else 1
    return 0


def _query_across(args, folder, accept) -> int:
    """--cross-model: the variant answers over the base model's KV of the KB, recomputing the
    layers of the pair's stored plan (kdn.engines.transformers.crossmodel.CrossReader); the
    answer is never exact and says so."""
    from kdn.core.errors import BadRequest
    from kdn.engines.transformers.crossmodel import CrossReader
    from kdn.engines.transformers.model import load_model
    if folder is None:
        raise BadRequest("--cross-model reads the base model's KV for a fine-tuned variant: name the "
                         "reader with --variant")
    if accept is not None:
        raise BadRequest("--cross-model reads the sender's exact KV: --accept does not apply")
    sender = _model_fingerprint("transformers")
    if sender is None:
        raise KDNError("the base model is not converted here: publish a KB with it first")
    plan = _plan(folder, sender)                     # ModelError: `kdn model plan` makes one
    network_client(args, tenant=args.tenant, fingerprint=sender, region=args.region).manifest(args.kb)
    model = load_model(variant=folder)
    cl = network_client(args, tenant=args.tenant, fingerprint=model.fingerprint, region=args.region)
    reader = CrossReader(cl, model, plan)
    try:
        a = reader.answer(args.kb, args.question, max_new_tokens=args.max_new_tokens, check=args.check)
    finally:
        reader.close()
    print(a.text)
    c = a.cross_model
    agree = next((p["agree"] for p in plan.profile if (p["start"], p["end"]) == (plan.start, plan.end)), None)
    chosen = f", {agree:.0%} identical on calibration" if agree is not None else ""
    across = (f" as the base model's KV, CROSS-MODEL (exact=False): layers {c['recompute'][0]}-{c['recompute'][1]} "
              f"of {c['layers']} recomputed by {model.name} (plan {c['plan']}{chosen}"
              + ("; read as kept before" if c["kept"] else f"; {a.extra['hidden_bytes'] / 2**20:.1f} MiB of "
                 "hidden states") + ")")
    return _report(args, cl, "transformers", a, across)


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
    p.add_argument("--variant", choices=VARIANTS, default=None,
                   help="prefill with this fine-tuned variant of the model (`kdn model variant`): its KV "
                        "is published under its own fingerprint")
    p.add_argument("--hidden-for", action="append", default=[], choices=VARIANTS, metavar="VARIANT",
                   help="also store the hidden states VARIANT's recompute plan starts from (`kdn model "
                        "plan`), so its readers may opt in to this KV (`kdn query --variant VARIANT "
                        "--cross-model`); repeatable")
    network_args(p)
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
    network_args(e)
    e.set_defaults(func=_emphasize)


def _delete_args(sub):
    d = sub.add_parser("delete", help="retire one version of a KB (its chunks go at the next `kdn collect`)")
    d.add_argument("kb", help="knowledge-base name")
    d.add_argument("version", type=int, help="the version to retire (`kdn status --json` lists them)")
    d.add_argument("--tenant", default="default")
    d.add_argument("--fingerprint", default=None,
                   help="the model's fingerprint, where several models published this version")
    network_args(d)
    d.set_defaults(func=_delete)


def _collect_args(sub):
    c = sub.add_parser("collect", help="delete the origin's chunks no version names; edges drop "
                                       "their copies as they replay the origin's drop log")
    c.add_argument("--object-ttl", type=float, default=None, metavar="SECONDS",
                   help="also delete other cache layers' objects (LMCache's, SGLang's) written "
                        "more than SECONDS ago (default: keep them all)")
    network_args(c)
    c.set_defaults(func=_collect)


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
    q.add_argument("--variant", choices=VARIANTS, default=None,
                   help="answer with this fine-tuned variant of the model (`kdn model variant`), over "
                        "its own KV of the KB")
    q.add_argument("--cross-model", action="store_true",
                   help="opt in: the --variant answers over the base model's KV of the KB, recomputing "
                        "the layers of the pair's plan (`kdn model plan`) from the hidden states the "
                        "publisher stored (`kdn publish --hidden-for`); never exact, and said so")
    network_args(q)
    q.set_defaults(func=_query)


def add_parsers(sub) -> None:
    """This group's subcommands."""
    _publish_args(sub)
    _emphasize_args(sub)
    _query_args(sub)
    _delete_args(sub)
    _collect_args(sub)
