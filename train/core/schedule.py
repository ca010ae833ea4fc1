"""What a training step reads and at which learning rate: the seeded row order and the LR
schedule.

One optimizer step = `grad_accum` micro-batches of `batch_size` rows on every rank. The
global batch (batch_size x world_size x grad_accum rows) is cut from one seeded stream of row
indices (a fresh permutation per epoch), rank r taking its slice, so 2 ranks x 2 rows see
exactly the rows of 1 rank x 4 rows, and the rows of any step follow from the number of rows
consumed before it. The LR schedule (`lr_lambda`) is built from the settings the set-up reads
(train/run/identity.py: schedule_settings), saved with each checkpoint.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_rows: int) -> tuple[int, ...]:
    """The seeded order of one epoch, drawn once (not once per row: the feature cache asks
    for a whole epoch at a time)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return tuple(torch.randperm(num_rows, generator=g).tolist())


def global_rows(first: int, count: int, num_rows: int, seed: int) -> list[int]:
    """Rows `first` .. `first + count - 1` of an endless stream that visits every row once
    per epoch in a seeded per-epoch order: an optimizer step's rows, `first` being the rows
    consumed before it (saved in each checkpoint, so a resumed run continues the stream even
    with another number of rows per step)."""
    out = []
    for j in range(first, first + count):
        epoch, pos = divmod(j, num_rows)
        out.append(_epoch_order(seed, epoch, num_rows)[pos])
    return out


def rank_chunks(
    rows: list[int], batch_size: int, grad_accum: int, rank: int, world: int
) -> list[list[int]]:
    """This rank's micro-batches of one step's global rows: micro-batch a of rank r is the
    (a * world + r)-th slice of `batch_size` rows."""
    return [
        rows[(a * world + rank) * batch_size : (a * world + rank + 1) * batch_size]
        for a in range(grad_accum)
    ]


def lr_lambda(
    warmup: int, total: int, min_ratio: float, time_progress: Callable[[], float] | None = None
) -> Callable[[int], float]:
    """Linear warmup over `warmup` steps, then cosine to `min_ratio`. The cosine's progress
    is (step - warmup) / (total - warmup), or `time_progress()` (spent share of a training
    time budget) when given: a run stopped by its budget then anneals as fully as one
    stopped by its step count, however slow its steps are."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if time_progress is not None:
            progress = min(1.0, time_progress())
        else:
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn
