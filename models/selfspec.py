"""Self-speculative drafts: the target's own first layers draft through a trained exit.

The draft is the frozen target's decoder layers 0..L-1 (L = `exit_layer`), then a small
trained exit, then the target's final norm and output head:

    h_L   = layers[0..L-1](emb(x))                         the target's own tensors, never copied
    e_t   = h_L + W_up SiLU(W_down RMSNorm(h_L))           the exit (W_up zero-initialised)
    q_t   = softmax(head(final_norm(e_t)))                 predicts x_{t+1}: offset 0

A fresh exit is the identity, so an untrained draft is the plain early exit (LayerSkip's
without its training); Kangaroo (arXiv 2404.18911) puts a trained adapter there, LayerSkip
(arXiv 2404.16710) trains the exit with an early-exit loss. Here the exit is trained with
any loss of train/losses against the target's next-token distribution, the target frozen.
The module holds the exit's weights only: layers, norm and head are read from `target` at
call time (checkpoints hold the exit; `hidden_layers = (L,)` makes the training step hand
over h_L, HF hidden_states[L], the output of layer L-1).

Decoding (decoding/drafters/selfspec.py) shares the target's ONE KV cache: a draft step
runs layers < L on the drafted token, writing their KV into the target's cache, and the
verify runs layers >= L only, from the cached h_L (`run_layers` runs any range of them).
This module holds the eager view (`SharedCacheTarget`, a DynamicCache); the compiled one
(`CompiledSharedCache`, a StaticKVCache) lives with the drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache
from transformers.utils.output_capturing import _active_collector

from models.masks import left_padding, positions_and_mask
from models.protocol import DraftOutput
from models.target import Target, TargetOutput


class SelfSpecExit(nn.Module):
    """The trained exit after the target's layer L-1: residual low-rank MLP, zero-initialised."""

    kind = "selfspec"

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        exit_layer: int,
        num_target_layers: int,
        rank: int = 256,
        rms_norm_eps: float = 1e-5,
        stop_below: float = 0.0,
    ):
        super().__init__()
        if not 1 <= exit_layer < num_target_layers:
            raise ValueError(
                f"exit_layer={exit_layer}: the draft is the target's layers 0..exit_layer-1 and "
                f"the verify runs the rest, so it must be in 1..{num_target_layers - 1} (the "
                f"target has {num_target_layers} layers); set draft.model.exit_layer"
            )
        if rank < 1:
            raise ValueError(f"rank={rank}: the exit's adapter needs rank >= 1 (draft.model.rank)")
        if not 0.0 <= stop_below < 1.0:
            raise ValueError(
                f"stop_below={stop_below}: a probability in [0, 1) (0 = always draft k tokens); "
                "set draft.model.stop_below"
            )
        self.vocab_size, self.exit_layer = vocab_size, exit_layer
        self.num_target_layers = num_target_layers
        # Kangaroo's early stop: a round stops drafting once the exit's top probability falls
        # under this (decoding/drafters/selfspec.py); 0 = k tokens every round.
        self.stop_below = stop_below
        self.hidden_layers = (exit_layer,)
        self.norm = nn.RMSNorm(hidden_size, eps=rms_norm_eps)
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)  # a fresh exit passes h_L through: the plain early exit

    def exit_logits(self, hidden: Tensor, target: Target) -> Tensor:
        """[..., H] h_L -> [..., V] the draft's logits through the exit, the target's final
        norm and head (the exit in its own dtype, norm and head in the target's)."""
        return target.head_logits(target.final_norm(self.adapt(hidden, target.dtype)))

    def adapt(self, hidden: Tensor, dtype: torch.dtype) -> Tensor:
        """[..., H] h_L -> [..., H] the exit's output in `dtype` (the target's), before the
        target's final norm and head (which the compiled drafter runs as a frozen graph)."""
        x = hidden.to(self.down.weight.dtype)
        return (x + self.up(F.silu(self.down(self.norm(x))))).to(dtype)

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # unused: h_L is the target's own, per position
        loss_mask: Tensor | None = None,  # unused: every position trains
    ) -> DraftOutput:
        if self.exit_layer not in target_out.hidden:
            raise ValueError(
                f"the self-speculative exit reads the target's hidden_states[{self.exit_layer}]; "
                "run the target with hidden_layers=draft.hidden_layers"
            )
        logits = self.exit_logits(target_out.hidden[self.exit_layer], target)  # [B, T, V]
        return DraftOutput(logits=[logits], offsets=[0])

    def set_progress(self, progress: float) -> None:
        pass

    def decoding_target(self, target: Target) -> SharedCacheTarget:
        """The target as this draft's rounds verify: `SharedCacheTarget`, its own weights,
        which runs only layers >= L over tokens the drafter already ran layers < L on."""
        return SharedCacheTarget(target, self.exit_layer)


@dataclass
class Drafted:
    """What a drafting round left in the shared cache: layers < L ran on `tokens` [B, m]
    (the round's newest token and its drafts but the last), their KV appended to `cache`
    after the entries of the committed tokens, giving `hidden` [B, m, H] = h_L."""

    cache: DynamicCache
    tokens: Tensor
    hidden: Tensor

    def continued_by(
        self,
        input_ids: Tensor,  # [B, T]
        cache: object,
        attention_mask: Tensor | None,
        position_ids: Tensor | None,
        hidden_layers: tuple[int, ...],
    ) -> bool:
        """Whether a verify call reuses this round: on its cache, starting with its tokens,
        with positions and a 2D mask given and no hidden layers asked for."""
        m = self.tokens.shape[1]
        return (
            cache is self.cache and not hidden_layers and position_ids is not None
            and (attention_mask is None or attention_mask.dim() == 2)
            and m <= input_ids.shape[1] and torch.equal(input_ids[:, :m], self.tokens)
        )  # fmt: skip


