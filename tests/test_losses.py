import math

import pytest
import torch
from omegaconf import OmegaConf

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from train.losses import (
    LOSSES,
    acceptance_proxy,
    cross_entropy,
    forward_kl,
    reverse_kl,
    sampling_cutoffs,
    simulated_tau,
    top1_agreement,
    total_variation,
)

DIVERGENCES = [forward_kl, reverse_kl, total_variation]


def _logits(n: int = 10, v: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2


@pytest.mark.parametrize("fn", DIVERGENCES)
def test_zero_when_equal(fn):
    d, _ = _logits()
    mask = torch.ones(10)
    assert fn(d, d.clone(), mask).item() == pytest.approx(0.0, abs=1e-6)
    assert fn(d, d.clone(), mask, temperature=0.5).item() == pytest.approx(0.0, abs=1e-6)


def test_tv_is_one_minus_acceptance():
    d, t = _logits()
    mask = torch.ones(10)
    tv = total_variation(d, t, mask)
    alpha = acceptance_proxy(d, t, mask)
    assert tv.item() == pytest.approx(1.0 - alpha.item(), abs=1e-6)
    assert 0.0 < alpha.item() < 1.0


def test_hand_computed_three_token_vocab():
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.5, 0.25])
    t_logits, d_logits = p.log()[None], q.log()[None]
    mask = torch.ones(1)
    kl = 0.5 * math.log(2) + 0.25 * math.log(0.5)  # sum p log p/q
    rkl = 0.25 * math.log(0.5) + 0.5 * math.log(2)  # sum q log q/p
    assert forward_kl(d_logits, t_logits, mask).item() == pytest.approx(kl, abs=1e-6)
    assert reverse_kl(d_logits, t_logits, mask).item() == pytest.approx(rkl, abs=1e-6)
    assert total_variation(d_logits, t_logits, mask).item() == pytest.approx(0.25, abs=1e-6)
    assert acceptance_proxy(d_logits, t_logits, mask).item() == pytest.approx(0.75, abs=1e-6)
    # CE against the target's argmax (token 0) and against a data label (token 1).
    assert cross_entropy(d_logits, t_logits, mask).item() == pytest.approx(-math.log(0.25))
    ce_data = cross_entropy(d_logits, t_logits, mask, labels=torch.tensor([1]))
    assert ce_data.item() == pytest.approx(-math.log(0.5))
    # Temperature 2: p^(1/2), q^(1/2) renormalised.
    p2 = p.sqrt() / p.sqrt().sum()
    q2 = q.sqrt() / q.sqrt().sum()
    kl2 = (p2 * (p2 / q2).log()).sum().item()
    assert forward_kl(d_logits, t_logits, mask, temperature=2.0).item() == pytest.approx(kl2)


