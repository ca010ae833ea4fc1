"""The compiled path of an evaluation (decode.compile; docs/fastpath.md): what a run keeps
between checkpoints (`DecodeCopies`), the compiled target and drafter built once
(`compiled_decoding`), and the verdict of `decode.compile=auto` (`compile_choice`: the faster
verify forward where compiling pays within the evaluation), measured once per machine."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch

from decoding.compiled import CompiledTarget
from decoding.drafter import Drafter
from decoding.drafters import make_drafter
from decoding.drafters.lookup import with_lookup
from decoding.spec import generate
from decoding.timing import forward_seconds
from models import dtype_choice
from models.dtype_choice import DtypeChoice, choose_dtype, choose_measured
from models.dtypes import draft_decode_copy, resolve_dtype
from models.target import Target
from train.eval.settings import EvalSettings
from train.parallel.ranks import Ranks


@dataclass
class DecodeCopies:
    """What train/eval/evaluate.py: evaluate_checkpoint keeps for a run's next checkpoint."""

    target: Target  # the frozen target in the decoding dtype
    dtypes: dict  # decode.dtype's choice and the fastest AR's (models/dtype_choice.py)
    baseline: Target | None = None  # the frozen target in the fastest AR's dtype, if another
    compiled: CompiledTarget | None = None  # decode.compile: its compiled target, and the
    draft: torch.nn.Module | None = None  # draft copy (weights copied in at each checkpoint)
    drafter: Drafter | None = None  # and drafter whose graphs read them
    # what the compiled speculative decode verifies with: the compiled target, or the
    # drafter's view of it (`verify_target`: selfspec's rounds leave work in its cache)
    spec_target: CompiledTarget | None = None


# decode.compile=auto on a CPU that never compiled this decode: what to do about it
UNMEASURED = (
    ": compiling was never timed here (minutes on a CPU); `scripts/evaluate.py CKPT "
    "decode.compile=only` times and records it, and auto weighs it from then on"
)


def describe_compile(choice: dict, setting: str) -> str:
    """The console's line for `compile_choice`'s record."""
    times = "".join(f", {k} {v:.0f} s" if k in ("compile", "saved at most") else
                    f", {k} {v * 1e3:.1f} ms" for k, v in choice["seconds"].items())  # fmt: skip
    if setting == "only":  # compiled whatever the verdict
        return f"decode path: compiled (only; the faster verify: {choice['dtype']}{times})"
    hint = UNMEASURED if choice["source"] == "unmeasured" else ""
    return f"decode path: {choice['dtype']} (auto: {choice['source']}{times}){hint}"


def compile_setting(decode_compile: bool | str) -> str:
    """decode.compile as one of "false", "auto", "only"; `true` is `only` with the eager
    speculative decode beside it, so it compiles as `only` does."""
    setting = str(decode_compile).lower()
    return "only" if setting == "true" else setting


def compiled_verify_timed(
    decode_compile: bool | str, dtype: str, device: torch.device
) -> str | None:
    """Where decode.dtype=auto may time the verify on the compiled path (decode_copies): a
    CPU decoding with decode.compile=only or true ("only": timed compiled, by proxy) or auto
    ("auto": the verdict `only` timed, where this machine has one; else eager timings, since
    the path is chosen after the dtype)."""
    path = compile_setting(decode_compile)
    timed = dtype == "auto" and device.type == "cpu" and path in ("auto", "only")
    return path if timed else None


def target_widths(settings: EvalSettings) -> tuple[int, ...]:
    """The widths the compiled target's graphs run at: the AR's 1 and the verify's (k + 1, or
    tree size + 1), and 2k + 1 where adaptive k reaches 2k."""
    k, tree = settings.k, settings.tree
    widths = (1, tree.size + 1) if tree is not None else (1, k + 1)
    if tree is None and settings.adaptive_k:
        widths += (2 * k + 1,)
    return widths


def compiled_decoding(
    copies: DecodeCopies, draft_eval: torch.nn.Module, decode_target: Target, drafter: Drafter,
    settings: EvalSettings, max_len: int,
) -> tuple[CompiledTarget, CompiledTarget, Drafter]:  # fmt: skip
    """The compiled target (the AR's), what the speculative decode verifies with (the same,
    or the drafter's `verify_target`) and the drafter for this checkpoint's `draft_eval`.
    Built once; later checkpoints load their weights into the kept draft copy (and a
    Medusa-2 adapted target) in place: a new module would compile new graphs."""
    adapted = adapts_target(decode_target, copies.target)  # Medusa-2: weights change
    if copies.compiled is None:
        tree, widths = settings.tree, target_widths(settings)
        levels = (tree.top_k,) if tree is not None and tree.kind == "dynamic" else ()
        copies.compiled = CompiledTarget(
            decode_target, max_len + max(widths), widths, drafter.hidden_layers,
            mode=settings.compile_mode, freeze=False if adapted else None,
            draft_widths=levels,  # an EAGLE-2 tree level's width, compiled before timing
        )  # fmt: skip
        copies.compiled.warmup()
        copies.draft = draft_eval
        copies.drafter, copies.spec_target = drafter_on(draft_eval, copies.compiled, settings)
    else:
        copies.draft.load_state_dict(draft_eval.state_dict())
        if adapted:
            copies.compiled.model.load_state_dict(decode_target.model.state_dict())
    return copies.compiled, copies.spec_target, copies.drafter


