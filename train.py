"""draftlab training entry point: `python train.py +experiment=distill_kl`.

Multi-process: `torchrun --nproc_per_node 2 train.py +experiment=debug` (CPU, gloo) or
`accelerate launch --config_file conf/accelerate/ddp.yaml train.py +experiment=...` (GPUs).
See docs/training.md. The `train/` package beside this script wins on import.
"""

import hydra
from omegaconf import DictConfig

import train.resolvers  # noqa: F401  (${safe_dirname:}, which run_dir uses)
from train.loop import run


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
