"""The comparison plots of grouped runs (train/report/runs.py), one figure per function:
tau at each checkpoint, per-position acceptance of the final evaluation, the training
proxy's predicted tau against the measured one, acceptance against the target's entropy, and
the learning curve (tau and speedup against training seconds; compare.py, and every run
with an evaluation or held-out proxy records saves its own: train/run/records.py).
scripts/compare.py saves them as PNGs (`PLOTS`: file name -> function); the notebook shows
the first four inline."""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from train.report.runs import (
    HELDOUT_PREFIX,
    Group,
    bucket_labels,
    common_edges,
    entropy_summary,
    eval_tags,
    load_run,
    mean_ci,
)


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


def plot_acceptance_vs_entropy(groups: list[Group]):
    """Acceptance against the target's entropy H (decoding/entropy.py) in the final
    evaluation: one panel per temperature, one line per group, each bucket's mean acceptance
    over the group's runs with a 95% t-interval, annotated with the judged positions pooled
    over runs; the legend gives each group's fitted slope (mean over runs)."""
    stats = [entropy_summary(g) for g in groups]
    edges = common_edges(stats)
    tags = list(dict.fromkeys(t for s in stats for t in s))
    tags.sort(key=lambda t: t != "greedy")
    fig, axes = plt.subplots(1, max(len(tags), 1), figsize=(1.0 + 4.6 * max(len(tags), 1), 4.4))
    axes = list(axes) if len(tags) > 1 else [axes]
    if edges is None:
        axes[0].text(0.5, 0.5, "no run has entropy_alpha records", ha="center", va="center")
        axes[0].set_axis_off()
        return fig
    labels, title = _labels(groups)
    buckets = bucket_labels(edges)
    for ax, tag in zip(axes, tags):
        for i, (by_tag, label) in enumerate(zip(stats, labels)):
            e = by_tag.get(tag)
            if e is None:
                continue
            shift = (i - (len(groups) - 1) / 2) * 0.06  # keep the error bars of groups apart
            shown = [(j, a) for j, a in enumerate(e["alpha"]) if a["mean"] is not None]
            x = [j + shift for j, _ in shown]
            y, err = [a["mean"] for _, a in shown], [a["ci95"] or 0.0 for _, a in shown]
            slope = e["slope"]["mean"]
            name = label if slope is None else f"{label}: slope {slope:+.3f}/nat"
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, color=f"C{i % 10}", label=name)
            for j, _ in shown:
                ax.annotate(
                    f"n={e['count'][j]}", (j + shift + 0.08, 0.03 + 0.045 * i),
                    color=f"C{i % 10}", fontsize=7,
                )  # fmt: skip
        ax.set_xticks(range(len(buckets)), buckets, rotation=30, fontsize=8)
        ax.set_xlim(-0.4, len(buckets) - 0.3)  # room for the last bucket's n= labels
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        what = "T=1 softmax, acceptance 0/1" if tag == "greedy" else "verifier's p, Σ min(p, q)"
        ax.set(xlabel="target entropy H(p) bucket (nats)", title=f"{tag} (H of the {what})")
        ax.legend(title=title, fontsize=8)
    axes[0].set_ylabel("acceptance (n: judged drafts)")
    fig.suptitle("Acceptance vs target entropy (final eval, mean ± 95% CI over runs)")
    fig.tight_layout()
    return fig


def _proxy_tags(records: list[dict], prefix: str) -> list[str]:
    """The decode samplings a proxy record simulates tau at: `<prefix>sim_tau_greedy` ->
    "greedy", `<prefix>sim_tau_T1` -> "T1" (not the loss temperature's `sim_tau`)."""
    head = prefix + "sim_tau_"
    return list(dict.fromkeys(k[len(head) :] for r in records for k in r if k.startswith(head)))


