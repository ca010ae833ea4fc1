"""Dtypes of targets and drafts: names from the config, and casting for decoding.

Casting a draft or a target for decoding goes through `cast_keep_rotary`, never a bare
`.to(dtype)`: the rotary frequencies must stay float32 (see there).
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def cast_keep_rotary(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module.to(dtype)` in place, except that rotary frequency buffers stay float32.

    nn.Module.to casts floating buffers too, and a bf16 inv_freq moves every rotary angle
    (SmolLM2: 0.6978 -> 0.6992): the cast model is then neither the one trained on nor the
    one `from_pretrained(dtype=torch.bfloat16)` builds (HF computes inv_freq in float32).
    A buffer already rounded by an earlier bare `.to(dtype)` stays rounded. Returns `module`.
    """
    # HF rotary embeddings: inv_freq, original_inv_freq; Gemma 3: full_attention_inv_freq, ...
    rotary = {name: buf for name, buf in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, buf in rotary.items():
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner), leaf, buf.float())
    return module


def draft_decode_copy(draft: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the draft in the decoding dtype with float32 rotary frequencies (drafters
    may freeze or convert the module they wrap; the trained draft is untouched). Medusa-2's
    adapted backbone (the target's weights with LoRA beside them) is neither copied nor
    cast: the copy refers to it, and its `decoding_target` reads the LoRA from it."""
    backbone = getattr(draft, "adapted", None)
    if backbone is None:
        return cast_keep_rotary(copy.deepcopy(draft), dtype).eval()
    draft.adapted = None
    try:
        copy_ = cast_keep_rotary(copy.deepcopy(draft), dtype).eval()
    finally:
        draft.adapted = backbone
    # a plain attribute, not a submodule: nothing done to the copy (.to, .eval, freezing)
    # reaches the training draft's LoRA
    object.__setattr__(copy_, "adapted", backbone)
    return copy_
