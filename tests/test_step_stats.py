"""One optimizer step's loss and statistics over the draft offsets (train/core/step_stats.py):
out-of-vocabulary positions masked from the loss but not from the logged statistics, a
loss's options and the full-vocabulary normaliser passed on, DSpark given the data labels."""

import pytest
import torch
from omegaconf import OmegaConf

from decoding.drafter import Sampling
from models.protocol import DraftOutput
from train.core.step import StepStats, offset_losses
from train.core.step_stats import StepWindow, decode_samplings
from train.losses.acceptance import acceptance_proxy, sampling_cutoffs, simulated_tau
from train.losses.divergences import ce_tv_mix, forward_kl, lk_lambda
from train.run.setup import step_setup


def _oov_step(mask_out_of_vocab: bool):
    """One offset_losses call on a reduced-vocabulary draft: T = 4 positions, target argmax
    [0, 1, 2, 4] with draft ids [0, 2, 3], so positions 1 and 3 are out of vocabulary. The
    draft's argmax is the target's argmax over the draft ids at every position."""
    g = torch.Generator().manual_seed(5)
    V, vocab_ids = 5, torch.tensor([0, 2, 3])
    target = torch.randn(1, 4, V, generator=g)
    target[0, torch.arange(4), torch.tensor([0, 1, 2, 4])] += 6.0  # the argmax per position
    draft = 2.0 * target[..., vocab_ids] + 0.1 * torch.randn(1, 4, 3, generator=g)
    cfg = OmegaConf.create(
        {
            "train": {
                "offset_decay": 1.0,
                "mask_out_of_vocab": mask_out_of_vocab,
                "max_grad_norm": 1.0,
            },
            "loss": {"name": "kl"},
            "decode": {"temperatures": [0.0, 0.7], "top_k": 0, "top_p": 0.9},
        }
    )
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "loss_mask": torch.ones(1, 4)}
    out = DraftOutput(logits=[draft], offsets=[0], vocab_ids=vocab_ids)
    loss, stats = _offset_losses_call(out, target, batch, torch.tensor([4.0]), cfg)
    return loss, stats, target, draft, vocab_ids


def _offset_losses_call(out, target, batch, counts, cfg):
    """offset_losses as the training step calls it -> (loss, StepStats)."""
    setup = step_setup(cfg, out.offsets, decode_samplings(**cfg.decode))
    stats = StepStats.zeros(len(out.offsets), len(setup.samplings))
    return offset_losses(out, target, batch, counts, setup, stats), stats


def test_mask_out_of_vocab_drops_exactly_those_positions_from_the_loss():
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
    for name in ("alpha", "top1", "oov", "tokens"):
        torch.testing.assert_close(getattr(stats_masked, name), getattr(stats_all, name))
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


def _offset_losses(loss: dict, vocab_ids: torch.Tensor | None):
    """One offset_losses call (T = 5, offsets [0, 1], V = 7) -> (loss, draft logits, target)."""
    g = torch.Generator().manual_seed(9)
    target = torch.randn(1, 5, 7, generator=g) * 2
    vd = 7 if vocab_ids is None else len(vocab_ids)
    drafts = [torch.randn(1, 5, vd, generator=g) for _ in range(2)]
    cfg = OmegaConf.create(
        {
            "train": {"offset_decay": 0.5, "max_grad_norm": 1.0},
            "loss": loss,
            "decode": {"temperatures": [0.0, 0.7], "top_k": 0, "top_p": 1.0},
        }
    )
    batch = {
        "input_ids": torch.randint(0, 7, (1, 5), generator=g),
        "loss_mask": torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.0]]),  # [t] = trains x_{t+1}
    }
    out = DraftOutput(logits=drafts, offsets=[0, 1], vocab_ids=vocab_ids)
    counts = torch.tensor([3.0, 3.0])  # the trained positions per offset
    total, _ = _offset_losses_call(out, target, batch, counts, cfg)
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
