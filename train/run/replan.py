"""The memory plan re-made with the shapes a run met (train/run/memory_plan.py).

A run is admitted with the plan's bounds: every held-out batch and every training batch
train.batch_size rows of data.max_len. Batches are padded to their own longest row, so
most are shorter; once a run knows its shapes, it re-plans with them, and summary.json
`memory` holds that plan beside the measured peaks (the admission stays the bound's)."""

from __future__ import annotations

import math

from train.run.memory_plan import MemoryPlan


def with_heldout_shapes(plan: MemoryPlan, shapes: list[tuple[int, int]]) -> MemoryPlan:
    """`plan` (in place) with the held-out proxy's batches as the data made them ([rows,
    padded length] each, every proxy's) in place of the bound it was made with: every batch
    train.batch_size rows of data.max_len. A run re-plans with them once its held-out rows
    exist (summary.json `memory`); the plan it was admitted with is the bound's."""
    if not plan.heldout_bytes or not shapes:
        return plan
    tokens = sum(rows * length for rows, length in shapes)
    taps = tokens * plan.feature_cache_bytes_per_token
    widest = max(rows * length for rows, length in shapes)
    plan.heldout_shapes = [(int(rows), int(length)) for rows, length in shapes]
    plan.heldout_bytes = taps + widest * plan.heldout_position_bytes + plan.heldout_stats_bytes
    plan.heldout_kept_bytes = taps if plan.heldout_kept_bytes else 0
    return plan


def with_train_batch(plan: MemoryPlan, widest: tuple[int, int] | None) -> MemoryPlan:
    """`plan` (in place) with the training activations at the widest micro-batch a run
    trained ([rows, padded length], the most positions) in place of the bound
    (train.batch_size x data.max_len); the activations scale with a batch's positions."""
    if widest is None or math.prod(widest) < 1:
        return plan
    plan.train_batch = (int(widest[0]), int(widest[1]))
    return plan
