"""`kdn model variant`: build the fine-tuned variant of the model (kdn.engines.transformers.variant).

It trains the default recipe (a LoRA on every layer, the bundled founding documents, a fixed
seed; minutes on 2 cores) once, and prints the folder, the base and variant fingerprints and
the training's loss; a second run finds the folder and trains nothing. Flags change the
recipe (another recipe is another folder).
"""
import json
from dataclasses import replace

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


def add_parsers(sub) -> None:
    """This group's subcommands."""
    m = sub.add_parser("model", help="the model family: build a fine-tuned variant")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    v = msub.add_parser("variant", help="train the variant once (LoRA on the bundled documents) and "
                                        "print where it is")
    v.add_argument("--recipe", default="founding-docs", choices=["founding-docs", "founding-docs-light"],
                   help="the recipe the options below change (default founding-docs: LoRA r16 on every "
                        "projection, 60 steps at 1e-3; -light: r8 on attention, 40 steps at 3e-4)")
    v.add_argument("--name", default=None, help="the variant's name (default: the recipe's)")
    v.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    v.add_argument("--seed", type=int, default=None, help="seed (default 0)")
    v.add_argument("--rank", type=int, default=None, help="LoRA rank (default: the recipe's)")
    v.add_argument("--lr", type=float, default=None, help="learning rate (default: the recipe's)")
    v.add_argument("--window", type=int, default=None, help="tokens per training window (default 128)")
    v.add_argument("--batch", type=int, default=None, help="windows per step (default 4)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.set_defaults(func=_variant)
