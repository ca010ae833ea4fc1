"""Training dtypes chosen by measurement (train/run/machine.py): target.dtype=auto and
train.bf16=auto follow the timings, the choice is applied to the run, and threads are shared
among a machine's processes."""

import json

import pytest
import torch
from accelerate.state import AcceleratorState

import train.run.machine
from tests.helpers import compose_debug, metrics_records
from train.loop import run


def fake_timings(monkeypatch, fast: str) -> None:
    """Every probe in train/run/machine.py times `fast` at 1 ms and the other dtype at 9 ms: the
    probe calls its forward in the dtype it measures, so the dtype is read off the call."""
    seen = []

    def median_seconds(fn, repeats=3):
        seen.append(fn)
        return 0.001 if (len(seen) % 2 == 1) == (fast == "float32") else 0.009

    monkeypatch.setattr(train.run.machine, "median_seconds", median_seconds)


@pytest.mark.parametrize("fast", ["float32", "bfloat16"])
def test_auto_training_dtypes_follow_the_timings(tmp_path, monkeypatch, fast):
    fake_timings(monkeypatch, fast)  # CANDIDATES order: float32 measured first, then bfloat16
    cfg = compose_debug(
        tmp_path / "run", "target.dtype=auto", "train.bf16=auto", f"data.cache_dir={tmp_path}/c"
    )
    summary = run(cfg)
    dtypes = summary["dtypes"]
    assert dtypes["train_target"]["dtype"] == fast
    assert dtypes["train_draft"]["dtype"] == fast
    assert dtypes["train_target"]["source"] == "measured"
    assert set(dtypes["train_target"]["seconds"]) == {"float32", "bfloat16"}


def _first_loss(tmp_path, name, *overrides) -> float:
    cfg = compose_debug(tmp_path / name, "train.steps=1", "train.eval_at_ckpt=false",
                        f"data.cache_dir={tmp_path}/c", *overrides)  # fmt: skip
    AcceleratorState._reset_state(reset_partial_state=True)  # mixed precision differs per run
    run(cfg)
    AcceleratorState._reset_state(reset_partial_state=True)
    return [r for r in metrics_records(tmp_path / name) if r["kind"] == "train"][0]["loss"]


def test_measured_bf16_autocast_is_applied_to_the_step(tmp_path, monkeypatch):
    """A measured bf16 choice autocasts the draft like train.bf16=true does; float32 does not."""
    fp32 = _first_loss(tmp_path, "fp32", "train.bf16=false")
    bf16 = _first_loss(tmp_path, "bf16", "train.bf16=true")
    assert fp32 != bf16  # bf16 autocast changes the first loss, or the test could not tell
    fake_timings(monkeypatch, "bfloat16")
    auto = _first_loss(tmp_path, "auto", "train.bf16=auto", "data.cache_dir=" + str(tmp_path / "d"))
    assert auto != fp32
    assert auto == pytest.approx(bf16, rel=1e-2)


def test_cached_choice_is_reused_without_measuring(tmp_path, monkeypatch):
    fake_timings(monkeypatch, "float32")
    overrides = ("target.dtype=auto", "train.bf16=auto", "train.steps=1",
                 "train.eval_at_ckpt=false", f"data.cache_dir={tmp_path}/c")  # fmt: skip
    run(compose_debug(tmp_path / "a", *overrides))

    def refuse(*args, **kwargs):
        raise AssertionError("a cached choice was measured again")

    monkeypatch.setattr(train.run.machine, "median_seconds", refuse)
    summary = json.loads(json.dumps(run(compose_debug(tmp_path / "b", *overrides))))
    assert summary["dtypes"]["train_target"]["source"] == "cached"
    assert summary["dtypes"]["train_draft"]["source"] == "cached"


def test_threads_are_the_cores_shared_by_processes(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(train.run.machine.os, "sched_getaffinity", lambda pid: set(range(8)))
    try:
        record = train.run.machine.share_threads(2, torch.device("cpu"))
        assert record["threads"] == 4 == torch.get_num_threads()
        assert train.run.machine.share_threads(16, torch.device("cpu"))["threads"] == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert (
            train.run.machine.share_threads(2, torch.device("cpu"))["source"] == "OMP_NUM_THREADS"
        )
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_suite_starts_a_worker_per_usable_core(monkeypatch):
    import psutil

    from tests.conftest import pytest_xdist_auto_num_workers

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 1)  # one core, two threads
    monkeypatch.setattr(train.run.machine.os, "sched_getaffinity", lambda pid: {0, 1})
    assert pytest_xdist_auto_num_workers(None) == 2 == train.run.machine.usable_cores()
    monkeypatch.setattr(train.run.machine.os, "sched_getaffinity", lambda pid: {5})  # taskset
    assert pytest_xdist_auto_num_workers(None) == 1


def test_a_resumed_auto_run_keeps_the_target_dtype_it_ran_in(tmp_path, monkeypatch):
    """A re-measured verdict must not change the features the draft reads mid-run."""
    overrides = ("target.dtype=auto", "train.bf16=false", "train.eval_at_ckpt=false",
                 "train.ckpt_every=1", f"data.cache_dir={tmp_path}/c")  # fmt: skip
    fake_timings(monkeypatch, "bfloat16")
    first = run(compose_debug(tmp_path / "run", "train.steps=1", *overrides))
    assert first["dtypes"]["train_target"]["dtype"] == "bfloat16"
    fake_timings(monkeypatch, "float32")  # the machine now says float32 (a cleared cache)
    second = run(compose_debug(tmp_path / "run", "train.steps=2", "resume=true", *overrides))
    assert second["dtypes"]["train_target"] == {**second["dtypes"]["train_target"],
                                                "dtype": "bfloat16", "source": "resumed"}  # fmt: skip


class OtherRank:
    """A rank other than 0 of a 2-process run: `broadcast` hands over rank 0's verdict."""

    main, world = False, 2

    def __init__(self, verdict):
        self.verdict = verdict

    def broadcast(self, obj):
        assert obj is None  # this rank measured nothing
        return self.verdict


def test_other_ranks_take_rank_0s_training_dtypes_without_measuring(monkeypatch, tiny_target):
    """With several processes only rank 0 times the dtypes: the ranks of one run never train
    in different dtypes (the feature cache's key holds the dtype, DDP needs equal steps)."""
    from models.dtype_choice import DtypeChoice

    def no_timing(*args, **kwargs):
        raise AssertionError("a rank other than 0 measured a dtype")

    monkeypatch.setattr(train.run.machine, "median_seconds", no_timing)
    cfg = compose_debug("unused", "target.dtype=auto", "train.bf16=auto")
    row = {"input_ids": list(range(3, 40)), "loss_mask": [0] * 10 + [1] * 27}
    bf16 = DtypeChoice("train_target", "bfloat16", "measured", {"float32": 2.0, "bfloat16": 1.0})
    choice = train.run.machine.set_target_dtype(cfg, tiny_target, row, None, OtherRank(bf16))
    assert choice == bf16 and tiny_target.dtype == torch.bfloat16
    draft_choice = DtypeChoice("train_draft", "float32", "measured", {})
    got = train.run.machine.choose_autocast("auto", cfg, tiny_target, None, None, row,
                                        OtherRank(draft_choice))  # fmt: skip
    assert got == draft_choice
