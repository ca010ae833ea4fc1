"""Two gloo ranks (torchrun on CPU) train exactly like one process with the same global batch.

Tolerance: rel 1e-5 on the loss. The two runs see the same rows and normalise by the same
global token count, but each rank pads its 2-row micro-batch to its own longest row and
sums in a different order, so float32 results differ in the last bits (observed ~1e-7).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, compose_debug, metrics_records

STEPS = 4
COMMON = [
    f"train.steps={STEPS}",
    "train.ckpt_every=2",
    "train.eval_at_ckpt=true",
    "decode.num_prompts=1",
    "data.num_train=16",
]


def test_two_ranks_match_one_process_with_same_global_batch(tmp_path):
    from train.loop import run

    torch.set_num_threads(1)
    one = tmp_path / "one"
    run(compose_debug(one, "train.batch_size=4", *COMMON))

    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "train.py",
        "+experiment=debug",
        f"run_dir={two}",
        "train.batch_size=2",
        *COMMON,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]

    ref = [x for x in metrics_records(one) if x["kind"] == "train"]
    got = [x for x in metrics_records(two) if x["kind"] == "train"]
    # Only the main rank logs: one line per step, not two.
    assert [x["step"] for x in got] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["alpha"][0] == pytest.approx(a["alpha"][0], rel=1e-5)
    assert ref[-1]["loss"] < ref[0]["loss"]  # the steps did something
    summary = json.loads((two / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == [
        "step_00000002",
        "step_00000004",
    ]
    print(
        "max rel loss diff", max(abs(b["loss"] - a["loss"]) / a["loss"] for a, b in zip(ref, got))
    )