def test_mask_selects_positions():
    d, t = _logits(n=4)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0])
    for fn in [*DIVERGENCES, cross_entropy]:
        rows = [fn(d[i : i + 1], t[i : i + 1], torch.ones(1)).item() for i in (0, 2)]
        assert fn(d, t, mask).item() == pytest.approx(sum(rows) / 2, rel=1e-6)
        assert fn(d, t, mask, reduction="sum").item() == pytest.approx(sum(rows), rel=1e-6)
    # Empty mask: zero loss, but still differentiable.
    d.requires_grad_(True)
    loss = forward_kl(d, t, torch.zeros(4))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(d.grad == 0)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_chunked_equals_unchunked_value_and_grad(name):
    fn = LOSSES[name]
    d, t = _logits(n=37, v=11, seed=1)
    mask = (torch.arange(37) % 3 != 0).float()
    grads, values = [], []
    for chunk in (1000, 5):
        x = d.clone().requires_grad_(True)
        loss = fn(x, t, mask, temperature=1.3, chunk_size=chunk)
        loss.backward()
        values.append(loss.item())
        grads.append(x.grad)
    assert values[0] == pytest.approx(values[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_finite_gradients_with_topk_masked_logits(name):
    d, t = _logits(n=6, v=9, seed=2)
    # Top-3 masking on both sides (same support), as when both are truncated for sampling.
    keep = t.topk(3, dim=-1).indices
    neg = torch.full_like(t, float("-inf"))
    t_masked = neg.scatter(-1, keep, t.gather(-1, keep))
    d_masked = neg.scatter(-1, keep, d.gather(-1, keep)).requires_grad_(True)
    loss = LOSSES[name](d_masked, t_masked, torch.ones(6))
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(d_masked.grad).all()
    # Target-only masking: the draft keeps mass outside the target's support. Finite for
    # CE, KL(p||q) and TV; KL(q||p) is genuinely infinite there (documented in train/losses.py).
    x = d.clone().requires_grad_(True)
    loss = LOSSES[name](x, t_masked, torch.ones(6))
    if name == "rkl":
        assert loss.item() > 1e30  # q * (log q - log(finfo.min)): inf or astronomically large
        return
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def test_gradient_direction_reduces_loss():
    d, t = _logits(seed=3)
    mask = torch.ones(10)
    for fn in [*DIVERGENCES, cross_entropy]:
        x = d.clone().requires_grad_(True)
        loss = fn(x, t, mask)
        loss.backward()
        with torch.no_grad():
            stepped = fn(x - 0.1 * x.grad / x.grad.norm(), t, mask)
        assert stepped.item() < loss.item()


def test_bad_shapes_raise_clear_errors():
    d, t = _logits()
    with pytest.raises(ValueError, match="same V"):
        forward_kl(d, t[:, :5], torch.ones(10))
    with pytest.raises(ValueError, match="mask"):
        total_variation(d, t, torch.ones(9))
    with pytest.raises(ValueError, match="temperature"):
        reverse_kl(d, t, torch.ones(10), temperature=0.0)


def test_top1_and_simulated_tau():
    t = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    d = torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    assert top1_agreement(d, t.argmax(-1), torch.ones(2)).item() == 0.5
    assert simulated_tau([0.5], k=3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert simulated_tau([0.8, 0.5], k=3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert simulated_tau([1.0], k=4) == 5.0


# -- the acceptance proxy as the decoder sees it -------------------------------------------


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


def _oov_step(mask_out_of_vocab: bool):
    """One offset_losses call on a reduced-vocabulary draft: T = 4 positions, target argmax
    [0, 1, 2, 4] with draft ids [0, 2, 3], so positions 1 and 3 are out of vocabulary. The
    draft's argmax is the target's argmax over the draft ids at every position."""
    from models.protocol import DraftOutput
    from train.step_stats import offset_losses, proxy_tags, stats_size

    g = torch.Generator().manual_seed(5)
    V, vocab_ids = 5, torch.tensor([0, 2, 3])
    target = torch.randn(1, 4, V, generator=g)
    target[0, torch.arange(4), torch.tensor([0, 1, 2, 4])] += 6.0  # the argmax per position
    draft = 2.0 * target[..., vocab_ids] + 0.1 * torch.randn(1, 4, 3, generator=g)
    cfg = OmegaConf.create(
        {
            "train": {"offset_decay": 1.0, "mask_out_of_vocab": mask_out_of_vocab},
            "loss": {"name": "kl"},
            "decode": {"temperatures": [0.0, 0.7], "top_k": 0, "top_p": 0.9},
        }
    )
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "loss_mask": torch.ones(1, 4)}
    out = DraftOutput(logits=[draft], offsets=[0], vocab_ids=vocab_ids)
    stats = torch.zeros(stats_size(1, len(proxy_tags(cfg.decode))))
    loss = offset_losses(out, target, batch, [0], torch.tensor([4.0]), forward_kl, 1.0, cfg, stats)
    return loss, stats, target, draft, vocab_ids


def test_mask_out_of_vocab_drops_exactly_those_positions_from_the_loss():
    from train.step_stats import StepWindow

    kept = torch.tensor([0, 2])  # in-vocabulary positions
    loss_all, stats_all, target, draft, vocab_ids = _oov_step(False)
    loss_masked, stats_masked, _, _, _ = _oov_step(True)
    restricted = target[0][:, vocab_ids]  # [4, 3]: the loss's renormalised target
    want_all = forward_kl(draft[0], restricted, torch.ones(4), reduction="sum") / 4
    want_masked = forward_kl(draft[0, kept], restricted[kept], torch.ones(2), reduction="sum") / 4
    assert loss_all.item() == pytest.approx(want_all.item(), rel=1e-6)
    assert loss_masked.item() == pytest.approx(want_masked.item(), rel=1e-6)
    assert loss_masked.item() < loss_all.item()
    # The logged statistics are the decoder's on every position, masked or not.
    torch.testing.assert_close(stats_masked[1:], stats_all[1:])
    window = StepWindow(1, ["T0.7"])
    window.add(stats_masked, torch.tensor([4.0]), loss_masked.item(), 1.0, 0.1, 1.0)
    rec = window.flush(1, 1e-3, 4, [0])
    assert rec["oov_positions"] == 2.0 and rec["oov_share"] == 0.5
    # Positions 1 and 3 can never be greedy hits (counting the draft's vocabulary only: 1.0).
    assert rec["top1"] == [0.5]
    sampling = Sampling(0.7, top_p=0.9)
    alpha_07 = acceptance_proxy(
        draft[0], restricted, torch.ones(4), sampling, sampling_cutoffs(target[0], sampling)
    )
    assert rec["alpha_T0.7"] == [pytest.approx(alpha_07.item(), abs=1e-6)]
    assert rec["sim_tau_T0.7"] == pytest.approx(simulated_tau(rec["alpha_T0.7"], 4))
    assert rec["alpha_T0.7"] != pytest.approx(rec["alpha"], abs=1e-3)  # not the T = 1 value
