"""What an evaluation decodes, decided before it decodes (train/eval/evaluate.py decodes it).

`plan_checkpoint` makes every decision of one checkpoint's evaluation, in this order, and
records each (summary.json `dtypes`):

1. **Dtypes** (`decode.dtype`, at a run's first evaluation): the frozen target in the dtype
   whose decode costs least per token on this machine (`decode_copies`: one forward of the
   verify's width over a typical cache plus the prompt's prefill spread over the new tokens;
   timed on the path the decode will take: compiled where the compiled path is the
   evaluation on a CPU, by a compiled copy of the first layers, and with auto where `only`
   recorded it, since the eager verdict does not predict the compiled one), and in the dtype
   of the machine's fastest eager AR when that is another. The draft copy's dtype
   (`decode.draft_dtype`): the faster per verify round beside that target; where the decode
   runs compiled, chosen again on the compiled drafter beside the compiled target
   (train/eval/compiled.py: `compiled_draft_choice`, recorded as `draft_compiled`). Verdicts are
   measured once per machine and cached (models/dtype_choice.py); the copies keep float32
   rotary frequencies (models.dtypes.cast_keep_rotary: a bare `.to(bfloat16)` rounds
   inv_freq and decodes another target than the one trained on).
2. **Path** (`decode.compile`, train/eval/compiled.py): false = eager; only = the compiled
   decode is the evaluation; true = that, and the eager speculative decode beside it; auto =
   the faster verify forward, compiled or eager, where compiling is repaid within this
   evaluation (`compile_choice`; a CPU without a record decodes eagerly, `only` records). The
   compiled target and a draft copy with its drafter are built at a run's first evaluation
   and kept (`DecodeCopies`): later checkpoints copy their weights into that copy in place,
   so no graph is compiled again. On a CPU each eager copy's linear layers take the faster
   layout for the few rows they multiply (models/few_rows.py: F.linear or W @ x^T), measured
   once per machine.
3. **Passes** (decoding.metrics.Pass), decoded at every sampling, interleaved prompt by
   prompt: the speculative decode ("spec"); the trained drafter alone where prompt lookup
   drafts too ("head"); the AR on the spec decode's path and dtype ("ar": the compiled AR on
   the compiled path) and the eager AR in its fastest dtype ("ar_eager", where "ar" is not
   it; decode.same_dtype_ar=false on the eager path: that one only); with compile=true the
   eager speculative decode ("eager_spec"). The out-of-domain prompts: "spec" and "head" at
   the headline sampling (`ood_passes`).
4. **Samplings**: decode.temperatures, greedy first where configured (the headline).

With several processes rank 0 decides and every rank follows its verdicts (`copies_in`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.lookup import LookupDrafter, with_lookup
from decoding.inductor import use_compile_cache
from decoding.metrics import Pass, path_of
from decoding.spec import generate
from decoding.timing import compiled_forward_seconds
from decoding.tree import TreeSpec
from models import dtype_choice
from models.dtype_choice import DtypeChoice, choose_dtype, time_forward
from models.dtypes import draft_decode_copy, resolve_dtype
from models.few_rows import choose_layouts, few_rows_products, time_in_layout
from models.target import Target, decode_copy
from train.data.prompt_file import ood_prompts, spread
from train.eval.compiled import (
    DecodeCopies,
    adapts_target,
    compile_choice,
    compile_setting,
    compiled_decoding,
    compiled_draft_choice,
    compiled_verify_timed,
    describe_compile,
    draft_dtype_setting,
    target_widths,
)
from train.eval.settings import EvalSettings
from train.parallel.ranks import Ranks
from train.phase_memory import phase

PROXY_LAYERS = 2  # the target's first layers a compiled dtype verdict is timed on


@dataclass
class CheckpointPlan:
    """What `train.eval.evaluate.evaluate_checkpoint` decodes at one checkpoint."""

    copies: DecodeCopies  # kept for the run's next checkpoint
    samplings: list[tuple[str, Sampling]]  # eval tag ("greedy", "T1") -> sampling, headline first
    passes: list[Pass]  # decoded at every sampling, interleaved prompt by prompt
    ood_passes: list[Pass]  # decoded on `ood` at the headline sampling: "spec", "head"
    lookup: LookupDrafter | None  # the spec decode's prompt lookup, whose rounds are counted
    path: str  # the spec decode's: "compiled" or "eager"
    prompts: list[Tensor]  # [1, T] each: the eval prompts
    ood: list[Tensor]  # [1, T] each: decode.ood_prompts
    tree: TreeSpec | None
    max_new_tokens: int

    @property
    def headline(self) -> str:
        """The sampling the summary's tau and speedup and the OOD decode are at."""
        return self.samplings[0][0]

    def release(self) -> None:
        """After the decode: the decoding copies back in the target's own linear layout (the
        few-rows layout is the plan's, for decoding only; the target goes on training)."""
        for copy_ in (self.copies.target, self.copies.baseline):
            if copy_ is not None:
                few_rows_products(copy_.model, False)


