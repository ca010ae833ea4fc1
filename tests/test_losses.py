"""The distillation losses (train/losses/divergences.py): divergences, cross-entropy and the TV family
(LK^lambda, LK^alpha, DSpark's CE + TV mix) by hand, chunked = unchunked, masks, gradients,
loss options. The acceptance proxies: tests/test_acceptance_proxy.py; the per-step loss and
statistics over draft offsets: tests/test_step_stats.py."""

import math
from functools import partial

import pytest
import torch
from omegaconf import OmegaConf

from decoding.drafter import Sampling
from train.losses.acceptance import acceptance_proxy, sampling_cutoffs
from train.losses.divergences import (
    LOSSES,
    ce_tv_mix,
    cross_entropy,
    forward_kl,
    lk_alpha,
    lk_lambda,
    loss_options,
    reverse_kl,
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
    # CE, KL(p||q) and TV; KL(q||p) is genuinely infinite there (documented in train/losses/divergences.py).
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


@pytest.mark.parametrize("alpha_mode", ["position", "batch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lk_lambda_written_out_gradient_is_autograds_with_a_reduced_vocab(alpha_mode, dtype):
    """lk_lambda's gradient is computed by hand (train/losses/divergences.py: _LKLambdaRows): equal to
    autograd through the decoder's alpha (acceptance_proxy's maths, full-vocabulary p) and
    KL over the draft ids, lambda held constant, in float32 and bfloat16."""
    d, t, log_norm, _ = _reduced_vocab_case(n=9)
    T, eta = 1.3, 3.0
    d = d.to(dtype)
    mask = (torch.arange(9) != 2).float()
    cut = torch.stack([torch.full_like(log_norm, float("-inf")), log_norm], -1)  # [9, 2]
    x = d.clone().requires_grad_(True)
    got = lk_lambda(x, t, mask, temperature=T, target_log_norm=log_norm, alpha_mode=alpha_mode)
    got.backward()
    y = d.clone().requires_grad_(True)
    yf = y.float()  # one cast: its backward rounds the whole gradient to bf16 once
    z, q = t / T, (yf / T).softmax(-1)  # [9, 6]
    p = (z - log_norm[:, None]).exp()  # the full vocabulary's p at the draft ids
    alpha = torch.minimum(p, q).sum(-1)  # [9]
    p_hat = z.softmax(-1)
    kl = (p_hat * (p_hat.log() - (yf / T).log_softmax(-1))).sum(-1)  # [9]
    with torch.no_grad():
        proxy = acceptance_proxy(d.float(), t, mask, Sampling(temperature=T), cut)
        lam = torch.exp(-eta * (alpha.detach() if alpha_mode == "position" else proxy))
    want = ((lam * kl + (1 - lam) * (1 - alpha)) * mask).sum() / mask.sum()
    want.backward()
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.float(), y.grad.float(), rtol=1e-5, atol=1e-7)
    assert x.grad[2].abs().sum() == 0 and x.grad[4].abs().sum() > 0  # row 2 is masked


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
    assert loss_options(LOSSES["lk"], cfg) == {"eta": 10.0}
    assert loss_options(LOSSES["kl"], {"name": "kl", "temperature": 1.0}) == {}
    with pytest.raises(
        ValueError, match=r"loss.eta is not an option of loss 'kl'; its options are \[\]"
    ):
        loss_options(LOSSES["kl"], {"name": "kl", "eta": 3.0})
    with pytest.raises(
        ValueError, match=r"loss.alpha is not .* 'lk'; its options are \['eta', 'alpha_mode'\]"
    ):
        loss_options(LOSSES["lk"], {"name": "lk", "alpha": 3.0})
