"""Time the target's forward in float32 and bfloat16 at the shapes a run uses, on this CPU.

    python scripts/bench_dtypes.py --out docs/bench_dtypes_cpu.json
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python scripts/bench_dtypes.py   # as an AVX2-only CPU

Shapes (rows x new tokens over a KV cache of --cached tokens): the AR step (1 x 1), verify
forwards of k + 1 = 4, 6, 8 and a 12-node tree + 1 (1 x 13), and a regeneration batch
(16 x 1). The two dtypes are interleaved shape by shape over --repeats rounds (medians and
spread over the rounds), so a drift of the machine hits both alike. Prints and writes JSON:
the machine (models.dtype_choice.machine_key), per shape both medians, the ratio bf16 / fp32
and the verify-to-step cost ratio of each dtype: what `dtype: auto` decides by.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from models.dtype_choice import machine_key, time_forward
from models.target_loaders import load_smollm2

SHAPES = [(1, 1), (1, 4), (1, 6), (1, 8), (1, 13), (16, 1)]  # (rows, new tokens)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cached", type=int, default=64, help="KV-cache length before the forward")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--inner", type=int, default=5, help="forwards per median inside a round")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    target = load_smollm2(dtype="float32")
    rounds: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for rows, new in SHAPES:
            for name, dtype in DTYPES.items():
                seconds = time_forward(target, dtype, rows, new, args.cached, repeats=args.inner)
                rounds.setdefault(f"{rows}x{new}/{name}", []).append(seconds)
    shapes = {}
    for rows, new in SHAPES:
        row = {}
        for name in DTYPES:
            times = rounds[f"{rows}x{new}/{name}"]
            row[name] = {"median_ms": 1e3 * statistics.median(times),
                         "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}  # fmt: skip
        row["bf16_over_fp32"] = row["bfloat16"]["median_ms"] / row["float32"]["median_ms"]
        shapes[f"{rows}x{new}"] = row
    for name in DTYPES:  # what a verify costs in steps of the same dtype
        step = shapes["1x1"][name]["median_ms"]
        for key in ("1x4", "1x6", "1x8", "1x13"):
            shapes[key][f"{name}_verify_over_step"] = shapes[key][name]["median_ms"] / step
    report = {
        "machine": machine_key(),
        "cached": args.cached,
        "repeats": args.repeats,
        "shapes": shapes,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
