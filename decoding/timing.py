"""Seconds of one forward through a target as decoding calls it, eager or compiled: what the
evaluation plan (train/eval/plan.py) weighs its dtype and path verdicts by."""

from __future__ import annotations

import copy
import statistics
import time

import torch

from decoding.compiled import CompiledTarget
from decoding.rounds import sync
from models.dtypes import cast_keep_rotary
from models.target import Target


def compiled_forward_seconds(
    target: Target, dtype: torch.dtype, width: int, cached: int, mode: str, layers: int = 2,
    max_len: int | None = None,
) -> float:  # fmt: skip
    """Seconds of one forward of `width` tokens over `cached` through a throwaway compiled
    copy of `target`'s first `layers` layers (embedding, final norm and head included) in
    `dtype` (float32 rotary; the target is untouched), its static cache `max_len` long
    (default: cached + width), times num_layers / layers: how
    `decode.dtype=auto` compares dtypes for a decode that runs compiled, by proxy. The eager
    timing does not predict it (on a CPU with AVX2 only the eager verify was faster in bf16
    while the compiled float32 AR step ran about 1.6x the compiled bf16 one, two evaluations,
    docs/portable.md), and compiling the whole target in every dtype costs minutes each
    (docs/fastpath.md, "Compile modes"): the proxy compiles a fifteenth of it, and gives
    its graph back when timed."""
    copy_ = Target(cast_keep_rotary(first_layers(target.model, layers), dtype),
                   target.tokenizer, name=target.name, check_head=False)  # fmt: skip
    max_len = max(max_len or 0, cached + width)
    compiled = CompiledTarget(copy_, max_len, (width,), (), mode=mode)
    try:
        compiled.warmup()
        return forward_seconds(compiled, width, cached, ()) * target.num_layers / copy_.num_layers
    finally:  # inductor would keep the copy's frozen weights for the rest of the process
        compiled.release()


def first_layers(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A deep copy of an HF causal LM keeping its first `layers` decoder layers (config
    updated); `model` is left as it was, and only the kept layers are copied."""
    decoder = model.model
    kept = min(layers, len(decoder.layers))
    all_layers = decoder.layers
    decoder.layers = torch.nn.ModuleList(all_layers[:kept])
    try:
        copy_ = copy.deepcopy(model)
    finally:
        decoder.layers = all_layers
    copy_.config.num_hidden_layers = kept
    if getattr(copy_.config, "layer_types", None):  # per-layer attention kinds (Gemma 3)
        copy_.config.layer_types = copy_.config.layer_types[:kept]
    return copy_


@torch.inference_mode()
def forward_seconds(
    target: Target | CompiledTarget, width: int, cached: int, hidden_layers: tuple[int, ...],
    repeats: int = 5,
) -> float:  # fmt: skip
    """Median seconds of one forward of `width` tokens (and the taps a drafter reads) over a
    cache of `cached` tokens, through `target` as decoding calls it, after one warm-up."""
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, target.vocab_size, (1, cached), generator=g).to(target.device)
    step = torch.randint(0, target.vocab_size, (1, width), generator=g).to(target.device)
    cache = target(prefix, hidden_layers=hidden_layers).cache
    times = []
    for _ in range(repeats + 1):  # the first is the warm-up
        sync(target.device)
        t0 = time.perf_counter()
        target(step, cache=cache, hidden_layers=hidden_layers)
        sync(target.device)
        times.append(time.perf_counter() - t0)
        cache.crop(-width)  # back to `cached` entries
    return statistics.median(times[1:])
