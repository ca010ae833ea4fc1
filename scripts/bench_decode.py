"""Benchmark our decoder against transformers on the same target, prompts and settings.

In one process, batch 1, after a warm-up per method:
  hf_generate       transformers `generate`, plain
  ours_ar           our loop with no draft (decoding/spec.py)
  ours_spec_lm      our loop with a draft LM
  ours_spec_ngram   our loop with n-gram prompt lookup
  hf_assisted       transformers assisted generation with the same draft LM (assistant_model=)
  hf_prompt_lookup  transformers prompt lookup (prompt_lookup_num_tokens=)
Writes JSON and a markdown table (tokens/s, τ, speedup vs hf_generate and vs ours_ar,
greedy match rate vs hf_generate).

No second SmolLM-family model exists offline, so the draft LM is a truncated copy of the
target: its first --draft-layers decoder layers + the final norm + the tied head (same
tokenizer by construction). It is a weak draft; it is the same one for ours and HF's.
τ for transformers = new tokens / target forwards (its first forward also verifies).

Trained heads (checkpoint directories, train/checkpoint.py; `fresh` = untrained heads, for
smoke runs only) add chain vs tree rows (decoding/tree.py):
  ours_medusa_chain / ours_medusa_static     Medusa heads, k-chain / static tree (--paths)
  ours_eagle_chain / ours_eagle_dynamic      EAGLE heads, k-chain / EAGLE-2 dynamic tree
`--methods` keeps only the named rows (hf_generate and ours_ar are always measured).

    .venv/bin/python scripts/bench_decode.py --out runs/bench/decode.json
    .venv/bin/python scripts/bench_decode.py --methods none --medusa runs/medusa_kl/seed0/checkpoints/step_00000200 \
        --eagle runs/eagle_tv/seed0/checkpoints/step_00000200 --out runs/bench/tree.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decoding.drafter import Sampling  # noqa: E402
from decoding.drafters import DraftLMDrafter, NgramDrafter  # noqa: E402
from decoding.metrics import greedy_match  # noqa: E402
from decoding.spec import generate  # noqa: E402
from decoding.tree import TreeSpec  # noqa: E402
from train.target import Target, build_tiny_random, load_smollm2, resolve_dtype  # noqa: E402

PROMPTS = [  # code / prose / qa, with some text to copy so prompt lookup has a chance
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Rewrite this sentence in plain English: 'The quarterly results exceeded expectations "
    "owing to robust demand across all regions.'",
    "What is the capital of France, and why is it famous? Answer in three sentences.",
    "Explain what a hash map is to a beginner programmer.",
    "Summarise the plot of Romeo and Juliet in a short paragraph.",
    'def is_prime(n):\n    """Return True if n is prime."""\nComplete this function and explain it.',
]


def truncated_draft(target: Target, first: int, last: int = 0) -> LlamaForCausalLM:
    """A standalone LM from the target's first `first` and last `last` decoder layers + the
    final norm + the tied head (LayerSkip-style: the last layers map into output space)."""
    n = target.num_layers
    keep = list(range(first)) + list(range(max(first, n - last), n))  # target layer ids
    cfg = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": len(keep)})
    draft = LlamaForCausalLM(cfg).to(device=target.device, dtype=target.dtype)
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
        from models import eagle, medusa

        if kind == "medusa":
            model = medusa.from_target(target)
        else:  # full vocabulary: a reduced one needs the training data's token counts
            model = eagle.from_target(target, None, vocab_size="full")
    else:
        from train.checkpoint import load_draft

        model = load_draft(path, target)
    return model.to(device=target.device, dtype=target.dtype).eval()


def count_calls(module: torch.nn.Module) -> list[int]:
    counter = [0]
    module.register_forward_pre_hook(lambda *_: counter.__setitem__(0, counter[0] + 1))
    return counter


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_method(name, fn, prompts, device, warmup_prompt):
    fn(warmup_prompt, 0)
    rows, total_s, tokens, extra = [], 0.0, 0, []
    for i, ids in enumerate(prompts):
        sync(device)
        t0 = time.perf_counter()
        seq, info = fn(ids, i)
        sync(device)
        total_s += time.perf_counter() - t0
        tokens += len(seq)
        rows.append(seq)
        extra.append(info)
    return {
        "method": name,
        "sequences": rows,
        "seconds": total_s,
        "new_tokens": tokens,
        "tokens_per_s": tokens / total_s,
        "info": extra,
    }


def bench(
    target: Target,
    draft: LlamaForCausalLM,
    prompts,
    warm,
    sampling: Sampling,
    k: int,
    max_new: int,
    seed: int,
    heads: dict[str, torch.nn.Module] | None = None,  # "medusa" / "eagle" -> draft model
    trees: dict[str, TreeSpec] | None = None,  # "static" / "dynamic" -> tree spec
    keep: list[str] | None = None,  # methods to run besides hf_generate and ours_ar
) -> list[dict]:
    device = target.device
    model = target.model
    target_calls = count_calls(model)
    hf_kw = dict(
        max_new_tokens=max_new,
        do_sample=not sampling.greedy,
        pad_token_id=target.tokenizer.pad_token_id,
        eos_token_id=target.eos_token_ids,
    )
    if not sampling.greedy:
        hf_kw.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)

    def hf(extra):
        def fn(ids, i):
            torch.manual_seed(seed + i)
            target_calls[0] = 0
            cfg = GenerationConfig(**hf_kw, **extra.get("gen", {}))
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=cfg,
                **extra.get("call", {}),
            )
            seq = out[0, ids.shape[1] :].tolist()
            return seq, {"target_forwards": target_calls[0]}

        return fn

    def ours(drafter, tree=None):
        def fn(ids, i):
            g = torch.Generator(device=device).manual_seed(seed + i)
            r = generate(
                target,
                ids,
                drafter,
                k=k,
                sampling=sampling,
                max_new_tokens=max_new,
                generator=g,
                tree=tree,
            )
            return r.sequences[0], {
                "accepted": sum(r.accept_counts),
                "verify_rounds": sum(d > 0 for d in r.draft_lens),
                "rounds": r.rounds,
                "total_s": r.total_s,
                "prefill_s": r.prefill_s,
                "draft_s": r.draft_s,
                "verify_s": r.verify_s,
                "overhead_s": r.overhead_s,
                "tree_nodes": sum(n for n, d in zip(r.tree_sizes, r.draft_lens) if d > 0),
            }

        return fn

    assist_gen = {
        "num_assistant_tokens": k,
        "num_assistant_tokens_schedule": "constant",
        "assistant_confidence_threshold": 0.0,
    }
    methods = [
        ("hf_generate", hf({})),
        ("ours_ar", ours(None)),
        ("ours_spec_lm", ours(DraftLMDrafter(draft, target))),
        ("ours_spec_ngram", ours(NgramDrafter(max_ngram=3, vocab_size=target.vocab_size))),
        ("hf_assisted", hf({"call": {"assistant_model": draft}})),
        (
            "hf_prompt_lookup",
            hf({"gen": {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": 3}}),
        ),
    ]
    heads, trees = heads or {}, trees or {}
    if "medusa" in heads:
        methods.append(("ours_medusa_chain", ours(heads["medusa"].make_drafter(target))))
        methods.append(
            ("ours_medusa_static", ours(heads["medusa"].make_drafter(target), trees["static"]))
        )
    if "eagle" in heads:
        methods.append(("ours_eagle_chain", ours(heads["eagle"].make_drafter(target))))
        methods.append(
            ("ours_eagle_dynamic", ours(heads["eagle"].make_drafter(target), trees["dynamic"]))
        )
    if keep is not None:  # the two references and the head rows always run
        keep = {"hf_generate", "ours_ar", *keep, *(m for m, _ in methods[6:])}
        methods = [m for m in methods if m[0] in keep]
    draft.generation_config.update(**assist_gen)
    results = [run_method(name, fn, prompts, device, warm) for name, fn in methods]
    ref, ar = results[0], results[1]
    for r in results:
        r["speedup_vs_hf_generate"] = r["tokens_per_s"] / ref["tokens_per_s"]
        r["speedup_vs_ours_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
        r["greedy_match_rate"] = (
            (
                sum(greedy_match(a, b) for a, b in zip(ref["sequences"], r["sequences"]))
                / len(prompts)
            )
            if sampling.greedy
            else None
        )
        info = r.pop("info")
        if r["method"].startswith("ours"):
            rounds = sum(x["verify_rounds"] for x in info)
            r["tau"] = 1 + sum(x["accepted"] for x in info) / rounds if rounds else 1.0
            loop_s = sum(x["total_s"] - x["prefill_s"] for x in info)
            r["overhead_share"] = sum(x["overhead_s"] for x in info) / loop_s
            r["draft_share"] = sum(x["draft_s"] for x in info) / sum(x["total_s"] for x in info)
            r["ms_per_round"] = 1e3 * loop_s / sum(x["rounds"] for x in info)
            nodes = sum(x["tree_nodes"] for x in info)
            r["tree_size"] = nodes / rounds if nodes else None
        else:
            r["tau"] = r["new_tokens"] / sum(x["target_forwards"] for x in info)
        r["sequences"] = [s[:16] for s in r["sequences"]]  # keep the JSON small
    return results


def markdown(all_results: dict) -> str:
    lines = []
    for label, results in all_results.items():
        lines += [
            f"\n**{label}**\n",
            "| method | tokens/s | τ | speedup vs HF generate | speedup vs our AR "
            "| greedy match | overhead share | tree size |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in results:
            gm = "-" if r["greedy_match_rate"] is None else f"{r['greedy_match_rate']:.3f}"
            oh = f"{r['overhead_share']:.3f}" if "overhead_share" in r else "-"
            ts = f"{r['tree_size']:.1f}" if r.get("tree_size") else "-"
            lines.append(
                f"| {r['method']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                f"{r['speedup_vs_hf_generate']:.2f} | {r['speedup_vs_ours_ar']:.2f} | {gm} | {oh} "
                f"| {ts} |"
            )
    return "\n".join(lines)


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
    args = ap.parse_args()

    dtype = resolve_dtype(args.dtype)
    if args.target == "smollm2":
        target = load_smollm2(dtype="float32", device="cpu").to(device=args.device, dtype=dtype)
    else:
        target = build_tiny_random(dtype="float32", device="cpu").to(
            device=args.device, dtype=dtype
        )
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
    all_results, t0 = {}, time.perf_counter()
    for temp in args.temperatures:
        sampling = Sampling(temperature=temp, top_p=args.top_p if temp > 0 else 1.0)
        label = (
            f"{target.name} {args.dtype} {args.device}, T={temp}, top_p={sampling.top_p}, k={args.k}, "
            f"max_new_tokens={args.max_new_tokens}, {len(prompts)} prompts, draft = target layers "
            f"first {args.draft_layers} + last {args.draft_last_layers}"
        )
        all_results[label] = bench(
            target, draft, prompts, warm, sampling, args.k, args.max_new_tokens, args.seed,
            heads=heads, trees=trees, keep=args.methods,
        )  # fmt: skip
        print(markdown({label: all_results[label]}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "args": vars(args),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "bench_seconds": time.perf_counter() - t0,
        "results": all_results,
    }
    out.write_text(json.dumps(payload, indent=1))
    out.with_suffix(".md").write_text(markdown(all_results) + "\n")
    print(f"wrote {out} and {out.with_suffix('.md')} in {payload['bench_seconds']:.0f}s")


if __name__ == "__main__":
    main()
