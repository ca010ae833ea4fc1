"""The contract every draft kind implements (one file per kind in models/).

Alignment convention (the one place off-by-ones are decided):
    `DraftOutput.logits[i][:, t]` is compared with the target's distribution at position
    `t + offsets[i]`, i.e. the target's prediction of token x_{t + offsets[i] + 1}.
    A draft LM has offsets [0]; Medusa head i has offset i+1; EAGLE unroll step s and
    MTP depth d are shifted by the model so that the same rule holds.
The training loop drops positions where `t + offset >= T` and applies the loss mask at
`t + offset` (1 where x_{t+offset+1} is an assistant token).

Casting a draft or a target for decoding goes through `cast_keep_rotary`, never a bare
`.to(dtype)`: the rotary frequencies must stay float32 (see there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from decoding.drafter import Drafter
    from train.target import Target, TargetOutput


@dataclass
class DraftOutput:
    logits: list[Tensor]  # one [B, T, V_draft] per predicted offset
    offsets: list[int]  # logits[i][:, t] pairs with the target at position t + offsets[i]
    aux_loss: Tensor | None = None  # e.g. EAGLE-1 feature regression, already weighted
    # Reduced draft vocabulary: draft id i is target id vocab_ids[i]. None = full vocabulary.
    # The loss renormalises the target distribution over these ids; the logged acceptance
    # proxy and top-1 use the full-vocabulary target, as the decoder does.
    vocab_ids: Tensor | None = None  # [V_draft] long
    extras: dict[str, Tensor] = field(default_factory=dict)  # anything worth logging


@runtime_checkable
class DraftModel(Protocol):
    """A trainable draft. Built by `from_target(target, token_counts=None, **flat_args)`."""

    # Target hidden layers this draft reads (indices into HF hidden_states; -1 = last,
    # after the final norm). Empty for a standalone draft LM.
    hidden_layers: tuple[int, ...]

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,  # the frozen target's forward over input_ids
        attention_mask: Tensor | None = None,  # [B, T]
    ) -> DraftOutput:
        """Training call. Frozen pieces shared with the target (embeddings, output head,
        final norm) are read from `target` here, never stored on the module: checkpoints
        hold only trained weights, and a bf16 copy of the draft can pair with a bf16
        copy of the target for evaluation."""
        ...

    def make_drafter(self, target: Target) -> Drafter:
        """An inference adapter for the shared decoder, sharing this module's weights and
        taking frozen pieces from `target` (which may be a bf16 copy used for decoding)."""
        ...


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