def plan_checkpoint(
    target: Target, draft: torch.nn.Module, eval_prompts: list[dict], settings: EvalSettings,
    target_eval: DecodeCopies | None, ranks: Ranks,
) -> CheckpointPlan:  # fmt: skip
    """The decisions of the module doc for `draft` at this checkpoint (dtypes and path at a
    run's first evaluation, kept in `target_eval` after it)."""
    use_compile_cache(settings.cache_dir)  # compiled code kept per machine
    if target_eval is None:  # rank 0 chooses the dtypes, every rank decodes in them
        if ranks.main:
            with phase("evaluation: copies and dtypes"):  # each dtype timed on a copy
                target_eval = decode_copies(target, settings, eval_prompts)
                prompt = torch.tensor(eval_prompts[0]["input_ids"], device=target.device)[None]
                choice = draft_dtype_choice(draft, target_eval.target, settings, prompt)
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
    adapted = adapts_target(decode_target, target_eval.target)
    drafter = with_lookup(make_drafter(draft_eval, decode_target), settings.lookup_min_match)
    prompts, ood = decode_prompts(eval_prompts, settings, target.tokenizer, decode_target.device)
    max_new_tokens = settings.max_new_tokens
    samplings = sorted(settings.samplings.items(), key=lambda item: item[0] != "greedy")
    setting = compile_setting(settings.compile)
    max_len = decode_len(prompts + ood, max_new_tokens)
    with phase("evaluation: compile"):  # the graphs, and the verdict's timing
        if setting in ("auto", "only") and "compile" not in target_eval.dtypes:
            # what building the compiled copies cost, by the clock: graphs already compiled in
            # this process (dynamo reuses them) would make a count of fresh compiles read zero
            started = time.perf_counter()
            if setting == "only":  # every rank compiles at once; rank 0 then times both paths
                compiled_decoding(
                    target_eval, draft_eval, decode_target, drafter, settings, max_len
                )
            built_s = time.perf_counter() - started
            choice = None  # decided at a run's first evaluation by rank 0, then kept
            if ranks.main:
                # at most: the ARs and one verify per new token, at every sampling
                forwards = max_new_tokens * (3 * len(samplings) * len(prompts) + len(ood))
                choice = compile_choice(
                    target_eval, draft_eval, decode_target, drafter, settings, max_len,
                    [p.shape[1] for p in prompts], forwards, built_s,
                ).as_record()  # fmt: skip
                print(describe_compile(choice, setting), flush=True)
            target_eval.dtypes["compile"] = ranks.broadcast(choice)
    compiled = setting == "only" or (
        setting == "auto" and target_eval.dtypes["compile"]["dtype"] == "compiled"
    )
    # The eager AR in its fastest dtype; a draft that adapts the target (Medusa-2) keeps its
    # AR on the adapted one, what its speculative decode must reproduce.
    eager_ar = decode_target if adapted else (target_eval.baseline or target_eval.target)
    choose_linear_layouts(target_eval, settings, eval_prompts, ranks, compiled)
    passes = []
    if compiled:
        # A later checkpoint's weights reach the kept compiled drafter from a copy in its own
        # dtype: a bf16 copy loaded into a float32 drafter would decode rounded weights.
        kept = target_eval.dtypes.get("draft_compiled")
        compiled_eval = draft_eval
        if kept is not None and resolve_dtype(kept["dtype"]) != draft_dtype:
            compiled_eval = draft_decode_copy(draft, resolve_dtype(kept["dtype"]))
        compiled_target, spec_target, compiled_drafter = compiled_decoding(
            target_eval, compiled_eval, decode_target, drafter, settings, max_len
        )  # fmt: skip
        if "draft_compiled" not in target_eval.dtypes:  # a run's first compiled evaluation
            with phase("evaluation: compile"):  # the other dtype's drafter graphs, timed
                compiled_draft_choice(target_eval, draft, settings, prompts[0], ranks)
            compiled_drafter, spec_target = target_eval.drafter, target_eval.spec_target
        spec = Pass("spec", spec_target, compiled_drafter)
        passes = [Pass("ar_eager", eager_ar), Pass("ar", compiled_target)]
    else:
        spec = Pass("spec", decode_target, drafter)
        same_dtype_ar = settings.same_dtype_ar or adapted
        if eager_ar is not decode_target:  # the fastest eager AR runs in another dtype
            passes.append(Pass("ar_eager", eager_ar))
        if same_dtype_ar or eager_ar is decode_target:
            passes.append(Pass("ar", decode_target))
    lookup = spec.drafter if isinstance(spec.drafter, LookupDrafter) else None
    heads = [Pass("head", spec.target, lookup.base)] if lookup is not None else []
    passes += [spec, *heads]
    # decode.compile=true: the eager one beside it (where the speculative one is compiled)
    if compiled and settings.compile is True and spec.target is not decode_target:
        passes.append(Pass("eager_spec", decode_target, drafter))
    return CheckpointPlan(target_eval, samplings, passes, [spec, *heads], lookup,
                          path_of(spec.target), prompts, ood, settings.tree,
                          max_new_tokens)  # fmt: skip


