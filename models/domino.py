"""Domino: the DFlash backbone (models/dflash.py) plus a small causal correction head
(SpecForge `OnlineDominoModel` / `DFlashDraftModel(projector_type="domino")`, speculators
`DominoDraftModel` / `DominoHead`).

DFlash predicts every block position independently, so acceptance decays along the block:
position i cannot know which tokens were drafted before it. Domino gives it that back
cheaply. A GRU (no bias) runs over the embeddings of the block's previous tokens; at block
position i its state s_i has read the anchor and the i - 1 tokens after it, and

    logits_i = base_i + W2 SiLU(W1 [z_i ; s_i])          # z_i: the backbone's normed hidden

with base_i the backbone's own logits (lm_head(z_i)). In training the previous tokens are the
ground truth (teacher forcing: x_{t+1}..x_{t+i}); in decoding they are the drafted ones,
one cheap GRU + projection step per token after the one backbone forward
(decoding/drafters/domino.py). W2 [V, E] starts at zero, so a fresh Domino is its DFlash.

Curriculum (base-anchored): loss = (1 - w) * loss(logits) + w * loss(base), w going linearly
from `lambda_start` (1) to 0 over the first `decay_ratio` of training, then 0 (SpecForge /
speculators `linear_lambda_base`). The backbone first learns to stand alone, then the
correction takes over. The training loop reports progress through `set_progress`; a draft
never told its progress trains the corrected logits only (w = 0), as speculators does
without a schedule horizon. The step blends the two losses (train/core/step_stats.py) from
`DraftOutput.base_logits` and `base_loss_weight`.

Why a subclass in its own file, not a flag of DFlashDraft: Domino adds parameters, a
training input (the teacher-forced tokens), a loss term with a schedule and a sequential
drafting step; kept apart, the DFlash file stays the plain block draft and each has its own
drafter, conf and experiment, as every other draft kind.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models import vocab
from models.dflash import DFlashDraft
from models.dflash_init import check_layers, draft_sizes, draft_vocab, init_from_target
from models.protocol import DraftOutput
from models.target import Target, TargetOutput


def base_loss_weight(progress: float, lambda_start: float = 1.0, decay_ratio: float = 0.5) -> float:
    """Domino's curriculum: weight of the backbone's own loss at `progress` (share of
    training done, 0..1): lambda_start at 0, linearly to 0 at decay_ratio, 0 after."""
    if decay_ratio <= 0:
        return 0.0
    return max(0.0, min(1.0, lambda_start * (1.0 - min(progress / decay_ratio, 1.0))))


class DominoDraft(DFlashDraft):
    kind = "domino"

    def __init__(
        self,
        *args,
        gru_hidden_size: int = 256,
        correction_size: int = 256,
        lambda_start: float = 1.0,
        decay_ratio: float = 0.5,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not 0.0 <= lambda_start <= 1.0 or not 0.0 <= decay_ratio <= 1.0:
            raise ValueError(
                f"lambda_start={lambda_start}, decay_ratio={decay_ratio}: both must lie in "
                "[0, 1] (the base-loss weight and the share of training it decays over)"
            )
        if self.target_vocab_size is None:
            raise ValueError(
                "DominoDraft needs target_vocab_size (its correction head maps to the "
                "vocabulary); build it with models.domino.from_target"
            )
        H = self.config.hidden_size
        self.lambda_start, self.decay_ratio = lambda_start, decay_ratio
        self.prefix_gru = nn.GRU(H, gru_hidden_size, num_layers=1, batch_first=True, bias=False)
        self.correction = nn.Sequential(
            nn.Linear(H + gru_hidden_size, correction_size, bias=False),
            nn.SiLU(),
            nn.Linear(correction_size, self.draft_vocab_size or self.target_vocab_size, bias=False),
        )
        nn.init.zeros_(self.correction[2].weight)  # a fresh Domino drafts as its DFlash
        self.base_loss_weight = 0.0  # set by set_progress; schedule state, not a weight

    def set_progress(self, progress: float) -> None:
        """Called by the training loop before each step with the share of training done."""
        self.base_loss_weight = base_loss_weight(progress, self.lambda_start, self.decay_ratio)

    def prefix_states(self, token_embeds: Tensor, state: Tensor | None = None) -> Tensor:
        """GRU over previous tokens' embeddings [M, L, H] (from `state` [1, M, G], None =
        zeros) -> the state after each of them [M, L, G]."""
        dtype = self.correction[0].weight.dtype
        out, _ = self.prefix_gru(token_embeds.to(dtype), state)
        return out

    def corrected(self, base: Tensor, z: Tensor, states: Tensor) -> Tensor:
        """base logits [..., V] + the correction from hidden z [..., H] and prefix states
        [..., G]."""
        delta = self.correction(torch.cat([z.to(states.dtype), states], dim=-1))
        return base + delta.to(base.dtype)

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # [B, T], right-padded
        loss_mask: Tensor | None = None,  # [B, T]: anchors only where x_{t+1} is trained
    ) -> DraftOutput:
        positions, z = self.train_blocks(target, input_ids, target_out, attention_mask, loss_mask)
        B, N, P, _ = z.shape
        T = input_ids.shape[1]
        head = vocab.head_rows(target.lm_head.weight, self.vocab_ids)  # [V_draft, H]
        base = self.logits(z[:, :, 1:], head)  # [B, N, P-1, V_draft]
        # Teacher forcing: block position i reads x_{t+1}..x_{t+i}. Past the sequence end the
        # tokens are clamped (those positions are past T and never trained).
        t = positions.clamp_min(0)
        idx = (t[..., None] + 1 + torch.arange(P - 1, device=t.device)).clamp_max(T - 1)
        prev = input_ids.gather(1, idx.view(B, -1)).view(B, N, P - 1)  # [B, N, P-1]
        with torch.no_grad():
            prev_embeds = target.embed_tokens(prev)  # [B, N, P-1, H]
        states = self.prefix_states(prev_embeds.view(B * N, P - 1, -1)).view(B, N, P - 1, -1)
        final = self.corrected(base, z[:, :, 1:], states)  # [B, N, P-1, V]
        weight = self.base_loss_weight if self.training else 0.0
        return DraftOutput(
            logits=list(final.unbind(2)),
            offsets=list(range(1, self.block_size)),
            positions=positions,
            offset_weights=self.offset_weights(),
            base_logits=list(base.unbind(2)) if weight > 0 else None,
            base_loss_weight=weight,
            vocab_ids=self.vocab_ids,
            extras={"base_loss_weight": torch.tensor(weight), **vocab.extras(self)},
        )


def from_target(
    target: Target,
    token_counts: Tensor | None = None,  # [V] training label counts: the reduced vocabulary
    block_size: int = 8,
    num_layers: int = 1,
    layers: list[int] | None = None,
    num_anchors: int | None = 32,
    gamma: float | None = 4.0,
    intermediate_size: int | None = None,
    gru_hidden_size: int = 256,
    correction_size: int = 256,
    lambda_start: float = 1.0,
    decay_ratio: float = 0.5,
    vocab_size: int | str = "full",
) -> DominoDraft:
    """A Domino draft sized from `target`: models.dflash.from_target's arguments, plus the
    correction head's GRU state size and projection width, and the curriculum (base-loss
    weight lambda_start at the start, 0 from decay_ratio of training on)."""
    draft = DominoDraft(
        **draft_sizes(target, intermediate_size),
        hidden_layers=tuple(check_layers(target, layers, num_layers)),
        num_layers=num_layers,
        block_size=block_size,
        num_anchors=num_anchors,
        gamma=gamma,
        **draft_vocab(target, vocab_size),
        gru_hidden_size=gru_hidden_size,
        correction_size=correction_size,
        lambda_start=lambda_start,
        decay_ratio=decay_ratio,
    )
    init_from_target(draft, target, token_counts)
    return draft.to(device=target.device)
