"""The losses of train/losses/family.py (jsd, nla, dpace, mix) against independent references
(by hand and, where installed, vllm-project/speculators' own eager losses), and optim=muon
(train/core/optimizers.py): the split, a step, a checkpoint round trip. Two-step runs of the real
loop on the tiny random target with each. The generic properties every registered loss has
(chunked = unchunked, finite gradients under top-k masks): tests/test_losses.py."""

import copy
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from decoding.drafter import Sampling
from models.protocol import DraftOutput
from tests.helpers import compose_debug, metrics_records
from train.core.optimizers import MuonWithAdamW, build_optimizer, split_for_muon
from train.core.step import StepSetup, StepStats, offset_losses
from train.losses.divergences import (
    LOSSES,
    LossSpec,
    cross_entropy,
    forward_kl,
    lk_lambda,
    reverse_kl,
)
from train.losses.family import dpace_chain_weights, dpace_weights
from train.run.settings import check_settings


def _logits(n: int = 9, v: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2, torch.randn(n, v, generator=g) * 2


def _probs(draft, target, temperature=1.0):
    return (target / temperature).softmax(-1).double(), (draft / temperature).softmax(-1).double()


# -- jsd ------------------------------------------------------------------------------------


@pytest.mark.parametrize("skew", [0.2, 0.5, 0.9])
def test_jsd_matches_the_definition(skew):
    d, t = _logits()
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1.0])
    p, q = _probs(d, t, 1.3)
    m = skew * p + (1 - skew) * q
    rows = (1 - skew) * (p * (p / m).log()).sum(-1) + skew * (q * (q / m).log()).sum(-1)
    want = (rows * mask).sum() / mask.sum()
    got = LOSSES["jsd"](d, t, mask, temperature=1.3, skew=skew)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)


def test_jsd_at_half_is_speculators_js_div_loss():
    eager = pytest.importorskip("speculators.losses.eager")
    d, t = _logits(seed=1)
    want = eager.js_div_loss(d[None], t[None])[0].mean()  # [1, N] per position
    assert LOSSES["jsd"](d, t, torch.ones(9)).item() == pytest.approx(want.item(), rel=1e-5)
    assert 0 < want.item() < math.log(2)


def test_jsd_skew_endpoints_are_forward_and_reverse_kl_and_continuous():
    d, t = _logits(seed=2)
    mask = torch.ones(9)
    jsd = LOSSES["jsd"]
    fkl, rkl = forward_kl(d, t, mask).item(), reverse_kl(d, t, mask).item()
    assert jsd(d, t, mask, skew=0.0).item() == pytest.approx(fkl, rel=1e-6)
    assert jsd(d, t, mask, skew=1.0).item() == pytest.approx(rkl, rel=1e-6)
    assert jsd(d, t, mask, skew=1e-6).item() == pytest.approx(fkl, rel=1e-3)  # no jump
    assert jsd(d, t, mask, skew=1 - 1e-6).item() == pytest.approx(rkl, rel=1e-3)
    assert jsd(d, d.clone(), mask).item() == pytest.approx(0.0, abs=1e-6)


# -- nla ------------------------------------------------------------------------------------


def test_nla_matches_the_definition_and_speculators():
    d, t = _logits(seed=3)
    mask = torch.tensor([1, 0, 1, 1, 1, 1, 1, 0, 1.0])
    p, q = _probs(d, t, 0.7)
    rows = -torch.minimum(p, q).sum(-1).clamp_min(1e-5).log()
    want = (rows * mask).sum() / mask.sum()
    got = LOSSES["nla"](d, t, mask, temperature=0.7)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    eager = pytest.importorskip("speculators.losses.eager")
    ref = eager.neg_log_acceptance_loss(d[None], t[None])[0].mean()
    assert LOSSES["nla"](d, t, torch.ones(9)).item() == pytest.approx(ref.item(), rel=1e-5)


def test_nla_floors_alpha_at_eps():
    # Disjoint supports: alpha = 0, the loss is -log(eps) and trains nothing there.
    t = torch.tensor([[0.0, -1e9, -1e9]])
    d = torch.tensor([[-1e9, 0.0, 0.0]], requires_grad=True)
    loss = LOSSES["nla"](d, t, torch.ones(1), eps=1e-3)
    loss.backward()
    assert loss.item() == pytest.approx(-math.log(1e-3)) and torch.all(d.grad == 0)


