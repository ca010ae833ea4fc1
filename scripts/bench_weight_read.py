"""The weight-read bound of one target forward on this machine: how long reading every weight
once takes, the floor under a batch-1 decode step (docs/fastpath.md).

Two measures over the embedded SmolLM2's bf16 weights (or the tiny target's), median of
--repeats: `amax` (one reduction over a flat copy of all weights: pure streaming) and `gemv`
(x @ W^T for every matrix whose input is the hidden size: what a 1-token forward must read,
per-operator overhead included).

    .venv/bin/python scripts/bench_weight_read.py --out runs/bench/weight_read.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from models.target_loaders import build_tiny_random, load_smollm2


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="runs/bench/weight_read.json")
    args = ap.parse_args()
    target = load_smollm2() if args.target == "smollm2" else build_tiny_random(seed=0)
    weights = [p.detach().to(torch.bfloat16).contiguous() for p in target.model.parameters()]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.cat([w.flatten() for w in weights])  # [N] bf16
    hidden = target.model.config.hidden_size
    mats = [w for w in weights if w.dim() == 2 and w.shape[1] == hidden]
    x = torch.ones(1, hidden, dtype=torch.bfloat16)  # [1, H]

    def gemv() -> None:
        for w in mats:
            torch.nn.functional.linear(x, w)

    result = {"target": args.target, "bytes": nbytes, "threads": torch.get_num_threads()}
    for name, fn in (("amax", lambda: torch.amax(flat)), ("gemv", gemv)):
        ts = timed(fn, args.repeats)
        med = statistics.median(ts)
        result[name] = {"median_ms": med * 1e3, "min_ms": min(ts) * 1e3, "max_ms": max(ts) * 1e3,
                        "gb_per_s": nbytes / med / 1e9}  # fmt: skip
        print(f"{name}: {nbytes / 1e6:.0f} MB in {med * 1e3:.2f} ms median "
              f"({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}), {nbytes / med / 1e9:.1f} GB/s")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
