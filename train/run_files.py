"""A run directory's own files: none until the start-up checks pass, none half-written.

- `check_run_dir`: a second run into a directory that already holds a run's records is
  refused unless it resumes (resume=true) or starts afresh (overwrite=true), so the records
  of two runs never mix in one metrics.jsonl. (A directory with checkpoints is refused by
  train/checkpoint.py: resume_checkpoint.)
- `clear_run`: what overwrite=true deletes, called once the new run's checks have passed: a
  refused start leaves the old run as it was.
- `write_atomic`: a temporary file beside the target, fsync'ed, renamed over it; Ctrl-C or a
  crash leaves the old file or the new one, never a part of either.
- `save_hydra_record`: Hydra's own record of the command line (`.hydra/config.yaml`,
  `hydra.yaml`, `overrides.yaml`). conf/train.yaml keeps Hydra from creating the run
  directory at launch (`hydra.run.dir: .`, `hydra.output_subdir: null`, console-only job
  logging), so the run writes that record itself with its config.yaml.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

# What a run writes into its directory besides checkpoints/ (a run's records).
RECORDS = ("metrics.jsonl", "summary.json", "config.yaml")


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a new run into a directory that holds another run's records but no checkpoint
    (a run stopped before its first checkpoint, or its checkpoints deleted by hand)."""
    if resume or overwrite:
        return
    found = [name for name in RECORDS if (run_dir / name).exists()]
    if found:
        raise FileExistsError(
            f"{run_dir} already holds a run's records ({', '.join(found)}) and no checkpoint "
            "to resume from; a new run there would mix its records with them. Pass "
            "overwrite=true to delete them and start afresh, or choose another "
            "name/seed/run_dir."
        )


def clear_run(run_dir: Path) -> None:
    """overwrite=true: delete the earlier run's checkpoints and records."""
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for path in [run_dir / "metrics.jsonl", run_dir / "summary.json",
                 *run_dir.glob("config.resume-*.yaml")]:  # fmt: skip
        path.unlink(missing_ok=True)


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` whole, or what it held before (Ctrl-C, a crash, a full disk)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_hydra_record(run_dir: Path, task_cfg) -> None:
    """`.hydra/` as Hydra writes it, when running under @hydra.main (train.py)."""
    if not HydraConfig.initialized():  # a test or a caller of train.loop.run
        return
    hydra_cfg = HydraConfig.get()
    out = run_dir / ".hydra"
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(task_cfg))
    write_atomic(out / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra_cfg})))
    write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.overrides.task))
