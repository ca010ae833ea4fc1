"""Compile seconds and forward ms of the target, per compile mode, width and dtype, side by side.

    python scripts/bench_compiled_forward.py --out docs/bench_compiled_forward_modes_xeon_amx.json
    python scripts/bench_compiled_forward.py --modes default cpp-gemm --dtype bfloat16 --widths 1 4

What a speculative round costs depends on the verify width (k + 1 for a chain, tree size + 1
for a tree), and on a CPU the compiled path (decoding/compiled.py: static KV cache, inductor
with the target's weights frozen) changes that cost by several times, differently per width,
dtype and compile mode (docs/fastpath.md, "Compile modes"). Per dtype: the eager target over a
DynamicCache and, per --modes, a `CompiledTarget` whose graph for each width is compiled by its
first call, timed alone (`compile_s` per mode and width: the graphs a decode needs, the AR's
width 1 and the verify's k + 1, and what the first graph of a process pays beside them); then
--repeats rounds, each timing every width eagerly and in every mode, rotated, so the machine's
drift hits all alike (median of --inner forwards each). The forwards return the taps an
EAGLE-3 drafter reads (--taps), as the evaluation's do.

Inductor's on-disk cache is a fresh temporary directory unless --cache-dir names one: run
twice with the same --cache-dir to see what a second process on this machine compiles.
Prints and writes JSON: the machine (models.dtype_choice.machine_key), per dtype, mode and
width the compile seconds, per width and path the median and spread over rounds.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time

import torch

from decoding.compiled import CompiledTarget
from decoding.inductor import MODES
from models.dtype_choice import machine_key
from models.dtypes import cast_keep_rotary
from models.target import Target
from models.target_loaders import load_smollm2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def median_ms(fn, width: int, inner: int) -> float:
    times = []
    for _ in range(inner):
        t0 = time.perf_counter()
        fn(width)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


@torch.inference_mode()
def bench_dtype(target: Target, widths: list[int], modes: list[str], taps: tuple[int, ...],
                cached: int, repeats: int, inner: int) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (1, cached), generator=g)
    steps = {w: torch.randint(0, target.vocab_size, (1, w), generator=g) for w in widths}
    eager_cache = target(prefix, hidden_layers=taps).cache
    paths = {"eager": None}
    compile_s: dict[str, dict[str, float]] = {}
    for mode in modes:
        compiled = CompiledTarget(target, cached + max(widths), widths, taps, mode=mode)
        cache = compiled(prefix, hidden_layers=taps).cache  # the eager prefill
        compile_s[mode] = {}
        for w in widths:  # each graph's compile alone: its first call
            t0 = time.perf_counter()
            compiled(steps[w], cache=cache, hidden_layers=taps)
            compile_s[mode][str(w)] = time.perf_counter() - t0
            cache.truncate(cached)
            print(f"  {mode} width {w}: compiled in {compile_s[mode][str(w)]:.1f} s", flush=True)
        paths[mode] = (compiled, cache)

    def forward(path: str, w: int) -> None:
        if path == "eager":
            target(steps[w], cache=eager_cache, hidden_layers=taps)
            eager_cache.crop(-w)  # back to `cached` entries
        else:
            compiled, cache = paths[path]
            compiled(steps[w], cache=cache, hidden_layers=taps)
            cache.truncate(cached)

    for path in paths:  # one untimed call of each: allocations, first-call kernel choices
        for w in widths:
            forward(path, w)
    rounds: dict[str, list[float]] = {}
    order = list(paths)
    for r in range(repeats):
        for path in order[r % len(order) :] + order[: r % len(order)]:  # rotated per round
            for w in widths:
                ms = median_ms(lambda w, path=path: forward(path, w), w, inner)
                rounds.setdefault(f"{path}/{w}", []).append(ms)
    out: dict = {"compile_s": compile_s, "widths": {}}
    for w in widths:
        row = {}
        for path in paths:
            times = rounds[f"{path}/{w}"]
            row[path] = {"median_ms": statistics.median(times), "min_ms": min(times),
                         "max_ms": max(times)}  # fmt: skip
        out["widths"][str(w)] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--modes", nargs="+", default=["default", "max-autotune-no-cudagraphs",
                    "cpp-gemm"], choices=[m for m in MODES if m != "auto"])  # fmt: skip
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 4], help="tokens per forward")
    ap.add_argument(
        "--taps",
        nargs="*",
        type=int,
        default=[2, 15, 27],
        help="hidden layers returned (the flagship EAGLE-3 head's)",
    )
    ap.add_argument("--cached", type=int, default=160, help="KV-cache length before the forward")
    ap.add_argument("--repeats", type=int, default=6, help="interleaved rounds")
    ap.add_argument("--inner", type=int, default=5, help="forwards per median inside a round")
    ap.add_argument("--cache-dir", help="inductor's on-disk cache (default: a fresh temp dir)")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    widths = sorted(set(args.widths))
    if widths[0] < 1:
        ap.error(f"--widths are token counts >= 1, got {widths}")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="inductor-")
    loaded = load_smollm2(dtype="float32")
    report = {"machine": machine_key(), "cached": args.cached, "modes": args.modes,
              "taps": args.taps, "repeats": args.repeats, "inner": args.inner,
              "inductor_cache": "given" if args.cache_dir else "fresh", "dtypes": {}}  # fmt: skip
    for name in args.dtype:
        model = loaded.model
        if name != "float32":  # a copy: the float32 model stays for any later dtype
            model = cast_keep_rotary(copy.deepcopy(loaded.model), DTYPES[name])
        target = Target(model, loaded.tokenizer, name=loaded.name)
        print(f"{name}: compiling widths {widths} in modes {args.modes} ...", flush=True)
        report["dtypes"][name] = bench_dtype(target, widths, args.modes, tuple(args.taps),
                                             args.cached, args.repeats, args.inner)  # fmt: skip
        torch._dynamo.reset()  # the next dtype compiles its own graphs
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
