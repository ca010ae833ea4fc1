"""DDP and FSDP over two gloo ranks on the CPU, launched as users launch them
(`accelerate launch --config_file conf/accelerate/{ddp,fsdp}.yaml --num_processes 2`):

- the 2-rank run (batch 2 per rank) trains like one process with batch 4: every step's loss
  and grad_norm within rel 1e-5, the final weights within atol 1e-5 + rtol 1e-4 (each rank
  pads its micro-batch to its own longest row and sums in another order, and FSDP
  reduce-scatters: float32 differs in the last bits, ~1e-7 in the loss; Adam's first steps
  divide by sqrt(v), so weights differ a little more);
- clipping is active: grad_norm > 0 and above train.max_grad_norm, and the 2-rank weights are
  the clipped single run's, far from an unclipped one's;
- summary.json says what ran (fsdp: a sharded draft; ddp: not sharded);
- the 2-rank checkpoint evaluates in one process (scripts/evaluate.py) exactly as the run did;
- SIGKILL mid-run, then resume=true under 2 ranks: bit-identical losses and final weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.helpers import ROOT, TIMING, compose_debug, metrics_records
from train.core.checkpoint import list_checkpoints, load_checkpoint

spec = importlib.util.spec_from_file_location("evaluate_script", ROOT / "scripts" / "evaluate.py")
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)

STEPS = 24
KILL_AFTER = 8  # kill once this step's checkpoint exists
COMMON = [
    f"train.steps={STEPS}",
    "train.ckpt_every=4",
    "train.eval_every=1000",  # the last checkpoint only
    "train.max_grad_norm=1.0",  # below the debug run's gradient norms (~3-9): clipping binds
    "data.num_train=16",
    "decode.temperatures=[0.0,0.7]",  # sampled acceptance: sensitive to every weight
    "decode.num_prompts=2",
    "decode.max_new_tokens=16",
    "decode.k=3",
    "train.dist_timeout_s=450",  # a collective no other rank joins raises (< the launch limit)
]
# PYTHONFAULTHANDLER: a process sent SIGABRT prints its threads' Python stacks (run_launch)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
       "PYTHONFAULTHANDLER": "1"}  # fmt: skip
LAUNCH_TIMEOUT_S = 600


def launch(strategy: str, run_dir: Path, *overrides: str) -> list[str]:
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(ROOT / "conf" / "accelerate" / f"{strategy}.yaml"),
        "--num_processes", "2", "train.py", "+experiment=debug", f"run_dir={run_dir}",
        "train.batch_size=2", *COMMON, *overrides,
    ]  # fmt: skip


def signal_launch(
    proc: subprocess.Popen, sig: int, everyone: list[psutil.Process] | None = None
) -> list[psutil.Process]:
    """Send `sig` to a launch's ranks, then to the launcher (torch's elastic agent starts each
    rank in a session of its own: one by one); skips one that ended meanwhile. Returns them,
    the launcher last."""
    if everyone is None:
        everyone = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    for p in everyone:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(sig)
    return everyone


def run_launch(strategy: str, run_dir: Path, *overrides: str) -> None:
    """The launch to its end; one that outlives LAUNCH_TIMEOUT_S fails with every process's
    Python stack (faulthandler dumps them on SIGABRT) and the log's tail: where it waited."""
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(launch(strategy, run_dir, *overrides), cwd=ROOT, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
        try:
            proc.wait(timeout=LAUNCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            everyone = signal_launch(proc, signal.SIGABRT)
            psutil.wait_procs(everyone, timeout=30)
            signal_launch(proc, signal.SIGKILL, everyone)
            proc.wait()
            pytest.fail(f"the launch ran over {LAUNCH_TIMEOUT_S} s; its stacks and log's tail:\n"
                        + log.read_text()[-12000:])  # fmt: skip
    assert proc.returncode == 0, log.read_text()[-4000:]


def train_records(run_dir: Path) -> list[dict]:
    return [x for x in metrics_records(run_dir) if x["kind"] == "train"]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(list_checkpoints(run_dir)[-1])[0]


def ran(run_dir: Path) -> dict:
    """summary.json's record of the strategy that ran (train/parallel/strategy.py: strategy_ran)."""
    return json.loads((run_dir / "summary.json").read_text())["strategy"]


def deterministic(metrics: dict) -> dict:
    """The evaluation's results: no timings, proxies, or which rank decoded which prompt."""
    return {
        k: v
        for k, v in metrics.items()
        if not k.endswith(TIMING) and "proxy" not in k and k != "prompts_by_rank"
    }


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict[str, Path]:
    """One process, batch 4 (the 2-rank runs' global batch): clipped, and unclipped."""
    from train.loop import run

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("single")
    runs = {"clipped": root / "clipped", "unclipped": root / "unclipped"}
    run(compose_debug(runs["clipped"], "train.batch_size=4", *COMMON))
    run(compose_debug(runs["unclipped"], "train.batch_size=4", *COMMON, "train.max_grad_norm=null"))
    torch.set_num_threads(threads)
    return runs


@pytest.fixture(scope="module", params=["ddp", "fsdp"])
def two_ranks(request, tmp_path_factory) -> tuple[str, Path, Path, int]:
    """(strategy, the uninterrupted 2-rank run, the killed-and-resumed one, the step resumed at)."""
    strategy = request.param
    root = tmp_path_factory.mktemp(strategy)
    whole, killed = root / "whole", root / "killed"
    run_launch(strategy, whole)
    # Every test below is about this strategy: a launch that ran another one fails them all.
    assert ran(whole)["kind"] == strategy, ran(whole)

    with open(root / "killed.log", "w") as out:
        proc = subprocess.Popen(launch(strategy, killed), cwd=ROOT, env=ENV, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if any(int(p.name.split("_")[1]) >= KILL_AFTER for p in list_checkpoints(killed)):
            break
        time.sleep(0.005)
    assert proc.poll() is None, (
        "the run ended before it could be killed: " + ((root / "killed.log").read_text()[-3000:])
    )
    ranks = signal_launch(proc, signal.SIGKILL)[:-1]
    proc.wait()
    psutil.wait_procs(ranks, timeout=30)
    resumed_at = load_checkpoint(list_checkpoints(killed)[-1])[2]["step"]
    assert KILL_AFTER <= resumed_at < STEPS, "the kill must land mid-training"
    run_launch(strategy, killed, "resume=true")
    return strategy, whole, killed, resumed_at


def test_summary_records_the_strategy_that_ran(two_ranks):
    strategy, whole, killed, _ = two_ranks
    for run_dir in (whole, killed):
        record = ran(run_dir)
        assert record["kind"] == strategy
        assert record["world_size"] == 2
        assert record["backend"] == "gloo"
        assert record["draft_sharded"] is (strategy == "fsdp")


def test_two_ranks_train_like_one_process_with_the_same_global_batch(two_ranks, single):
    strategy, whole, _, _ = two_ranks
    ref, got = train_records(single["clipped"]), train_records(whole)
    assert [x["step"] for x in got] == list(range(1, STEPS + 1))  # the main rank logs, once
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (strategy, a["step"])
        assert b["alpha"] == pytest.approx(a["alpha"], rel=1e-5), (strategy, a["step"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (strategy, a["step"])
    assert ref[-1]["loss"] < ref[0]["loss"]  # the steps did something
    want, have = final_weights(single["clipped"]), final_weights(whole)
    assert set(have) == set(want)
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_gradients_are_clipped(two_ranks, single):
    _, whole, _, _ = two_ranks
    norms = [x["grad_norm"] for x in train_records(whole)]
    assert all(n > 1.0 for n in norms), norms  # > 0, and above max_grad_norm: clipping binds
    clipped, unclipped, have = (
        final_weights(single["clipped"]), final_weights(single["unclipped"]), final_weights(whole)
    )  # fmt: skip
    # Unclipped training lands far from the clipped run (Adam is not blind to the clip: the
    # clip factor changes from step to step); the 2-rank run lands on the clipped one.
    far = max(float((clipped[n] - unclipped[n]).abs().max()) for n in clipped)
    near = max(float((clipped[n] - have[n]).abs().max()) for n in clipped)
    assert far > 1e-3 and near < far / 100, (near, far)


def test_checkpoint_evaluates_identically_in_one_process(two_ranks):
    _, whole, _, _ = two_ranks
    final = json.loads((whole / "summary.json").read_text())["final_eval"]
    assert final["step"] == STEPS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank ran
    try:
        result = ev.main([str(list_checkpoints(whole)[-1])])
    finally:
        torch.set_num_threads(threads)
    for tag in ("greedy", "T0.7"):
        assert result[f"{tag}/alpha"] == final[f"{tag}/alpha"], tag
        assert result[f"{tag}/accept_hist"] == final[f"{tag}/accept_hist"], tag
    assert deterministic(result) == deterministic(final)


def test_kill_and_resume_equals_the_uninterrupted_run(two_ranks):
    strategy, whole, killed, resumed_at = two_ranks
    want = {x["step"]: x for x in train_records(whole)}
    got = {x["step"]: x for x in train_records(killed)}
    assert sorted(got) == list(range(1, STEPS + 1))  # lines past the checkpoint were dropped
    for step in range(resumed_at + 1, STEPS + 1):  # same ranks, threads, data order: exact
        assert got[step]["loss"] == want[step]["loss"], (strategy, step)
        assert got[step]["grad_norm"] == want[step]["grad_norm"], (strategy, step)
    have, ref = final_weights(killed), final_weights(whole)
    for name in ref:
        assert torch.equal(have[name], ref[name]), (strategy, name)
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{resumed_at:08d}")


def test_a_run_killed_in_its_last_evaluation_evaluates_it_on_every_rank(two_ranks, tmp_path):
    """The finished run with its final evaluation gone (a kill between the last checkpoint
    and its evaluation): resumed under the same launch, every rank evaluates that checkpoint
    (the main rank's records decide for all: a rank deciding alone would hang the others in
    the evaluation's gathers), once, with the uninterrupted run's results."""
    strategy, whole, _, _ = two_ranks
    copy = tmp_path / "copy"
    shutil.copytree(whole, copy)
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln)["kind"] != "eval"]
    assert len(kept) == len(lines) - 1  # eval_every: the last checkpoint only
    (copy / "metrics.jsonl").write_text("".join(ln + "\n" for ln in kept))
    (copy / "summary.json").unlink()
    run_launch(strategy, copy, "resume=true")
    final = json.loads((copy / "summary.json").read_text())["final_eval"]
    want = json.loads((whole / "summary.json").read_text())["final_eval"]
    assert final["step"] == STEPS and deterministic(final) == deterministic(want), strategy
    assert [r["step"] for r in metrics_records(copy) if r["kind"] == "eval"] == [STEPS]


def test_fsdp_gradient_accumulation_trains_like_one_process(tmp_path, single):
    """2 ranks x 1 row x 2 micro-batches (the first without a gradient reduction) = one
    process with batch 4; and the sharded draft started from rank 0's broadcast weights."""
    run_dir = tmp_path / "accum"
    run_launch("fsdp", run_dir, "train.batch_size=1", "train.grad_accum=2")
    record = ran(run_dir)
    assert (record["kind"], record["initial_weights"], record["mixed_precision"]) == (
        "fsdp", "broadcast from rank 0", None)  # fmt: skip
    ref, got = train_records(single["clipped"]), train_records(run_dir)
    for a, b in zip(ref, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), a["step"]
    want, have = final_weights(single["clipped"]), final_weights(run_dir)
    for name in want:
        torch.testing.assert_close(have[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def test_fsdp_with_bf16_records_its_mixed_precision_policy(tmp_path):
    run_dir = tmp_path / "bf16"
    run_launch("fsdp", run_dir, "train.bf16=true", "train.steps=4", "train.eval_at_ckpt=false")
    policy = ran(run_dir)["mixed_precision"]
    assert policy == {"param_dtype": "bfloat16", "reduce_dtype": "float32", "master_weights": "float32"}  # fmt: skip
    losses = [x["loss"] for x in train_records(run_dir)]
    assert len(losses) == 4 and all(0 < x < 100 for x in losses), losses
    assert {w.dtype for w in final_weights(run_dir).values()} == {torch.float32}  # master weights
