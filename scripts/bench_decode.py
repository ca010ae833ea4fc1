"""Benchmark our decoder against transformers (one script of over 400 lines: every part serves it).

Same target, prompts and settings for every row.

Rows (batch 1, one process):
  hf_generate       transformers `generate`, plain
  ours_ar           our loop with no draft (decoding/spec.py)
  ours_spec_lm      our loop with a draft LM
  ours_spec_ngram   our loop with n-gram prompt lookup
  hf_assisted       transformers assisted generation with the same draft LM (assistant_model=)
  hf_prompt_lookup  transformers prompt lookup (prompt_lookup_num_tokens=)
Trained heads (checkpoint directories, train/checkpoint.py; `fresh` = untrained heads, for
smoke runs only) add chain vs tree rows (decoding/tree.py):
  ours_medusa_chain / ours_medusa_static     Medusa heads, k-chain / static tree (--paths)
  ours_eagle_chain / ours_eagle_dynamic      EAGLE heads, k-chain / EAGLE-2 dynamic tree
`--methods` keeps only the named rows (hf_generate and ours_ar are always measured).
`--compile` adds the compiled path (decoding/compiled.py, docs/fastpath.md) beside every row
of our loop: `<row>_compiled` runs the same drafter over a CompiledTarget (static KV cache,
torch.compile of the fixed-width forwards, CUDA graphs on CUDA), and `ours_ar_compiled` is
its AR baseline. Speedups are reported against both AR baselines: `speedup_vs_ours_ar`
(eager AR) and `speedup_vs_ours_ar_compiled`; the markdown's second table puts "speedup
eager" (eager row vs eager AR) beside "speedup compiled" (compiled row vs compiled AR).
Compiling happens before any timing (the CompiledTargets are built once for every
temperature); its seconds are reported apart (`compile_s` per row, `compile` in the JSON),
and `graphs_timed` counts graphs compiled inside timed calls (0, else the timing is void).

Timing: one warm-up per method; then the methods run INTERLEAVED per prompt (prompt 1: every
method in turn, then prompt 2, ...), --repeats passes with the method order rotated by one per
pass, so drift on a shared machine is spread over all methods. tokens/s and speedup vs our AR
(and vs HF generate) of the SAME pass are reported as median and min-max over the passes.

τ, one definition for every row: tokens emitted per target verify forward, bonus included,
every forward after the prefill counted (the prefill forward and its `prefill_tokens` are left
out; transformers' assisted / prompt-lookup prefill also verifies drafts). Ours: from
GenerationResult.round_tokens / draft_lens; transformers': from a hook on the target
(`hf_rounds`). `tau_drafted`: the same over forwards that had drafts only; not comparable.

No second SmolLM-family model exists offline, so the draft LM is a truncated copy of the
target: its first --draft-layers decoder layers + its last --draft-last-layers + the final
norm + the tied head (same tokenizer by construction). The same draft serves ours and HF's.

    .venv/bin/python scripts/bench_decode.py --out runs/bench/decode.json
    .venv/bin/python scripts/bench_decode.py --methods none --medusa runs/medusa_kl/seed0/checkpoints/step_00000200 \
        --eagle runs/eagle_tv/seed0/checkpoints/step_00000200 --out runs/bench/tree.json
    .venv/bin/python scripts/bench_decode.py --compile --methods none \
        --eagle runs/eagle_tv/seed0/checkpoints/step_00000200 --out runs/bench/compiled.json
    # smoke run (seconds), tiny random target:
    .venv/bin/python scripts/bench_decode.py --target tiny --draft-layers 1 --draft-last-layers 0 \
        --num-prompts 2 --max-new-tokens 16 --repeats 2 --temperatures 0 --out /tmp/bench_tiny.json
    # the same with compiled rows, no code generation (tracing only, seconds):
    ... --compile --compile-mode aot_eager --eagle fresh
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decoding.compiled import MODES, STATS, CompiledTarget, resolve_mode  # noqa: E402
from decoding.drafter import Drafter, Sampling  # noqa: E402
from decoding.drafters import make_drafter  # noqa: E402
from decoding.drafters.draft_lm import DraftLMDrafter  # noqa: E402
from decoding.drafters.ngram import NgramDrafter  # noqa: E402
from decoding.metrics import greedy_match  # noqa: E402
from decoding.rounds import sync  # noqa: E402
from decoding.spec import generate  # noqa: E402
from decoding.tree import TreeSpec  # noqa: E402
from models import eagle, medusa  # noqa: E402
from models.dtypes import cast_keep_rotary, resolve_dtype  # noqa: E402
from models.target import Target  # noqa: E402
from models.target_loaders import build_tiny_random, load_smollm2  # noqa: E402
from train.checkpoint import load_draft  # noqa: E402

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


def load_heads(kind: str, path: str, target: Target) -> torch.nn.Module:
    """A trained Medusa / EAGLE draft from a checkpoint dir (or untrained: 'fresh'), in the
    target's dtype and device."""
    if path == "fresh":
        if kind == "medusa":
            model = medusa.from_target(target)
        else:  # full vocabulary: a reduced one needs the training data's token counts
            model = eagle.from_target(target, None, vocab_size="full")
    else:
        model = load_draft(path, target)
    return cast_keep_rotary(model.to(target.device), target.dtype).eval()


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
        graphs = STATS.graphs
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
            graphs=STATS.graphs - graphs,  # compiled during this call (compiled rows)
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
        compiled[shape] = CompiledTarget(
            target, max_len + widths[shape][-1], widths[shape], sorted(layers[shape]), mode
        )
        compiled[shape].warmup()
        name = f"target {shape} widths {widths[shape]}"
        out.compile_s[name], out.graphs[name] = STATS.seconds - seconds, STATS.graphs - graphs
    for name, (shape, make) in makers.items():
        graphs, seconds = STATS.graphs, STATS.seconds
        tree = None if shape == "chain" else trees[shape]
        out.rows[name] = (compiled[shape], make(compiled[shape]), tree)
        out.compile_s[name], out.graphs[name] = STATS.seconds - seconds, STATS.graphs - graphs
    return out


