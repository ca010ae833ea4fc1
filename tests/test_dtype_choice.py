"""`dtype: auto` (models/dtype_choice.py): the faster dtype by measurement, remembered per
machine, never over an explicit setting; and the real timing probe on the tiny target."""

from __future__ import annotations

import json

import pytest
import torch

import models.dtype_choice as dc
from models.target_loaders import build_tiny_random

CPU = torch.device("cpu")


def fake_timer(seconds: dict[str, float], calls: list):
    def measure(dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        calls.append(name)
        return seconds[name]

    return measure


@pytest.mark.parametrize(
    "seconds, want",
    [
        ({"float32": 0.124, "bfloat16": 0.131}, "float32"),  # an AVX2-only verify of 6 tokens
        ({"float32": 0.076, "bfloat16": 0.043}, "bfloat16"),  # its 1-token step
        ({"float32": 0.05, "bfloat16": 0.05}, "float32"),  # a tie: the exact one
    ],
)
def test_auto_picks_the_faster_dtype_and_remembers_it(tmp_path, seconds, want):
    calls = []
    shapes = {"rows": 1, "new": 6, "cached": 64}
    first = dc.choose_dtype("decode", "auto", shapes, fake_timer(seconds, calls), CPU, tmp_path)
    assert (first.dtype, first.source, first.seconds) == (want, "measured", seconds)
    assert calls == ["float32", "bfloat16"]
    again = dc.choose_dtype("decode", "auto", shapes, fake_timer(seconds, calls), CPU, tmp_path)
    assert (again.dtype, again.source, again.seconds) == (want, "cached", seconds)
    assert calls == ["float32", "bfloat16"]  # the cache answered: nothing measured twice
    assert want in first.describe() and "ms" in first.describe()


def test_the_cache_is_keyed_by_machine_use_and_shapes(tmp_path, monkeypatch):
    calls = []
    timer = fake_timer({"float32": 2.0, "bfloat16": 1.0}, calls)
    dc.choose_dtype("decode", "auto", {"new": 6}, timer, CPU, tmp_path)
    assert len(calls) == 2
    dc.choose_dtype("decode", "auto", {"new": 9}, timer, CPU, tmp_path)  # another shape
    dc.choose_dtype("regenerate", "auto", {"new": 6}, timer, CPU, tmp_path)  # another use
    assert len(calls) == 6
    here = dc.machine_key()
    # Each key changed to a value it cannot have here (a fixed "AVX512" is this machine's own
    # capability on an AVX-512 CPU).
    for key in ("cpu", "capability", "threads", "torch", "onednn_isa"):
        value = here[key] + 1 if key == "threads" else f"not {here[key]}"
        other = {**here, key: value}
        monkeypatch.setattr(dc, "machine_key", lambda other=other: other)
        before = len(calls)
        dc.choose_dtype("decode", "auto", {"new": 6}, timer, CPU, tmp_path)
        assert len(calls) == before + 2, f"a different {key} reused the cached timings"
    files = list((tmp_path / "dtype").glob("*.json"))
    assert len(files) == 8
    assert all(json.loads(f.read_text())["key"]["use"] in ("decode", "regenerate") for f in files)


def test_explicit_dtype_wins_and_cuda_is_bf16_without_measuring(tmp_path):
    def never(dtype):
        raise AssertionError("measured although the answer was given")

    got = dc.choose_dtype("decode", "bf16", {}, never, CPU, tmp_path)
    assert (got.dtype, got.source) == ("bfloat16", "explicit")
    got = dc.choose_dtype("decode", "fp32", {}, never, CPU, tmp_path)
    assert (got.dtype, got.source) == ("float32", "explicit")
    got = dc.choose_dtype("decode", "auto", {}, never, torch.device("cuda"), tmp_path)
    assert (got.dtype, got.source) == ("bfloat16", "cuda")
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        dc.choose_dtype("decode", "fp8", {}, never, CPU, tmp_path)
    assert not (tmp_path / "dtype").exists()


def test_time_forward_measures_a_cached_forward_and_leaves_the_target_alone():
    target = build_tiny_random(vocab_size=128, device="cpu")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    for dtype in (torch.float32, torch.bfloat16):
        seconds = dc.time_forward(target, dtype, rows=2, new_tokens=3, cached=8, repeats=2)
        assert 0 < seconds < 5
    assert target.dtype == torch.float32
    after = target.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_losing_candidate_stops_at_its_first_call_past_twice_the_best(tmp_path, monkeypatch):
    """Candidates are timed in order; once one has a median, a later candidate's timing stops
    at its first timed call over LOSING x that median (its recorded time): bf16 at 4 s a call
    against float32's 1 s runs the warm-up and one timed call, not the warm-up and three. A
    candidate within the bound is timed in full, and the bound is gone after the choice."""
    clock = [0.0]
    monkeypatch.setattr(dc.time, "perf_counter", lambda: clock[0])
    calls = {"float32": 0, "bfloat16": 0}

    def timed(name: str, seconds: float) -> float:
        def call() -> None:
            calls[name] += 1
            clock[0] += seconds

        return dc.median_seconds(call)

    slow = {"float32": 1.0, "bfloat16": 4.0}
    choice = dc.choose_measured("probe", {"n": 1}, lambda n: timed(n, slow[n]), tmp_path)
    assert choice.dtype == "float32" and choice.seconds == {"float32": 1.0, "bfloat16": 4.0}
    assert calls == {"float32": 4, "bfloat16": 2}
    close = {"float32": 1.0, "bfloat16": 1.5}  # within 2x: every call
    calls.update(float32=0, bfloat16=0)
    dc.choose_measured("probe", {"n": 2}, lambda n: timed(n, close[n]), tmp_path)
    assert calls == {"float32": 4, "bfloat16": 4}
    calls.update(float32=0)
    assert timed("float32", 10.0) == 10.0 and calls["float32"] == 4  # no bound outside a choice
