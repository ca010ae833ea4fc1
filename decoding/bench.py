"""Pieces of the decode benchmark (scripts/bench_decode.py, whose help describes the rows and
the timing): the prompts, the truncated-target draft LM, one call of each method
(transformers `generate` with a hook counting its target forwards, or our loop), the
compiled twins of our rows, and the per-method summary and its markdown tables.

τ is one figure for every row: tokens emitted per target verify forward after the prefill,
bonus included (`tau_figures`; transformers' rounds come from `hf_rounds`). `tau_drafted`
counts the forwards that had drafts only.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from decoding.compiled import CompiledTarget
from decoding.drafter import Drafter, Sampling
from decoding.drafters import make_drafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.inductor import STATS, resolve_mode
from decoding.metrics import greedy_match
from decoding.spec import generate
from decoding.tree import TreeSpec
from models.dtypes import cast_keep_rotary
from models.target import Target

PROMPTS = [  # code / prose / qa, with some text to copy so prompt lookup has a chance
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence in plain English: 'The quarterly results exceeded expectations "
    "owing to robust demand across all regions.'",
    "What is the capital of France, and why is it famous? Answer in three sentences.",
    "Explain what a hash map is to a beginner programmer.",
    "Summarise the plot of Romeo and Juliet in a short paragraph.",
    'def is_prime(n):\n    """Return True if n is prime."""\nComplete this function and explain it.',
]
Method = Callable[[torch.Tensor, int], dict]  # (prompt ids [1, T], prompt index) -> call record


def truncated_draft(target: Target, first: int, last: int = 0) -> LlamaForCausalLM:
    """A standalone LM from the target's first `first` and last `last` decoder layers + the
    final norm + the tied head (LayerSkip-style: the last layers map into output space)."""
    n = target.num_layers
    if not (1 <= first <= n and 0 <= last <= n - first):
        raise ValueError(
            f"the target has {n} decoder layers: need 1 <= --draft-layers ({first}) and "
            f"--draft-layers + --draft-last-layers ({first + last}) <= {n} "
            "(tiny target: --draft-layers 1 --draft-last-layers 0)"
        )
    keep = list(range(first)) + list(range(n - last, n))  # target layer ids
    cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": len(keep)})
    # float32 rotary frequencies, as in the target the layers come from (models/dtypes.py)
    draft = cast_keep_rotary(LlamaForCausalLM(cfg).to(target.device), target.dtype)
    state = {}
    for key, value in target.model.state_dict().items():
        if key.startswith("model.layers."):
            layer = int(key.split(".")[2])
            if layer not in keep:
                continue
            key = key.replace(f"model.layers.{layer}.", f"model.layers.{keep.index(layer)}.", 1)
        state[key] = value
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"truncated draft: missing {missing}, unexpected {unexpected}")
    draft.tie_weights()
    draft.generation_config = GenerationConfig(**target.model.generation_config.to_dict())
    return draft.eval().requires_grad_(False)


def tau_figures(accept_counts: list[int], draft_lens: list[int]) -> dict:
    """τ over every verify forward, and over the forwards that had drafts only."""
    drafted = [n for n, d in zip(accept_counts, draft_lens) if d > 0]
    return {
        "tau": 1 + sum(accept_counts) / len(accept_counts) if accept_counts else None,
        "tau_drafted": 1 + sum(drafted) / len(drafted) if drafted else None,
        "verify_forwards": len(accept_counts),
        "drafted_forwards": len(drafted),
    }


def record_forwards(model: torch.nn.Module) -> tuple[list, torch.utils.hooks.RemovableHandle]:
    """A hook appending (input length, first position id) for every call of `model`."""
    calls = []

    def hook(module, args, kwargs):
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if kwargs.get("position_ids") is None:
            raise RuntimeError("transformers called the target without position_ids: cannot "
                               "tell how many tokens each forward emitted")  # fmt: skip
        # A copy, not .item(): no device sync inside transformers' timed loop.
        calls.append((ids.shape[1], kwargs["position_ids"][0, 0].clone()))

    return calls, model.register_forward_pre_hook(hook, with_kwargs=True)


def hf_rounds(
    forwards: list[tuple[int, int]], prompt_len: int, new_tokens: int
) -> tuple[list[int], list[int], int]:
    """transformers' target forwards -> (accepted drafts, drafts) per forward after the prefill
    and the tokens the prefill forward emitted. Before each later forward the cache holds the
    prompt and every emitted token but the newest, and the forward reads [newest, drafts], so
    it starts at position prompt_len + emitted - 1."""
    if not forwards or int(forwards[0][1]) != 0 or forwards[0][0] < prompt_len:
        raise RuntimeError(
            f"expected transformers' first target forward to be the prefill of the "
            f"{prompt_len}-token prompt at position 0, got (length, position) {forwards[:1]}"
        )
    starts = [int(s) for _, s in forwards[1:]] + [prompt_len + new_tokens - 1]
    emitted = [b - a for a, b in zip(starts, starts[1:])]  # per forward after the prefill
    if any(e < 1 for e in emitted):
        raise RuntimeError(f"transformers' forwards start at {starts}: not one round each")
    return [e - 1 for e in emitted], [n - 1 for n, _ in forwards[1:]], starts[0] - prompt_len + 1


def hf_method(target: Target, hf_kw: dict, seed: int, forwards: list, **extra) -> Method:
    """transformers `generate` with extra generation-config fields (gen=) / call kwargs (call=);
    `forwards` is record_forwards' list on target.model."""

    def fn(ids, i):
        torch.manual_seed(seed + i)
        forwards.clear()
        cfg = GenerationConfig(**hf_kw, **extra.get("gen", {}))
        out = target.model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **extra.get("call", {})
        )
        seq = out[0, ids.shape[1] :].tolist()
        accepts, drafts, prefill_tokens = hf_rounds(forwards, ids.shape[1], len(seq))
        return dict(sequence=seq, accept_counts=accepts, draft_lens=drafts,
                    prefill_tokens=prefill_tokens)  # fmt: skip

    return fn


