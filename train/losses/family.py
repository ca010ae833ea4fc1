"""More losses of the one-loss API (train/losses/divergences.py: `LOSSES`, `Loss`, `LossSpec`), defined
as the training libraries that introduced them define them, so a recipe ports with its loss:

- `jsd`: the Jensen-Shannon divergence, with a skew that moves it from forward KL (skew 0)
  through the symmetric JSD (skew 0.5, vllm-project/speculators' `jsd`) to reverse KL (1).
- `nla`: speculators' negative log-acceptance, -log max(sum min(p, q), 1e-5), with p the
  target renormalised over the draft ids (`lk_alpha` is the same maths with the decoder's
  full-vocabulary p and no floor).
- `dpace`: D-PACE (arXiv 2605.18810), speculators' default loss for DFlash: cross-entropy
  against the target's argmax, each draft position weighted by how much of its chain of
  drafts it can still make accepted (`dpace_weights`). The weights need every offset of a
  chain at once, so the training step asks for them first (`dpace_chain_weights`, the
  `Loss.chain_weights` of train/losses/divergences.py) and passes each offset's as `position_weights`.
- `mix`: a weighted sum of registered losses, each part with its own options
  (`loss.parts=[{name: kl, weight: 0.5}, {name: tv, weight: 0.5}]`).

Every loss is a plain function over [N, V] rows, chunked by train/losses/rows.py:
masked_reduce; masked mean over positions or, with reduction="sum", the masked sum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from train.losses.acceptance import DEFAULT_CHUNK, check_logits
from train.losses.rows import ce_rows, log_probs, masked_reduce

NLA_EPS = 1e-5  # speculators' floor on alpha (losses/eager.py: _NLA_EPS)
DEFAULT_MIX = ({"name": "kl", "weight": 0.5}, {"name": "tv", "weight": 0.5})  # conf/loss/mix.yaml
_SHARED = ("temperature", "labels")  # set once on the mix, shared by its parts


def check_jsd(skew: float = 0.5) -> None:
    if not 0.0 <= skew <= 1.0:
        raise ValueError(
            f"loss.skew must be in [0, 1] (0 = forward KL, 0.5 = symmetric JSD, 1 = reverse "
            f"KL), got {skew}"
        )


def _jsd_rows(draft: Tensor, target: Tensor, temperature: float, skew: float) -> Tensor:
    logq, logp = log_probs(draft, temperature), log_probs(target, temperature)  # [n, V]
    if skew == 0.0:  # the limit skew -> 0: m -> q
        return (logp.exp() * (logp - logq)).sum(-1)  # [n] KL(p || q)
    if skew == 1.0:  # the limit skew -> 1: m -> p
        return (logq.exp() * (logq - logp)).sum(-1)  # [n] KL(q || p)
    # log m, m = skew p + (1 - skew) q, in log space (speculators: logaddexp(logq, logp) - log 2)
    log_m = torch.logaddexp(logp + math.log(skew), logq + math.log1p(-skew))  # [n, V]
    kl_p = (logp.exp() * (logp - log_m)).sum(-1)  # [n] KL(p || m)
    kl_q = (logq.exp() * (logq - log_m)).sum(-1)  # [n] KL(q || m)
    return (1.0 - skew) * kl_p + skew * kl_q


def jensen_shannon(
    draft_logits: Tensor,  # [N, V]
    target_logits: Tensor,  # [N, V]
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    skew: float = 0.5,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """JSD_s(p, q) = (1 - s) KL(p || m) + s KL(q || m), m = s p + (1 - s) q, p = target,
    q = draft, s = `skew`. s = 0.5 is vllm-project/speculators' `jsd` exactly
    (src/speculators/losses/eager.py: js_div_loss; 0.5 KL(p || m) + 0.5 KL(q || m), m = (p +
    q) / 2, bounded by log 2); speculators has no skew. The skew weights each KL by the other
    distribution's share of m, so it is continuous in s with forward KL(p || q) at s = 0 and
    reverse KL(q || p) at s = 1 (GKD's JSD(beta), arXiv 2306.13649, and TRL's
    generalized_jsd_loss mix the same m but weight KL(p || m) by s, which vanishes at both
    ends; they special-case the endpoints)."""
    check_logits(draft_logits, target_logits, mask, temperature)
    check_jsd(skew)
    rows_fn = partial(_jsd_rows, temperature=temperature, skew=float(skew))
    return masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


def check_nla(eps: float = NLA_EPS) -> None:
    if not 0.0 < eps <= 1.0:
        raise ValueError(f"loss.eps (the floor on alpha) must be in (0, 1], got {eps}")


def _nla_rows(draft: Tensor, target: Tensor, temperature: float, eps: float) -> Tensor:
    q = F.softmax(draft.float() / temperature, dim=-1)  # [n, V]
    p = F.softmax(target.float() / temperature, dim=-1)
    overlap = torch.minimum(p, q).sum(-1)  # [n] alpha over the given ids, p renormalised
    return -overlap.clamp_min(eps).log()


def neg_log_acceptance(
    draft_logits: Tensor,  # [N, V]
    target_logits: Tensor,  # [N, V]
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    eps: float = NLA_EPS,
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """-log max(alpha, eps), alpha = sum_x min(p, q): vllm-project/speculators' `nla`
    (src/speculators/losses/eager.py: neg_log_acceptance_loss, eps = _NLA_EPS = 1e-5; the
    LK^alpha of arXiv 2602.23881). Its gradient is grad(TV) / alpha, and none where alpha <
    eps (the floor). p is the target renormalised over the draft ids, as speculators' loss
    sees a reduced vocabulary; `lk_alpha` uses the decoder's p instead."""
    check_logits(draft_logits, target_logits, mask, temperature)
    check_nla(eps)
    rows_fn = partial(_nla_rows, temperature=temperature, eps=float(eps))
    return masked_reduce(rows_fn, draft_logits, (target_logits,), mask, chunk_size, reduction)


