"""Print a training launch's memory per rank before anything runs: no weights read.

    python scripts/plan.py +experiment=eagle_tv
    python scripts/plan.py +experiment=eagle_tv target=hf target.path=<DIR_OR_HUB_ID> \
        train.batch_size=8 --gpus 8 --gpu-mem 80 [--fsdp]

Takes train.py's overrides. Per rank: the target's weights, the draft's parameters, their
gradients and optimizer state, the activations of one step at train.batch_size x
data.max_len (with and without gradient checkpointing), the evaluation's copies, and the
feature cache's size on disk (train/run/memory_plan.py says how each is counted). With --gpus
the plan is for that many CUDA ranks (target.dtype=auto counts bfloat16, as a run on CUDA
takes); --gpu-mem GiB per GPU is then checked as train.py checks the device's memory at
start, and a plan that does not fit is refused (exit 1) with the settings that would fit.
Without them: one process on this machine, checked against its memory (a CUDA device's
total, or the host's RAM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from models.target_loaders import target_config
from train.phase_memory import process_memory
from train.run.memory_fit import check_fits, device_memory, format_plan
from train.run.memory_plan import GIB, plan_for_run, planned_dtype

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("overrides", nargs="*", help="train.py's Hydra overrides")
    ap.add_argument("--gpus", type=int, help="CUDA ranks of the launch (one per GPU)")
    ap.add_argument("--gpu-mem", type=float, help="memory per GPU in GiB")
    ap.add_argument("--fsdp", action="store_true", help="the draft's state sharded (FSDP2)")
    args = ap.parse_args()
    if args.gpus is not None and args.gpus < 1:
        ap.error(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpu_mem is not None and args.gpu_mem <= 0:
        ap.error(f"--gpu-mem must be > 0 GiB, got {args.gpu_mem}")
    if args.fsdp and (args.gpus or 1) < 2:
        ap.error("--fsdp shards over ranks: give --gpus 2 or more")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[*args.overrides, "logger=none"])
    gpus = args.gpus is not None or args.gpu_mem is not None
    cuda = gpus or torch.cuda.is_available()
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    dtype = planned_dtype(str(cfg.target.get("dtype", "float32")), cuda)
    ranks = args.gpus or 1
    # A CPU plan counts this process as a run's baseline (the libraries a run imports too)
    plan = plan_for_run(cfg, config, name, dtype, ranks, args.fsdp, cuda, process_memory() or 0)
    print(format_plan(plan))
    if args.gpu_mem is not None:
        memory = (int(args.gpu_mem * GIB), f"--gpu-mem {args.gpu_mem:g} GiB")
    elif gpus:
        memory = None
    else:
        memory = device_memory(torch.device("cuda" if cuda else "cpu"))
    if memory is None:
        return 0
    try:
        check_fits(plan, *memory)
    except ValueError as err:
        print(str(err).splitlines()[0], file=sys.stderr)
        print(str(err).splitlines()[-2], file=sys.stderr)  # the settings that would fit
        return 1
    print(f"fits: {plan.peak_bytes() / GIB:.2f} GiB of {memory[0] / GIB:.2f} GiB ({memory[1]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
