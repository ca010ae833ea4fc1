"""Regeneration engines side by side: transformers' `generate` and our batched loop.

    python scripts/bench_regen.py --out docs/bench_regen_cpu.json
    python scripts/bench_regen.py --prompts 32 --methods generate:16 answer_prompts:16 answer_prompts:64

The first --prompts training prompts of the default data (the embedded corpus, rendered with
the target's chat template), answered greedily with --max-new-tokens by each method in
turn, in --dtype, the methods rotated round by round (--repeats) so a drift of the machine
hits all alike. A method is ENGINE:BATCH: `generate` is `model.generate` over left-padded
batches of BATCH (what regeneration ran before train/data/answer_batch.py),
`answer_prompts` is what regeneration runs now (continuous batching over BATCH slots).
Prompts are sorted by length, longest first, as regeneration orders them. Prints and writes JSON: the machine, per method the
new tokens (each answer up to its EOS, as regeneration counts them), seconds and tokens/s
per round (median, min, max), and how many answers equal the first method's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from decoding.drafter import Sampling
from models.dtype_choice import machine_key
from models.dtypes import resolve_dtype
from models.target_loaders import load_smollm2
from train.data.answer_batch import answer_prompts
from train.data.prepare import prepare_data


def training_prompts(target, count: int) -> list[list[int]]:
    """The default data's first `count` training prompts (token ids up to the answer)."""
    data = prepare_data(target, num_train=count, regenerate=False, progress=False)
    prompts = []
    for ids, mask in zip(data.train["input_ids"], data.train["loss_mask"], strict=True):
        prompts.append(ids[: mask.index(1) + 1])  # the mask marks the tokens before answers
    return prompts


def run_generate(target, batch: list[list[int]], max_new_tokens: int, pad_id: int) -> list:
    width = max(len(p) for p in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, L]
    attention_mask = torch.zeros_like(input_ids)  # left padded
    for row, prompt in enumerate(batch):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    out = target.model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
        eos_token_id=target.eos_token_ids, pad_token_id=pad_id, do_sample=False,
    )  # fmt: skip
    return out[:, width:].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="what data.regen_dtype=auto picks here")
    ap.add_argument("--methods", nargs="+", default=["generate:16", "answer_prompts:64"])
    ap.add_argument("--repeats", type=int, default=2, help="rounds, methods rotated")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    methods = [(m.split(":")[0], int(m.split(":")[1])) for m in args.methods]
    if any(engine not in ("generate", "answer_prompts") for engine, _ in methods):
        ap.error(f"a method is generate:BATCH or answer_prompts:BATCH, got {args.methods}")
    target = load_smollm2(dtype=args.dtype)
    prompts = sorted(training_prompts(target, args.prompts), key=len, reverse=True)
    eos = set(target.eos_token_ids)
    pad_id = target.tokenizer.pad_token_id
    answers: dict[str, list[list[int]]] = {}
    seconds: dict[str, list[float]] = {}
    for round_ in range(args.repeats):
        for engine, size in methods[round_ % len(methods) :] + methods[: round_ % len(methods)]:
            name = f"{engine}:{size}"
            batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
            t0 = time.perf_counter()
            new = []
            with torch.inference_mode():
                if engine == "generate":
                    for batch in batches:
                        new += run_generate(target, batch, args.max_new_tokens, pad_id)
                else:
                    new = answer_prompts(target, prompts, args.max_new_tokens, Sampling(),
                                         sorted(eos), pad_id, slots=size)  # fmt: skip
            seconds.setdefault(name, []).append(time.perf_counter() - t0)
            cut = []  # each answer up to its EOS, as regeneration keeps it
            for tokens in new:
                stop = next((j for j, t in enumerate(tokens) if t in eos), None)
                cut.append(tokens if stop is None else tokens[: stop + 1])
            answers[name] = cut
    first = f"{methods[0][0]}:{methods[0][1]}"
    rows = {}
    for name, times in seconds.items():
        tokens = sum(len(a) for a in answers[name])
        rates = [tokens / s for s in times]
        rows[name] = {
            "new_tokens": tokens,
            "seconds": times,
            "tokens_per_s": {
                "median": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
            },  # fmt: skip
            f"answers_equal_to_{first}": sum(
                a == b for a, b in zip(answers[name], answers[first], strict=True)
            ),
        }
    report = {
        "machine": machine_key(),
        "dtype": str(resolve_dtype(args.dtype)).removeprefix("torch."),
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats,
        "methods": rows,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