def run_interleaved(
    methods: dict[str, Method], prompts: list[torch.Tensor], warm: torch.Tensor, repeats: int
) -> dict[str, list[list[dict]]]:
    """method -> repeat -> prompt -> call record (+ "seconds"). Every method is warmed up
    first; then per repeat each prompt runs every method in turn, the order rotated by one
    each repeat."""
    device = warm.device
    for fn in methods.values():
        fn(warm, 0)
    names = list(methods)
    runs = {name: [[] for _ in range(repeats)] for name in names}
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for i, ids in enumerate(prompts):
            for name in order:
                sync(device)
                t0 = time.perf_counter()
                record = methods[name](ids, i)
                sync(device)
                record["seconds"] = time.perf_counter() - t0
                runs[name][rep].append(record)
    return runs


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


def bench(
    target: Target,
    draft: LlamaForCausalLM,
    prompts: list[torch.Tensor],
    warm: torch.Tensor,
    sampling: Sampling,
    k: int,
    max_new: int,
    seed: int,
    repeats: int = 3,
    heads: dict[str, torch.nn.Module] | None = None,  # "medusa" / "eagle" -> draft model
    trees: dict[str, TreeSpec] | None = None,  # "static" / "dynamic" -> tree spec
    keep: list[str] | None = None,  # methods to run besides hf_generate and ours_ar
    compiled: CompiledRows | None = None,  # the compiled twins of our rows (build_compiled)
) -> list[dict]:
    hf_kw = dict(
        max_new_tokens=max_new,
        do_sample=not sampling.greedy,
        pad_token_id=target.tokenizer.pad_token_id,
        eos_token_id=target.eos_token_ids,
    )
    if not sampling.greedy:
        hf_kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
    forwards, hook = record_forwards(target.model)  # our loop calls target.model.model only

    def hf(**extra):
        return hf_method(target, hf_kw, seed, forwards, **extra)

    def ours(drafter, tree=None):
        return ours_method(target, drafter, k, sampling, max_new, seed, tree)

    methods = {
        "hf_generate": hf(),
        "ours_ar": ours(None),
        "ours_spec_lm": ours(DraftLMDrafter(draft, target)),
        "ours_spec_ngram": ours(NgramDrafter(max_ngram=3, vocab_size=target.vocab_size)),
        "hf_assisted": hf(call={"assistant_model": draft}),
        "hf_prompt_lookup": hf(gen={"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3}),
    }
    if keep is not None:  # the two references always run
        methods = {m: fn for m, fn in methods.items() if m in {"hf_generate", "ours_ar", *keep}}
    heads, trees = heads or {}, trees or {}
    if "medusa" in heads:
        methods["ours_medusa_chain"] = ours(make_drafter(heads["medusa"], target))
        methods["ours_medusa_static"] = ours(make_drafter(heads["medusa"], target), trees["static"])
    if "eagle" in heads:
        methods["ours_eagle_chain"] = ours(make_drafter(heads["eagle"], target))
        methods["ours_eagle_dynamic"] = ours(make_drafter(heads["eagle"], target), trees["dynamic"])
    warm_s = {}  # compiled rows: seconds compiling graphs first needed by the warm-up call
    for name, (target_c, drafter, tree) in (compiled.rows if compiled else {}).items():
        methods[name] = ours_method(target_c, drafter, k, sampling, max_new, seed, tree)
        seconds = STATS.seconds
        methods[name](warm, 0)  # e.g. an EAGLE tree level's width: compiled here, untimed
        warm_s[name] = STATS.seconds - seconds
    draft.generation_config.update(
        num_assistant_tokens=k,
        num_assistant_tokens_schedule="constant",
        assistant_confidence_threshold=0.0,
    )
    try:
        rows = summarize(run_interleaved(methods, prompts, warm, repeats), sampling.greedy)
    finally:
        hook.remove()
    for row in rows:
        if row["method"] in warm_s:  # building the drafter (once per run) + this warm-up
            row["compile_s"] = compiled.compile_s[row["method"]] + warm_s[row["method"]]
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--draft-layers", type=int, default=20, help="first N target layers")
    ap.add_argument("--draft-last-layers", type=int, default=6, help="+ the last M target layers")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved passes over the prompts")
    ap.add_argument("--out", default="runs/bench/decode.json")
    ap.add_argument("--medusa", help="Medusa checkpoint dir, or 'fresh' (untrained, smoke only)")
    ap.add_argument("--eagle", help="EAGLE checkpoint dir, or 'fresh' (untrained, smoke only)")
    ap.add_argument("--paths", help="static tree paths as JSON, e.g. '[[0],[1],[0,0]]'")
    ap.add_argument("--tree-depth", type=int, default=4, help="dynamic tree levels")
    ap.add_argument("--tree-top-k", type=int, default=4, help="dynamic tree branching")
    ap.add_argument("--tree-nodes", type=int, default=16, help="dynamic tree nodes kept")
    ap.add_argument(
        "--methods", nargs="+", help="keep only these rows (+ hf_generate, ours_ar, heads); 'none'"
    )
    ap.add_argument(
        "--compile", action="store_true",
        help="add the compiled twin of every row of our loop (<row>_compiled, docs/fastpath.md)",
    )  # fmt: skip
    ap.add_argument(
        "--compile-mode", default="auto", choices=MODES,
        help="auto: CUDA graphs on CUDA, max-autotune-no-cudagraphs on CPU; aot_eager: no "
        "code generation (smoke runs)",
    )  # fmt: skip
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")

    load = load_smollm2 if args.target == "smollm2" else build_tiny_random
    target = load(dtype="float32", device="cpu")
    target = target.to(device=args.device, dtype=resolve_dtype(args.dtype))
    draft = truncated_draft(target, args.draft_layers, args.draft_last_layers)
    tok = target.tokenizer
    heads = {}
    for kind, path in (("medusa", args.medusa), ("eagle", args.eagle)):
        if path:
            heads[kind] = load_heads(kind, path, target)
    trees = {
        "static": TreeSpec(paths=json.loads(args.paths)) if args.paths else TreeSpec(),
        "dynamic": TreeSpec(
            kind="dynamic", depth=args.tree_depth, top_k=args.tree_top_k, num_nodes=args.tree_nodes
        ),
    }

    def encode(text: str) -> torch.Tensor:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )["input_ids"]
        return torch.tensor([ids], device=target.device)

    prompts = [encode(p) for p in PROMPTS[: args.num_prompts]]
    warm = encode(PROMPTS[-1])
    t0 = time.perf_counter()
    compiled = None
    if args.compile:  # before any timing; the graphs serve every temperature
        max_len = max(p.shape[1] for p in [*prompts, warm]) + args.max_new_tokens
        compiled = build_compiled(
            target, draft, heads, trees, args.k, max_len, args.compile_mode, args.methods
        )
        for name, seconds in compiled.compile_s.items():
            print(f"[compile] {name}: {seconds:.1f}s, {compiled.graphs[name]} graphs", flush=True)
    all_results = {}
    for temp in args.temperatures:
        sampling = Sampling(temperature=temp, top_p=args.top_p if temp > 0 else 1.0)
        label = (
            f"{target.name} {args.dtype} {args.device}, T={temp}, top_p={sampling.top_p}, k={args.k}, "
            f"max_new_tokens={args.max_new_tokens}, {len(prompts)} prompts, draft = target layers "
            f"first {args.draft_layers} + last {args.draft_last_layers}, {args.repeats} repeats"
            + (f", compile mode {args.compile_mode}" if compiled else "")
        )
        all_results[label] = bench(
            target, draft, prompts, warm, sampling, args.k, args.max_new_tokens, args.seed,
            repeats=args.repeats, heads=heads, trees=trees, keep=args.methods, compiled=compiled,
        )  # fmt: skip
        print(markdown({label: all_results[label]}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": vars(args),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bench_seconds": time.perf_counter() - t0,
        # What compiling cost, apart from every timing: per compiled target (its warm-up)
        # and per row (its drafter's build); `total_s` adds the warm-up calls' compiles.
        "compile": None
        if compiled is None
        else {
            "mode": compiled.mode,
            "seconds": compiled.compile_s,
            "graphs": compiled.graphs,
            "total_s": STATS.seconds,
            "total_graphs": STATS.graphs,
        },
        "results": all_results,
    }
    out.write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(markdown(all_results) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')} in {payload['bench_seconds']:.0f}s")


if __name__ == "__main__":
    main()
