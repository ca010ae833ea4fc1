"""The memory plan against measured peaks, phase by phase, for the launches docs/memory.md
quotes: one process, DDP and FSDP over two CPU ranks (FSDP also with gradient
accumulation), each a short run of the flagship (the EAGLE-3 head on the embedded
SmolLM2) with two checkpoints, the held-out proxy and an eager evaluation at each; the
one-process run regenerates 32 training rows (the others train on the shipped pack).

    python scripts/bench_memory.py --out docs/reports/memory_plan.json
    python scripts/bench_memory.py --summary runs/eagle_tv/.../summary.json   # add a run's
    python scripts/bench_memory.py --summary .../summary.json --as-recorded --only   # just it

Each run writes summary.json `memory` (train/loop.py): the plan's bytes per phase
(train/run/memory_plan.py: MemoryPlan.phase_bytes) beside the main rank's measured peak RSS in
that phase (train/phase_memory.py), with what the process held when that peak's phase
began ("from": the peak less it is what the phase itself added). Runs one at a time (each rank one thread); prints a
table and writes JSON: per run its command, the plan and the peak per phase, and
measured / plan. `--summary` adds finished runs (the README's first run) to the table, with
the plan this code makes for their config (their recorded target dtype, ranks and process
baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

from models.target_loaders import target_config
from train.run.memory_plan import plan_for_run
from train.run.replan import with_heldout_shapes, with_recorded_dtypes, with_train_batch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}

SHORT = [
    "+experiment=eagle_tv", "train.time_budget_s=null", "train.steps=8", "train.ckpt_every=4",
    "train.eval_every=null", "decode.compile=false", "decode.num_prompts=2",
    "decode.max_new_tokens=16", "decode.ood_num_prompts=2", "logger=none",
]  # fmt: skip

REGENERATE = ["data.pack=null", "data.pack_val=0", "data.num_train=32"]  # the data phase answers

LAUNCHES = {
    "one process, regenerating 32 rows": ([sys.executable, "train.py"], REGENERATE),
    "DDP, 2 ranks": (["accelerate", "ddp"], []),
    "FSDP, 2 ranks": (["accelerate", "fsdp"], []),
    "FSDP, 2 ranks, grad_accum 2": (["accelerate", "fsdp"], ["train.grad_accum=2"]),
}


def command(launcher: list[str], overrides: list[str], run_dir: Path) -> list[str]:
    if launcher[0] == "accelerate":
        launcher = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            f"conf/accelerate/{launcher[1]}.yaml", "--num_processes", "2", "train.py",
        ]  # fmt: skip
    return [*launcher, *SHORT, *overrides, f"run_dir={run_dir}"]


def replan(run_dir: Path, summary: dict) -> dict:
    """The run's `memory` with the plan this code makes for its config.yaml (its target dtype,
    ranks, process baseline, held-out batches, widest training batch, the matmul shapes' state
    and shapes met, and the evaluation's dtypes and path as recorded): a run measured before
    a change of the plan is compared with the plan as it is now."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    memory = summary["memory"]
    recorded = memory["plan"]
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    # the matmul shapes' state as the run measured it, where it did (else measured here)
    shapes = (recorded["shape_bytes_per_width"], recorded["matmuls_per_width"]) if "matmuls_per_width" in recorded else None  # fmt: skip
    plan = plan_for_run(cfg, config, name, recorded["target_dtype"], recorded["ranks"],
                        recorded["sharded"], False, recorded["baseline_bytes"], shapes)  # fmt: skip
    plan = with_heldout_shapes(plan, recorded.get("heldout_shapes") or [])  # as the run did
    plan = with_train_batch(plan, recorded.get("train_batch"), recorded.get("shape_widths"))
    dtypes, evaluated = summary.get("dtypes") or {}, summary.get("final_eval") or {}
    if all(use in dtypes for use in ("decode", "ar")) and "decode_path" in evaluated:
        plan = with_recorded_dtypes(plan, dtypes, evaluated["decode_path"] == "compiled")
    planned = plan.phase_bytes()
    phases = {k: {**v, "plan_bytes": planned.get(k)} for k, v in memory.get("phases", {}).items()}
    return {**memory, "plan_peak_bytes": plan.peak_bytes(), "phases": phases}


def compare(memory: dict) -> dict:
    """Per phase and overall: plan, measured peak RSS, measured / plan."""

    def row(plan: int | None, peak: int | None, start: int | None = None) -> dict:
        ratio = round(peak / plan, 3) if plan and peak else None
        held = {} if start is None else {"start_rss_bytes": start}  # what the phase rose from
        return {"plan_bytes": plan, "peak_rss_bytes": peak, **held, "measured_over_plan": ratio}

    phases = {
        name: row(p.get("plan_bytes"), p.get("peak_rss_bytes"), p.get("start_rss_bytes"))
        for name, p in memory.get("phases", {}).items()
    }
    return {"overall": row(memory["plan_peak_bytes"], memory["peak_rss_bytes"]), "phases": phases}


def table(results: dict) -> str:
    lines = [f"{'run':34} {'phase':16} {'plan MiB':>9} {'peak MiB':>9} {'peak/plan':>9} {'from MiB':>9}"]  # fmt: skip
    for run, result in results.items():
        for name, r in [("overall", result["overall"]), *result["phases"].items()]:
            plan, peak, start = (None if b is None else b / 2**20 for b in (r["plan_bytes"], r["peak_rss_bytes"], r.get("start_rss_bytes")))  # fmt: skip
            lines.append(
                f"{run:34} {name:16} {plan or 0:9.0f} {peak or 0:9.0f} "
                f"{r['measured_over_plan'] or float('nan'):9.3f} "
                + ("" if start is None else f"{start:9.0f}")
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON here")
    parser.add_argument("--summary", type=Path, nargs="*", default=[], help="finished runs' summary.json to add")  # fmt: skip
    parser.add_argument("--as-recorded", action="store_true",
                        help="take --summary runs' plans as they recorded them (runs of this code)")  # fmt: skip
    parser.add_argument("--only", nargs="*", help="run only these launches (names as printed)")
    parser.add_argument("--workdir", type=Path, help="keep the runs here (default: a temporary dir)")  # fmt: skip
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for path in args.summary:
        summary = json.loads(path.read_text())
        memory = summary["memory"]
        if not args.as_recorded:
            memory = replan(path.parent, summary)  # the plan as this code makes it
        results[f"{summary['name']} ({path.parent})"] = {"command": "as run", **compare(memory)}  # fmt: skip
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_memory_"))
    for i, (name, (launcher, extra)) in enumerate(LAUNCHES.items()):
        if args.only is not None and name not in args.only:  # --only alone: none
            continue
        run_dir = workdir / f"run{i}"
        cmd = command(launcher, extra, run_dir)
        print(f"[{name}] {' '.join(cmd)}", flush=True)
        started = time.perf_counter()
        env = {**ENV, "OMP_NUM_THREADS": "1"} if launcher[0] == "accelerate" else ENV
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"[{name}] failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
        results[name] = {"command": " ".join(cmd[1:] if cmd[0] == sys.executable else cmd),
                         "wall_s": round(time.perf_counter() - started, 1),
                         **compare(summary["memory"])}  # fmt: skip
        print(table({name: results[name]}), flush=True)
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
