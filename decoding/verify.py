"""Verification of a drafted chain: pure tensor maths, no model or cache calls.

Greedy: draft token i is accepted iff it equals the target's argmax at that position; the
first mismatch is replaced by the target's argmax (correction), and if all k match, the
target's argmax after the last draft is a free bonus token.

Sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x ~ q is accepted with
probability min(1, p(x)/q(x)); at the first rejection the correction is drawn from
normalize(max(p - q, 0)); if all k are accepted the bonus is drawn from p at position k.
Every emitted token is then an exact sample of p given its prefix:
    P(emit y) = q(y) min(1, p(y)/q(y)) + (1 - Σ_x min(p(x), q(x))) r(y)
              = min(p(y), q(y)) + max(p(y) - q(y), 0) = p(y).
p and q must be the distributions AFTER the same temperature / top-k / top-p transform
(`sampling_probs`), or the output is a sample of the wrong distribution.

Shapes: B rows, k drafts, V vocabulary. `p` has k+1 positions: p[:, i] is the target's
distribution for the token after [last, d_1..d_i], so p[:, i] judges d_{i+1} and p[:, k]
gives the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from decoding.drafter import Sampling


@dataclass
class VerifyResult:
    num_accepted: Tensor  # [B] long, accepted drafts per row (0..k)
    next_token: Tensor  # [B] long, correction (n < k) or bonus (n == k) token per row


def check_sampling(sampling: Sampling) -> None:
    """Raise a ValueError naming the bad field (called before any decoding starts)."""
    if not sampling.temperature >= 0.0:  # also catches NaN
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}")
    if not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {sampling.top_p}")
    if sampling.top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")


def sampling_probs(logits: Tensor, sampling: Sampling) -> Tensor:
    """Logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k, top-p.

    Greedy (temperature 0) gives the one-hot of the argmax, so the same code paths work.
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (the most
    likely token is always kept)."""
    logits = logits.float()
    if sampling.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def acceptance_probability(p_x: Tensor, q_x: Tensor) -> Tensor:
    """min(1, p(x)/q(x)) elementwise. q(x) = 0 (a token the draft could not have sampled,
    e.g. from a deterministic drafter's rounding) is accepted iff p(x) > 0."""
    ratio = p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)
    return torch.where(q_x > 0, ratio.clamp(max=1.0), (p_x > 0).to(p_x.dtype))


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """normalize(max(p - q, 0)) over the last dim. When p <= q everywhere (p == q) the
    residual is empty; rejection then has probability 0, and we fall back to p so the
    result is still a distribution (matters only for float round-off)."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(p.dtype).tiny), p)


def greedy_verify(draft_tokens: Tensor, target_logits: Tensor) -> VerifyResult:
    """draft_tokens [B, k], target_logits [B, k+1, V] -> accepted counts and next tokens."""
    target_tokens = target_logits.argmax(-1)  # [B, k+1]
    return greedy_verify_tokens(draft_tokens, target_tokens)


def greedy_verify_tokens(draft_tokens: Tensor, target_tokens: Tensor) -> VerifyResult:
    """Same as greedy_verify, from the target's argmax tokens [B, k+1]."""
    k = draft_tokens.shape[1]
    match = draft_tokens == target_tokens[:, :k]  # [B, k]
    num_accepted = match.long().cumprod(-1).sum(-1)  # [B], length of the matching prefix
    next_token = target_tokens.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    return VerifyResult(num_accepted, next_token)


def rejection_verify(
    draft_tokens: Tensor,  # [B, k]
    q: Tensor,  # [B, k, V] draft distributions the tokens were drawn from
    p: Tensor,  # [B, k+1, V] target distributions (same sampling transform)
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,  # [B, k] optional, for exact tests
) -> tuple[VerifyResult, Tensor]:
    """Speculative sampling. Returns the result and the distribution [B, V] the next token
    was drawn from (residual at the first rejection, or p[:, k] when all were accepted)."""
    B, k = draft_tokens.shape
    p_x = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_x = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    if uniforms is None:
        uniforms = torch.rand(B, k, generator=generator, device=p.device)
    accept = uniforms < acceptance_probability(p_x, q_x)  # [B, k]; u in [0,1), p_x=0 never passes
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]
    # Next-token distribution per row: residual at the rejected position, else p at k.
    rows = torch.arange(B, device=p.device)
    p_next = p[rows, num_accepted]  # [B, V]
    q_padded = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, k+1, V]; q = 0 at bonus
    q_next = q_padded[rows, num_accepted]  # [B, V]
    next_dist = residual_distribution(p_next, q_next)  # equals p_next when q_next = 0
    next_token = torch.multinomial(next_dist, 1, generator=generator).squeeze(1)  # [B]
    return VerifyResult(num_accepted, next_token), next_dist