def plot_learning_curve(groups: list[Group]) -> Figure:
    """The learning curve against training seconds. Left, tau per temperature (greedy solid,
    T > 0 dashed): decoded on the held-out prompts at every evaluated checkpoint (markers,
    eval records' `train_s`; an older run's final evaluation takes the summary's), simulated
    from the held-out proxy at every checkpoint (thin line, `heldout` records:
    train/eval/heldout.py) and from the training rows the draft is fitting (dotted, `train`
    records). Right, the decoded speedup against the eager AR, and against the compiled AR
    (dotted) where the compiled path was the evaluation. A pyplot-free Figure: a training run
    saves it (`save_learning_curve`) without opening a pyplot window or choosing a backend."""
    fig = Figure(figsize=(11.0, 4.6))
    ax_tau, ax_speed = fig.subplots(1, 2)
    labels, title = _labels(groups)
    for i, (g, label) in enumerate(zip(groups, labels)):
        named = False  # the legend names a group's first run with points only
        for run in g.runs:
            evals = [e if "train_s" in e or e.get("step") != run.summary.get("steps")
                     else {**e, "train_s": run.summary.get("train_s")}  # the run's final eval
                     for e in run.evals]  # fmt: skip
            evals = [e for e in evals if e.get("train_s") is not None]
            held = [r for r in run.records if r.get("kind") == "heldout" and "train_s" in r]
            trained = [r for r in run.records if r.get("kind") == "train" and "train_s" in r]
            shown = bool(evals or held)
            name, named = (label if shown and not named else "_"), named or shown
            tags = [*(t for e in evals for t in eval_tags(e)), *_proxy_tags(held, HELDOUT_PREFIX)]
            for tag in sorted(dict.fromkeys(tags), key=lambda t: t != "greedy"):
                style = {"color": f"C{i % 10}", "ls": "-" if tag == "greedy" else "--"}
                for records, prefix, what, extra in (
                    (held, HELDOUT_PREFIX, "held-out proxy", {"lw": 1.2}),
                    (trained, "", "training-rows proxy", {"lw": 0.8, "ls": ":", "alpha": 0.6}),
                ):
                    pts = [r for r in records if r.get(f"{prefix}sim_tau_{tag}") is not None]
                    if pts:
                        ax_tau.plot([r["train_s"] for r in pts],
                                    [r[f"{prefix}sim_tau_{tag}"] for r in pts],
                                    **(style | extra), label=f"{name} {tag} {what}")  # fmt: skip
                pts = [e for e in evals if e.get(f"{tag}/tau") is not None]
                if not pts:
                    continue
                secs = [e["train_s"] for e in pts]
                style |= {"marker": "o" if tag == "greedy" else "s"}
                ax_tau.plot(secs, [e[f"{tag}/tau"] for e in pts], **style, lw=2.2, ms=7,
                            label=f"{name} {tag} decoded")  # fmt: skip
                eager = [e.get(f"{tag}/speedup_eager_ar", e.get(f"{tag}/speedup")) for e in pts]
                ax_speed.plot(secs, eager, **style, label=f"{name} {tag} vs eager AR")
                compiled = [e.get(f"{tag}/speedup_compiled_ar") for e in pts]
                if any(c is not None for c in compiled):
                    style |= {"ls": ":", "marker": "x"}
                    ax_speed.plot(secs, compiled, **style, label=f"{name} {tag} vs compiled AR")
    ax_speed.axhline(1.0, color="0.5", lw=1)
    for ax in (ax_tau, ax_speed):
        ax.grid(alpha=0.3)
        if len(ax.get_legend_handles_labels()[0]):
            ax.legend(title=title, fontsize=7)
        else:  # runs evaluated before eval records carried train_s
            ax.text(0.5, 0.5, "no eval record has train_s", ha="center", transform=ax.transAxes)
        ax.set_xlim(left=0)
    ax_tau.set(xlabel="training seconds", ylabel="τ (tokens / verify forward)",
               title="τ: decoded (markers), simulated (lines)")  # fmt: skip
    ax_speed.set(xlabel="training seconds", ylabel="speedup (AR time / spec time)",
                 title="decoded speedup")  # fmt: skip
    fig.suptitle("Learning curve on the held-out prompts")
    fig.tight_layout()
    return fig


def save_learning_curve(run_dir: str | Path) -> Path:
    """learning_curve.png of one finished run, in its directory (written whole: a temporary
    file renamed)."""
    run = load_run(run_dir)
    fig = plot_learning_curve([Group({"run": str(run.config.get("name", "run"))}, [run])])
    path = Path(run_dir) / "learning_curve.png"
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)
    return path


PLOTS = {
    "tau_vs_step.png": plot_tau_vs_step,
    "acceptance_per_position.png": plot_acceptance_per_position,
    "proxy_vs_measured.png": plot_proxy_vs_measured,
    "acceptance_vs_entropy.png": plot_acceptance_vs_entropy,
    "learning_curve.png": plot_learning_curve,
}
