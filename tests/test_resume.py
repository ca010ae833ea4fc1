"""SIGKILL mid-training, resume, and land on exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from train.checkpoint import list_checkpoints, load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
STEPS = 40
COMMON = [
    f"train.steps={STEPS}",
    "train.ckpt_every=4",
    "train.keep_last=2",
    "train.eval_at_ckpt=false",
    "data.num_train=16",
]


def _compose(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            "train",
            overrides=[
                "+experiment=debug",
                f"run_dir={run_dir}",
                *COMMON,
                *overrides,
            ],
        )


def _losses(run_dir: Path) -> dict[int, float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {x["step"]: x["loss"] for x in lines if x["kind"] == "train"}


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
