"""DFlash block drafts (z-lab `dflash`, "DFlash: Block Diffusion for Flash Speculative
Decoding"; SpecForge `OnlineDFlashModel`, speculators `DFlashDraftModel`): ONE draft forward
proposes a whole block.

The block at anchor position a holds the anchor token x_a (the newest token, whose target
feature is not known yet) and block_size - 1 mask positions, at positions a..a+B-1. Block
position i (1..B-1) predicts the token AT position a + i, all in parallel: no drafted token
is fed back. What the block knows of the sequence comes from the target:

    c_j   = hidden_norm(fc(cat(h_l1, h_l2, ..)_j))            # taps of several target layers, fused
    layer: q       = q_proj(input_layernorm(x))                # x: the block's hidden [B, N, B, H]
           k, v    = k_proj / v_proj of [c_0..c_{a-1} ; input_layernorm(x)]
           x      += o_proj(attn(q, k, v)) ; x += mlp(post_attention_layernorm(x))
    logits_i = lm_head(norm(x_i))                              # the target's frozen head, full vocabulary

Every draft layer reads the context c as keys/values (its own k_proj / v_proj), never as
queries, so the context's keys and values depend on the target features only: decoding
caches them once per verified position (decoding/drafters/dflash.py). A block sees the
context STRICTLY before its anchor (j < a: the anchor's own target feature does not exist
when drafting) and attends bidirectionally inside itself (the mask positions carry no
tokens, so nothing there can leak an answer); blocks never see each other.

Alignment (models/protocol.py): a block is indexed by t = a - 1, the newest position whose
target feature it reads. Block position i predicts x_{t+1+i}, which the target predicts at
position t + i: offset i, `DraftOutput.offsets = [1..B-1]`. Loss weight of block position i:
exp(-(i-1)/gamma) (DFlash; gamma = 7 for B = 16, 5 for 10, 4 for 8), `offset_weights`.

Training samples anchors: `num_anchors` per row on average, drawn uniformly over the batch
from the positions t whose anchor x_{t+1} is an answer token (loss_mask[t] = 1, the training
loop passes the batch's loss mask; SpecForge samples the same way). That is where decoding
puts blocks: the first block's anchor is the first answer token, which the target's prefill
emits. A block anchored in the prompt would train nothing (every offset outside the loss
mask) and cost a full block. Without a loss mask every real position is a candidate. The
logits come back at the sampled positions only (`DraftOutput.positions`, [B, N]; -1 pads
rows with fewer anchors) and the training step gathers the target there
(train/core/step_stats.py). `num_anchors=None` takes every candidate.

Frozen pieces from the target at call time: the embedding (the anchor token) and the output
head (with a reduced vocabulary, models/vocab.py: its rows at the draft ids `vocab_ids`).
Trained: fc, hidden_norm, the layers, norm (initialised from the target's final norm) and
`mask_embedding`, the one input vector of every mask position (DFlash uses a spare token id
of the target's vocabulary; a learned vector needs none). The served variant
(`mask_token_id` set, `qk_norm=True`; +experiment=dflash_served_kl) is the layout serving
engines load (speculators' `dflash`, z-lab's): the mask positions read the target's frozen
embedding of `mask_token_id` (a non-persistent buffer `mask_vector`, not trained), and the
layers normalise queries and keys per head as Qwen3 layers do (train/formats/dflash.py
exports it). Domino (models/domino.py) adds a
causal correction head to this backbone. Both build their layers from models/dflash_layer.py
and start from the target through models/dflash_init.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from models import vocab
from models.dflash_init import (
    check_layers,
    draft_sizes,
    draft_vocab,
    init_from_target,
    resolve_mask_token,
)
from models.dflash_layer import DFlashLayer
from models.protocol import DraftOutput
from models.target import Target, TargetOutput


class DFlashDraft(nn.Module):
    kind = "dflash"

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        max_position_embeddings: int,
        rope_parameters: dict,
        hidden_layers: tuple[int, ...],
        rms_norm_eps: float = 1e-5,
        hidden_act: str = "silu",
        num_layers: int = 1,
        block_size: int = 8,
        num_anchors: int | None = 32,
        gamma: float | None = 4.0,
        target_vocab_size: int | None = None,
        draft_vocab_size: int | None = None,  # None = the target's whole head
        mask_token_id: int | None = None,  # None: a learned mask vector; an id: its embedding
        qk_norm: bool = False,  # Qwen3's per-head q/k norms (the served layout)
    ):
        super().__init__()
        if block_size < 2:
            raise ValueError(
                f"block_size={block_size}: a block is the anchor plus at least one predicted "
                "position; use block_size >= 2 (DFlash: 16)"
            )
        if num_layers < 1:
            raise ValueError(f"num_layers={num_layers}: a DFlash draft needs at least 1 layer")
        if num_anchors is not None and num_anchors < 1:
            raise ValueError(
                f"num_anchors={num_anchors}: sample at least 1 anchor per row, or null for all"
            )
        if gamma is not None and not gamma > 0:
            raise ValueError(f"gamma={gamma}: the position weights exp(-(i-1)/gamma) need > 0")
        if not hidden_layers:
            raise ValueError("a DFlash draft reads at least one target layer (hidden_layers)")
        self.hidden_layers = tuple(hidden_layers)
        self.block_size, self.num_anchors, self.gamma = block_size, num_anchors, gamma
        self.config = LlamaConfig(
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=dict(rope_parameters),
            rms_norm_eps=rms_norm_eps,
            hidden_act=hidden_act,
        )
        H = hidden_size
        self.fc = nn.Linear(len(self.hidden_layers) * H, H, bias=False)  # fuses the taps
        self.hidden_norm = LlamaRMSNorm(H, eps=rms_norm_eps)  # on the fused context
        self.layers = nn.ModuleList(DFlashLayer(self.config, qk_norm) for _ in range(num_layers))
        self.norm = LlamaRMSNorm(H, eps=rms_norm_eps)  # before the shared head
        self.mask_token_id, self.qk_norm = mask_token_id, qk_norm
        if mask_token_id is None:
            self.mask_embedding = nn.Parameter(torch.zeros(H))  # every mask position's input
        else:  # the target's embedding of the id, frozen; set by from_target, never saved
            self.register_buffer("mask_vector", torch.zeros(H), persistent=False)
        self.target_vocab_size, self.draft_vocab_size = target_vocab_size, draft_vocab_size
        vocab.attach(self, "ids", draft_vocab_size, target_vocab_size)  # vocab_ids [N] or None
        # inv_freq is a non-persistent buffer; decoding copies go through
        # models.dtypes.cast_keep_rotary, which keeps it float32.
        self.rotary = LlamaRotaryEmbedding(self.config)

    # -- the pieces shared by training and drafting -------------------------------------
    def context(self, hidden: dict[int, Tensor]) -> Tensor:
        """Target hidden layers -> the fused context c [B, L, H]."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise ValueError(
                f"target output lacks hidden layers {missing}; run the target with "
                f"hidden_layers={self.hidden_layers}"
            )
        dtype = self.fc.weight.dtype
        taps = torch.cat([hidden[layer].to(dtype) for layer in self.hidden_layers], dim=-1)
        return self.hidden_norm(self.fc(taps))  # [B, L, H]

    def context_kv(self, ctx: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Context [B, L, H] at positions [B|1, L] -> every layer's keys and values
        [B, h, L, D]: what a block reads of the sequence."""
        cos, sin = self.rotary(ctx, positions)  # [B|1, L, D]
        return [layer.self_attn.context_kv(ctx, cos, sin) for layer in self.layers]

    def blocks(
        self,
        anchor_embeds: Tensor,  # [B, N, H] embedding of each block's anchor token
        anchor_positions: Tensor,  # [B, N] long: the anchor's position a
        kv: list[tuple[Tensor, Tensor]],  # context_kv(...): [B, h, C, D] per layer
        ctx_mask: Tensor,  # [B, N, C] bool: the context entries each block sees (j < a)
    ) -> Tensor:
        """N blocks per row in one pass -> their normed hidden [B, N, block_size, H];
        position 0 is the anchor, position i predicts the token at a + i."""
        B, N, H = anchor_embeds.shape
        P = self.block_size
        dtype = self.fc.weight.dtype
        mask = self.mask_embedding if self.mask_token_id is None else self.mask_vector
        masks = mask.to(dtype).expand(B, N, P - 1, H)
        x = torch.cat([anchor_embeds.to(dtype)[:, :, None], masks], dim=2)  # [B, N, P, H]
        positions = anchor_positions[..., None] + torch.arange(P, device=x.device)  # [B, N, P]
        cos, sin = self.rotary(x, positions.view(B, N * P))  # [B, N*P, D]
        cos, sin = cos.view(B, N, P, -1), sin.view(B, N, P, -1)
        for layer, (ctx_k, ctx_v) in zip(self.layers, kv, strict=True):
            x = layer(x, cos, sin, ctx_k, ctx_v, ctx_mask)
        return self.norm(x)  # [B, N, P, H]

    def logits(self, h: Tensor, head_weight: Tensor) -> Tensor:
        """Normed hidden [..., H] -> logits [..., V] through the target's frozen head
        (`head_weight`: its rows at the draft vocabulary, models.vocab.head_rows).

        Flattened to 2D first: the callers pass slices of the block (h[:, :, 1:]) whose
        leading dims do not fold into one, and torch.matmul then broadcasts the head to a
        batched matmul, copying the whole [H, V] head once per batch entry (docs/design.md
        §6, "A head over a slice")."""
        flat = h.to(head_weight.dtype).reshape(-1, h.shape[-1])  # copies the small side only
        return F.linear(flat, head_weight).view(*h.shape[:-1], head_weight.shape[0])

    def offset_weights(self) -> list[float] | None:
        """exp(-(i-1)/gamma) for block position i = 1..B-1; None = train.offset_decay ** i."""
        if self.gamma is None:
            return None
        return [math.exp(-i / self.gamma) for i in range(self.block_size - 1)]

    # -- training ----------------------------------------------------------------------
    def sample_anchors(self, real: Tensor, loss_mask: Tensor | None = None) -> Tensor:
        """real [B, T] bool (right-padded), loss_mask [B, T] (1 at t: x_{t+1} is trained)
        -> block positions t [B, N] long, ascending per row, -1 = padding: t in 0..T-2 with
        x_{t+1} real and, given a loss mask, loss_mask[t] = 1 (the anchor is an answer
        token); `num_anchors` x B of them drawn uniformly from the whole batch (every
        candidate the same chance), all when num_anchors is None or there are fewer."""
        B, T = real.shape
        cand = real[:, 1:]  # [B, T-1]: t whose anchor token x_{t+1} is real
        if loss_mask is not None:
            cand = cand & loss_mask[:, :-1].bool()  # ... and an answer token
        chosen = cand
        total = int(cand.sum())
        if self.num_anchors is not None and self.num_anchors * B < total:
            score = torch.rand(B, T - 1, device=real.device).masked_fill(~cand, 2.0)
            pick = score.flatten().topk(self.num_anchors * B, largest=False).indices
            chosen = torch.zeros(B * (T - 1), dtype=torch.bool, device=real.device)
            chosen[pick] = True
            chosen = chosen.view(B, T - 1)
        N = max(int(chosen.sum(1).max()), 1)
        t = torch.arange(T - 1, device=real.device).expand(B, -1)
        order = torch.where(chosen, t, T).sort(dim=1).values[:, :N]  # not chosen sorts last
        return torch.where(order < T, order, -1)  # [B, N]

    def train_blocks(
        self,
        target: Target,
        input_ids: Tensor,
        target_out: TargetOutput,
        attention_mask: Tensor | None,
        loss_mask: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        """The training pass: sampled block positions t [B, N] (-1 = padding) and their
        blocks' normed hidden [B, N, block_size, H] (anchor x_{t+1} at position t+1)."""
        vocab.require(self)  # the mapping was checked when built or loaded
        B, T = input_ids.shape
        if T < 2:
            raise ValueError(f"sequence length {T}: a block needs an anchor after a context")
        real = torch.ones_like(input_ids, dtype=torch.bool)
        if attention_mask is not None:
            real = attention_mask.bool()
            if (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
                raise ValueError(
                    "DFlash training expects right-padded batches (train.data.prepare.collate "
                    "pads right)"
                )
        ctx = self.context(target_out.hidden)  # [B, T, H]
        if loss_mask is not None and loss_mask.shape != input_ids.shape:
            raise ValueError(
                f"loss_mask {tuple(loss_mask.shape)} does not match input_ids "
                f"{tuple(input_ids.shape)}: pass the batch's own loss mask"
            )
        positions = self.sample_anchors(real, loss_mask)  # [B, N]
        t = positions.clamp_min(0)  # padding rows compute a block at t = 0, never trained
        kv = self.context_kv(ctx, torch.arange(T, device=ctx.device)[None])
        with torch.no_grad():
            anchor_embeds = target.embed_tokens(input_ids.gather(1, t + 1))  # [B, N, H]
        keys = torch.arange(T, device=ctx.device)
        ctx_mask = (keys[None, None, :] <= t[..., None]) & real[:, None, :]  # [B, N, T]
        return positions, self.blocks(anchor_embeds, t + 1, kv, ctx_mask)

    def set_progress(self, progress: float) -> None:
        """No schedule of its own: training progress changes nothing here."""

    def decoding_target(self, target: Target) -> Target:
        """The decoder verifies with the frozen target itself."""
        return target

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # [B, T], right-padded
        loss_mask: Tensor | None = None,  # [B, T]: anchors only where x_{t+1} is trained
    ) -> DraftOutput:
        positions, h = self.train_blocks(target, input_ids, target_out, attention_mask, loss_mask)
        head = vocab.head_rows(target.lm_head.weight, self.vocab_ids)  # [V_draft, H]
        logits = self.logits(h[:, :, 1:], head)  # [B, N, P-1, V_draft]
        return DraftOutput(
            logits=list(logits.unbind(2)),
            offsets=list(range(1, self.block_size)),
            positions=positions,
            offset_weights=self.offset_weights(),
            vocab_ids=self.vocab_ids,
            extras=vocab.extras(self),
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
    vocab_size: int | str = "full",
    mask_token_id: int | str | None = None,
    qk_norm: bool = False,
) -> DFlashDraft:
    """A DFlash draft sized from `target`. `block_size`: anchor + predicted positions (at
    most block_size - 1 drafts per forward). `layers`: target hidden_states indices to fuse
    (None: DFlash's spread over the target, `default_layers`). `num_anchors`: blocks per row
    per training step on average, anchored at answer tokens (None: every one). `gamma`: position weights
    exp(-(i-1)/gamma) (None: train.offset_decay ** (i-1)). `vocab_size`: "full" (the
    target's head, as DFlash) or N: predict over the N most frequent trained tokens, the
    target's head rows for them (EAGLE-3's reduced vocabulary; needs `token_counts` or a
    checkpoint's vocab_ids). `mask_token_id`: None (a learned mask vector), an id, or "auto"
    (the tokenizer's mask token, else its pad token): the mask positions read the target's
    embedding of it; with `qk_norm` the served layout (module docstring)."""
    draft = DFlashDraft(
        **draft_sizes(target, intermediate_size),
        **draft_vocab(target, vocab_size),
        hidden_layers=tuple(check_layers(target, layers, num_layers)),
        num_layers=num_layers,
        block_size=block_size,
        num_anchors=num_anchors,
        gamma=gamma,
        mask_token_id=resolve_mask_token(target, mask_token_id),
        qk_norm=qk_norm,
    )
    init_from_target(draft, target, token_counts)
    return draft.to(device=target.device)
