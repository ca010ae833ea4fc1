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


class RecordMatmuls(TorchDispatchMode):
    """Records each matmul's operands as (op, ((shape, stride), ...)), once per distinct call."""

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


def step_matmuls(draft: torch.nn.Module, target: Target, rows: int, width: int) -> list[tuple]:
    """The distinct matmuls of one training step at [rows, width] (the plan's on the meta
    device, where `.item()` reads 1 and attention is the fused kernel's): the target's
    forward without gradients, the draft's forward and its backward from a loss on
    every offset's logits (what a step's backward reaches)."""
    ids = torch.zeros(rows, width, dtype=torch.long, device=target.device)
    mask = torch.ones_like(ids)
    recorder = RecordMatmuls()
    attention = mock.patch.object(F, "scaled_dot_product_attention", fused_attention)
    with MetaScalars(), recorder, attention:
        with torch.no_grad():
            t_out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
        out = draft(target, ids, t_out, mask, mask)
        sum(x.float().sum() for x in out.logits).backward()
    for p in draft.parameters():
        p.grad = None
    return list(recorder.calls)


def strided_normal(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Normal values viewed with `stride` (a stride 0 repeats an element: an expanded tensor)."""
    storage = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True) if n > 0)
    return torch.randn(storage if all(shape) else 0).to(dtype).as_strided(shape, stride)


def replay(calls: list[tuple], dtype: torch.dtype) -> None:
    """Runs each recorded matmul once on real tensors of its shapes and strides in `dtype`."""
    with torch.no_grad():
        for func, operands in calls:
            func(*(strided_normal(shape, stride, dtype) for shape, stride in operands))


def widths_met(max_len: int, pad_multiple: int, micro_batches: int | None = None) -> int:
    """The most batch widths a run can train at: one per multiple of `pad_multiple` up to
    `max_len` (no more than the micro-batches it trains, where that is known)."""
    widths = math.ceil(max_len / max(1, pad_multiple))
    return widths if micro_batches is None else max(0, min(widths, micro_batches))


def cached_widths(widths: int, matmuls_per_width: int) -> int:
    """How many widths' primitives the caches can hold: a width beyond them evicts an older
    one (ONEDNN_PRIMITIVE_CACHE_CAPACITY, oneDNN's own setting; 1,024 by default)."""
    capacity = int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY") or CACHE_CAPACITY)
    return min(widths, max(1, capacity // max(1, matmuls_per_width)))


def bytes_per_width(
    draft: torch.nn.Module, target: Target, rows: int, widths: list[int], dtype: torch.dtype
) -> tuple[int, int]:
    """(resident bytes one training width keeps, matmuls per width): the widest of `widths`
    warms up (what the first matmul of a kind creates once, and the buffers a library sizes
    to the largest matmul so far), the others are measured, the mean growth of
    `settled_rss` over them. `draft` and `target` on the meta device, as the plan builds
    them; `dtype` the one the run computes its matmuls in."""
    if len(widths) < 2:
        return 0, 0
    warm, *measured = sorted(widths, reverse=True)
    calls = step_matmuls(draft, target, rows, warm)
    largest = max((math.prod(shape) for _, operands in calls for shape, _ in operands), default=0)
    if largest * dtype.itemsize > REPLAY_LIMIT:
        raise ValueError(
            f"an operand of {largest * dtype.itemsize / 2**20:.0f} MiB is over the "
            f"{REPLAY_LIMIT // 2**20} MiB replayed where the plan is made"
        )
    replay(calls, dtype)
    per_width = [step_matmuls(draft, target, rows, w) for w in measured]
    before = settled_rss()
    for calls in per_width:
        replay(calls, dtype)
    grown = max(0, settled_rss() - before)
    return grown // len(measured), len(per_width[-1])


def settled_rss() -> int:
    """The resident bytes once the freed tensors' pages are given back (the replay makes no
    reference cycles: its tensors are freed as they go, so no collection is needed)."""
    give_back_freed()
    return process_memory() or 0


def probe_widths(max_len: int, pad_multiple: int, count: int = 3) -> list[int]:
    """The `count` smallest widths a run pads to (multiples of `pad_multiple` up to
    `max_len`): the replay's cost grows with the width, a cached primitive's size hardly
    does (docs/memory.md)."""
    step = max(1, pad_multiple)
    grid = [w for w in range(step, max_len + 1, step)] or [max_len]
    return grid[:count]