def choose_linear_layouts(
    copies: DecodeCopies, settings: EvalSettings, eval_prompts: list[dict], ranks: Ranks,
    compiled: bool,
) -> None:  # fmt: skip
    """decode.linear_layout for the eager copies a CPU decodes with (models/few_rows.py): the
    decoding copy where the speculative decode runs eagerly, the fastest eager AR's copy
    always, unless it is the copy the compiled target wraps (its graphs were traced plain).
    Measured by rank 0 once per run, every rank swaps; train/eval/evaluate.py swaps back."""
    layout = settings.linear_layout  # conf/decode/chain.yaml: auto
    if layout not in ("auto", "plain", "transposed"):
        raise ValueError(f"decode.linear_layout={layout!r}: use auto, plain or transposed")
    copies_ = {"layout": copies.target, "layout_ar": copies.baseline}  # None: the same copy
    if compiled:
        copies_ = {"layout_ar": copies.baseline}  # None: the AR's copy is the compiled one's
    copies_ = {use: c for use, c in copies_.items() if c is not None}
    if copies.target.device.type != "cpu" or layout == "plain" or not copies_:
        return
    if layout == "transposed":
        for use in copies_:
            copies.dtypes[use] = DtypeChoice(use, layout, "explicit").as_record()
    elif any(use not in copies.dtypes for use in copies_):  # auto: measured once per run
        choices = None
        if ranks.main:
            _, cached, width = typical_shapes(settings, eval_prompts)
            widths = {"layout": (width, 1), "layout_ar": (1,)}  # verify + AR step; AR step
            widths = {use: widths[use] for use in copies_}
            choices = choose_layouts(copies_, widths, cached, settings.cache_dir)
            print("\n".join(f"linear {c.describe()}" for c in choices.values()), flush=True)
            choices = {use: c.as_record() for use, c in choices.items()}
        copies.dtypes.update(ranks.broadcast(choices))
    for use, copy_ in copies_.items():  # every rank: rank 0's verdicts
        few_rows_products(copy_.model, copies.dtypes[use]["dtype"] == "transposed")


def decode_prompts(
    eval_prompts: list[dict], settings: EvalSettings, tokenizer, device: torch.device
) -> tuple[list[Tensor], list[Tensor]]:
    """The prompts a checkpoint decodes ([1, T] each): decode.num_prompts of the eval prompts
    (spread over the categories' blocks), and decode.ood_prompts, kinds the training data has
    none of, decoded for tau alone (spread over the file's kinds)."""
    chosen = spread(eval_prompts, settings.num_prompts)
    prompts = [torch.tensor(p["input_ids"], device=device)[None] for p in chosen]
    ood = ood_prompts(settings.ood_prompts, tokenizer, settings.chat_template)
    ood = spread(ood, settings.ood_num_prompts or len(prompts))
    return prompts, [torch.tensor(p["input_ids"], device=device)[None] for p in ood]


def decode_len(prompts: list[Tensor], max_new_tokens: int) -> int:
    """Positions a decode of `prompts` reaches: the longest prompt plus max_new_tokens."""
    return max(p.shape[1] for p in prompts) + max_new_tokens


