"""Acceptance and speed metrics of a drafter on a target (definitions: docs/design.md §3).

`decode_prompts` decodes every prompt in each of several `Pass`es (AR and speculative, batch
1, same max_new_tokens and sampling), interleaved prompt by prompt after a warm-up, and
`summarize` turns them into a JSON-able dict:
    tau                  tokens per target verify forward, bonus included, over EVERY verify
                         forward (also rounds without drafts: an n-gram miss, the last token
                         of the budget); what the speedup follows
    tau_drafted          the same over rounds that had drafts only
    alpha                α_i = P(accept draft i | drafts 1..i-1 accepted), i = 1..k
    accept_cumulative    P(drafts 1..i all accepted)
    accept_hist          rounds with 0..k accepted drafts
                         (α, accept_cumulative, accept_hist: rounds with drafts only)
    verify_rounds, drafted_rounds   verify forwards; those with drafts
    accepted_per_prompt  accepted drafts per prompt, in prompt order
    tokens_per_s, ar_tokens_per_s, speedup (= tokens/s ratio) against the AR on the spec
                         decode's own path and dtype ("ar"; else the fastest eager AR),
                         wall_time_ratio (= speedup when both emit the same tokens, e.g. greedy)
    path, dtype, ar_dtype  the spec decode's path ("eager" / "compiled") and dtype; the AR's
    eager_ar_tokens_per_s, speedup_eager_ar, eager_ar_dtype
                         against the fastest eager AR decoded (its fastest dtype)
    compiled_ar_tokens_per_s, speedup_compiled_ar, compiled_ar_dtype
                         against the compiled AR, where one was decoded
    best_ar, best_ar_tokens_per_s, speedup_best_ar
                         against the faster of the compiled and the eager AR: the fastest
                         plain decoding this machine runs. Absent without a compiled AR
    tau_<pass>, alpha_<pass>, tokens_per_s_<pass>, speedup_<pass> (vs the fastest AR, where
                         `speedup_best_ar` is), speedup_<pass>_eager_ar
                         a further speculative pass: "head" (the trained drafter alone,
                         without prompt lookup), "eager_spec" (the eager decode beside a
                         compiled one)
    predicted_speedup    τ·T_target(1) / (T_verify(k) + T_draft(k)) from measured per-round
                         costs: T_target(1) a step of the AR `speedup` divides by, T_verify a
                         verify forward, T_draft the drafter's propose + commit per round
                         (t_*_ms); both prefills, the target's and the drafter's, are left
                         out of every per-round cost
    loop_efficiency      speedup / predicted_speedup: the share of what the forwards allow
                         that the decode loop delivers
    draft_time_share     share of the round time (wall time minus both prefills) spent in
                         the drafter's propose/commit
    overhead_share       share of round time outside target and drafter calls
    greedy_match_rate    greedy only: mean fraction of the "ar" tokens reproduced before the
                         first difference (1.0 = lossless; in bf16, k-row kernels round
                         differently); None where no AR of the spec decode's dtype was decoded
    tree, tree_size      tree decoding (`tree=`, decoding/tree.py): the TreeSpec and the mean
                         drafted nodes per verify round (None for chains); α_i is then per
                         depth i, and `k` is the tree's maximum depth
    entropy_alpha        acceptance against the target's entropy H (nats) at every draft the
                         verifier judged (decoding/entropy.py): {edges, count, alpha, slope,
                         intercept}, per bucket [edges[i], edges[i+1]) the judged positions and
                         their mean acceptance, and the least-squares line acceptance ≈
                         intercept + slope·H (greedy: H of the T=1 softmax, acceptance 0/1;
                         T > 0: H of the verifier's p, acceptance Σ min(p, q); trees: one
                         position per depth); None with `entropy=False`
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from decoding.compiled import CompiledTarget
from decoding.drafter import Drafter, Sampling
from decoding.entropy import EntropyProbe
from decoding.rounds import GREEDY, GenerationResult
from decoding.spec import generate
from decoding.tree import TreeSpec
from models.target import Target


def _as_row(prompt: Tensor) -> Tensor:
    return prompt.view(1, -1) if prompt.dim() == 1 else prompt


def decode_spec_only(
    target: Target,
    drafter: Drafter,
    prompts: list[Tensor],  # each [T] or [1, T]
    indices: list[int] | None = None,  # the prompts to decode (None: all); a process's share
    *,
    k: int = 4,
    sampling: Sampling = GREEDY,
    max_new_tokens: int = 64,
    seed: int = 0,
    adaptive_k: bool = False,
    tree: TreeSpec | None = None,
) -> list[GenerationResult]:
    """The speculative decode alone of `indices` of `prompts`, prompt i seeded seed + i as in
    `decode_prompts`: for acceptance figures (`acceptance_stats`) where no speedup is wanted,
    so no AR pass and no warm-up (nothing here is timed)."""
    indices = list(range(len(prompts))) if indices is None else list(indices)
    kw = dict(
        k=k, sampling=sampling, max_new_tokens=max_new_tokens, adaptive_k=adaptive_k, tree=tree
    )
    gen = torch.Generator(device=target.device)
    return [
        generate(target, _as_row(prompts[i]), drafter, generator=gen.manual_seed(seed + i), **kw)
        for i in indices
    ]


def acceptance_stats(results: list[GenerationResult], k: int) -> dict:
    """τ over every verify forward (`GenerationResult.tau`) and `tau_drafted` over rounds
    with drafts; α_i, cumulative acceptance and the histogram over rounds with drafts."""
    every = [t for r in results for t in r.round_tokens]
    drafted = [t for r in results for t, d in zip(r.round_tokens, r.draft_lens) if d > 0]
    rounds = [(n, d) for r in results for n, d in zip(r.accept_counts, r.draft_lens) if d > 0]
    hist = [0] * (k + 1)
    for n, _ in rounds:
        hist[min(n, k)] += 1
    alpha, cumulative = [], []
    for i in range(1, k + 1):
        offered = [n for n, d in rounds if d >= i]  # rounds where draft i existed
        reached = [n for n in offered if n >= i - 1]  # ... and drafts 1..i-1 were accepted
        alpha.append(sum(n >= i for n in reached) / len(reached) if reached else None)
        cumulative.append(sum(n >= i for n in offered) / len(offered) if offered else None)
    return {
        "tau": sum(every) / len(every) if every else 1.0,
        "tau_drafted": sum(drafted) / len(drafted) if drafted else 1.0,
        "alpha": alpha,
        "accept_cumulative": cumulative,
        "accept_hist": hist,
        "verify_rounds": len(every),
        "drafted_rounds": len(rounds),
    }


def greedy_match(ar: list[int], spec: list[int]) -> float:
    """Length of the common prefix over the longer sequence (1.0 = identical)."""
    same = 0
    for a, b in zip(ar, spec):
        if a != b:
            break
        same += 1
    return same / max(len(ar), len(spec), 1)


@dataclass(frozen=True)
class Pass:
    """One decode of every prompt: `drafter=None` decodes plain AR. The names `summarize`
    knows: "spec" (the speculative decode the metrics are of), "ar" (the AR on the spec
    decode's own path and dtype: its `speedup`, predicted speedup, loop efficiency and greedy
    match), "ar_eager" (the fastest eager AR, where "ar" is not it) and further speculative
    passes ("head": the trained drafter without prompt lookup; "eager_spec": the eager decode
    beside a compiled one), each reported as `tau_<name>`, `tokens_per_s_<name>` and its
    speedups."""

    name: str
    target: Target  # or a decoding.compiled.CompiledTarget, called alike
    drafter: Drafter | None = None


def plain_passes(target: Target, drafter: Drafter, baseline: Target | None = None) -> list[Pass]:
    """AR and speculative on `target`, and the AR of `baseline` (the same target in the
    dtype of the machine's fastest eager AR), where given."""
    passes = [Pass("ar", target), Pass("spec", target, drafter)]
    return passes + ([Pass("ar_eager", baseline)] if baseline is not None else [])


@dataclass
class Decoded:
    """What `decode_prompts` measures, kept per prompt so that the shares of the prompts
    decoded in several processes merge (`merge_decoded`) into the record one process would
    give: `summarize` sums and concatenates in prompt order."""

    indices: list[int]  # the prompts decoded, positions in the caller's list
    runs: dict[str, list[GenerationResult]]  # pass name -> one result per prompt
    entropy: list[tuple[list[Tensor], list[Tensor]]]  # per prompt: EntropyProbe's rounds, CPU
    facts: dict  # settings, devices, and each pass's path and dtype (the same in every share)


def decode_prompts(
    passes: list[Pass],
    prompts: list[Tensor],  # each [T] or [1, T]
    indices: list[int] | None = None,  # the prompts to decode (None: all); a process's share
    *,
    k: int = 4,
    sampling: Sampling = GREEDY,
    max_new_tokens: int = 64,
    warmup: int = 1,
    seed: int = 0,
    adaptive_k: bool = False,
    eos_token_ids: list[int] | None = None,
    tree: TreeSpec | None = None,  # draft trees instead of chains (k is then unused)
    entropy: bool = True,  # record entropy_alpha of "spec" (False: None, no probe work)
) -> Decoded:
    """Decode `indices` of `prompts` in every pass, interleaved prompt by prompt (prompt i:
    every pass, in order, then prompt i + 1), so that the machine's drift over the minutes of
    an evaluation hits every pass alike and no ratio divides by a pass decoded at another
    time. Prompt i's generator is seeded seed + i in every pass, whatever share it is in;
    the share's first `warmup` prompts are decoded in every pass first, untimed."""
    indices = list(range(len(prompts))) if indices is None else list(indices)
    names = [p.name for p in passes]
    if len(set(names)) != len(names) or "spec" not in names:
        raise ValueError(f"decode_prompts needs one pass named 'spec' and unique names: {names}")
    device = passes[0].target.device
    kw = dict(sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    spec_kw = dict(k=k, adaptive_k=adaptive_k, tree=tree, **kw)

    def run(p: Pass, i: int, probe: EntropyProbe | None = None) -> GenerationResult:
        gen = torch.Generator(device=device).manual_seed(seed + i)
        prompt = _as_row(prompts[i]).to(p.target.device)
        if p.drafter is None:
            return generate(p.target, prompt, None, generator=gen, **kw)
        return generate(p.target, prompt, p.drafter, generator=gen, probe=probe, **spec_kw)

    for i in indices[:warmup]:  # caches, allocator, kernel choice
        for p in passes:
            run(p, i)
    facts = {
        "k": k, "adaptive_k": adaptive_k, "tree": tree, "sampling": sampling,
        "max_new_tokens": max_new_tokens, "entropy": entropy, "device": str(device),
        "passes": {p.name: {"path": path_of(p.target), "dtype": dtype_of(p.target)}
                   for p in passes},
    }  # fmt: skip
    out = Decoded(indices, {p.name: [] for p in passes}, [], facts)
    for i in indices:  # the measured runs only, not the warm-up, are probed
        probe = EntropyProbe() if entropy else None
        for p in passes:
            out.runs[p.name].append(run(p, i, probe if p.name == "spec" else None))
        if probe is not None:
            out.entropy.append(
                ([h.cpu() for h in probe.entropy], [a.cpu() for a in probe.acceptance])
            )
    return out


def path_of(target: Target | CompiledTarget) -> str:
    """ "compiled" for a CompiledTarget or a drafter's view over one (`compiled`)."""
    views = getattr(target, "compiled", None)  # selfspec's CompiledSharedCache
    return (
        "compiled"
        if isinstance(target, CompiledTarget) or isinstance(views, CompiledTarget)
        else "eager"
    )


def dtype_of(target: Target) -> str:
    return str(target.dtype).removeprefix("torch.")


def merge_decoded(parts: list[Decoded]) -> Decoded:
    """The shares of several processes as one, in prompt order."""
    order = sorted((i, p, j) for p, part in enumerate(parts) for j, i in enumerate(part.indices))
    facts = next((part.facts for part in parts if part.indices), parts[0].facts)
    runs = {name: [parts[p].runs[name][j] for _, p, j in order] for name in facts["passes"]}
    entropy = [parts[p].entropy[j] for _, p, j in order if parts[p].entropy]
    return Decoded([i for i, _, _ in order], runs, entropy, facts)


def evaluate(
    target: Target,
    drafter: Drafter,
    prompts: list[Tensor],  # each [T] or [1, T]
    baseline: Target | None = None,
    **kw,
) -> dict:
    """`decode_prompts` of AR and speculative decoding over every prompt, then `summarize`
    (the keys: module doc)."""
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    return summarize(decode_prompts(plain_passes(target, drafter, baseline), prompts, **kw))


def tokens_per_s(runs: list[GenerationResult]) -> float:
    return sum(r.num_tokens for r in runs) / sum(r.total_s for r in runs)


def summarize(decoded: Decoded) -> dict:
    """The metrics of the module doc from every prompt's decodes (`decode_prompts`, or the
    `merge_decoded` shares of several processes)."""
    runs, facts = decoded.runs, decoded.facts
    spec_runs, passes = runs["spec"], facts["passes"]
    if not spec_runs:
        raise ValueError("summarize needs at least one decoded prompt")
    k, tree, sampling = facts["k"], facts["tree"], facts["sampling"]
    probe = None
    if facts["entropy"]:
        probe = EntropyProbe()
        for entropies, acceptances in decoded.entropy:
            probe.entropy += entropies
            probe.acceptance += acceptances

    stats = acceptance_stats(spec_runs, max(max(r.draft_lens, default=k) for r in spec_runs))
    # The AR `speedup` divides by: the spec decode's own path and dtype where decoded, else
    # the fastest eager AR (decode.same_dtype_ar=false on an eager path of another dtype).
    ar_name = "ar" if "ar" in runs else "ar_eager"
    ar_runs = runs[ar_name]
    spec_tps, ar_tps = tokens_per_s(spec_runs), tokens_per_s(ar_runs)
    # Per-round costs (both prefills excluded): one AR target step, one verify forward, the
    # drafter's propose + commit.
    spec_rounds = sum(r.rounds for r in spec_runs)
    t_target_1 = sum(r.verify_s for r in ar_runs) / max(sum(r.rounds for r in ar_runs), 1)
    t_verify = sum(r.verify_s for r in spec_runs) / max(spec_rounds, 1)
    t_draft = sum(r.draft_s for r in spec_runs) / max(spec_rounds, 1)
    round_time = sum(r.rounds_s for r in spec_runs)
    predicted = stats["tau"] * t_target_1 / (t_verify + t_draft)
    out = {
        **stats,
        "k": k if tree is None else tree.max_depth,
        "adaptive_k": facts["adaptive_k"],
        "tree": None if tree is None else dataclasses.asdict(tree),
        "tree_size": None,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": facts["max_new_tokens"],
        "num_prompts": len(spec_runs),
        "accepted_per_prompt": [sum(r.accept_counts) for r in spec_runs],
        "new_tokens": sum(r.num_tokens for r in spec_runs),
        "ar_new_tokens": sum(r.num_tokens for r in ar_runs),
        "tokens_per_s": spec_tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": spec_tps / ar_tps,
        "wall_time_ratio": sum(r.total_s for r in ar_runs) / sum(r.total_s for r in spec_runs),
        "predicted_speedup": predicted,
        # What of the speedup its forwards allow (tau x AR step / (verify + draft)) the loop
        # delivers: under 1 by the rounds' own work (sampling, acceptance, rollback, Python)
        # and the drafter's prefill, over it where the AR's loop pays more per token.
        "loop_efficiency": spec_tps / ar_tps / predicted,
        "t_target_step_ms": 1e3 * t_target_1,
        "t_verify_ms": 1e3 * t_verify,
        "t_draft_round_ms": 1e3 * t_draft,
        "draft_time_share": sum(r.draft_s for r in spec_runs) / max(round_time, 1e-9),
        "overhead_share": sum(r.overhead_s for r in spec_runs) / max(round_time, 1e-9),
        "ar_overhead_share": sum(r.overhead_s for r in ar_runs)
        / max(sum(r.rounds_s for r in ar_runs), 1e-9),
        "greedy_match_rate": None,
        "greedy_exact_match": None,
        "entropy_alpha": None if probe is None else probe.summary(),
        "device": facts["device"],
        "path": passes["spec"]["path"],
        "dtype": passes["spec"]["dtype"],
        "ar_dtype": passes[ar_name]["dtype"],
    }
    out |= baselines(runs, passes, spec_tps)
    for name in [n for n in runs if n not in ("spec", "ar", "ar_eager")]:  # head, eager_spec
        extra = acceptance_stats(runs[name], k if tree is None else tree.max_depth)
        tps = tokens_per_s(runs[name])
        out |= {f"tau_{name}": extra["tau"], f"alpha_{name}": extra["alpha"],
                f"tokens_per_s_{name}": tps}  # fmt: skip
        if "eager_ar_tokens_per_s" in out:
            out[f"speedup_{name}_eager_ar"] = tps / out["eager_ar_tokens_per_s"]
        if "best_ar_tokens_per_s" in out:
            out[f"speedup_{name}"] = tps / out["best_ar_tokens_per_s"]
    sizes = [n for r in spec_runs for n, d in zip(r.tree_sizes, r.draft_lens) if d > 0]
    if tree is not None and sizes:
        out["tree_size"] = sum(sizes) / len(sizes)
    # Greedy match is a losslessness check within one path and dtype: an AR in another dtype
    # parts from the speculative decode at near-ties (docs/design.md §3), so it is measured
    # against "ar" alone.
    if sampling.greedy and "ar" in runs:
        pairs = [(a.sequences[0], s.sequences[0]) for a, s in zip(runs["ar"], spec_runs)]
        out["greedy_match_rate"] = sum(greedy_match(a, s) for a, s in pairs) / len(pairs)
        out["greedy_exact_match"] = sum(a == s for a, s in pairs) / len(pairs)
    return out


def baselines(runs: dict[str, list[GenerationResult]], passes: dict, spec_tps: float) -> dict:
    """The speculative decode against each AR decoded beside it: `speedup_eager_ar` against
    the fastest eager AR; with a compiled AR, `speedup_compiled_ar` against it and
    `speedup_best_ar` against the faster of the two (`best_ar` names it), the fastest plain
    decoding this machine runs (docs/design.md §3). Without a compiled AR there is no
    `speedup_best_ar`: an eager AR is not the machine's fastest."""
    ars = {passes[n]["path"]: n for n in ("ar", "ar_eager") if n in runs}
    out = {}
    for path, name in ars.items():
        tps = tokens_per_s(runs[name])
        out |= {f"{path}_ar_tokens_per_s": tps, f"speedup_{path}_ar": spec_tps / tps,
                f"{path}_ar_dtype": passes[name]["dtype"]}  # fmt: skip
    if "compiled" in ars:
        best = max(ars, key=lambda path: out[f"{path}_ar_tokens_per_s"])
        out |= {"best_ar": f"{best} {out[f'{best}_ar_dtype']}",
                "best_ar_tokens_per_s": out[f"{best}_ar_tokens_per_s"],
                "speedup_best_ar": spec_tps / out[f"{best}_ar_tokens_per_s"]}  # fmt: skip
    return out
