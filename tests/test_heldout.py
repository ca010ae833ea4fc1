"""The held-out acceptance proxy (train/eval/heldout.py): its numbers against a hand computation
on the target's full logits, and in a run, a record at every checkpoint that leaves the
training itself untouched."""

import pytest
import torch

from decoding.drafter import Sampling
from models.draft_lm import from_target
from tests.helpers import chat_ids, compose_debug, metrics_records
from train.core.step import StepSetup
from train.eval.heldout import PREFIX, HeldOut, heldout_rows
from train.loop import run
from train.losses.acceptance import simulated_tau
from train.losses.divergences import LossSpec
from train.report.plots import plot_learning_curve
from train.report.runs import Group, load_run


@pytest.mark.parametrize("pad_multiple", [1, 8])  # batches as wide as their longest row, or 8s
def test_record_matches_a_hand_computation_and_leaves_the_draft_as_it_was(
    tiny, tmp_path, pad_multiple
):
    torch.manual_seed(0)
    draft = from_target(tiny, num_layers=1, init="random").train()
    prompts = [{"input_ids": chat_ids(tiny, text)} for text in ("hello there", "a b c d", "x")]
    rows = heldout_rows(tiny, prompts, 12, dtype="float32", cache_dir=str(tmp_path), progress=False)
    assert len(rows) == 3 and all(sum(r["loss_mask"]) > 0 for r in rows)
    for p, r in zip(prompts, rows):  # the prompt, then the answer's labels only
        n = len(p["input_ids"])
        assert r["input_ids"][:n] == p["input_ids"] and sum(r["loss_mask"][: n - 1]) == 0
    setup = StepSetup(LossSpec.from_settings({"name": "kl"}), [0], [Sampling(1.0), Sampling(0.7)])
    held = HeldOut.from_rows(rows, tiny.tokenizer.pad_token_id, 2, tiny.device, setup, k=3,
                             pad_multiple=pad_multiple)  # fmt: skip
    assert all(b["input_ids"].shape[1] % pad_multiple == 0 for b in held.batches)
    before = {n: p.clone() for n, p in draft.state_dict().items()}
    built_in_eval = draft.model.model.layers[0].eval()  # e.g. a from_pretrained backbone
    rec = held.record(draft, tiny)

    # By hand, row by row with no padding: the target's argmax against the draft's, and
    # sum_v min(p, q) at T = 1 over the answer's positions.
    hits = alpha = count = 0.0
    with torch.no_grad():
        for r in rows:
            ids = torch.tensor(r["input_ids"])[None]
            mask = torch.tensor(r["loss_mask"], dtype=torch.bool)
            t_out = tiny(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
            d = draft(tiny, ids, t_out, torch.ones_like(ids)).logits[0][0][mask]  # [N, V]
            t = t_out.logits[0][mask]  # [N, V]
            hits += float((d.argmax(-1) == t.argmax(-1)).sum())
            alpha += float(torch.minimum(d.softmax(-1), t.softmax(-1)).sum())
            count += float(mask.sum())
    assert rec[PREFIX + "top1"][0] == pytest.approx(hits / count, abs=1e-6)
    assert rec[PREFIX + "alpha"][0] == pytest.approx(alpha / count, rel=1e-4)
    assert rec[PREFIX + "sim_tau_greedy"] == pytest.approx(simulated_tau([hits / count], 3))
    assert rec[PREFIX + "positions"] == count
    assert set(rec) >= {PREFIX + "alpha_T0.7", PREFIX + "sim_tau_T0.7"}
    assert draft.training and not any(m.training for m in built_in_eval.modules())  # each's mode
    assert all(torch.equal(before[n], p) for n, p in draft.state_dict().items())  # weights


def test_a_run_records_it_at_every_checkpoint_and_trains_as_without_it(tmp_path):
    common = ["train.steps=4", "train.ckpt_every=2", "decode.temperatures=[0.0,0.7]"]
    run(compose_debug(tmp_path / "off", *common))
    summary = run(compose_debug(tmp_path / "on", *common, "train.heldout_proxy=true"))
    off, on = metrics_records(tmp_path / "off"), metrics_records(tmp_path / "on")
    losses = lambda recs: [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]  # noqa: E731
    assert losses(on) == losses(off)  # the proxy takes nothing from the training's RNG or state
    held = [r for r in on if r["kind"] == "heldout"]
    assert [r["step"] for r in held] == [2, 4] and not any(r["kind"] == "heldout" for r in off)
    evals = {r["step"]: r for r in on if r["kind"] == "eval"}
    for r in held:
        assert r["train_s"] == evals[r["step"]]["train_s"]
        assert evals[r["step"]]["greedy/heldout_proxy_tau"] == r[PREFIX + "sim_tau_greedy"]
        assert evals[r["step"]]["T0.7/heldout_proxy_tau"] == r[PREFIX + "sim_tau_T0.7"]
        assert 1.0 <= r[PREFIX + "sim_tau_greedy"] <= 5.0
    assert summary["final_heldout"] == {k: v for k, v in held[-1].items() if k != "kind"}
    trained = [r for r in on if r["kind"] == "train"]
    assert all("train_s" in r for r in trained)
    # The run's own learning curve: the held-out and training-rows proxies at their seconds,
    # the decoded tau at each evaluation's.
    assert (tmp_path / "on" / "learning_curve.png").is_file()
    twice = plot_learning_curve([Group({}, [load_run(tmp_path / "on")] * 2)])  # a group's legend
    named = [ln.get_label() for ax in twice.axes for ln in ax.lines if ln.get_label()[0] != "_"]
    assert len(named) == len(set(named)) == 8  # per tag: 3 on the left, 1 speedup (eager decode)
    fig = plot_learning_curve([Group({}, [load_run(tmp_path / "on")])])
    lines = {
        ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].lines
    }
    for tag in ("greedy", "T0.7"):
        assert lines[f"all runs {tag} held-out proxy"] == (
            [r["train_s"] for r in held],
            [r[f"{PREFIX}sim_tau_{tag}"] for r in held],
        )
        assert lines[f"all runs {tag} training-rows proxy"] == (
            [r["train_s"] for r in trained],
            [r[f"sim_tau_{tag}"] for r in trained],
        )
        assert lines[f"all runs {tag} decoded"] == (
            [r["train_s"] for r in held],
            [evals[r["step"]][f"{tag}/tau"] for r in held],
        )


