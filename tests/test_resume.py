"""SIGKILL mid-training, resume, and land on exactly the losses of an uninterrupted run."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, compose_debug, metrics_records
from train.core.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_checkpoint,
)

STEPS = 40
COMMON = [
    f"train.steps={STEPS}",
    "train.ckpt_every=4",
    "train.keep_last=2",
    "train.eval_at_ckpt=false",
    "data.num_train=16",
]


def _compose(run_dir: Path, *overrides: str):
    return compose_debug(run_dir, *COMMON, *overrides)


def _losses(run_dir: Path) -> dict[int, float]:
    return {x["step"]: x["loss"] for x in metrics_records(run_dir) if x["kind"] == "train"}


def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    from train.loop import run

    torch.set_num_threads(1)  # the killed subprocess runs with OMP_NUM_THREADS=1 too
    reference = tmp_path / "reference"
    run(_compose(reference))
    want = _losses(reference)
    assert sorted(want) == list(range(1, STEPS + 1))

    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "train.py",
        "+experiment=debug",
        f"run_dir={killed}",
        *COMMON,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if any(int(p.name.split("_")[1]) >= 8 for p in list_checkpoints(killed)):
            break
        time.sleep(0.005)
    assert proc.poll() is None, (
        f"the run ended before it could be killed: {proc.stderr.read()[-2000:]}"
    )
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    newest = list_checkpoints(killed)[-1]
    resumed_at = load_checkpoint(newest)[2]["step"]
    assert 8 <= resumed_at < STEPS, "the kill must land mid-training"

    summary = run(_compose(killed, "resume=true"))
    assert summary["resumed_from"] == str(newest)
    got = _losses(killed)
    assert sorted(got) == list(range(1, STEPS + 1))  # lines past the checkpoint were dropped
    # Same process count, same thread count, same data order: bit-identical losses.
    for step in range(resumed_at + 1, STEPS + 1):
        assert got[step] == want[step], (step, got[step], want[step])
    ref_state = load_checkpoint(list_checkpoints(reference)[-1])[0]
    res_state = load_checkpoint(list_checkpoints(killed)[-1])[0]
    for name in ref_state:
        assert torch.equal(ref_state[name], res_state[name]), name


def _truncate(path: Path, size: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:size])


def test_damaged_newest_checkpoint_resumes_from_the_newest_intact_one(tmp_path):
    from train.loop import run

    torch.set_num_threads(1)
    run(_compose(tmp_path, "train.steps=12"))  # checkpoints at 8 and 12 (keep_last=2)
    want = _losses(tmp_path)
    assert sorted(want) == list(range(1, 13))
    newest, older = list_checkpoints(tmp_path)[-1], list_checkpoints(tmp_path)[-2]
    assert (newest.name, older.name) == ("step_00000012", "step_00000008")
    # Copies: safetensors maps the file, and the mapped pages vanish when it is truncated.
    want_state = {name: t.clone() for name, t in load_checkpoint(newest)[0].items()}
    damaged = newest / "draft.safetensors"
    _truncate(damaged, damaged.stat().st_size // 2)  # e.g. a full disk while copying the run

    # The damaged one is renamed aside: out of keep_last pruning and latest_checkpoint (which
    # scripts/evaluate.py reads), kept for inspection.
    aside = newest.with_name(".damaged-step_00000012")
    with pytest.warns(UserWarning, match=f"{older}.*renamed {aside.name}.*{damaged} is damaged"):
        assert resume_checkpoint(tmp_path, resume=True, overwrite=False) == older
    assert latest_checkpoint(tmp_path) == older and list_checkpoints(tmp_path)[-1] == older
    assert not newest.exists() and (aside / "draft.safetensors").is_file()

    summary = run(_compose(tmp_path, "train.steps=12", "resume=true"))
    assert summary["resumed_from"] == str(older)
    assert _losses(tmp_path) == want  # steps 9..12 again, bit-identical
    got_state = load_checkpoint(newest)[0]  # step 12 was written again, intact
    for name in want_state:
        assert torch.equal(got_state[name], want_state[name]), name
    assert aside.is_dir()  # a resume's clean_partial leaves it for the user


def test_resume_refuses_when_no_checkpoint_is_intact(tmp_path):
    from train.loop import run

    run(_compose(tmp_path, "train.steps=4", "train.ckpt_every=2"))
    old, new = list_checkpoints(tmp_path)
    _truncate(new / "draft.safetensors", 100)  # header length past the end of the file
    _truncate(old / "trainer_state.pt", 1000)
    metrics = (tmp_path / "metrics.jsonl").read_text()

    with pytest.raises(ValueError, match="draft.safetensors is damaged") as err:
        load_checkpoint(new)  # loading a damaged checkpoint names the file, too
    assert str(new / "draft.safetensors") in str(err.value)
    with pytest.raises(ValueError, match="no checkpoint .* is intact") as err:
        run(_compose(tmp_path, "train.steps=4", "train.ckpt_every=2", "resume=true"))
    assert str(new / "draft.safetensors") in str(err.value)
    assert str(old / "trainer_state.pt") in str(err.value)
    assert (tmp_path / "metrics.jsonl").read_text() == metrics  # nothing trained or dropped
    assert list_checkpoints(tmp_path) == [old, new]


def test_a_run_killed_in_its_last_evaluation_evaluates_when_resumed(tmp_path):
    """The last checkpoint is written before its evaluation: a kill in between (here: the
    eval record removed, and an append cut short) left a finished run with no final
    evaluation. Resumed, it evaluates that checkpoint once, trains nothing, and its records
    equal the uninterrupted run's but for timings."""
    from train.loop import run

    torch.set_num_threads(1)
    overrides = ("train.steps=4", "train.ckpt_every=2", "train.eval_at_ckpt=true")
    want = run(_compose(tmp_path / "whole", *overrides))
    killed = tmp_path / "killed"
    run(_compose(killed, *overrides))
    lines = (killed / "metrics.jsonl").read_text().splitlines()
    kept = [ln for ln in lines if not ('"kind": "eval"' in ln and '"step": 4' in ln)]
    assert len(kept) == len(lines) - 1
    (killed / "metrics.jsonl").write_text("\n".join(kept) + '\n{"kind": "tra')  # cut short
    (killed / "summary.json").unlink()
    got = run(_compose(killed, *overrides, "resume=true"))
    assert got["resumed_from"].endswith("step_00000004")
    assert got["final_eval"]["step"] == 4
    assert got["final_eval"]["tau"] == want["final_eval"]["tau"]
    evals = [r["step"] for r in metrics_records(killed) if r["kind"] == "eval"]
    assert evals == [2, 4]  # once each
    assert _losses(killed) == _losses(tmp_path / "whole")
