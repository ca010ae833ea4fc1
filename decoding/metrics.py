"""Acceptance and speed metrics of a drafter on a target (definitions: docs/design.md §3).

`evaluate` decodes every prompt twice in the same call, plain AR and speculative (both
through decoding/spec.py, batch 1, same dtype/device/max_new_tokens), after a warm-up,
and returns a JSON-able dict:
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
    tokens_per_s, ar_tokens_per_s, speedup (= tokens/s ratio; equals the AR/spec wall-time
                         ratio when both emit the same tokens, e.g. greedy), wall_time_ratio
                         (None where the AR was decoded at another sampling: `with_ar`)
    ar_dtype             the dtype the AR above ran in: the decode dtype, or with
                         `same_dtype_ar=False` the fastest AR's
    best_ar_dtype, best_ar_tokens_per_s, speedup_best_ar
                         the same against the fastest AR of this machine: `baseline`, the
                         target in another dtype, decoded AR interleaved with the other two
                         (None: the AR above is the fastest)
    predicted_speedup    τ·T_target(1) / (T_verify(k) + T_draft(k)) from measured per-round
                         costs: T_target(1) an AR step, T_verify a verify forward, T_draft the
                         drafter's propose + commit per round (t_*_ms); both prefills, the
                         target's and the drafter's, are left out of every per-round cost
    draft_time_share     share of the round time (wall time minus both prefills) spent in
                         the drafter's propose/commit
    overhead_share       share of round time outside target and drafter calls
    greedy_match_rate    greedy only: mean fraction of AR tokens reproduced before the first
                         difference (1.0 = lossless; in bf16, k-row kernels round differently)
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


@dataclass
class Decoded:
    """What `evaluate` measures, kept per prompt so that the shares of the prompts decoded
    in several processes merge (`merge_decoded`) into the record one process would give:
    `summarize` sums and concatenates in prompt order."""

    indices: list[int]  # the prompts decoded, positions in the caller's list
    ar: list[GenerationResult]  # per prompt: plain AR
    spec: list[GenerationResult]  # speculative
    best: list[GenerationResult]  # the fastest AR's dtype (empty without a baseline)
    entropy: list[tuple[list[Tensor], list[Tensor]]]  # per prompt: EntropyProbe's rounds, CPU
    facts: dict  # settings and devices the record reports (the same in every share)


def decode_prompts(
    target: Target,
    drafter: Drafter,
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
    entropy: bool = True,  # record entropy_alpha (False: None, and no probe work per round)
    baseline: Target | None = None,  # the same target in the dtype of the machine's fastest AR
    same_dtype_ar: bool = True,  # with a baseline: also decode AR in the decode dtype
    ar: bool = True,  # False: the speculative decode alone (`with_ar` adds another's AR)
) -> Decoded:
    """Decode `indices` of `prompts` AR and speculatively (and AR in the baseline's dtype),
    prompt i with the generator seeded seed + i whatever share it is in, after a warm-up on
    the share's first `warmup` prompts. `same_dtype_ar=False` with a baseline decodes AR in
    the baseline's dtype only: one pass fewer, every speedup is then against the fastest AR,
    and the greedy match (defined within one dtype) is not measured. `ar=False` decodes no AR
    pass at all: an AR forward costs the same at every sampling, so an evaluation of several
    samplings decodes the AR at one and divides the others by it (`with_ar`)."""
    if baseline is not None and not same_dtype_ar:
        ar_target, baseline = baseline, None
    else:
        ar_target = target
    indices = list(range(len(prompts))) if indices is None else list(indices)
    device = target.device
    kw = dict(sampling=sampling, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids)
    spec_kw = dict(k=k, adaptive_k=adaptive_k, tree=tree, **kw)

    def gen(seed_offset: int) -> torch.Generator:
        return torch.Generator(device=device).manual_seed(seed + seed_offset)

    for i in indices[:warmup]:  # caches, allocator, kernel choice
        if ar:
            generate(ar_target, _as_row(prompts[i]), None, generator=gen(i), **kw)
        generate(target, _as_row(prompts[i]), drafter, generator=gen(i), **spec_kw)
        if baseline is not None and ar:
            generate(
                baseline, _as_row(prompts[i]).to(baseline.device), None, generator=gen(i), **kw
            )
    out = Decoded(indices, [], [], [], [], {
        "k": k, "adaptive_k": adaptive_k, "tree": tree, "sampling": sampling,
        "max_new_tokens": max_new_tokens, "entropy": entropy, "device": str(device),
        "dtype": str(target.dtype).removeprefix("torch."),
        "ar_dtype": str(ar_target.dtype).removeprefix("torch."),
        "best_ar_dtype": str((baseline or ar_target).dtype).removeprefix("torch."),
    })  # fmt: skip
    for i in indices:  # the measured runs only, not the warm-up, are probed
        prompt = _as_row(prompts[i])
        probe = EntropyProbe() if entropy else None
        if ar:
            out.ar.append(generate(ar_target, prompt, None, generator=gen(i), **kw))
        out.spec.append(generate(target, prompt, drafter, generator=gen(i), probe=probe, **spec_kw))
        if baseline is not None and ar:  # interleaved with the other two, prompt by prompt
            out.best.append(generate(baseline, prompt, None, generator=gen(i), **kw))
        if probe is not None:
            out.entropy.append(
                ([h.cpu() for h in probe.entropy], [a.cpu() for a in probe.acceptance])
            )
    return out


def with_ar(decoded: Decoded, ar_decoded: Decoded) -> Decoded:
    """`decoded` (a speculative decode alone, `decode_prompts(..., ar=False)`) with the AR
    passes of `ar_decoded`, the same prompts decoded at another sampling: what `summarize`
    divides its tokens/s by. The AR's tokens are then those of that sampling (greedy match
    is measured for greedy `decoded` only, whose AR is its own)."""
    if decoded.indices != ar_decoded.indices:
        raise ValueError(f"AR of prompts {ar_decoded.indices}, decoded {decoded.indices}")
    facts = decoded.facts | {"ar_sampling": ar_decoded.facts["sampling"]}
    return dataclasses.replace(decoded, ar=ar_decoded.ar, best=ar_decoded.best, facts=facts)


def merge_decoded(parts: list[Decoded]) -> Decoded:
    """The shares of several processes as one, in prompt order."""
    order = sorted((i, p, j) for p, part in enumerate(parts) for j, i in enumerate(part.indices))

    def pick(field: str) -> list:  # `best` and `entropy` are empty in every share or none
        return [getattr(parts[p], field)[j] for _, p, j in order if getattr(parts[p], field)]

    facts = next((part.facts for part in parts if part.indices), parts[0].facts)
    merged = [pick(field) for field in ("ar", "spec", "best", "entropy")]
    return Decoded([i for i, _, _ in order], *merged, facts)


def evaluate(
    target: Target,
    drafter: Drafter,
    prompts: list[Tensor],  # each [T] or [1, T]
    **kw,
) -> dict:
    """`decode_prompts` over every prompt, then `summarize` (the keys: module doc)."""
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    return summarize(decode_prompts(target, drafter, prompts, **kw))


def summarize(decoded: Decoded) -> dict:
    """The metrics of the module doc from every prompt's decodes (`decode_prompts`, or the
    `merge_decoded` shares of several processes)."""
    ar_runs, spec_runs, best_runs = decoded.ar, decoded.spec, decoded.best
    if not spec_runs:
        raise ValueError("summarize needs at least one decoded prompt")
    facts = decoded.facts
    k, tree, sampling = facts["k"], facts["tree"], facts["sampling"]
    probe = None
    if facts["entropy"]:
        probe = EntropyProbe()
        for entropies, acceptances in decoded.entropy:
            probe.entropy += entropies
            probe.acceptance += acceptances

    stats = acceptance_stats(spec_runs, max(max(r.draft_lens, default=k) for r in spec_runs))
    ar_time = sum(r.total_s for r in ar_runs)
    spec_time = sum(r.total_s for r in spec_runs)
    ar_tokens = sum(r.num_tokens for r in ar_runs)
    spec_tokens = sum(r.num_tokens for r in spec_runs)
    ar_tps, spec_tps = ar_tokens / ar_time, spec_tokens / spec_time
    # Per-round costs (both prefills excluded): one AR target step, one verify forward, the
    # drafter's propose + commit.
    ar_rounds = sum(r.rounds for r in ar_runs)
    spec_rounds = sum(r.rounds for r in spec_runs)
    t_target_1 = sum(r.verify_s for r in ar_runs) / max(ar_rounds, 1)
    t_verify = sum(r.verify_s for r in spec_runs) / max(spec_rounds, 1)
    t_draft = sum(r.draft_s for r in spec_runs) / max(spec_rounds, 1)
    round_time = sum(r.rounds_s for r in spec_runs)
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
        "new_tokens": spec_tokens,
        "ar_new_tokens": ar_tokens,
        "tokens_per_s": spec_tps,
        "ar_tokens_per_s": ar_tps,
        "speedup": spec_tps / ar_tps,
        # Against the fastest AR this machine runs (its best dtype; docs/design.md §3): the
        # AR above when no faster baseline was given.
        "best_ar_dtype": facts["best_ar_dtype"],
        "best_ar_tokens_per_s": ar_tps,
        "speedup_best_ar": spec_tps / ar_tps,
        "wall_time_ratio": ar_time / spec_time,
        "predicted_speedup": stats["tau"] * t_target_1 / (t_verify + t_draft),
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
        "dtype": facts["dtype"],
        "ar_dtype": facts.get("ar_dtype", facts["dtype"]),
    }
    if facts.get("ar_sampling", sampling) != sampling:  # the AR decoded other text
        out["wall_time_ratio"] = None
    if best_runs:
        best_tps = sum(r.num_tokens for r in best_runs) / sum(r.total_s for r in best_runs)
        out["best_ar_tokens_per_s"] = best_tps
        out["speedup_best_ar"] = spec_tps / best_tps
    sizes = [n for r in spec_runs for n, d in zip(r.tree_sizes, r.draft_lens) if d > 0]
    if tree is not None and sizes:
        out["tree_size"] = sum(sizes) / len(sizes)
    # Greedy match is a losslessness check within one dtype: AR in another dtype parts from
    # the speculative decode at near-ties (docs/design.md §3), so it is not measured then.
    same_dtype = facts.get("ar_dtype", facts["dtype"]) == facts["dtype"]
    if sampling.greedy and facts.get("ar_sampling", sampling).greedy and same_dtype:
        matches = [greedy_match(a.sequences[0], s.sequences[0]) for a, s in zip(ar_runs, spec_runs)]
        out["greedy_match_rate"] = sum(matches) / len(matches)
        out["greedy_exact_match"] = sum(
            a.sequences == s.sequences for a, s in zip(ar_runs, spec_runs)
        ) / len(ar_runs)
    return out
