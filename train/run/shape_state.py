"""What a CPU run keeps for every matmul shape it meets, for the memory plan
(train/run/memory_plan.py): measured where the plan is made, as the process baseline is.

On a CPU, oneDNN (bf16 matmuls) keeps a primitive for every shape it meets, with its
JIT-generated kernels and scratch, in two caches of up to 1,024 entries each (oneDNN's and
ideep's), and keeps them for good. A training step at a new batch width meets every one of
its matmuls at a new shape; batches are padded to a multiple of train.pad_multiple, so a run
meets at most one set per multiple up to data.max_len. docs/memory.md measured this as most
of what a first run kept beyond its tensors.

`bytes_per_width` measures one width's set: it records the matmuls of one training step
(the target's forward, the draft's forward and backward) on the meta device, then runs
those shapes on real tensors at widths the run would meet and reads how much the process's
resident memory grew once the freed tensors' pages are given back (the primitives live in
the C++ heap, their kernels' code in pages of their own: RSS counts both, as a run's peak
does). Where no matmul keeps state (float32 on MKL) it reads ~0.
"""

from __future__ import annotations

import math
import os
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.target import Target
from train.phase_memory import give_back_freed, process_memory
from train.run.meta_forward import MetaScalars, fused_attention

# the matmuls that reach oneDNN on a CPU (linear layers decompose to these)
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
CACHE_CAPACITY = 1024  # oneDNN's and ideep's default primitive cache capacity, each
# The largest operand replayed where the plan is made: a bigger target's weights would be
# copied to measure (an 8B's vocabulary projection is 2 GiB in float32) before the plan has
# said whether the run fits
REPLAY_LIMIT = 256 * 2**20
MIN_PROBE = 16  # the narrowest width replayed (`probe_widths`)
Matmul = tuple  # (aten op, ((shape, stride), ...) of its operands)


class RecordMatmuls(TorchDispatchMode):
    """Records each matmul as (op, ((shape, stride), ...) of its operands), once per distinct
    call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[tuple, None] = {}  # insertion-ordered set

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            operands = tuple(
                (tuple(a.shape), tuple(a.stride())) for a in args if isinstance(a, torch.Tensor)
            )
            self.calls[(func, operands)] = None
        return func(*args, **(kwargs or {}))


def step_matmuls(
    draft: torch.nn.Module, target: Target, rows: int, width: int
) -> tuple[list[Matmul], list[Matmul]]:
    """The distinct matmuls of one training step at [rows, width] (the plan's on the meta
    device, where `.item()` reads 1 and attention is the fused kernel's): (the target's
    forward without gradients, the draft's forward and its backward from a loss on every
    offset's logits, what a step's backward reaches). Apart: the draft may compute in
    another dtype (autocast)."""
    ids = torch.zeros(rows, width, dtype=torch.long, device=target.device)
    mask = torch.ones_like(ids)
    target_calls, draft_calls = RecordMatmuls(), RecordMatmuls()
    attention = mock.patch.object(F, "scaled_dot_product_attention", fused_attention)
    try:
        with MetaScalars(), attention:
            with torch.no_grad(), target_calls:
                t_out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
            with draft_calls:
                out = draft(target, ids, t_out, mask, mask)
                sum(x.float().sum() for x in out.logits).backward()
    finally:  # the draft is the plan's own, but it is handed back as it came
        for p in draft.parameters():
            p.grad = None
    return list(target_calls.calls), list(draft_calls.calls)


def strided_zeros(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Zeros viewed with `stride` (a stride 0 repeats an element: an expanded tensor). A
    primitive depends on shapes, strides and dtype, not values: zeros are made in `dtype`
    directly (no float32 copy on the way) and draw nothing from the RNG."""
    storage = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0)
    return torch.zeros(storage if all(shape) else 0, dtype=dtype).as_strided(shape, stride)


def replay(calls: list[Matmul], dtype: torch.dtype) -> None:
    """Runs each recorded matmul once on real tensors of its shapes and strides in `dtype`."""
    with torch.no_grad():
        for func, operands in calls:
            func(*(strided_zeros(shape, stride, dtype) for shape, stride in operands))