def drafter_on(
    draft_copy: torch.nn.Module, compiled: CompiledTarget, settings: EvalSettings
) -> tuple[Drafter, CompiledTarget]:
    """The compiled drafter of `draft_copy` (its steps compiled by its warm-up) behind prompt
    lookup, and what its speculative decode verifies with (`verify_target`, or `compiled`)."""
    drafter = make_drafter(draft_copy, compiled)
    return with_lookup(drafter, settings.lookup_min_match), getattr(
        drafter, "verify_target", compiled
    )


def draft_dtype_setting(
    draft: torch.nn.Module, target: Target, settings: EvalSettings, prompt: torch.Tensor
) -> tuple[str, dict]:
    """decode.draft_dtype as a draft dtype verdict takes it, and the shapes it is keyed by:
    unset (a config written before the key existed) the target's dtype, as decoding was; a
    draft that adapts the target or shares its layers follows the target's dtype."""
    target_dtype = str(target.dtype).removeprefix("torch.")
    setting = settings.draft_dtype or target_dtype
    if setting == "auto" and draft.decoding_target(target) is not target:
        setting = target_dtype
    shapes = {"target": target.name, "target_dtype": str(target.dtype), "draft": draft.kind,
              "params": sum(p.numel() for p in draft.parameters()), "k": settings.k,
              "tree": repr(settings.tree), "prompt": prompt.shape[1]}  # fmt: skip
    return setting, shapes


def compiled_draft_choice(
    copies: DecodeCopies, draft: torch.nn.Module, settings: EvalSettings, prompt: torch.Tensor,
    ranks: Ranks, new_tokens: int = 32, repeats: int = 3,
) -> None:  # fmt: skip
    """decode.draft_dtype=auto where the speculative decode runs compiled: the dtype whose
    compiled drafter drafts a round fastest beside the compiled target (`copies.compiled`,
    built with the eager verdict's draft copy), timed where it decodes. The eager verdict
    (train/eval/plan.py: draft_dtype_choice) does not predict it: on an AMD EPYC with AVX2
    only it chose float32 in one process (168.5 against 230.0 ms) where this verdict, in
    another, drafted a round in 19.1 ms in float32 and 14.2 in bf16 (docs/results.md). Both
    drafters decode `prompt` greedily without lookup, one after the other `repeats` times
    after a warm-up; each dtype's seconds: the median of its draft seconds per round (the
    verify is the same forward for both; a dtype the drafter cannot run in times as
    infinite). Measured by rank 0 once per machine (models/dtype_choice.py,
    use "draft_compiled"), every rank follows; recorded in `copies.dtypes`; where another
    dtype wins, its drafter replaces the kept one (`copies.draft`, `drafter`, `spec_target`).
    A draft that adapts the target or shares its layers keeps the target's dtype."""
    current = next(copies.draft.parameters()).dtype
    new_tokens = min(new_tokens, settings.max_new_tokens)  # what the compiled cache holds
    setting, shapes = draft_dtype_setting(draft, copies.target, settings, prompt)
    built = {current: (copies.draft, copies.drafter, copies.spec_target)}

    def build(dtype: torch.dtype) -> tuple:
        if dtype not in built:
            copy_ = draft_decode_copy(draft, dtype)
            built[dtype] = (copy_, *drafter_on(copy_, copies.compiled, settings))
        return built[dtype]

    record = None
    if ranks.main:
        seconds: dict[torch.dtype, float] = {}

        def measure(dtype: torch.dtype) -> float:
            if not seconds:  # every candidate at once, alternating, so drift hits them alike
                candidates = [resolve_dtype(name) for name in dtype_choice.CANDIDATES]
                per_round = {c: [] for c in candidates}
                for rep in range(repeats + 1):  # the first is the warm-up
                    for c in [c for c in candidates if c not in seconds]:
                        try:
                            _, drafter, spec_target = build(c)
                            base = getattr(drafter, "base", drafter)  # without prompt lookup
                            result = generate(spec_target, prompt, base, k=settings.k,
                                              max_new_tokens=new_tokens, eos_token_ids=[],
                                              tree=settings.tree)  # fmt: skip
                        except (RuntimeError, TypeError) as err:  # e.g. a dtype mismatch
                            print(f"dtype draft_compiled: {c} cannot decode "
                                  f"({str(err).splitlines()[0]})", flush=True)  # fmt: skip
                            seconds[c] = float("inf")
                            continue
                        if rep:
                            per_round[c].append(result.draft_s / max(1, len(result.round_tokens)))
                # a dtype that failed after timed repeats keeps its infinite time
                seconds.update({c: statistics.median(t) for c, t in per_round.items()
                                if t and c not in seconds})  # fmt: skip
            return seconds[dtype]

        shapes |= {"new": new_tokens, "max_len": copies.compiled.max_len,
                   "mode": copies.compiled.mode}  # fmt: skip
        choice = choose_dtype("draft_compiled", setting, shapes, measure,
                              copies.target.device, settings.cache_dir)  # fmt: skip
        if choice.source != "explicit":
            print(f"dtype {choice.describe()}", flush=True)
        record = choice.as_record()
    copies.dtypes["draft_compiled"] = record = ranks.broadcast(record)
    copies.draft, copies.drafter, copies.spec_target = build(resolve_dtype(record["dtype"]))


