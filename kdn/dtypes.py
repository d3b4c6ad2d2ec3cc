"""KV dtypes: each name's numpy storage dtype, torch dtype and size, the one table everyone reads.

numpy has no bfloat16: bf16 KV is stored as uint16 and reinterpreted by torch's
.view(torch.bfloat16). Storage is little-endian, as frames are.
"""
import numpy as np
import torch

# name -> (numpy storage dtype, torch dtype, itemsize)
DTYPES = {
    "float32": (np.dtype("<f4"), torch.float32, 4),
    "float16": (np.dtype("<f2"), torch.float16, 2),
    "bfloat16": (np.dtype("<u2"), torch.bfloat16, 2),
}
TORCH_NAMES = {tdt: name for name, (_, tdt, _) in DTYPES.items()}

# Opaque bytes: an object another cache layer stores in KDN (an LMCache memory object, an
# SGLang page) that is not KV of KDN's layout. Its frame says so (dtype "opaque", every KV
# dimension 0, raw = its length in bytes), it holds a 1-D uint8 array, and only lossless
# codecs apply to it. It is not in DTYPES: nothing that reads KV ever takes it for KV.
OPAQUE = "opaque"
# name -> (numpy storage dtype, itemsize), KV dtypes and opaque bytes alike (what codecs read)
STORAGE = {**{name: (storage, size) for name, (storage, _, size) in DTYPES.items()},
           OPAQUE: (np.dtype("u1"), 1)}
