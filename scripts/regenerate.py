"""Build (and cache) the training data ahead of a run: answer the prompts with the target.

    python scripts/regenerate.py                                  # embedded target + corpus
    python scripts/regenerate.py data=tiny target=tiny_random     # a smoke test
    python scripts/regenerate.py data=local data.source=chats.jsonl target=hf target.path=DIR
    python scripts/regenerate.py data.num_train=16 --samples 2   # measure tokens/s
    python scripts/regenerate.py data.regen_backend=openai data.regen_model=NAME  # a server answers

Arguments are Hydra overrides of the `target` and `data` groups (conf/) plus `device=`.
A rerun resumes from the cache; prints the dataset stats (sizes, regeneration tokens/s)
as JSON, and `--samples N` prints N training rows with their trained tokens marked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from train.data.prepare import prepare_data
from train.data.sources import check_source
from train.formats.export import load_target
from train.run.compose import compose_target_data
from train.run.settings import check_regen_backend


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "overrides", nargs="*", help="target=NAME data=NAME data.KEY=VALUE device=cpu"
    )
    parser.add_argument("--samples", type=int, default=0, help="print this many training rows")
    parser.add_argument("--json", type=Path, default=None, help="also write the stats here")
    args = parser.parse_args(argv)

    if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
        raise ValueError(f"--json {args.json}: give a file in an existing directory")
    cfg = compose_target_data(args.overrides)
    check_source(cfg.data.source)  # a missing or empty file, before the target loads
    check_regen_backend(cfg.data)  # the backend's settings, likewise

    t0 = time.perf_counter()
    target = load_target(cfg)  # the loader's own error (a missing target.path), not Hydra's
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    data = prepare_data(target, **OmegaConf.to_container(cfg.data, resolve=True))
    stats = {
        "target": target.name,
        "target_load_s": round(load_s, 2),
        "prepare_s": round(time.perf_counter() - t0, 2),
        **data.stats,
    }
    print(json.dumps(stats, indent=1))
    if args.json:
        args.json.write_text(json.dumps(stats, indent=1))

    tok = target.tokenizer
    for row in data.train.select(range(min(args.samples, len(data.train)))):
        ids, mask = row["input_ids"], row["loss_mask"]
        # loss_mask[t] trains the prediction of token t+1: mark those tokens with [[ ]].
        trained = [0] + mask[:-1]
        text = "".join(
            f"[[{tok.decode([i])}]]" if m else tok.decode([i]) for i, m in zip(ids, trained)
        )
        print(f"\n===== {row['category']} {row['group']} ({len(ids)} tokens, {sum(mask)} trained)")
        print(text)


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as err:  # a refusal: one line, no traceback
        sys.exit(f"regenerate.py: error: {err}")
