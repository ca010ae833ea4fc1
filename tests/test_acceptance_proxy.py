"""The acceptance statistics (train/losses/acceptance.py) as the decoder sees them: alpha at the
decode's temperature / top-k / top-p, a reduced draft vocabulary against the target's
un-renormalised full-vocabulary p, top-1 agreement and the simulated tau."""

import pytest
import torch

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from train.losses.acceptance import (
    acceptance_proxy,
    sampling_cutoffs,
    simulated_tau,
    top1_agreement,
)


def test_top1_and_simulated_tau():
    t = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    d = torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    assert top1_agreement(d, t.argmax(-1), torch.ones(2)).item() == 0.5
    assert simulated_tau([0.5], k=3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert simulated_tau([0.8, 0.5], k=3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert simulated_tau([1.0], k=4) == 5.0


def _sampled(probs: list[float], temperature: float, top_p: float) -> list[float]:
    """By hand: p^(1/T) normalised, then the smallest most-likely prefix reaching top_p."""
    powered = [x ** (1 / temperature) for x in probs]
    scaled = [x / sum(powered) for x in powered]
    order = sorted(range(len(probs)), key=lambda i: -scaled[i])
    kept, mass = set(), 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.add(i)
        mass += scaled[i]
    total = sum(scaled[i] for i in kept)
    return [scaled[i] / total if i in kept else 0.0 for i in range(len(probs))]


def test_proxy_at_decode_temperature_and_top_p_matches_hand_computation():
    p, q = [0.5, 0.3, 0.15, 0.05], [0.4, 0.4, 0.1, 0.1]
    t_logits, d_logits = torch.tensor(p).log()[None], torch.tensor(q).log()[None]
    mask = torch.ones(1)
    # T = 0.7, top-p 0.8 keeps tokens {0, 1} of both: p -> [.675, .325, 0, 0], q -> [.5, .5, 0, 0].
    p_s, q_s = _sampled(p, 0.7, 0.8), _sampled(q, 0.7, 0.8)
    assert p_s[2:] == [0.0, 0.0] and q_s == [0.5, 0.5, 0.0, 0.0]
    want = sum(min(a, b) for a, b in zip(p_s, q_s, strict=True))
    sampling = Sampling(temperature=0.7, top_p=0.8)
    got = acceptance_proxy(d_logits, t_logits, mask, sampling).item()
    assert got == pytest.approx(want, abs=1e-6)
    plain = acceptance_proxy(d_logits, t_logits, mask).item()  # T = 1, no truncation
    assert plain == pytest.approx(0.85, abs=1e-6)  # 0.4 + 0.3 + 0.1 + 0.05
    assert abs(got - plain) > 0.02


def test_proxy_is_the_verifier_acceptance_with_reduced_vocab_topk_topp():
    """alpha per row = sum_x min(p, q) with p, q exactly as decoding.verify samples them:
    p over the full vocabulary, q over the draft ids scattered into it (zeros elsewhere)."""
    g = torch.Generator().manual_seed(4)
    N, V = 12, 50
    vocab_ids = torch.randperm(V, generator=g)[:20].sort().values  # [Vd]
    t = torch.randn(N, V, generator=g) * 3
    d = t[:, vocab_ids] + torch.randn(N, 20, generator=g)
    mask = torch.ones(N)
    for sampling in (Sampling(0.7), Sampling(0.7, top_k=30, top_p=0.9), Sampling(1.3, top_p=0.5)):
        p = sampling_probs(t, sampling)  # [N, V]
        q = torch.zeros(N, V).index_copy(1, vocab_ids, sampling_probs(d, sampling))
        want = torch.minimum(p, q).sum(-1)  # [N]
        cut = sampling_cutoffs(t, sampling)
        got = [
            acceptance_proxy(
                d[i : i + 1], t[i : i + 1, vocab_ids], mask[:1], sampling, cut[i : i + 1]
            )
            for i in range(N)
        ]
        torch.testing.assert_close(torch.stack(got), want, rtol=0, atol=1e-6)


def test_reduced_vocab_alpha_uses_the_unrenormalised_target():
    # Target over 4 tokens; the draft knows ids [0, 2] only. p = [.4, .3, .2, .1]: the
    # decoder accepts at most p(0) + p(2) = 0.6, whatever q is.
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    vocab_ids = torch.tensor([0, 2])
    q = torch.tensor([[0.5, 0.5]])
    sampling = Sampling(temperature=1.0)
    alpha = acceptance_proxy(
        q.log(), p.log()[:, vocab_ids], torch.ones(1), sampling, sampling_cutoffs(p.log(), sampling)
    )
    assert alpha.item() == pytest.approx(min(0.4, 0.5) + min(0.2, 0.5), abs=1e-6)  # 0.6
    # The loss's view renormalises p over the draft ids to [2/3, 1/3]: alpha 0.5 + 1/3.
    renormalised = acceptance_proxy(q.log(), p.log()[:, vocab_ids], torch.ones(1))
    assert renormalised.item() == pytest.approx(0.5 + 1 / 3, abs=1e-6)


def test_top1_counts_a_miss_when_the_target_argmax_is_outside_the_draft_vocab():
    vocab_ids = torch.tensor([0, 2, 3])
    target_tokens = torch.tensor([2, 1, 3])  # position 1's argmax (id 1) is not a draft id
    draft = torch.tensor([[0.0, 5.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 5.0]])  # ids 2, 2, 3
    hits = top1_agreement(draft, target_tokens, torch.ones(3), vocab_ids, reduction="sum")
    assert hits.item() == 2.0
    with pytest.raises(ValueError, match="argmax token ids"):
        top1_agreement(draft, torch.zeros(3, 4), torch.ones(3), vocab_ids)
