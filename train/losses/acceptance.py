"""Acceptance statistics: what the decoder would accept from a draft, measured in training.

Acceptance proxies (`acceptance_proxy`, `top1_agreement`) measure what the decoder sees, not
what the loss sees: p is the target's FULL-vocabulary distribution after the decode's
temperature / top-k / top-p, and with a reduced draft vocabulary the sum runs over the draft
ids with that un-renormalised p (a token outside the draft vocabulary is always rejected).
`sampling_cutoffs` stands for that p with two numbers per position; `accept_rows` is the
per-position sum of min(p, q), shared with the TV family of train/losses/divergences.py; `simulated_tau`
turns per-offset acceptance into tokens per verify forward. The losses share `check_logits`
and `DEFAULT_CHUNK` with the proxies.
"""

from __future__ import annotations

import torch
from torch import Tensor

from decoding.drafter import Sampling
from decoding.verify import sampling_probs

DEFAULT_CHUNK = 1024  # positions per chunk: 1024 x 49152 fp32 = 200 MB per temporary
PLAIN_SAMPLING = Sampling(temperature=1.0)  # temperature 1, no top-k / top-p


def check_logits(
    draft_logits: Tensor, target_logits: Tensor, mask: Tensor, temperature: float
) -> None:
    """Refuse logits that are not both [N, V], a mask that is not [N], a temperature <= 0."""
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


def accept_rows(draft: Tensor, target: Tensor, cutoffs: Tensor, sampling: Sampling) -> Tensor:
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
    check_logits(draft_logits, target_logits, mask, sampling.temperature)
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
        total += accept_rows(d[start:end], t[start:end], c[start:end], sampling).sum()
    return total if reduction == "sum" else total / max(int(keep.sum()), 1)


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
