"""What an evaluation decodes, decided before it decodes (train/evaluate.py decodes it).

`plan_checkpoint` makes every decision of one checkpoint's evaluation, in this order, and
records each (summary.json `dtypes`):

1. **Dtypes** (`decode.dtype`, at a run's first evaluation): the frozen target in the dtype
   whose decode costs least per token on this machine (`decode_copies`: one forward of the
   verify's width over a typical cache plus the prompt's prefill spread over the new tokens;
   timed on the path the decode will take: compiled where `decode.compile=only` on a CPU,
   and with auto where `only` recorded it, since the eager verdict does not predict the
   compiled one), and in the dtype of the
   machine's fastest eager AR when that is another (the baseline of `speedup_best_ar`). The
   draft copy's dtype (`decode.draft_dtype`): the faster per verify round beside that target.
   Verdicts are measured once per machine and cached (models/dtype_choice.py); the copies keep
   float32 rotary frequencies (models.dtypes.cast_keep_rotary: a bare `.to(bfloat16)` rounds
   inv_freq and decodes another target than the one trained on).
2. **Path** (`decode.compile`): false = eager; only = the compiled decode is the evaluation;
   true = both, the compiled one's keys beside the eager ones; auto = the faster verify
   forward, compiled or eager, where compiling is repaid within this evaluation
   (`compile_choice`: the recorded compile seconds weighed against what its forwards can
   save; a CPU without a record decodes eagerly, `only` records). The compiled target and a draft copy
   with its drafter are built at a run's first evaluation and kept (`DecodeCopies`): later
   checkpoints copy their weights into that copy in place, so no graph is compiled again.
   On an eager CPU decode, each copy's linear layers then take the faster layout for the few
   rows they multiply (models/few_rows.py: F.linear or W @ x^T), measured once per machine.
3. **Baselines**: the AR in the decode dtype and, where the fastest eager AR runs in another
   dtype, that one too (`decode.same_dtype_ar=false`: that one only); with the compiled path
   the compiled AR and the eager AR in its fastest dtype. Decoded at the headline sampling
   only (train/evaluate.py).

With several processes rank 0 decides and every rank follows its verdicts (`copies_in`).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor

from decoding.compiled import STATS, CompiledTarget, use_compile_cache
from decoding.drafter import Drafter
from decoding.drafters import make_drafter
from decoding.drafters.lookup import with_lookup
from decoding.spec import generate
from decoding.timing import compiled_forward_seconds, forward_seconds
from decoding.tree import TreeSpec
from models import dtype_choice
from models.dtype_choice import DtypeChoice, choose_dtype, choose_measured, time_forward
from models.dtypes import cast_keep_rotary, resolve_dtype
from models.few_rows import choose_layouts, few_rows_products, time_in_layout
from models.target import Target
from train.data.prompt_file import ood_prompts, spread
from train.ranks import Ranks
from train.step_stats import decode_samplings

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


@dataclass
class DecodeCopies:
    """What train/evaluate.py: evaluate_checkpoint keeps for a run's next checkpoint."""

    target: Target  # the frozen target in the decoding dtype
    dtypes: dict  # decode.dtype's choice and the fastest AR's (models/dtype_choice.py)
    baseline: Target | None = None  # the frozen target in the fastest AR's dtype, if another
    compiled: CompiledTarget | None = None  # decode.compile: its compiled target, and the
    draft: torch.nn.Module | None = None  # draft copy (weights copied in at each checkpoint)
    drafter: Drafter | None = None  # and drafter whose graphs read them


@dataclass
class CheckpointPlan:
    """What `train.evaluate.evaluate_checkpoint` decodes at one checkpoint."""

    copies: DecodeCopies  # kept for the run's next checkpoint
    decode_target: Target  # the target the drafts are judged against (Medusa-2: adapted)
    drafter: Drafter  # the eager drafter over decode_target
    compiled: tuple[CompiledTarget, Drafter] | None  # the compiled path, where it decodes
    only_compiled: bool  # the compiled decode IS the evaluation
    prompts: list[Tensor]  # [1, T] each: the eval prompts
    ood: list[Tensor]  # [1, T] each: decode.ood_prompts
    tree: TreeSpec | None
    max_new_tokens: int


