"""Time one target forward eagerly and through the compiled path, per width and dtype.

    python scripts/bench_compiled_forward.py --out docs/bench_compiled_forward_cpu.json
    python scripts/bench_compiled_forward.py --dtype float32 --widths 1 6 9 13 17

What a speculative round costs depends on the verify width (k + 1 for a chain, tree size + 1
for a tree), and on a CPU the compiled path (decoding/compiled.py: static KV cache, inductor
with the target's weights frozen) can change that cost by several times, differently per
width and dtype (docs/portable.md). Per dtype: the eager target over a DynamicCache and a
`CompiledTarget` compiled at every --widths (its compile seconds reported apart), both over a
prefix of --cached tokens; then --repeats rounds, each timing every width eagerly and
compiled, interleaved (median of --inner forwards each), so the machine's drift hits both
alike. Prints and writes JSON: the machine (models.dtype_choice.machine_key), the compile
seconds, per width and path the median and spread over rounds, and each path's cost of a
width in 1-token forwards of the same path.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from decoding.compiled import CompiledTarget
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
def bench_dtype(target: Target, widths: list[int], cached: int, repeats: int, inner: int,
                mode: str) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (1, cached), generator=g)
    steps = {w: torch.randint(0, target.vocab_size, (1, w), generator=g) for w in widths}
    eager_cache = target(prefix, use_cache=True).cache
    compiled = CompiledTarget(target, max_len=cached + max(widths), widths=widths, mode=mode)
    t0 = time.perf_counter()
    compiled.warmup()
    compile_s = time.perf_counter() - t0
    static_cache = compiled(prefix).cache

    def eager(w: int) -> None:
        target(steps[w], cache=eager_cache, use_cache=True)
        eager_cache.crop(-w)  # back to `cached` entries

    def comp(w: int) -> None:
        compiled(steps[w], cache=static_cache)
        static_cache.truncate(cached)

    for w in widths:  # one untimed call of each: allocations, first-call kernel choices
        eager(w)
        comp(w)
    rounds: dict[str, list[float]] = {}
    for _ in range(repeats):
        for w in widths:
            rounds.setdefault(f"eager/{w}", []).append(median_ms(eager, w, inner))
            rounds.setdefault(f"compiled/{w}", []).append(median_ms(comp, w, inner))
    out: dict = {"compile_s": compile_s, "widths": {}}
    for w in widths:
        row = {}
        for path in ("eager", "compiled"):
            times = rounds[f"{path}/{w}"]
            row[path] = {"median_ms": statistics.median(times), "min_ms": min(times),
                         "max_ms": max(times)}  # fmt: skip
        row["compiled_over_eager"] = row["compiled"]["median_ms"] / row["eager"]["median_ms"]
        out["widths"][str(w)] = row
    first = str(widths[0])
    for w in widths:  # a width's cost in the path's own narrowest forwards
        row = out["widths"][str(w)]
        for path in ("eager", "compiled"):
            base = out["widths"][first][path]["median_ms"]
            row[f"{path}_over_width_{first}"] = row[path]["median_ms"] / base
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 6], help="tokens per forward")
    ap.add_argument("--cached", type=int, default=160, help="KV-cache length before the forward")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--inner", type=int, default=5, help="forwards per median inside a round")
    ap.add_argument("--mode", default="auto", help="decode.compile_mode (auto: CPU autotuning)")
    ap.add_argument("--out", help="write the JSON here too")
    args = ap.parse_args()
    widths = sorted(set(args.widths))
    if widths[0] < 1:
        ap.error(f"--widths are token counts >= 1, got {widths}")
    loaded = load_smollm2(dtype="float32")
    report = {"machine": machine_key(), "cached": args.cached, "mode": args.mode,
              "repeats": args.repeats, "inner": args.inner, "dtypes": {}}  # fmt: skip
    for name in args.dtype:
        model = loaded.model
        if name != "float32":  # a copy: the float32 model stays for any later dtype
            model = cast_keep_rotary(copy.deepcopy(loaded.model), DTYPES[name])
        target = Target(model, loaded.tokenizer, name=loaded.name)
        print(f"{name}: compiling widths {widths} ...", flush=True)
        report["dtypes"][name] = bench_dtype(
            target, widths, args.cached, args.repeats, args.inner, args.mode
        )
        torch._dynamo.reset()  # the next dtype compiles its own graphs
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
