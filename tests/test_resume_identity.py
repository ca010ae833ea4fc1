"""A checkpoint's settings are compared wherever its weights are used again (train/run/identity.py):
resume=true and draft.init_from refuse every difference in one message with the overrides
that match; a resumed run continues the data from the rows consumed and the LR schedule it
started with, and each segment keeps its own config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import train.loop
from models.target_loaders import build_tiny_random
from tests.helpers import TINY_CPU_RUN, compose_debug, compose_train, metrics_records
from train.core.checkpoint import list_checkpoints, load_checkpoint
from train.core.schedule import _epoch_order
from train.formats.export import checkpoint_config
from train.loop import run

# An EAGLE-3 head on a 4-layer tiny target: default taps (2, 2, 1)
EAGLE = (*TINY_CPU_RUN, "draft=eagle", "target.num_layers=4", "draft.model.ttt_steps=2",
         "name=eagle_tiny", "train.steps=2", "train.ckpt_every=2", "train.eval_at_ckpt=false",
         "train.batch_size=2", "train.log_every=1", "optim.warmup_steps=1")  # fmt: skip
DEBUG = ("train.eval_at_ckpt=false",)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's many small ops crawl on busy cores
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eagle_run(tmp_path_factory) -> Path:
    """A 2-step EAGLE run with the default taps."""
    run_dir = tmp_path_factory.mktemp("identity") / "source"
    torch.set_num_threads(1)
    run(compose_train(*EAGLE, f"run_dir={run_dir}"))
    return run_dir


def _untouched(run_dir: Path) -> tuple:
    """What a refused start must leave as it was."""
    files = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else None
    metrics = (run_dir / "metrics.jsonl").read_text() if files else None
    return files, metrics, [p.name for p in list_checkpoints(run_dir)]


def test_resume_with_other_taps_and_lr_is_refused_listing_each(eagle_run):
    before = _untouched(eagle_run)
    cfg = compose_train(*EAGLE, f"run_dir={eagle_run}", "resume=true", "train.steps=4",
                        "draft.model.layers=[1,3,4]", "optim.lr=0.01")  # fmt: skip
    with pytest.raises(ValueError) as err:
        run(cfg)
    msg = str(err.value)
    assert f"resume=true: {eagle_run}/checkpoints/step_00000002 was trained with other" in msg
    assert "draft.model.layers: checkpoint [2, 2, 1], now [1, 3, 4]\n" in msg
    assert "optim.lr: checkpoint 0.001, now 0.01\n" in msg
    assert msg.endswith("To match the checkpoint: draft.model.layers=[2,2,1] optim.lr=0.001")
    assert "train.steps" not in msg  # a resumed run may run longer
    # Only the course differs: a warm start from the checkpoint is the other way out.
    with pytest.raises(
        ValueError, match=r"optim.lr=0.001\nOr keep the new settings .* draft.init_from="
    ):
        run(compose_train(*EAGLE, f"run_dir={eagle_run}", "resume=true", "optim.lr=0.01"))
    assert _untouched(eagle_run) == before  # nothing trained, written or dropped
    # The explicit default taps are the same taps: no difference.
    cfg = compose_train(*EAGLE, f"run_dir={eagle_run}", "resume=true", "draft.model.layers=[2,2,1]")
    assert run(cfg)["steps"] == 2


def test_init_from_with_other_taps_is_refused_naming_what_is_free(eagle_run, tmp_path):
    fresh = tmp_path / "warm"
    cfg = compose_train(*EAGLE, f"run_dir={fresh}", f"draft.init_from={eagle_run}",
                        "draft.model.layers=[1,3,4]", "draft.model.ttt_steps=3")  # fmt: skip
    with pytest.raises(ValueError) as err:
        run(cfg)
    msg = str(err.value)
    assert "draft.model.layers: checkpoint [2, 2, 1], now [1, 3, 4]\n" in msg
    assert "draft.model.ttt_steps: checkpoint 2, now 3\n" in msg
    assert "To match the checkpoint: draft.model.layers=[2,2,1] draft.model.ttt_steps=2" in msg
    assert "Free to change when starting from a checkpoint: the optimiser (optim.*)" in msg
    assert not fresh.exists()
    # Another optimiser, loss and seed are free: the warm start goes ahead.
    ok = compose_train(*EAGLE, f"run_dir={fresh}", f"draft.init_from={eagle_run}", "loss=tv",
                       "optim.lr=0.01", "seed=3", "train.steps=1", "train.ckpt_every=1")  # fmt: skip
    assert run(ok)["steps"] == 1


def test_resume_with_another_draft_kind_or_target_says_so(tmp_path):
    run(compose_debug(tmp_path, *DEBUG))
    with pytest.raises(ValueError, match=r"draft \(kind, builder\): checkpoint \[\"draft_lm\", "
                       r"\"models.draft_lm.from_target\"\], now \[\"mtp\".*\n.*draft=draft_lm"):  # fmt: skip
        run(compose_debug(tmp_path, *DEBUG, "resume=true", "draft=mtp"))
    with pytest.raises(ValueError) as err:
        run(
            compose_debug(tmp_path, *DEBUG, "resume=true", "target.seed=1", "target.dtype=bfloat16")
        )
    msg = str(err.value)
    weights = build_tiny_random(seed=0, device="cpu").fingerprint
    assert f'target weights: checkpoint "{weights} (tiny_random-s0-v128-h64-l2)", now' in msg
    assert "load the target the checkpoint was trained with: tiny_random-s0-v128-h64-l2" in msg
    assert 'target.dtype: checkpoint "float32", now "bfloat16"' in msg
    assert "To match the checkpoint: target.dtype=float32" in msg


def test_other_batch_size_continues_at_the_rows_consumed(tmp_path, monkeypatch, capsys):
    run(compose_debug(tmp_path, *DEBUG))  # 2 steps of 4 rows
    seen = []
    real = train.loop.global_rows
    monkeypatch.setattr(train.loop, "global_rows",
                        lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])  # fmt: skip
    cfg = compose_debug(tmp_path, *DEBUG, "resume=true", "train.steps=4", "train.batch_size=2")
    run(cfg)
    order = _epoch_order(0, 0, cfg.data.num_train)
    assert seen == [list(order[8:10]), list(order[10:12])]  # rows 8..11 of the stream, in order
    assert "continues at row 8 of the run's seeded order" in capsys.readouterr().out
    ckpts = list_checkpoints(tmp_path)
    assert load_checkpoint(ckpts[-1])[2]["rows_consumed"] == 12
    # Each segment keeps its config; a checkpoint evaluates with its own.
    first = (tmp_path / "config.yaml").read_text()
    assert "batch_size: 4" in first and "batch_size: 2" in (tmp_path / "config.resume-00000002.yaml").read_text()  # fmt: skip
    assert [checkpoint_config(c).train.batch_size for c in ckpts] == [4, 2]
    identity = json.loads((ckpts[-1] / "identity.json").read_text())
    assert identity["draft"]["kind"] == "draft_lm" and identity["draft"]["taps"] == []
    assert identity["target"]["weights"] == build_tiny_random(seed=0, device="cpu").fingerprint


def test_resume_keeps_the_lr_schedule_it_started_with(tmp_path, capsys):
    run(compose_debug(tmp_path, *DEBUG))  # warmup 1, cosine over 2 steps to 0.1 * 3e-3
    run(compose_debug(tmp_path, *DEBUG, "resume=true", "train.steps=5"))
    lrs = {r["step"]: r["lr"] for r in metrics_records(tmp_path) if r["kind"] == "train"}
    assert lrs[2] == pytest.approx(3e-4)
    assert [lrs[s] for s in (3, 4, 5)] == pytest.approx([3e-4] * 3)  # past the end: min_lr_ratio
    assert "the LR schedule stays the one the run started with" in capsys.readouterr().out


def test_a_checkpoint_from_before_identity_json_still_resumes(tmp_path):
    run(compose_debug(tmp_path, *DEBUG))
    ckpt = list_checkpoints(tmp_path)[-1]
    (ckpt / "identity.json").unlink()
    state = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    del state["schedule"]  # its schedule is then the one its config.yaml describes
    torch.save(state, ckpt / "trainer_state.pt")
    with pytest.raises(ValueError, match="draft.model.num_layers: checkpoint 1, now 2"):
        run(compose_debug(tmp_path, *DEBUG, "resume=true", "draft.model.num_layers=2"))
    assert run(compose_debug(tmp_path, *DEBUG, "resume=true", "train.steps=3"))["steps"] == 3
    lrs = {r["step"]: r["lr"] for r in metrics_records(tmp_path) if r["kind"] == "train"}
    assert lrs[3] == pytest.approx(3e-4)
