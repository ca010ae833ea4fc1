"""Distillation losses between a draft distribution q and the frozen target's p.

Every loss is a plain function
    loss(draft_logits [N, V], target_logits [N, V], mask [N], temperature=1.0) -> scalar
returning the masked mean over positions (or the masked sum with reduction="sum", which
the training loop uses to normalise by the global token count across ranks and
micro-batches). Per-offset weights (gamma^i) are applied by the caller. A loss's own
options (LK's eta, ...) are keyword arguments set from its conf/loss/*.yaml (`loss_options`).

The TV family (`lk_lambda`, `lk_alpha`, `ce_tv_mix`) computes alpha = sum_x min(p, q) as the
decoder sees it: with a reduced draft vocabulary, p at the draft ids is the target's FULL-
vocabulary distribution, not renormalised, so the caller passes `target_log_norm` [N], the
logsumexp of the full target row at the loss temperature (None: target_logits is the full
vocabulary). The KL and CE terms, like `kl`, `ce` and `tv`, use the target renormalised over
the draft ids (KL(p || q) is infinite when q has no mass where p has).

Memory: with V = 49k-150k, one [N, V] float32 temporary at N = 2k positions is 0.4-1.2 GB,
and a divergence needs several (two softmaxes, two log-softmaxes, products). So positions
are processed in chunks of `chunk_size`, and under autograd each chunk is wrapped in
activation checkpointing: only the chunk's inputs (views of the logits) are kept, the
temporaries are recomputed in backward. Chunked = unchunked in value and gradient.

-inf logits (top-k masking) are safe: log-probabilities are clamped to the dtype's
finite minimum before any product, so 0 * (-inf) never appears and gradients stay finite.
One exception is real, not numerical: KL(q || p) is +inf when the draft puts mass where a
truncated target has none; use kl or tv against top-k-truncated target logits.

Acceptance proxies (`acceptance_proxy`, `top1_agreement`) measure what the decoder sees, not
what the loss sees: p is the target's FULL-vocabulary distribution after the decode's
temperature / top-k / top-p, and with a reduced draft vocabulary the sum runs over the draft
ids with that un-renormalised p (a token outside the draft vocabulary is always rejected).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from decoding.drafter import Sampling
from decoding.verify import sampling_probs

DEFAULT_CHUNK = 1024  # positions per chunk: 1024 x 49152 fp32 = 200 MB per temporary
PLAIN_SAMPLING = Sampling(temperature=1.0)  # temperature 1, no top-k / top-p


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
    rows_fn: Callable[..., Tensor],  # (draft [n, V], *rows) -> [n]; options bound by partial
    draft_logits: Tensor,  # [N, V]
    rows: tuple[Tensor | None, ...],  # per position: [N, V] target, [N, 1] labels, [N]; or None
    mask: Tensor,  # [N]
    chunk_size: int,
    reduction: str,
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
        if d.requires_grad:  # recompute the [n, V] temporaries in backward
            out = checkpoint(rows_fn, d, *chunk, use_reentrant=False)
        else:
            out = rows_fn(d, *chunk)
        total = total + out.sum()
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
    rows_fn = partial(_forward_kl_rows, temperature=temperature)
    return _masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


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
    rows_fn = partial(_reverse_kl_rows, temperature=temperature)
    return _masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


def total_variation(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """TV(p, q) = 1/2 sum_x |p - q| = 1 - sum_x min(p, q): exactly 1 - expected acceptance
    with a full vocabulary (a reduced one renormalises p over the draft ids; the TV family
    below uses the decoder's p)."""
    _check(draft_logits, target_logits, mask, temperature)
    rows_fn = partial(_tv_rows, temperature=temperature)
    return _masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


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
    rows_fn = partial(_ce_rows, temperature=temperature)
    return _masked_reduce(rows_fn, draft_logits, (labels[:, None],), mask, chunk_size, reduction)


@torch.no_grad()
def sampling_cutoffs(
    target_logits: Tensor,  # [N, V] the FULL target vocabulary
    sampling: Sampling,
    chunk_size: int = 256,  # top-p sorts [chunk, V] with int64 indices: keep it small
) -> Tensor:
    """[N, 2] per row (cut, lse) such that the decoder's p = sampling_probs(logits, sampling)
    is p(x) = exp(z_x - lse) where z_x >= cut, else 0, with z = logits / temperature.
    Two numbers per position stand for p over the whole vocabulary, so p at any subset of
    ids (a reduced draft vocabulary, each draft offset) costs no second pass over V.
    Equal to sampling_probs except that a top-p boundary inside a tie of equal logits keeps
    every tied token (sampling_probs keeps those its sort puts first)."""
    if sampling.greedy:
        raise ValueError("greedy decoding has no sampling distribution; use top1_agreement")
    out = []
    for start in range(0, target_logits.shape[0], chunk_size):
        z = target_logits[start : start + chunk_size].float() / sampling.temperature  # [n, V]
        cut = z.new_full(z.shape[:1], float("-inf"))  # [n]
        if 0 < sampling.top_k < z.shape[-1]:
            cut = z.topk(sampling.top_k, dim=-1).values[:, -1]
        if sampling.top_p < 1.0:
            # As sampling_probs: keep the sorted prefix whose mass before each token < top_p.
            ordered = z.masked_fill(z < cut[:, None], float("-inf")).sort(-1, descending=True)
            probs = ordered.values.softmax(-1)  # [n, V]
            kept = ((probs.cumsum(-1) - probs) < sampling.top_p).sum(-1)  # [n] >= 1
            cut = torch.maximum(cut, ordered.values.gather(-1, (kept - 1)[:, None])[:, 0])
        if sampling.top_k or sampling.top_p < 1.0:
            z = z.masked_fill(z < cut[:, None], float("-inf"))
        lse = z.logsumexp(-1)  # [n]
        out.append(torch.stack([cut, lse], -1))
    return torch.cat(out) if out else target_logits.new_zeros(0, 2, dtype=torch.float32)


def _accept_rows(draft: Tensor, target: Tensor, cutoffs: Tensor, sampling: Sampling) -> Tensor:
    q = sampling_probs(draft, sampling)  # [n, Vd] the drafter's q, over its own vocabulary
    z = target.float() / sampling.temperature  # [n, Vd] the target at the draft ids
    cut, lse = cutoffs[:, :1], cutoffs[:, 1:]
    p = torch.where(z >= cut, (z - lse).exp(), 0.0)  # [n, Vd] full-vocabulary p, not renormalised
    return torch.minimum(p, q).sum(-1)  # [n] expected acceptance of one drafted token


@torch.no_grad()
def acceptance_proxy(
    draft_logits: Tensor,  # [N, Vd]
    target_logits: Tensor,  # [N, Vd] the target at the draft's ids (all of V for a full vocab)
    mask: Tensor,  # [N]
    sampling: Sampling = PLAIN_SAMPLING,
    cutoffs: Tensor | None = None,  # [N, 2] sampling_cutoffs of the FULL-vocabulary target
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """Training proxy alpha = mean over positions of sum_x min(p(x), q(x)): the probability
    that one drafted token is accepted by rejection sampling under `sampling` (temperature,
    top-k, top-p applied to both p and q, as the verifier does). The sum runs over the
    draft's ids with p the target's full-vocabulary distribution, so a reduced draft
    vocabulary needs `cutoffs` from the full target logits; without them, target_logits
    must be the full vocabulary. At temperature 1 with no truncation and a full vocabulary
    this is 1 - TV(p, q)."""
    _check(draft_logits, target_logits, mask, sampling.temperature)
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if cutoffs is None:
        cutoffs = sampling_cutoffs(target_logits, sampling)
    if cutoffs.shape != (draft_logits.shape[0], 2):
        raise ValueError(
            f"cutoffs {tuple(cutoffs.shape)} must be [N, 2] = [{draft_logits.shape[0]}, 2]"
        )
    keep = mask.bool()
    d, t, c = draft_logits[keep], target_logits[keep], cutoffs[keep]
    total = torch.zeros((), dtype=torch.float32, device=draft_logits.device)
    for start in range(0, d.shape[0], chunk_size):
        end = start + chunk_size
        total += _accept_rows(d[start:end], t[start:end], c[start:end], sampling).sum()
    return total if reduction == "sum" else total / max(int(keep.sum()), 1)


def _check_log_norm(target_log_norm: Tensor | None, mask: Tensor) -> None:
    if target_log_norm is not None and target_log_norm.shape != mask.shape:
        raise ValueError(
            f"target_log_norm {tuple(target_log_norm.shape)} must be [N] = "
            f"[{mask.shape[0]}]: the logsumexp of each FULL-vocabulary target row / temperature"
        )


def _decoder_cutoffs(target: Tensor, log_norm: Tensor | None, temperature: float) -> Tensor:
    """[n, 2] (cut, lse) for _accept_rows at the loss temperature, no top-k / top-p: p at the
    draft ids is exp(z - lse) with lse the FULL target row's logsumexp (`log_norm`), or this
    row's own when log_norm is None (the target logits are the full vocabulary)."""
    if log_norm is None:
        log_norm = (target.float() / temperature).logsumexp(-1)  # [n]
    log_norm = log_norm.float()
    return torch.stack([torch.full_like(log_norm, float("-inf")), log_norm], -1)


def _alpha_rows(
    draft: Tensor, target: Tensor, log_norm: Tensor | None, temperature: float
) -> Tensor:
    """[n] alpha = sum over the draft ids of min(p, q) as the decoder sees it, differentiable
    in the draft logits (the same maths as acceptance_proxy)."""
    cutoffs = _decoder_cutoffs(target, log_norm, temperature)
    return _accept_rows(draft, target, cutoffs, Sampling(temperature=temperature))


def _lk_lambda_rows(
    draft: Tensor,
    target: Tensor,
    log_norm: Tensor | None,
    temperature: float,
    eta: float,
    lam: Tensor | None,  # [] lambda of the whole call (alpha_mode="batch"); None = per position
) -> Tensor:
    alpha = _alpha_rows(draft, target, log_norm, temperature)  # [n]
    kl = _forward_kl_rows(draft, target, temperature)  # [n] p renormalised over the draft ids
    if lam is None:  # stop-gradient: lambda weighs the two terms, it is not itself trained
        lam = torch.exp(-eta * alpha.detach())  # [n]
    return lam * kl + (1.0 - lam) * (1.0 - alpha)


def _lk_alpha_rows(
    draft: Tensor, target: Tensor, log_norm: Tensor | None, temperature: float
) -> Tensor:
    alpha = _alpha_rows(draft, target, log_norm, temperature)  # [n]
    # alpha = 0 only when q and p have disjoint supports (-inf logits): a large finite loss.
    return -alpha.clamp_min(torch.finfo(alpha.dtype).tiny).log()


def _ce_tv_rows(
    draft: Tensor,
    target: Tensor,
    labels: Tensor,  # [n, 1]
    log_norm: Tensor | None,
    temperature: float,
    ce_weight: float,
    tv_weight: float,
) -> Tensor:
    ce = _ce_rows(draft, labels, temperature)  # [n]
    tv = 1.0 - _alpha_rows(draft, target, log_norm, temperature)  # [n]
    return ce_weight * ce + tv_weight * tv


def lk_lambda(
    draft_logits: Tensor,  # [N, Vd]
    target_logits: Tensor,  # [N, Vd] the target at the draft's ids (all of V for a full vocab)
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    target_log_norm: Tensor | None = None,  # [N] logsumexp of the FULL target row / temperature
    eta: float = 3.0,
    alpha_mode: str = "position",
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """LK^lambda (Samarin et al. 2026, "LK Losses", arXiv 2602.23881): lambda * KL(p || q) +
    (1 - lambda) * TV, TV = 1 - alpha, lambda = exp(-eta * stopgrad(alpha)). While the draft
    is far from the target (alpha ~ 0) it is forward KL, whose gradient does not vanish;
    as alpha grows it becomes TV, which is 1 - expected acceptance. The paper's eta: 3 for
    EAGLE / MTP, 10 for Medusa. alpha_mode "position": each position's own alpha (as
    vllm-project/speculators' lk_hybrid); "batch": one lambda from the mean alpha over this
    call's positions (SpecForge's lk_loss), i.e. one offset of one micro-batch on one rank.
    alpha and TV are the decoder's (module docstring); KL(p || q) renormalises p over the
    draft ids, as `kl`."""
    _check(draft_logits, target_logits, mask, temperature)
    _check_log_norm(target_log_norm, mask)
    if eta < 0:
        raise ValueError(f"loss.eta must be >= 0 (0 = pure forward KL), got {eta}")
    if alpha_mode not in ("position", "batch"):
        raise ValueError(f"loss.alpha_mode must be 'position' or 'batch', got {alpha_mode!r}")
    lam = None
    if alpha_mode == "batch":  # one lambda from the mean alpha, before the chunks
        cutoffs = None  # acceptance_proxy then uses each row's own logsumexp (full vocab)
        if target_log_norm is not None:
            cutoffs = _decoder_cutoffs(target_logits, target_log_norm, temperature)
        sampling = Sampling(temperature=temperature)
        alpha = acceptance_proxy(draft_logits, target_logits, mask, sampling, cutoffs, chunk_size)
        lam = torch.exp(-eta * alpha)  # [] no grad: acceptance_proxy is no_grad
    rows_fn = partial(_lk_lambda_rows, temperature=temperature, eta=eta, lam=lam)
    rows = (target_logits, target_log_norm)
    return _masked_reduce(rows_fn, draft_logits, rows, mask, chunk_size, reduction)


def lk_alpha(
    draft_logits: Tensor,  # [N, Vd]
    target_logits: Tensor,  # [N, Vd] the target at the draft's ids (all of V for a full vocab)
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    target_log_norm: Tensor | None = None,  # [N] logsumexp of the FULL target row / temperature
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """LK^alpha (arXiv 2602.23881): -log alpha per position, alpha the decoder's acceptance
    probability. Its gradient is grad(TV) / alpha: TV's direction, with the 1 / alpha factor
    that keeps it from vanishing while alpha is small (from scratch). Against a one-hot
    target it is cross-entropy."""
    _check(draft_logits, target_logits, mask, temperature)
    _check_log_norm(target_log_norm, mask)
    rows_fn = partial(_lk_alpha_rows, temperature=temperature)
    rows = (target_logits, target_log_norm)
    return _masked_reduce(rows_fn, draft_logits, rows, mask, chunk_size, reduction)


def ce_tv_mix(
    draft_logits: Tensor,  # [N, Vd]
    target_logits: Tensor,  # [N, Vd] the target at the draft's ids (all of V for a full vocab)
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    labels: Tensor | None = None,  # [N] hard labels from the data; None = target argmax
    target_log_norm: Tensor | None = None,  # [N] logsumexp of the FULL target row / temperature
    ce_weight: float = 0.1,
    tv_weight: float = 1.8,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """Fixed mix ce_weight * CE + tv_weight * TV, DeepSeek's DSpark recipe: DeepSpec
    (deepspec/modeling/dspark/loss.py, config/dspark/*.py) trains 0.1 * CE + 0.9 * L1 with
    hard-label CE (the data's tokens) and L1 = sum |p - q| = 2 TV, hence tv_weight = 1.8.
    CE is `cross_entropy`'s (labels, or the target's argmax over the draft ids); TV = 1 -
    alpha is the decoder's (module docstring)."""
    _check(draft_logits, target_logits, mask, temperature)
    _check_log_norm(target_log_norm, mask)
    if ce_weight < 0 or tv_weight < 0:
        raise ValueError(
            f"loss.ce_weight and loss.tv_weight must be >= 0, got {ce_weight} and {tv_weight}"
        )
    if labels is None:
        labels = target_logits.argmax(-1)  # [N]
    if labels.shape != mask.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match mask {tuple(mask.shape)}")
    rows_fn = partial(
        _ce_tv_rows, temperature=temperature, ce_weight=ce_weight, tv_weight=tv_weight
    )
    rows = (target_logits, labels[:, None], target_log_norm)
    return _masked_reduce(rows_fn, draft_logits, rows, mask, chunk_size, reduction)


@torch.no_grad()
def top1_agreement(
    draft_logits: Tensor,  # [N, Vd]
    target_tokens: Tensor,  # [N] long: argmax of the FULL-vocabulary target logits
    mask: Tensor,  # [N]
    vocab_ids: Tensor | None = None,  # [Vd] target id of each draft id; None = full vocabulary
    reduction: str = "mean",
) -> Tensor:
    """Greedy proxy: fraction of positions where the draft's argmax, as a target id, is the
    target's argmax over its whole vocabulary (greedy acceptance). A position whose target
    argmax lies outside a reduced draft vocabulary is a miss, as in the decoder."""
    if target_tokens.shape != mask.shape or draft_logits.shape[:1] != mask.shape:
        raise ValueError(
            f"draft_logits {tuple(draft_logits.shape)}, target_tokens "
            f"{tuple(target_tokens.shape)} and mask {tuple(mask.shape)} must be [N, Vd], [N] "
            "and [N]; pass the target's argmax token ids, not its logits"
        )
    keep = mask.bool()
    drafted = draft_logits[keep].argmax(-1)  # [M] draft ids
    if vocab_ids is not None:
        drafted = vocab_ids.to(drafted.device)[drafted]  # [M] target ids
    same = (drafted == target_tokens[keep]).float().sum()
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
    "lk": lk_lambda,
    "lk_alpha": lk_alpha,
    "dspark": ce_tv_mix,
}

# What the caller passes itself, never from a loss config.
_CALL_ARGS = ("draft_logits", "target_logits", "mask", "temperature", "labels", "target_log_norm")


def loss_options(loss_fn: Callable[..., Tensor], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword options a loss config (conf/loss/*.yaml) sets for `loss_fn`: every key but
    name, temperature and labels, which the caller handles. A key the loss does not take is
    an error that lists the ones it does."""
    options = {k: v for k, v in settings.items() if k not in ("name", "temperature", "labels")}
    params = inspect.signature(loss_fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):  # a wrapper: it takes anything
        return options
    takes = [name for name in params if name not in (*_CALL_ARGS, "reduction")]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ValueError(
            f"loss.{unknown[0]} is not an option of loss {settings.get('name')!r}; "
            f"its options are {takes}"
        )
    return options
