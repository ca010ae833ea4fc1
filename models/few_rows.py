"""Linear layers whose products of a few rows run as W @ x^T: the eager verify's layout.

Why: `F.linear(x, W)` of a few rows x [m, K] against a tall weight W [N, K] runs, on some CPUs,
at a fraction of the speed of the same product written W @ x^T (a tall matrix times a thin
one). On the 2-core AVX2 EPYC, float32, medians of 50: the SmolLM2 head (N = 49152, K = 576)
at m = 4 took 22.0 ms as F.linear and 9.0 ms as W @ x^T (m = 1: 9.3 and 9.0 ms); a whole eager
verify of 4 tokens over 160 cached, 122 ms against 92 ms with every linear so written, an
AR step unchanged (~70 ms), interleaved. Other CPUs and bf16 kernels differ, so the layout is
a measured verdict per machine like a dtype (train/eval/plan.py: `products_choice`), never a
habit. Beyond `MAX_ROWS` rows (a training batch, a regeneration step) F.linear runs as before.

The swap changes the class of the model's own nn.Linear modules in place (`__class__`):
parameters, state_dict keys and hooks stay as they are, and `few_rows_products(model, False)`
swaps back. Subclasses of nn.Linear (LoRA wrappers, quantized layers) are left alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from models.dtype_choice import DtypeChoice, choose_measured, time_forward
from models.target import Target

MAX_ROWS = 8  # rows up to which W @ x^T: a verify of k + 1 <= 8 tokens, an AR step


class FewRowsLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        rows = x.numel() // max(x.shape[-1], 1)
        if rows > MAX_ROWS:
            return super().forward(x)
        flat = x.reshape(rows, x.shape[-1])  # [m, K]
        out = (self.weight @ flat.T).T  # [N, K] @ [K, m] -> [m, N]
        if self.bias is not None:
            out = out + self.bias
        return out.contiguous().reshape(*x.shape[:-1], out.shape[-1])


def few_rows_products(model: nn.Module, transposed: bool) -> int:
    """Every plain nn.Linear of `model` computes few-row products as W @ x^T (`transposed`)
    or as F.linear; returns how many layers it set."""
    plain, swapped = (nn.Linear, FewRowsLinear) if transposed else (FewRowsLinear, nn.Linear)
    count = 0
    for module in model.modules():
        if type(module) is plain:
            module.__class__ = swapped
            count += 1
    return count


def choose_layouts(
    targets: dict[str, Target | None], widths: dict[str, tuple[int, ...]], cached: int,
    cache_dir: str | Path | None,
) -> dict[str, DtypeChoice]:  # fmt: skip
    """For each target (None: skipped) the faster layout, "plain" (F.linear) or "transposed"
    (W @ x^T), as it decodes: the sum of one forward of each of its `widths` (a verify of
    k + 1 tokens, an AR step) over `cached` tokens, in its dtype; measured once per machine
    (models/dtype_choice.py: choose_measured). Each target is left in the layout chosen."""
    choices = {}
    for use, target in targets.items():
        if target is None:
            continue
        shapes = {"target": target.name, "dtype": str(target.dtype).removeprefix("torch."),
                  "widths": list(widths[use]), "cached": cached}  # fmt: skip

        def measure(layout: str, target: Target = target, use: str = use) -> float:
            few_rows_products(target.model, layout == "transposed")
            return sum(time_forward(target, target.dtype, 1, w, cached) for w in widths[use])

        choice = choose_measured(use, shapes, measure, cache_dir, ("plain", "transposed"))
        few_rows_products(target.model, choice.dtype == "transposed")
        choices[use] = choice
    return choices


def time_in_layout(
    target: Target, dtype: torch.dtype, width: int, cached: int, transposed: bool
) -> float:
    """`time_forward` of one row of `width` tokens over `cached` in `dtype` with the target's
    linears in a layout (a cast copy inherits it); the target is left plain."""
    few_rows_products(target.model, transposed)
    try:
        return time_forward(target, dtype, 1, width, cached)
    finally:
        few_rows_products(target.model, False)
