"""decoding/verify.py: exact output distributions, not sampling.

The output distribution of one verify step with draft x ~ q is
    P(y) = Σ_x q(x) [a(x) δ_{x,y} + (1 - a(x)) r_x(y)]
where a(x) is the acceptance threshold on the uniform u and r_x is the distribution the
correction is drawn from after rejecting x. Both are read off `rejection_verify` itself
(by feeding u just below / at the threshold), then P must equal p exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from transformers.generation.logits_process import TopPLogitsWarper

from decoding.drafter import Sampling
from decoding.verify import (
    acceptance_probability,
    check_sampling,
    emitted_drafts,
    greedy_verify,
    rejection_verify,
    residual_distribution,
    sampling_probs,
    verify,
)


def exact_output_distribution(p: Tensor, q: Tensor) -> tuple[Tensor, float]:
    """p, q [V] (float64). Returns the exact distribution of the emitted token and the
    acceptance mass, by enumerating the draft token and querying rejection_verify."""
    V = p.shape[0]
    out = torch.zeros(V, dtype=torch.float64)
    accept_mass = 0.0
    P = torch.stack([p, p])[None]  # [1, 2, V]: position 0 judges the draft, 1 is the bonus
    Q = q[None, None]  # [1, 1, V]
    for x in range(V):
        if q[x] == 0:
            continue  # never drafted
        a = float(acceptance_probability(p[x : x + 1], q[x : x + 1]))
        tok = torch.tensor([[x]])
        if a > 0:  # u just below the threshold accepts
            res, _ = rejection_verify(
                tok, Q, P, uniforms=torch.tensor([[a * (1 - 1e-9)]], dtype=torch.float64)
            )
            assert res.num_accepted.item() == 1
        if a < 1:  # u at the threshold rejects, and the correction comes from the residual
            res, dist = rejection_verify(
                tok, Q, P, uniforms=torch.tensor([[a]], dtype=torch.float64)
            )
            assert res.num_accepted.item() == 0
            out += q[x] * (1 - a) * dist[0]
        out[x] += q[x] * a
        accept_mass += float(q[x]) * a
    return out, accept_mass


def test_three_token_example_is_exact():
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    out, mass = exact_output_distribution(p, q)
    assert abs(mass - 0.6) < 1e-12  # Σ min(p, q) = .2 + .3 + .1
    torch.testing.assert_close(out, p, rtol=0, atol=1e-12)
    # Residual after a rejection: max(p - q, 0) = [.4, 0, 0] -> all mass on token 0.
    torch.testing.assert_close(
        residual_distribution(p, q), torch.tensor([1.0, 0, 0], dtype=torch.float64)
    )


def _random_dist(g: torch.Generator, V: int, kind: str) -> Tensor:
    x = torch.rand(V, generator=g, dtype=torch.float64)
    if kind == "zeros":
        x[torch.rand(V, generator=g) < 0.5] = 0.0
        x[0] += 1e-3  # keep it a distribution
    elif kind == "tiny":
        x[torch.rand(V, generator=g) < 0.5] = 1e-30
    elif kind == "peaked":
        x = (x * 30).softmax(0)
    return x / x.sum()


def test_random_pairs_are_exact_including_zeros_tiny_and_equal():
    g = torch.Generator().manual_seed(0)
    kinds = ["plain", "zeros", "tiny", "peaked"]
    for trial in range(200):
        V = int(torch.randint(2, 12, (1,), generator=g))
        p = _random_dist(g, V, kinds[trial % 4])
        q = p.clone() if trial % 10 == 0 else _random_dist(g, V, kinds[(trial // 4) % 4])
        out, mass = exact_output_distribution(p, q)
        torch.testing.assert_close(out, p, rtol=0, atol=1e-12)
        assert abs(mass - float(torch.minimum(p, q).sum())) < 1e-12
        if trial % 10 == 0:
            assert abs(mass - 1.0) < 1e-12  # p == q: every draft accepted


def test_acceptance_probability_edge_cases():
    p = torch.tensor([0.0, 0.5, 0.2, 0.0])
    q = torch.tensor([0.3, 0.0, 0.4, 0.0])
    assert acceptance_probability(p, q).tolist() == [0.0, 1.0, 0.5, 0.0]


def test_empty_residual_falls_back_to_p():
    p = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(residual_distribution(p, p.clone()), p)


def test_rows_reject_at_different_positions():
    # B=3, k=3, V=4. Every draft token has p = 0.5, q = 1.0 -> a = 0.5 at each position.
    V, k = 4, 3
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    q = torch.nn.functional.one_hot(drafts, V).float()  # [3, 3, 4]
    p = torch.full((3, k + 1, V), 0.5 / 3)
    for i in range(k):
        p[:, i, drafts[0, i]] = 0.5
    p[:, k] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    u = torch.tensor([[0.9, 0.1, 0.1], [0.1, 0.1, 0.9], [0.1, 0.1, 0.1]])
    res, dist = rejection_verify(
        drafts, q, p, uniforms=u, generator=torch.Generator().manual_seed(0)
    )
    assert res.num_accepted.tolist() == [0, 2, 3]
    # Row 0 rejects d_1 = 1: residual = p[0,0] with token 1 removed, renormalised.
    torch.testing.assert_close(dist[0], torch.tensor([1 / 3, 0.0, 1 / 3, 1 / 3]))
    torch.testing.assert_close(dist[1], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0]))
    torch.testing.assert_close(dist[2], p[2, k])  # all accepted: bonus from p at k
    assert res.next_token[0].item() != 1 and res.next_token[1].item() != 3


def test_greedy_verify_per_row():
    V = 6
    target_tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 5, 5, 5]])
    logits = torch.nn.functional.one_hot(target_tokens, V).float() * 5.0  # [3, 4, 6]
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [4, 5, 5]])
    res = greedy_verify(drafts, logits)
    assert res.num_accepted.tolist() == [3, 1, 0]
    assert res.next_token.tolist() == [4, 2, 5]  # bonus, correction, correction


def test_verify_dispatch_greedy_matches_sampling_with_one_hot():
    # Sampling with a near-zero temperature behaves like greedy for a one-hot draft.
    logits = torch.tensor([[[0.0, 3.0, 1.0], [2.0, 0.0, 0.0]]])
    drafts = torch.tensor([[1]])
    g = verify(drafts, None, logits, Sampling())
    s = verify(
        drafts,
        torch.tensor([[[0.0, 1.0, 0.0]]]),
        logits,
        Sampling(temperature=1e-4),
        generator=torch.Generator().manual_seed(0),
    )
    assert g.num_accepted.tolist() == s.num_accepted.tolist() == [1]
    assert g.next_token.tolist() == s.next_token.tolist() == [0]


def test_sampling_probs_matches_references():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g) * 3
    torch.testing.assert_close(
        sampling_probs(logits, Sampling(temperature=0.7)), (logits / 0.7).softmax(-1)
    )
    for top_p in (0.1, 0.5, 0.9, 0.999):
        ours = sampling_probs(logits, Sampling(temperature=0.7, top_p=top_p))
        ref = TopPLogitsWarper(top_p=top_p)(None, logits / 0.7).softmax(-1)
        torch.testing.assert_close(ours, ref)
    topk = sampling_probs(logits, Sampling(temperature=1.0, top_k=3))
    assert (topk > 0).sum(-1).tolist() == [3] * 5
    kept = logits.topk(3, -1).indices
    torch.testing.assert_close(topk.gather(-1, kept), logits.gather(-1, kept).softmax(-1))
    greedy = sampling_probs(logits, Sampling())
    assert greedy.argmax(-1).tolist() == logits.argmax(-1).tolist() and (greedy.sum(-1) == 1).all()


@pytest.mark.parametrize(
    "bad, word",
    [
        (Sampling(temperature=-0.1), "temperature"),
        (Sampling(top_p=0.0), "top_p"),
        (Sampling(top_p=1.5), "top_p"),
        (Sampling(top_k=-1), "top_k"),
        (Sampling(temperature=float("nan")), "temperature"),
    ],
)
def test_bad_sampling_settings_raise(bad, word):
    with pytest.raises(ValueError, match=word):
        check_sampling(bad)


def test_emitted_drafts_stop_at_the_first_eos():
    accepted = torch.tensor([[5, 2, 6, 7], [5, 6, 7, 8], [2, 9, 2, 6], [5, 6, 7, 9]])
    eos = torch.tensor([2, 9])
    assert emitted_drafts(accepted, eos).tolist() == [2, 4, 1, 4]
    assert emitted_drafts(accepted, eos[:0]).tolist() == [4] * 4  # no EOS: every draft
    assert emitted_drafts(accepted[:, :0], eos).tolist() == [0] * 4  # nothing accepted
