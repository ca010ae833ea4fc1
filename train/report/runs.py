"""Finished training runs: load run directories, group them, aggregate over seeds.

Shared by scripts/compare.py (markdown + PNGs) and notebooks/acceptance.ipynb (same table
and plots, interactive), so the numbers agree everywhere; train/report/tracking.py names
W&B runs the same way. No network: everything is read from run directories written by
train/loop.py:

    <run_dir>/config.yaml      resolved config
    <run_dir>/metrics.jsonl    one JSON per line, kind = train | eval
    <run_dir>/summary.json     final train record, final eval, tau curve, wall time

Grouping: runs are grouped by the config fields whose values differ between them, seeds
and run management (run_dir, resume, device, logger, ...) excepted; a field whose values
follow from fields already chosen (loss.labels follows loss.name) is left out. Within a
group, tau and speedup are the mean over runs (seeds) with a 95% Student t-interval
(mean +- t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation).

The headline tag of an evaluation is "greedy" when temperature 0 was evaluated, otherwise
the first temperature ("T0.7"), as in train/eval/evaluate.py: `tau` and `speedup` of an eval
record are that tag's values.

Acceptance against the target's entropy (`<tag>/entropy_alpha`, decoding/entropy.py) is
aggregated per tag (`entropy_summary`): the fitted slope and intercept and each entropy
bucket's acceptance as mean ± 95% t-interval over runs, positions pooled over runs. Runs
evaluated before it existed have no such key and are left out of it.
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

# The keys of held-out proxy records (train/eval/heldout.py), apart from the train records' in W&B
HELDOUT_PREFIX = "heldout/"
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
    summary = read_json(path / "summary.json", (path / "summary.json").read_text())
    metrics = path / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.is_file() else []
    records = [read_json(metrics, x) for x in lines if x.strip()]
    return Run(path, config, summary, records, flatten(config))


def read_json(path: Path, text: str):
    """json.loads, a damaged file named (compare.py prints one line, not a traceback)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is damaged, not JSON ({err}); leave that run out of the paths given"
        ) from None


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


def bucket_labels(edges: list[float | None]) -> list[str]:
    """Entropy bucket edges (None = infinity, as eval records write it) -> "[0, 0.5)", ...,
    "[4, ∞)"."""

    def fmt(e: float | None) -> str:
        return "∞" if e is None else f"{e:g}"

    return [f"[{fmt(lo)}, {fmt(hi)})" for lo, hi in zip(edges, edges[1:])]


def entropy_summary(group: Group) -> dict:
    """tag -> acceptance against the target's entropy over the group's final evaluations:
    {edges, runs, count (positions per bucket, pooled over runs), alpha (per bucket), slope,
    intercept (mean_ci over runs each)}. Tags without `<tag>/entropy_alpha` in any run are
    absent."""
    out = {}
    tags = dict.fromkeys(t for r in group.runs for t in eval_tags(r.final_eval))
    for tag in tags:
        recs = [(r, r.final_eval.get(f"{tag}/entropy_alpha")) for r in group.runs]
        recs = [(r, x) for r, x in recs if x]
        if not recs:
            continue
        edges = recs[0][1]["edges"]
        other = [str(r.path) for r, x in recs if x["edges"] != edges]
        if other:
            raise ValueError(
                f"{tag}/entropy_alpha: {recs[0][0].path} buckets the target entropy at {edges} "
                f"but {', '.join(other)} at other edges; compare runs evaluated with the same "
                "decoding/entropy.py ENTROPY_EDGES (re-evaluate with scripts/evaluate.py)"
            )
        n = len(edges) - 1
        out[tag] = {
            "edges": edges,
            "runs": len(recs),
            "count": [sum(x["count"][i] for _, x in recs) for i in range(n)],
            "alpha": [mean_ci([x["alpha"][i] for _, x in recs]) for i in range(n)],
            "slope": mean_ci([x["slope"] for _, x in recs]),
            "intercept": mean_ci([x["intercept"] for _, x in recs]),
        }
    return out


def common_edges(summaries: list[dict]) -> list | None:
    """The entropy bucket edges shared by the `entropy_summary` outputs of several groups
    (None when none has any); different edges cannot share a table column or a plot axis."""
    edges = [e["edges"] for s in summaries for e in s.values()]
    if any(e != edges[0] for e in edges):
        raise ValueError(
            f"groups bucket the target entropy at different edges ({edges[0]} and "
            f"{next(e for e in edges if e != edges[0])}); compare runs evaluated with the same "
            "decoding/entropy.py ENTROPY_EDGES (re-evaluate with scripts/evaluate.py)"
        )
    return edges[0] if edges else None


def _mean_list(lists: list[list]) -> list[float | None]:
    """Element-wise mean of per-position lists of possibly different lengths (None skipped)."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        vals = [x[i] for x in lists if i < len(x) and x[i] is not None]
        out.append(statistics.fmean(vals) if vals else None)
    return out


def summarize_group(group: Group) -> dict:
    """JSON-able aggregate of a group: tau per tag and speedup (mean, CI), per-position
    acceptance and proxy tau at the headline tag, training time, acceptance against the
    target's entropy per tag (`entropy_summary`)."""
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
        "entropy_alpha": entropy_summary(group),
    }