class SharedCacheTarget:
    """A `Target` whose forward reuses a drafting round's work (models/selfspec.py): called
    exactly like the target, every attribute the target's. When the drafter left `drafted`
    and the call's tokens start with its tokens, layers < L run only on the rest and layers
    >= L on all, from the drafted h_L; the cache then holds one entry per token in every
    layer, as after a plain forward. Any other call (the prefill, an AR step, a lookup
    round's proposal, hidden layers asked for) first drops what the round left in layers
    < L and runs the plain forward: the view is never wrong, at worst not faster."""

    same_weights = True  # not an adapted target (Medusa-2): its AR is the plain target's

    def __init__(self, target: Target, exit_layer: int):
        self.target, self.exit_layer = target, exit_layer
        self.drafted: Drafted | None = None

    def __getattr__(self, name: str):  # device, dtype, vocab_size, model, tokenizer, ...
        if name == "target":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.target, name)

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        cache: DynamicCache | None = None,
        attention_mask: Tensor | None = None,  # [B, past + T] 2D (1 = real token)
        position_ids: Tensor | None = None,  # [B, T]
        hidden_layers: tuple[int, ...] = (),
        logits: bool = True,
        use_cache: bool = True,
    ) -> TargetOutput:
        drafted, self.drafted = self.drafted, None
        args = (input_ids, cache, attention_mask, position_ids, hidden_layers)
        if drafted is None or not drafted.continued_by(*args):
            if drafted is not None:  # back to one entry per committed token in every layer
                for layer in drafted.cache.layers[: self.exit_layer]:
                    layer.crop(-drafted.tokens.shape[1])
            return self.target(input_ids, cache, attention_mask, position_ids, hidden_layers,
                               logits, use_cache)  # fmt: skip
        L, T, m = self.exit_layer, input_ids.shape[1], drafted.tokens.shape[1]
        past = cache.get_seq_length(L)  # entries of committed tokens; layers < L hold m more
        hidden = drafted.hidden
        pad = left_padding(attention_mask)  # [B] or None (the decode loop pads left)
        if m < T:  # the round's last draft: layers < L on it (and anything after it)
            embeds = self.target.embed_tokens(input_ids[:, m:])
            mask = positions_and_mask(past + m, T - m, pad, input_ids.device)[1]
            new = run_layers(self.target, embeds, 0, L, position_ids[:, m:], mask, cache)
            hidden = torch.cat([hidden, new], 1)  # [B, T, H]
        mask = positions_and_mask(past, T, pad, input_ids.device)[1]
        last = run_layers(self.target, hidden, L, self.target.num_layers, position_ids, mask, cache)
        last = self.target.final_norm(last)  # [B, T, H]
        return TargetOutput(self.target.head_logits(last) if logits else None, {}, cache)

    __call__ = forward

    def shallow_step(
        self, ids: Tensor, slot: int, pad: Tensor | None, cache: DynamicCache
    ) -> Tensor:
        """Layers < L on `ids` [B, 1], their KV appended to `cache` as its slot `slot` (a
        drafting round's step) -> [B, 1, H] h_L."""
        position, mask = positions_and_mask(slot, 1, pad, ids.device)  # [B|1, 1], mask
        x = self.target.embed_tokens(ids)
        return run_layers(self.target, x, 0, self.exit_layer, position, mask, cache)

    def exit_logits(self, draft: SelfSpecExit, hidden: Tensor) -> Tensor:
        """[B, H] h_L -> [B, V] the draft's logits."""
        return draft.exit_logits(hidden, self.target)


def run_layers(
    target: Target,
    hidden: Tensor,  # [B, T, H] the input of layer `start` (embeddings when start = 0)
    start: int,
    stop: int,
    position_ids: Tensor,  # [B|1, T]
    mask: Tensor | None,  # [B|1, 1, T, keys] bool (True = attend); None: one query sees all
    cache: DynamicCache | None,
) -> Tensor:
    """The target's decoder layers start..stop-1 on `hidden`, each writing its KV into its
    own slot of `cache` (a layer knows its index) -> [B, T, H], the output of layer stop-1
    (pre-norm: HF hidden_states[stop])."""
    model = target.model.model
    rope = model.rotary_emb(hidden, position_ids)  # cos, sin
    # transformers' output-capturing hooks on each layer read a ContextVar, which dynamo can
    # trace only once a model's own forward has set it: set to capture nothing, as a forward
    # asking for no extra outputs does (and reset, so no state outlives the call)
    token = _active_collector.set({})
    try:
        for layer in model.layers[start:stop]:
            hidden = layer(
                hidden,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=rope,
                cache=cache,
                use_cache=cache is not None,
            )
    finally:
        _active_collector.reset(token)
    return hidden


def from_target(
    target: Target,
    token_counts: Tensor | None = None,  # unused: the exit predicts over the full vocabulary
    exit_layer: int | None = None,  # None: an eighth of the target's layers, at least 1
    rank: int = 256,
    stop_below: float = 0.0,
) -> SelfSpecExit:
    """An exit after the target's layer exit_layer - 1, sized from the target."""
    if exit_layer is None:
        exit_layer = max(1, target.num_layers // 8)
    cfg = target.config
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
        raise ValueError(
            f"target {target.name!r} has sliding-window layers: the self-speculative drafter "
            "masks every layer alike, which would let them see past their window; use a "
            "target whose layers all attend fully, or another draft kind"
        )
    eps = getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_eps", 1e-5)
    exit_ = SelfSpecExit(
        target.hidden_size, target.vocab_size, exit_layer, target.num_layers, rank, eps,
        stop_below,
    )  # fmt: skip
    return exit_.to(device=target.device)
