"""Evaluation after each checkpoint: the shared decoder on held-out prompts, as planned.

`evaluate_checkpoint` asks train/eval/plan.py for the checkpoint's plan (the dtypes, the path
— eager or compiled —, the passes, the samplings, the prompts; decided once per run from
measurements on this machine and recorded under `dtypes`), then decodes it: at every sampling,
headline first (greedy where configured), `decoding.metrics.decode_prompts` decodes each
prompt in every pass of the plan, interleaved prompt by prompt (the ARs, the speculative
decode, the trained drafter without prompt lookup), so every speedup divides by an AR decoded
at the same sampling in the same minutes. `summarize` gives tau, per-position acceptance, the
speedup against each AR — `speedup_best_ar` against the fastest plain decoding this machine
runs, the faster of the compiled and the eager AR, present only where the compiled AR was
decoded —, `loop_efficiency`, the head's own tau (`tau_head`, `speedup_head`) and the
acceptance against the target's entropy (`<tag>/entropy_alpha`; decoding/entropy.py,
docs/design.md §3). Beside them: the training proxy's prediction at that same sampling and
its error (`<tag>/proxy_tau`, `proxy_error`: simulated tau from alpha = sum min(p, q), from
top-1 agreement for greedy; train/core/step_stats.py), so a train/decode mismatch (high proxy,
tau ~ 1) shows at once, and at the headline sampling the out-of-domain prompts' tau, lookup
share and head-only tau (`ood/<tag>/...`, `ood/tau_ratio`). `compile_s`,
`compiled_graphs` and `compiled_cudagraphs` say what compiling cost at this checkpoint (0
once a run's graphs exist), `compile_s_graphs` those seconds per graph ("30-layer target
float32 [1, 4]": the graph's name and input shape; the dtype proxies are 2-layer targets).

With several processes (`ranks`, train/parallel/ranks.py) rank 0 plans and every rank decodes in its
verdicts: rank r decodes prompts r, r + world, ... (prompt i seeded as in one process), and
the per-prompt results are gathered and summarised in prompt order, so τ, α, the accept
counts of every prompt and the token counts equal one process's (timings are sums over
prompts; each rank warms up on its own first prompt). Every rank returns the same record.
"""

from __future__ import annotations

import torch

from decoding.inductor import STATS, counts_recordings
from decoding.metrics import (
    acceptance_stats,
    decode_prompts,
    decode_spec_only,
    merge_decoded,
    summarize,
)
from models.target import Target
from train.eval.compiled import DecodeCopies
from train.eval.plan import CheckpointPlan, plan_checkpoint
from train.eval.settings import EvalSettings
from train.parallel.ranks import Ranks

# The headline sampling's keys copied to the record's top level, for curves and summaries.
HEADLINE_KEYS = ("tau", "tau_head", "speedup", "speedup_eager_ar", "speedup_compiled_ar",
                 "speedup_best_ar", "speedup_head", "loop_efficiency")  # fmt: skip


def evaluate_checkpoint(
    target: Target,
    draft: torch.nn.Module,
    eval_prompts: list[dict],
    settings: EvalSettings,  # built by the set-up: train/run/settings.py: eval_settings
    last_train: dict | None,  # the newest train record: its simulated tau per sampling
    target_eval: DecodeCopies | None = None,
    ranks: Ranks | None = None,  # several processes: each decodes its share (module doc)
) -> tuple[dict, DecodeCopies]:
    """-> (flat JSON-able metrics, the decoding copies to reuse at the next checkpoint).
    `draft` is the whole draft (not a sharded one): each rank decodes with a copy of it."""
    ranks = ranks or Ranks()
    k = settings.k
    if not eval_prompts:
        raise ValueError(
            "train.eval_at_ckpt=true but the data has no eval prompts; set data.num_eval > 0"
        )
    # What compiling costs this checkpoint, the dtype choice's timing of a compiled verify included
    graphs, recorded, seconds = STATS.graphs, STATS.cudagraphs, STATS.seconds
    by_graph = dict(STATS.by_graph)
    plan = plan_checkpoint(target, draft, eval_prompts, settings, target_eval, ranks)
    mine = ranks.mine(len(plan.prompts))  # prompts rank, rank + world, ...
    result: dict = {"k": k, "num_prompts": len(plan.prompts), "ood_num_prompts": len(plan.ood),
                    "dtypes": plan.copies.dtypes, "decode_path": plan.path,
                    "passes": [p.name for p in plan.passes]}  # fmt: skip
    headline = plan.headline
    for tag, sampling in plan.samplings:
        kw = dict(
            k=k,
            sampling=sampling,
            max_new_tokens=plan.max_new_tokens,
            seed=settings.seed,
            adaptive_k=settings.adaptive_k,
            tree=plan.tree,
        )
        count_lookups(plan, ranks)  # rounds counted per sampling
        with torch.no_grad():
            share = decode_prompts(
                plan.passes, plan.prompts, mine, warmup=settings.warmup, **kw
            )  # fmt: skip
        parts = ranks.gather(share)
        if ranks.world > 1:  # which rank decoded which prompts
            result["prompts_by_rank"] = [part.indices for part in parts]
        m = summarize(merge_decoded(parts))
        if plan.lookup is not None:  # every rank's rounds, warm-up prompts included
            m["lookup_share"] = count_lookups(plan, ranks)
        result |= {f"{tag}/{key}": value for key, value in m.items()}
        if plan.ood and tag == headline:  # the same decodes on out-of-domain prompts
            result |= ood_record(plan, tag, ranks, kw)
        # The proxy computed at this very sampling; absent from train records written
        # before this temperature was configured (a resumed run), and then not reported.
        predicted = None
        if last_train is not None:
            predicted = last_train.get("sim_tau_greedy" if sampling.greedy else f"sim_tau_{tag}")
        if predicted is not None:
            result[f"{tag}/proxy_tau"] = predicted
            result[f"{tag}/proxy_error"] = predicted - m["tau"]
    result |= {key: result[f"{headline}/{key}"] for key in HEADLINE_KEYS
               if f"{headline}/{key}" in result}  # fmt: skip
    if plan.ood:  # the out-of-domain tau beside the in-domain one, and their ratio
        result["ood/tau"] = result[f"ood/{headline}/tau"]
        result["ood/tau_ratio"] = result["ood/tau"] / result["tau"]
    if plan.copies.compiled is not None:
        result["compile_s"] = STATS.seconds - seconds  # 0 once a run's graphs exist
        result["compiled_graphs"] = STATS.graphs - graphs
        result["compile_s_graphs"] = STATS.graphs_since(by_graph)
        # CUDA-graph recordings; None where this torch does not announce them
        result["compiled_cudagraphs"] = STATS.cudagraphs - recorded if counts_recordings() else None
    plan.release()
    return result, plan.copies


