"""Experiment comparison: a real 2x2 Hydra sweep on the tiny target, scripts/compare.py on it
(numbers checked against the runs' own summaries), the grouping and t-interval on synthetic
runs, the W&B settings, and the notebook executed on the sweep."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from scipy import stats as scipy_stats

from tests.helpers import metrics_records
from train.report.plots import plot_acceptance_vs_entropy, plot_learning_curve
from train.report.runs import (
    bucket_labels,
    find_runs,
    group_keys,
    group_runs,
    load_run,
    mean_ci,
    summarize_group,
    t_quantile_975,
)
from train.report.tables import entropy_table, markdown_table
from train.report.tracking import wandb_run_settings, wandb_summary

ROOT = Path(__file__).resolve().parents[1]
VARIANT = "train.ckpt_every=2,train.steps=4"  # the sweep's non-swept overrides, as in run_dir
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """`train.py -m +experiment=debug loss=ce,tv seed=0,1` (4 steps, evals at 2 and 4)."""
    work = tmp_path_factory.mktemp("sweep")
    cmd = [sys.executable, str(ROOT / "train.py"), "-m", "+experiment=debug", "loss=ce,tv"]
    cmd += ["seed=0,1", "train.steps=4", "train.ckpt_every=2"]
    proc = subprocess.run(cmd, cwd=work, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work / "runs"


def _ci95(values: list[float]) -> tuple[float, float]:
    """Reference t-interval from scipy, independent of train/report/runs.py."""
    n = len(values)
    half = scipy_stats.t.ppf(0.975, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return statistics.fmean(values), half


def _table_rows(markdown: str, index: int = 0) -> dict[str, dict[str, str]]:
    """The index-th markdown table of `markdown` -> {first cell: {column: cell}}."""
    tables, block = [], []
    for ln in [*markdown.splitlines(), ""]:
        if ln.startswith("|"):
            block.append(ln)
        elif block:
            tables.append(block)
            block = []
    lines = tables[index]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    return {r[header[0]]: r for r in rows}


def test_sweep_writes_one_run_dir_per_job(sweep):
    dirs = sorted(p.parent for p in sweep.rglob("summary.json"))
    expected = [
        sweep / "debug" / f"loss={loss},{VARIANT}" / f"seed{s}"
        for loss in ("ce", "tv")
        for s in (0, 1)
    ]
    assert dirs == expected
    for d in dirs:
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        assert f"loss={cfg['loss']['name']}," in d.parent.name and d.name == f"seed{cfg['seed']}"
        assert cfg["run_dir"] == str(d.relative_to(sweep.parent))
        assert (d / ".hydra" / "overrides.yaml").is_file()  # Hydra's record sits in the run dir
        assert f"seed={cfg['seed']}" in (d / ".hydra" / "overrides.yaml").read_text()
        evals = metrics_records(d)
        assert [e["step"] for e in evals if e["kind"] == "eval"] == [2, 4]


def test_run_dir_leaves_seed_and_run_management_out():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cases = {
            ("+experiment=debug",): "runs/debug/seed0",
            ("+experiment=debug", "seed=2", "resume=true", "device=cpu", "logger=wandb"): (
                "runs/debug/seed2"
            ),
            ("+experiment=debug", "optim.lr=0.1", "loss=tv", "seed=1", "overwrite=true"): (
                "runs/debug/loss=tv,optim.lr=0.1/seed1"
            ),
        }
        for overrides, want in cases.items():
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            assert str(Path(cfg.run_dir)) == want, overrides
            assert cfg.hydra.sweep.subdir == "."  # Hydra creates no directory per job


def test_compare_table_matches_run_summaries(sweep, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare.py"), str(sweep), "--out", str(out)],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = (out / "comparison.md").read_text()
    assert table.split("\n", 2)[2] in proc.stdout  # printed too
    rows = _table_rows(table)
    assert sorted(rows) == ["ce", "tv"]  # grouped by loss.name only (loss.labels follows it)
    assert "| loss.name | seeds | τ greedy |" in table and "loss.labels" in table

    for loss, row in rows.items():
        summaries = [
            json.loads((sweep / "debug" / f"loss={loss},{VARIANT}" / f"seed{s}" / "summary.json").read_text())
            for s in (0, 1)
        ]  # fmt: skip
        evals = [s["final_eval"] for s in summaries]
        assert all(e["step"] == 4 for e in evals)
        assert row["seeds"] == "0,1"
        mean, half = _ci95([e["greedy/tau"] for e in evals])
        assert row["τ greedy"] == f"{mean:.3f} ± {half:.3f}"
        mean, half = _ci95([e["speedup"] for e in evals])
        assert row["speedup (greedy)"] == f"{mean:.3f} ± {half:.3f}"
        for i in range(4):
            assert (
                row[f"α_{i + 1}"] == f"{statistics.fmean(e['greedy/alpha'][i] for e in evals):.3f}"
            )
        mean, half = _ci95([e["greedy/proxy_tau"] for e in evals])
        assert row["proxy τ"] == f"{mean:.3f} ± {half:.3f}"
        mean, half = _ci95([s["train_s"] for s in summaries])
        assert row["train s"] == f"{mean:.1f} ± {half:.1f}" and row["steps"] == "4"
        assert all(s["train_s"] < s["wall_s"] for s in summaries)  # evaluations left out

        group = next(g for g in json.loads((out / "comparison.json").read_text())["groups"]
                     if g["values"] == {"loss.name": loss})  # fmt: skip
        assert group["tau"]["greedy"]["values"] == [e["greedy/tau"] for e in evals]  # exact
        assert group["train_time_s"]["values"] == [s["train_s"] for s in summaries]

        # Acceptance vs target entropy: the second table, one row per loss (greedy only here).
        entropy = _table_rows(table, 1)[loss]
        records = [e["greedy/entropy_alpha"] for e in evals]
        assert entropy["sampling"] == "greedy" and entropy["seeds"] == "0,1"
        mean, half = _ci95([x["slope"] for x in records])
        assert entropy["slope (per nat)"] == f"{mean:.3f} ± {half:.3f}"
        assert entropy["positions"] == str(sum(sum(x["count"]) for x in records))
        assert sum(records[0]["count"]) > 0
        for i, label in enumerate(bucket_labels(records[0]["edges"])):
            alphas = [x["alpha"][i] for x in records if x["alpha"][i] is not None]
            n = sum(x["count"][i] for x in records)
            want = f"{statistics.fmean(alphas):.3f} (n={n})" if alphas else "–"
            assert entropy[f"α, H ∈ {label}"] == want

    plots = ("tau_vs_step.png", "acceptance_per_position.png", "proxy_vs_measured.png")
    for name in (*plots, "acceptance_vs_entropy.png", "learning_curve.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, name


def test_compare_rejects_unknown_group_field(sweep, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare.py"), str(sweep), "--by", "loss.nme",
         "--out", str(tmp_path)],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "loss.nme" in proc.stderr and "loss.name" in proc.stderr


def test_t_quantile_matches_scipy():
    for df in [*range(1, 41), 60, 100, 1000]:
        assert t_quantile_975(df) == pytest.approx(scipy_stats.t.ppf(0.975, df), abs=2e-5)
    with pytest.raises(ValueError, match="two or more runs"):
        t_quantile_975(0)


def _fake_run(
    root: Path,
    loss: str,
    seed: int,
    tau: float,
    wall: float,
    alpha: list,
    entropy: dict | None = None,
) -> Path:
    d = root / f"{loss}-{seed}"
    d.mkdir(parents=True)
    cfg = {
        "name": f"exp_{loss}", "seed": seed, "run_dir": str(d), "device": "cpu",
        "draft": {"kind": "eagle", "model": {"seed": seed, "ttt_steps": 3}},
        "loss": {"name": loss, "temperature": 1.0, **({"labels": "target"} if loss == "ce" else {})},
        "data": {"source": "embedded", "seed": 0, "cache_dir": f"/tmp/c{seed}"},
        "decode": {"k": 3, "temperatures": [0.0, 0.7]},
        "logger": {"kind": "wandb", "project": f"p{seed}"},
    }  # fmt: skip
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    ev = {"greedy/tau": tau, "greedy/alpha": alpha, "greedy/speedup": tau / 2,
          "greedy/proxy_tau": tau + 0.5, "T0.7/tau": tau - 0.2, "T0.7/alpha": [0.5, 0.4, 0.3],
          "tau": tau, "speedup": tau / 2, "step": 10}  # fmt: skip
    ev.update({f"{tag}/entropy_alpha": rec for tag, rec in (entropy or {}).items()})
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "eval", **ev}) + "\n")
    summary = {"wall_s": wall, "steps": 10, "final_eval": ev, "final_train": {"loss": 1.0}}
    (d / "summary.json").write_text(json.dumps(summary))
    return d


def test_grouping_and_interval_on_synthetic_runs(tmp_path):
    for seed, (tau, wall) in enumerate([(2.0, 10.0), (2.5, 12.0), (3.0, 14.0)]):
        _fake_run(tmp_path, "kl", seed, tau, wall, [0.9, 0.8, None])
    _fake_run(tmp_path, "tv", 0, 3.2, 9.0, [0.95, 0.9, 0.85])
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.yaml").write_text("seed: 0\n")  # no summary.json: skipped
    runs = find_runs([tmp_path])
    assert len(runs) == 4
    # seeds, draft.model.seed (= seed), logger, data.cache_dir and run_dir never group;
    # name and loss.labels follow loss.name.
    assert group_keys(runs) == ["loss.name"]
    kl, tv = group_runs(runs)
    assert kl.values == {"loss.name": "kl"} and [r.seed for r in kl.runs] == [0, 1, 2]
    s = summarize_group(kl)
    assert s["headline"] == "greedy" and list(s["tau"]) == ["greedy", "T0.7"]
    assert s["tau"]["greedy"]["mean"] == pytest.approx(2.5)
    assert s["tau"]["greedy"]["ci95"] == pytest.approx(4.302653 * 0.5 / math.sqrt(3), rel=1e-6)
    assert s["alpha"][:2] == pytest.approx([0.9, 0.8])
    assert s["alpha"][2] is None  # position never reached: no number, not 0
    rows = _table_rows(markdown_table([kl, tv], ["loss.name"]))
    assert rows["kl"]["τ greedy"] == "2.500 ± 1.242" and rows["kl"]["τ T0.7"] == "2.300 ± 1.242"
    assert rows["kl"]["wall s"] == "12.0 ± 5.0" and rows["kl"]["α_3"] == "–"  # no train_s
    assert "train s" not in rows["kl"] and s["train_time_s"]["mean"] is None
    assert rows["tv"]["τ greedy"] == "3.200" and rows["tv"]["seeds"] == "0"  # one run: no ±
    assert mean_ci([1.0]) == {"mean": 1.0, "ci95": None, "n": 1, "values": [1.0]}
    with pytest.raises(FileNotFoundError, match="summary.json"):
        load_run(tmp_path / "unfinished")


EDGES = [0.0, 0.5, 1.0, 2.0, 3.0, 4.0, None]


def _entropy_record(slope: float, alpha: list, count: list) -> dict:
    return {"edges": EDGES, "count": count, "alpha": alpha, "slope": slope, "intercept": 0.9}


def test_entropy_table_and_plot_on_synthetic_runs(tmp_path):
    """Slope ± t-interval over seeds, bucket means over seeds with pooled counts, per group
    and temperature; a run evaluated before the measurement existed adds nothing; the plot has
    a panel per temperature and a line per group."""
    count = [3, 2, 1, 0, 0, 4]
    for seed, slope in enumerate([-0.2, -0.1, -0.3]):
        alpha = [0.9 - 0.1 * seed, 0.6, 0.5, None, None, 0.1 * seed]
        greedy = _entropy_record(slope, alpha, count)
        sampled = _entropy_record(slope / 2, [0.8, 0.7, 0.6, None, None, 0.3], count)
        _fake_run(tmp_path, "kl", seed, 2.0, 10.0, [0.9], {"greedy": greedy, "T0.7": sampled})
    _fake_run(
        tmp_path, "tv", 0, 3.0, 9.0, [0.9], {"greedy": _entropy_record(-0.5, [1.0] * 6, count)}
    )
    _fake_run(tmp_path, "tv", 1, 3.0, 9.0, [0.9])  # evaluated before entropy_alpha existed
    groups = group_runs(find_runs([tmp_path]))
    md = entropy_table(groups, ["loss.name"])
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    assert [(r["loss.name"], r["sampling"], r["seeds"]) for r in rows] == [
        ("kl", "greedy", "0,1,2"), ("kl", "T0.7", "0,1,2"), ("tv", "greedy", "0"),
    ]  # fmt: skip
    kl, kl_t, tv = rows
    mean, half = _ci95([-0.2, -0.1, -0.3])
    assert kl["slope (per nat)"] == f"{mean:.3f} ± {half:.3f}" == "-0.200 ± 0.248"
    assert kl["intercept"] == "0.900 ± 0.000" and kl["positions"] == str(3 * sum(count))
    assert kl["α, H ∈ [0, 0.5)"] == "0.800 (n=9)" and kl["α, H ∈ [4, ∞)"] == "0.100 (n=12)"
    assert kl["α, H ∈ [2, 3)"] == "–"  # an empty bucket: no number, not 0
    assert kl_t["slope (per nat)"] == "-0.100 ± 0.124" and kl_t["α, H ∈ [4, ∞)"] == "0.300 (n=12)"
    assert tv["slope (per nat)"] == "-0.500" and tv["positions"] == str(sum(count))  # one run
    assert "nats" in md and "Σ min(p, q)" in md

    fig = plot_acceptance_vs_entropy(groups)
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title().split(" ")[0] for ax in panels] == ["greedy", "T0.7"]
    assert all("nats" in ax.get_xlabel() for ax in panels)
    legend = [t.get_text() for t in panels[0].get_legend().get_texts()]
    assert legend == ["kl: slope -0.200/nat", "tv: slope -0.500/nat"]
    tick_labels = [t.get_text() for t in panels[0].get_xticklabels()]
    assert tick_labels == bucket_labels(EDGES)
    kl_means = [0.8, 0.6, 0.5, 0.1]  # buckets 0, 1, 2, 5 (3 and 4 empty)
    line = panels[0].containers[0].lines[0]  # the first errorbar's data line: group kl
    assert list(line.get_ydata()) == pytest.approx(kl_means)

    # Runs bucketed at other edges cannot share a column.
    odd = _entropy_record(-0.1, [0.5, 0.5], [1, 1])
    odd["edges"] = [0.0, 1.0, None]
    _fake_run(tmp_path / "odd", "ce", 0, 2.0, 9.0, [0.9], {"greedy": odd})
    with pytest.raises(ValueError, match="ENTROPY_EDGES"):
        entropy_table(group_runs(find_runs([tmp_path])), ["loss.name"])
    report = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare.py"), str(tmp_path), "--out", str(report),
         "--by", "loss.name"],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0 and "ENTROPY_EDGES" in proc.stderr
    (tmp_path / "odd" / "ce-0" / "summary.json").unlink()  # back to comparable runs
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "compare.py"), str(tmp_path), "--out", str(report)],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = (report / "comparison.md").read_text()
    assert "## Acceptance vs target entropy" in written and _table_rows(written, 1)["kl"]
    data = (report / "acceptance_vs_entropy.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    group = json.loads((report / "comparison.json").read_text())["groups"][0]
    assert group["entropy_alpha"]["greedy"]["slope"]["values"] == [-0.2, -0.1, -0.3]


def test_wandb_run_settings_and_summary(sweep):
    for d in sorted(p.parent for p in sweep.rglob("summary.json")):
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        ws = wandb_run_settings(cfg)
        loss, seed = cfg["loss"]["name"], cfg["seed"]
        assert ws["group"] == f"debug/loss={loss},{VARIANT}"  # seeds share a group, losses do not
        assert ws["name"] == f"{ws['group']}/seed{seed}"
        assert ws["tags"] == ["draft:draft_lm", f"loss:{loss}", "data:embedded-regen", "exp:debug"]
        summary = json.loads((d / "summary.json").read_text())
        flat = wandb_summary(summary)
        assert set(flat) == set(ws["summary_keys"])
        assert flat["final/greedy/tau"] == summary["final_eval"]["greedy/tau"]
        assert flat["final/greedy/alpha_2"] == summary["final_eval"]["greedy/alpha"][1]
        assert flat["final/train_wall_s"] == summary["wall_s"]
        slope = summary["final_eval"]["greedy/entropy_alpha"]["slope"]
        assert flat["final/greedy/entropy_slope"] == slope and slope is not None
    # A run_dir outside the runs/<name>/<overrides>/seed<N> scheme groups by its fields.
    cfg = {"name": "x", "seed": 3, "run_dir": "/tmp/somewhere", "draft": {"kind": "medusa"},
           "loss": {"name": "tv"}, "data": {"source": "/d/chat.jsonl", "regenerate": False}}  # fmt: skip
    ws = wandb_run_settings(cfg)
    assert (
        ws["group"] == "x/medusa-tv-chat.jsonl-orig"
        and ws["name"] == "x/medusa-tv-chat.jsonl-orig/seed3"
    )


def test_notebook_is_stripped_and_runs_on_the_sweep(sweep, monkeypatch):
    from nbclient import NotebookClient

    path = ROOT / "notebooks" / "acceptance.ipynb"
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), "strip outputs"
    assert "train.report" in code[0].source or "from train import report" in code[0].source
    monkeypatch.setenv("DRAFTLAB_RUNS", str(sweep))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # The kernelspec runs `python`: make it this interpreter (the venv), not a system one.
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()  # fmt: skip
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs)
    assert "4 runs in 2 groups, grouped by ['loss.name']" in text
    tables = [o.data["text/markdown"] for o in outputs if "text/markdown" in o.get("data", {})]
    assert len(tables) == 2 and sorted(_table_rows(tables[0])) == ["ce", "tv"]
    assert "slope (per nat)" in tables[1] and "entropy in nats" in tables[1]  # vs entropy
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 4


def test_learning_curve_plots_each_eval_at_its_training_seconds(tmp_path):
    """A line per temperature at the eval records' train_s: tau left; speedup right against
    the eager AR, and the compiled AR where the evaluation decoded compiled; records from
    before train_s was recorded are left out."""
    d = _fake_run(tmp_path, "kl", 0, 2.0, 10.0, [0.9])
    evals = [{"step": 5, "greedy/tau": 9.9}]  # no train_s: left out
    for step, secs, tau in ((10, 100.0, 1.5), (20, 210.0, 1.8)):
        evals.append({"step": step, "train_s": secs, "greedy/tau": tau, "T1.0/tau": tau - 0.3,
                      "greedy/speedup": 1.1, "greedy/speedup_eager_ar": tau,
                      "greedy/speedup_compiled_ar": tau / 2, "T1.0/speedup": 0.9})  # fmt: skip
    (d / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "eval", **e}) + "\n" for e in evals)
    )
    older = _fake_run(tmp_path / "older", "kl", 0, 2.0, 10.0, [0.9])  # records without train_s
    empty = plot_learning_curve(group_runs(find_runs([older])))
    assert [t.get_text() for t in empty.axes[0].texts] == ["no eval record has train_s"]
    summary = json.loads((older / "summary.json").read_text())  # its last step, 10: the final eval
    (older / "summary.json").write_text(json.dumps({**summary, "train_s": 55.0}))
    final = plot_learning_curve(group_runs(find_runs([older]))).axes[0].lines
    assert [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in final] == [
        ([55.0], [2.0]),
        ([55.0], [1.8]),
    ]
    fig = plot_learning_curve(group_runs(find_runs([d])))
    ax_tau, ax_speed = fig.axes
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax_tau.lines}
    assert lines == {
        "all runs greedy decoded": ([100.0, 210.0], [1.5, 1.8]),
        "all runs T1.0 decoded": ([100.0, 210.0], [1.2, 1.5]),
    }
    speed = {
        ln.get_label(): list(ln.get_ydata()) for ln in ax_speed.lines if ln.get_label()[0] != "_"
    }
    assert speed == {"all runs greedy vs eager AR": [1.5, 1.8], "all runs greedy vs compiled AR": [0.75, 0.9],
                     "all runs T1.0 vs eager AR": [0.9, 0.9]}  # fmt: skip
