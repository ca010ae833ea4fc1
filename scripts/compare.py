"""Compare finished training runs: a markdown table and PNG plots, read from run directories.

    python scripts/compare.py runs/eagle_tv --out reports/eagle_tv
    python scripts/compare.py 'runs/eagle_*/**' runs/distill_kl --out reports/all
    python scripts/compare.py runs/eagle_tv --by loss.name --out reports/by_loss

Writes <out>/comparison.md (also printed: the run table, then acceptance against the
target's entropy per temperature), comparison.json, tau_vs_step.png,
acceptance_per_position.png, proxy_vs_measured.png and acceptance_vs_entropy.png. No
network: only the run directories' config.yaml, summary.json and metrics.jsonl are read.
The grouping, the statistics, the tables and the plots live in train/report/ (shared with
notebooks/acceptance.ipynb); docs/compare.md explains them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only (before pyplot loads); the notebook keeps its inline backend
import matplotlib.pyplot as plt  # noqa: E402

from train.report.plots import PLOTS  # noqa: E402
from train.report.runs import Run, find_runs, group_keys, group_runs, summarize_group  # noqa: E402
from train.report.tables import entropy_table, markdown_table  # noqa: E402


def write_report(runs: list[Run], out_dir: str | Path, keys: list[str] | None = None) -> dict:
    """comparison.md, comparison.json and the PNGs of PLOTS into out_dir -> the JSON dict."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = group_keys(runs) if keys is None else keys
    groups = group_runs(runs, keys)
    table = markdown_table(groups, keys)
    table += "\n## Acceptance vs target entropy\n\n" + entropy_table(groups, keys)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="run directories, parents of runs, or globs")
    parser.add_argument("--out", default="reports/compare", help="output directory")
    parser.add_argument(
        "--by",
        default=None,
        help="comma-separated config fields to group by (default: the fields that differ)",
    )
    args = parser.parse_args(argv)

    out = Path(args.out)  # where the report goes, checked before any run is read
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file; give a directory for the report")
    above = next(p for p in out.parents if p.exists())
    if not above.is_dir():
        raise ValueError(f"--out {out}: {above} is a file, not a directory")
    runs = find_runs(args.paths)
    keys = args.by.split(",") if args.by else None
    if keys:
        unknown = [k for k in keys if all(k not in r.flat for r in runs)]
        if unknown:
            raise ValueError(
                f"--by {','.join(unknown)}: no run has this config field; fields that differ "
                f"here: {group_keys(runs) or 'none'} (dotted paths into config.yaml)"
            )
    report = write_report(runs, args.out, keys)
    print(report["table"])
    print(f"{len(runs)} runs in {len(report['groups'])} groups -> {args.out}/")
    for f in report["files"]:
        print(f"  {f}")


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as err:  # a refusal: one line, no traceback
        sys.exit(f"compare.py: error: {err}")
