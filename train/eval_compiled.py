"""The compiled path in evaluation (`decode.compile`: true | only | auto; train/evaluate.py,
decoding/compiled.py, docs/fastpath.md): building the compiled target and drafter once per
run, the measured choice of `auto`, and the speedups of an evaluation whose decode is the
compiled one."""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from decoding.compiled import STATS, CompiledTarget
from decoding.drafter import Drafter
from decoding.drafters import make_drafter
from decoding.drafters.lookup import with_lookup
from decoding.rounds import sync
from decoding.tree import TreeSpec
from models import dtype_choice
from models.dtype_choice import DtypeChoice, choose_measured
from models.dtypes import cast_keep_rotary
from models.target import Target


@dataclass
class DecodeCopies:
    """What train/evaluate.py: evaluate_checkpoint keeps for a run's next checkpoint."""

    target: Target  # the frozen target in the decoding dtype
    dtypes: dict  # decode.dtype's choice and the fastest AR's (models/dtype_choice.py)
    baseline: Target | None = None  # the frozen target in the fastest AR's dtype, if another
    compiled: CompiledTarget | None = None  # decode.compile: its compiled target, and the
    draft: torch.nn.Module | None = None  # draft copy (weights copied in at each checkpoint)
    drafter: Drafter | None = None  # and drafter whose graphs read them


# What the compiled path reports beside the eager keys, as <tag>/compiled_<key>.
COMPILED_KEYS = ("tau", "speedup", "tokens_per_s", "ar_tokens_per_s", "wall_time_ratio",
                 "greedy_match_rate")  # fmt: skip


def compiled_decoding(
    copies: DecodeCopies, draft_eval: torch.nn.Module, decode_target: Target, drafter: Drafter,
    dec: DictConfig, tree: TreeSpec | None, max_len: int,
) -> tuple[CompiledTarget, Drafter]:  # fmt: skip
    """The compiled target and drafter for this checkpoint's `draft_eval`. Built once; later
    checkpoints load their weights into the kept draft copy (and a Medusa-2 adapted target)
    in place: a new module would compile new graphs."""
    adapted = decode_target is not copies.target  # Medusa-2: weights change per checkpoint
    if copies.compiled is None:
        k = int(dec.k)
        widths = (1, tree.size + 1) if tree is not None else (1, k + 1)
        if tree is None and dec.get("adaptive_k", False):
            widths += (2 * k + 1,)  # adaptive k reaches 2k
        levels = (tree.top_k,) if tree is not None and tree.kind == "dynamic" else ()
        copies.compiled = CompiledTarget(
            decode_target, max_len + max(widths), widths, drafter.hidden_layers,
            mode=dec.get("compile_mode", "auto"), freeze=False if adapted else None,
            draft_widths=levels,  # an EAGLE-2 tree level's width, compiled before timing
        )  # fmt: skip
        copies.compiled.warmup()
        lookup = dec.get("lookup_min_match", 0)
        copies.draft = draft_eval
        copies.drafter = with_lookup(make_drafter(draft_eval, copies.compiled), lookup)
    else:
        copies.draft.load_state_dict(draft_eval.state_dict())
        if adapted:
            copies.compiled.model.load_state_dict(decode_target.model.state_dict())
    return copies.compiled, copies.drafter


