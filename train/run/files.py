"""A run directory's own files: none until the start-up checks pass, none half-written.

- `check_run_dir`: a second run into a directory that already holds a run's records is
  refused unless it resumes (resume=true) or starts afresh (overwrite=true), so the records
  of two runs never mix in one metrics.jsonl. (A directory with checkpoints is refused by
  train/core/checkpoint.py: resume_checkpoint.)
- `clear_run`: what overwrite=true deletes, called once the new run's checks have passed: a
  refused start leaves the old run as it was.
- `write_eval_prompts` / `read_eval_prompts`: the run's held-out eval prompts (token ids
  included) with the data settings that chose them, so scripts/evaluate.py decodes them
  without preparing the data again (which may regenerate the whole training set).
- `route_third_party_output`: inductor's autotuning tables and library warnings into the
  run's third_party.log, not the console (which says once where they went).
- `save_hydra_record`: Hydra's own record of the command line (`.hydra/config.yaml`,
  `hydra.yaml`, `overrides.yaml`). conf/train.yaml keeps Hydra from creating the run
  directory at launch (`hydra.run.dir: .`, `hydra.output_subdir: null`, console-only job
  logging), so the run writes that record itself with its config.yaml.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from train.disk import write_atomic

# What a run writes into its directory besides checkpoints/ (a run's records).
RECORDS = ("metrics.jsonl", "summary.json", "config.yaml")
EVAL_PROMPTS = "eval_prompts.json"
# data.* settings that do not choose or render the eval prompts (how the training prompts are
# answered, where things are cached): a change of these leaves a run's stored prompts valid.
NOT_EVAL_SETTINGS = ("progress", "cache_dir", "max_new_tokens", "temperature", "top_p",
                     "max_failed_share", "num_reference", "num_raw_chunks", "regenerate_turns",
                     "bad_rows", "num_proc")  # fmt: skip
THIRD_PARTY_LOG = "third_party.log"
PROJECT = str(Path(__file__).resolve().parents[2])  # warnings from here stay on the console


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


def _eval_settings(data: dict) -> dict:
    return {
        k: v for k, v in data.items() if k not in NOT_EVAL_SETTINGS and not k.startswith("regen_")
    }


def write_eval_prompts(run_dir: Path, prompts: list[dict], data: dict) -> None:
    """The run's eval prompts (train.data.prepare: PreparedData.eval_prompts) beside its
    config, with the data.* settings (`data`, resolved) that chose them."""
    record = {"data": _eval_settings(data), "prompts": prompts}
    write_atomic(run_dir / EVAL_PROMPTS, json.dumps(record, default=str))


def read_eval_prompts(run_dir: Path, data: dict) -> tuple[list[dict] | None, str]:
    """The eval prompts a run stored, if its data settings are `data`'s; else None and why
    (a run from before runs stored them, or data.* settings that choose other prompts)."""
    path = run_dir / EVAL_PROMPTS
    if not path.is_file():
        return None, f"no {path} (a run from before runs stored their eval prompts)"
    stored = json.loads(path.read_text())
    now = _eval_settings(data)
    changed = sorted(k for k in stored["data"].keys() | now.keys()
                     if stored["data"].get(k) != now.get(k))  # fmt: skip
    if changed:
        return None, f"data.{', data.'.join(changed)} not as the run had them ({path})"
    return stored["prompts"], str(path)


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


def route_third_party_output(run_dir: Path) -> Path:
    """Inductor's AUTOTUNE tables (written to stderr by select_algorithm's `log_results`, dozens
    of lines per compiled matmul) and the warnings of other packages go to
    run_dir/third_party.log (draftlab's own warnings stay on the console); the first of them
    prints one console line naming the file. Returns the file's path."""
    path, told = Path(run_dir) / THIRD_PARTY_LOG, []

    def tell() -> None:
        if not told:
            told.append(True)
            print(f"[draftlab] third-party output (autotuning tables, warnings): {path}", flush=True)  # fmt: skip

    console = getattr(warnings.showwarning, "console", warnings.showwarning)

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if str(filename).startswith(PROJECT) and "site-packages" not in str(filename):
            return console(message, category, filename, lineno, file, line)  # our own: shown
        with path.open("a") as f:
            f.write(warnings.formatwarning(message, category, filename, lineno, line))
        tell()

    show.console = console
    warnings.showwarning = show
    try:
        from torch._inductor.select_algorithm import AlgorithmSelectorCache
    except ImportError:  # no inductor in this torch: nothing of it to route
        return path
    original = AlgorithmSelectorCache.log_results
    if getattr(original, "routed_to", None) is None:  # not yet wrapped in this process

        def routed(*args, **kwargs):
            try:
                log = routed.routed_to.open("a")
            except OSError:  # that run's directory is gone: the console, as before
                return original(*args, **kwargs)
            with log, contextlib.redirect_stderr(log):
                out = original(*args, **kwargs)
            if routed.routed_to.stat().st_size:
                routed.tell()
            return out

        AlgorithmSelectorCache.log_results = staticmethod(routed)
    wrapped = AlgorithmSelectorCache.log_results
    wrapped.routed_to, wrapped.tell = path, tell  # a later run: its own directory
    return path