def plan_checkpoint(
    target: Target, draft: torch.nn.Module, eval_prompts: list[dict], cfg: DictConfig,
    target_eval: DecodeCopies | None, ranks: Ranks,
) -> CheckpointPlan:  # fmt: skip
    """The decisions of the module doc for `draft` at this checkpoint (dtypes and path at a
    run's first evaluation, kept in `target_eval` after it)."""
    dec = cfg.decode
    tree = None  # decode=tree_static / tree_dynamic: draft trees (decoding/tree.py)
    if dec.get("tree") is not None:
        tree = TreeSpec(**OmegaConf.to_container(dec.tree, resolve=True))
    use_compile_cache((cfg.get("data") or {}).get("cache_dir"))  # compiled code kept per machine
    if target_eval is None:  # rank 0 chooses the dtypes, every rank decodes in them
        if ranks.main:
            cache_dir = (cfg.get("data") or {}).get("cache_dir")
            taps = ()  # the drafter's, where decode_copies times a compiled verify
            if compiled_verify_timed(dec, target.device):
                taps = make_drafter(draft_decode_copy(draft, target.dtype), target).hidden_layers
            target_eval = decode_copies(target, dec, tree, eval_prompts, cache_dir, taps)
            prompt = torch.tensor(eval_prompts[0]["input_ids"], device=target.device)[None]
            choice = draft_dtype_choice(draft, target_eval.target, dec, tree, prompt, cache_dir)
            if choice.source != "explicit":
                print(f"dtype {choice.describe()}", flush=True)
            target_eval.dtypes["draft"] = choice.as_record()
        dtypes = ranks.broadcast(target_eval.dtypes if ranks.main else None)
        if not ranks.main:
            target_eval = copies_in(target, dtypes)
    draft_dtype = resolve_dtype(target_eval.dtypes["draft"]["dtype"])
    draft_eval = draft_decode_copy(draft, draft_dtype)
    # Medusa-2 trains a LoRA on the target: its drafts are judged against (and lossless
    # with respect to) the adapted target, so both AR and speculative runs decode that one.
    decode_target = draft_eval.decoding_target(target_eval.target)
    drafter = with_lookup(make_drafter(draft_eval, decode_target), dec.get("lookup_min_match", 0))
    chosen = spread(eval_prompts, dec.get("num_prompts"))  # over the categories' blocks
    prompts = [torch.tensor(p["input_ids"], device=decode_target.device)[None] for p in chosen]
    # decode.ood_prompts: kinds the training data has none of, decoded for tau alone
    ood = ood_prompts(
        dec.get("ood_prompts"), target.tokenizer, (cfg.get("data") or {}).get("chat_template")
    )
    ood = spread(ood, dec.get("ood_num_prompts") or len(prompts))  # over the file's kinds
    ood = [torch.tensor(p["input_ids"], device=decode_target.device)[None] for p in ood]
    max_new_tokens = int(dec.get("max_new_tokens", 64))
    samplings = decode_samplings(dec)  # eval tag ("greedy", "T0.7") -> Sampling
    compiled = None  # decode.compile: (compiled target, its drafter), beside the eager ones
    setting = dec.get("compile", False)
    max_len = max(p.shape[1] for p in prompts + ood) + max_new_tokens
    if setting in ("auto", "only") and "compile" not in target_eval.dtypes:
        spent = STATS.seconds
        if setting == "only":  # every rank compiles at once; rank 0 then times both paths
            compiled_decoding(target_eval, draft_eval, decode_target, drafter, dec, tree, max_len)
        choice = None  # decided at a run's first evaluation by rank 0, then kept
        if ranks.main:
            cache_dir = (cfg.get("data") or {}).get("cache_dir")
            # at most: the AR at the headline sampling, one verify per new token at each
            forwards = max_new_tokens * ((len(samplings) + 1) * len(prompts) + len(ood))
            choice = compile_choice(
                target_eval, draft_eval, decode_target, drafter, dec, tree, max_len,
                [p.shape[1] for p in prompts], cache_dir, forwards, STATS.seconds - spent,
            ).as_record()  # fmt: skip
            print(describe_compile(choice, setting), flush=True)
        target_eval.dtypes["compile"] = ranks.broadcast(choice)
    if setting == "auto":
        setting = "only" if target_eval.dtypes["compile"]["dtype"] == "compiled" else False
    only_compiled = setting == "only"  # the compiled decode IS the evaluation
    layout = str(dec.get("linear_layout", "plain"))  # conf/decode/chain.yaml: auto
    if layout not in ("auto", "plain", "transposed"):
        raise ValueError(f"decode.linear_layout={layout!r}: use auto, plain or transposed")
    copies = {"layout": target_eval.target, "layout_ar": target_eval.baseline}
    if not setting and target.device.type == "cpu" and layout != "plain":  # eager decoding
        if layout == "transposed":
            target_eval.dtypes["layout"] = DtypeChoice("layout", layout, "explicit").as_record()
            target_eval.dtypes["layout_ar"] = target_eval.dtypes["layout"]
        elif "layout" not in target_eval.dtypes:  # auto: measured by rank 0, once per run
            choices = None
            if ranks.main:
                _, cached, width = typical_shapes(dec, tree, eval_prompts)
                widths = {"layout": (width, 1), "layout_ar": (1,)}  # verify + AR step; AR step
                cache_dir = (cfg.get("data") or {}).get("cache_dir")
                choices = choose_layouts(copies, widths, cached, cache_dir)
                print("\n".join(f"linear {c.describe()}" for c in choices.values()), flush=True)
                choices = {use: c.as_record() for use, c in choices.items()}
            target_eval.dtypes.update(ranks.broadcast(choices))
        for use, copy_ in copies.items():  # every rank: rank 0's verdicts
            if copy_ is not None:
                few_rows_products(copy_.model, target_eval.dtypes[use]["dtype"] == "transposed")
    if setting:
        compiled = compiled_decoding(
            target_eval, draft_eval, decode_target, drafter, dec, tree, max_len
        )
    return CheckpointPlan(target_eval, decode_target, drafter, compiled, only_compiled, prompts,
                          ood, tree, max_new_tokens)  # fmt: skip


