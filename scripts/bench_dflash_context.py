"""The DFlash drafter's cost per round as a generation grows (docs/dflash.md, "Context
cache"): SmolLM2-135M and an untrained DFlash draft of conf/draft/dflash.yaml's shape
(block 8, 2 layers, full vocabulary), greedy chains of k = 7 without EOS, one prompt. Per
generation length: the drafter's milliseconds per round (propose + commit) over all rounds
and over the last 16, the median over repeats.

    python scripts/bench_dflash_context.py [--lengths 128 512] [--repeats 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from decoding.drafters import make_drafter
from decoding.spec import generate
from models import dflash
from models.dtypes import cast_keep_rotary
from models.target_loaders import load_smollm2


def timed(drafter, times: list[float]):
    """Adds the seconds of every propose + commit pair of `drafter` to `times`."""
    propose, commit = drafter.propose, drafter.commit

    def propose_(*args, **kwargs):
        t0 = time.perf_counter()
        out = propose(*args, **kwargs)
        times.append(time.perf_counter() - t0)
        return out

    def commit_(*args, **kwargs):
        t0 = time.perf_counter()
        commit(*args, **kwargs)
        times[-1] += time.perf_counter() - t0

    drafter.propose, drafter.commit = propose_, commit_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    target = load_smollm2(dtype=args.dtype, device="cpu")
    torch.manual_seed(0)
    draft = cast_keep_rotary(dflash.from_target(target, block_size=8, num_layers=2), target.dtype)
    chat = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    ids = target.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    ids = torch.tensor(ids if isinstance(ids, list) else ids["input_ids"])[None]
    for n in args.lengths:
        every, last = [], []
        for _ in range(args.repeats):
            times: list[float] = []
            drafter = make_drafter(draft, target)
            timed(drafter, times)
            with torch.no_grad():
                generate(target, ids, drafter, k=7, max_new_tokens=n, eos_token_ids=[])
            every.append(1e3 * statistics.mean(times))
            last.append(1e3 * statistics.mean(times[-16:]))
        print(
            f"{n} new tokens ({len(times)} rounds, prompt {ids.shape[1]}): draft ms per round "
            f"{statistics.median(every):.2f} over all rounds, {statistics.median(last):.2f} "
            f"over the last 16 (median of {args.repeats})",
            flush=True,
        )


if __name__ == "__main__":
    main()
