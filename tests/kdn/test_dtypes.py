"""The one dtype table (kdn/dtypes.py): storage dtype, torch dtype and size agree."""
import numpy as np
import torch

from kdn.dtypes import DTYPES, TORCH_NAMES


def test_each_dtype_stores_in_its_size_and_views_as_its_torch_dtype():
    for name, (storage, tdt, size) in DTYPES.items():
        assert np.dtype(storage).itemsize == size == torch.empty(0, dtype=tdt).element_size()
        assert TORCH_NAMES[tdt] == name
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    stored = bf.view(torch.uint16).numpy().astype(DTYPES["bfloat16"][0])
    assert torch.equal(torch.from_numpy(stored).view(torch.bfloat16), bf)