# -- dpace ----------------------------------------------------------------------------------


def _dpace_reference(conf: list[float], trained: list[float], a: float) -> list[float]:
    """D-PACE's weights by the paper's sums, one chain: w_k = sum_{j>=k} prod_{i<=j} s_i."""
    s = [((1 - a) * c + a) if m else 1.0 for c, m in zip(conf, trained, strict=True)]
    out = []
    for k in range(len(s)):
        total = sum(math.prod(s[: j + 1]) * trained[j] for j in range(k, len(s)))
        out.append(total * trained[k])
    return out


def test_dpace_weights_by_hand_and_as_speculators():
    g = torch.Generator().manual_seed(4)
    conf = torch.rand(3, 5, generator=g)
    trained = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1], [1, 1, 1, 0, 0.0]])
    got = dpace_weights(conf, trained, 0.3)
    for row in range(3):
        want = _dpace_reference(conf[row].tolist(), trained[row].tolist(), 0.3)
        assert got[row].tolist() == pytest.approx(want, rel=1e-6)
    utils = pytest.importorskip("speculators.losses.utils")
    # speculators' layout: blocks of [anchor (never trained), drafts...], CE per slot.
    ce = -torch.cat([torch.ones(3, 1), conf], 1).log().reshape(1, -1)  # [1, 3 * 6]
    mask = torch.cat([torch.zeros(3, 1), trained], 1).reshape(1, -1)
    ref = utils.dpace_loss_decay(None, mask, 6, 0.3, ce * mask).reshape(3, 6)[:, 1:]
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_dpace_loss_is_weighted_ce_and_equals_ce_without_weights():
    d, t = _logits(seed=5)
    mask = torch.tensor([1, 1, 1, 0, 1, 1, 1, 1, 1.0])
    w = torch.linspace(0.5, 3.0, 9)
    ce_rows = -F.log_softmax(d / 1.3, -1).gather(-1, t.argmax(-1, keepdim=True)).squeeze(-1)
    want = (w * ce_rows * mask).sum() / mask.sum()
    got = LOSSES["dpace"](d, t, mask, temperature=1.3, position_weights=w)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    plain = LOSSES["dpace"](d, t, mask, temperature=1.3)
    assert plain.item() == pytest.approx(cross_entropy(d, t, mask, temperature=1.3).item())
    x = d.clone().requires_grad_(True)  # chunked = plain with weights too
    values = [LOSSES["dpace"](x, t, mask, position_weights=w, chunk_size=c) for c in (100, 2)]
    assert values[0].item() == pytest.approx(values[1].item(), rel=1e-6)


def _chain_reference(logits, offsets, positions, target, loss_mask, a, temperature):
    """Per offset, each draft's D-PACE weight, by loops over rows and chain positions."""
    B, T = loss_mask.shape
    starts = positions.tolist() if positions is not None else [list(range(T))] * B
    weights = [torch.zeros(B, len(starts[0]) if positions is not None else T - o) for o in offsets]
    for b in range(B):
        for n, start in enumerate(starts[b]):
            conf, trained = [], []
            for lg, off in zip(logits, offsets, strict=True):
                at = start + off
                ok = start >= 0 and at < T
                q = (lg[b, n] / temperature).softmax(-1) if ok else None
                conf.append(float(q[target[b, at].argmax()]) if ok else 1.0)
                trained.append(float(loss_mask[b, at]) if ok else 0.0)
            for k, w in enumerate(_dpace_reference(conf, trained, a)):
                if n < weights[k].shape[1]:
                    weights[k][b, n] = w
    return [w.reshape(-1) for w in weights]


