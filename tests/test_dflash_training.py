"""DFlash and Domino training on tiny random targets: Domino's curriculum, the training step
at sampled anchors, the training loop (with the checkpoint reload), and the start-up,
export and replay refusals. Drafts and helpers: tests/test_dflash.py."""

import json
import math

import pytest
import torch
from hydra import compose, initialize_config_dir

from decoding.drafters import make_drafter
from models.domino import DominoDraft, base_loss_weight
from models.protocol import DraftOutput
from models.target_loaders import build_tiny_random
from tests.test_dflash import KINDS, ROOT, build, step_loss
from tests.test_spec import make_target
from train.core.replay import gather_stream
from train.formats.checks import ExportError
from train.formats.export import refuse

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return make_target()  # varied greedy text: an off-by-one shows


# -- Domino's curriculum ---------------------------------------------------------------------
def test_curriculum_weight_goes_from_lambda_start_to_zero(target):
    assert [base_loss_weight(p) for p in (0.0, 0.25, 0.5, 0.75, 1.0)] == [1.0, 0.5, 0.0, 0, 0]
    assert base_loss_weight(0.1, lambda_start=0.8, decay_ratio=0.2) == pytest.approx(0.4)
    draft = build(target, "domino", correction=True)
    assert draft.base_loss_weight == 0.0  # never told its progress: the corrected loss only
    ids = torch.randint(6, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    out_t = target(ids, hidden_layers=draft.hidden_layers)
    assert draft(target, ids, out_t).base_logits is None
    draft.set_progress(0.1)  # the loop calls this before every step
    out = draft(target, ids, out_t)
    assert out.base_loss_weight == pytest.approx(0.8) and len(out.base_logits) == 4
    # The step's loss is (1 - w) * loss(corrected) + w * loss(backbone), position by position.
    blended, _, _ = step_loss(out, out_t.logits, ids)
    plain = DraftOutput(out.logits, out.offsets, positions=out.positions,
                        offset_weights=out.offset_weights)  # fmt: skip
    base = DraftOutput(out.base_logits, out.offsets, positions=out.positions,
                       offset_weights=out.offset_weights)  # fmt: skip
    final_loss = float(step_loss(plain, out_t.logits, ids)[0].detach())
    base_loss = float(step_loss(base, out_t.logits, ids)[0].detach())
    assert base_loss != pytest.approx(final_loss)  # the correction head is not zero
    assert float(blended.detach()) == pytest.approx(0.2 * final_loss + 0.8 * base_loss, rel=1e-5)
    assert draft.eval()(target, ids, out_t).base_logits is None  # evaluation: corrected only


# -- the training step at sampled anchors -----------------------------------------------------
def test_step_at_sampled_anchors_pairs_like_the_dense_layout_and_keeps_means(target):
    draft = build(target, "dflash", gamma=2.0)
    ids = torch.randint(6, 128, (2, 14), generator=torch.Generator().manual_seed(6))
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    out_t = target(ids, hidden_layers=draft.hidden_layers)
    out = draft(target, ids, out_t)  # every position: N = T - 1
    # The same logits laid out densely ([B, T, V], as a Medusa head's) give the same step.
    dense = [torch.cat([x, torch.zeros(2, 1, 128)], 1) for x in out.logits]
    dense_out = DraftOutput(dense, out.offsets, offset_weights=out.offset_weights)
    total, stats, counts = step_loss(out, out_t.logits, ids, loss_mask)
    total_d, stats_d, _ = step_loss(dense_out, out_t.logits, ids, loss_mask)
    torch.testing.assert_close(total, total_d)
    torch.testing.assert_close(stats.flat(), stats_d.flat())
    # The draft's position weights exp(-(i-1)/gamma) replace train.offset_decay ** (i-1).
    per_offset = stats.loss / counts
    want = sum(math.exp(-i / 2.0) * per_offset[i] for i in range(4))
    assert float(total.detach()) == pytest.approx(float(want), rel=1e-5)
    # Sampled anchors: sums are scaled to the micro-batch's trained positions, so a draft
    # that is exactly the target logs alpha = top-1 = 1 (not the sampled share of it).
    few = torch.tensor([[5, 7, 9], [4, 8, -1]])  # 3 and 2 anchors in the trained region
    at = [(few + off).clamp(0, 13)[..., None].expand(-1, -1, 128) for off in out.offsets]
    perfect = DraftOutput([out_t.logits.gather(1, i) for i in at], out.offsets, positions=few)
    _, stats_p, counts_p = step_loss(perfect, out_t.logits, ids, loss_mask)
    torch.testing.assert_close(stats_p.alpha[0] / counts_p, torch.ones(4))
    torch.testing.assert_close(stats_p.top1 / counts_p, torch.ones(4))


@pytest.mark.parametrize("vocab", ["full", 64])
def test_loop_trains_domino_with_its_curriculum(tmp_path, monkeypatch, vocab):
    """Two steps of the real loop on the tiny target (debug experiment): the draft is told
    its progress before each step, the records are finite, the checkpoint reloads (a
    reduced vocabulary built from the data's counts, and reloaded with the checkpoint)."""
    from train.core.checkpoint import load_draft
    from train.loop import run

    seen, masks = [], []
    original = DominoDraft.set_progress
    monkeypatch.setattr(
        DominoDraft, "set_progress", lambda self, p: (seen.append(p), original(self, p))
    )
    sample = DominoDraft.sample_anchors

    def spy(self, r, m=None):  # the memory plan's forward on the meta device is not a step
        if m is None or m.device.type != "meta":
            masks.append(m)
        return sample(self, r, m)

    monkeypatch.setattr(DominoDraft, "sample_anchors", spy)
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "+experiment=debug", f"run_dir={run_dir}", "draft=domino", "decode.k=3",
                "~draft.model.init", "draft.model.block_size=4", "draft.model.num_anchors=8",
                "draft.model.gru_hidden_size=16", "draft.model.correction_size=16",
                f"draft.model.vocab_size={vocab}",
            ],
        )  # fmt: skip
    run(cfg)
    assert seen == [0.0, 0.5]
    # The preflight forward has no loss mask; both training steps pass the batch's.
    assert masks[0] is None and len(masks) == 3 and all(m is not None for m in masks[1:])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["offsets"] for x in train_lines] == [[1, 2, 3]] * 2
    weights = [math.exp(-i / 4.0) for i in range(3)]  # conf gamma 4, not offset_decay 0.8 ** i
    for rec in train_lines:
        assert math.isfinite(rec["loss"]) and all(0.0 <= a <= 1.0 for a in rec["alpha"])
        logged = sum(w * x for w, x in zip(weights, rec["loss_per_offset"], strict=True))
        assert rec["loss"] == pytest.approx(logged, rel=1e-5)
    assert any(x["kind"] == "eval" and x["tau"] >= 1.0 for x in lines)

    tiny = build_tiny_random(device="cpu")
    loaded = load_draft(run_dir / "checkpoints" / "step_00000002", tiny)
    assert isinstance(loaded, DominoDraft) and loaded.block_size == 4
    if vocab == "full":
        assert loaded.vocab_ids is None
    else:  # the run's vocabulary, not the -1 placeholder of a draft built without counts
        assert loaded.vocab_ids.shape == (64,) and bool((loaded.vocab_ids.diff() > 0).all())
        assert set(tiny.eos_token_ids) <= set(loaded.vocab_ids.tolist())
        make_drafter(loaded, tiny)  # passes the vocabulary check


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["decode.k=8"],
            r"decode.k=8 drafts per round but one round of a draft=dflash drafts at most 7",
        ),
        (["decode=tree_dynamic", "decode.tree.depth=8"], r"decode.tree.depth=8 .* at most"),
        (["decode=tree_static"], "cannot draft decode.tree.kind=static"),
        (["replay.enabled=true"], "set replay.enabled=false"),
        (
            ["draft=domino", "draft.model.block_size=4", "decode.k=4"],
            "a draft=domino drafts at most 3",
        ),
        (
            ["loss=ce", "loss.labels=data"],
            r"draft.model.vocab_size=8192\) cannot .*vocab_size=full",
        ),
    ],
)
def test_startup_checks_refuse_what_a_block_cannot_draft(overrides, message):
    from train.run.settings import check_settings

    # run_dir given: its default reads ${hydra:job.override_dirname}, which only a Hydra
    # launch (or a test that sets HydraConfig) resolves; this test must pass on its own
    base = ["+experiment=dflash_kl", "run_dir=runs/unused"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        good = compose("train", overrides=[*base, "decode=tree_dynamic"])
        bad = compose("train", overrides=[*base, *overrides])
    check_settings(good)  # a dynamic tree of depth <= block_size - 1 fits
    with pytest.raises(ValueError, match=message):
        check_settings(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_export_and_replay_refuse_clearly(target, kind):
    draft = build(target, kind)
    with pytest.raises(ExportError, match="not exported"):
        refuse("speculators", draft)
    ids = torch.randint(6, 128, (1, 8))
    out = draft(target, ids, target(ids, hidden_layers=draft.hidden_layers))
    with pytest.raises(ValueError, match="replay.enabled=false"):
        gather_stream(out, torch.zeros(1, 8, 128), {}, "acc")
