"""scripts/bench_decode.py without timing claims: one τ definition for every row (ours and
transformers'), the drafted-forwards-only figure beside it, methods interleaved per prompt
with the order rotated per repeat, and speedups paired within a repeat. Tiny random target."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from decoding.bench import (
    PROMPTS,
    build_compiled,
    hf_rounds,
    markdown,
    ours_method,
    summarize,
    tau_figures,
    truncated_draft,
)
from decoding.drafter import Sampling
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.tree import TreeSpec
from models.target_loaders import build_tiny_random
from tests.helpers import chat_ids

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode.py"
spec = importlib.util.spec_from_file_location("bench_decode", SCRIPT)
bd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bd)


class NoMatch(NgramDrafter):
    """Prompt lookup that never finds a match: every round is a plain 1-token forward."""

    def _lookup(self, tokens, k):
        return []


def prompts_of(target, texts):
    return [torch.tensor([chat_ids(target, t)]) for t in texts]


def untied_target():
    """build_tiny_random's greedy output repeats one token (tied, large embeddings), so prompt
    lookup would match every round; a random untied head gives varied text and misses."""
    target = build_tiny_random(seed=0, device="cpu")
    g = torch.Generator().manual_seed(3)
    target.model.config.tie_word_embeddings = False
    target.model.lm_head.weight = torch.nn.Parameter(torch.randn(128, 64, generator=g) * 0.5)
    with torch.no_grad():
        target.model.get_input_embeddings().weight.div_(8.0)
    return target


def test_tau_figures_counts_every_forward():
    fig = tau_figures([2, 0, 0, 3], [4, 0, 0, 4])
    assert fig["tau"] == pytest.approx(1 + 5 / 4)  # every verify forward
    assert fig["tau_drafted"] == pytest.approx(1 + 5 / 2)  # forwards that had drafts only
    assert (fig["verify_forwards"], fig["drafted_forwards"]) == (4, 2)
    assert tau_figures([0, 0, 0], [0, 0, 0])["tau"] == 1.0
    assert tau_figures([0, 0, 0], [0, 0, 0])["tau_drafted"] is None
    assert tau_figures([], [])["tau"] is None


def test_hf_rounds_from_recorded_forwards():
    # (input length, first position) recorded from transformers 5 prompt lookup, 16-token
    # prompt, 20 new tokens: the prefill also carried 4 candidates (all rejected).
    forwards = [(20, 0), (5, 16), (2, 17), (3, 19), (5, 22), (5, 27), (5, 32)]
    accepts, drafts, prefill_tokens = hf_rounds(forwards, 16, 20)
    assert prefill_tokens == 1
    assert drafts == [4, 1, 2, 4, 4, 4]
    assert accepts == [0, 1, 2, 4, 4, 2]  # the last forward: what is left of the 20 tokens
    assert prefill_tokens + len(accepts) + sum(accepts) == 20
    # plain generate: one token per forward
    plain = [(16, 0)] + [(1, 16 + i) for i in range(19)]
    assert hf_rounds(plain, 16, 20) == ([0] * 19, [0] * 19, 1)
    with pytest.raises(RuntimeError, match="prefill"):
        hf_rounds([(5, 16)], 16, 20)


def test_ours_tau_is_tokens_per_target_forward():
    """τ = (emitted tokens after the prefill) / (target forwards after the prefill), counted by
    a hook on the target's decoder, with rounds that drafted nothing counted too."""
    target = untied_target()
    ids = prompts_of(target, ["abcd abcd abcd xyz"])[0]
    calls = []
    target.model.model.register_forward_pre_hook(lambda *_: calls.append(1))
    ngram = ours_method(target, NgramDrafter(vocab_size=128), 3, Sampling(), 24, 0)
    record = ngram(ids, 0)
    fig = tau_figures(record["accept_counts"], record["draft_lens"])
    assert 0 < fig["drafted_forwards"] < fig["verify_forwards"]  # both kinds of rounds
    assert fig["verify_forwards"] == len(calls) - 1
    assert fig["tau"] == pytest.approx((len(record["sequence"]) - 1) / (len(calls) - 1))
    assert fig["tau_drafted"] > fig["tau"]

    calls.clear()
    never = ours_method(target, NoMatch(vocab_size=128), 3, Sampling(), 24, 0)(ids, 0)
    fig = tau_figures(never["accept_counts"], never["draft_lens"])
    assert fig["tau"] == 1.0 and fig["tau_drafted"] is None
    assert fig["verify_forwards"] == len(calls) - 1 == len(never["sequence"]) - 1


