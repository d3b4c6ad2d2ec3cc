"""The fine-tuned variant (kdn.engines.transformers.variant): trained here from a recipe on the
bundled documents, merged, saved beside the base model, reused, and a model of the same family
with other weights, so other KV and another fingerprint. The tiny recipe (2 steps on 32-token
windows) is for the mechanics; `kdn model variant` trains the real one."""
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from kdn.cli.knowledge import bundled_documents
from kdn.core.errors import ModelError
from kdn.engines.fingerprint import META_FILE, fingerprints
from kdn.engines.transformers.model import load_model
from kdn.engines.transformers.variant import TINY, Recipe, build, read_record, variant_folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)            # as the model fixture: 2 workers share 2 cores
    yield root, build(bundled_documents()[-1:], TINY, root=root)
    torch.set_num_threads(threads)


def test_a_variant_is_trained_once_then_found_and_is_another_model_of_the_family(tiny, model):
    root, (folder, record, trained) = tiny
    assert trained and folder.parent == root and folder.name.startswith("tiny-")
    assert record["recipe"]["steps"] == 2 and len(record["losses"]) == 2
    assert record["base_weights_digest"] == model.weights_digest != record["weights_digest"]
    assert record["documents"] == [bundled_documents()[-1][0]]
    again = build(bundled_documents()[-1:], TINY, root=root)
    assert again == (folder, record, False)                       # found, not trained again
    texts = bundled_documents()[-1:]
    assert variant_folder(replace(TINY, seed=1), model.weights_digest, texts, root) != folder
    assert variant_folder(TINY, model.weights_digest, texts, root) == folder
    # a folder without its record (a build cut short) is trained again, never loaded; the same
    # recipe on the same machine gives the same weights
    (folder / META_FILE).unlink()
    rebuilt = build(texts, TINY, root=root)
    assert rebuilt[2] and rebuilt[1]["weights_digest"] == record["weights_digest"]

    variant = load_model(variant=folder, warm=False)
    assert variant.name == "smollm2-135m-instruct+tiny"
    assert variant.weights_digest == record["weights_digest"]
    assert variant.fingerprint != model.fingerprint
    assert variant.fingerprint == fingerprints(folder)["transformers"]          # named from the folder
    family = {k: v for k, v in model.fingerprint_fields.items() if k != "weights"}
    assert {k: v for k, v in variant.fingerprint_fields.items() if k != "weights"} == family
    tokens = model.knowledge_tokens("We the People of the United States")
    assert variant.knowledge_tokens("We the People of the United States") == tokens
    base_kv, own_kv = model.prefill(tokens).kv, variant.prefill(tokens).kv
    assert base_kv.shape == own_kv.shape and not np.array_equal(base_kv, own_kv)


def test_a_folder_that_is_not_a_variant_is_never_loaded(tiny, tmp_path):
    root, (folder, record, _) = tiny
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    assert read_record(broken) is None
    with pytest.raises(ModelError, match="not a complete KDN model variant"):
        load_model(variant=broken, warm=False)
    meta = json.loads((folder / META_FILE).read_text())
    assert meta["variant_format"] == record["variant_format"] and meta["weights_digest"] == record["weights_digest"]


@pytest.mark.parametrize("field,value,message", [
    ("steps", 0, "steps must be a positive int"), ("rank", True, "rank must be a positive int"),
    ("lr", 2.0, "lr must be a float in"), ("name", "../x", "name must be letters"),
    ("seed", -1, "seed must be an int >= 0"), ("targets", (), "targets names no module"),
    ("layers", (3, 1), "layers must be a tuple of distinct"), ("layers", [21], "layers must be a tuple"),
    ("layers", (-1,), "layers must be a tuple"), ("layers", (2, 2), "distinct layer numbers")])
def test_a_bad_recipe_is_refused_by_its_field(field, value, message):
    with pytest.raises(ModelError, match=message):
        replace(Recipe(), **{field: value}).check()