@pytest.mark.parametrize("sampled", [False, True], ids=["every_position", "sampled_blocks"])
def test_dpace_in_the_training_step_matches_a_loop_reference(sampled):
    """offset_losses with loss=dpace: sum over offsets of sum_n w * CE / count (offset
    weights 1, not the draft's), w from the whole chain, for a dense multi-offset draft
    (Medusa-like) and for one trained at sampled positions (DFlash-like)."""
    g = torch.Generator().manual_seed(6)
    B, T, V, offsets = 2, 9, 6, [1, 2, 3]
    target = torch.randn(B, T, V, generator=g) * 2
    loss_mask = (torch.rand(B, T, generator=g) > 0.2).long()
    positions = torch.tensor([[0, 3, 6, -1], [1, 2, 7, 4]]) if sampled else None
    rows = positions.shape[1] if sampled else T
    logits = [torch.randn(B, rows, V, generator=g) * 2 for _ in offsets]
    out = DraftOutput(logits, offsets, positions=positions, offset_weights=[1.0, 0.5, 0.25])
    spec = LossSpec.from_settings({"name": "dpace", "temperature": 1.3, "dpace_alpha": 0.4})
    ref = _chain_reference(logits, offsets, positions, target, loss_mask, 0.4, 1.3)
    got = dpace_chain_weights(logits, offsets, positions, target, loss_mask, 1.3, 0.4)
    for k in range(3):
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.long), "loss_mask": loss_mask}
    counts = torch.tensor([float(loss_mask[:, o:].sum()) for o in offsets])
    setup = StepSetup(spec, offsets, [Sampling(temperature=1.3)])
    total = offset_losses(out, target, batch, counts, setup, StepStats.zeros(3, 1))
    want = 0.0
    for k, off in enumerate(offsets):
        if sampled:
            at = (positions + off).clamp(0, T - 1)
            t_k = target.gather(1, at[..., None].expand(-1, -1, V))
            m_k = loss_mask.gather(1, at) * (positions >= 0) * (positions + off < T)
            d_k = logits[k]
            scale = loss_mask[:, off:].sum() / m_k.sum().clamp_min(1)
        else:
            t_k, m_k, d_k, scale = target[:, off:], loss_mask[:, off:], logits[k][:, : T - off], 1
        ce = -F.log_softmax(d_k / 1.3, -1).gather(-1, t_k.argmax(-1, keepdim=True)).squeeze(-1)
        want += scale * (ref[k] * ce.reshape(-1) * m_k.reshape(-1)).sum() / counts[k]
    assert total.item() == pytest.approx(float(want), rel=1e-5)


# -- mix ------------------------------------------------------------------------------------


