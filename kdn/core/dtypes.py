"""KV dtypes: each name's numpy storage dtype, torch dtype name and size, the one table everyone reads.

numpy has no bfloat16: bf16 KV is stored as uint16 and reinterpreted by torch's
.view(torch.bfloat16). Storage is little-endian, as frames are.

This module never imports torch at module level (the vocabulary moves bytes; edges and the
origin never load torch): `torch_dtype` and `name_of` import it when an engine asks.
"""
import numpy as np

# name -> (numpy storage dtype, torch dtype's attribute name, itemsize)
DTYPES = {
    "float32": (np.dtype("<f4"), "float32", 4),
    "float16": (np.dtype("<f2"), "float16", 2),
    "bfloat16": (np.dtype("<u2"), "bfloat16", 2),
}


def torch_dtype(name: str):
    """The torch dtype of a KDN dtype name (KeyError for a name not in DTYPES)."""
    import torch
    return getattr(torch, DTYPES[name][1])


def name_of(dtype):
    """KDN's name for a torch dtype, or None where KDN does not store it."""
    for name, (_, attr, _) in DTYPES.items():
        if str(dtype) == f"torch.{attr}":
            return name
    return None


# Opaque bytes: an object another cache layer stores in KDN (an LMCache memory object, an
# SGLang page) that is not KV of KDN's layout. Its frame says so (dtype "opaque", every KV
# dimension 0, raw = its length in bytes), it holds a 1-D uint8 array, and only lossless
# codecs apply to it. It is not in DTYPES: nothing that reads KV ever takes it for KV.
OPAQUE = "opaque"
# name -> (numpy storage dtype, itemsize), KV dtypes and opaque bytes alike (what codecs read)
STORAGE = {**{name: (storage, size) for name, (storage, _, size) in DTYPES.items()},
           OPAQUE: (np.dtype("u1"), 1)}
