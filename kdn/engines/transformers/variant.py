"""A fine-tuned variant of the base model, made on this machine: a second member of its family.

KDN's model is SmolLM2-135M-Instruct (kdn.engines.transformers.convert). Reusing KV across
models of one family (issue 38) needs a second model with the same architecture and other
weights, and nothing may come from a model hub, so this module makes one: a LoRA (peft) on
the attention and MLP projections of every layer (or of the recipe's `layers` only, the rest
frozen: UPPER), trained by next-token prediction on the bundled
public-domain documents (kdn/data: five founding documents of the United States; the
variant's domain) for a fixed number of steps from a fixed seed, merged into the weights and
saved as an ordinary model folder under cache_root()/variants/ (written to a temp folder,
then renamed: a killed build never leaves a folder that loads). Its record (META_FILE) holds
the recipe, the base model's weights digest and the variant's own, so kdn.engines.fingerprint
names it from the folder like the base, and a folder whose record does not match its recipe
and base is built again, never loaded.

The folder's name is the recipe's name and a digest of (recipe, base weights, training
text): the same recipe on the same base reuses it. Training is deterministic for one recipe
on one machine (seeded batches and LoRA initialisation); another CPU's kernels may round
differently, so the record's weights digest, not the recipe, names the variant's KV.

`kdn model variant` builds the default recipe (VARIANT: minutes on 2 cores) on the bundled
documents; tests build a tiny one (a few steps on short windows) for the mechanics;
load_model(variant=folder) loads one.
"""
import json
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kdn.core.errors import ModelError
from kdn.core.files import fsync_dir
from kdn.engines.fingerprint import META_FILE, weights_digest
from kdn.engines.transformers.convert import TMP_MARK, cache_root, converted_folder, quiet_transformers

FORMAT = 1                     # bump when a variant folder's layout changes