def test_recipes_name_their_folders_as_before_and_the_cli_offers_every_recipe():
    """`layers` enters a folder's digest only where it names layers: the recipes from before
    it keep their folders (a variant built then is found, not trained again)."""
    from kdn.cli.kb import VARIANTS
    from kdn.engines.transformers.variant import RECIPES, UPPER, VARIANT
    before = "founding-docs-4c29de5295268692"        # the name the code before `layers` gave
    assert variant_folder(VARIANT, "w", [("a", "b")], "/r").name == before
    assert variant_folder(replace(UPPER, name=VARIANT.name), "w", [("a", "b")], "/r").name != before
    assert VARIANTS == tuple(RECIPES) and UPPER.layers == tuple(range(21, 30))


def test_a_variant_of_its_upper_layers_keeps_the_bases_kv_below_them_and_a_plan_from_there_is_its_own(
        tiny, model, tmp_path):
    """A fine-tune of layers 27-29 only (a common way to adapt a model: the lower layers
    frozen): below 27 its KV is the base model's (the same weights and kernels: equal to well
    under float32's rounding of a layer, allowed for a BLAS whose path depends on where the
    weights lie in memory), and the plan recomputing 27-30
    from the base model's hidden states there gives its own KV and its own answers, where the
    base model's KV raw does not give its own KV."""
    from kdn.engines.transformers import crossmodel as X
    root = tiny[0]
    upper = replace(TINY, name="tiny-upper", layers=(27, 28, 29), lr=2e-2)
    with pytest.raises(ModelError, match=r"past the model's last \(29\)"):
        build(bundled_documents()[-1:], replace(upper, layers=(29, 30)), root=tmp_path)
    folder, record, trained = build(bundled_documents()[-1:], upper, root=root)
    assert trained and record["recipe"]["layers"] == [27, 28, 29]
    variant = load_model(variant=folder, warm=False)
    assert variant.weights_digest != model.weights_digest
    tokens = model.knowledge_tokens(bundled_documents()[-1][1][:600])
    kv, hidden = X.prefill_with_hidden(model, tokens, [24, 27])
    own = variant.prefill(tokens).kv
    assert np.abs(own[:27] - kv[:27]).max() < 1e-6                 # the frozen layers: the base's KV
    assert np.abs(own[27:] - kv[27:]).max() > 1e-3                 # raw reuse is not its own KV
    assert np.abs(X.recompute(variant, hidden[27], 27, 30) - own[27:]).max() < 1e-3
    rows = X.profile(variant, model, [(bundled_documents()[-1][1][:600], ["Who spoke these words?"])],
                     starts=[24, 27], max_new_tokens=4)
    assert {(r["start"], r["end"]): r["agree"] for r in rows if r["end"] == 30} == {(24, 30): 1.0, (27, 30): 1.0}