def count_lookups(plan: CheckpointPlan, ranks: Ranks) -> float | None:
    """The share of the spec decode's rounds that prompt lookup drafted since the last call,
    over every rank; resets the counts. None without lookup."""
    if plan.lookup is None:
        return None
    counts = ranks.gather((plan.lookup.lookup_rounds, plan.lookup.rounds))
    plan.lookup.rounds = plan.lookup.lookup_rounds = 0
    lookups, rounds = (sum(c[i] for c in counts) for i in (0, 1))
    return lookups / max(rounds, 1)


def ood_record(plan: CheckpointPlan, tag: str, ranks: Ranks, kw: dict) -> dict:
    """`ood/<tag>/tau`, `alpha` and `lookup_share` of the speculative decode on the
    out-of-domain prompts, and `tau_head` of the trained drafter alone there (no timing: no
    AR, no warm-up)."""
    out = {}
    for spec in plan.ood_passes:
        count_lookups(plan, ranks)
        with torch.no_grad():
            runs = decode_spec_only(
                spec.target, spec.drafter, plan.ood, ranks.mine(len(plan.ood)), **kw
            )  # fmt: skip
        runs = [r for part in ranks.gather(runs) for r in part]
        stats = acceptance_stats(runs, max(max(r.draft_lens, default=kw["k"]) for r in runs))
        if spec.name == "spec":
            out[f"ood/{tag}/tau"], out[f"ood/{tag}/alpha"] = stats["tau"], stats["alpha"]
            if plan.lookup is not None:
                out[f"ood/{tag}/lookup_share"] = count_lookups(plan, ranks)
        else:
            out[f"ood/{tag}/tau_{spec.name}"] = stats["tau"]
    return out


def format_eval_table(evals: list[dict]) -> str:
    """A markdown table of the per-checkpoint evaluations: τ (and the head's alone, without
    prompt lookup), α_i and per temperature the speedup against the fastest AR (where the
    compiled AR was decoded) and against the eager AR, tokens/s of the speculative decode and
    of the ARs, and the loop's efficiency."""
    rows = []
    for ev in evals:
        for key, tau in ev.items():
            if not key.endswith("/tau"):
                continue
            tag = key[: -len("/tau")]
            if tag == "ood":  # the headline sampling's ood/<tag>/tau again
                continue
            alpha = " ".join("-" if a is None else f"{a:.2f}" for a in ev.get(f"{tag}/alpha", []))
            head = ev.get(f"{tag}/tau_head")
            row = f"| {ev.get('step', '?')} | {tag} | {tau:.3f} | {_num(head, '.3f')} | {alpha} "
            if f"{tag}/speedup" in ev:
                best = ev.get(f"{tag}/speedup_best_ar")
                row += (
                    f"| {_num(best, '.2f', 'x')} ({ev.get(f'{tag}/best_ar', 'not decoded')}) "
                    f"| {_num(ev.get(f'{tag}/speedup_eager_ar'), '.2f', 'x')} "
                    f"| {ev[f'{tag}/tokens_per_s']:.1f} "
                    f"| {_num(ev.get(f'{tag}/compiled_ar_tokens_per_s'), '.1f')} "
                    f"| {_num(ev.get(f'{tag}/eager_ar_tokens_per_s'), '.1f')} "
                    f"| {_num(ev.get(f'{tag}/loop_efficiency'), '.2f')} |"
                )
            else:  # out-of-domain prompts: decoded for tau alone, no AR pass
                row += "| - | - | - | - | - | - |"
            rows.append(row)
    head = (
        "| step | sampling | τ | τ head alone | α per position | speedup vs the fastest AR "
        "| vs the eager AR | tok/s spec | tok/s AR compiled | tok/s AR eager | loop efficiency |"
    )
    lines = [head, "|---" * 11 + "|", *rows]
    if evals and "speedup_best_ar" not in evals[-1]:
        lines.append("The compiled AR was not decoded (decode.compile=false, or auto chose eager), so "
                     "there is no speedup against the fastest AR; decode.compile=only decodes it.")  # fmt: skip
    return "\n".join(lines)


def _num(value: float | None, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"