def graph_len(target: Target, settings: EvalSettings, eval_prompts: list[dict]) -> int:
    """The cache length the compiled target's graphs are built for (`compiled_decoding`): the
    decode's length plus the widest forward."""
    prompts, ood = decode_prompts(eval_prompts, settings, target.tokenizer, torch.device("cpu"))
    return decode_len(prompts + ood, settings.max_new_tokens) + max(target_widths(settings))


def typical_shapes(settings: EvalSettings, eval_prompts: list[dict]) -> tuple[int, int, int]:
    """A decode's typical prompt length, cache length and verify width, as its copies are
    timed: the median prompt, the cache halfway through max_new_tokens (multiples of 32)."""
    lengths = sorted(len(p["input_ids"]) for p in eval_prompts) or [64]
    prompt = max(32, 32 * round(lengths[len(lengths) // 2] / 32))
    cached = max(32, 32 * round((prompt + settings.max_new_tokens / 2) / 32))
    tree = settings.tree
    width = tree.size + 1 if tree is not None else settings.k + 1
    return prompt, cached, width


def decode_copies(target: Target, settings: EvalSettings, eval_prompts: list[dict]) -> DecodeCopies:
    """The frozen target in decode.dtype ("auto": the faster dtype for decoding on this
    machine), and in the dtype of the machine's fastest AR when that is another, for the
    speedup against the best AR (models/dtype_choice.py; docs/design.md §3). Each is timed as
    a decode costs per token: one forward of its width (a verify of k + 1 tokens or tree
    size + 1; an AR step) over a typical cache, plus the prompt's prefill spread over
    max_new_tokens, since a dtype that is fast for one row can be slow for many (a CPU
    without native bf16: docs/portable.md). With decode.compile=only (or true) on a CPU the
    verify is timed compiled, on a compiled copy of the target's first layers
    (decoding.timing.compiled_forward_seconds: a proxy, minutes cheaper than compiling the
    whole target per dtype), with auto where `only` recorded it: the path the decode will
    take decides its dtype. The proxy's graph holds the decode's cache length (`graph_len`)
    and verify width: it times the attention the decode runs, and the target's verify graph
    in the chosen dtype finds the proxy's C++ kernels compiled (docs/fastpath.md)."""
    prompt, cached, width = typical_shapes(settings, eval_prompts)
    per, cache_dir = settings.max_new_tokens, settings.cache_dir
    path = compiled_verify_timed(settings.compile, settings.dtype, target.device)
    max_len = graph_len(target, settings, eval_prompts) if path is not None else None
    mode = settings.compile_mode
    # each eager dtype timed at its faster linear layout (models/few_rows.py); plan_checkpoint
    # then records the layout of the dtype chosen
    layouts = {"auto": (False, True), "transposed": (True,)}.get(settings.linear_layout, ())
    choices: dict[str, DtypeChoice] = {}
    for use, setting, new in (("decode", settings.dtype, width), ("ar", "auto", 1)):
        shapes = {"target": target.name, "rows": 1, "new": new, "cached": cached,
                  "prefill": prompt, "per": per}  # fmt: skip
        if layouts and target.device.type == "cpu":  # not the verdict of plain linears alone
            shapes["layouts"] = ["transposed" if t else "plain" for t in layouts]
        timed = shapes | {"path": "only", "mode": mode, "proxy_layers": PROXY_LAYERS,
                          "max_len": max_len}  # fmt: skip
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
            within = min(cached, max_len - new)  # the typical cache, as the graph holds it
            step = compiled_forward_seconds(target, dtype, new, within, mode, PROXY_LAYERS, max_len)
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
    draft: torch.nn.Module, target: Target, settings: EvalSettings, prompt: torch.Tensor
) -> DtypeChoice:
    """decode.draft_dtype: as set; "auto": the dtype whose draft copy decodes a round
    fastest beside `target` (the decoding copy), timed as seconds per verify round of one
    prompt (the verify is the same for both, so the difference is the draft's). A small draft
    runs one-row forwards, where bf16 can win on a CPU whose many-row bf16 forwards lose
    (docs/portable.md). A draft that adapts the target (Medusa-2) follows the target's dtype.
    A dtype the drafter cannot run in times as infinite."""
    setting, shapes = draft_dtype_setting(draft, target, settings, prompt)
    tree = settings.tree

    def measure(dtype: torch.dtype) -> float:
        copy_ = draft_decode_copy(draft, dtype)
        drafter = make_drafter(copy_, target)
        run = lambda: generate(target, prompt, drafter, k=settings.k, max_new_tokens=16,  # noqa: E731
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

    return choose_dtype("draft", setting, shapes, measure, target.device, settings.cache_dir)