def ours_method(
    target: Target,
    drafter: Drafter | None,
    k: int,
    sampling: Sampling,
    max_new: int,
    seed: int,
    tree: TreeSpec | None = None,
) -> Method:
    def fn(ids, i):
        g = torch.Generator(device=target.device).manual_seed(seed + i)
        graphs = STATS.graphs + STATS.cudagraphs
        r = generate(target, ids, drafter, k=k, sampling=sampling, max_new_tokens=max_new,
                     generator=g, tree=tree)  # fmt: skip
        seq = r.sequences[0]
        # Tokens emitted per round - 1: the round that ends on an accepted EOS draft emits no
        # bonus after it, so this is what was emitted, as for transformers' rows.
        accepts = [t - 1 for t in r.round_tokens]
        return dict(
            sequence=seq, accept_counts=accepts, draft_lens=r.draft_lens, prefill_tokens=1,
            loop_s=r.verify_s + r.draft_s + r.overhead_s,  # the rounds: prefills left out
            total_s=r.total_s, draft_s=r.draft_s, overhead_s=r.overhead_s,
            tree_nodes=sum(n for n, d in zip(r.tree_sizes, r.draft_lens) if d > 0),
            # graphs compiled or CUDA graphs recorded during this call (compiled rows)
            graphs=STATS.graphs + STATS.cudagraphs - graphs,
        )  # fmt: skip

    return fn


@dataclass
class CompiledRows:
    """The compiled twins of our loop's rows, built once per run (their graphs serve every
    temperature): row name -> (compiled target, drafter or None, tree or None), and the
    seconds / graphs that building each compiled target and each drafter took."""

    mode: str
    rows: dict[str, tuple[CompiledTarget, Drafter | None, TreeSpec | None]] = field(
        default_factory=dict
    )
    compile_s: dict[str, float] = field(default_factory=dict)  # "target <shape>" or row name
    graphs: dict[str, int] = field(default_factory=dict)