def compile_choice(
    copies: DecodeCopies, draft_eval: torch.nn.Module, decode_target: Target, drafter: Drafter,
    dec: DictConfig, tree: TreeSpec | None, max_len: int, prompt_lengths: list[int],
    cache_dir: str | None, forwards: int,
) -> DtypeChoice:  # fmt: skip
    """decode.compile=auto: "compiled" (the compiled path is the evaluation, as
    decode.compile=only) where one verify forward (k + 1 tokens, or tree size + 1) of the
    compiled target is faster than the eager one's, over a typical cache, on this machine, and
    the seconds that saves over this evaluation's target forwards (`forwards`, an upper bound:
    every AR step and one verify per new token) repay what compiling cost; else "eager".
    Both are known once this machine compiled the target: its first evaluation compiles to
    measure (a compiled verdict keeps those graphs, `copies.compiled`; an eager one drops
    them) and records the verdict and the compile seconds (models/dtype_choice.py, per
    machine, target, dtype, width and mode); a later evaluation too small to repay them
    decodes eagerly without compiling ("weighed")."""
    width = tree.size + 1 if tree is not None else int(dec.k) + 1
    lengths = sorted(prompt_lengths)
    cached = min(lengths[len(lengths) // 2] + int(dec.max_new_tokens) // 2, max_len - width)
    layers = tuple(drafter.hidden_layers)
    shapes = {"target": decode_target.name, "dtype": str(decode_target.dtype),
              "device": decode_target.device.type, "width": width, "cached": cached,
              "mode": str(dec.get("compile_mode", "auto"))}  # fmt: skip
    machine = dtype_choice.machine_key()
    cost_key = {**machine, "use": "compile_s", "shapes": shapes}
    cost_file = dtype_choice.cache_file(cache_dir, cost_key)
    verdict_file = dtype_choice.cache_file(
        cache_dir, {**machine, "use": "compile", "shapes": shapes}
    )
    if copies.compiled is None and cost_file.is_file() and verdict_file.is_file():
        verdict = json.loads(verdict_file.read_text())
        seconds, compile_s = verdict["seconds"], json.loads(cost_file.read_text())["seconds"]
        saved_s = forwards * (seconds["eager"] - seconds["compiled"])
        if verdict["dtype"] == "compiled" and saved_s < compile_s:
            return DtypeChoice("compile", "eager", "weighed", seconds | {"compile": compile_s,
                               "saved at most": max(saved_s, 0.0)}, shapes)  # fmt: skip
    spent = STATS.seconds

    def measure(path: str) -> float:
        if path == "eager":
            return forward_seconds(decode_target, width, cached, layers)
        compiled, _ = compiled_decoding(
            copies, draft_eval, decode_target, drafter, dec, tree, max_len
        )
        return forward_seconds(compiled, width, cached, layers)

    choice = choose_measured("compile", shapes, measure, cache_dir, ("eager", "compiled"))
    if STATS.seconds > spent:  # this evaluation compiled: what that cost, for later ones
        cost_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cost_file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": cost_key, "seconds": STATS.seconds - spent}))
        tmp.replace(cost_file)
    if choice.dtype == "eager":  # no graphs kept for a path that is not used
        copies.compiled = copies.draft = copies.drafter = None
    return choice


def compiled_forward_seconds(
    target: Target, dtype: torch.dtype, width: int, cached: int, hidden_layers: tuple[int, ...],
    mode: str,
) -> float:  # fmt: skip
    """Seconds of one forward of `width` tokens over `cached` through a throwaway compiled
    copy of `target` in `dtype` (float32 rotary; the target is untouched): how `decode.dtype
    =auto` times a dtype for a decode that runs compiled. The eager timing does not predict it:
    on a CPU with AVX2 only the eager verify was faster in bf16 while the compiled float32 AR
    step ran about 1.6x the compiled bf16 one (two evaluations, docs/portable.md)."""
    copy_ = Target(cast_keep_rotary(copy.deepcopy(target.model), dtype), target.tokenizer,
                   name=target.name)  # fmt: skip
    compiled = CompiledTarget(copy_, cached + width, (width,), hidden_layers, mode=mode)
    compiled.warmup()
    return forward_seconds(compiled, width, cached, hidden_layers)


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


def compiled_against_both(m: dict) -> dict:
    """`decode.compile=only`: `summarize` of the compiled decode whose AR ran compiled (same
    target, dtype and graphs: `speedup`, `greedy_match_rate`) and eagerly in the fastest
    eager AR dtype (its `*best_ar*` keys). Renamed so each says which AR it divides by, and
    `speedup_best_ar` = against the faster of the two ARs, measured side by side
    (docs/design.md §3): no speedup is an artefact of a slow baseline."""
    m = dict(m)
    m["speedup_compiled_ar"], m["compiled_ar_tokens_per_s"] = m["speedup"], m["ar_tokens_per_s"]
    m["speedup_eager_ar"], m["eager_ar_tokens_per_s"] = (
        m["speedup_best_ar"],
        m["best_ar_tokens_per_s"],
    )
    m["eager_ar_dtype"] = m["best_ar_dtype"]
    compiled_wins = m["compiled_ar_tokens_per_s"] >= m["eager_ar_tokens_per_s"]
    m["best_ar"] = f"compiled {m['dtype']}" if compiled_wins else f"eager {m['eager_ar_dtype']}"
    m["best_ar_dtype"] = m["dtype"] if compiled_wins else m["eager_ar_dtype"]
    m["best_ar_tokens_per_s"] = max(m["compiled_ar_tokens_per_s"], m["eager_ar_tokens_per_s"])
    m["speedup_best_ar"] = m["tokens_per_s"] / m["best_ar_tokens_per_s"]
    return m
