"""Acceptance against the target's entropy (definition: docs/design.md §3).

At every drafted position the verifier judged (each draft up to and including a round's
first rejection), take H = the entropy in nats of the target distribution p there and the
acceptance there; bucket H at fixed edges (`ENTROPY_EDGES`, the same for every run so runs
compare) and fit acceptance = intercept + slope · H by least squares over all positions.

    p           sampling: the verifier's own p (temperature, top-k, top-p: `sampling_probs`);
                greedy: the T = 1 softmax without top-k / top-p (the greedy verifier looks at
                the argmax only, so its own p would be a one-hot with H = 0)
    acceptance  greedy: 1 if the draft equals the target's argmax, else 0; sampling: the exact
                expected acceptance Σ_x min(p(x), q(x)) of that position (the mean of the 0/1
                outcome over the verifier's uniform and the draft's sample, so less noisy)
    trees       one position per depth along the accepted path: the root and every accepted
                node that has children; acceptance = P(the verifier accepts one of its
                children): greedy 1[the argmax is among them]; sampling 1 − Π_j (1 − a_j),
                a_j = min(1, r_j(x_j) / q_j(x_j)) the threshold child j meets with r_1 = p and
                r_{j+1} = normalize(max(r_j − q_j, 0)) (decoding/verify.py's recursion, over
                every child). Exact for deterministic candidates (EAGLE-2 trees, top-k
                Medusa trees: it is the p-mass of the candidates); for sampled siblings it is
                conditional on the candidates that were drawn.

The per-position functions are pure tensor maths on what the verify step already holds (the
verify forward's logits, the drafts and their q): no extra target forward. `EntropyProbe`
collects their output over `decoding.spec.generate(..., probe=)` calls; the loops leave the
probe's own time out of their wall time, so speedups do not pay for the measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from decoding.drafter import Sampling
from decoding.verify import acceptance_probability, residual_distribution, sampling_probs

# Bucket i holds H in [ENTROPY_EDGES[i], ENTROPY_EDGES[i + 1]) nats; the last is open-ended.
ENTROPY_EDGES: tuple[float, ...] = (0.0, 0.5, 1.0, 2.0, 3.0, 4.0, math.inf)


def entropy(probs: Tensor) -> Tensor:
    """probs [..., V] -> Shannon entropy in nats [...] (0·log 0 = 0: top-k / top-p zeros)."""
    return torch.special.entr(probs.float()).sum(-1)


def judged_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """Target logits [..., V] -> the p whose entropy is reported [..., V] float32: the
    verifier's p when sampling, the plain T = 1 softmax when greedy."""
    if sampling.greedy:
        return logits.float().softmax(-1)
    return sampling_probs(logits, sampling)


def expected_acceptance(p: Tensor, q: Tensor) -> Tensor:
    """p, q [..., V] -> Σ_x min(p(x), q(x)) [...]: the probability that a draft x ~ q is
    accepted by rejection sampling against p."""
    return torch.minimum(p, q.to(p.dtype)).sum(-1)


def chain_positions(
    drafts: Tensor,  # [B, k]
    q: Tensor | None,  # [B, k, V] the distributions the drafts were drawn from; None = greedy
    target_logits: Tensor,  # [B, k+1, V] the verify forward
    num_accepted: Tensor,  # [B] the verifier's accepted drafts per row
    sampling: Sampling,
    rows: Tensor,  # [B] bool, rows still decoding (a finished row's drafts are not judged)
) -> tuple[Tensor, Tensor]:
    """-> (H [M], acceptance [M]) at the judged positions of one chain round, row-major: per
    row, drafts 1..min(n + 1, k) (the accepted ones, then the first rejection if any)."""
    k = drafts.shape[1]
    judged = torch.arange(k, device=drafts.device)[None, :] <= num_accepted[:, None]  # [B, k]
    judged &= rows[:, None]
    m = int(judged.any(0).sum())  # judged positions form a prefix: compute only those
    judged = judged[:, :m]
    p = judged_probs(target_logits[:, :m], sampling)  # [B, m, V]
    if sampling.greedy:
        accept = (drafts[:, :m] == target_logits[:, :m].argmax(-1)).float()  # [B, m]
    else:
        if q is None:
            raise ValueError("sampling acceptance needs the draft distributions q; got None")
        accept = expected_acceptance(p, q[:, :m])  # [B, m]
    return entropy(p)[judged], accept[judged]


def children_acceptance(
    p: Tensor,  # [V] the target's distribution at the parent
    child_tokens: Tensor,  # [c] the children's tokens, in the order the verifier tries them
    child_q: Tensor | None,  # [c, V] each child's q given its earlier siblings; None = one-hot
) -> Tensor:
    """P(the verifier accepts one of the children) = 1 − Π_j (1 − a_j), with a_j = min(1,
    r_j(x_j) / q_j(x_j)), r_1 = p, r_{j+1} = normalize(max(r_j − q_j, 0)): tree rejection
    sampling's recursion (decoding/verify.py) carried over every child -> scalar tensor."""
    r, rejected = p.float(), p.new_ones((), dtype=torch.float32)
    for j, x in enumerate(child_tokens.tolist()):
        if child_q is None:  # a deterministic candidate: q_j = one-hot(x_j)
            q_j = torch.zeros_like(r)
            q_j[x] = 1.0
        else:
            q_j = child_q[j].float()  # [V]
        rejected = rejected * (1.0 - acceptance_probability(r[x : x + 1], q_j[x : x + 1])[0])
        r = residual_distribution(r, q_j)
    return 1.0 - rejected


