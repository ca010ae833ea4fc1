"""Compare finished training runs: a markdown table and PNG plots, read from run directories.

    python scripts/compare.py runs/eagle_tv --out reports/eagle_tv
    python scripts/compare.py 'runs/eagle_*/**' runs/distill_kl --out reports/all
    python scripts/compare.py runs/eagle_tv --by loss.name --out reports/by_loss

Writes <out>/comparison.md (also printed), comparison.json, tau_vs_step.png,
acceptance_per_position.png and proxy_vs_measured.png. No network: only the run
directories' config.yaml, summary.json and metrics.jsonl are read. The logic lives in
train/report.py (shared with notebooks/acceptance.ipynb); docs/compare.md explains it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from train.report import find_runs, group_keys, write_report  # noqa: E402


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

    runs = find_runs(args.paths)
    keys = args.by.split(",") if args.by else None
    if keys:
        unknown = [k for k in keys if all(k not in r.flat for r in runs)]
        if unknown:
            raise SystemExit(
                f"--by {','.join(unknown)}: no run has this config field; fields that differ "
                f"here: {group_keys(runs) or 'none'} (dotted paths into config.yaml)"
            )
    report = write_report(runs, args.out, keys)
    print(report["table"])
    print(f"{len(runs)} runs in {len(report['groups'])} groups -> {args.out}/")
    for f in report["files"]:
        print(f"  {f}")


if __name__ == "__main__":
    main()
