"""The one dtype table (kdn/core/dtypes.py): storage dtype, torch dtype and size agree."""
import numpy as np
import torch

from kdn.core.dtypes import DTYPES, name_of, torch_dtype


def test_each_dtype_stores_in_its_size_and_views_as_its_torch_dtype():
    for name, (storage, _, size) in DTYPES.items():
        tdt = torch_dtype(name)
        assert np.dtype(storage).itemsize == size == torch.empty(0, dtype=tdt).element_size()
        assert name_of(tdt) == name
    assert name_of(torch.int64) is None
    bf = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    stored = bf.view(torch.uint16).numpy().astype(DTYPES["bfloat16"][0])
    assert torch.equal(torch.from_numpy(stored).view(torch.bfloat16), bf)
