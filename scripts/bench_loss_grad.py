"""Time LK^lambda's forward + backward: the written-out gradient against autograd.

    python scripts/bench_loss_grad.py --out runs/bench/loss_grad.json
    python scripts/bench_loss_grad.py --rows 512 --vocab 8192 --repeats 8

`lk_lambda` (train/losses/divergences.py) computes its gradient by hand in the forward pass
(`_LKLambdaRows`). The reference is the same maths through autograd as the other losses run
it (train/losses/rows.py): the decoder's alpha (`alpha_rows`) and KL over the draft ids
(`forward_kl_rows`), one activation-checkpointed chunk (`masked_reduce`). Both run on one
[rows, vocab] chunk with a reduced vocabulary (the full row's logsumexp passed), interleaved, the order swapped every
repeat; the first repeat of each is a warm-up. Prints and writes JSON: the machine, the
median and min-max per method, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from models.dtype_choice import machine_key
from train.losses.divergences import lk_lambda
from train.losses.rows import alpha_rows, forward_kl_rows, masked_reduce


def _autograd_rows(draft, target, log_norm, temperature: float, eta: float):  # noqa: ANN001
    alpha = alpha_rows(draft, target, log_norm, temperature)  # [n]
    lam = torch.exp(-eta * alpha.detach())
    return lam * forward_kl_rows(draft, target, temperature) + (1.0 - lam) * (1.0 - alpha)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, default=512, help="positions in the chunk")
    ap.add_argument("--vocab", type=int, default=8192, help="draft vocabulary (EAGLE-3's)")
    ap.add_argument("--repeats", type=int, default=6, help="interleaved passes (first: warm-up)")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    if args.repeats < 2:
        ap.error(f"--repeats must be >= 2 (the first is a warm-up), got {args.repeats}")
    g = torch.Generator().manual_seed(0)
    target = torch.randn(args.rows, args.vocab, generator=g) * 3  # [n, Vd]
    draft = target + torch.randn(args.rows, args.vocab, generator=g)
    rest = torch.randn(args.rows, args.vocab // 2, generator=g)  # the ids outside the draft's
    log_norm = torch.cat([target, rest], 1).logsumexp(-1)  # [n] the full row's
    mask = torch.ones(args.rows)
    reference = partial(_autograd_rows, temperature=1.0, eta=3.0)
    methods = {
        "written_out": lambda x: lk_lambda(x, target, mask, 1.0, log_norm, reduction="sum"),
        "autograd_checkpointed": lambda x: masked_reduce(
            reference, x, (target, log_norm), mask, args.rows, "sum"
        ),
    }
    seconds = {name: [] for name in methods}
    for rep in range(args.repeats):
        order = list(methods) if rep % 2 == 0 else list(methods)[::-1]
        for name in order:
            x = draft.clone().requires_grad_(True)
            t0 = time.perf_counter()
            methods[name](x).backward()
            seconds[name].append(time.perf_counter() - t0)
    rows = {
        name: {
            "median_ms": 1e3 * statistics.median(s[1:]),
            "min_ms": 1e3 * min(s[1:]),
            "max_ms": 1e3 * max(s[1:]),
        }  # fmt: skip
        for name, s in seconds.items()
    }
    ratio = rows["autograd_checkpointed"]["median_ms"] / rows["written_out"]["median_ms"]
    print(f"machine: {json.dumps(machine_key())}")
    print(f"LK^lambda forward + backward, [{args.rows}, {args.vocab}], {args.repeats - 1} repeats")
    for name, row in rows.items():
        print(f"  {name}: {row['median_ms']:.1f} ms ({row['min_ms']:.1f}-{row['max_ms']:.1f})")
    print(f"  autograd / written out: {ratio:.2f}x")
    if args.out:
        report = {"machine": machine_key(), "rows": args.rows, "vocab": args.vocab,
                  "repeats": args.repeats - 1, "methods": rows, "ratio": ratio}  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
