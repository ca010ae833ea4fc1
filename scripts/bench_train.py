"""Time one training step of an experiment in every dtype combination, on this machine.

    python scripts/bench_train.py +experiment=eagle_tv --out runs/bench/train.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_train.py +experiment=eagle_tv

Rows: the frozen target in float32 / bfloat16 x the draft's forward and loss without / with
bf16 autocast: what `target.dtype: auto` and `train.bf16: auto` choose between
(train/run/machine.py). Each row times the loop's own `train_step` (target forward, draft
forward, losses, backward, clipping; no optimizer update, so every repeat trains the same
weights) on the experiment's batch (train.batch_size rows of the training data, in the
loop's first-epoch order). The rows run INTERLEAVED, the order rotated by one per repeat,
and report the median and min-max over --repeats. The training data is read from the cache
a run fills (train/data/); `data.regenerate=false` times the source answers instead (other
lengths) when nothing is cached yet. Prints a table and the machine (CPU model, ATen's CPU
capability, oneDNN ISA cap, torch, threads); --out writes JSON. The rows run with glibc's
own mmap threshold (train.py fixes it at 1 MiB: --mmap-threshold 1048576 times that).
--trim adds a twin of every row that first gives the freed heap back (train/phase_memory.py:
give_back_freed), so a trim between steps is timed with the pages it faults in again;
--mmap-threshold BYTES a twin that runs with glibc's mmap threshold fixed at BYTES (every
larger tensor mapped and unmapped on its own), the other rows then at 32 MiB, the most
glibc's own threshold rises to.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from models.dtype_choice import machine_key
from train.core.schedule import global_rows, rank_chunks
from train.core.step import train_step
from train.data.prepare import collate, prepare_data
from train.phase_memory import DYNAMIC_MMAP_CEILING, give_back_freed, set_mmap_threshold
from train.run.settings import eval_settings
from train.run.setup import instantiate, preflight, step_setup

ROOT = Path(__file__).resolve().parents[1]
TARGET_DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=eagle_tv")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes over the rows")
    ap.add_argument("--out", help="write the JSON here too")
    ap.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                    help="each row also as a twin run with glibc's mmap threshold fixed at BYTES "
                    "(the others at 32 MiB, where glibc's own threshold ends)")  # fmt: skip
    ap.add_argument("--trim", action="store_true",
                    help="each row also as a twin that gives the freed heap back first (glibc "
                    "malloc_trim): a trim between steps, refaults included")  # fmt: skip
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, "logger=none", "device=cpu"])
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    tc, decode_samplings = cfg.train, eval_settings(cfg).samplings
    target = instantiate(cfg.target, dtype="float32")
    prepared = prepare_data(target, **OmegaConf.to_container(cfg.data, resolve=True))
    rows = prepared.train.select_columns(["input_ids", "loss_mask"])
    pad_id = target.tokenizer.pad_token_id
    order = global_rows(0, tc.batch_size * tc.grad_accum, len(rows), cfg.seed)
    chunks = rank_chunks(order, tc.batch_size, tc.grad_accum, 0, 1)
    micro = [collate([rows[i] for i in c], pad_id) for c in chunks]

    steps = {}  # row name -> a function running one train_step
    for target_name in TARGET_DTYPES:
        copy_ = instantiate(cfg.target, dtype=target_name)  # loaded as a run loads it
        draft = instantiate(cfg.draft.model, target=copy_, token_counts=prepared.token_counts)
        offsets = preflight(draft, copy_, torch.tensor(rows[0]["input_ids"]))
        base = step_setup(cfg, offsets, decode_samplings)
        params = [p for p in draft.parameters() if p.requires_grad]
        for autocast in (False, True):
            setup = replace(base, autocast=autocast)

            def step(copy_=copy_, draft=draft, setup=setup, params=params) -> None:
                train_step(0, draft, draft, copy_, micro, chunks, setup, accelerator, params)
                draft.zero_grad(set_to_none=True)

            name = f"target {target_name}, draft {'bf16 autocast' if autocast else 'float32'}"
            steps[name] = step
            if args.trim:  # the trim, then the step that faults the given-back pages in again
                steps[name + ", heap trimmed"] = lambda step=step: (give_back_freed(), step())
            if args.mmap_threshold:
                steps[name + f", mmap threshold {args.mmap_threshold}"] = lambda step=step: (
                    with_threshold(args.mmap_threshold, step)
                )
    if args.mmap_threshold:  # the plain rows at the ceiling of glibc's dynamic threshold
        set_mmap_threshold(DYNAMIC_MMAP_CEILING)
    for fn in steps.values():  # warm-up, untimed
        fn()
    names, seconds = list(steps), {name: [] for name in steps}
    for rep in range(args.repeats):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            t0 = time.perf_counter()
            steps[name]()
            seconds[name].append(time.perf_counter() - t0)
    fastest = min(statistics.median(s) for s in seconds.values())
    table = {
        name: {
            "median_s": statistics.median(s),
            "min_s": min(s),
            "max_s": max(s),
            "over_fastest": statistics.median(s) / fastest,
        }  # fmt: skip
        for name, s in seconds.items()
    }
    tokens = sum(int(b["attention_mask"].sum()) for b in micro)
    print(f"machine: {json.dumps(machine_key())}")
    print(f"{cfg.name}: one step = {len(micro)} x {micro[0]['input_ids'].shape} rows, "
          f"{tokens} tokens, {args.repeats} interleaved repeats")  # fmt: skip
    print("| dtypes | median s | min-max s | x fastest |\n|---|---|---|---|")
    for name, row in table.items():
        print(f"| {name} | {row['median_s']:.2f} | {row['min_s']:.2f}-{row['max_s']:.2f} | "
              f"{row['over_fastest']:.2f} |")  # fmt: skip
    if args.out:
        report = {"machine": machine_key(), "experiment": str(cfg.name),
                  "overrides": args.overrides, "tokens_per_step": tokens,
                  "repeats": args.repeats, "rows": table}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def with_threshold(nbytes: int, step) -> None:
    """`step` with glibc's mmap threshold at `nbytes`, then back at the dynamic ceiling."""
    set_mmap_threshold(nbytes)
    try:
        step()
    finally:
        set_mmap_threshold(DYNAMIC_MMAP_CEILING)


if __name__ == "__main__":
    main()