def test_ours_counts_only_tokens_emitted_before_eos():
    """Our loop records the accepted drafts of the round that hit EOS before the output is cut
    there; τ must count the emitted tokens only, as it does for transformers' rows."""
    target = untied_target()
    ids = prompts_of(target, ["hello"])[0]
    perfect = DraftLMDrafter(copy.deepcopy(target.model), target)  # accepts all k = 3
    method = ours_method(target, perfect, 3, Sampling(), 12, 0)
    target.model.generation_config.eos_token_id = []
    free = method(ids, 0)["sequence"]
    assert free[2] not in free[:2]
    target.model.generation_config.eos_token_id = [free[2]]  # 2nd token of round 1's drafts
    record = method(ids, 0)
    assert record["sequence"] == free[:3]
    fig = tau_figures(record["accept_counts"], record["draft_lens"])
    assert record["accept_counts"] == [1] and fig["tau"] == 2.0


def test_bench_rows_share_one_tau_definition():
    target = build_tiny_random(seed=0, device="cpu")
    draft = truncated_draft(target, 1, 0)
    prompts = prompts_of(target, PROMPTS[:2])
    rows = bd.bench(target, draft, prompts, prompts[0], Sampling(), 3, 12, 0, repeats=2)
    json.dumps(rows)  # the JSON payload
    by = {r["method"]: r for r in rows}
    assert set(by) == {"hf_generate", "ours_ar", "ours_spec_lm", "ours_spec_ngram",
                       "hf_assisted", "hf_prompt_lookup"}  # fmt: skip
    for name in ("hf_generate", "ours_ar"):
        assert by[name]["tau"] == 1.0 and by[name]["tau_drafted"] is None
    calls = 2 * len(prompts)  # repeats x prompts
    assert by["hf_generate"]["verify_forwards"] == by["hf_generate"]["new_tokens"] - calls
    for r in rows:  # tokens = prefill tokens + τ x forwards after the prefill, every row
        assert r["prefill_tokens"] + r["tau"] * r["verify_forwards"] == pytest.approx(
            r["new_tokens"]
        ), r["method"]
        assert len(r["tokens_per_s"]["per_repeat"]) == 2
        assert r["tokens_per_s"]["min"] <= r["tokens_per_s"]["median"] <= r["tokens_per_s"]["max"]
        assert r["greedy_match_rate"] == 1.0  # fp32: every method reproduces generate
    assert by["ours_ar"]["speedup_vs_ours_ar"]["per_repeat"] == [1.0, 1.0]
    assert by["ours_spec_lm"]["tau"] > 1.0 and by["hf_assisted"]["tau"] > 1.0
    assert by["hf_assisted"]["prefill_tokens"] > calls  # its prefill forward verified drafts
    assert "| τ (every forward) | τ drafted forwards only" in markdown({"tiny": rows})


