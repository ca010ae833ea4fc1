"""Whether a memory plan (train/run/memory_plan.py) fits: the memory one rank may use
(`device_memory`), the refusal of a launch that does not fit with the settings that would
(`check_fits`, `fitting_settings`), and the plan as text (`format_plan`, scripts/plan.py)."""

from __future__ import annotations

import os
from dataclasses import asdict

import torch

from train.run.memory_plan import FSDP_LAUNCH, GIB, MemoryPlan, spread_over_ranks
from train.run.shape_state import cached_widths


def device_memory(device: torch.device, processes_here: int = 1) -> tuple[int, str] | None:
    """(bytes one rank may use, what they are), or None when unknown: a CUDA device's total
    memory, or on a CPU the host's RAM shared by the processes on it."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index} total memory"
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        share = f" / {processes_here} processes" if processes_here > 1 else ""
        return ram // max(1, processes_here), f"host RAM{share}"
    return None


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def fitting_settings(plan: MemoryPlan, available: int) -> list[str]:
    """The settings that would make `plan` fit in `available` bytes per rank."""
    fixes = []
    if not plan.sharded:
        # the launch's own ranks when it has several, else the fewest GPUs that would do
        for n in [plan.ranks] if plan.ranks > 1 else (2, 4, 8, 16, 32, 64):
            unsharded = {"gradient_bytes": plan.gradient_bytes}  # as one process holds them
            sharded = MemoryPlan(**{**asdict(plan), **unsharded, "ranks": n, "sharded": True})
            spread_over_ranks(sharded)
            if sharded.peak_bytes() <= available:
                per_rank = gib(sharded.peak_bytes())
                fixes.append(f"FSDP over {n} ranks ({FSDP_LAUNCH} {n}): {per_rank} per rank")
                break
    if plan.activation_bytes:
        phases = plan.phase_bytes()
        fixed = phases["training"] - plan.activation_bytes  # a step's activations: per row
        per_row = plan.activation_bytes / plan.batch_size
        rows = int((available - fixed) // per_row) if available > fixed else 0
        others = max(v for k, v in phases.items() if k not in ("training", "held-out proxy"))
        if 1 <= rows < plan.batch_size and others <= available:
            fixes.append(f"train.batch_size={rows} (train.grad_accum keeps the global batch)")
        if plan.peak_bytes(checkpointing=True) <= available:
            fixes.append(
                f"gradient checkpointing of the draft's blocks: {gib(plan.peak_bytes(True))} "
                "per rank (not a setting of this project yet)"
            )
    return fixes


def check_fits(plan: MemoryPlan, available: int, what: str) -> None:
    """Refuse (ValueError) a launch whose plan exceeds `available` bytes per rank, with its
    numbers and the settings that would make it fit."""
    if plan.peak_bytes() <= available:
        return
    fixes = fitting_settings(plan, available)
    advice = ("Settings that fit: " + "; ".join(fixes)) if fixes else (
        "No setting tried fits (FSDP, a smaller batch, checkpointing): the target alone "
        f"needs {gib(plan.target_bytes)}; use a device with more memory or a smaller dtype."
    )  # fmt: skip
    raise ValueError(
        f"memory plan: this launch needs {gib(plan.peak_bytes())} per rank but {what} is "
        f"{gib(available)}.\n{format_plan(plan)}\n{advice}\n"
        "(python scripts/plan.py <the same overrides> prints this plan.)"
    )


def format_plan(plan: MemoryPlan) -> str:
    """The plan as lines of text, one per item."""
    shard = f", draft state sharded over {plan.ranks} ranks (FSDP)" if plan.sharded else ""
    count = f"{plan.draft_trainable or 0:,} trainable + {plan.draft_frozen or 0:,} frozen"
    count = "?" if plan.draft_trainable is None else count
    baseline = (
        "  process baseline  {:>12}  (this process before the target: interpreter, libraries)"
    )
    lines = [
        f"per rank, {plan.ranks} rank(s){shard}; batch {plan.batch_size} x {plan.max_len} tokens",
        f"  target weights    {gib(plan.target_bytes):>12}  ({plan.target_params:,} params, {plan.target_dtype}, {plan.target_name})",  # fmt: skip
        f"  draft parameters  {gib(plan.draft_bytes):>12}  ({plan.draft_kind}: {count})",
        f"  gradients         {gib(plan.gradient_bytes):>12}",
        f"  optimizer state   {gib(plan.optimizer_bytes):>12}  (AdamW: 2 float32 states per trainable param)",  # fmt: skip
        f"  activations       {gib(plan.activation_bytes):>12}  (tensors a meta forward saves, attention as a fused kernel)",  # fmt: skip
        f"  activations ckpt  {gib(plan.activation_bytes_checkpointed):>12}  (with gradient checkpointing of the draft's blocks)",  # fmt: skip
        f"  evaluation copies {gib(plan.evaluation_bytes):>12}  (decode.dtype copies of target and draft; 0: no decoding)",  # fmt: skip
        f"    of which compiled {gib(plan.compiled_bytes):>10}  (decode.compile on a CPU: each graph's packed weights)",  # fmt: skip
        f"  dtype verdicts    {gib(plan.verdict_bytes):>12}  (a CPU timing its dtypes: the target copied into the other candidate, freed before the copies)",  # fmt: skip
        f"  held-out proxy    {gib(plan.heldout_bytes):>12}  (train.heldout_proxy: cached taps, a batch's logits, a forward; the taps, {gib(plan.heldout_kept_bytes)}, kept after a pass before the last step)",  # fmt: skip
        f"  regeneration      {gib(plan.regeneration_bytes):>12}  (answering the training prompts: K/V slots, a prefill, a copy in data.regen_dtype)",  # fmt: skip
        f"  held-out answers  {gib(plan.heldout_regeneration_bytes):>12}  (train.heldout_proxy: the held-out prompts answered once, by the target in its dtype)",  # fmt: skip
        f"  matmul shapes     {gib(plan.shape_bytes):>12}  (a CPU: oneDNN's state per shape, {plan.shape_bytes_per_width / 2**20:.1f} MiB a width measured x {cached_widths(plan.shape_widths, plan.matmuls_per_width)} widths)",  # fmt: skip
        f"  DDP buckets       {gib(plan.bucket_bytes):>12}  (a second copy of the gradients)",
        f"  FSDP unsharded    {gib(plan.gathered_bytes):>12}  (a forward / backward's gathered unit; the checkpoint gathers {gib(plan.checkpoint_bytes)})",  # fmt: skip
        f"  peak              {gib(plan.peak_bytes()):>12}  (with checkpointing: {gib(plan.peak_bytes(True))})",  # fmt: skip
        "  per phase         "
        + ", ".join(f"{k} {v / GIB:.2f}" for k, v in plan.phase_bytes().items())
        + " GiB",  # fmt: skip
        f"  feature cache     {plan.feature_cache_bytes_per_token:,} bytes/token on disk; {gib(plan.feature_cache_bytes)} for the rows x max_len",  # fmt: skip
    ]
    if plan.baseline_bytes:
        lines.insert(1, baseline.format(gib(plan.baseline_bytes)))
    return "\n".join(lines + [f"  note: {n}" for n in plan.notes])
