"""scripts/curve_tokens.py: held-out acceptance against unique training tokens, read from the
runs' summary.json (a point already run is read, not run again)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("curve_tokens", ROOT / "scripts" / "curve_tokens.py")
curve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(curve)


def _summary(run_dir: Path, tokens: int, top1: float, alpha: float) -> None:
    run_dir.mkdir(parents=True)
    held = {
        "heldout/top1": [top1, 0.1], "heldout/alpha_T1": [alpha, 0.1],
        "heldout/sim_tau_greedy": 1 + top1, "heldout/sim_tau_T1": 1 + alpha,
        "heldout/oov_share": 0.05,
    }  # fmt: skip
    summary = {"steps": 300, "train_s": 9.0, "final_heldout": held,
               "data_stats": {"trained_tokens": tokens, "train_rows": 7, "streams": {}}}  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(summary))


def test_points_are_read_from_existing_runs_and_drawn(tmp_path):
    runs = tmp_path / "runs"
    _summary(runs / "regen_0_s300" / "seed0", 28000, 0.40, 0.38)
    _summary(runs / "regen_0_s300" / "seed1", 28000, 0.42, 0.40)
    _summary(runs / "raw_680_s300" / "seed0", 300000, 0.45, 0.41)
    _summary(runs / "raw_680_s300" / "seed1", 300000, 0.47, 0.43)
    out = tmp_path / "out"
    points = curve.main(
        [
            "--steps",
            "300",
            "--seeds",
            "0",
            "1",
            "--points",
            "regen:0",
            "raw:680",
            "--runs",
            str(runs),
            "--out",
            str(out),
        ]
    )  # fmt: skip  (no train.py runs: every summary exists)
    assert [(p["stream"], p["seed"], p["top1_1"]) for p in points] == [
        ("regen", 0, 0.40), ("raw", 0, 0.45), ("regen", 1, 0.42), ("raw", 1, 0.47),
    ]  # fmt: skip
    assert [p["alpha_T1_1"] for p in points] == [0.38, 0.41, 0.40, 0.43]
    assert json.loads((out / "curve.json").read_text())["points"] == points
    assert (out / "curve.png").stat().st_size > 10_000


def test_a_bad_point_is_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="expected STREAM:N"):
        curve.main(["--points", "regen:0", "books:5", "--runs", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_pack_points_train_one_pass_over_their_own_rows(tmp_path, monkeypatch):
    """--passes 1 with pack points: each point's step budget is its rows (the pack's first
    rows of its sources until the answer tokens reach N) over the batch size, and each run
    gets the pack, its token cap and sources, and no regenerated rows."""
    from train.data.pack import write_pack

    rows = [{"source": "self" if i % 2 else "pool", "category": "x", "group": f"g{i}",
             "prompt": f"p{i}", "answer_ids": [1] * 10, "finished": True} for i in range(40)]  # fmt: skip
    write_pack(tmp_path / "pack", rows, {"target": "t"})
    assert curve.pack_rows(tmp_path / "pack", "pack", 95) == 10  # 10 rows reach 95 tokens
    assert curve.pack_rows(tmp_path / "pack", "packself", 200) == 20  # every self row
    launched = []

    def fake_run(cmd, check, cwd):
        run_dir = Path(next(a for a in cmd if a.startswith("run_dir=")).removeprefix("run_dir="))
        launched.append(cmd)
        _summary(run_dir, 1000, 0.5, 0.4)

    monkeypatch.setattr(curve.subprocess, "run", fake_run)
    points = curve.main(["--passes", "1", "--pack", str(tmp_path / "pack"), "--points",
                         "pack:95", "packself:200", "--runs", str(tmp_path / "runs"),
                         "--out", str(tmp_path / "out")])  # fmt: skip
    steps = [
        int(next(a for a in c if a.startswith("train.steps=")).split("=")[1]) for c in launched
    ]
    assert steps == [3, 5]  # ceil(10 / 4), 20 / 4
    assert "data.num_train=0" in launched[0] and "data.pack_sources=[self]" in launched[1]
    assert "data.pack_tokens=95" in launched[0] and len(points) == 2
    with pytest.raises(SystemExit):  # a step budget from passes needs pack points
        curve.main(["--passes", "1", "--points", "regen:0", "--runs", str(tmp_path / "r2")])
