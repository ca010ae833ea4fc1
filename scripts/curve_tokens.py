"""Held-out acceptance against unique training tokens: the curve of the small-target recipe.

    python scripts/curve_tokens.py --steps 300 --seeds 0 1 \
        --points regen:0 raw:180 raw:680 raw:2400 reference:700 --out docs/reports/curve
    python scripts/curve_tokens.py --passes 1 --seeds 0 1 --pack DIR \
        --points pack:28000 pack:100000 pack:300000 pack:1000000 --out docs/reports/curve_pack

Every point is one `train.py +experiment=eagle_tv` run at a FIXED step budget (no time
budget, no decode evaluation: the held-out proxy of train/eval/heldout.py measures it, and a
step count does not depend on the machine's load): the recipe's regenerated answers plus
N rows of one more stream, `raw` (data.num_raw_chunks: chunks of stdlib modules and play
scenes, labelled by the target itself under KL / TV losses), `reference` (data.num_reference:
the corpus's own answers) or `regen` (N more regenerated answers: data.num_train = 256 + N);
or target-written rows alone, from a pack (train/data/pack.py, `--pack`): `pack` (its N first
answer tokens, data.pack_tokens, both sources), `packself` / `packpool` (one source alone).
`--passes P` replaces the fixed step budget: each point trains the steps P passes over its
own rows take (rows / train.batch_size of the recipe), so a larger point trains longer.
The x axis is what the run actually trained on, `data_stats.trained_tokens` (the pool of
unique label tokens), the y axes the held-out first-position acceptance, top-1 agreement
(greedy) and sum min(p, q) at T = 1. Extra `KEY=VALUE` arguments after `--` go to every run.

Runs go to <--runs, default runs/curve>/<stream>_<N>_s<steps>/seed<S>; a point whose
summary.json exists is read, not run again, so an interrupted curve resumes. Writes
<out>/curve.json and <out>/curve.png.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402

from train.data.pack import resolve_pack  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STREAM_KEYS = {
    "regen": "data.num_train",
    "raw": "data.num_raw_chunks",
    "reference": "data.num_reference",
    "pack": "data.pack_tokens",
    "packself": "data.pack_tokens",
    "packpool": "data.pack_tokens",
}
PACK_SOURCES = {"pack": "[self,pool]", "packself": "[self]", "packpool": "[pool]"}
BASE_TRAIN = 256  # the recipe's regenerated answers (conf/data/default.yaml: num_train)


def parse_point(text: str) -> tuple[str, int]:
    stream, _, n = text.partition(":")
    if stream not in STREAM_KEYS or not n.isdigit():
        raise ValueError(
            f"--points {text!r}: expected STREAM:N with STREAM one of {sorted(STREAM_KEYS)}"
        )
    return stream, int(n)


def pack_rows(pack: Path, stream: str, tokens: int) -> int:
    """How many rows a run with data.pack_tokens=`tokens` of `stream`'s sources trains."""
    sources = PACK_SOURCES[stream].strip("[]").split(",")
    rows = seen = 0
    with gzip.open(pack / "conversations.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            if row["source"] in sources and seen < tokens:
                rows, seen = rows + 1, seen + len(row["answer_ids"])
    return rows


def run_point(stream: str, n: int, steps: int, seed: int, runs: Path, extra: list[str],
              pack: Path | None = None) -> dict:  # fmt: skip
    """One run (or its existing summary): the held-out proxy at the end and the data's size."""
    run_dir = runs / f"{stream}_{n}_s{steps}" / f"seed{seed}"
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        value = BASE_TRAIN + n if stream == "regen" else n
        overrides = [
            "+experiment=eagle_tv", "logger=none", f"seed={seed}", f"run_dir={run_dir}",
            "train.time_budget_s=null", f"train.steps={steps}", "train.eval_at_ckpt=false",
            "train.feature_cache=false", f"{STREAM_KEYS[stream]}={value}", *extra,
        ]  # fmt: skip
        if stream in PACK_SOURCES:
            overrides += [f"data.pack={pack}", "data.num_train=0",
                          f"data.pack_sources={PACK_SOURCES[stream]}"]  # fmt: skip
        elif stream != "regen":
            overrides.append(f"data.num_train={BASE_TRAIN}")
        print(f"[curve] {stream}:{n} seed {seed}: train.py {' '.join(overrides)}", flush=True)
        started = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], check=True, cwd=ROOT)
        print(f"[curve] {stream}:{n} seed {seed} done in {time.perf_counter() - started:.0f} s")
    summary = json.loads(summary_path.read_text())
    held = summary["final_heldout"]
    if held is None:
        raise ValueError(f"{summary_path}: no held-out proxy record (train.heldout_proxy=false?)")
    stats = summary["data_stats"]
    return {
        "stream": stream, "n": n, "seed": seed, "steps": summary["steps"],
        "trained_tokens": stats["trained_tokens"], "train_rows": stats["train_rows"],
        "streams": stats.get("streams"),
        "top1_1": held["heldout/top1"][0], "alpha_T1_1": held["heldout/alpha_T1"][0],
        "sim_tau_greedy": held["heldout/sim_tau_greedy"], "sim_tau_T1": held["heldout/sim_tau_T1"],
        "oov_share": held["heldout/oov_share"], "train_s": summary["train_s"],
        "run_dir": str(run_dir),
    } | ({"val_top1_1": held["val/top1"][0], "val_alpha_T1_1": held["val/alpha_T1"][0]}
         if "val/top1" in held else {})  # fmt: skip