def adapts_target(decode_target: Target, target: Target) -> bool:
    """Whether a draft's decoding target (DraftModel.decoding_target) has weights of its own
    (Medusa-2's LoRA), rather than being `target` itself or a view over its weights
    (a self-speculative draft's SharedCacheTarget: `same_weights`)."""
    return decode_target is not target and not getattr(decode_target, "same_weights", False)


def compile_choice(
    copies: DecodeCopies, draft_eval: torch.nn.Module, decode_target: Target, drafter: Drafter,
    settings: EvalSettings, max_len: int, prompt_lengths: list[int], forwards: int,
    compiled_s: float = 0.0,
) -> DtypeChoice:  # fmt: skip
    """The compiled path's verdict: "compiled" where one verify forward (k + 1 tokens, or tree
    size + 1) of the compiled target is faster than the eager one's, over a typical cache, on
    this machine, else "eager"; recorded per machine, target, dtype, width and mode
    (models/dtype_choice.py) with what compiling cost (`use: compile_s`).

    decode.compile=only compiles whatever the verdict (before this call: `compiled_s`, the
    seconds that took), times both paths and records them.
    decode.compile=auto decodes the compiled path only where compiling pays within this
    evaluation: with a record, where the seconds it saves over `forwards` (an upper bound:
    the AR and one verify per new token) exceed what compiling cost ("weighed" when they do
    not: eager, nothing compiled); without one, on a CPU it decodes eagerly ("unmeasured": a
    cold compile there costs minutes, more than one evaluation's forwards save; `only` records
    it), on CUDA it compiles to measure (an eager verdict drops the graphs)."""
    setting, tree, cache_dir = compile_setting(settings.compile), settings.tree, settings.cache_dir
    width = tree.size + 1 if tree is not None else settings.k + 1
    lengths = sorted(prompt_lengths)
    cached = min(lengths[len(lengths) // 2] + settings.max_new_tokens // 2, max_len - width)
    layers = tuple(drafter.hidden_layers)
    shapes = {"target": decode_target.name, "dtype": str(decode_target.dtype),
              "device": decode_target.device.type, "width": width, "cached": cached,
              "mode": settings.compile_mode}  # fmt: skip
    machine = dtype_choice.machine_key()
    cost_key = {**machine, "use": "compile_s", "shapes": shapes}
    cost_file = dtype_choice.cache_file(cache_dir, cost_key)
    verdict_file = dtype_choice.cache_file(
        cache_dir, {**machine, "use": "compile", "shapes": shapes}
    )
    recorded = cost_file.is_file() and verdict_file.is_file()
    if setting == "auto" and copies.compiled is None and recorded:
        verdict = json.loads(verdict_file.read_text())
        seconds, compile_s = verdict["seconds"], json.loads(cost_file.read_text())["seconds"]
        saved_s = forwards * (seconds["eager"] - seconds["compiled"])
        if verdict["dtype"] == "compiled" and saved_s < compile_s:
            return DtypeChoice("compile", "eager", "weighed", seconds | {"compile": compile_s,
                               "saved at most": max(saved_s, 0.0)}, shapes)  # fmt: skip
    elif setting == "auto" and copies.compiled is None and decode_target.device.type == "cpu":
        return DtypeChoice("compile", "eager", "unmeasured", {}, shapes)
    built_s = [compiled_s]  # wall seconds of building the compiled copies, warm-up included

    def measure(path: str) -> float:
        if path == "eager":
            return forward_seconds(decode_target, width, cached, layers)
        t0 = time.perf_counter()
        compiled, _, _ = compiled_decoding(
            copies, draft_eval, decode_target, drafter, settings, max_len
        )
        built_s.append(time.perf_counter() - t0)
        return forward_seconds(compiled, width, cached, layers)

    choice = choose_measured("compile", shapes, measure, cache_dir, ("eager", "compiled"))
    compile_s = sum(built_s)
    if compile_s > 0:  # this evaluation compiled: what that cost, for later ones
        cost_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cost_file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": cost_key, "seconds": compile_s}))
        tmp.replace(cost_file)
    if setting == "auto" and choice.dtype == "eager":  # no graphs kept for a path not used
        copies.compiled = copies.draft = copies.drafter = copies.spec_target = None
    return choice
