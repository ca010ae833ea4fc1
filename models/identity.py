"""A fingerprint of a model's weights: which weights a checkpoint was trained on, and what
keys the caches of the target's features and answers (train/core/feature_cache.py,
train/data/regenerate.py), so re-saved weights at the same path or hub id are never taken
for the old ones.

sha256 over every state_dict entry's name and shape and a strided sample of its values
(at most `SAMPLE` per tensor, the stride below a row's length for the big matrices, so
every row of an embedding or head contributes), each value rounded to bfloat16 first: the
same weights held in float32 or bfloat16 give the same fingerprint (the dtype is recorded
beside it), and any change a bfloat16 copy would see changes it. Tied weights are hashed
under each name, so the fingerprint depends on the values alone. Integers are hashed as
they are. Measured on SmolLM2-135M (273 tensors) on a busy 2-core CPU: 0.15-0.35 s in
float32, 0.06 s in bfloat16, against about 2 s for hashing every value; the rounding runs in
numpy, as torch's thread pool made the 273 small casts take 3 s there. A sample does not
see a change of a few isolated values, which no fine-tune, re-quantisation or further
training makes.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import nn

SAMPLE = 65536  # values hashed per tensor at most


def _bfloat16_bits(values: torch.Tensor) -> np.ndarray:
    """The bfloat16 bit patterns of float `values` (1-D, on the CPU), rounded to nearest
    even as torch's cast rounds."""
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().astype(np.uint16)
    bits = values.numpy().astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def weights_fingerprint(model: nn.Module, sample: int = SAMPLE) -> str:
    """16 hex digits naming `model`'s weights (state_dict), independent of their dtype and
    device."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        h.update(f"{name}:{list(tensor.shape)}:".encode())
        if flat.numel() > sample:
            flat = flat[:: -(-flat.numel() // sample)]  # a strided view: <= sample values
        if flat.device.type != "cpu":  # copy the sample only, not the whole tensor
            flat = flat.contiguous()
        flat = flat.cpu()
        data = _bfloat16_bits(flat) if flat.is_floating_point() else flat.numpy()
        h.update(np.ascontiguousarray(data).tobytes())
    return h.hexdigest()[:16]
