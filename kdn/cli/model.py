"""`kdn model variant` and `kdn model plan`: the model's family (kdn.engines.transformers.variant, .crossmodel).

`variant` trains the default recipe (a LoRA on every layer, the bundled founding documents, a
fixed seed; minutes on 2 cores) once, and prints the folder, the base and variant fingerprints
and the training's loss; a second run finds the folder and trains nothing. Flags change the
recipe (another recipe is another folder).

`plan` profiles a built variant reading the base model's KV on the calibration split
(crossmodel.calibrate: every plan recomputing whole blocks of layers, asked the calibration
questions over windows of the calibration documents: the bundled ones, or --calibration's) and stores the plan of the fewest
recomputed layers whose greedy answers are the variant's own on at least --target of them,
with its profile, for the pair (kdn.engines.family.save_plan). Readers of that variant may
then opt in to the base model's KV (`kdn query --variant NAME --cross-model`). Where no plan
short of recomputing every layer reaches the target, nothing is stored and the command says
how near the best came (exit 2): the variant prefills itself.
"""
import json
from dataclasses import replace

from kdn.cli.kb import VARIANTS
from kdn.core.errors import KDNError


def _variant(args, rest):
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.fingerprint import fingerprints
    from kdn.engines.transformers.convert import converted_folder
    from kdn.engines.transformers.variant import RECIPES, Recipe, build
    recipe = RECIPES[args.recipe]
    for name in ("steps", "seed", "rank", "lr", "window", "batch"):
        if getattr(args, name) is not None:
            recipe = replace(recipe, **{name: getattr(args, name)})
    if args.name is not None:
        recipe = replace(recipe, name=args.name)
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, flush=True))
    folder, record, trained = build(bundled_documents(), Recipe.check(recipe), log=log)
    base, _, _ = converted_folder()
    out = {"folder": str(folder), "trained_now": trained,
           "base_fingerprint": fingerprints(base)["transformers"],
           "variant_fingerprint": fingerprints(folder)["transformers"],
           "recipe": record["recipe"], "training_tokens": record["training_tokens"],
           "loss_first": record["losses"][0], "loss_last": record["losses"][-1],
           "train_s": record["train_s"]}
    if out["base_fingerprint"] == out["variant_fingerprint"]:
        raise KDNError("the variant's weights are the base model's: nothing was learned")
    if args.json:
        print(json.dumps(out))
    else:
        print(f"variant {record['recipe']['name']} {'trained' if trained else 'already built'}: {folder}")
        print(f"  fingerprint {out['variant_fingerprint']} (base {out['base_fingerprint']})")
        print(f"  {record['recipe']['steps']} steps on {record['training_tokens']} tokens, loss "
              f"{out['loss_first']:.3f} -> {out['loss_last']:.3f}, {record['train_s']} s")
    return 0


def _plan(args, rest):
    from kdn.cli.knowledge import bundled_documents
    from kdn.engines.family import save_plan
    from kdn.engines.transformers import variant
    from kdn.engines.transformers.crossmodel import calibrate
    from kdn.engines.transformers.model import load_model
    if not 0 < args.target <= 1:
        raise KDNError(f"--target must be in (0, 1], got {args.target}")
    docs = bundled_documents()
    folder = variant.built(args.recipe)
    if args.calibration:              # the operator's own texts, all of them
        from kdn.client.documents import select_documents
        docs = select_documents(args.calibration, [], []).documents
        names = {"names": [n for n, _ in docs]}
    else:
        names = {}                    # the bundled calibration split
    log = (lambda msg: None) if args.json else (lambda msg: print(msg, flush=True))
    reader, sender = load_model(variant=folder, log=log), load_model(log=log)
    profile, plan = calibrate(reader, sender, docs, block=args.block, window=args.window, target=args.target,
                              max_new_tokens=args.max_new_tokens, log=log, **names)
    best = max((p for p in profile if p["end"] - p["start"] < reader.layers),
               key=lambda p: (p["agree"], -(p["end"] - p["start"])), default=None)
    out = {"variant": args.recipe, "reader": reader.fingerprint, "sender": sender.fingerprint,
           "target": args.target, "profiled": len(profile), "plan": None, "best": best}
    if plan is not None:
        path = save_plan(plan, variant.plans_root())
        agree = next(p["agree"] for p in profile if (p["start"], p["end"]) == (plan.start, plan.end))
        out.update(plan=plan.describe(), agree=agree, path=str(path))
    if args.json:
        print(json.dumps(out))
    elif plan is not None:
        print(f"plan {plan.name} for {args.recipe} reading the base model's KV: recompute layers "
              f"{plan.start}-{plan.end} of {plan.layers} ({out['agree']:.0%} of "
              f"{next(p['items'] for p in profile)} calibration answers identical to its own); saved to {path}")
    if plan is None:
        from kdn.engines.family import plan_path
        old = plan_path(variant.plans_root(), reader.fingerprint, sender.fingerprint)
        removed = old.exists()
        if removed:                       # an earlier run's plan no longer holds: gone with it
            old.unlink()
        near = (f"; the nearest recomputes layers {best['start']}-{best['end']} and agrees on {best['agree']:.0%}"
                if best else "")
        raise KDNError(f"no plan short of recomputing all {reader.layers} layers keeps {args.target:.0%} of "
                       f"{args.recipe}'s calibration answers identical{near}: no plan stored"
                       f"{' (the earlier one of the pair removed)' if removed else ''}, the variant "
                       f"prefills itself (a lower --target accepts more disagreement)")
    return 0


def add_parsers(sub) -> None:
    """This group's subcommands."""
    m = sub.add_parser("model", help="the model family: build a fine-tuned variant, plan its reads of the "
                                     "base model's KV")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    v = msub.add_parser("variant", help="train the variant once (LoRA on the bundled documents) and "
                                        "print where it is")
    v.add_argument("--recipe", default="founding-docs", choices=VARIANTS,
                   help="the recipe the options below change (default founding-docs: LoRA r16 on every "
                        "projection, 60 steps at 1e-3; -light: r8 on attention, 40 steps at 3e-4; "
                        "-upper: as the default, on layers 21-29 only)")
    v.add_argument("--name", default=None, help="the variant's name (default: the recipe's)")
    v.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    v.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    v.add_argument("--rank", type=int, default=None, help="LoRA rank (default: the recipe's)")
    v.add_argument("--lr", type=float, default=None, help="learning rate (default: the recipe's)")
    v.add_argument("--window", type=int, default=None, help="tokens per training window (default 128)")
    v.add_argument("--batch", type=int, default=None, help="windows per step (default 4)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.set_defaults(func=_variant)
    p = msub.add_parser("plan", help="profile a variant reading the base model's KV on the calibration "
                                     "split and store the recompute plan for the pair")
    p.add_argument("--recipe", default="founding-docs", choices=VARIANTS,
                   help="the variant (built first with `kdn model variant`)")
    p.add_argument("--target", type=float, default=0.95,
                   help="the share of calibration answers the plan must keep identical to the variant's "
                        "own (default 0.95)")
    p.add_argument("--block", type=int, default=3, help="plans recompute whole blocks of this many layers "
                                                        "(default 3)")
    p.add_argument("--window", type=int, default=600, help="tokens per calibration KB (default 600)")
    p.add_argument("--calibration", nargs="+", metavar="PATH", default=None,
                   help="calibrate on these text files and folders (your own domain's), cut into "
                        "--window-token KBs (default: the bundled calibration documents, "
                        "kdn.engines.transformers.crossmodel.CALIBRATION_DOCS)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="answer tokens compared (default 16)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_plan)
