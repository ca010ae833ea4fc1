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
    layer: nn.Module,  # models.eagle_layer.EagleLayer
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


def target_layer_init(
    target: Target,
    hidden_layers: tuple[int, ...],
    tap_scale: Tensor,  # [n] the fixed input scale of each tap (EagleDraft.tap_scale)
    fc: nn.Linear,  # [H, n*H] over the n taps
    layer: nn.Module,  # models.eagle_layer.EagleLayer, EAGLE-3 style (2H-wide q/k/v)
) -> int:
    """Start EAGLE-3's decoder layer as the target layer that the deepest tap enters (in
    place); returns that layer's index.

    hidden_states[d] is the input of the target's layer d, so with `fc` selecting the deepest
    tap (as `identity_init`), the feature half of q/k/v, `hidden_norm`, o_proj, the
    post-attention norm and the MLP copied from layer d, and the embedding half of q/k/v
    zero, the first unroll step computes s * hidden_states[d + 1] at every position (its
    attention reads the same keys the target's does): the draft starts one target layer
    deeper than the logit lens, with a working attention and MLP to adapt instead of zeros.
    s is the deepest tap's scale: the norms inside the layer do not see it, so o_proj and
    down_proj are scaled by s to keep the residual stream in the tap's units. The last tap
    (-1, or L: after the final norm) has no layer after it; layer L - 1 is used then."""
    L, H = target.num_layers, fc.weight.shape[0]
    depth = [la if 0 <= la < L else L - 1 for la in hidden_layers]
    deepest = max(range(len(depth)), key=lambda i: depth[i])
    source = target.model.model.layers[depth[deepest]]
    s = float(tap_scale[deepest])
    fc.weight.zero_()
    fc.weight[:, deepest * H : (deepest + 1) * H] = torch.eye(H, dtype=fc.weight.dtype)
    attn, theirs = layer.self_attn, source.self_attn
    for name in ("q_proj", "k_proj", "v_proj"):
        mine, src = getattr(attn, name), getattr(theirs, name)
        if mine.weight.shape != (src.weight.shape[0], 2 * H):
            raise ValueError(
                f"draft {name} is {tuple(mine.weight.shape)}, the target layer's "
                f"{tuple(src.weight.shape)}: init=target_layer needs the target's head layout"
            )
        mine.weight.zero_()
        mine.weight[:, H:] = src.weight.float()
        if mine.bias is not None:
            mine.bias.copy_(src.bias if src.bias is not None else torch.zeros_like(mine.bias))
    attn.o_proj.weight.copy_(theirs.o_proj.weight.float() * s)
    if attn.o_proj.bias is not None:
        attn.o_proj.bias.copy_(theirs.o_proj.bias.float() * s)
    layer.hidden_norm.weight.copy_(source.input_layernorm.weight)
    layer.post_attention_layernorm.weight.copy_(source.post_attention_layernorm.weight)
    mlp, src_mlp = layer.mlp, source.mlp
    if mlp.gate_proj.weight.shape != src_mlp.gate_proj.weight.shape:
        raise ValueError(
            f"draft MLP is {tuple(mlp.gate_proj.weight.shape)}, the target layer's "
            f"{tuple(src_mlp.gate_proj.weight.shape)}: init=target_layer needs "
            "intermediate_size: null (the target's)"
        )
    mlp.gate_proj.weight.copy_(src_mlp.gate_proj.weight)
    mlp.up_proj.weight.copy_(src_mlp.up_proj.weight)
    mlp.down_proj.weight.copy_(src_mlp.down_proj.weight.float() * s)
    return depth[deepest]