def tree_positions(
    tokens: Tensor,  # [B, N]
    parents: Tensor,  # [B, N] -1 = the root
    q: Tensor | None,  # [B, N, V] each node's q given its earlier siblings; None = one-hot
    target_logits: Tensor,  # [B, N+1, V] the tree forward: position i+1 is after node i
    path: Tensor,  # [B, D] the verifier's accepted node ids root-down (-1 past its depth)
    num_accepted: Tensor,  # [B]
    sampling: Sampling,
    rows: Tensor,  # [B] bool, rows still decoding
) -> tuple[Tensor, Tensor]:
    """-> (H [M], acceptance [M]) of one tree round, one position per depth along each row's
    accepted path that has children (a leaf's next token is a bonus, nothing was judged)."""
    H_rows, accept_rows = [], []
    n_rows, rows_list = num_accepted.tolist(), rows.tolist()
    for b in range(tokens.shape[0]):
        if not rows_list[b]:
            continue
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents[b].tolist()):
            children.setdefault(parent, []).append(i)
        nodes = [n for n in [-1, *path[b, : n_rows[b]].tolist()] if n in children]
        if not nodes:
            continue
        logits = target_logits[b, [n + 1 for n in nodes]]  # [m, V]
        p = judged_probs(logits, sampling)  # [m, V]
        H_rows.append(entropy(p))
        if sampling.greedy:
            best = logits.argmax(-1).tolist()
            hit = [float(best[j] in tokens[b, children[n]].tolist()) for j, n in enumerate(nodes)]
            accept_rows.append(torch.tensor(hit, device=p.device))
            continue
        accept = [
            children_acceptance(
                p[j], tokens[b, children[n]], None if q is None else q[b, children[n]]
            )
            for j, n in enumerate(nodes)
        ]
        accept_rows.append(torch.stack(accept))
    if not H_rows:
        empty = target_logits.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(H_rows), torch.cat(accept_rows).float()


def check_edges(edges: tuple[float, ...] | list[float]) -> None:
    if len(edges) < 2 or edges[0] != 0.0 or edges[-1] != math.inf:
        raise ValueError(
            f"entropy bucket edges must start at 0 and end at inf so every H lands in a "
            f"bucket, got {list(edges)}; e.g. {list(ENTROPY_EDGES)}"
        )
    if any(lo >= hi for lo, hi in zip(edges, edges[1:])):
        raise ValueError(f"entropy bucket edges must increase strictly, got {list(edges)}")


def least_squares(x: Tensor, y: Tensor) -> tuple[float | None, float | None]:
    """x, y [M] -> (slope, intercept) of y ≈ intercept + slope · x; (None, None) when x
    does not vary (fewer than two distinct values: no line is determined)."""
    x, y = x.double(), y.double()
    if x.numel() < 2:
        return None, None
    dx = x - x.mean()
    sxx = float((dx * dx).sum())
    if sxx <= 0.0:
        return None, None
    slope = float((dx * (y - y.mean())).sum()) / sxx
    return slope, float(y.mean()) - slope * float(x.mean())


def entropy_alpha(
    H: Tensor,  # [M] nats
    acceptance: Tensor,  # [M]
    edges: tuple[float, ...] = ENTROPY_EDGES,
) -> dict:
    """-> JSON-able {edges, count, alpha, slope, intercept}: per bucket [edges[i],
    edges[i+1]) the number of positions and their mean acceptance (None when empty), and the
    least-squares line over all positions. The open last edge is written None (JSON has no
    infinity)."""
    check_edges(edges)
    if H.shape != acceptance.shape or H.dim() != 1:
        raise ValueError(
            f"H {tuple(H.shape)} and acceptance {tuple(acceptance.shape)} must both be [M]"
        )
    H, acceptance = H.detach().double().cpu(), acceptance.detach().double().cpu()
    n = len(edges) - 1
    inner = torch.tensor(edges[1:-1], dtype=torch.float64)
    bucket = torch.bucketize(H, inner, right=True)  # [M] in 0..n-1, i: edges[i] <= H < edges[i+1]
    count = torch.bincount(bucket, minlength=n).tolist()
    total = torch.zeros(n, dtype=torch.float64).index_add_(0, bucket, acceptance).tolist()
    slope, intercept = least_squares(H, acceptance)
    return {
        "edges": [None if math.isinf(e) else float(e) for e in edges],
        "count": count,
        "alpha": [t / c if c else None for t, c in zip(total, count)],
        "slope": slope,
        "intercept": intercept,
    }


@dataclass
class EntropyProbe:
    """(H, acceptance) of every judged position over one or more `generate(..., probe=)`
    calls; `summary()` buckets them (`entropy_alpha`)."""

    entropy: list[Tensor] = field(default_factory=list)  # per round: [m] nats
    acceptance: list[Tensor] = field(default_factory=list)  # per round: [m]

    def add(self, H: Tensor, acceptance: Tensor) -> None:
        self.entropy.append(H)
        self.acceptance.append(acceptance)

    @property
    def count(self) -> int:
        return sum(h.numel() for h in self.entropy)

    def summary(self, edges: tuple[float, ...] = ENTROPY_EDGES) -> dict:
        if not self.entropy:
            return entropy_alpha(torch.zeros(0), torch.zeros(0), edges)
        return entropy_alpha(torch.cat(self.entropy), torch.cat(self.acceptance), edges)
