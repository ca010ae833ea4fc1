"""What this machine runs fastest for training: threads per process, the frozen target's
dtype (`target.dtype: auto`) and the draft's autocast (`train.bf16: auto`), chosen by timing
the shapes a step runs (models/dtype_choice.py does the choosing and the per-machine cache).

Why measure: on a CPU without native bf16 kernels (AVX2 only) a bf16 training step cost
about 15x its float32 step, while on a CPU with avx512_bf16 the bf16 target and autocast were
the faster recipe (docs/portable.md). A step's shapes are many-row forwards, where the two
kinds of CPU differ most, so the probe is one row of up to 256 tokens: a GEMM as large in M
as the step's, at a fraction of its cost. The target's dtype is chosen before it loads (it
loads straight into it, docs/memory.md), so its probe runs on a slice built from its config.

Threads: every process of a job takes an equal share of the cores this process may run on
(torch's default is all physical cores per process: two ranks on two cores then run four
threads and each forward slows several-fold). OMP_NUM_THREADS, when set, is left alone.
"""

from __future__ import annotations

import copy
import os

import torch
from omegaconf import DictConfig
from transformers import PretrainedConfig

from models.dtype_choice import PROBE_TOKENS, DtypeChoice, choose_dtype, median_seconds
from models.dtype_choice import choose_target_dtype as slice_dtype
from models.dtypes import resolve_dtype
from models.protocol import DraftModel
from models.target import Target
from train.core.step import StepSetup, StepStats, offset_losses, target_output
from train.parallel.ranks import Ranks


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity (a cpuset or taskset counts), where the
    OS has one, else every CPU; at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


def share_threads(local_processes: int, device: torch.device) -> dict:
    """Set torch's intra-op threads to this process's share of the usable cores (CPU runs
    only; OMP_NUM_THREADS wins). Returns what was decided, for summary.json."""
    cores = usable_cores()
    record = {"cores": cores, "processes_here": local_processes, "source": "default"}
    if device.type == "cpu":
        if os.environ.get("OMP_NUM_THREADS"):
            record["source"] = "OMP_NUM_THREADS"
        else:
            torch.set_num_threads(max(1, cores // max(1, local_processes)))
            record["source"] = "cores / processes"
    record["threads"] = torch.get_num_threads()
    return record


def probe_batch(row: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """One training row cut to PROBE_TOKENS, as a [1, T] batch."""
    ids = torch.tensor(row["input_ids"][:PROBE_TOKENS], device=device)[None]  # [1, T]
    mask = torch.tensor(row["loss_mask"][:PROBE_TOKENS], device=device)[None]  # [1, T]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}


def choose_target_dtype(
    setting: str, config: PretrainedConfig, name: str, device: torch.device,
    tokens: int = PROBE_TOKENS, cache_dir: str | None = None,
) -> DtypeChoice:  # fmt: skip
    """target.dtype: as set, or with "auto" the faster of float32 and bfloat16 for the
    training forward (no grad, one row of `tokens`), timed before the weights are loaded on
    a slice of the target built from its config (models/dtype_choice.py: target_slice), so
    the target loads straight into its dtype. Taps cost little beside the layers' matmuls."""
    timer = median_seconds  # looked up at each call: the tests replace the timer
    return slice_dtype(setting, config, name, device, tokens, cache_dir, timer)


def choose_autocast(
    setting: bool | str, cfg: DictConfig, target: Target, draft: DraftModel, setup: StepSetup,
    row: dict, ranks: Ranks | None = None,
) -> DtypeChoice:  # fmt: skip
    """train.bf16: true / false as set; "auto": bf16 autocast of the draft's forward and loss
    when its forward + backward on one probe row is faster that way, timed on a copy of the
    draft (the run's own draft is not touched). With several processes rank 0 times it and
    every rank takes its verdict: ranks never train in different dtypes."""
    if setting != "auto":
        name = "bfloat16" if setting else "float32"
        return DtypeChoice("train_draft", name, "explicit")
    ranks = ranks or Ranks()
    if not ranks.main:
        return ranks.broadcast(None)
    batch = probe_batch(row, target.device)
    t_out = target_output(target, draft, batch, [0], None)
    probe = copy.deepcopy(draft).train()
    counts = torch.tensor(
        [float(batch["loss_mask"][:, off:].sum()) for off in setup.offsets]
    ).clamp_min(1.0)
    shapes = {"target": target.name, "target_dtype": str(target.dtype), "rows": 1,
              "tokens": batch["input_ids"].shape[1], "draft": cfg.draft.kind,
              "draft_settings": repr(sorted(cfg.draft.model.items())),
              "loss": repr(sorted(cfg.loss.items()))}  # fmt: skip

    def measure(dtype: torch.dtype) -> float:
        def step() -> None:
            stats = StepStats.zeros(len(setup.offsets), len(setup.samplings))
            with torch.autocast(target.device.type, torch.bfloat16, enabled=dtype != torch.float32):
                out = probe(target, batch["input_ids"], t_out, batch["attention_mask"],
                            batch["loss_mask"])  # fmt: skip
                loss = offset_losses(out, t_out.logits, batch, counts, setup, stats)
            loss.backward()
            probe.zero_grad(set_to_none=True)

        return median_seconds(step)

    cache_dir = cfg.data.get("cache_dir")
    choice = choose_dtype("train_draft", "auto", shapes, measure, target.device, cache_dir)
    return ranks.broadcast(choice)


def target_dtype(
    cfg: DictConfig, config: PretrainedConfig, name: str, device: torch.device,
    tokens: int = PROBE_TOKENS, resumed_dtype: str | None = None, ranks: Ranks | None = None,
) -> DtypeChoice:  # fmt: skip
    """The target's training dtype, chosen before it loads (target.dtype; "auto": measured,
    or on a resume the dtype the run's checkpoint ran in). With several processes rank 0
    measures and every rank takes its verdict."""
    setting, ranks = str(cfg.target.dtype), ranks or Ranks()
    if setting == "auto" and resumed_dtype is not None:
        return DtypeChoice("train_target", resumed_dtype, "resumed")
    cache_dir = cfg.data.get("cache_dir")
    if setting != "auto":
        return choose_target_dtype(setting, config, name, device, tokens, cache_dir)
    choice = choose_target_dtype(setting, config, name, device, tokens, cache_dir) if ranks.main else None  # fmt: skip
    return ranks.broadcast(choice)


def set_target_dtype(
    cfg: DictConfig, target: Target, row: dict, resumed_dtype: str | None = None,
    ranks: Ranks | None = None,
) -> DtypeChoice:  # fmt: skip
    """`target_dtype` for a target already loaded (its probe as long as `row`, at most
    PROBE_TOKENS), the target cast to it in place. A run chooses before loading instead."""
    tokens = min(PROBE_TOKENS, len(row["input_ids"]))
    choice = target_dtype(cfg, target.config, target.name, target.device, tokens, resumed_dtype, ranks)  # fmt: skip
    if target.dtype != resolve_dtype(choice.dtype):
        target.to(dtype=resolve_dtype(choice.dtype))
    return choice
