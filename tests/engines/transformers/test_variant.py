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
    ("seed", -1, "seed must be an int >= 0"), ("targets", (), "targets names no module")])
def test_a_bad_recipe_is_refused_by_its_field(field, value, message):
    with pytest.raises(ModelError, match=message):
        replace(Recipe(), **{field: value}).check()


def test_a_variant_needs_training_text(tmp_path):
    with pytest.raises(ModelError, match="needs training text"):
        build([], TINY, root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_kdn_model_variant_refuses_a_bad_recipe_in_one_line(capsys):
    from kdn.cli import main
    assert main(["model", "variant", "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kdn: error: variant recipe: steps must be a positive int, got 0"]