def check_dpace(dpace_alpha: float = 0.5) -> None:
    if not 0.0 < dpace_alpha <= 1.0:  # speculators' check (train/config/schema.py)
        raise ValueError(
            f"loss.dpace_alpha (D-PACE's confidence smoothing) must be in (0, 1], got {dpace_alpha}"
        )


def dpace_weights(
    confidence: Tensor,  # [..., K] q(target argmax) of each draft along a chain of K offsets
    trained: Tensor,  # [..., K] 1 where the draft is trained (loss mask, inside the sequence)
    dpace_alpha: float = 0.5,
) -> Tensor:
    """D-PACE's weight of each draft of a chain, as vllm-project/speculators computes it
    (src/speculators/losses/utils.py: dpace_loss_decay): s_k = (1 - a) q_k + a (1 where
    untrained), w_k = sum_{j >= k} trained_j prod_{i <= j} s_i, times trained_k. [..., K],
    no gradient: the weights steer the loss and are not trained."""
    with torch.no_grad():
        trained = trained.float()
        smooth = (1.0 - dpace_alpha) * confidence.float() + dpace_alpha
        smooth = torch.where(trained > 0, smooth, torch.ones_like(smooth))
        prefix = smooth.cumprod(-1) * trained  # [..., K]
        return prefix.flip(-1).cumsum(-1).flip(-1) * trained  # suffix sums


