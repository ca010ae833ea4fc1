"""Faults a shared cluster throws, each run as train.py is launched (scripts/fault_inject.py's
commands: the tiny target, an EAGLE head, a local source, the feature pass): SIGKILL at
random points and a relaunch with resume=auto ends as the uninterrupted run did, and a killed
export leaves its --out absent or whole; two runs on one cache at once, with the same
settings and with other settings, each end as they do alone."""

import importlib.util
import json

import pytest

from tests.helpers import ROOT


def harness():
    spec = importlib.util.spec_from_file_location("fault_inject", ROOT / "scripts" / "fault_inject.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["regen", "tokenized"])  # two items: two workers share them
def test_killed_runs_and_exports_lose_nothing(tmp_path, kind):
    argv = ["--runs", "1", "--repeat", "1", "--steps", "40", "--kinds", kind]
    result = harness().main([*argv, "--workdir", str(tmp_path)])
    assert result["lost_what"] == [] and result["lost"] == 0
    assert result["survived"] == result["injected"] >= 4  # of 1 run x 6 phases (+ 1 export)
    assert set(result["reference_wall_s"]) == {kind}  # the other kind was never run
    other = "data: tokenize" if kind == "regen" else "data: regenerate answers"
    assert all(k["target"] != other for k in result["kills"])
    for where in ("data: read the source", "feature pass", "training", "evaluation and records"):
        assert result["phases"].get(where), (where, result["phases"])  # every phase was hit


@pytest.mark.slow
def test_two_runs_on_one_cache_each_end_as_they_do_alone(tmp_path):
    """Three launches at once on one cache: two regenerate the same answers (the same source
    read, the same regeneration cache file, the same feature cache), one tokenizes the same
    source instead (stage 1 shared, its own stage 2)."""
    h = harness()
    source = h.source_file(tmp_path / "source.jsonl")
    alone = {}
    for regenerate in (True, False):
        run_dir = tmp_path / f"alone-{regenerate}"
        cmd = h.train_command(run_dir, tmp_path / f"cache-{regenerate}", source, 30, regenerate)
        assert h.launch(cmd, tmp_path / "alone.log").wait() == 0, (tmp_path / "alone.log").read_text()[-3000:]  # fmt: skip
        alone[regenerate] = h.outcome(run_dir)
    shared = tmp_path / "cache-shared"
    runs = [(tmp_path / f"shared-{i}", regenerate) for i, regenerate in enumerate((True, True, False))]  # fmt: skip
    procs = [h.launch(h.train_command(d, shared, source, 30, r), d.with_suffix(".log")) for d, r in runs]  # fmt: skip
    for (run_dir, regenerate), proc in zip(runs, procs, strict=True):
        assert proc.wait() == 0, run_dir.with_suffix(".log").read_text()[-3000:]
        assert h.same(h.outcome(run_dir), alone[regenerate]) == [], run_dir
        assert h.check_disk(run_dir, shared) == []
    (answers,) = (shared / "data" / "regen").rglob("responses.jsonl")
    lines = answers.read_text().splitlines()
    assert lines and all(json.loads(line)["ids"] for line in lines)  # every line whole