def build_compiled(
    target: Target,
    draft: LlamaForCausalLM,
    heads: dict[str, torch.nn.Module],
    trees: dict[str, TreeSpec],
    k: int,
    max_len: int,  # longest prompt (the warm-up one included) + max_new_tokens
    mode: str,
    keep: list[str] | None = None,
) -> CompiledRows:
    """The compiled twin of every row of our loop that `bench` runs (same `keep` filter).
    One CompiledTarget per verify shape, padded to fixed widths: chains (1, k + 1), each
    tree (1, its size + 1); it returns the hidden layers of every drafter it serves."""
    makers: dict[str, tuple[str, Callable]] = {"ours_ar_compiled": ("chain", lambda t: None)}
    if keep is None or "ours_spec_lm" in keep:
        makers["ours_spec_lm_compiled"] = ("chain", lambda t: DraftLMDrafter(draft, t))
    if keep is None or "ours_spec_ngram" in keep:
        ngram = NgramDrafter(max_ngram=3, vocab_size=target.vocab_size)  # stateless per call
        makers["ours_spec_ngram_compiled"] = ("chain", lambda t: ngram)
    for kind, tree_kind in (("medusa", "static"), ("eagle", "dynamic")):
        if kind in heads:
            make = lambda t, m=heads[kind]: make_drafter(m, t)  # noqa: E731
            makers[f"ours_{kind}_chain_compiled"] = ("chain", make)
            makers[f"ours_{kind}_{tree_kind}_compiled"] = (tree_kind, make)
    widths = {"chain": (1, k + 1)} | {kind: (1, tree.size + 1) for kind, tree in trees.items()}
    layers: dict[str, set[int]] = {}  # verify shape -> the hidden layers its drafters read
    for shape, make in makers.values():
        eager = make(target)  # an eager drafter, only to read its hidden layers
        layers.setdefault(shape, set()).update(eager.hidden_layers if eager else ())
    out = CompiledRows(resolve_mode(mode, target.device))
    compiled: dict[str, CompiledTarget] = {}
    for shape in layers:
        graphs, seconds = STATS.graphs, STATS.seconds
        tree = trees.get(shape)
        levels = (tree.top_k,) if tree is not None and tree.kind == "dynamic" else ()
        compiled[shape] = CompiledTarget(
            target, max_len + widths[shape][-1], widths[shape], sorted(layers[shape]), mode,
            draft_widths=levels,
        )  # fmt: skip
        compiled[shape].warmup()
        name = f"target {shape} widths {widths[shape]}"
        out.compile_s[name], out.graphs[name] = STATS.seconds - seconds, STATS.graphs - graphs
    for name, (shape, make) in makers.items():
        graphs, seconds = STATS.graphs, STATS.seconds
        tree = None if shape == "chain" else trees[shape]
        out.rows[name] = (compiled[shape], make(compiled[shape]), tree)
        out.compile_s[name], out.graphs[name] = STATS.seconds - seconds, STATS.graphs - graphs
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "per_repeat": values}  # fmt: skip


