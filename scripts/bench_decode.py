"""Benchmark our decoder against transformers (the pieces: decoding/bench.py).

Same target, prompts and settings for every row.

Rows (batch 1, one process):
  hf_generate       transformers `generate`, plain
  ours_ar           our loop with no draft (decoding/spec.py)
  ours_spec_lm      our loop with a draft LM
  ours_spec_ngram   our loop with n-gram prompt lookup
  hf_assisted       transformers assisted generation with the same draft LM (assistant_model=)
  hf_prompt_lookup  transformers prompt lookup (prompt_lookup_num_tokens=)
Trained heads (checkpoint directories, train/core/checkpoint.py; `fresh` = untrained heads, for
smoke runs only) add chain vs tree rows (decoding/tree.py):
  ours_medusa_chain / ours_medusa_static     Medusa heads, k-chain / static tree (--paths)
  ours_eagle_chain / ours_eagle_dynamic      EAGLE heads, k-chain / EAGLE-2 dynamic tree
Every row runs in each `--dtype` (default float32 and bfloat16: which one is faster depends
on the CPU and the shape, docs/portable.md); a dtype's rows are interleaved among
themselves, and the JSON's `machine` says which CPU they hold for (model, ATen's CPU
capability, oneDNN ISA cap, torch, threads). Compare dtypes side by side with
scripts/bench_dtypes.py, which interleaves them.
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
    # smoke run, tiny random target:
    .venv/bin/python scripts/bench_decode.py --target tiny --draft-layers 1 --draft-last-layers 0 \
        --num-prompts 2 --max-new-tokens 16 --repeats 2 --temperatures 0 --out /tmp/bench_tiny.json
    # the same with compiled rows, no code generation (tracing only):
    ... --compile --compile-mode aot_eager --eagle fresh
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from decoding.bench import (
    PROMPTS,
    CompiledRows,
    Method,
    build_compiled,
    hf_method,
    markdown,
    ours_method,
    record_forwards,
    summarize,
    truncated_draft,
)
from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.inductor import MODES, STATS
from decoding.rounds import sync
from decoding.tree import TreeSpec
from models import eagle, medusa
from models.dtype_choice import machine_key
from models.dtypes import cast_keep_rotary, resolve_dtype
from models.target import Target
from models.target_loaders import build_tiny_random, load_smollm2
from train.core.checkpoint import load_draft


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


def bench_dtype(args: argparse.Namespace, dtype: str) -> tuple[dict, CompiledRows | None]:
    """Every row with the target (and its drafts) in `dtype`: label -> rows, and the
    compiled pieces (None without --compile)."""
    load = load_smollm2 if args.target == "smollm2" else build_tiny_random
    target = load(dtype="float32", device="cpu")
    target = target.to(device=args.device, dtype=resolve_dtype(dtype))
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
            f"{target.name} {dtype} {args.device}, T={temp}, top_p={sampling.top_p}, k={args.k}, "
            f"max_new_tokens={args.max_new_tokens}, {len(prompts)} prompts, draft = target layers "
            f"first {args.draft_layers} + last {args.draft_last_layers}, {args.repeats} repeats"
            + (f", compile mode {args.compile_mode}" if compiled else "")
        )
        all_results[label] = bench(
            target, draft, prompts, warm, sampling, args.k, args.max_new_tokens, args.seed,
            repeats=args.repeats, heads=heads, trees=trees, keep=args.methods, compiled=compiled,
        )  # fmt: skip
        print(markdown({label: all_results[label]}), flush=True)
    return all_results, compiled


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--dtype", nargs="+", default=["float32", "bfloat16"],
        help="the target's dtype(s); every row is run in each (which is faster differs per "
        "CPU and shape: docs/portable.md)",
    )  # fmt: skip
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

    print(f"machine: {json.dumps(machine_key())}", flush=True)  # what the figures hold for
    all_results, compiles, t0 = {}, {}, time.perf_counter()
    for dtype in args.dtype:  # each dtype's rows interleaved among themselves
        results, compiled = bench_dtype(args, dtype)
        all_results |= results
        if compiled is not None:
            compiles[dtype] = {"mode": compiled.mode, "seconds": compiled.compile_s,
                               "graphs": compiled.graphs}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": vars(args),
        "machine": machine_key(),  # CPU model, ATen capability, oneDNN ISA cap, torch, threads
        "bench_seconds": time.perf_counter() - t0,
        # What compiling cost, apart from every timing: per compiled target (its warm-up)
        # and per row (its drafter's build); `total_s` adds the warm-up calls' compiles.
        "compile": None
        if not compiles
        else {"per_dtype": compiles, "total_s": STATS.seconds, "total_graphs": STATS.graphs},
        "results": all_results,
    }
    out.write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(markdown(all_results) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')} in {payload['bench_seconds']:.0f}s")


if __name__ == "__main__":
    main()
