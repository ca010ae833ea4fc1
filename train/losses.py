"""Distillation losses between a draft distribution q and the frozen target's p.

Every loss is a plain function
    loss(draft_logits [N, V], target_logits [N, V], mask [N], temperature=1.0) -> scalar
returning the masked mean over positions (or the masked sum with reduction="sum", which
the training loop uses to normalise by the global token count across ranks and
micro-batches). Per-offset weights (gamma^i) are applied by the caller.

Memory: with V = 49k-150k, one [N, V] float32 temporary at N = 2k positions is 0.4-1.2 GB,
and a divergence needs several (two softmaxes, two log-softmaxes, products). So positions
are processed in chunks of `chunk_size`, and under autograd each chunk is wrapped in
activation checkpointing: only the chunk's inputs (views of the logits) are kept, the
temporaries are recomputed in backward. Chunked = unchunked in value and gradient.

-inf logits (top-k masking) are safe: log-probabilities are clamped to the dtype's
finite minimum before any product, so 0 * (-inf) never appears and gradients stay finite.
One exception is real, not numerical: KL(q || p) is +inf when the draft puts mass where a
truncated target has none; use kl or tv against top-k-truncated target logits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 1024  # positions per chunk: 1024 x 49152 fp32 = 200 MB per temporary


def _log_probs(logits: Tensor, temperature: float) -> Tensor:
    # fp32 maths whatever the logits' dtype; clamp so -inf never enters a product.
    logp = F.log_softmax(logits.float() / temperature, dim=-1)  # [n, V]
    return logp.clamp_min(torch.finfo(logp.dtype).min)


def _forward_kl_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    logq, logp = _log_probs(draft, temperature), _log_probs(target, temperature)
    return (logp.exp() * (logp - logq)).sum(-1)  # [n] KL(p || q)


def _reverse_kl_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    logq, logp = _log_probs(draft, temperature), _log_probs(target, temperature)
    return (logq.exp() * (logq - logp)).sum(-1)  # [n] KL(q || p)


def _tv_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    q = F.softmax(draft.float() / temperature, dim=-1)
    p = F.softmax(target.float() / temperature, dim=-1)
    return 0.5 * (p - q).abs().sum(-1)  # [n]


def _ce_rows(draft: Tensor, labels: Tensor, temperature: float) -> Tensor:
    return -_log_probs(draft, temperature).gather(-1, labels.long()).squeeze(-1)  # [n]


def _min_rows(draft: Tensor, target: Tensor, temperature: float) -> Tensor:
    q = F.softmax(draft.float() / temperature, dim=-1)
    p = F.softmax(target.float() / temperature, dim=-1)
    return torch.minimum(p, q).sum(-1)  # [n] expected acceptance of one drafted token


def _check(draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float) -> None:
    if draft_logits.shape != target_logits.shape or draft_logits.dim() != 2:
        raise ValueError(
            f"draft_logits {tuple(draft_logits.shape)} and target_logits "
            f"{tuple(target_logits.shape)} must both be [N, V] with the same V; restrict the "
            "target to the draft's vocab_ids before calling a loss"
        )
    if mask.shape != draft_logits.shape[:1]:
        raise ValueError(f"mask {tuple(mask.shape)} must be [N] = [{draft_logits.shape[0]}]")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _masked_reduce(
    rows_fn: Callable[[Tensor, Tensor, float], Tensor],
    draft_logits: Tensor,  # [N, V]
    other: Tensor,  # [N, V] target logits, or [N, 1] labels for CE
    mask: Tensor,  # [N]
    temperature: float,
    chunk_size: int,
    reduction: str,
) -> Tensor:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    keep = mask.bool()
    draft_logits, other = draft_logits[keep], other[keep]  # [M, V], [M, *]
    total = draft_logits.new_zeros((), dtype=torch.float32)
    for start in range(0, draft_logits.shape[0], chunk_size):
        d = draft_logits[start : start + chunk_size]
        o = other[start : start + chunk_size]
        if d.requires_grad:  # recompute the [n, V] temporaries in backward
            rows = checkpoint(rows_fn, d, o, temperature, use_reentrant=False)
        else:
            rows = rows_fn(d, o, temperature)
        total = total + rows.sum()
    if draft_logits.shape[0] == 0:
        total = total + 0.0 * draft_logits.sum()  # keep the graph connected on empty masks
    if reduction == "sum":
        return total
    return total / max(int(keep.sum()), 1)


def forward_kl(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """KL(p || q) = sum_x p log(p / q), p = target, q = draft: mode-covering."""
    _check(draft_logits, target_logits, mask, temperature)
    return _masked_reduce(
        _forward_kl_rows, draft_logits, target_logits, mask, temperature, chunk_size, reduction
    )


def reverse_kl(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """KL(q || p) = sum_x q log(q / p): mode-seeking."""
    _check(draft_logits, target_logits, mask, temperature)
    return _masked_reduce(
        _reverse_kl_rows, draft_logits, target_logits, mask, temperature, chunk_size, reduction
    )


def total_variation(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """TV(p, q) = 1/2 sum_x |p - q| = 1 - sum_x min(p, q): exactly 1 - expected acceptance."""
    _check(draft_logits, target_logits, mask, temperature)
    return _masked_reduce(
        _tv_rows, draft_logits, target_logits, mask, temperature, chunk_size, reduction
    )


def cross_entropy(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    labels: Tensor | None = None,  # [N] hard labels from the data; None = target argmax
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """-log q(y) with y the data's next token (`labels`) or the target's greedy token."""
    _check(draft_logits, target_logits, mask, temperature)
    if labels is None:
        labels = target_logits.argmax(-1)  # [N]
    if labels.shape != mask.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match mask {tuple(mask.shape)}")
    return _masked_reduce(
        _ce_rows, draft_logits, labels[:, None], mask, temperature, chunk_size, reduction
    )


@torch.no_grad()
def acceptance_proxy(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """Training proxy alpha = mean over positions of sum_x min(p, q) (= 1 - TV): the
    probability that one drafted token is accepted by rejection sampling at `temperature`."""
    _check(draft_logits, target_logits, mask, temperature)
    return _masked_reduce(
        _min_rows, draft_logits, target_logits, mask, temperature, chunk_size, reduction
    )


@torch.no_grad()
def top1_agreement(
    draft_logits: Tensor, target_logits: Tensor, mask: Tensor, reduction: str = "mean"
) -> Tensor:
    """Greedy proxy: fraction of positions where argmax q == argmax p (greedy acceptance)."""
    keep = mask.bool()
    same = (draft_logits[keep].argmax(-1) == target_logits[keep].argmax(-1)).float().sum()
    return same if reduction == "sum" else same / max(int(keep.sum()), 1)


def simulated_tau(alphas: list[float], k: int) -> float:
    """tau = 1 + sum_{i<=k} prod_{j<=i} alpha_j; offsets beyond the list reuse the last alpha
    (a draft LM predicts offset 1 only and is chained k times)."""
    if not alphas:
        raise ValueError("simulated_tau needs at least one alpha")
    tau, run = 1.0, 1.0
    for i in range(k):
        run *= alphas[min(i, len(alphas) - 1)]
        tau += run
    return tau


LOSSES: dict[str, Callable[..., Tensor]] = {
    "ce": cross_entropy,
    "kl": forward_kl,
    "rkl": reverse_kl,
    "tv": total_variation,
}