@dataclass(frozen=True)
class Recipe:
    """How a variant is made: LoRA rank and alpha on target modules (of the layers named, or
    of every layer when layers is empty), AdamW at lr, steps batches of batch windows of
    window tokens of the training text, from seed."""
    name: str = "founding-docs"
    rank: int = 16
    alpha: int = 32
    targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lr: float = 1e-3
    steps: int = 60
    batch: int = 4
    window: int = 128
    seed: int = 0
    layers: tuple = ()

    def check(self) -> "Recipe":
        for name in ("rank", "alpha", "steps", "batch", "window"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelError(f"variant recipe: {name} must be a positive int, got {v!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ModelError(f"variant recipe: seed must be an int >= 0, got {self.seed!r}")
        if not (isinstance(self.lr, float) and 0 < self.lr < 1):
            raise ModelError(f"variant recipe: lr must be a float in (0, 1), got {self.lr!r}")
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name):
            raise ModelError(f"variant recipe: name must be letters, digits, '-' or '_', got {self.name!r}")
        if not self.targets:
            raise ModelError("variant recipe: targets names no module")
        if (not isinstance(self.layers, tuple) or any(not isinstance(i, int) or isinstance(i, bool) or i < 0
                                                       for i in self.layers)
                or list(self.layers) != sorted(set(self.layers))):
            raise ModelError(f"variant recipe: layers must be a tuple of distinct layer numbers >= 0 in "
                             f"ascending order (empty: every layer), got {self.layers!r}")
        return self

    def digest_fields(self) -> dict:
        """The recipe as its folder's digest names it: `layers` only where it names some, so
        the recipes from before it existed keep their folders."""
        d = asdict(self)
        if not d["layers"]:
            del d["layers"]
        return d


VARIANT = Recipe()                         # what `kdn model variant` builds
# A lighter fine-tune of the same documents (attention only, lower rate, fewer steps): a variant
# nearer its base, as many real adapters are; `kdn bench crossmodel --recipe` measures both.
LIGHT = Recipe(name="founding-docs-light", rank=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"),
               lr=3e-4, steps=40)
# The same fine-tune with the lower 21 of 30 layers frozen, a common way to adapt a model:
# only layers 21-29 change, so the variant's KV and hidden states equal its base's below them.
UPPER = Recipe(name="founding-docs-upper", layers=tuple(range(21, 30)))
RECIPES = {r.name: r for r in (VARIANT, LIGHT, UPPER)}
TINY = Recipe(name="tiny", rank=2, alpha=4, targets=("q_proj", "k_proj", "v_proj"), lr=5e-3,
              steps=2, batch=1, window=32)  # tests: the mechanics, in seconds


def variant_folder(recipe: Recipe, base_weights: str, texts, root: Path) -> Path:
    """root/<recipe name>-<digest of the recipe, the base weights and the training text>."""
    h = xxhash.xxh3_64()
    h.update(json.dumps({"format": FORMAT, "recipe": recipe.digest_fields(), "base": base_weights},
                        sort_keys=True, default=list).encode())
    for name, text in texts:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return Path(root) / f"{recipe.name}-{h.hexdigest()}"


def read_record(folder: Path):
    """The variant's record if folder holds a complete variant, else None."""
    try:
        meta = json.loads((Path(folder) / META_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None
    if meta.get("variant_format") != FORMAT or not (Path(folder) / "config.json").is_file():
        return None
    return meta


def build(texts, recipe: Recipe = VARIANT, cache_dir=None, log=None, root=None) -> tuple:
    """(folder, record, whether this call trained it): the variant of recipe trained on texts
    ([(name, text)]: `kdn model variant` gives the bundled documents) over the converted base
    model, trained on first use and reused after, in root (default cache_root()/variants)."""
    log = log or (lambda msg: None)
    recipe.check()
    texts = [(str(n), str(t)) for n, t in texts]
    if not texts:
        raise ModelError("a variant needs training text: no document given")
    base, base_meta, _ = converted_folder(cache_dir, None, log)
    n_layers = json.loads((Path(base) / "config.json").read_text())["num_hidden_layers"]
    if recipe.layers and recipe.layers[-1] >= n_layers:
        raise ModelError(f"variant recipe: layers {list(recipe.layers)} name a layer past the model's "
                         f"last ({n_layers - 1})")
    root = Path(root) if root is not None else cache_root(cache_dir) / "variants"
    target = variant_folder(recipe, base_meta["weights_digest"], texts, root)
    meta = read_record(target)
    if meta is not None:
        return target, meta, False
    if target.exists():          # a folder with no complete record: never loaded, replaced
        shutil.rmtree(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    try:
        record = _train(base, base_meta["weights_digest"], recipe, texts, tmp, log)
        (tmp / META_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:          # another build of the same recipe finished first: keep its folder
            if read_record(target) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return target, read_record(target), False
        fsync_dir(target.parent)
    except BaseException:      # a half-written folder never stays behind (then re-raised)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target, read_record(target), True


def find(recipe: Recipe, texts, cache_dir=None, root=None) -> Path:
    """The folder of recipe's variant trained on texts, already built; ModelError naming the
    command that builds it otherwise (a reader never trains a model as a side effect)."""
    _, base_meta, _ = converted_folder(cache_dir, None, None)
    root = Path(root) if root is not None else cache_root(cache_dir) / "variants"
    folder = variant_folder(recipe.check(), base_meta["weights_digest"], [(str(n), str(t)) for n, t in texts], root)
    if read_record(folder) is None:
        raise ModelError(f"the variant {recipe.name!r} is not built here: build it first "
                         f"(`kdn model variant --recipe {recipe.name}`)")
    return folder


def built(name: str) -> Path:
    """The folder of the bundled recipe `name`'s variant (trained on the bundled documents),
    already built; ModelError for a name that is no recipe or a variant not built here."""
    if name not in RECIPES:
        raise ModelError(f"no variant recipe {name!r}: the recipes are {', '.join(RECIPES)}")
    from kdn.cli.knowledge import bundled_documents      # the documents every recipe trains on
    return find(RECIPES[name], bundled_documents())


def plans_root(cache_dir=None) -> Path:
    """Where the recompute plans of model pairs are kept (kdn.engines.family.save_plan): beside
    the variants, under the model cache."""
    return cache_root(cache_dir) / "variants"


def _windows(ids: np.ndarray, recipe: Recipe, rng) -> torch.Tensor:
    starts = rng.integers(0, len(ids) - recipe.window, recipe.batch)
    return torch.from_numpy(np.stack([ids[s:s + recipe.window] for s in starts]).astype(np.int64))


def _train(base: Path, base_weights: str, recipe: Recipe, texts, out: Path, log) -> dict:
    """Train recipe's LoRA on texts, merge it, save the merged model and tokenizer into out."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    t0 = time.perf_counter()
    torch.manual_seed(recipe.seed)
    rng = np.random.default_rng(recipe.seed)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(base, local_files_only=True)
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    ids = np.array([t for _, text in texts for t in tok(text)["input_ids"] + [tok.eos_token_id]])
    if len(ids) <= recipe.window:
        raise ModelError(f"variant recipe: {len(ids)} training tokens do not fill one {recipe.window}-token window")
    model = get_peft_model(hf, LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, lora_dropout=0.0,
                                          target_modules=list(recipe.targets), bias="none",
                                          layers_to_transform=list(recipe.layers) or None,
                                          task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=recipe.lr)
    losses = []
    for step in range(recipe.steps):
        x = _windows(ids, recipe, rng)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(float(loss.detach()), 4))
        if step % 10 == 0 or step == recipe.steps - 1:
            log(f"  step {step + 1}/{recipe.steps}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)")
    merged = model.merge_and_unload()
    merged.eval()
    out.mkdir()
    with quiet_transformers():
        merged.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
    with torch.inference_mode():
        digest = weights_digest(merged.state_dict())
    log(f"variant {recipe.name}: {recipe.steps} steps in {time.perf_counter() - t0:.0f} s, "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return {"variant_format": FORMAT, "recipe": asdict(recipe), "base_weights_digest": base_weights,
            "weights_digest": digest, "training_tokens": int(len(ids)), "losses": losses,
            "train_s": round(time.perf_counter() - t0, 1),
            "documents": [name for name, _ in texts]}
