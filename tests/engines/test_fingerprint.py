"""kdn.engines.fingerprint: vLLM's KV is named apart from transformers' KV of the same weights,
and the "transformers" name is exactly kdn.engines.transformers.model's, computed from the folder alone."""
import pytest
import torch

from kdn.engines.fingerprint import fingerprints, weights_of
from kdn.core.errors import ModelError
from kdn.engines.transformers.model import load_model


@pytest.fixture(scope="module")
def model():
    return load_model()


def test_the_transformers_name_is_kdn_models_and_vllm_has_its_own(model):
    fps = fingerprints(model.cache_path)
    assert fps["transformers"] == model.fingerprint
    assert fps["vllm"] != model.fingerprint
    assert fingerprints(model.cache_path, device="cuda")["vllm"] != fps["vllm"], \
        "another device's kernels are other numerics"
    cast = fingerprints(model.cache_path, dtype=torch.bfloat16)
    assert cast["vllm"] != fps["vllm"] and cast["transformers"] is None


def test_a_folder_kdn_did_not_convert_is_named_by_its_weight_files(model, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).symlink_to(model.cache_path / name)
    assert weights_of(folder).startswith("files:")
    assert fingerprints(folder)["vllm"] != fingerprints(model.cache_path)["vllm"]
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no safetensors"):
        weights_of(folder)
    with pytest.raises(ModelError, match="not a local model folder"):
        fingerprints(tmp_path / "nowhere")