def summarize(runs: dict[str, list[list[dict]]], greedy: bool) -> list[dict]:
    """One row per method: tokens/s and speedups per repeat (median, min-max), τ figures and
    counts pooled over every call, greedy match vs hf_generate (first repeat)."""
    tps = {
        name: [
            sum(len(c["sequence"]) for c in rep) / sum(c["seconds"] for c in rep) for rep in reps
        ]
        for name, reps in runs.items()
    }
    rows = []
    for name, reps in runs.items():
        calls = [c for rep in reps for c in rep]
        row = {"method": name, "tokens_per_s": spread(tps[name])}
        for ref in ("ours_ar", "ours_ar_compiled", "hf_generate"):
            if ref in tps:
                row[f"speedup_vs_{ref}"] = spread([a / b for a, b in zip(tps[name], tps[ref])])
        twin = name.removesuffix("_compiled")
        if twin != name and twin in tps:  # the compiled row against its eager twin
            row["speedup_vs_eager"] = spread([a / b for a, b in zip(tps[name], tps[twin])])
        row |= tau_figures(
            [n for c in calls for n in c["accept_counts"]],
            [d for c in calls for d in c["draft_lens"]],
        )
        row["new_tokens"] = sum(len(c["sequence"]) for c in calls)
        row["prefill_tokens"] = sum(c["prefill_tokens"] for c in calls)
        row["greedy_match_rate"] = None
        if greedy and "hf_generate" in runs:
            pairs = zip(runs["hf_generate"][0], reps[0])
            row["greedy_match_rate"] = statistics.mean(
                greedy_match(a["sequence"], b["sequence"]) for a, b in pairs
            )
        if "loop_s" in calls[0]:  # our loop's own time split
            loop_s = sum(c["loop_s"] for c in calls)
            row["overhead_share"] = sum(c["overhead_s"] for c in calls) / loop_s
            # Same as decoding/metrics.py's draft_time_share: both prefills left out.
            row["draft_share"] = sum(c["draft_s"] for c in calls) / loop_s
            row["ms_per_round"] = 1e3 * loop_s / row["verify_forwards"]
            nodes = sum(c["tree_nodes"] for c in calls)
            row["tree_size"] = nodes / row["drafted_forwards"] if nodes else None
            row["graphs_timed"] = sum(c["graphs"] for c in calls)
        row["sequences"] = [c["sequence"][:16] for c in reps[0]]  # keep the JSON small
        rows.append(row)
    return rows


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(all_results: dict) -> str:
    lines = []
    for label, results in all_results.items():
        lines += [
            f"\n**{label}**\n",
            "| method | tokens/s median (min–max) | speedup vs our AR median (min–max) "
            "| speedup vs HF generate | τ (every forward) | τ drafted forwards only (share) "
            "| greedy match | overhead share | tree size |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            t, s = r["tokens_per_s"], r["speedup_vs_ours_ar"]
            share = r["drafted_forwards"] / r["verify_forwards"] if r["verify_forwards"] else 0
            lines.append(
                f"| {r['method']} | {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) "
                f"| {s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f}) "
                f"| {fmt(r.get('speedup_vs_hf_generate', {}).get('median'))} | {fmt(r['tau'])} "
                f"| {fmt(r['tau_drafted'])} ({share:.0%}) | {fmt(r['greedy_match_rate'], 3)} "
                f"| {fmt(r.get('overhead_share'), 3)} | {fmt(r.get('tree_size'), 1)} |"
            )
        lines += eager_vs_compiled(results)
    return "\n".join(lines)


def eager_vs_compiled(results: list[dict]) -> list[str]:
    """Markdown lines: every row of our loop that has a compiled twin, its speedup over the
    AR baseline of its own path (eager vs eager AR, compiled vs compiled AR) side by side.
    No lines when the run had no compiled rows."""
    by = {r["method"]: r for r in results}
    if "ours_ar_compiled" not in by:
        return []
    lines = [
        "",
        "| method | speedup eager (vs our AR) | speedup compiled (vs our compiled AR) "
        "| compiled ÷ eager tok/s | τ eager | τ compiled | compile s | graphs in timed calls |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, eager in by.items():
        twin = by.get(f"{name}_compiled")
        if twin is None:
            continue
        lines.append(
            f"| {name} | {eager['speedup_vs_ours_ar']['median']:.2f} "
            f"| {twin['speedup_vs_ours_ar_compiled']['median']:.2f} "
            f"| {twin['speedup_vs_eager']['median']:.2f} | {fmt(eager['tau'])} "
            f"| {fmt(twin['tau'])} | {fmt(twin['compile_s'], 1)} | {twin['graphs_timed']} |"
        )
    return lines
