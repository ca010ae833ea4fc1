"""The pieces every distillation loss is built from (train/losses/divergences.py, train/losses/family.py):
per-row divergences between draft and target logits, the decoder's alpha per row, and the
chunked, masked reduction over positions with activation checkpointing (the memory note of
train/losses/divergences.py's docstring). A `*_rows` function maps a chunk of rows [n, V] to [n]."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from decoding.drafter import Sampling
from train.losses.acceptance import accept_rows


def log_probs(logits: Tensor, temperature: float) -> Tensor:
    # fp32 maths whatever the logits' dtype; clamp so -inf never enters a product.
    logp = F.log_softmax(logits.float() / temperature, dim=-1)  # [n, V]
    return logp.clamp_min(torch.finfo(logp.dtype).min)


def forward_kl_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    logq, logp = log_probs(draft, temperature), log_probs(target, temperature)
    return (logp.exp() * (logp - logq)).sum(-1)  # [n] KL(p || q)


def reverse_kl_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    logq, logp = log_probs(draft, temperature), log_probs(target, temperature)
    return (logq.exp() * (logq - logp)).sum(-1)  # [n] KL(q || p)


def tv_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    q = F.softmax(draft.float() / temperature, dim=-1)
    p = F.softmax(target.float() / temperature, dim=-1)
    return 0.5 * (p - q).abs().sum(-1)  # [n]


def ce_rows(draft: Tensor, labels: Tensor, temperature: float) -> Tensor:
    return -log_probs(draft, temperature).gather(-1, labels.long()).squeeze(-1)  # [n]


def masked_reduce(
    rows_fn: Callable[..., Tensor],  # (draft [n, V], *rows) -> [n]; options bound by partial
    draft_logits: Tensor,  # [N, V]
    rows: tuple[Tensor | None, ...],  # per position: [N, V] target, [N, 1] labels, [N]; or None
    mask: Tensor,  # [N]
    chunk_size: int,
    reduction: str,
    checkpointed: bool = True,  # False: rows_fn keeps what its own backward needs
) -> Tensor:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    keep = mask.bool()
    draft_logits = draft_logits[keep]  # [M, V]
    rows = tuple(None if r is None else r[keep] for r in rows)
    total = draft_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, draft_logits.shape[0], chunk_size):
        d = draft_logits[start : start + chunk_size]
        chunk = tuple(None if r is None else r[start : start + chunk_size] for r in rows)
        if d.requires_grad and checkpointed:  # recompute the [n, V] temporaries in backward
            out = checkpoint(rows_fn, d, *chunk, use_reentrant=False)
        else:
            out = rows_fn(d, *chunk)
        total = total + out.sum()
    if draft_logits.shape[0] == 0:
        total = total + 0.0 * draft_logits.sum()  # keep the graph connected on empty masks
    if reduction == "sum":
        return total
    return total / max(int(keep.sum()), 1)


def check_log_norm(target_log_norm: Tensor | None, mask: Tensor) -> None:
    if target_log_norm is not None and target_log_norm.shape != mask.shape:
        raise ValueError(
            f"target_log_norm {tuple(target_log_norm.shape)} must be [N] = "
            f"[{mask.shape[0]}]: the logsumexp of each FULL-vocabulary target row / temperature"
        )


def decoder_cutoffs(target: Tensor, log_norm: Tensor | None, temperature: float) -> Tensor:
    """[n, 2] (cut, lse) for accept_rows at the loss temperature, no top-k / top-p: p at the
    draft ids is exp(z - lse) with lse the FULL target row's logsumexp (`log_norm`), or this
    row's own when log_norm is None (the target logits are the full vocabulary)."""
    if log_norm is None:
        log_norm = (target.float() / temperature).logsumexp(-1)  # [n]
    log_norm = log_norm.float()
    return torch.stack([torch.full_like(log_norm, float("-inf")), log_norm], -1)


def alpha_rows(
    draft: Tensor, target: Tensor, log_norm: Tensor | None, temperature: float
) -> Tensor:
    """[n] alpha = sum over the draft ids of min(p, q) as the decoder sees it, differentiable
    in the draft logits (the same maths as acceptance_proxy)."""
    cutoffs = decoder_cutoffs(target, log_norm, temperature)
    return accept_rows(draft, target, cutoffs, Sampling(temperature=temperature))
