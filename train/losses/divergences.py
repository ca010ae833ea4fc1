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

The per-row pieces and the chunked reduction are in train/losses/rows.py; JSD, NLA, D-PACE and
weighted mixes of these losses in train/losses/family.py. The acceptance statistics logged
beside the losses (`acceptance_proxy`, `top1_agreement`, `simulated_tau`) are in
train/losses/acceptance.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from decoding.drafter import Sampling
from train.losses import family
from train.losses.acceptance import DEFAULT_CHUNK, acceptance_proxy, check_logits
from train.losses.rows import (
    alpha_rows,
    ce_rows,
    check_log_norm,
    decoder_cutoffs,
    forward_kl_rows,
    masked_reduce,
    reverse_kl_rows,
    tv_rows,
)


def forward_kl(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """KL(p || q) = sum_x p log(p / q), p = target, q = draft: mode-covering."""
    check_logits(draft_logits, target_logits, mask, temperature)
    rows_fn = partial(forward_kl_rows, temperature=temperature)
    return masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


def reverse_kl(
    draft_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """KL(q || p) = sum_x q log(q / p): mode-seeking."""
    check_logits(draft_logits, target_logits, mask, temperature)
    rows_fn = partial(reverse_kl_rows, temperature=temperature)
    return masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


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
    check_logits(draft_logits, target_logits, mask, temperature)
    rows_fn = partial(tv_rows, temperature=temperature)
    return masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


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
    check_logits(draft_logits, target_logits, mask, temperature)
    if labels is None:
        labels = target_logits.argmax(-1)  # [N]
    if labels.shape != mask.shape:
        raise ValueError(f"labels {tuple(labels.shape)} must match mask {tuple(mask.shape)}")
    rows_fn = partial(ce_rows, temperature=temperature)
    return masked_reduce(rows_fn, draft_logits, (labels[:, None],), mask, chunk_size, reduction)


class _LKLambdaRows(torch.autograd.Function):
    """LK^lambda per row with its gradient written out and computed in the forward pass.
    A checkpointed chunk runs the forward twice and then differentiates it op by op: on a
    2-core CPU those ~45 passes over [n, Vd] were a third of an EAGLE-3 step; this is about
    half as many, at the price of keeping one [n, Vd] gradient per chunk until backward.
    With q = softmax(z / T), p_hat the target renormalised over the draft ids, p the
    decoder's p and m = d min(p, q) / dq (1 where q < p, 1/2 at a tie, as torch.minimum):
      d KL(p_hat || q) / dz = (q - p_hat) / T,   d alpha / dz = q (m - sum(m q)) / T."""

    @staticmethod
    def forward(ctx, draft, target, log_norm, temperature, eta, lam):  # noqa: ANN001, ANN205
        log_q = F.log_softmax(draft.float() / temperature, dim=-1)  # [n, Vd]
        q = log_q.exp()
        z = target.float() / temperature  # [n, Vd]
        log_p_hat = F.log_softmax(z, dim=-1)
        p_hat = log_p_hat.exp()
        lse = z.logsumexp(-1) if log_norm is None else log_norm.float()  # [n]
        p = (z - lse[:, None]).exp()  # [n, Vd] the decoder's p, not renormalised
        alpha = torch.minimum(p, q).sum(-1)  # [n]
        floor = torch.finfo(torch.float32).min
        kl = (p_hat * (log_p_hat.clamp_min(floor) - log_q.clamp_min(floor))).sum(-1)  # [n]
        lam = torch.exp(-eta * alpha) if lam is None else lam.float().expand_as(alpha)  # [n]
        slope = (q < p).float().add_((q == p).float(), alpha=0.5)  # [n, Vd] m
        kept = (slope * q).sum(-1, keepdim=True)  # [n, 1]
        grad = (q - p_hat).mul_(lam[:, None]).sub_(q * (slope - kept) * (1.0 - lam)[:, None])
        ctx.save_for_backward(grad.div_(temperature))
        ctx.dtype = draft.dtype
        return lam * kl + (1.0 - lam) * (1.0 - alpha)

    @staticmethod
    def backward(ctx, grad_rows):  # noqa: ANN001, ANN205
        (grad,) = ctx.saved_tensors
        return (grad * grad_rows[:, None]).to(ctx.dtype), None, None, None, None, None


def _lk_lambda_rows(
    draft: Tensor, target: Tensor, log_norm: Tensor | None, temperature: float, eta: float,
    lam: Tensor | None,  # [] lambda of the whole call (alpha_mode="batch"); None = per position
) -> Tensor:  # fmt: skip
    """[n] lambda * KL(p_hat || q) + (1 - lambda) * (1 - alpha); lambda = exp(-eta alpha) is a
    weight, not trained (stop-gradient)."""
    return _LKLambdaRows.apply(draft, target, log_norm, temperature, eta, lam)


def _lk_alpha_rows(draft: Tensor, target: Tensor, log_norm: Tensor | None, temperature: float):
    alpha = alpha_rows(draft, target, log_norm, temperature)  # [n]
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
    ce = ce_rows(draft, labels, temperature)  # [n]
    tv = 1.0 - alpha_rows(draft, target, log_norm, temperature)  # [n]
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
    check_logits(draft_logits, target_logits, mask, temperature)
    check_log_norm(target_log_norm, mask)
    if eta < 0:
        raise ValueError(f"loss.eta must be >= 0 (0 = pure forward KL), got {eta}")
    if alpha_mode not in ("position", "batch"):
        raise ValueError(f"loss.alpha_mode must be 'position' or 'batch', got {alpha_mode!r}")
    lam = None
    if alpha_mode == "batch":  # one lambda from the mean alpha, before the chunks
        cutoffs = None  # acceptance_proxy then uses each row's own logsumexp (full vocab)
        if target_log_norm is not None:
            cutoffs = decoder_cutoffs(target_logits, target_log_norm, temperature)
        sampling = Sampling(temperature=temperature)
        alpha = acceptance_proxy(draft_logits, target_logits, mask, sampling, cutoffs, chunk_size)
        lam = torch.exp(-eta * alpha)  # [] no grad: acceptance_proxy is no_grad
    # The written-out gradient (`_LKLambdaRows`) in place of a checkpointed chunk.
    rows_fn = partial(_lk_lambda_rows, temperature=temperature, eta=eta, lam=lam)
    rows = (target_logits, target_log_norm)
    return masked_reduce(
        rows_fn, draft_logits, rows, mask, chunk_size, reduction, checkpointed=False
    )


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
    check_logits(draft_logits, target_logits, mask, temperature)
    check_log_norm(target_log_norm, mask)
    rows_fn = partial(_lk_alpha_rows, temperature=temperature)
    rows = (target_logits, target_log_norm)
    return masked_reduce(rows_fn, draft_logits, rows, mask, chunk_size, reduction)


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
    check_logits(draft_logits, target_logits, mask, temperature)
    check_log_norm(target_log_norm, mask)
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
    return masked_reduce(rows_fn, draft_logits, rows, mask, chunk_size, reduction)


@dataclass(frozen=True)
class Loss:
    """A registered loss and what it needs from its caller, declared here once: the training
    step, replay and the start-up checks read these fields, never the function's signature."""

    fn: Callable[..., Tensor]
    options: tuple[str, ...] = ()  # its own settings in conf/loss/<name>.yaml (LK's eta, ...)
    takes_labels: bool = False  # hard labels: loss.labels=data passes the data's next tokens
    # alpha over the target's FULL-vocabulary p: the caller passes `target_log_norm`, which a
    # replay batch does not carry
    full_vocab_alpha: bool = False
    check: Callable[..., None] | None = None  # check(**options): bad settings refused up front
    # D-PACE: each position's weight from its chain of drafts, every offset at once; the step
    # passes it as `position_weights` and the offsets' own weights become 1 (train/core/step.py)
    chain_weights: Callable[..., list[Tensor]] | None = None

    def __call__(self, *args, **kwargs) -> Tensor:
        return self.fn(*args, **kwargs)


LOSSES: dict[str, Loss] = {
    "ce": Loss(cross_entropy, takes_labels=True),
    "kl": Loss(forward_kl),
    "rkl": Loss(reverse_kl),
    "tv": Loss(total_variation),
    "lk": Loss(lk_lambda, options=("eta", "alpha_mode"), full_vocab_alpha=True),
    "lk_alpha": Loss(lk_alpha, full_vocab_alpha=True),
    "dspark": Loss(
        ce_tv_mix, options=("ce_weight", "tv_weight"), takes_labels=True, full_vocab_alpha=True
    ),
    "jsd": Loss(family.jensen_shannon, options=("skew",), check=family.check_jsd),
    "nla": Loss(family.neg_log_acceptance, options=("eps",), check=family.check_nla),
    "dpace": Loss(
        family.dpace,
        options=("dpace_alpha",),
        check=family.check_dpace,
        chain_weights=family.dpace_chain_weights,
    ),
}
LOSSES["mix"] = Loss(
    partial(family.loss_mix, losses=LOSSES), options=("parts",), takes_labels=True,
    full_vocab_alpha=True, check=partial(family.check_mix, losses=LOSSES),
)  # fmt: skip


def loss_options(loss: Loss, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword options a loss config (conf/loss/*.yaml) sets for `loss`: every key but
    name, temperature and labels, which the caller handles. A key the loss does not declare
    is an error that lists the ones it does."""
    options = {k: v for k, v in settings.items() if k not in ("name", "temperature", "labels")}
    unknown = sorted(set(options) - set(loss.options))
    if unknown:
        raise ValueError(
            f"loss.{unknown[0]} is not an option of loss {settings.get('name')!r}; "
            f"its options are {list(loss.options)}"
        )
    return options


@dataclass(frozen=True)
class LossSpec:
    """cfg.loss resolved and checked once, then used by the offline step, replay and the
    start-up checks alike (one rule for what a loss needs)."""

    name: str
    loss: Loss
    temperature: float = 1.0
    labels_from_data: bool = False  # loss.labels=data: the data's next token, not the target
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> LossSpec:
        """From a loss config (name, temperature, labels, the loss's own options); a
        ValueError that names the bad key."""
        name = settings.get("name")
        if name not in LOSSES:
            raise ValueError(f"loss.name={name!r} is not one of {sorted(LOSSES)}")
        loss = LOSSES[name]
        temperature = float(settings.get("temperature", 1.0))
        if not temperature > 0:
            raise ValueError(f"loss.temperature must be > 0, got {temperature}")
        labels = settings.get("labels", "target")
        if labels not in ("target", "data"):
            raise ValueError(f"loss.labels must be 'target' or 'data', got {labels!r}")
        if labels == "data" and not loss.takes_labels:
            raise ValueError(
                f"loss.labels=data but loss {name!r} takes no labels; "
                f"losses that do: {sorted(n for n, spec in LOSSES.items() if spec.takes_labels)}"
            )
        options = loss_options(loss, settings)
        if loss.check is not None:
            loss.check(**options)
        return cls(name, loss, temperature, labels == "data", options)

    def sum(
        self,
        draft_logits: Tensor,  # [N, Vd]
        target_logits: Tensor,  # [N, Vd]
        mask: Tensor,  # [N]
        labels: Tensor | None = None,  # [N] the data's next tokens (labels_from_data)
        target_log_norm: Tensor | None = None,  # [N] full-vocabulary logsumexp (full_vocab_alpha)
        position_weights: Tensor | None = None,  # [N] this offset's chain_weights (D-PACE)
    ) -> Tensor:
        """The masked SUM of the loss over positions, with what this loss declares it needs."""
        kwargs = dict(self.options)
        if position_weights is not None:
            kwargs["position_weights"] = position_weights
        if self.loss.full_vocab_alpha:
            kwargs["target_log_norm"] = target_log_norm
        if self.labels_from_data:
            if labels is None:
                raise ValueError(f"loss {self.name!r} with labels=data needs the data's labels")
            kwargs["labels"] = labels
        return self.loss.fn(
            draft_logits, target_logits, mask, temperature=self.temperature, reduction="sum",
            **kwargs,
        )  # fmt: skip