def plot(points: list[dict], budget: str, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key, title in (
        (axes[0], "top1_1", "greedy: top-1 agreement, 1st draft"),
        (axes[1], "alpha_T1_1", "T = 1: Σ min(p, q), 1st draft"),
    ):
        for stream in dict.fromkeys(p["stream"] for p in points):
            mine = sorted(
                (p for p in points if p["stream"] == stream), key=lambda p: p["trained_tokens"]
            )
            xs = sorted({p["trained_tokens"] for p in mine})
            means = [statistics.mean(p[key] for p in mine if p["trained_tokens"] == x) for x in xs]
            label = f"pack: {PACK_SOURCES[stream]}" if stream in PACK_SOURCES else (
                f"256 regenerated + {stream}")  # fmt: skip
            line = ax.plot(xs, means, marker="o", label=label)[0]
            ax.scatter([p["trained_tokens"] for p in mine], [p[key] for p in mine], s=12,
                       color=line.get_color(), alpha=0.5)  # fmt: skip
        ax.set_xscale("log")
        ax.set(xlabel="unique trained tokens (data_stats.trained_tokens)", title=title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"held-out acceptance after {budget}")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "EAGLE-3 head on SmolLM2-135M: held-out acceptance against unique tokens", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--passes",
        type=float,
        default=None,
        help="instead of --steps: the steps this many passes over a point's rows take",
    )
    parser.add_argument("--pack", type=Path, default=None, help="the pack of pack* points")
    parser.add_argument("--batch-size", type=int, default=4, help="the recipe's train.batch_size")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--points", nargs="+", default=["regen:0", "raw:180", "raw:680", "raw:2400"]
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "reports" / "curve")
    parser.add_argument(
        "--runs", type=Path, default=ROOT / "runs" / "curve", help="run directories"
    )
    parser.add_argument("extra", nargs="*", help="KEY=VALUE overrides for every run (after --)")
    args = parser.parse_args(argv)
    todo = [parse_point(p) for p in args.points]  # all refused before the first run
    if args.passes is not None and any(s not in PACK_SOURCES for s, _ in todo):
        parser.error("--passes counts a pack's rows: pack / packself / packpool points only")
    if any(s in PACK_SOURCES for s, _ in todo):
        args.pack = resolve_pack(str(args.pack) if args.pack else "builtin")

    def steps_of(stream: str, n: int) -> int:
        if args.passes is None:
            return args.steps
        return max(1, math.ceil(args.passes * pack_rows(args.pack, stream, n) / args.batch_size))

    points = [
        run_point(s, n, steps_of(s, n), seed, args.runs, args.extra, args.pack)
        for seed in args.seeds
        for s, n in todo
    ]
    budget = f"{args.passes:g} pass(es)" if args.passes is not None else f"{args.steps} steps"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curve.json").write_text(
        json.dumps({"steps": args.steps, "passes": args.passes, "points": points}, indent=2)
    )
    plot(points, budget, args.out / "curve.png")
    for p in points:
        print(f"{p['stream']:>9}:{p['n']:<5} seed {p['seed']}  {p['trained_tokens']:>8} tokens  "
              f"top-1 {p['top1_1']:.3f}  alpha T=1 {p['alpha_T1_1']:.3f}  "
              f"sim tau {p['sim_tau_greedy']:.3f} / {p['sim_tau_T1']:.3f}")  # fmt: skip
    print(f"wrote {args.out / 'curve.json'} and {args.out / 'curve.png'}")
    return points


if __name__ == "__main__":
    main()
