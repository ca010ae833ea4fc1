"""Evaluation after each checkpoint: the shared decoder on held-out prompts, as planned.

`evaluate_checkpoint` asks train/eval_plan.py for the checkpoint's plan (the dtypes, the path
— eager or compiled —, the baselines, the prompts; decided once per run from measurements on
this machine and recorded under `dtypes`), then decodes it. For every configured sampling,
headline first (greedy where configured), `decoding.metrics.decode_prompts` decodes each
prompt speculatively (and at the headline, AR side by side), and `summarize` gives tau,
per-position acceptance, the speedup against each AR and the acceptance against the
target's entropy (`<tag>/entropy_alpha`; decoding/entropy.py, docs/design.md §3). Beside them: the training
proxy's prediction at that same sampling and its error (`<tag>/proxy_tau`, `proxy_error`:
simulated tau from alpha = sum min(p, q), from top-1 agreement for greedy;
train/step_stats.py), so a train/decode mismatch (high proxy, tau ~ 1) shows at once, and at
the headline sampling the out-of-domain prompts' tau (`ood/<tag>/tau`, `ood/tau_ratio`).

The AR is decoded at the headline sampling alone, interleaved prompt by prompt with its
speculative decode (an AR forward costs the same at every temperature): the speedups of the
other samplings divide by it (`<tag>/ar_decoded_at`). With the compiled path as the
evaluation (`decode_path: compiled`) each prompt is decoded by the compiled AR, the compiled
speculative decode and the eager AR in its fastest dtype: `<tag>/speedup` is against the
compiled AR, `speedup_eager_ar` against the eager one, `speedup_best_ar` against the faster
(`compiled_against_both`).
`decode.compile=true` decodes both paths and logs the compiled one's `<tag>/compiled_<key>`
beside the eager keys. `compile_s`, `compiled_graphs` and `compiled_cudagraphs` say what
compiling cost at this checkpoint (0 once a run's graphs exist).

With several processes (`ranks`, train/ranks.py) rank 0 plans and every rank decodes in its
verdicts: rank r decodes prompts r, r + world, ... (prompt i seeded as in one process), and
the per-prompt results are gathered and summarised in prompt order, so τ, α, the accept
counts of every prompt and the token counts equal one process's (timings are sums over
prompts; each rank warms up on its own first prompt). Every rank returns the same record.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig

from decoding.compiled import STATS, counts_recordings
from decoding.drafters.lookup import LookupDrafter
from decoding.metrics import (
    acceptance_stats,
    decode_prompts,
    decode_spec_only,
    merge_decoded,
    summarize,
    with_ar,
)
from models.few_rows import few_rows_products
from models.target import Target
from train.eval_plan import DecodeCopies, plan_checkpoint
from train.ranks import Ranks
from train.step_stats import decode_samplings

# What the compiled path reports beside the eager keys, as <tag>/compiled_<key>.
COMPILED_KEYS = ("tau", "speedup", "tokens_per_s", "ar_tokens_per_s", "wall_time_ratio",
                 "greedy_match_rate")  # fmt: skip


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
    if not eval_prompts:
        raise ValueError(
            "train.eval_at_ckpt=true but the data has no eval prompts; set data.num_eval > 0"
        )
    # What compiling costs this checkpoint, the dtype choice's timing of a compiled verify included
    graphs, recorded, seconds = STATS.graphs, STATS.cudagraphs, STATS.seconds
    plan = plan_checkpoint(target, draft, eval_prompts, cfg, target_eval, ranks)
    target_eval, decode_target, drafter, compiled = (
        plan.copies,
        plan.decode_target,
        plan.drafter,
        plan.compiled,
    )
    only_compiled, prompts, ood, tree = plan.only_compiled, plan.prompts, plan.ood, plan.tree
    max_new_tokens = plan.max_new_tokens
    mine = ranks.mine(len(prompts))  # prompts rank, rank + world, ...
    result: dict = {"k": k, "num_prompts": len(prompts), "ood_num_prompts": len(ood)}
    samplings = decode_samplings(dec)  # eval tag ("greedy", "T0.7") -> Sampling
    # The fastest-AR baseline is the plain target: a draft that adapts the target (Medusa-2)
    # keeps its AR on the adapted one, what its speculative decode must reproduce.
    same_dtype_ar = bool(dec.get("same_dtype_ar", True)) or decode_target is not target_eval.target
    result["dtypes"] = target_eval.dtypes
    # The headline sampling, decoded first, is the only one decoded AR too: an AR forward
    # costs the same at every temperature, so the other samplings' speedups divide by the AR
    # decoded there (`with_ar`, `<tag>/ar_decoded_at`). The OOD prompts are decoded at it alone.
    first = "greedy" if "greedy" in samplings else next(iter(samplings))
    headline = compiled_headline = None  # the headline's Decoded: its AR serves the others
    for tag, sampling in sorted(samplings.items(), key=lambda item: item[0] != first):
        kw = dict(
            k=k,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            warmup=int(dec.get("warmup", 1)),
            seed=int(dec.get("seed", cfg.seed)),
            adaptive_k=bool(dec.get("adaptive_k", False)),
            tree=tree,
            ar=tag == first,
        )
        used = compiled[1] if only_compiled else drafter
        if isinstance(used, LookupDrafter):  # rounds counted per sampling
            used.rounds = used.lookup_rounds = 0
        with torch.no_grad():
            if only_compiled:  # compiled AR, compiled spec, eager AR in its fastest dtype
                eager_ar = target_eval.baseline or decode_target
                if decode_target is not target_eval.target:  # Medusa-2: the adapted target
                    eager_ar = decode_target
                share = decode_prompts(*compiled, prompts, mine, baseline=eager_ar, **kw)
            else:
                share = decode_prompts(
                    decode_target, drafter, prompts, mine, baseline=target_eval.baseline,
                    same_dtype_ar=same_dtype_ar, **kw,
                )  # fmt: skip
            parts = ranks.gather(share)
            if ranks.world > 1:  # which rank decoded which prompts
                result["prompts_by_rank"] = [part.indices for part in parts]
            decoded = merge_decoded(parts)
            if tag == first:
                headline = decoded
            else:
                decoded = with_ar(decoded, headline)
            m = summarize(decoded)
            m["ar_decoded_at"] = first
            if only_compiled:
                m = compiled_against_both(m)
            elif compiled is not None:  # COMPILED_KEYS only, the compiled AR at `first` too
                share = decode_prompts(*compiled, prompts, mine, entropy=False, **kw)
                compiled_decoded = merge_decoded(ranks.gather(share))
                if tag == first:
                    compiled_headline = compiled_decoded
                else:
                    compiled_decoded = with_ar(compiled_decoded, compiled_headline)
                mc = summarize(compiled_decoded)
                result |= {f"{tag}/compiled_{key}": mc[key] for key in COMPILED_KEYS}
        for key, value in m.items():
            result[f"{tag}/{key}"] = value
        if isinstance(used, LookupDrafter):  # every rank's rounds, warm-up prompts included
            counts = ranks.gather((used.lookup_rounds, used.rounds))
            lookups, rounds = (sum(c[i] for c in counts) for i in (0, 1))
            result[f"{tag}/lookup_share"] = lookups / max(rounds, 1)
        if ood and tag == first:  # the same decode on out-of-domain prompts: tau, alpha
            spec = compiled if only_compiled else (decode_target, drafter)
            kw.pop("warmup"), kw.pop("ar")
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
    for copy_ in (target_eval.target, target_eval.baseline):  # the plan's layout, for decoding
        if copy_ is not None:  # alone: the target goes on training as it came
            few_rows_products(copy_.model, False)
    return result, target_eval


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
            if tag == "ood":  # the headline sampling's ood/<tag>/tau again
                continue
            alpha = " ".join("-" if a is None else f"{a:.2f}" for a in ev.get(f"{tag}/alpha", []))
            row = f"| {ev.get('step', '?')} | {tag} | {tau:.3f} | {alpha} "
            if f"{tag}/speedup" in ev:
                row += (
                    f"| {ev[f'{tag}/speedup']:.2f}x "
                    f"| {ev.get(f'{tag}/speedup_best_ar', float('nan')):.2f}x "
                    f"({ev.get(f'{tag}/best_ar', ev.get(f'{tag}/best_ar_dtype', '?'))}) "
                    f"| {ev.get(f'{tag}/tokens_per_s', float('nan')):.1f} "
                    f"| {ev.get(f'{tag}/ar_tokens_per_s', float('nan')):.1f} |"
                )
            else:  # out-of-domain prompts: decoded for tau alone, no AR pass
                row += "| - | - | - | - |"
            if compiled and f"{tag}/speedup" not in ev:
                row += " - | - | - |"
            elif compiled:
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
