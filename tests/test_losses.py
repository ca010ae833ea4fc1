import math
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from train.losses import (
    LOSSES,
    acceptance_proxy,
    ce_tv_mix,
    cross_entropy,
    forward_kl,
    lk_alpha,
    lk_lambda,
    loss_options,
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
    for fn in [*DIVERGENCES, cross_entropy, lk_lambda, lk_alpha, ce_tv_mix]:
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


# -- the TV family: LK^lambda, LK^alpha, DSpark's CE + TV mix --------------------------------

TV_FAMILY = {
    "lk": lk_lambda,
    "lk_batch": partial(lk_lambda, alpha_mode="batch"),
    "lk_alpha": lk_alpha,
    "dspark": ce_tv_mix,
}


def test_tv_family_hand_computed_three_token_vocab():
    # p = [.5, .3, .2], q = [.2, .3, .5]: alpha = .2 + .3 + .2 = 0.7, TV = 0.3,
    # KL(p || q) = .5 log(.5/.2) + .3 log 1 + .2 log(.2/.5) = 0.3 log 2.5.
    t_logits = torch.tensor([[0.5, 0.3, 0.2]]).log() + 4.0  # a shift changes nothing
    d_logits = torch.tensor([[0.2, 0.3, 0.5]]).log()
    mask = torch.ones(1)
    alpha, tv, kl = 0.7, 0.3, 0.3 * math.log(2.5)
    lam3, lam10 = math.exp(-3 * alpha), math.exp(-10 * alpha)
    assert lk_lambda(d_logits, t_logits, mask).item() == pytest.approx(
        lam3 * kl + (1 - lam3) * tv, abs=1e-6
    )
    assert lk_lambda(d_logits, t_logits, mask, eta=10.0).item() == pytest.approx(
        lam10 * kl + (1 - lam10) * tv, abs=1e-6
    )
    assert lk_alpha(d_logits, t_logits, mask).item() == pytest.approx(-math.log(0.7), abs=1e-6)
    # DSpark: CE on the target's argmax (token 0, q = .2) or a data label (token 1, q = .3).
    dspark = 0.1 * -math.log(0.2) + 1.8 * tv
    assert ce_tv_mix(d_logits, t_logits, mask).item() == pytest.approx(dspark, abs=1e-6)
    mix = ce_tv_mix(d_logits, t_logits, mask, labels=torch.tensor([1]), tv_weight=0.9)
    assert mix.item() == pytest.approx(0.1 * -math.log(0.3) + 0.9 * tv, abs=1e-6)
    # A second row with q = p (alpha 1, KL 0, TV 0). Per position it adds 0 to the sum; with
    # alpha_mode=batch both rows share lambda = exp(-3 * mean alpha) = exp(-3 * 0.85).
    t2 = torch.cat([t_logits, d_logits])
    d2 = torch.cat([d_logits, d_logits])
    two = torch.ones(2)
    assert lk_lambda(d2, t2, two).item() == pytest.approx((lam3 * kl + (1 - lam3) * tv) / 2)
    lam_b = math.exp(-3 * 0.85)
    assert lk_lambda(d2, t2, two, alpha_mode="batch").item() == pytest.approx(
        (lam_b * kl + (1 - lam_b) * tv) / 2, abs=1e-6
    )


def test_tv_family_reduced_vocab_alpha_is_the_decoders():
    # Full target p = [.4, .3, .2, .1]; the draft knows ids [0, 1, 2] with q = [.5, .25, .25].
    # The decoder: alpha = min(.4, .5) + min(.3, .25) + min(.2, .25) = 0.85 (token 3 is always
    # rejected). Renormalised over the draft ids, p = [4/9, 3/9, 2/9] gives alpha = 0.91667.
    full = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log() + 2.0  # [1, V]: logsumexp 2, not 0
    vocab_ids = torch.tensor([0, 1, 2])
    t = full[:, vocab_ids]  # [1, Vd]
    d = torch.tensor([[0.5, 0.25, 0.25]]).log()
    mask, log_norm = torch.ones(1), full.logsumexp(-1)  # [1]
    alpha, renorm_alpha = 0.85, 4 / 9 + 0.25 + 2 / 9
    p_ren, q = [4 / 9, 3 / 9, 2 / 9], [0.5, 0.25, 0.25]
    kl = sum(a * math.log(a / b) for a, b in zip(p_ren, q, strict=True))  # p renormalised
    lam = math.exp(-3 * alpha)
    got = lk_lambda(d, t, mask, target_log_norm=log_norm)
    assert got.item() == pytest.approx(lam * kl + (1 - lam) * (1 - alpha), abs=1e-6)
    assert lk_alpha(d, t, mask, target_log_norm=log_norm).item() == pytest.approx(
        -math.log(alpha), abs=1e-6
    )
    assert ce_tv_mix(d, t, mask, target_log_norm=log_norm).item() == pytest.approx(
        0.1 * -math.log(0.5) + 1.8 * (1 - alpha), abs=1e-6
    )
    # The same alpha as the logged proxy; without the normaliser, the renormalised value.
    sampling = Sampling(temperature=1.0)
    proxy = acceptance_proxy(d, t, mask, sampling, sampling_cutoffs(full, sampling))
    assert lk_alpha(d, t, mask, target_log_norm=log_norm).item() == pytest.approx(
        -math.log(proxy.item()), abs=1e-6
    )
    assert lk_alpha(d, t, mask).item() == pytest.approx(-math.log(renorm_alpha), abs=1e-6)
    # `tv` keeps the loss's renormalised view: 1 - 0.91667, not the decoder's 0.15.
    assert total_variation(d, t, mask).item() == pytest.approx(1 - renorm_alpha, abs=1e-6)


def test_lk_lambda_is_kl_at_zero_alpha_and_tends_to_tv_as_eta_alpha_grows():
    d, t = _logits(n=6, v=9, seed=6)
    mask = torch.ones(6)
    # eta = 0: lambda = 1 everywhere, exactly forward KL in value and gradient.
    x, y = d.clone().requires_grad_(True), d.clone().requires_grad_(True)
    lk, kl = lk_lambda(x, t, mask, eta=0.0), forward_kl(y, t, mask)
    lk.backward()
    kl.backward()
    assert lk.item() == pytest.approx(kl.item(), rel=1e-6)
    torch.testing.assert_close(x.grad, y.grad)
    # alpha ~ 0 (p on token 0, q on token 1): lambda = exp(-3 alpha) ~ 1, pure KL.
    far_t = torch.tensor([[20.0, 0.0, 0.0, 0.0]])
    far_d = torch.tensor([[0.0, 20.0, 0.0, 0.0]])
    one = torch.ones(1)
    assert acceptance_proxy(far_d, far_t, one).item() < 1e-7
    assert lk_lambda(far_d, far_t, one).item() == pytest.approx(
        forward_kl(far_d, far_t, one).item(), rel=1e-6
    )
    assert forward_kl(far_d, far_t, one).item() > 10 * total_variation(far_d, far_t, one).item()
    # eta * alpha large: lambda = exp(-eta alpha) ~ 0, TV (the paper's eta = 3 keeps lambda
    # >= exp(-3) = 0.05 even at alpha = 1, so LK^lambda always keeps some KL).
    alphas = [acceptance_proxy(d[i : i + 1], t[i : i + 1], one).item() for i in range(6)]
    assert min(alphas) > 0.05
    near_tv = lk_lambda(d, t, mask, eta=1000.0)
    assert near_tv.item() == pytest.approx(total_variation(d, t, mask).item(), abs=1e-6)
    assert abs(lk_lambda(d, t, mask).item() - near_tv.item()) > 1e-2


@pytest.mark.parametrize("alpha_mode", ["position", "batch"])
def test_lk_lambda_gradient_treats_lambda_as_a_constant(alpha_mode):
    d, t = _logits(n=5, v=6, seed=7)
    mask, one, T = torch.ones(5), torch.ones(1), 1.3
    with torch.no_grad():  # alpha per row at temperature T, by hand
        q, p = (d / T).softmax(-1), (t / T).softmax(-1)
        alpha = torch.minimum(p, q).sum(-1)  # [5]
    lam = torch.exp(-3.0 * (alpha if alpha_mode == "position" else alpha.mean().expand(5)))
    x = d.clone().requires_grad_(True)
    lk_lambda(x, t, mask, temperature=T, alpha_mode=alpha_mode).backward()
    y = d.clone().requires_grad_(True)
    want = sum(
        lam[i] * forward_kl(y[i : i + 1], t[i : i + 1], one, T)
        + (1 - lam[i]) * total_variation(y[i : i + 1], t[i : i + 1], one, T)
        for i in range(5)
    )
    (want / 5).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-7)