def test_mix_is_the_weighted_sum_of_its_parts_with_their_options():
    d, t = _logits(seed=7)
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 1.0])
    log_norm = (t / 1.3).logsumexp(-1) + 0.2  # as if the draft ids were part of a larger vocab
    labels = torch.arange(9) % 7
    parts = [{"name": "ce", "weight": 0.1}, {"name": "lk", "weight": 0.9, "eta": 10.0}]
    spec = LossSpec.from_settings({"name": "mix", "temperature": 1.3, "labels": "data", "parts": parts})  # fmt: skip
    got = spec.sum(d, t, mask, labels=labels, target_log_norm=log_norm)
    ce = cross_entropy(d, t, mask, 1.3, labels=labels, reduction="sum")
    lk = lk_lambda(d, t, mask, 1.3, target_log_norm=log_norm, eta=10.0, reduction="sum")
    assert got.item() == pytest.approx((0.1 * ce + 0.9 * lk).item(), rel=1e-5)
    x = d.clone().requires_grad_(True)  # chunked = plain, value and gradient
    grads = []
    for chunk in (100, 2):
        x.grad = None
        LOSSES["mix"](x, t, mask, parts=parts, chunk_size=chunk).backward()
        grads.append(x.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    default = LOSSES["mix"](d, t, mask)  # conf/loss/mix.yaml's parts: kl 0.5 + tv 0.5
    want = 0.5 * forward_kl(d, t, mask) + 0.5 * LOSSES["tv"](d, t, mask)
    assert default.item() == pytest.approx(want.item(), rel=1e-6)


BAD_LOSSES = [
    ({"name": "jsd", "skew": 1.5}, "loss.skew must be in"),
    ({"name": "nla", "eps": 0.0}, r"loss.eps .* must be in \(0, 1\]"),
    ({"name": "dpace", "dpace_alpha": 0.0}, r"loss.dpace_alpha .* must be in \(0, 1\]"),
    ({"name": "dpace", "labels": "data"}, "takes no labels"),
    ({"name": "mix", "parts": []}, "loss.parts must be a non-empty list"),
    ({"name": "mix", "parts": [{"name": "kk", "weight": 1}]}, "'kk' is not a loss to mix"),
    ({"name": "mix", "parts": [{"name": "mix"}]}, "'mix' is not a loss to mix"),
    ({"name": "mix", "parts": [{"name": "dpace"}]}, "use loss=dpace"),
    ({"name": "mix", "parts": [{"name": "kl", "weight": -1}]}, "weight must be a number >= 0"),
    ({"name": "mix", "parts": [{"name": "kl", "eta": 3}]}, "'eta' is not an option of 'kl'"),
    ({"name": "mix", "parts": [{"name": "lk", "eta": -1}]}, "loss.eta must be >= 0"),
    ({"name": "mix", "parts": [{"name": "kl", "temperature": 2}]}, "set temperature on the mix"),
    ({"name": "mix", "parts": [{"name": "kl", "weight": 0}]}, "every weight is 0"),
    ({"name": "jsd", "beta": 0.5}, "loss.beta is not an option of loss 'jsd'"),
]


@pytest.mark.parametrize("settings, message", BAD_LOSSES, ids=[m for _, m in BAD_LOSSES])
def test_bad_loss_settings_are_refused_up_front(settings, message):
    with pytest.raises(ValueError, match=message):
        LossSpec.from_settings(settings)


# -- optim=muon -----------------------------------------------------------------------------


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(11, 8)
        self.fc = torch.nn.Linear(8, 8)  # weight -> Muon, bias -> AdamW
        self.norm = torch.nn.LayerNorm(8)
        self.gate = torch.nn.Linear(8, 1, bias=False)  # [1, 8]: degenerate -> AdamW
        self.lm_head = torch.nn.Linear(8, 11, bias=False)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, ids):
        h = self.norm(self.fc(self.embed_tokens(ids)))
        return self.lm_head(h) + self.gate(h)


def test_muon_takes_hidden_matrices_and_adamw_the_rest():
    toy = _Toy()
    muon, adamw = split_for_muon(toy.named_parameters())
    assert [n for n, _ in muon] == ["fc.weight"]
    assert sorted(n for n, _ in adamw) == sorted(
        ["embed_tokens.weight", "fc.bias", "norm.weight", "norm.bias", "gate.weight", "lm_head.weight"]
    )  # fmt: skip
    opt = build_optimizer(toy.named_parameters(), "muon", lr=0.01, muon_lr=0.02)
    assert isinstance(opt, MuonWithAdamW)
    assert isinstance(opt._inner[0], torch.optim.Muon) and opt._inner[0].param_groups[0]["params"] == [toy.fc.weight]  # fmt: skip
    assert [g["lr"] for g in opt.param_groups] == [0.02, 0.01]
    adamw_only = build_optimizer(toy.named_parameters(), "adamw", lr=0.01)
    assert isinstance(adamw_only, torch.optim.AdamW)
    # The module's order, as checkpoints written before optim=muon hold it.
    assert adamw_only.param_groups[0]["params"] == [p for p in toy.parameters() if p.requires_grad]


def _step(toy, opt, ids):
    opt.zero_grad()
    toy(ids).logsumexp(-1).mean().backward()
    opt.step()


