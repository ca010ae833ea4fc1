"""The markdown comparison tables of grouped runs (train/report/runs.py): tau per temperature
and speedup as mean ± 95% t-interval over seeds, per-position acceptance, proxy tau, time
(`markdown_table`); acceptance against the target's entropy per temperature
(`entropy_table`)."""

from __future__ import annotations

from train.report.runs import (
    Group,
    bucket_labels,
    common_edges,
    differing_keys,
    entropy_summary,
    summarize_group,
)


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


def entropy_table(groups: list[Group], keys: list[str] | None = None) -> str:
    """One row per group and temperature: the slope and intercept of acceptance on the
    target's entropy (mean ± 95% t-interval over seeds), the judged positions, and the mean
    acceptance of every entropy bucket with its positions pooled over seeds."""
    keys = list(groups[0].values) if keys is None and groups else (keys or [])
    stats = [entropy_summary(g) for g in groups]
    edges = common_edges(stats)
    if edges is None:
        return (
            "No final evaluation has `<tag>/entropy_alpha` (runs evaluated before acceptance "
            "against target entropy was measured; re-evaluate with scripts/evaluate.py).\n"
        )
    labels = bucket_labels(edges)
    header = [*(keys or ["runs"]), "sampling", "seeds", "slope (per nat)", "intercept"]
    header += ["positions", *(f"α, H ∈ {b}" for b in labels)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g, by_tag in zip(groups, stats):
        for tag, e in by_tag.items():
            cells = [str(v) for v in g.values.values()] or ["all"]
            seeds = [r.seed for r in g.runs if r.final_eval.get(f"{tag}/entropy_alpha")]
            cells += [tag, ",".join(map(str, seeds)), _fmt(e["slope"]), _fmt(e["intercept"])]
            cells.append(str(sum(e["count"])))
            cells += [
                "–" if a["mean"] is None else f"{a['mean']:.3f} (n={n})"
                for a, n in zip(e["alpha"], e["count"])
            ]
            lines.append("| " + " | ".join(cells) + " |")
    notes = (
        "\nAt every draft the verifier judged in each run's final evaluation (the accepted ones "
        "and the first rejection of each round), H = entropy in nats of the target's "
        "distribution there (greedy: the T=1 softmax; T > 0: the verifier's p after "
        "temperature / top-k / top-p) and the acceptance there (greedy: 1 if the draft is the "
        "target's argmax; T > 0: the expected acceptance Σ min(p, q); tree decoding: one "
        "position per depth of the accepted path, acceptance = P(one of its children is "
        "accepted)); docs/design.md §3. slope, intercept = least-squares line "
        "acceptance ≈ intercept + slope · H per run, mean ± half-width of the 95% Student "
        "t-interval over the group's seeds (no ± for one run). α per bucket = mean over seeds "
        "of each run's mean acceptance in that bucket; n = positions pooled over seeds. "
        "positions = all judged positions pooled over seeds.\n"
    )
    return "\n".join(lines) + "\n" + notes