def test_a_variant_needs_training_text(tmp_path):
    with pytest.raises(ModelError, match="needs training text"):
        build([], TINY, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_kdn_model_variant_refuses_a_bad_recipe_in_one_line(capsys):
    from kdn.cli import main
    assert main(["model", "variant", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kdn: error: variant recipe: steps must be a positive int, got 0"]


# --- reading across the family (kdn.engines.family, kdn.engines.transformers.crossmodel) -------
ADMIN = "admin-token-crossmodel-0123456789"
READ = "reader-token-crossmodel-0123456789"


def test_plans_are_chosen_on_their_profile_stored_with_the_pair_and_checked(tmp_path, model):
    from kdn.engines.family import Plan, check_family, choose, cross_fingerprint, load_plan, save_plan
    profile = [{"start": 0, "end": 30, "agree": 1.0, "first": 1.0, "items": 10},
               {"start": 18, "end": 30, "agree": 0.9, "first": 1.0, "items": 10},
               {"start": 12, "end": 30, "agree": 0.96, "first": 1.0, "items": 10},
               {"start": 6, "end": 30, "agree": 0.96, "first": 1.0, "items": 10}]
    plan = choose(profile, "r", "s", 30, target=0.95, calibration={"kbs": ["a"]})
    assert (plan.start, plan.end, plan.recomputed) == (12, 30, 18)     # fewest layers at >= 95%
    assert choose(profile, "r", "s", 30, target=0.99) is None          # only a full recompute reaches it
    path = save_plan(plan, tmp_path)
    assert load_plan(tmp_path, "r", "s") == plan and path.name == "r-from-s.json"
    assert cross_fingerprint(plan) not in ("r", "s") and plan.name in cross_fingerprint(plan)
    with pytest.raises(ModelError, match="no recompute plan for reader"):
        load_plan(tmp_path, "r", "other")
    with pytest.raises(ModelError, match=r"within 0\.\.30, got \[12, 31\)"):
        Plan("r", "s", 12, 31, 30)
    with pytest.raises(ModelError, match="reader and sender are the same model"):
        Plan("r", "r", 0, 3, 30)
    other = dict(model.fingerprint_fields, kv_heads=model.fingerprint_fields["kv_heads"] * 2, weights="x")
    with pytest.raises(ModelError, match="not of one family .*kv_heads"):
        check_family(model.fingerprint_fields, other)


def test_a_full_recompute_from_the_senders_hidden_states_is_the_readers_own_kv(tiny, model):
    from kdn.engines.transformers import crossmodel as X
    root, (folder, record, _) = tiny
    variant = load_model(variant=folder, warm=False)
    tokens = model.knowledge_tokens(bundled_documents()[-1][1][:600])
    kv, hidden = X.prefill_with_hidden(model, tokens, [0, 20])
    assert np.array_equal(kv, model.prefill(tokens).kv)                # the capture changes no byte
    assert hidden[0].shape == (len(tokens), model.hf.config.hidden_size)
    assert np.array_equal(X.from_chunk_layout(X.to_chunk_layout(hidden[20])), hidden[20])
    # the tiny LoRA leaves the embeddings alone: recomputing every layer is the variant's own prefill
    own = variant.prefill(tokens).kv
    full = X.recompute(variant, hidden[0], 0, variant.layers)
    assert np.abs(full - own).max() < 1e-3
    part = X.recompute(variant, hidden[20], 20, variant.layers)
    mixed = X.assemble(kv, part, 20)
    assert np.array_equal(mixed[:20], kv[:20]) and np.array_equal(mixed[20:], part)
    assert not np.array_equal(part, kv[20:])
    rows = X.profile(variant, model, [(bundled_documents()[-1][1][:600], ["Who spoke these words?"])],
                     starts=[0, 24], max_new_tokens=6)
    by = {(r["start"], r["end"]): r for r in rows}
    assert by[(0, 30)]["agree"] == 1.0 and by[(0, 30)]["items"] == 1 and set(by) == {(0, 30), (24, 30)}


def test_cross_model_reads_are_opt_in_flagged_kept_apart_and_leave_exact_kv_alone(tiny, model, small_network):
    from kdn.client import Client
    from kdn.client.publish import publish_documents
    from kdn.core.errors import AccessDenied, ManifestError
    from kdn.engines.family import Plan, cross_fingerprint
    from kdn.engines.transformers.crossmodel import CrossReader, publish_hidden
    from kdn.engines.transformers.worker import answer
    root, (folder, record, _) = tiny
    variant = load_model(variant=folder, warm=False)
    net = small_network(auth={"admin": ADMIN, "readers": {"acme": READ}}, replicas=1)
    docs = [("gettysburg", bundled_documents()[-1][1][:700])]
    sender = Client(network=net.name, region="us-east", tenant="acme", fingerprint=model.fingerprint,
                    admin_token=ADMIN)
    publish_documents(sender, model, "speech", docs)
    know = sender.manifest("speech").token_ids().tolist()
    before = sender.fetch(know, kb="speech")
    no_hidden = CrossReader(Client(network=net.name, region="eu-west", tenant="acme",
                                   fingerprint=variant.fingerprint, token=READ), variant,
                            Plan(variant.fingerprint, model.fingerprint, 0, variant.layers, variant.layers))
    with pytest.raises(ModelError, match="has not stored its hidden states entering layer 0") as e:
        no_hidden.answer("speech", "Who?", max_new_tokens=2)
    assert "`kdn publish speech PATH... --hidden-for tiny`" in str(e.value)
    no_hidden.close()
    hid = publish_hidden(sender, model, "speech", docs, [0])
    assert hid["bytes"] == len(know) * model.hf.config.hidden_size * 4
    question = "Who is speaking?"
    reader = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=variant.fingerprint,
                    token=READ)
    with pytest.raises(ManifestError, match="no knowledge base 'speech'"):   # no opt-in: never the base's KV
        answer(reader, variant, "speech", question)
    plan = Plan(variant.fingerprint, model.fingerprint, 0, variant.layers, variant.layers)
    with pytest.raises(ModelError, match="the plan is for reader"):
        CrossReader(reader, model, plan)
    admin_reader = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=variant.fingerprint,
                          admin_token=ADMIN)
    cross = CrossReader(admin_reader, variant, plan)
    try:
        first = cross.answer("speech", question, max_new_tokens=6, check=True)
        again = cross.answer("speech", question, max_new_tokens=6)
    finally:
        cross.close()
    assert first.exact is False and again.exact is False
    assert first.cross_model["sender"] == model.fingerprint and first.cross_model["recompute"] == [0, 30]
    assert first.cross_model["kept"] is False and again.cross_model["kept"] is True
    assert first.cached_tokens == len(know) and first.extra["hidden_bytes"] == hid["bytes"]
    # every layer recomputed from the (shared) embeddings: the variant's own answer
    assert first.identical and again.tokens == first.tokens
    # the sender's KV cut short (here: none of it answers): the variant computes the rest itself
    short = CrossReader(reader, variant, plan)
    real = short.sender.fetch
    short.sender.fetch = lambda prompt, **kw: real(prompt[:0], **kw)
    try:
        cut = short.answer("speech", question, max_new_tokens=6)
    finally:
        short.close()
    assert cut.cached_tokens == 0 and cut.tokens == first.baseline_tokens and cut.exact is False
    # kept under the plan's own namespace only: the variant's and the base's are as they were
    prompt = know + variant.question_tokens(question)
    with pytest.raises(AccessDenied, match="nothing is published under it"):
        reader.fetch(prompt)                          # the variant's own namespace holds nothing
    kept = Client(network=net.name, region="eu-west", tenant="acme", fingerprint=cross_fingerprint(plan),
                  token=READ).fetch(prompt)
    assert kept.tokens == len(know)
    after = sender.fetch(know, kb="speech")
    assert [c.key for c in after.chunks] == [c.key for c in before.chunks]
    assert all(np.array_equal(a.kv, b.kv) for a, b in zip(after.chunks, before.chunks))


# --- the command line: `kdn model plan`, `kdn publish --hidden-for`, `kdn query --cross-model` ---
@pytest.fixture
def family_cli(tiny, model, tmp_path, monkeypatch):
    """The CLI in-process with the tiny variant standing for the recipe it names, plans kept in
    tmp_path, and the two models loaded once (load_model answers them)."""
    import kdn.engines.transformers.model
    from kdn.engines.transformers import variant as V
    root, (folder, record, _) = tiny
    reader = load_model(variant=folder, warm=False)
    monkeypatch.setattr(V, "find", lambda recipe, texts, **k: folder)
    monkeypatch.setattr(V, "plans_root", lambda cache_dir=None: tmp_path / "plans")
    monkeypatch.setattr(kdn.engines.transformers.model, "load_model",
                        lambda *a, variant=None, **k: reader if variant == folder else model)
    monkeypatch.setenv("KDN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KDN_ADMIN_TOKEN", ADMIN)
    monkeypatch.delenv("KDN_TOKEN", raising=False)
    return reader, tmp_path / "plans"


def test_kdn_model_plan_stores_the_pairs_plan_or_says_how_near_it_came(family_cli, model, tmp_path, capsys):
    from kdn.cli import main
    from kdn.engines.family import load_plan
    reader, plans = family_cli
    text = tmp_path / "calibration" / "speech.md"              # calibrated on the operator's own text
    text.parent.mkdir()
    text.write_text(bundled_documents()[-1][1][:600])
    small = ["--window", "4096", "--max-new-tokens", "4", "--calibration", str(text.parent)]
    # blocks of 30: the only plan recomputes every layer, no faster than the variant's own prefill
    assert main(["model", "plan", "--block", "30"] + small) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no plan short of recomputing all 30 layers keeps 95%" in err[0], err
    assert "no plan stored, the variant prefills itself" in err[0] and not plans.exists()
    assert main(["model", "plan", "--block", "15", "--target", "0.5", "--json"] + small) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    plan = load_plan(plans, reader.fingerprint, model.fingerprint)
    assert out["plan"] == plan.describe() and plan.recomputed == 15 and out["agree"] >= 0.5
    assert {(p["start"], p["end"]) for p in plan.profile} == {(0, 15), (15, 30), (0, 30)}
    assert plan.calibration["kbs"] == ["speech.md@0"] and plan.calibration["block"] == 15
    assert main(["model", "plan", "--target", "1.5"]) == 2
    assert "--target must be in (0, 1]" in capsys.readouterr().err
    # a rerun that reaches no plan removes the earlier one: readers then prefill themselves
    assert main(["model", "plan", "--block", "30"] + small) == 2
    assert "(the earlier one of the pair removed)" in capsys.readouterr().err
    with pytest.raises(ModelError, match="no recompute plan"):
        load_plan(plans, reader.fingerprint, model.fingerprint)


def test_the_cli_reads_across_models_only_when_asked_and_says_so(family_cli, model, small_network,
                                                                  ray_cluster, tmp_path, capsys):
    from kdn.cli import main
    from kdn.client import Client
    from kdn.engines.family import Plan, cross_fingerprint, save_plan
    reader, plans = family_cli
    net = small_network(auth={"admin": ADMIN})
    at = ["--address", ray_cluster.address, "--network", net.name]
    doc = tmp_path / "speech.md"
    doc.write_text(bundled_documents()[-1][1][:700])
    question = "Who is speaking?"
    ask = ["query", "speech", question, "--region", "eu-west", "--max-new-tokens", "6"] + at
    # no plan for the pair yet: the publish is refused before anything is prefilled
    assert main(["publish", "speech", str(doc), "--hidden-for", "founding-docs"] + at) == 2
    assert "no recompute plan for reader" in capsys.readouterr().err
    plan = Plan(reader.fingerprint, model.fingerprint, 0, reader.layers, reader.layers)
    save_plan(plan, plans)
    assert main(["publish", "speech", str(doc), "--hidden-for", "founding-docs"] + at) == 0
    out = capsys.readouterr().out
    assert "default/speech v1 committed" in out and "hidden states entering layer 0 stored for founding-docs" in out
    know = Client(network=net.name, region="us-east", fingerprint=model.fingerprint).manifest("speech").token_ids()
    before = Client(network=net.name, region="us-east", fingerprint=model.fingerprint).fetch(know.tolist())
    # without opting in, the variant reads its own KV only: there is none
    assert main(ask + ["--variant", "founding-docs"]) == 2
    assert "no knowledge base 'speech'" in capsys.readouterr().err
    assert main(ask + ["--cross-model"]) == 2
    assert "name the reader with --variant" in capsys.readouterr().err
    # opted in: the base model's KV, every layer recomputed by the variant, its own answer
    assert main(ask + ["--variant", "founding-docs", "--cross-model", "--check"]) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    assert f"{len(know)}/" in err and "CROSS-MODEL (exact=False): layers 0-30 of 30 recomputed by " + reader.name in err
    assert f"plan {plan.name}" in err and "generated tokens identical: yes" in err, err
    assert main(ask + ["--variant", "founding-docs", "--cross-model"]) == 0      # kept: no recompute
    assert "read as kept before" in capsys.readouterr().err
    kept = Client(network=net.name, region="eu-west", fingerprint=cross_fingerprint(plan)).fetch(know.tolist())
    assert kept.tokens == len(know)                  # kept under the plan's own namespace
    after = Client(network=net.name, region="us-east", fingerprint=model.fingerprint).fetch(know.tolist())
    assert [c.key for c in after.chunks] == [c.key for c in before.chunks]
    assert all(np.array_equal(a.kv, b.kv) for a, b in zip(after.chunks, before.chunks))