def verify(
    draft_tokens: Tensor,  # [B, k]
    q: Tensor | None,  # [B, k, V] or None for greedy
    target_logits: Tensor,  # [B, k+1, V]
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Dispatch on the sampling mode: what the decoding loop calls."""
    if sampling.greedy:
        return greedy_verify(draft_tokens, target_logits)
    if q is None:
        raise ValueError(
            "sampling verification needs the draft distributions q; the drafter returned None"
        )
    p = sampling_probs(target_logits, sampling)
    result, _ = rejection_verify(draft_tokens, q.float(), p, generator=generator)
    return result


def emitted_drafts(accepted: Tensor, eos_ids: Tensor) -> Tensor:
    """accepted [B, n] accepted draft tokens, eos_ids [E] -> [B] how many of them each row
    emits: all n, or up to and including its first EOS (the row stops there, so accepted
    drafts after an EOS are never emitted)."""
    is_eos = torch.isin(accepted, eos_ids).long()  # [B, n]
    after_eos = is_eos.cumsum(-1) - is_eos  # [B, n] > 0 strictly after the first EOS
    return (after_eos == 0).sum(-1)


def sample(logits: Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> Tensor:
    """One token per row from logits [B, V] (argmax when greedy) -> [B]."""
    if sampling.greedy:
        return logits.argmax(-1)
    probs = sampling_probs(logits, sampling)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


# ---------------------------------------------------------------------------------------
# Trees. Node i (0..N-1) has a parent in 0..i-1 or -1 (the root: the newest token, whose
# target distribution is position 0 of the verify forward); node i's own target
# distribution is position i+1. Parents precede children, so one pass in index order works.
#
# Sampling over a tree (SpecInfer; multi-draft speculative sampling, Jeon et al. 2024 RSD):
# at an accepted node with target distribution r = p, its children x_1..x_m are tried in
# index order; child j is accepted with min(1, r(x_j)/q_j(x_j)), and on rejection
# r <- normalize(max(r - q_j, 0)); if no child is accepted the next token is drawn from r;
# at an accepted leaf it is drawn from p at that leaf (bonus). q_j is the distribution x_j
# was drawn from GIVEN x_1..x_{j-1}. Each try is one ordinary rejection step that emits an
# exact sample of the current r, so by induction over the siblings the emitted token is
# an exact sample of p (the proof of verify.py's header, applied to r_j instead of p):
#     P(y | r_j) = min(r_j(y), q_j(y)) + (1 - Σ min(r_j, q_j)) r_{j+1}(y) = r_j(y).
# Valid sibling schemes: i.i.d. draws (q_j = q), draws without replacement (q_j = q with
# x_1..x_{j-1} removed and renormalised) and deterministic candidates such as top-k
# (q_j = one-hot(x_j): accept with r(x_j), else zero x_j in r and renormalise), which is
# what `q=None` means. Tested by exact enumeration in tests/test_tree.py.
# ---------------------------------------------------------------------------------------


@dataclass
class TreeVerifyResult:
    num_accepted: Tensor  # [B] long, accepted depth per row
    path: Tensor  # [B, D] long, accepted node ids root-down (-1 past the accepted depth)
    next_token: Tensor  # [B] long, correction or bonus token after the accepted path
    accept_prob: Tensor | None = (
        None  # [B, N] sampling: threshold each tried node met (NaN untried)
    )


def node_depths(parents: Tensor) -> Tensor:
    """parents [B, N] (-1 = root) -> depth of every node [B, N] (children of the root: 1)."""
    B, N = parents.shape
    depth = torch.zeros(B, N + 1, dtype=torch.long, device=parents.device)  # column 0: root
    for i in range(N):
        depth[:, i + 1] = depth.gather(1, parents[:, i : i + 1] + 1)[:, 0] + 1
    return depth[:, 1:]


def check_tree(tokens: Tensor, parents: Tensor) -> None:
    if tokens.shape != parents.shape or tokens.dim() != 2:
        raise ValueError(
            f"tree tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must both be [B, N]"
        )
    ids = torch.arange(parents.shape[1], device=parents.device)
    if bool(((parents < -1) | (parents >= ids)).any()):
        raise ValueError(
            "tree parents must satisfy -1 <= parents[:, i] < i (parents before children)"
        )


def _path_to(node: Tensor, parents: Tensor, depth: Tensor) -> Tensor:
    """Node ids root-down to `node` [B] (-1 = root) -> [B, D] with -1 past each row's depth."""
    B, N = parents.shape
    D = int(depth.max()) if N else 0
    path = torch.full((B, D), -1, dtype=torch.long, device=parents.device)
    if N == 0:
        return path
    node_depth = torch.where(node >= 0, depth.gather(1, node.clamp_min(0)[:, None])[:, 0], 0)
    cur = node.clone()
    for d in range(D, 0, -1):
        here = node_depth >= d
        path[:, d - 1] = torch.where(here, cur, -1)
        parent = parents.gather(1, cur.clamp_min(0)[:, None])[:, 0]
        cur = torch.where(here, parent, cur)
    return path


def tree_greedy_verify(tokens: Tensor, parents: Tensor, target_tokens: Tensor) -> TreeVerifyResult:
    """tokens, parents [B, N]; target_tokens [B, N+1] (the target's argmax at the root and at
    every node). The accepted path is the longest root path whose tokens all equal the
    target's argmax after their parent; ties (duplicate siblings) go to the lower node id."""
    check_tree(tokens, parents)
    B, N = tokens.shape
    accepted = torch.zeros(B, N + 1, dtype=torch.bool, device=tokens.device)
    accepted[:, 0] = True  # the root is already emitted
    for i in range(N):
        parent = parents[:, i : i + 1] + 1  # [B, 1] column of the parent
        want = target_tokens.gather(1, parent)[:, 0]
        accepted[:, i + 1] = accepted.gather(1, parent)[:, 0] & (tokens[:, i] == want)
    depth = node_depths(parents)  # [B, N]
    score = torch.where(accepted[:, 1:], depth, 0)
    if N:
        best = score.argmax(-1)  # first maximum: the lowest node id at the deepest accepted depth
        num_accepted = score.gather(1, best[:, None])[:, 0]
        node = torch.where(num_accepted > 0, best, -1)
    else:
        num_accepted = torch.zeros(B, dtype=torch.long, device=tokens.device)
        node = num_accepted - 1
    next_token = target_tokens.gather(1, (node + 1)[:, None])[:, 0]
    return TreeVerifyResult(num_accepted, _path_to(node, parents, depth), next_token)


def tree_rejection_verify(
    tokens: Tensor,  # [B, N]
    parents: Tensor,  # [B, N]
    q: Tensor | None,  # [B, N, V] each node's draft distribution given its earlier siblings
    p: Tensor,  # [B, N+1, V] target distributions (same sampling transform)
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,  # [B, N] optional: the uniform each node is judged with
) -> tuple[TreeVerifyResult, Tensor]:
    """Recursive rejection sampling down the tree (see the block comment above). q=None:
    every node was a deterministic choice (q_j = one-hot). Returns the result and the
    distribution [B, V] the next token was drawn from."""
    check_tree(tokens, parents)
    B, N = tokens.shape
    V = p.shape[-1]
    if uniforms is None:
        uniforms = torch.rand(B, N, generator=generator, device=p.device, dtype=p.dtype)
    accept_prob = torch.full((B, N), float("nan"), dtype=p.dtype, device=p.device)
    children_rows = parents.tolist()
    tokens_rows = tokens.tolist()
    node_rows = []  # per row: the accepted node, -1 = the root
    next_dist = torch.empty(B, V, dtype=p.dtype, device=p.device)
    for b in range(B):
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(children_rows[b]):
            children.setdefault(parent, []).append(i)
        cur, r = -1, p[b, 0]
        while True:
            for c in children.get(cur, []):
                x = tokens_rows[b][c]
                q_c = q[b, c] if q is not None else F.one_hot(tokens[b, c], V).to(p.dtype)
                a = acceptance_probability(r[x : x + 1], q_c[x : x + 1])[0]
                accept_prob[b, c] = a
                if uniforms[b, c] < a:
                    cur, r = c, p[b, c + 1]
                    break
                r = residual_distribution(r, q_c)
            else:  # every child rejected (r is the residual), or a leaf (r = p there: bonus)
                break
        node_rows.append(cur)
        next_dist[b] = r
    node = torch.tensor(node_rows, dtype=torch.long, device=p.device)
    depth = node_depths(parents)
    num_accepted = torch.where(
        node >= 0, depth.gather(1, node.clamp_min(0)[:, None])[:, 0] if N else node, 0
    )
    next_token = torch.multinomial(next_dist, 1, generator=generator)[:, 0]
    result = TreeVerifyResult(num_accepted, _path_to(node, parents, depth), next_token, accept_prob)
    return result, next_dist


def tree_verify(
    tokens: Tensor,  # [B, N]
    parents: Tensor,  # [B, N]
    q: Tensor | None,  # [B, N, V], or None (greedy, or deterministic candidates)
    target_logits: Tensor,  # [B, N+1, V]
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Dispatch on the sampling mode: what the tree decoding loop calls."""
    if sampling.greedy:
        return tree_greedy_verify(tokens, parents, target_logits.argmax(-1))
    p = sampling_probs(target_logits, sampling)
    result, _ = tree_rejection_verify(
        tokens, parents, None if q is None else q.float(), p, generator=generator
    )
    return result
