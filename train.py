"""draftlab training entry point: `python train.py +experiment=distill_kl`.

Multi-process: `torchrun --nproc_per_node 2 train.py +experiment=debug` (CPU, gloo) or
`accelerate launch --config_file conf/accelerate/ddp.yaml train.py +experiment=...` (GPUs).
See docs/training.md. The `train/` package beside this script wins on import.

A refused start (a bad setting, a missing file: docs/bad_inputs.md) prints one line,
`train.py: error: <what is wrong and the override that fixes it>`, and exits with status 1;
HYDRA_FULL_ERROR=1 shows the whole traceback instead.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

import train.run.resolvers  # noqa: F401  (${safe_dirname:}, which run_dir uses)
from train.loop import run
from train.phase_memory import HEAP_MMAP_THRESHOLD, set_mmap_threshold


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # process-wide and for good (glibc cannot go back to its own threshold): set by the
    # entry points, not by run(), so a caller running it in-process keeps its allocator
    set_mmap_threshold(HEAP_MMAP_THRESHOLD)
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, FileExistsError) as err:  # a refusal, not a crash
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        sys.exit(f"train.py: error: {err}")


if __name__ == "__main__":
    main()
