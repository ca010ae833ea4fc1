"""How a fresh EAGLE draft (models/eagle.py) starts from its target: the default taps of
EAGLE-3, the reduced draft vocabulary built from the training data (d2t/t2d), and the
identity init that makes a new head predict roughly the target's own next token."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / middle / high taps spread over depth, as EAGLE-3 (hidden_states indices
    2, L/2, L-3: outputs of layers 1, L/2-1 and L-4). SmolLM2 (L=30): (2, 15, 27)."""
    return (min(2, num_layers), max(num_layers // 2, 1), max(num_layers - 3, 1))


def build_vocab_map(
    token_counts: Tensor, size: int, always_keep: list[int] = ()
) -> tuple[Tensor, Tensor]:
    """The `size` most frequent target ids (ties -> lower id; `always_keep` forced in, e.g.
    EOS), sorted by id. Returns d2t [size] long (target id = i + d2t[i]) and t2d [V] bool."""
    counts = token_counts.detach().flatten().double().cpu()
    vocab = counts.numel()
    if not 0 < size <= vocab:
        raise ValueError(f"draft vocab size must be in 1..{vocab} (target vocab), got {size}")
    counts[list(always_keep)] = float("inf")
    keep = torch.argsort(counts, descending=True, stable=True)[:size]
    target_ids = keep.sort().values  # [size]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(size), t2d


def identity_init(
    input_proj: nn.Linear,  # [H, 2H]: feature half, then token half
    fuse: nn.Linear | None,  # [H, n*H] over the n taps, None for a single tap
    hidden_layers: tuple[int, ...],
    layer: LlamaDecoderLayer,
) -> None:
    """Start as a pass-through of the deepest tapped target feature (in place).

    A randomly initialised head sends a random unit-RMS direction through the target's norm
    and head: logits with std ~6 on SmolLM2, a peaked random q, KL ~23 nats per position and
    vanishing TV gradients (measured: TV training stalled at alpha ~0.03). Selecting the deepest
    tap in `fuse`, the feature half of `input_proj`, and zeroing the layer's output projections
    makes a fresh head predict roughly the target's own next-token distribution instead:
    a sane start that every loss can improve. The token half of `input_proj` keeps a small
    random init so the embedding's gradient is not zero."""
    H = input_proj.weight.shape[0]
    eye = torch.eye(H, dtype=input_proj.weight.dtype)
    if fuse is not None:
        depth = [la if la >= 0 else float("inf") for la in hidden_layers]  # -1 = last
        deepest = depth.index(max(depth))
        fuse.weight.zero_()
        fuse.weight[:, deepest * H : (deepest + 1) * H] = eye
    input_proj.weight[:, :H] = eye
    input_proj.weight[:, H:].mul_(0.1)
    if input_proj.bias is not None:
        input_proj.bias.zero_()
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