def test_compiled_rows_beside_eager_ones():
    """--compile: every row of our loop gets a compiled twin (AR, draft LM, n-gram, EAGLE
    chain and dynamic tree), decoding the same tokens in fp32, with its speedups against both
    AR baselines, compile seconds apart, no graph compiled in a timed call, and the markdown's
    eager-vs-compiled table. aot_eager: traced and guarded as for inductor, no code generated."""
    target = untied_target()
    draft = truncated_draft(target, 1, 0)
    prompts = prompts_of(target, PROMPTS[:2])
    heads = {"eagle": bd.load_heads("eagle", "fresh", target)}
    trees = {"dynamic": TreeSpec(kind="dynamic", depth=2, top_k=2, num_nodes=4)}
    max_len = max(p.shape[1] for p in prompts) + 12
    compiled = build_compiled(target, draft, heads, trees, 3, max_len, "aot_eager")
    assert compiled.graphs["target chain widths (1, 4)"] == 2  # one graph per width
    rows = bd.bench(target, draft, prompts, prompts[0], Sampling(), 3, 12, 0, repeats=2,
                    heads=heads, trees=trees, compiled=compiled)  # fmt: skip
    json.dumps(rows)
    by = {r["method"]: r for r in rows}
    twins = ["ours_ar", "ours_spec_lm", "ours_spec_ngram", "ours_eagle_chain", "ours_eagle_dynamic"]
    assert {f"{name}_compiled" for name in twins} <= set(by)
    for name in twins:
        eager, comp = by[name], by[f"{name}_compiled"]
        assert comp["sequences"] == eager["sequences"], name  # fp32: the same tokens
        assert (comp["tau"], comp["verify_forwards"]) == (eager["tau"], eager["verify_forwards"])
        assert comp["greedy_match_rate"] == 1.0
        assert comp["graphs_timed"] == 0 and comp["compile_s"] >= 0.0, name
        paired = zip(comp["tokens_per_s"]["per_repeat"], eager["tokens_per_s"]["per_repeat"])
        assert comp["speedup_vs_eager"]["per_repeat"] == pytest.approx([a / b for a, b in paired])
        assert "speedup_vs_ours_ar_compiled" in eager and "speedup_vs_ours_ar" in comp
    assert by["ours_ar_compiled"]["speedup_vs_ours_ar_compiled"]["per_repeat"] == [1.0, 1.0]
    table = markdown({"tiny": rows})
    assert "| speedup eager (vs our AR) | speedup compiled (vs our compiled AR) |" in table
    side = table.split("| speedup eager (vs our AR)")[1]  # one line per eager row with a twin
    assert "_compiled" not in side and side.count("\n| ours_") == len(twins)
    assert "speedup compiled" not in markdown({"tiny": [r for r in rows if r is by["ours_ar"]]})


def test_methods_interleaved_and_rotated():
    log = []

    def method(name):
        def fn(ids, i):
            log.append((name, int(ids[0, 0])))
            return {"sequence": [0]}

        return fn

    prompts = [torch.tensor([[1]]), torch.tensor([[2]])]
    runs = bd.run_interleaved({m: method(m) for m in "abc"}, prompts, torch.tensor([[9]]), 3)
    warm, timed = log[:3], log[3:]
    assert warm == [("a", 9), ("b", 9), ("c", 9)]  # every method warmed before any timing
    order = [m for m, _ in timed]
    assert order == list("abcabcbcabcacabcab")  # per prompt, rotated per repeat
    assert [p for _, p in timed] == [1, 1, 1, 2, 2, 2] * 3
    assert all(len(runs[m]) == 3 and all("seconds" in c for c in runs[m][0]) for m in "abc")


def test_speedup_is_paired_within_a_repeat():
    def runs_of(seconds):
        return [[{"sequence": [0] * 10, "seconds": s, "accept_counts": [0], "draft_lens": [0],
                  "prefill_tokens": 1}] for s in seconds]  # fmt: skip

    rows = summarize({"ours_ar": runs_of([1, 2, 4]), "x": runs_of([0.5, 4, 1])}, greedy=False)
    x = rows[1]
    assert x["speedup_vs_ours_ar"]["per_repeat"] == [2.0, 0.5, 4.0]
    assert (x["speedup_vs_ours_ar"]["median"], x["speedup_vs_ours_ar"]["min"]) == (2.0, 0.5)
    assert x["speedup_vs_ours_ar"]["max"] == 4.0
    assert x["tokens_per_s"]["median"] == 10.0 and x["tokens_per_s"]["min"] == 2.5
    assert "speedup_vs_hf_generate" not in x and x["greedy_match_rate"] is None
