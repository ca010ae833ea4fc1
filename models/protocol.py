"""The contract every draft kind implements (one file per kind in models/).

Alignment convention (the one place off-by-ones are decided):
    `DraftOutput.logits[i][:, t]` is compared with the target's distribution at position
    `t + offsets[i]`, i.e. the target's prediction of token x_{t + offsets[i] + 1}.
    A draft LM has offsets [0]; Medusa head i has offset i+1; EAGLE unroll step s and
    MTP depth d are shifted by the model so that the same rule holds.
The training loop drops positions where `t + offset >= T` and applies the loss mask at
`t + offset` (1 where x_{t+offset+1} is an assistant token). A draft that trains at sampled
positions only (DFlash's anchors) returns its logits at those positions, `positions` [B, N]
giving each row's t; the same rule then holds row by row.

The decoder's adapter for each draft kind lives in decoding/drafters/ (`make_drafter`),
above this layer. Casting a draft or a target for decoding goes through
`models.dtypes.cast_keep_rotary`, never a bare `.to(dtype)`: the rotary frequencies must
stay float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from torch import Tensor

from models.target import Target, TargetOutput


@dataclass
class DraftOutput:
    logits: list[Tensor]  # one [B, T, V_draft] per predicted offset
    offsets: list[int]  # logits[i][:, t] pairs with the target at position t + offsets[i]
    aux_loss: Tensor | None = None  # e.g. EAGLE-1 feature regression, already weighted, summed
    # over this batch's positions: the step divides by the global batch's real tokens
    # Reduced draft vocabulary: draft id i is target id vocab_ids[i]. None = full vocabulary.
    # The loss renormalises the target distribution over these ids; the logged acceptance
    # proxy and top-1 use the full-vocabulary target, as the decoder does.
    vocab_ids: Tensor | None = None  # [V_draft] long
    # A draft that adapts the target (Medusa-2's LoRA): the adapted model's own next-token
    # logits [B, T, V] and the weight of its LM loss, weight * KL(p_target || p_adapted)
    # over real tokens, which the training step computes (train/core/step.py: aux_loss).
    adapted_logits: Tensor | None = None
    adapted_loss_weight: float = 0.0
    # A draft trained at sampled positions only (DFlash / Domino anchors): logits[i] is
    # [B, N, V_draft] and its row n of batch row b sits at position t = positions[b, n]
    # (-1 = padding, never trained). None = every position, logits [B, T, V_draft].
    positions: Tensor | None = None  # [B, N] long
    # The draft's own weight per offset (DFlash: exp(-(i-1)/gamma) for block position i);
    # None = train.offset_decay ** i.
    offset_weights: list[float] | None = None
    # Domino's curriculum: the backbone's own logits (one per offset, laid out as `logits`)
    # and their share w of the loss: (1 - w) * loss(logits) + w * loss(base_logits).
    base_logits: list[Tensor] | None = None
    base_loss_weight: float = 0.0
    extras: dict[str, Tensor] = field(default_factory=dict)  # anything worth logging


@runtime_checkable
class DraftModel(Protocol):
    """A trainable draft. Built by `from_target(target, token_counts=None, **flat_args)`.

    Everything the training loop, the evaluation and the decoder ask of a draft is declared
    here; none of them probes a module for optional methods. A new draft kind implements all
    of it (most kinds: `set_progress` does nothing, `decoding_target` returns its argument)
    and registers its drafter under `kind` (decoding/drafters/__init__.py: DRAFTERS)."""

    # The kind's name: conf/draft/*.yaml's `draft.kind` and the key of its drafter.
    kind: str
    # Target hidden layers this draft reads (indices into HF hidden_states; -1 = last,
    # after the final norm). Empty for a standalone draft LM.
    hidden_layers: tuple[int, ...]

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,  # the frozen target's forward over input_ids
        attention_mask: Tensor | None = None,  # [B, T]
        loss_mask: Tensor | None = None,  # [B, T] 1 where x_{t+1} is trained
    ) -> DraftOutput:
        """Training call. Frozen pieces shared with the target (embeddings, output head,
        final norm) are read from `target` here, never stored on the module: checkpoints
        hold only trained weights, and a bf16 copy of the draft can pair with a bf16
        copy of the target for evaluation. `loss_mask` is for drafts that train at sampled
        positions (DFlash / Domino anchors go where x_{t+1} is trained); others ignore it."""
        ...

    def set_progress(self, progress: float) -> None:
        """Called by the training loop before every step with the share of training done,
        in [0, 1] (steps, or seconds of a time budget): a loss schedule of the draft's own
        (Domino's curriculum) follows it."""
        ...

    def decoding_target(self, target: Target) -> Target:
        """The target the decoder verifies this draft's proposals with, given the frozen one
        in the decoding dtype: `target` itself, or a draft that adapts the target (Medusa-2's
        LoRA) returns the adapted target, against which its decoding is lossless."""
        ...