def test_refused_without_eval_prompts(tmp_path):
    with pytest.raises(ValueError, match="heldout_proxy=true .* data.num_eval > 0"):
        run(compose_debug(tmp_path / "run", "train.heldout_proxy=true", "data.num_eval=0",
                          "train.eval_at_ckpt=false"))  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_a_draft_that_samples_its_positions_trains_as_without_it(tmp_path):
    """Domino (DFlash's block draft) draws its anchors from the RNG in every forward (one
    per row here, so it does draw), the held-out record's included: the loop restores the
    RNG after it."""
    common = [
        "train.steps=4", "train.ckpt_every=2", "train.eval_at_ckpt=false", "draft=domino",
        "decode.k=3", "~draft.model.init", "draft.model.block_size=4",
        "draft.model.num_anchors=1", "draft.model.gru_hidden_size=16",
        "draft.model.correction_size=16",
    ]  # fmt: skip
    run(compose_debug(tmp_path / "off", *common))
    run(compose_debug(tmp_path / "on", *common, "train.heldout_proxy=true"))
    off, on = metrics_records(tmp_path / "off"), metrics_records(tmp_path / "on")
    losses = lambda recs: [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]  # noqa: E731
    assert losses(on) == losses(off) and len(losses(on)) == 4
    assert [r["step"] for r in on if r["kind"] == "heldout"] == [2, 4]
