"""Compare training runs: load run directories, group them, aggregate over seeds, plot.

Shared by scripts/compare.py (markdown + PNGs) and notebooks/acceptance.ipynb (same plots,
interactive), so the numbers agree everywhere; train/tracking.py names W&B runs the same way.
No network: everything is read from run directories written by train/loop.py:

    <run_dir>/config.yaml      resolved config
    <run_dir>/metrics.jsonl    one JSON per line, kind = train | eval
    <run_dir>/summary.json     final train record, final eval, tau curve, wall time

Grouping: runs are grouped by the config fields whose values differ between them, seeds
and run management (run_dir, resume, device, logger, ...) excepted; a field whose values
follow from fields already chosen (loss.labels follows loss.name) is left out. Within a
group, tau and speedup are the mean over runs (seeds) with a 95% Student t-interval
(mean +- t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation).

The headline tag of an evaluation is "greedy" when temperature 0 was evaluated, otherwise
the first temperature ("T0.7"), as in train/evaluate.py: `tau` and `speedup` of an eval
record are that tag's values.
"""

from __future__ import annotations

import glob
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

# Config fields that never define a group: where a run is, how it is logged or resumed.
RUN_MANAGEMENT = ("seed", "name", "run_dir", "resume", "overwrite", "device", "logger.")
IGNORED_SUFFIXES = (".device", ".cache_dir", ".progress")
# Fields tried first when choosing group keys, so the familiar names win over their aliases.
PRIORITY = ("draft.kind", "loss.name", "data.source", "data.regenerate")

# t_{0.975, df} for df = 1..30 (two-sided 95%); larger df use a Cornish-Fisher expansion.
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)  # fmt: skip


@dataclass
class Run:
    path: Path
    config: dict
    summary: dict
    records: list[dict]
    flat: dict[str, Any] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        return int(self.config.get("seed", 0))

    @property
    def evals(self) -> list[dict]:
        return [r for r in self.records if r.get("kind") == "eval"]

    @property
    def final_eval(self) -> dict:
        return self.summary.get("final_eval") or {}


@dataclass
class Group:
    values: dict[str, Any]  # group key -> value shared by its runs
    runs: list[Run]

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.values.items()) or "all runs"


# -- loading --------------------------------------------------------------------------


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists become tuples (hashable, comparable)."""
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(node, list):
        return {prefix[:-1]: tuple(node)}
    return {prefix[:-1]: node}


def load_run(path: str | Path) -> Run:
    """One run directory -> Run (config.yaml, summary.json, metrics.jsonl)."""
    path = Path(path)
    missing = [n for n in ("config.yaml", "summary.json") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a finished run directory: {', '.join(missing)} missing "
            "(train/loop.py writes summary.json when a run ends; point at finished runs)"
        )
    config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=False)
    summary = json.loads((path / "summary.json").read_text())
    metrics = path / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records = [json.loads(x) for x in lines if x.strip()]
    return Run(path, config, summary, records, flatten(config))


def find_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Run directories from paths or globs; a directory that is not a run is searched
    recursively for finished runs (a summary.json beside a config.yaml)."""
    dirs: list[Path] = []
    for item in paths:
        matches = sorted(glob.glob(str(item), recursive=True)) or [str(item)]
        for m in map(Path, matches):
            if (m / "summary.json").is_file():
                dirs.append(m)
            elif m.is_dir():
                found = (p.parent for p in m.rglob("summary.json"))
                dirs += sorted(d for d in found if (d / "config.yaml").is_file())
            else:
                raise FileNotFoundError(
                    f"{m} does not exist; pass run directories or a glob such as 'runs/eagle_tv/**'"
                )
    unique = list(dict.fromkeys(d.resolve() for d in dirs))
    if not unique:
        raise FileNotFoundError(
            f"no finished run (summary.json + config.yaml) under {list(map(str, paths))}"
        )
    return [load_run(d) for d in unique]


# -- grouping -------------------------------------------------------------------------


