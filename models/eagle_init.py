"""How a fresh EAGLE draft (models/eagle.py) starts from its target: the default taps of
EAGLE-3, their fixed input scale, and the identity init that makes a new head predict
roughly the target's own next token. Its reduced draft vocabulary (d2t/t2d) is built by
models/vocab.py."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.target import Target


def default_eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """Low / middle / high taps spread over depth: hidden_states indices 2, L/2, L-3 (the
    residual stream entering layers 2, L/2, L-3), the taps vLLM and SGLang capture when a
    draft names none. SmolLM2 (L=30): (2, 15, 27)."""
    return (min(2, num_layers), max(num_layers // 2, 1), max(num_layers - 3, 1))


def measure_tap_scale(target: Target, layers: tuple[int, ...], seed: int = 0) -> Tensor:
    """[n] float32: 1 / (median per-token RMS of each tapped hidden state), rounded to a power
    of two, measured on one short forward over seeded random token ids, position 0 left out
    (the attention-sink position carries massive activations: RMS ~940 on SmolLM2 vs 3-21
    elsewhere). Random ids stand in for text: on SmolLM2 (bf16) their medians are within 30%
    of real text's (taps 2/15/27: 3.9/6.6/19.7 vs 3.0/6.7/21.3), and the scale only needs the
    right order. A power of two makes folding it into the served fc weight exact (export
    and re-import give bit-identical logits)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.vocab_size, (2, 33), generator=g).to(target.device)
    with torch.no_grad():
        hidden = target(ids, hidden_layers=tuple(layers), logits=False, use_cache=False).hidden
    rms = [hidden[la][:, 1:].float().pow(2).mean(-1).sqrt().median() for la in layers]
    return torch.exp2(-torch.stack(rms).clamp_min(1e-6).log2().round()).cpu()


def identity_init(
    fc: nn.Linear,  # EAGLE-3: [H, n*H] over the n taps; EAGLE-1: [H, 2H] over [embedding, feature]
    hidden_layers: tuple[int, ...],
    layer: nn.Module,  # models.eagle.EagleLayer
    style: str,
) -> None:
    """Start as a logit lens of the deepest tapped target feature (in place).

    A randomly initialised head sends a random unit-RMS direction through the target's norm
    and head: logits with std ~6 on SmolLM2, a peaked random q, KL ~23 nats per position and
    vanishing TV gradients (measured: TV training stalled at alpha ~0.03). With `fc` selecting
    the deepest tap (EAGLE-3; the scaled tap, so g ~ unit RMS) or the feature half (EAGLE-1)
    and the layer's output projections zeroed, h = g at step 0 and a fresh head predicts
    lm_head(norm(deepest tap)), roughly the target's own next-token distribution: a sane
    start that every loss can improve. EAGLE-1's embedding half keeps a small random init
    so the embedding's gradient is not zero."""
    H = fc.weight.shape[0]
    eye = torch.eye(H, dtype=fc.weight.dtype)
    if style == "eagle3":
        depth = [la if la >= 0 else float("inf") for la in hidden_layers]  # -1 = last
        deepest = depth.index(max(depth))
        fc.weight.zero_()
        fc.weight[:, deepest * H : (deepest + 1) * H] = eye
    else:
        fc.weight[:, :H].mul_(0.1)  # embedding half
        fc.weight[:, H:] = eye  # feature half
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
