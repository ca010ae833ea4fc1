"""Data preparation at real size: a synthetic multi-turn set, prepared cold and warm.

    python scripts/bench_data.py --rows 100000 --out docs/reports/bench_data/rows100k.json
    python scripts/bench_data.py --rows 100000 --formats jsonl json parquet dir --runs cold warm

Builds a synthetic ShareGPT file of --rows multi-turn conversations from the embedded
corpus (stdlib source and Shakespeare's plays: 1-3 user/assistant turn pairs, ~330
tokens each, a few percent with a system turn), then runs the whole 1-step training process
of the issue's measurement in a child process per run,

    train.py +experiment=eagle_kl data=local data.source=F data.num_train=null
        data.regenerate=false train.steps=1 train.feature_cache=false train.eval_at_ckpt=false

under `/usr/bin/time -v`: `cold` with an empty data cache, `warm` again over the cache the
cold run left. Runs one at a time (never two torch jobs at once). Prints and writes JSON: the
machine, per format and run the process's wall seconds, peak RSS (GB) and the seconds the
preparation itself reported (`prepare_s` from its summary line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from models.dtype_choice import machine_key
from train.data.corpus import play_files, play_speeches, stdlib_files

ROOT = Path(__file__).resolve().parents[1]

ASKS = (
    "Explain what this does:\n\n{t}",
    "Can you continue this?\n\n{t}",
    "Summarise the following in plain words.\n\n{t}",
    "What is wrong with this, if anything?\n\n{t}",
    "Rewrite this more clearly:\n\n{t}",
)


def text_pool(seed: int, files: int = 300) -> list[str]:
    """Paragraphs of the embedded corpus: stdlib modules split at blank lines, play speeches."""
    pool = []
    for path, _ in stdlib_files(seed)[:files]:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        pool += [p for p in re.split(r"\n\s*\n", text) if 80 <= len(p) <= 1200]
    for path in play_files():
        pool += ["\n".join(s["lines"]) for s in play_speeches(path) if len(s["lines"]) >= 3]
    return pool


def synthetic_rows(rows: int, seed: int = 0):
    """`rows` ShareGPT conversations (dicts), 1-3 turn pairs each, drawn with `seed`."""
    rng, pool = random.Random(seed), text_pool(seed)
    for i in range(rows):
        turns = [{"from": "system", "value": "You are a helpful assistant."}] if i % 25 == 0 else []
        for _ in range(rng.choice((1, 2, 2, 3))):
            ask = rng.choice(ASKS).format(t=rng.choice(pool)[:400])
            turns += [{"from": "human", "value": ask}, {"from": "gpt", "value": rng.choice(pool)}]
        yield {"id": f"syn-{i}", "conversations": turns}


def write_rows(path: Path, rows: int, seed: int = 0) -> Path:
    """The synthetic set as .jsonl, .json (one array), .parquet, or (.dir) a dataset
    directory holding it as train.parquet (read through `datasets.load_dataset`)."""
    if path.suffix == ".dir":
        tmp = path.with_suffix(".dir.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        write_rows(tmp / "train.parquet", rows, seed)
        tmp.rename(path)
        return path
    tmp = path.with_suffix(path.suffix + ".tmp")
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows_iter, writer = synthetic_rows(rows, seed), None
        while batch := [row for _, row in zip(range(10_000), rows_iter)]:
            table = pa.Table.from_pylist(batch)
            writer = writer or pq.ParquetWriter(tmp, table.schema)
            writer.write_table(table)
        writer.close()
    else:
        with tmp.open("w", encoding="utf-8") as f:
            array = path.suffix == ".json"
            f.write("[\n" if array else "")
            for i, row in enumerate(synthetic_rows(rows, seed)):
                f.write(("," if array and i else "") + json.dumps(row) + "\n")
            f.write("]\n" if array else "")
    tmp.replace(path)
    return path


def run_once(source: Path, cache: Path, run_dir: Path, extra: list[str]) -> dict:
    cmd = [
        "/usr/bin/time", "-v", sys.executable, str(ROOT / "train.py"), "+experiment=eagle_kl",
        "data=local", f"data.source={source}", "data.num_train=null", "data.regenerate=false",
        "train.steps=1", "train.feature_cache=false", "train.eval_at_ckpt=false",
        f"data.cache_dir={cache}",
        f"run_dir={run_dir}", "overwrite=true", *extra,
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)[1])
    prep = re.search(r"prepared in ([\d.]+) s", proc.stdout + proc.stderr)
    return {
        "wall_s": round(wall, 1),
        "peak_rss_gb": round(rss_kb / 2**20, 3),
        "prepare_s": float(prep[1]) if prep else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument(
        "--formats", nargs="+", default=["jsonl"], choices=["jsonl", "json", "parquet", "dir"]
    )
    ap.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the set and caches go (default: tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the workdir")
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("overrides", nargs="*", help="more train.py overrides, e.g. data.num_proc=2")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine_key(), "rows": args.rows, "overrides": args.overrides, "runs": {}}
    try:
        for fmt in args.formats:
            source = work / f"synthetic-{args.rows}-{args.seed}.{fmt}"
            if not source.exists():
                t = time.perf_counter()
                write_rows(source, args.rows, args.seed)
                print(f"wrote {source} ({source.stat().st_size / 2**20:.0f} MB) in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)  # fmt: skip
            cache = work / f"cache-{fmt}"
            shutil.rmtree(cache, ignore_errors=True)
            for run in args.runs:
                figures = run_once(source, cache, work / "run", args.overrides)
                result["runs"][f"{fmt}/{run}"] = figures
                print(f"{fmt} {run}: {json.dumps(figures)}", flush=True)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
