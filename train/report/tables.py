"""The markdown comparison table of grouped runs (train/report/runs.py): tau per temperature
and speedup as mean ± 95% t-interval over seeds, per-position acceptance, proxy tau, time."""

from __future__ import annotations

from train.report.runs import Group, differing_keys, summarize_group


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
