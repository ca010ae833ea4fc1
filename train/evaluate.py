"""Evaluation after each checkpoint: the shared decoder on held-out prompts.

Decoding runs in the dtypes `decode.dtype` and `decode.draft_dtype` name, or with "auto"
the ones measured fastest on this machine (a CPU with native bf16 and one with AVX2 only
disagree: docs/portable.md), so the loop hands over copies of the frozen target (made
once and reused: it never changes) and of the current draft in those dtypes. The copies
keep their rotary frequencies in float32 (models.dtypes.cast_keep_rotary): a bare `.to(bfloat16)` rounds
inv_freq and decodes a different target than the one trained on. For every configured
temperature `decoding.metrics.evaluate` measures tau, per-position acceptance and speedup
against AR on the same prompts in the same call; next to it we log the training proxy's
prediction at that same sampling (simulated tau from alpha = sum min(p, q) at the decode's
temperature / top-k / top-p for T > 0, from top-1 agreement for greedy; train/step_stats.py)
and its error, so a train/decode mismatch (high proxy, tau ~ 1) shows up at once. Each
temperature also records acceptance against the target's entropy (`<tag>/entropy_alpha`:
bucket edges, positions and mean acceptance per bucket, least-squares slope and intercept;
decoding/entropy.py, docs/design.md §3).

`decode.compile=true` also decodes every temperature through the compiled path
(decoding/compiled.py, docs/fastpath.md) and logs `<tag>/compiled_<key>` beside the eager
keys, its speedup against a compiled AR baseline; `compile_s`, `compiled_graphs` and
`compiled_cudagraphs` (CUDA-graph recordings) say what compiling cost at this checkpoint.
`decode.compile=only` makes the compiled path THE evaluation: per prompt, interleaved, the
compiled AR, the compiled speculative decode and the eager AR in its fastest dtype (no eager
speculative pass); `<tag>/speedup` is then against the compiled AR, `<tag>/speedup_eager_ar`
against the eager one and `<tag>/speedup_best_ar` against the faster of the two
(`compiled_against_both`). The compiled target and one draft copy with its drafter
are built at a run's first evaluation and kept (`DecodeCopies`): later checkpoints copy their
weights into that copy in place, so no graph is compiled again.

With several processes (`ranks`, train/ranks.py) every rank evaluates the checkpoint: rank 0
picks the decoding dtypes and every rank decodes in them, rank r decodes prompts r, r +
world, ... (prompt i seeded as in one process), and the per-prompt results are gathered and
summarised in prompt order, so τ, α, the accept counts of every prompt and the token counts
equal one process's (timings are sums over prompts, as in one process; each rank warms up
on its own first prompt). Every rank returns the same record.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.compiled import STATS, counts_recordings, use_compile_cache
from decoding.drafters import make_drafter
from decoding.drafters.lookup import LookupDrafter, with_lookup
from decoding.metrics import (
    acceptance_stats,
    decode_prompts,
    decode_spec_only,
    merge_decoded,
    summarize,
)
from decoding.spec import generate
from decoding.tree import TreeSpec
from models.dtype_choice import DtypeChoice, choose_dtype, time_forward
from models.dtypes import cast_keep_rotary, resolve_dtype
from models.target import Target
from train.data.prompt_file import ood_prompts
from train.eval_compiled import (
    COMPILED_KEYS,
    DecodeCopies,
    compile_choice,
    compiled_against_both,
    compiled_decoding,
    compiled_forward_seconds,
)
from train.ranks import Ranks
from train.step_stats import decode_samplings


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
    """ "auto" | "only" where decode.dtype=auto times the verify on the compiled path (a CPU
    decoding with decode.compile=auto | only; decode_copies), else None."""
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
    lengths = sorted(len(p["input_ids"]) for p in eval_prompts) or [64]
    prompt = max(32, 32 * round(lengths[len(lengths) // 2] / 32))
    cached = max(32, 32 * round((prompt + dec.max_new_tokens / 2) / 32))
    width = tree.size + 1 if tree is not None else int(dec.k) + 1
    per = int(dec.max_new_tokens)
    path = compiled_verify_timed(dec, target.device)
    mode = str(dec.get("compile_mode", "auto"))
    choices: dict[str, DtypeChoice] = {}
    for use, setting, new in (("decode", dec.dtype, width), ("ar", "auto", 1)):
        shapes = {"target": target.name, "rows": 1, "new": new, "cached": cached,
                  "prefill": prompt, "per": per}  # fmt: skip
        timed_compiled = use == "decode" and path is not None
        if timed_compiled:  # a verdict timed eagerly is not this one
            shapes |= {"path": path, "mode": mode, "taps": list(hidden_layers)}

        def measure(dtype, new=new, timed_compiled=timed_compiled):
            prefill = time_forward(target, dtype, 1, prompt, 1)
            if not timed_compiled:
                return time_forward(target, dtype, 1, new, cached) + prefill / per
            step = compiled_forward_seconds(target, dtype, new, cached, hidden_layers, mode)
            if path == "auto":  # the decode will take the faster path
                step = min(step, time_forward(target, dtype, 1, new, cached))
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


def evaluate_checkpoint(
    target: Target,
    draft: torch.nn.Module,
    eval_prompts: list[dict],
    cfg: DictConfig,
    last_train: dict | None,  # the newest train record: its simulated tau per sampling
    target_eval: DecodeCopies | None = None,
    ranks: Ranks | None = None,  # several processes: each decodes its share (module doc)
) -> tuple[dict, DecodeCopies]:
    """-> (flat JSON-able metrics, the decoding copies to reuse at the next checkpoint).
    `draft` is the whole draft (not a sharded one): each rank decodes with a copy of it."""
    ranks = ranks or Ranks()
    dec = cfg.decode
    k = int(dec.get("k", 4))
    tree = None  # decode=tree_static / tree_dynamic: draft trees (decoding/tree.py)
    if dec.get("tree") is not None:
        tree = TreeSpec(**OmegaConf.to_container(dec.tree, resolve=True))
    if not eval_prompts:
        raise ValueError(
            "train.eval_at_ckpt=true but the data has no eval prompts; set data.num_eval > 0"
        )
    use_compile_cache((cfg.get("data") or {}).get("cache_dir"))  # compiled code kept per machine
    # What compiling costs this checkpoint, decode_copies' timing of a compiled verify included
    graphs, recorded, seconds = STATS.graphs, STATS.cudagraphs, STATS.seconds
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
    num = dec.get("num_prompts") or len(eval_prompts)
    prompts = [
        torch.tensor(p["input_ids"], device=decode_target.device)[None] for p in eval_prompts[:num]
    ]
    mine = ranks.mine(len(prompts))  # prompts rank, rank + world, ...
    # decode.ood_prompts: kinds the training data has none of, decoded for tau alone
    ood = ood_prompts(
        dec.get("ood_prompts"), target.tokenizer, (cfg.get("data") or {}).get("chat_template")
    )
    ood = [torch.tensor(p["input_ids"], device=decode_target.device)[None] for p in ood[:num]]
    result: dict = {"k": k, "num_prompts": len(prompts), "ood_num_prompts": len(ood)}
    max_new_tokens = int(dec.get("max_new_tokens", 64))
    samplings = decode_samplings(dec)  # eval tag ("greedy", "T0.7") -> Sampling
    compiled = None  # decode.compile: (compiled target, its drafter), beside the eager ones
    setting = dec.get("compile", False)
    max_len = max(p.shape[1] for p in prompts + ood) + max_new_tokens
    if setting == "auto":  # measured at a run's first evaluation by rank 0, then kept
        if "compile" not in target_eval.dtypes:
            choice = None
            if ranks.main:
                cache_dir = (cfg.get("data") or {}).get("cache_dir")
                # at most: every AR step, one verify per new token, every temperature
                forwards = max_new_tokens * (len(samplings) * 2 * len(prompts) + len(ood))
                choice = compile_choice(
                    target_eval, draft_eval, decode_target, drafter, dec, tree, max_len,
                    [p.shape[1] for p in prompts], cache_dir, forwards,
                ).as_record()  # fmt: skip
                print(f"decode path: {choice['dtype']} ({choice['source']}; " + ", ".join(
                    f"{k} {v:.0f} s" if k in ("compile", "saved at most") else
                    f"{k} {v * 1e3:.1f} ms" for k, v in choice["seconds"].items()) + ")",
                    flush=True)  # fmt: skip
            target_eval.dtypes["compile"] = ranks.broadcast(choice)
        setting = "only" if target_eval.dtypes["compile"]["dtype"] == "compiled" else False
    only_compiled = setting == "only"  # the compiled decode IS the evaluation
    if setting:
        compiled = compiled_decoding(
            target_eval, draft_eval, decode_target, drafter, dec, tree, max_len
        )
    # The fastest-AR baseline is the plain target: a draft that adapts the target (Medusa-2)
    # keeps its AR on the adapted one, what its speculative decode must reproduce.
    same_dtype_ar = bool(dec.get("same_dtype_ar", True)) or decode_target is not target_eval.target
    result["dtypes"] = target_eval.dtypes
    # The headline sampling, decoded first: with the compiled path the eager AR is decoded at
    # it alone (an AR forward costs the same at every temperature), and so are the OOD prompts
    first = "greedy" if "greedy" in samplings else next(iter(samplings))
    eager_ar_record = None  # the eager AR's dtype and tokens/s, for the samplings after it
    for tag, sampling in sorted(samplings.items(), key=lambda item: item[0] != first):
        kw = dict(
            k=k,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            warmup=int(dec.get("warmup", 1)),
            seed=int(dec.get("seed", cfg.seed)),
            adaptive_k=bool(dec.get("adaptive_k", False)),
            tree=tree,
        )
        used = compiled[1] if only_compiled else drafter
        if isinstance(used, LookupDrafter):  # rounds counted per sampling
            used.rounds = used.lookup_rounds = 0
        with torch.no_grad():
            if only_compiled:  # compiled AR, compiled spec, eager AR in its fastest dtype
                eager_ar = target_eval.baseline or decode_target
                if decode_target is not target_eval.target:  # Medusa-2: the adapted target
                    eager_ar = decode_target
                # An AR forward costs the same at every temperature: the eager AR, the
                # slowest pass of all, is decoded at the first sampling only
                eager_ar = eager_ar if tag == first else None
                share = decode_prompts(
                    *compiled, prompts, mine, baseline=eager_ar, **kw
                )  # fmt: skip
            else:
                share = decode_prompts(
                    decode_target, drafter, prompts, mine, baseline=target_eval.baseline,
                    same_dtype_ar=same_dtype_ar, **kw,
                )  # fmt: skip
            parts = ranks.gather(share)
            if ranks.world > 1:  # which rank decoded which prompts
                result["prompts_by_rank"] = [part.indices for part in parts]
            m = summarize(merge_decoded(parts))
            if only_compiled:
                if tag == first:
                    eager_ar_record = {
                        key: m[key] for key in ("best_ar_dtype", "best_ar_tokens_per_s")
                    }
                else:  # against the eager AR decoded at the first sampling
                    m |= eager_ar_record
                    m["speedup_best_ar"] = m["tokens_per_s"] / m["best_ar_tokens_per_s"]
                m = compiled_against_both(m)
                m["eager_ar_decoded_at"] = first
            elif compiled is not None:  # COMPILED_KEYS only
                share = decode_prompts(*compiled, prompts, mine, entropy=False, **kw)
                mc = summarize(merge_decoded(ranks.gather(share)))
                result |= {f"{tag}/compiled_{key}": mc[key] for key in COMPILED_KEYS}
        for key, value in m.items():
            result[f"{tag}/{key}"] = value
        if isinstance(used, LookupDrafter):  # every rank's rounds, warm-up prompts included
            counts = ranks.gather((used.lookup_rounds, used.rounds))
            lookups, rounds = (sum(c[i] for c in counts) for i in (0, 1))
            result[f"{tag}/lookup_share"] = lookups / max(rounds, 1)
        if ood and tag == first:  # the same decode on out-of-domain prompts: tau, alpha
            spec = compiled if only_compiled else (decode_target, drafter)
            kw.pop("warmup")
            with torch.no_grad():
                runs = decode_spec_only(*spec, ood, ranks.mine(len(ood)), **kw)
            runs = [r for part in ranks.gather(runs) for r in part]
            ood_stats = acceptance_stats(runs, max(max(r.draft_lens, default=k) for r in runs))
            result[f"ood/{tag}/tau"] = ood_stats["tau"]
            result[f"ood/{tag}/alpha"] = ood_stats["alpha"]
        # The proxy computed at this very sampling; absent from train records written
        # before this temperature was configured (a resumed run), and then not reported.
        predicted = None
        if last_train is not None:
            predicted = last_train.get("sim_tau_greedy" if sampling.greedy else f"sim_tau_{tag}")
        if predicted is not None:
            result[f"{tag}/proxy_tau"] = predicted
            result[f"{tag}/proxy_error"] = predicted - m["tau"]
    result["tau"] = result[f"{first}/tau"]  # the headline number for curves and summaries
    result["speedup"] = result.get(f"{first}/speedup")
    result["speedup_best_ar"] = result.get(f"{first}/speedup_best_ar")
    if ood:  # the out-of-domain tau beside the in-domain one, and their ratio
        result["ood/tau"] = result[f"ood/{first}/tau"]
        result["ood/tau_ratio"] = result["ood/tau"] / result["tau"]
    if only_compiled:
        result["decode_path"] = "compiled"
        result["speedup_eager_ar"] = result[f"{first}/speedup_eager_ar"]
        result["speedup_compiled"] = result[f"{first}/speedup_compiled_ar"]
    elif compiled is not None:
        result["speedup_compiled"] = result[f"{first}/compiled_speedup"]
    if compiled is not None:
        result["compile_s"] = STATS.seconds - seconds  # 0 once a run's graphs exist
        result["compiled_graphs"] = STATS.graphs - graphs
        # CUDA-graph recordings; None where this torch does not announce them
        result["compiled_cudagraphs"] = STATS.cudagraphs - recorded if counts_recordings() else None
    return result, target_eval


def format_eval_table(evals: list[dict]) -> str:
    """A markdown table of the per-checkpoint evaluations: τ, α_i and speedup per temperature;
    with decode.compile, the compiled path's speedup (vs compiled AR) and tokens/s beside the
    eager ones."""
    rows = []
    compiled = any(key.endswith("/compiled_speedup") for ev in evals for key in ev)
    for ev in evals:
        for key, tau in ev.items():
            if not key.endswith("/tau"):
                continue
            tag = key[: -len("/tau")]
            alpha = " ".join("-" if a is None else f"{a:.2f}" for a in ev.get(f"{tag}/alpha", []))
            row = (
                f"| {ev.get('step', '?')} | {tag} | {tau:.3f} | {alpha} "
                f"| {ev.get(f'{tag}/speedup', float('nan')):.2f}x "
                f"| {ev.get(f'{tag}/speedup_best_ar', float('nan')):.2f}x "
                f"({ev.get(f'{tag}/best_ar', ev.get(f'{tag}/best_ar_dtype', '?'))}) "
                f"| {ev.get(f'{tag}/tokens_per_s', float('nan')):.1f} "
                f"| {ev.get(f'{tag}/ar_tokens_per_s', float('nan')):.1f} |"
            )
            if compiled:
                row += (
                    f" {ev.get(f'{tag}/compiled_speedup', float('nan')):.2f}x "
                    f"| {ev.get(f'{tag}/compiled_tokens_per_s', float('nan')):.1f} "
                    f"| {ev.get(f'{tag}/compiled_ar_tokens_per_s', float('nan')):.1f} |"
                )
            rows.append(row)
    head = (
        "| step | sampling | τ | α per position | speedup vs AR | vs the fastest AR (its dtype) "
        "| tok/s spec | tok/s AR |"
    )
    rule = "|---|---|---|---|---|---|---|---|"
    if compiled:
        head += " speedup compiled (vs compiled AR) | tok/s spec compiled | tok/s AR compiled |"
        rule += "---|---|---|"
    return "\n".join([head, rule, *rows])