def _reduced_vocab_case(n: int = 23, seed: int = 8):
    """Draft logits [n, 6] over 6 of a 10-token target vocabulary: (d, t at the draft ids,
    the full rows' logsumexp at T = 1.3, labels)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(n, 10, generator=g) * 2
    vocab_ids = torch.tensor([0, 2, 3, 5, 7, 8])
    t = full[:, vocab_ids]
    d = t + torch.randn(n, 6, generator=g)
    labels = torch.randint(0, 6, (n,), generator=g)
    return d, t, (full / 1.3).logsumexp(-1), labels


@pytest.mark.parametrize("name", sorted(TV_FAMILY))
def test_tv_family_chunked_equals_unchunked_with_a_reduced_vocab(name):
    d, t, log_norm, labels = _reduced_vocab_case()
    mask = (torch.arange(23) % 4 != 1).float()
    extra = {"labels": labels} if name == "dspark" else {}
    values, grads = [], []
    for chunk in (1000, 4):
        x = d.clone().requires_grad_(True)
        loss = TV_FAMILY[name](
            x, t, mask, temperature=1.3, target_log_norm=log_norm, chunk_size=chunk, **extra
        )
        loss.backward()
        values.append(loss.item())
        grads.append(x.grad)
    assert values[0] == pytest.approx(values[1], rel=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("name", sorted(TV_FAMILY))
def test_tv_family_mask_and_reduction(name):
    d, t, log_norm, labels = _reduced_vocab_case(n=6)
    fn = TV_FAMILY[name]
    extra = {"labels": labels} if name == "dspark" else {}
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    kept = mask.bool()
    # The masked call is the call on the kept rows alone (batch lambda included).
    ref_extra = {"labels": labels[kept]} if name == "dspark" else {}
    ref = fn(d[kept], t[kept], torch.ones(3), 1.3, target_log_norm=log_norm[kept], **ref_extra)
    got = fn(d, t, mask, 1.3, target_log_norm=log_norm, **extra)
    total = fn(d, t, mask, 1.3, target_log_norm=log_norm, reduction="sum", **extra)
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    assert total.item() == pytest.approx(3 * ref.item(), rel=1e-6)
    changed = d.clone()
    changed[~kept] += 5.0  # masked rows change nothing
    assert fn(changed, t, mask, 1.3, target_log_norm=log_norm, **extra).item() == pytest.approx(
        got.item(), rel=1e-6
    )
    # Empty mask: zero, still differentiable.
    x = d.clone().requires_grad_(True)
    empty = fn(x, t, torch.zeros(6), 1.3, target_log_norm=log_norm, **extra)
    empty.backward()
    assert empty.item() == 0.0 and torch.all(x.grad == 0)


def test_tv_family_bad_options_raise_clear_errors():
    d, t = _logits()
    mask = torch.ones(10)
    with pytest.raises(ValueError, match="alpha_mode"):
        lk_lambda(d, t, mask, alpha_mode="global")
    with pytest.raises(ValueError, match="eta"):
        lk_lambda(d, t, mask, eta=-1.0)
    with pytest.raises(ValueError, match="tv_weight"):
        ce_tv_mix(d, t, mask, tv_weight=-0.5)
    with pytest.raises(ValueError, match="target_log_norm"):
        lk_alpha(d, t, mask, target_log_norm=torch.zeros(9))
    # Config keys: a loss's own options pass, others name the ones it takes.
    cfg = OmegaConf.create({"name": "lk", "temperature": 1.0, "eta": 10.0})
    assert loss_options(lk_lambda, cfg) == {"eta": 10.0}
    assert loss_options(forward_kl, {"name": "kl", "temperature": 1.0}) == {}
    with pytest.raises(ValueError, match="loss.eta is not an option of loss 'kl'.*chunk_size"):
        loss_options(forward_kl, {"name": "kl", "eta": 3.0})


def _offset_losses(loss: dict, vocab_ids: torch.Tensor | None):
    """One offset_losses call (T = 5, offsets [0, 1], V = 7) -> (loss, draft logits, target)."""
    from models.protocol import DraftOutput
    from train.step_stats import offset_losses, proxy_tags, stats_size

    g = torch.Generator().manual_seed(9)
    target = torch.randn(1, 5, 7, generator=g) * 2
    vd = 7 if vocab_ids is None else len(vocab_ids)
    drafts = [torch.randn(1, 5, vd, generator=g) for _ in range(2)]
    cfg = OmegaConf.create(
        {
            "train": {"offset_decay": 0.5},
            "loss": loss,
            "decode": {"temperatures": [0.0, 0.7], "top_k": 0, "top_p": 1.0},
        }
    )
    batch = {
        "input_ids": torch.randint(0, 7, (1, 5), generator=g),
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]),  # [t] = trains x_{t+1}
    }
    out = DraftOutput(logits=drafts, offsets=[0, 1], vocab_ids=vocab_ids)
    stats = torch.zeros(stats_size(2, len(proxy_tags(cfg.decode))))
    counts = torch.tensor([3.0, 3.0])  # the trained positions per offset
    fn = LOSSES[loss["name"]]
    total = offset_losses(out, target, batch, [0, 1], counts, fn, loss["temperature"], cfg, stats)
    return total, drafts, target, batch


def test_offset_losses_passes_the_options_and_the_full_vocabulary_normaliser():
    vocab_ids = torch.tensor([0, 1, 3, 4, 6])
    loss = {"name": "lk", "temperature": 1.5, "eta": 10.0, "alpha_mode": "batch"}
    got, drafts, target, batch = _offset_losses(loss, vocab_ids)
    want = plain = 0.0  # plain: the defaults (eta 3, per position, renormalised target)
    for i, off in enumerate((0, 1)):
        d = drafts[i][0, : 5 - off]
        full = target[0, off:]  # [5 - off, V]
        t, mask = full[:, vocab_ids], batch["loss_mask"][0, off:]
        log_norm = (full / 1.5).logsumexp(-1)
        want += 0.5**i * lk_lambda(d, t, mask, 1.5, log_norm, 10.0, "batch").item()
        plain += 0.5**i * lk_lambda(d, t, mask, 1.5).item()  # 3 trained positions per offset
    assert got.item() == pytest.approx(want, rel=1e-6)
    assert abs(got.item() - plain) > 1e-2
    with pytest.raises(ValueError, match="loss.alpha is not an option of loss 'lk'"):
        _offset_losses({"name": "lk", "temperature": 1.0, "alpha": 3.0}, vocab_ids)


def test_offset_losses_gives_dspark_the_data_labels():
    loss = {
        "name": "dspark",
        "temperature": 1.0,
        "labels": "data",
        "ce_weight": 0.3,
        "tv_weight": 0.9,
    }
    got, drafts, target, batch = _offset_losses(loss, None)
    ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
    labels = torch.cat([ids[1:], ids.new_zeros(1)])  # x_{t+1}; the last (padding) is masked
    want = ce_tv_mix(drafts[0][0], target[0], mask, labels=labels, ce_weight=0.3, tv_weight=0.9)
    labels1 = torch.cat([ids[2:], ids.new_zeros(1)])
    want1 = ce_tv_mix(
        drafts[1][0, :4], target[0, 1:], mask[1:], labels=labels1, ce_weight=0.3, tv_weight=0.9
    )
    assert got.item() == pytest.approx(want.item() + 0.5 * want1.item(), rel=1e-6)
    argmax = ce_tv_mix(drafts[0][0], target[0], mask, ce_weight=0.3, tv_weight=0.9)
    assert abs(argmax.item() - want.item()) > 1e-3