def dpace_chain_weights(
    logits: Sequence[Tensor],  # per offset [B, T|N, Vd] (DraftOutput.logits)
    offsets: Sequence[int],  # DraftOutput.offsets
    positions: Tensor | None,  # [B, N] the draft's sampled positions, -1 = padding; None: all t
    target_logits: Tensor,  # [B, T, Vd] the target at the draft's ids
    loss_mask: Tensor,  # [B, T]
    temperature: float = 1.0,
    dpace_alpha: float = 0.5,
) -> list[Tensor]:
    """D-PACE's weight of every trained draft, one [N_i] per offset in the order
    train/core/step.py: offset_losses flattens that offset's rows: [B, N] at sampled positions
    (DFlash blocks), else [B, T - offset]. The chain of position t is its drafts at every
    offset (a DFlash block, Medusa's heads, EAGLE's unroll, MTP's depths), paired as
    models/protocol.py aligns them: logits[i][:, t] with the target at t + offsets[i].
    Confidence = the draft's probability of the target's argmax over the draft ids, at the
    loss temperature: exp(-CE) of the CE that `dpace` trains."""
    B, T = loss_mask.shape
    device = loss_mask.device
    starts = positions if positions is not None else torch.arange(T, device=device).expand(B, T)
    K, S = len(offsets), starts.shape[1]
    labels = target_logits.argmax(-1)  # [B, T] the CE's label, a draft id
    confidence = torch.ones(B, S, K, device=device)
    trained = torch.zeros(B, S, K, device=device)
    lengths = []  # rows of each offset
    with torch.no_grad():
        for k, (offset_logits, off) in enumerate(zip(logits, offsets, strict=True)):
            n = S if positions is not None else max(T - off, 0)
            at = starts[:, :n] + off  # [B, n] the target position each draft is compared with
            inside = (starts[:, :n] >= 0) & (at < T)
            at = at.clamp(0, T - 1)
            z = offset_logits[:, :n].float() / temperature  # [B, n, Vd]
            label = labels.gather(1, at)  # [B, n]
            log_q = z.gather(-1, label[..., None]).squeeze(-1) - z.logsumexp(-1)  # [B, n]
            confidence[:, :n, k] = log_q.exp()
            trained[:, :n, k] = loss_mask.gather(1, at).float() * inside
            lengths.append(n)
    weights = dpace_weights(confidence, trained, dpace_alpha)  # [B, S, K]
    return [weights[:, :n, k].reshape(-1) for k, n in enumerate(lengths)]


def _weighted_ce_rows(
    draft: Tensor, labels: Tensor, weights: Tensor, temperature: float
) -> Tensor:  # [n, V], [n, 1], [n] -> [n]
    return weights * ce_rows(draft, labels, temperature)