def test_muon_step_schedule_and_checkpoint_round_trip():
    torch.manual_seed(0)
    toy, ids = _Toy(), torch.arange(6)[None]
    opt = build_optimizer(toy.named_parameters(), "muon", lr=0.01, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** (s + 1))
    before = {n: p.detach().clone() for n, p in toy.named_parameters()}
    _step(toy, opt, ids)
    sched.step()
    for name, p in toy.named_parameters():  # every trainable weight moved, the frozen did not
        assert torch.equal(p, before[name]) == name.startswith("frozen"), name
    assert [g["lr"] for g in opt.param_groups] == [0.0025, 0.0025]  # both groups scheduled
    assert [g["lr"] for o in opt._inner for g in o.param_groups] == [0.0025, 0.0025]
    state = copy.deepcopy(opt.state_dict())  # as saved to disk: no tensor shared
    again = copy.deepcopy(toy)
    restored = build_optimizer(again.named_parameters(), "muon", lr=0.01, weight_decay=0.01)
    restored.load_state_dict(state)
    assert len(state["state"]) == 7  # Muon's matrix first, then AdamW's six
    assert "momentum_buffer" in state["state"][0] and "exp_avg" in state["state"][1]
    assert [g["lr"] for o in restored._inner for g in o.param_groups] == [0.0025, 0.0025]
    _step(toy, opt, ids)  # the restored optimizer continues exactly
    _step(again, restored, ids)
    for (name, a), b in zip(toy.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name


BAD_OPTIM = [
    (["optim=muon", "optim.muon_ns_steps=0"], "optim.muon_ns_steps must be an integer >= 1"),
    (["optim=muon", "optim.muon_adjust_lr_fn=keller"], "optim.muon_adjust_lr_fn must be one of"),
    (["optim=muon", "optim.muon_momentum=-1"], "optim.muon_momentum must be >= 0"),
    (["optim=muon", "optim.lr=-1"], "optim: Learning rate should be >= 0"),  # torch's Muon
    (["optim=muon", "optim.betas=[0.9,1.5]"], "optim: Invalid beta parameter"),  # its AdamW
    (["+optim.muon_lr=0.1"], r"optim.muon_lr is not a setting of optim.name=adamw \(a Muon"),
    (["optim=muon", "optim.name=sgd"], "optim.name='sgd' is not one of"),
]


@pytest.mark.parametrize("overrides, message", BAD_OPTIM, ids=[m for _, m in BAD_OPTIM])
def test_bad_optim_settings_are_refused_up_front(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        check_settings(compose_debug(tmp_path, *overrides))


# -- the real loop, two steps on the tiny random target -------------------------------------

MIX = "loss.parts=[{name: kl, weight: 0.5}, {name: tv, weight: 0.5}]"
FAST = ("train.eval_at_ckpt=false",)


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss=jsd"],
        ["loss=mix", MIX],
        ["optim=muon"],
        ["loss=dpace", "draft=dflash", "~draft.model.init", "draft.model.block_size=4",
         "draft.model.num_anchors=8", "decode.k=3"],
    ],
    ids=["jsd", "mix", "muon", "dflash_dpace"],
)  # fmt: skip
def test_two_step_runs(tmp_path, overrides):
    from train.loop import run

    summary = run(compose_debug(tmp_path, *FAST, *overrides))
    assert summary["steps"] == 2
    lines = [x for x in metrics_records(tmp_path) if x["kind"] == "train"]
    assert len(lines) == 2 and all(math.isfinite(x["loss"]) and x["loss"] > 0 for x in lines)
    if "loss=dpace" in overrides:  # the offsets' own weights are 1 under D-PACE
        assert lines[0]["loss"] == pytest.approx(sum(lines[0]["loss_per_offset"]), rel=1e-5)


def test_muon_run_resumes_exactly(tmp_path):
    """optim=muon through the loop's checkpoints: drop the newest, resume, and land on the
    same losses and weights (both optimizers' states were saved and restored)."""
    from train.core.checkpoint import list_checkpoints, load_checkpoint
    from train.loop import run

    torch.set_num_threads(1)
    common = (*FAST, "optim=muon", "train.steps=4", "train.ckpt_every=2", "train.keep_last=2")
    run(compose_debug(tmp_path, *common))
    want = {x["step"]: x["loss"] for x in metrics_records(tmp_path) if x["kind"] == "train"}
    newest = list_checkpoints(tmp_path)[-1]
    draft_state, _, trainer = load_checkpoint(newest)
    kinds = [set(s) for s in trainer["optimizer"]["state"].values()]
    assert {"momentum_buffer"} in kinds and {"step", "exp_avg", "exp_avg_sq"} in kinds  # both
    want_state = {n: t.clone() for n, t in draft_state.items()}
    shutil.rmtree(newest)
    run(compose_debug(tmp_path, *common, "resume=true"))
    got = {x["step"]: x["loss"] for x in metrics_records(tmp_path) if x["kind"] == "train"}
    assert got == want
    for name, value in load_checkpoint(newest)[0].items():
        assert torch.equal(value, want_state[name]), name