def typical_shapes(
    dec: DictConfig, tree: TreeSpec | None, eval_prompts: list[dict]
) -> tuple[int, int, int]:
    """A decode's typical prompt length, cache length and verify width, as its copies are
    timed: the median prompt, the cache halfway through max_new_tokens (multiples of 32)."""
    lengths = sorted(len(p["input_ids"]) for p in eval_prompts) or [64]
    prompt = max(32, 32 * round(lengths[len(lengths) // 2] / 32))
    cached = max(32, 32 * round((prompt + dec.max_new_tokens / 2) / 32))
    width = tree.size + 1 if tree is not None else int(dec.k) + 1
    return prompt, cached, width


def decode_copy(target: Target, dtype: torch.dtype) -> Target:
    """The target in the decoding dtype: the training target itself when it already has
    that dtype, else a frozen copy with float32 rotary frequencies (the training target is
    untouched)."""
    if target.dtype == dtype:
        return target
    model = cast_keep_rotary(copy.deepcopy(target.model), dtype)
    return Target(model, target.tokenizer, name=target.name)


def draft_decode_copy(draft: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of the draft in the decoding dtype with float32 rotary frequencies (drafters
    may freeze or convert the module they wrap; the trained draft is untouched). Medusa-2's
    adapted backbone (the target's weights with LoRA beside them) is neither copied nor
    cast: the copy refers to it, and its `decoding_target` reads the LoRA from it."""
    backbone = getattr(draft, "adapted", None)
    if backbone is None:
        return cast_keep_rotary(copy.deepcopy(draft), dtype).eval()
    draft.adapted = None
    try:
        copy_ = cast_keep_rotary(copy.deepcopy(draft), dtype).eval()
    finally:
        draft.adapted = backbone
    # a plain attribute, not a submodule: nothing done to the copy (.to, .eval, freezing)
    # reaches the training draft's LoRA
    object.__setattr__(copy_, "adapted", backbone)
    return copy_


def compiled_verify_timed(dec: DictConfig, device: torch.device) -> str | None:
    """Where decode.dtype=auto may time the verify on the compiled path (decode_copies): a
    CPU decoding with decode.compile=only ("only": timed compiled) or auto ("auto": the
    verdict `only` timed, where this machine has one; else eager timings, since the path
    is chosen after the dtype and timing a compiled verify costs a compile per dtype)."""
    path = str(dec.get("compile", False))
    timed = dec.get("dtype") == "auto" and device.type == "cpu" and path in ("auto", "only")
    return path if timed else None


def decode_copies(
    target: Target, dec: DictConfig, tree: TreeSpec | None, eval_prompts: list[dict],
    cache_dir: str | None, hidden_layers: tuple[int, ...] = (),
) -> DecodeCopies:  # fmt: skip
    """The frozen target in decode.dtype ("auto": the faster dtype for decoding on this
    machine), and in the dtype of the machine's fastest AR when that is another, for the
    speedup against the best AR (models/dtype_choice.py; docs/design.md §3). Each is timed as
    a decode costs per token: one forward of its width (a verify of k + 1 tokens or tree
    size + 1; an AR step) over a typical cache, plus the prompt's prefill spread over
    max_new_tokens, since a dtype that is fast for one row can be slow for many (a CPU
    without native bf16: docs/portable.md). With decode.compile=only on a CPU the verify is
    timed compiled (with the drafter's taps, `hidden_layers`), with auto the faster of eager
    and compiled: the path the decode will take decides its dtype."""
    prompt, cached, width = typical_shapes(dec, tree, eval_prompts)
    per = int(dec.max_new_tokens)
    path = compiled_verify_timed(dec, target.device)
    mode = str(dec.get("compile_mode", "auto"))
    # each eager dtype timed at its faster linear layout (models/few_rows.py); plan_checkpoint
    # then records the layout of the dtype chosen
    layouts = {"auto": (False, True), "transposed": (True,)}.get(dec.get("linear_layout"), ())
    choices: dict[str, DtypeChoice] = {}
    for use, setting, new in (("decode", dec.dtype, width), ("ar", "auto", 1)):
        shapes = {"target": target.name, "rows": 1, "new": new, "cached": cached,
                  "prefill": prompt, "per": per}  # fmt: skip
        if layouts and target.device.type == "cpu":  # not the verdict of plain linears alone
            shapes["layouts"] = ["transposed" if t else "plain" for t in layouts]
        timed = shapes | {"path": "only", "mode": mode, "taps": list(hidden_layers)}
        recorded = dtype_choice.cache_file(
            cache_dir, {**dtype_choice.machine_key(), "use": use, "shapes": timed}
        ).is_file()
        compiled = use == "decode" and (path == "only" or (path == "auto" and recorded))
        if compiled:  # a verdict timed eagerly is not this one
            shapes = timed

        def measure(dtype, new=new, compiled=compiled):
            prefill = time_forward(target, dtype, 1, prompt, 1)
            if not compiled:
                step = min(
                    time_in_layout(target, dtype, new, cached, t) for t in layouts or (False,)
                )
                return step + prefill / per
            step = compiled_forward_seconds(target, dtype, new, cached, hidden_layers, mode)
            return step + prefill / per

        choices[use] = choose_dtype(use, setting, shapes, measure, target.device, cache_dir)
        if choices[use].source != "explicit":
            print(f"dtype {choices[use].describe()}", flush=True)
    return copies_in(target, {u: c.as_record() for u, c in choices.items()})


def copies_in(target: Target, dtypes: dict) -> DecodeCopies:
    """The decoding copies for dtype choices already made (`DtypeChoice.as_record`s of
    "decode" and "ar"): how the other ranks follow rank 0's verdicts."""
    decode_dtype, ar_dtype = (resolve_dtype(dtypes[u]["dtype"]) for u in ("decode", "ar"))
    copy_ = decode_copy(target, decode_dtype)
    baseline = None if ar_dtype == decode_dtype else decode_copy(target, ar_dtype)
    return DecodeCopies(copy_, dict(dtypes), baseline)


def draft_dtype_choice(
    draft: torch.nn.Module, target: Target, dec: DictConfig, tree: TreeSpec | None,
    prompt: torch.Tensor, cache_dir: str | None,
) -> DtypeChoice:  # fmt: skip
    """decode.draft_dtype: as set; "auto": the dtype whose draft copy decodes a round
    fastest beside `target` (the decoding copy), timed as seconds per verify round of one
    prompt (the verify is the same for both, so the difference is the draft's). A small draft
    runs one-row forwards, where bf16 can win on a CPU whose many-row bf16 forwards lose
    (docs/portable.md). A draft that adapts the target (Medusa-2) follows the target's dtype.
    A dtype the drafter cannot run in times as infinite."""
    # Unset (a config written before the key existed): the target's dtype, as decoding was.
    setting = str(dec.get("draft_dtype", str(target.dtype).removeprefix("torch.")))
    if setting == "auto" and draft.decoding_target(target) is not target:
        setting = str(target.dtype).removeprefix("torch.")
    shapes = {"target": target.name, "target_dtype": str(target.dtype), "draft": draft.kind,
              "params": sum(p.numel() for p in draft.parameters()), "k": int(dec.k),
              "tree": repr(tree), "prompt": prompt.shape[1]}  # fmt: skip

    def measure(dtype: torch.dtype) -> float:
        copy_ = draft_decode_copy(draft, dtype)
        drafter = make_drafter(copy_, target)
        run = lambda: generate(target, prompt, drafter, k=int(dec.k), max_new_tokens=16,  # noqa: E731
                               eos_token_ids=[], tree=tree)  # fmt: skip
        try:
            with torch.no_grad():
                run()  # warm-up
                times = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    rounds = len(run().round_tokens)
                    times.append((time.perf_counter() - t0) / max(1, rounds))
        except (RuntimeError, TypeError) as err:  # e.g. a dtype mismatch inside the drafter
            print(f"dtype draft: {dtype} cannot decode ({str(err).splitlines()[0]})", flush=True)
            return float("inf")
        return statistics.median(times)

    return choose_dtype("draft", setting, shapes, measure, target.device, cache_dir)


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
    cache_dir: str | None, forwards: int, compiled_s: float = 0.0,
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
    setting = str(dec.get("compile"))
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
    spent = STATS.seconds

    def measure(path: str) -> float:
        if path == "eager":
            return forward_seconds(decode_target, width, cached, layers)
        compiled, _ = compiled_decoding(
            copies, draft_eval, decode_target, drafter, dec, tree, max_len
        )
        return forward_seconds(compiled, width, cached, layers)

    choice = choose_measured("compile", shapes, measure, cache_dir, ("eager", "compiled"))
    compile_s = compiled_s + STATS.seconds - spent
    if compile_s > 0:  # this evaluation compiled: what that cost, for later ones
        cost_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cost_file.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": cost_key, "seconds": compile_s}))
        tmp.replace(cost_file)
    if setting == "auto" and choice.dtype == "eager":  # no graphs kept for a path not used
        copies.compiled = copies.draft = copies.drafter = None
    return choice