def dpace(
    draft_logits: Tensor,  # [N, V]
    target_logits: Tensor,  # [N, V]
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    position_weights: Tensor | None = None,  # [N] dpace_chain_weights' for this offset; None = 1
    dpace_alpha: float = 0.5,  # used by dpace_chain_weights; checked here
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """D-PACE (Dynamic Position-Aware Cross-Entropy, arXiv 2605.18810), as
    vllm-project/speculators trains DFlash by default (PR #980; PR #736:
    src/speculators/models/dflash/metrics.py: compute_metrics with dpace_loss_decay, which
    requires loss ce): sum over positions of w * CE(q, argmax p) / trained positions, w from
    `dpace_chain_weights` (no gradient). The offsets' own weights (DFlash's exp(-(i-1)/gamma),
    train.offset_decay) are replaced by these, as speculators replaces its decay."""
    check_logits(draft_logits, target_logits, mask, temperature)
    check_dpace(dpace_alpha)
    if position_weights is None:
        position_weights = torch.ones(mask.shape, device=draft_logits.device)
    if position_weights.shape != mask.shape:
        raise ValueError(
            f"position_weights {tuple(position_weights.shape)} must match mask {tuple(mask.shape)}"
        )
    labels = target_logits.argmax(-1)[:, None]  # [N, 1]
    rows = (labels, position_weights.float())
    rows_fn = partial(_weighted_ce_rows, temperature=temperature)
    return masked_reduce(rows_fn, draft_logits, rows, mask, chunk_size, reduction)


def _mix_part(part: Any, losses: Mapping[str, Any]) -> tuple[str, float, dict[str, Any]]:
    """One entry of loss.parts -> (name, weight, its options), or a ValueError saying why."""
    if not isinstance(part, Mapping) or "name" not in part:
        raise ValueError(f"each of loss.parts is {{name: <loss>, weight: <w>, ...}}, got {part!r}")
    name, options = part["name"], {k: v for k, v in part.items() if k not in ("name", "weight")}
    if name not in losses or name == "mix":
        raise ValueError(
            f"loss.parts: {name!r} is not a loss to mix; choose from "
            f"{sorted(n for n in losses if n != 'mix')}"
        )
    loss = losses[name]
    if loss.chain_weights is not None:
        raise ValueError(f"loss.parts: {name!r} weighs whole chains of drafts; use loss={name}")
    weight = part.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight >= 0:
        raise ValueError(f"loss.parts: {name!r} weight must be a number >= 0, got {weight!r}")
    shared = sorted(set(options) & set(_SHARED))
    if shared:
        raise ValueError(f"loss.parts: set {shared[0]} on the mix (loss.{shared[0]}), not a part")
    unknown = sorted(set(options) - set(loss.options))
    if unknown:
        raise ValueError(
            f"loss.parts: {unknown[0]!r} is not an option of {name!r}; "
            f"its options are {list(loss.options)}"
        )
    return name, float(weight), options


def _check_parts(parts: Any) -> None:
    if isinstance(parts, str | Mapping) or not isinstance(parts, Sequence) or not parts:
        raise ValueError(
            f"loss.parts must be a non-empty list such as [{{name: kl, weight: 0.5}}, "
            f"{{name: tv, weight: 0.5}}], got {parts!r}"
        )


def check_mix(parts: Sequence[Any] = DEFAULT_MIX, *, losses: Mapping[str, Any]) -> None:
    """loss.parts: a non-empty list of registered losses (not mixes, not chain-weighted),
    each with a weight >= 0 and only its own options, which its own function checks (called
    on a one-row probe, as train/run/settings.py checks other settings)."""
    _check_parts(parts)
    weights = []
    for part in parts:
        name, weight, options = _mix_part(part, losses)
        probe = torch.zeros(1, 2)  # [1, V]
        try:
            losses[name].fn(probe, probe, torch.ones(1), **options)
        except ValueError as err:
            raise ValueError(f"loss.parts: {name!r}: {err}") from None
        weights.append(weight)
    if not any(w > 0 for w in weights):
        raise ValueError("loss.parts: every weight is 0; give at least one part a weight > 0")


def loss_mix(
    draft_logits: Tensor,  # [N, Vd]
    target_logits: Tensor,  # [N, Vd]
    mask: Tensor,  # [N]
    temperature: float = 1.0,
    labels: Tensor | None = None,  # [N] the data's next tokens, to the parts that take labels
    target_log_norm: Tensor | None = None,  # [N] to the parts that declare full_vocab_alpha
    parts: Sequence[Any] = DEFAULT_MIX,
    *,
    losses: Mapping[str, Any],  # the registry (train/losses/divergences.py: LOSSES)
    chunk_size: int = DEFAULT_CHUNK,
    reduction: str = "mean",
) -> Tensor:
    """sum_j weight_j * loss_j, each part a registered loss with its own options at the mix's
    temperature (vllm-project/speculators' weighted loss dict, losses/utils.py: compound_loss,
    e.g. {"ce": 0.1, "tv": 0.9}, here with options per part). Each part is chunked on its own,
    so the mix is chunked equals plain as its parts are."""
    _check_parts(parts)
    total = draft_logits.new_zeros((), dtype=torch.float32)
    for part in parts:
        name, weight, options = _mix_part(part, losses)
        loss = losses[name]
        if loss.takes_labels and labels is not None:
            options["labels"] = labels
        if loss.full_vocab_alpha:
            options["target_log_norm"] = target_log_norm
        value = loss.fn(
            draft_logits, target_logits, mask, temperature=temperature, chunk_size=chunk_size,
            reduction=reduction, **options,
        )  # fmt: skip
        total = total + weight * value
    return total