def _ignored(key: str, runs: list[Run]) -> bool:
    if key == "seed" or key.startswith(RUN_MANAGEMENT) or key.endswith(IGNORED_SUFFIXES):
        return True
    # A nested seed that follows the run's seed (draft.model.seed: ${seed}) is a seed too;
    # data.seed (fixed, chooses the held-out prompts) is not.
    return key.endswith(".seed") and all(r.flat.get(key) == r.seed for r in runs)


def differing_keys(runs: list[Run]) -> list[str]:
    """Config fields whose values differ between runs (seeds, run management excepted),
    the PRIORITY fields first."""
    keys = sorted(set().union(*(r.flat for r in runs)))
    keys = [
        k for k in keys if not _ignored(k, runs) and len({repr(r.flat.get(k)) for r in runs}) > 1
    ]
    return sorted(keys, key=lambda k: (PRIORITY.index(k) if k in PRIORITY else len(PRIORITY), k))


def group_keys(runs: list[Run]) -> list[str]:
    """The differing fields that each refine the grouping made by the fields before them
    (loss.labels, present for ce only, follows loss.name and is left out)."""
    chosen: list[str] = []
    n_groups = 1
    for key in differing_keys(runs):
        n = len({tuple(repr(r.flat.get(k)) for k in (*chosen, key)) for r in runs})
        if n > n_groups:  # the field splits a group further: keep it
            chosen.append(key)
            n_groups = n
    return chosen


def group_runs(runs: list[Run], keys: list[str] | None = None) -> list[Group]:
    """Runs sharing the values of `keys` (default: group_keys(runs)), sorted by value."""
    keys = group_keys(runs) if keys is None else keys
    groups: dict[tuple, Group] = {}
    for run in sorted(runs, key=lambda r: str(r.path)):
        values = {k: run.flat.get(k) for k in keys}
        groups.setdefault(tuple(repr(v) for v in values.values()), Group(values, [])).runs.append(
            run
        )
    for g in groups.values():
        g.runs.sort(key=lambda r: (r.seed, str(r.path)))
    return [groups[k] for k in sorted(groups, key=lambda t: [str(x) for x in t])]


# -- statistics -----------------------------------------------------------------------


