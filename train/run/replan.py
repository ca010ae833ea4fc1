"""The memory plan re-made with the shapes a run met (train/run/memory_plan.py).

A run is admitted with the plan's bounds: every held-out batch and every training batch
train.batch_size rows of data.max_len. Batches are padded to their own longest row, so
most are shorter; once a run knows its shapes, it re-plans with them, and summary.json
`memory` holds that plan beside the measured peaks (the admission stays the bound's). So
with the evaluation's dtypes: a run is admitted with the larger of the dtypes a CPU may
measure faster, and re-planned with the ones it measured."""

from __future__ import annotations

import math

from models.dtypes import resolve_dtype
from train.eval.compiled import DecodeCopies
from train.run.memory_plan import (
    COMPILED_COPIES,
    MemoryPlan,
    target_copy_bytes,
    timing_copy_bytes,
)


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


def with_train_batch(
    plan: MemoryPlan, widest: tuple[int, int] | None, shapes_met: int | None = None
) -> MemoryPlan:
    """`plan` (in place) with the training activations at the widest micro-batch a run
    trained ([rows, padded length], the most positions) in place of the bound
    (train.batch_size x data.max_len); the activations scale with a batch's positions. With
    `shapes_met`, the distinct micro-batch shapes this process trained, each a set of matmul
    shapes kept (train/run/shape_state.py), in place of the widths it could meet."""
    if shapes_met is not None:
        plan.shape_widths = int(shapes_met)
    if widest is None or math.prod(widest) < 1:
        return plan
    plan.train_batch = (int(widest[0]), int(widest[1]))
    return plan


def with_decode_dtypes(
    plan: MemoryPlan, decode: str, ar: str, draft: str, compiled: bool, measured: bool = True
) -> MemoryPlan:
    """`plan` (in place) with the evaluation's copies as its verdicts made them
    (train/eval/plan.py; summary.json `dtypes`) in place of the bound it was admitted with
    (decode.dtype=auto: the larger of the dtypes a CPU may measure faster): the target in
    the decoding dtype and in the fastest eager AR's where either is not its training dtype,
    the draft in `draft`, and with `compiled` the graphs' frozen weights in the decoding
    dtype (none where the evaluation decoded eagerly); the verdicts' timing copy only where
    a verdict was `measured` (not read from its record)."""
    if not plan.evaluation_bytes:
        return plan
    trained = resolve_dtype(plan.target_dtype)
    copies = target_copy_bytes(plan.target_params, trained, (decode,), (ar,))
    weights = plan.compiled_weights if compiled else 0
    plan.compiled_bytes = COMPILED_COPIES * weights * resolve_dtype(decode).itemsize
    draft_params = (plan.draft_trainable or 0) + (plan.draft_frozen or 0)
    plan.evaluation_bytes = (
        copies + draft_params * resolve_dtype(draft).itemsize + plan.compiled_bytes
    )
    plan.verdict_bytes = timing_copy_bytes(plan.target_params, trained) if measured else 0
    return plan


def with_recorded_dtypes(plan: MemoryPlan, records: dict, compiled: bool) -> MemoryPlan:
    """`with_decode_dtypes` from the verdicts' records (`DtypeChoice.as_record`s by use:
    `DecodeCopies.dtypes`, summary.json `dtypes`); the draft's, where none, the decoding's;
    with a compiled drafter's verdict as well, the wider of the two (at a later checkpoint the
    eager copy and the compiled drafter's copy are held at once)."""
    dtypes = {use: record["dtype"] for use, record in records.items() if isinstance(record, dict)}
    draft = dtypes.get("draft", dtypes["decode"])
    compiled_draft = dtypes.get("draft_compiled", draft)
    if resolve_dtype(compiled_draft).itemsize > resolve_dtype(draft).itemsize:
        draft = compiled_draft
    measured = any((records.get(use) or {}).get("source") == "measured" for use in ("decode", "ar"))
    return with_decode_dtypes(plan, dtypes["decode"], dtypes["ar"], draft, compiled, measured)


def replan_evaluation(plan: MemoryPlan, copies: DecodeCopies) -> MemoryPlan:
    """`with_recorded_dtypes` for an evaluation's `DecodeCopies` (train/eval/compiled.py)."""
    return with_recorded_dtypes(plan, copies.dtypes, copies.compiled is not None)
