"""Atomic checkpoints: draft weights + config + everything needed to resume exactly.

Layout of `<run_dir>/checkpoints/step_00000100/`:
    draft.safetensors   draft.state_dict() (trained weights + buffers such as d2t/t2d)
    draft.yaml          the resolved cfg.draft (reload = instantiate + load_state_dict(strict))
    config.yaml         the resolved run config it was trained with (scripts/evaluate.py reads it,
                        so a copied checkpoint folder evaluates on its own)
    identity.json       the settings that shape the draft's computation and the target's
                        identity (train/run/identity.py), compared on resume, init_from, evaluate
    trainer_state.pt    step, rows consumed, optimizer, LR scheduler and the settings of its
                        schedule, RNG states of every rank
    meta.json           step, loss, training seconds (for humans, notebooks, curves)

A checkpoint is written into `.tmp-step_*`, every file fsync'ed, then the directory is
renamed into place and the parent fsync'ed: a crash mid-write leaves only a `.tmp-*`
directory, which `list_checkpoints` ignores and `clean_partial` removes. So a directory
named `step_*` is always complete when written; a file damaged later (a full disk, a bad
copy) is caught by `checkpoint_damage`, and resume falls back to the newest intact one,
renaming each newer damaged one to `.damaged-step_*`: out of `list_checkpoints` (so out of
keep_last pruning and `latest_checkpoint`), kept for inspection (`clean_partial` leaves it).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import hydra.utils
import numpy as np
import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from models.target import Target
from train.disk import out_of_space

CKPT_SUBDIR = "checkpoints"
PREFIX = "step_"
TMP_PREFIX = ".tmp-"
DAMAGED_PREFIX = ".damaged-"
FILES = ("draft.safetensors", "draft.yaml", "trainer_state.pt")  # what resume reads


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CKPT_SUBDIR


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX) :]))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def clean_partial(run_dir: str | Path) -> None:
    """Remove `.tmp-*` leftovers of a crash mid-write."""
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_tensors(state: dict[str, Tensor], path: Path) -> None:
    """safetensors refuses tensors that share storage (tied embeddings): store each storage
    once and record the other names as aliases in the metadata."""
    kept: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, t in state.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        kept[name] = t.detach().contiguous().cpu()
    save_file(kept, str(path), metadata={"aliases": json.dumps(aliases)})


def load_tensors(path: Path) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            state[name] = f.get_tensor(name)
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    draft_state: dict[str, Tensor],
    draft_cfg_yaml: str,
    trainer_state: dict,
    keep_last: int,
    meta: dict | None = None,
    config_yaml: str | None = None,
    identity: dict | None = None,
) -> Path:
    """Write checkpoint `step` atomically, then keep only the newest `keep_last`.
    `config_yaml`: the resolved run config, saved beside the weights; `identity`: what
    train/run/identity.py compares (identity.json)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    old = root / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
    try:
        save_tensors(draft_state, tmp / "draft.safetensors")
        (tmp / "draft.yaml").write_text(draft_cfg_yaml)
        if config_yaml is not None:
            (tmp / "config.yaml").write_text(config_yaml)
        if identity is not None:
            (tmp / "identity.json").write_text(json.dumps(identity, indent=2))
        torch.save(trainer_state, tmp / "trainer_state.pt")
        (tmp / "meta.json").write_text(json.dumps({"step": step, **(meta or {})}, indent=2))
        for f in tmp.iterdir():
            _fsync_file(f)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. after resume): swap, never half-replace
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException as err:  # Ctrl-C between the two renames: put the old step back
        if old.exists() and not final.exists():
            os.rename(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, Exception):  # a full disk: say so, and what is left to resume from
            kept = list_checkpoints(run_dir)
            fix = (f"The newest checkpoint, {kept[-1].name}, is intact: free space (or lower "
                   "train.keep_last) and relaunch with resume=auto." if kept else
                   "There is no earlier checkpoint: free space and relaunch.")  # fmt: skip
            full = out_of_space(err, f"checkpoint {final.name}", root, fix)
            if full is not None:
                raise full from err
        raise
    if keep_last > 0:
        for stale in list_checkpoints(run_dir)[:-keep_last]:
            # Out of the checkpoints first: a deletion cut short leaves a .tmp-* directory
            # (clean_partial removes it), never a step_* directory with files missing.
            doomed = root / f"{TMP_PREFIX}pruned-{stale.name}-{os.getpid()}"
            os.rename(stale, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
    return final


def _damaged(file: Path, err: Exception) -> str:
    return f"{file} is damaged ({type(err).__name__}: {err})"


def checkpoint_damage(path: str | Path) -> str | None:
    """None if checkpoint `path` can be resumed from, else which file is damaged and how.
    Cheap: the safetensors header (its tensor offsets must cover the file exactly, so a
    truncated file fails without reading the tensors) and trainer_state.pt unpickled."""
    path = Path(path)
    missing = [n for n in FILES if not (path / n).is_file()]
    if missing:
        return f"missing {missing}"
    try:
        with safe_open(str(path / "draft.safetensors"), framework="pt") as f:
            f.metadata()
    except Exception as err:  # safetensors raises SafetensorError, an OSError, ...
        return _damaged(path / "draft.safetensors", err)
    try:
        torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError, ...
        return _damaged(path / "trainer_state.pt", err)
    return None


def load_checkpoint(path: str | Path) -> tuple[dict[str, Tensor], str, dict]:
    """-> (draft state dict, draft config YAML, trainer state)."""
    path = Path(path)
    missing = [n for n in FILES if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"checkpoint {path} is missing {missing}; it was not written by draftlab"
        )
    fix = "; use another checkpoint of the run"
    try:
        draft_state = load_tensors(path / "draft.safetensors")
    except Exception as err:
        raise ValueError(_damaged(path / "draft.safetensors", err) + fix) from err
    try:
        trainer_state = torch.load(
            path / "trainer_state.pt", map_location="cpu", weights_only=False
        )
    except Exception as err:
        raise ValueError(_damaged(path / "trainer_state.pt", err) + fix) from err
    return draft_state, (path / "draft.yaml").read_text(), trainer_state


def load_draft(
    path: str | Path, target: Target, device: str | torch.device | None = None
) -> torch.nn.Module:
    """Rebuild a trained draft from a checkpoint directory for `target` (strict load)."""
    draft_state, draft_yaml, _ = load_checkpoint(path)
    draft_cfg = OmegaConf.create(draft_yaml)
    # plain lists and dicts for the builder, as the run built it (train/run/setup.py)
    draft = hydra.utils.instantiate(
        draft_cfg.model, target=target, token_counts=None, _convert_="all"
    )
    draft.load_state_dict(draft_state, strict=True)
    return draft.to(device or target.device)


def _move_aside(ckpt: Path) -> Path:
    """Rename damaged checkpoint `ckpt` to `.damaged-step_N` (`-2`, `-3`... if taken): no longer
    a checkpoint to prune, resume or evaluate, but kept for the user to inspect."""
    n, dest = 1, ckpt.with_name(DAMAGED_PREFIX + ckpt.name)
    while dest.exists():
        n += 1
        dest = ckpt.with_name(f"{DAMAGED_PREFIX}{ckpt.name}-{n}")
    with contextlib.suppress(FileNotFoundError):  # every rank resumes: another moved it first
        ckpt.rename(dest)
    return dest


def resume_setting(run_dir: Path, resume: bool | str, overwrite: bool) -> tuple[bool, bool]:
    """`resume` and `overwrite` as booleans. resume=auto is the one launch line that survives
    preemption: it resumes (as resume=true, refusing what that refuses) where run_dir holds a
    checkpoint, and where it holds none starts afresh (as overwrite=true: the records of a
    run killed before its first checkpoint are replaced, as that run is redone from step 0)."""
    setting = str(resume).lower()
    if setting not in ("true", "false", "auto"):
        raise ValueError(f"resume={resume!r}: use true, false or auto")
    if setting != "auto":
        return setting == "true", overwrite
    if overwrite:
        raise ValueError("resume=auto and overwrite=true contradict each other; pass one of them")
    clean_partial(run_dir)
    return (True, False) if latest_checkpoint(run_dir) is not None else (False, True)


def resume_checkpoint(run_dir: Path, resume: bool, overwrite: bool) -> Path | None:
    """Decide, before anything heavy, whether a run starts fresh (None) or resumes from the
    returned checkpoint: the newest intact one, with a warning naming any newer damaged one,
    which is renamed to `.damaged-step_N` (else it would count toward keep_last and be
    `latest_checkpoint`; the run re-saves that step when it gets there). Removes a crashed
    write's partial directory."""
    clean_partial(run_dir)
    newest = latest_checkpoint(run_dir)
    if resume and overwrite:
        raise ValueError("resume=true and overwrite=true contradict each other; pass one of them")
    if resume:
        if newest is None:
            raise FileNotFoundError(
                f"resume=true but {run_dir}/checkpoints holds no checkpoint. Drop resume=true to "
                "start a new run, or set name/seed/run_dir to the run you want to continue."
            )
        damaged = []
        for ckpt in reversed(list_checkpoints(run_dir)):
            damage = checkpoint_damage(ckpt)
            if damage is None:
                if damaged:
                    moved = [f"{c.name} (renamed {_move_aside(c).name}): {d}" for c, d in damaged]
                    warnings.warn(
                        f"resuming from {ckpt}, the newest intact checkpoint, instead of the "
                        f"damaged newer one(s): {'; '.join(moved)}",
                        stacklevel=2,
                    )
                return ckpt
            damaged.append((ckpt, damage))
        raise ValueError(
            f"resume=true but no checkpoint in {run_dir}/checkpoints is intact: "
            f"{'; '.join(f'{c.name}: {d}' for c, d in damaged)}. Delete the damaged directories, or pass overwrite=true "
            "(instead of resume=true) to start the run afresh."
        )
    if newest is not None and not overwrite:
        raise FileExistsError(
            f"{run_dir} already has checkpoints (newest: {newest.name}). Pass resume=true to "
            "continue that run, overwrite=true to delete them and start afresh, or choose "
            "another name/seed/run_dir."
        )
    return None


def rng_state() -> dict:
    """This process's RNG states (torch, python, numpy, cuda), for bit-exact resume."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def trainer_state(
    step: int,
    rows_consumed: int,
    world_size: int,
    optimizer_state: dict,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    rng_all: list[dict],
    replay_all: list[dict] | None,
    train_s: float,
    schedule: dict | None = None,
    strategy: str = "single",
) -> dict:
    """What a resumed run needs to continue exactly: the step and data position (rows of the
    seeded stream consumed: train/core/schedule.py), optimizer state (`strategy` "fsdp": the full
    state keyed by parameter name, train/parallel/strategy.py) and LR scheduler with the settings of
    its schedule (train/run/identity.py: schedule_settings), every rank's RNG states and replay
    buffers, and the training seconds spent (a time budget's clock)."""
    return {
        "step": step,
        "rows_consumed": rows_consumed,
        "world_size": world_size,
        "strategy": strategy,
        "optimizer": optimizer_state,
        "scheduler": scheduler.state_dict(),
        "schedule": schedule,
        "rng": rng_all,  # one entry per rank
        "replay": replay_all,  # every rank's buffer
        "train_s": train_s,
    }


def restore_trainer_state(
    path: Path,
    draft: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    replay,  # train.core.replay.Replay | None
    rank: int,
    world_size: int,
    sharded: bool = False,
) -> tuple[int, float]:
    """Load checkpoint `path` into the draft (strict), optimizer, scheduler, this rank's RNG
    and replay buffer. -> (step, training seconds spent). `sharded`: the draft is FSDP-sharded
    (train/parallel/strategy.py); every rank loads the full state and keeps its own shard."""
    draft_state, _, state = load_checkpoint(path)
    if state["world_size"] != world_size:
        raise ValueError(
            f"{path} was written by {state['world_size']} processes; "
            f"resume with the same number (got {world_size})"
        )
    saved = state.get("strategy", "single")  # checkpoints before the key: not FSDP
    if (saved == "fsdp") != sharded:
        fix = (
            "conf/accelerate/fsdp.yaml"
            if saved == "fsdp"
            else "torchrun or conf/accelerate/ddp.yaml"
        )
        raise ValueError(
            f"{path} was written by a {saved} run and this run is "
            f"{'fsdp' if sharded else 'not fsdp'}: its optimizer state is laid out for the other; "
            f"resume with {fix}"
        )
    if sharded:
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(draft, draft_state, options=options)
        set_optimizer_state_dict(draft, optimizer, state["optimizer"], options=options)
    else:
        draft.load_state_dict(draft_state, strict=True)
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"][rank])
    if replay is not None and state.get("replay"):
        replay.load_state_dict(state["replay"][rank])
    return state["step"], state.get("train_s", 0.0)