def widths_met(max_len: int, pad_multiple: int, micro_batches: int | None = None) -> int:
    """The most batch widths a run can train at: one per multiple of `pad_multiple` up to
    `max_len` (no more than the micro-batches it trains, where that is known)."""
    widths = math.ceil(max_len / max(1, pad_multiple))
    return widths if micro_batches is None else max(0, min(widths, micro_batches))


def cache_capacity() -> int:
    """oneDNN's primitive cache capacity: ONEDNN_PRIMITIVE_CACHE_CAPACITY where it is set to
    a number (0 turns the caches off), else 1,024."""
    setting = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "")
    return int(setting) if setting.strip().isdigit() else CACHE_CAPACITY


def cached_widths(widths: int, matmuls_per_width: int) -> int:
    """How many widths' primitives the caches can hold: a width beyond them evicts an older
    one (none with the caches off)."""
    capacity = cache_capacity()
    if capacity <= 0:
        return 0
    return min(widths, max(1, capacity // max(1, matmuls_per_width)))


def bytes_per_width(
    draft: torch.nn.Module, target: Target, rows: int, widths: list[int],
    target_dtype: torch.dtype, draft_dtype: torch.dtype,
) -> tuple[int, int]:  # fmt: skip
    """(resident bytes one training width keeps, distinct matmuls per width): the widest of
    `widths` warms up (what the first matmul of a kind creates once, and the buffers a
    library sizes to the largest matmul so far), the others are measured, the mean growth
    of `settled_rss` over them. `draft` and `target` on the meta device, as the plan builds
    them; the target's matmuls replayed in `target_dtype`, the draft's in `draft_dtype`
    (bf16 under autocast)."""
    if len(widths) < 2:
        raise ValueError(f"widths {widths}: one warms up, at least one more is measured")
    warm, *measured = sorted(widths, reverse=True)
    on_target, on_draft = step_matmuls(draft, target, rows, warm)
    largest = max(
        [math.prod(shape) * target_dtype.itemsize for _, ops in on_target for shape, _ in ops]
        + [math.prod(shape) * draft_dtype.itemsize for _, ops in on_draft for shape, _ in ops]
    )  # fmt: skip
    if largest > REPLAY_LIMIT:
        raise ValueError(
            f"an operand of {largest / 2**20:.0f} MiB is over the "
            f"{REPLAY_LIMIT // 2**20} MiB replayed where the plan is made"
        )
    replay(on_target, target_dtype)
    replay(on_draft, draft_dtype)
    per_width = [step_matmuls(draft, target, rows, w) for w in measured]
    before = settled_rss()
    for on_target, on_draft in per_width:
        replay(on_target, target_dtype)
        replay(on_draft, draft_dtype)
    grown = max(0, settled_rss() - before)
    distinct = {(func, ops, dtype) for calls, dtype in ((on_target, target_dtype), (on_draft, draft_dtype)) for func, ops in calls}  # fmt: skip
    return grown // len(measured), len(distinct)


def settled_rss() -> int:
    """The resident bytes once the freed tensors' pages are given back (the replay makes no
    reference cycles: its tensors are freed as they go, so no collection is needed)."""
    give_back_freed()
    return process_memory() or 0


def probe_widths(max_len: int, pad_multiple: int, count: int = 3) -> list[int]:
    """The `count` smallest widths of at least MIN_PROBE a run pads to (multiples of
    `pad_multiple`, the longest row of `max_len` rounded up: train/data/prepare.py collate;
    fewer where fewer exist): the replay's cost grows with the width, a cached primitive's
    size hardly does above it (docs/memory.md); below it a matrix of a few rows may take
    another kernel (a matrix-vector one). A run whose every width is narrower (a short
    `data.max_len`) is probed at its `count` widest: the kernels it does meet."""
    step = max(1, pad_multiple)
    grid = list(range(step, -(-max_len // step) * step + 1, step))  # what collate pads to
    wide = [w for w in grid if w >= MIN_PROBE]
    return wide[:count] if wide else grid[-count:]