def t_quantile_975(df: int) -> float:
    """Two-sided 95% Student t critical value t_{0.975, df}."""
    if df < 1:
        raise ValueError(f"a t-interval needs df >= 1 (two or more runs), got df={df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    z2 = z * z
    return z * (1 + (z2 + 1) / (4 * df) + (5 * z2**2 + 16 * z2 + 3) / (96 * df**2)
                + (3 * z2**3 + 19 * z2**2 + 17 * z2 - 15) / (384 * df**3))  # fmt: skip


def mean_ci(values: list[float]) -> dict:
    """Mean and half-width of the 95% t-interval (None for a single value)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "ci95": None, "n": 0, "values": []}
    mean = statistics.fmean(vals)
    ci = (
        t_quantile_975(len(vals) - 1) * statistics.stdev(vals) / math.sqrt(len(vals))
        if len(vals) > 1
        else None
    )
    return {"mean": mean, "ci95": ci, "n": len(vals), "values": vals}


def eval_tags(record: dict) -> list[str]:
    """Temperature tags of an eval record in evaluation order, the headline tag first."""
    tags = [k[: -len("/tau")] for k in record if k.endswith("/tau") and k != "tau"]
    return sorted(tags, key=lambda t: t != "greedy")


def _mean_list(lists: list[list]) -> list[float | None]:
    """Element-wise mean of per-position lists of possibly different lengths (None skipped)."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        vals = [x[i] for x in lists if i < len(x) and x[i] is not None]
        out.append(statistics.fmean(vals) if vals else None)
    return out


def summarize_group(group: Group) -> dict:
    """JSON-able aggregate of a group: tau per tag and speedup (mean, CI), per-position
    acceptance and proxy tau at the headline tag, training time."""
    evals = [r.final_eval for r in group.runs]
    tags = eval_tags(evals[0]) if evals and evals[0] else []
    head = tags[0] if tags else None
    return {
        "values": group.values,
        "runs": [str(r.path) for r in group.runs],
        "seeds": [r.seed for r in group.runs],
        "headline": head,
        "tau": {t: mean_ci([e.get(f"{t}/tau") for e in evals]) for t in tags},
        "speedup": mean_ci([e.get("speedup") for e in evals]),
        "alpha": _mean_list([e.get(f"{head}/alpha") or [] for e in evals]),
        "proxy_tau": mean_ci([e.get(f"{head}/proxy_tau") for e in evals]),
        # train_s: steps (+ rollouts) only; wall_s: the whole loop, evaluations included.
        # Runs written before train_s existed have wall_s alone (their train_time_s: None).
        "train_time_s": mean_ci([r.summary.get("train_s") for r in group.runs]),
        "wall_time_s": mean_ci([r.summary.get("wall_s") for r in group.runs]),
        "steps": sorted({r.summary.get("steps") for r in group.runs}, key=str),
    }


# -- the markdown table ---------------------------------------------------------------


def _fmt(stat: dict, digits: int = 3) -> str:
    if stat["mean"] is None:
        return "–"
    if stat["ci95"] is None:
        return f"{stat['mean']:.{digits}f}"
    return f"{stat['mean']:.{digits}f} ± {stat['ci95']:.{digits}f}"


def markdown_table(groups: list[Group], keys: list[str] | None = None) -> str:
    """One row per group: differing config fields, seeds, tau per temperature and speedup
    (mean ± 95% t-interval over seeds), per-position acceptance, proxy tau, train time."""
    keys = list(groups[0].values) if keys is None and groups else (keys or [])
    stats = [summarize_group(g) for g in groups]
    tags = list(dict.fromkeys(t for s in stats for t in s["tau"]))
    k = max((len(s["alpha"]) for s in stats), default=0)
    head_tag = stats[0]["headline"] if stats else None
    header = [*(keys or ["runs"]), "seeds"]
    header += [f"τ {t}" for t in tags] + [f"speedup ({head_tag})"]
    # One time column measured the same way for every row: train_s if every run has it.
    by_train = all(r.summary.get("train_s") is not None for g in groups for r in g.runs)
    time_col = "train_time_s" if by_train else "wall_time_s"
    header += [f"α_{i + 1}" for i in range(k)] + ["proxy τ", "steps"]
    header.append("train s" if by_train else "wall s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g, s in zip(groups, stats):
        cells = [str(v) for v in g.values.values()] or ["all"]
        cells.append(",".join(map(str, s["seeds"])))
        cells += [_fmt(s["tau"][t]) if t in s["tau"] else "–" for t in tags]
        cells.append(_fmt(s["speedup"]))
        cells += [
            "–" if i >= len(s["alpha"]) or s["alpha"][i] is None else f"{s['alpha'][i]:.3f}"
            for i in range(k)
        ]
        steps = [x for x in s["steps"] if x is not None]
        lo, hi = (min(steps), max(steps)) if steps else (None, None)
        steps_cell = "–" if lo is None else str(lo) if lo == hi else f"{lo}–{hi}"
        cells += [_fmt(s["proxy_tau"]), steps_cell, _fmt(s[time_col], 1)]
        lines.append("| " + " | ".join(cells) + " |")
    notes = (
        "\nτ = tokens per target verify forward, bonus included (docs/design.md §3), from each "
        "run's final evaluation; mean ± half-width of the 95% Student t-interval over the "
        "group's runs (seeds), no ± for a single run. speedup = speculative / AR tokens/s on "
        "the same prompts in the same process (decoding/metrics.py) at "
        f"the headline temperature ({head_tag}); α_i = per-position conditional acceptance "
        "and proxy τ = the training proxy's prediction, both at that temperature (means). "
        "steps = optimizer steps run (a range when a time budget stopped the seeds at "
        "different steps); "
        + (
            "train s = training time (steps and replay rollouts, without checkpoints and "
            "evaluations)."
            if by_train
            else "wall s = wall time of the training loop including checkpoint evaluations "
            "(some runs predate the train-time-only field)."
        )
    )
    runs = [r for g in groups for r in g.runs]
    implied = [k for k in differing_keys(runs) if k not in keys]
    if implied:  # fields that differ too but move in lockstep with the group keys
        notes += f" Also differing, in step with the columns above: {', '.join(implied)}."
    return "\n".join(lines) + "\n" + notes + "\n"


# -- plots ----------------------------------------------------------------------------


def _labels(groups: list[Group]) -> tuple[list[str], str | None]:
    """Legend labels and title: with one group key the labels are its values, the title
    its name."""
    if groups and len(groups[0].values) == 1:
        return [str(next(iter(g.values.values()))) for g in groups], next(iter(groups[0].values))
    return [g.label for g in groups], None


def _finish(fig, ax, title: str | None, xlabel: str, ylabel: str, heading: str):
    ax.set(xlabel=xlabel, ylabel=ylabel, title=heading)
    ax.grid(alpha=0.3)
    ax.legend(title=title, fontsize=8)
    fig.tight_layout()
    return fig


def plot_tau_vs_step(groups: list[Group]):
    """tau of every checkpoint evaluation against the training step: a thin line per run,
    a thick line for the group mean over runs at the steps they share."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels, title = _labels(groups)
    for i, (g, label) in enumerate(zip(groups, labels)):
        by_step: dict[int, list[float]] = {}
        for run in g.runs:
            pts = [(e["step"], e["tau"]) for e in run.evals if e.get("tau") is not None]
            if pts:
                ax.plot(*zip(*pts), color=f"C{i % 10}", alpha=0.3, lw=0.8, marker=".")
            for step, tau in pts:
                by_step.setdefault(step, []).append(tau)
        steps = sorted(s for s, v in by_step.items() if len(v) == len(g.runs))
        means = [statistics.fmean(by_step[s]) for s in steps]
        style = {"color": f"C{i % 10}", "lw": 2.2, "marker": "o"}
        ax.plot(steps, means, **style, label=f"{label} (n={len(g.runs)})")
    heading = "τ at each checkpoint (thin: runs, thick: mean)"
    return _finish(fig, ax, title, "training step", "τ (tokens / verify forward)", heading)


def plot_acceptance_per_position(groups: list[Group]):
    """Per-position acceptance of the final evaluation, per group (one line per loss in a
    loss sweep), mean over the group's runs with a 95% t-interval. Left: cumulative
    P(drafts 1..i all accepted), whose sum is about τ − 1. Right: conditional α_i, annotated with
    the verify rounds that reached position i (pooled over runs): deep positions rest on
    few rounds, so their α_i is noisy where the cumulative curve is not."""
    import matplotlib.pyplot as plt

    fig, (ax_cum, ax_cond) = plt.subplots(1, 2, figsize=(10.5, 4.2))
    labels, title = _labels(groups)
    head = None
    for i, (g, label) in enumerate(zip(groups, labels)):
        head = eval_tags(g.runs[0].final_eval)[0] if g.runs[0].final_eval else head
        shift = (i - (len(groups) - 1) / 2) * 0.06  # keep the error bars of groups apart
        for ax, key in ((ax_cum, "accept_cumulative"), (ax_cond, "alpha")):
            lists = [r.final_eval.get(f"{head}/{key}") or [] for r in g.runs]
            k = max((len(x) for x in lists), default=0)
            stats = [mean_ci([x[j] for x in lists if j < len(x)]) for j in range(k)]
            shown = [(j + 1, s) for j, s in enumerate(stats) if s["mean"] is not None]
            x = [pos + shift for pos, _ in shown]
            y, err = [s["mean"] for _, s in shown], [s["ci95"] or 0.0 for _, s in shown]
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=f"C{i % 10}", label=label)
        # Rounds reaching position i = rounds that accepted at least i - 1 drafts.
        hists = [r.final_eval.get(f"{head}/accept_hist") or [] for r in g.runs]
        width = max((len(h) for h in hists), default=0)
        pooled = [sum(h[j] for h in hists if j < len(h)) for j in range(width)]
        for pos in range(1, width):
            ax_cond.annotate(
                f"n={sum(pooled[pos - 1 :])}", (pos + 0.08, 0.03 + 0.045 * i),
                color=f"C{i % 10}", fontsize=7,
            )  # fmt: skip
    for ax in (ax_cum, ax_cond):
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    ax_cum.set(
        xlabel="draft position i",
        ylabel="P(drafts 1..i accepted)",
        title="cumulative: τ ≈ 1 + Σ_i",
    )
    ax_cond.set(
        xlabel="draft position i (n: verify rounds that reached i)",
        ylabel="α_i = P(accept i | 1..i−1 accepted)",
        title="conditional",
    )
    ax_cum.legend(title=title, fontsize=8)
    fig.suptitle(f"Per-position acceptance ({head}, final eval, mean ± 95% CI over runs)")
    fig.tight_layout()
    return fig


def plot_proxy_vs_measured(groups: list[Group]):
    """The training proxy's predicted tau against the decoder's measured tau, one point per
    checkpoint evaluation and temperature; on the diagonal the proxy is exact."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 5.0))
    labels, title = _labels(groups)
    markers: dict[str, str] = {}
    lo = hi = 1.0
    for i, (g, label) in enumerate(zip(groups, labels)):
        points: dict[str, list[tuple[float, float]]] = {}  # tag -> [(proxy, measured)]
        for e in (e for run in g.runs for e in run.evals):
            for tag in eval_tags(e):
                if e.get(f"{tag}/proxy_tau") is not None and e.get(f"{tag}/tau") is not None:
                    points.setdefault(tag, []).append((e[f"{tag}/proxy_tau"], e[f"{tag}/tau"]))
        for n, (tag, pts) in enumerate(points.items()):
            marker = markers.setdefault(tag, "o^sDv<>"[len(markers) % 7])
            style = {"color": f"C{i % 10}", "marker": marker, "alpha": 0.75, "s": 28}
            ax.scatter(*zip(*pts), **style, label=label if n == 0 else None)
            lo, hi = min(lo, *(min(p) for p in pts)), max(hi, *(max(p) for p in pts))
    ax.plot([lo, hi + 0.1], [lo, hi + 0.1], color="0.5", ls="--", lw=1, label="proxy = measured")
    heading = (
        "Proxy-predicted vs measured τ (" + ", ".join(f"{m} {t}" for t, m in markers.items()) + ")"
    )
    xlabel = "proxy τ (simulated from training α / top-1)"
    return _finish(fig, ax, title, xlabel, "measured τ (decoder)", heading)


PLOTS = {
    "tau_vs_step.png": plot_tau_vs_step,
    "acceptance_per_position.png": plot_acceptance_per_position,
    "proxy_vs_measured.png": plot_proxy_vs_measured,
}


def write_report(runs: list[Run], out_dir: str | Path, keys: list[str] | None = None) -> dict:
    """comparison.md, comparison.json and the PNGs of PLOTS into out_dir -> the JSON dict."""
    import matplotlib

    matplotlib.use("Agg")  # files only; the notebook keeps its inline backend
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = group_keys(runs) if keys is None else keys
    groups = group_runs(runs, keys)
    table = markdown_table(groups, keys)
    (out / "comparison.md").write_text(f"# Run comparison ({len(runs)} runs)\n\n{table}")
    report = {"group_keys": keys, "groups": [summarize_group(g) for g in groups]}
    (out / "comparison.json").write_text(json.dumps(report, indent=2, default=str))
    for name, plot in PLOTS.items():
        fig = plot(groups)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    return {
        **report,
        "table": table,
        "files": [str(out / n) for n in ("comparison.md", "comparison.json", *PLOTS)],
    }
