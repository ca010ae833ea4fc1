"""The compiled decoding path (decoding/compiled.py, models/static_cache.py) on the tiny random
target, in float32 so that compiled and eager decoding must agree token for token.

Backends: `test_compiled_equals_eager_with_inductor` compiles with inductor (torch.compile's
default mode, with the CPU default of frozen target weights; the slowest test here) to check
the generated code. The other tests use `aot_eager`: dynamo traces, guards and decides
recompiles exactly as for inductor, but no code is generated, so they stay quick.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import decoding.metrics
from decoding.compiled import CachedStep, CompiledTarget
from decoding.drafters import make_drafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.inductor import STATS, Compiled, counts_recordings
from decoding.spec import generate
from decoding.tree import TreeSpec, compact_cache, tree_attention_mask
from decoding.verify import node_depths
from models import dflash, draft_lm, eagle, medusa, mtp
from models.static_cache import StaticKVCache
from models.target import Target
from tests.helpers import (
    N_SINGLE,
    NO_EOS,
    P_THRESHOLD,
    V,
    exact_triples,
    g_test,
    left_pad,
    noisy_copy,
    prompt_ids,
    untied_target,
)
from train.eval.evaluate import evaluate_checkpoint, format_eval_table
from train.run.settings import check_decode, eval_settings


@pytest.fixture(scope="module")
def target() -> Target:
    return untied_target(device="cpu")


def prompts(n: int = 3, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (1, 6 + 3 * i), generator=g) for i in range(n)]


def record(result) -> tuple:
    return result.sequences, result.accept_counts, result.draft_lens


def test_static_rollback_equals_dynamic_crop(target):
    """Random rounds over both caches, eager: chain rounds of 0..5 drafts cropped to a random
    accept count (DynamicCache.crop vs StaticKVCache.crop), and tree rounds compacted to a
    random root path (compact_cache on either). Every forward's logits and hidden layer must
    agree, i.e. the static cache's rollback leaves exactly the sequence the dynamic one has."""
    static = CompiledTarget(target, max_len=160, widths=(1, 6, 9), hidden_layers=(1,), mode=None)
    ids = prompts(1)[0]
    ref, out = target(ids), static(ids)
    torch.testing.assert_close(out.logits, ref.logits)
    dyn, sta = ref.cache, out.cache
    g = torch.Generator().manual_seed(1)
    pos = ids.shape[1]
    for rnd in range(24):
        past = dyn.get_seq_length()
        assert sta.get_seq_length() == past
        if rnd % 3 == 2:  # a tree of 8 nodes below the root, one root path kept
            N = 8
            parents = torch.tensor(
                [[int(torch.randint(-1, i, (1,), generator=g)) for i in range(N)]]
            )
            mask = tree_attention_mask(parents, past, None, target.dtype)
            depth = node_depths(parents)
            positions = pos + torch.cat([depth.new_zeros(1, 1), depth], 1)
            kw = dict(attention_mask=mask, position_ids=positions, hidden_layers=(1,))
        else:  # a chain of k drafts
            N = int(torch.randint(0, 6, (1,), generator=g))
            kw = dict(position_ids=pos + torch.arange(N + 1)[None], hidden_layers=(1,))
        step = torch.randint(3, V, (1, N + 1), generator=g)
        a, b = target(step, cache=dyn, **kw), static(step, cache=sta, **kw)
        torch.testing.assert_close(b.logits, a.logits)
        torch.testing.assert_close(b.hidden[1], a.hidden[1])
        if rnd % 3 == 2:
            node = int(torch.randint(0, N, (1,), generator=g))
            path = [node]
            while parents[0, path[-1]] >= 0:
                path.append(int(parents[0, path[-1]]))
            keep = torch.tensor([[0] + [p + 1 for p in reversed(path)]])  # root + path
            compact_cache(dyn, past, keep)
            compact_cache(sta, past, keep)
            pos += keep.shape[1]
        else:
            n = int(torch.randint(0, N + 1, (1,), generator=g))  # accepted drafts
            dyn.crop(-(N - n))
            sta.crop(-(N - n))
            pos += n + 1


def test_compiled_equals_eager_with_inductor(target):
    """Inductor-generated graphs (default mode, frozen weights) give the eager target's logits
    at both widths, and the same greedy tokens and accept counts, AR and with a drafter."""
    compiled = CompiledTarget(target, max_len=160, widths=(1, 5), mode="default")
    compiled.warmup()
    ids = prompts(1)[0]
    ref, out = target(ids), compiled(ids)
    for T in (1, 3, 5):  # 3 runs padded to width 5
        step = torch.randint(3, V, (1, T))
        positions = ref.cache.get_seq_length() + torch.arange(T)[None]
        a = target(step, cache=ref.cache, position_ids=positions)
        b = compiled(step, cache=out.cache, position_ids=positions)
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=1e-4)
    for ids in prompts(2, seed=3):
        eager = generate(target, ids, None, max_new_tokens=24)
        assert record(generate(compiled, ids, None, max_new_tokens=24)) == record(eager)
        draft = NgramDrafter(vocab_size=V)
        eager = generate(target, ids, draft, k=4, max_new_tokens=24)
        assert record(generate(compiled, ids, draft, k=4, max_new_tokens=24)) == record(eager)


def test_compile_seconds_are_kept_per_graph(target):
    """STATS.by_graph: each width's graph under its own label (the Compiled's name, the
    input shape and, unless the name says it, the dtype: one function compiled in two dtypes
    keeps two labels), summing to what STATS.seconds grew by; a call that compiles nothing
    adds nothing."""
    seconds, by_graph = STATS.seconds, dict(STATS.by_graph)
    compiled = CompiledTarget(target, max_len=64, widths=(1, 3), mode="aot_eager")
    compiled.warmup()
    name = f"{target.num_layers}-layer target float32"
    grown = STATS.graphs_since(by_graph)
    assert set(grown) == {f"{name} [1, 1]", f"{name} [1, 3]"}, grown
    assert sum(grown.values()) == pytest.approx(STATS.seconds - seconds)
    before = dict(STATS.by_graph)
    generate(compiled, prompts(1)[0], None, max_new_tokens=4)  # the width-1 graph, compiled
    assert STATS.by_graph == before
    step = Compiled(lambda x: x * 2, "aot_eager")
    before = dict(STATS.by_graph)
    for dtype in (torch.float32, torch.bfloat16):
        step(torch.ones(2, 5, dtype=dtype))
    lambda_ = "test_compile_seconds_are_kept_per_graph.<locals>.<lambda> [2, 5]"
    assert set(STATS.graphs_since(before)) == {f"{lambda_} float32", f"{lambda_} bfloat16"}


def test_no_recompile_across_rounds_of_varying_accept_counts(target):
    """After the warm-up prompt, 20+ rounds with different accept counts, drafts cut short by
    the token budget, n-gram proposals of any length and AR steps compile no new graph:
    every forward is padded to a width that already has one."""
    compiled = CompiledTarget(target, max_len=200, widths=(1, 5), mode="aot_eager")
    lm = DraftLMDrafter(noisy_copy(target.model, 0.5), compiled)
    ngram = NgramDrafter(vocab_size=V)
    warm = prompts(1, seed=5)[0]
    generate(compiled, warm, None, max_new_tokens=8)
    generate(compiled, warm, lm, k=4, max_new_tokens=24)
    generate(compiled, warm, ngram, k=4, max_new_tokens=24)
    graphs = STATS.graphs
    assert graphs > 0
    accepts, budgets = [], []
    for ids in prompts(4, seed=6):
        for drafter in (lm, ngram):
            r = generate(compiled, ids, drafter, k=4, max_new_tokens=23)
            accepts += r.accept_counts
            budgets += r.draft_lens
        generate(compiled, ids, None, max_new_tokens=6)
    assert len(accepts) >= 20 and len(set(accepts)) >= 3, accepts
    assert len(set(budgets)) >= 3, budgets  # 4 drafts, fewer at the budget / n-gram misses
    assert STATS.graphs == graphs, f"{STATS.graphs - graphs} graphs compiled after warm-up"


def draft_for(kind: str, target: Target) -> tuple[torch.nn.Module, TreeSpec | None]:
    torch.manual_seed(0)
    if kind == "draft_lm":
        return draft_lm.from_target(target, num_layers=1), None
    if kind.startswith("eagle"):
        tree = TreeSpec(kind="dynamic", depth=3, top_k=3, num_nodes=8) if "tree" in kind else None
        return eagle.from_target(target, None, vocab_size="full", ttt_steps=2), tree
    if kind.startswith("medusa"):
        heads = medusa.from_target(target, num_heads=3, head_init="copy")
        return heads, TreeSpec(
            paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
        ) if "tree" in kind else None
    if kind == "dflash":
        return dflash.from_target(target, block_size=4, layers=[1, 2]), None
    return mtp.from_target(target, num_depths=2), None


def test_cpp_gemm_compiles_a_target_and_a_drafter_that_equal_eager(target):
    """The CPU's mode, cpp-gemm: the target's frozen weights through the C++ GEMM template,
    the EAGLE drafter's unfrozen ones (no template candidate: they compile as `default`); the
    decode is the eager one, token for token and round for round."""
    draft, tree = draft_for("eagle", target)
    hidden_layers = make_drafter(draft, target).hidden_layers
    compiled = CompiledTarget(target, 64, (1, 4), hidden_layers, "cpp-gemm")
    compiled.warmup()
    eager_drafter, compiled_drafter = make_drafter(draft, target), make_drafter(draft, compiled)
    ids = prompts(1, seed=9)[0]
    kw = dict(k=3, max_new_tokens=12, eos_token_ids=[])
    eager = generate(target, ids, eager_drafter, **kw)
    assert record(generate(compiled, ids, compiled_drafter, **kw)) == record(eager)


@pytest.mark.parametrize(
    "kind", ["draft_lm", "eagle", "eagle_tree", "medusa", "medusa_tree", "mtp", "dflash"]
)
def test_drafters_compiled_equal_eager(target, kind):
    """Every drafter built on a CompiledTarget (its own static cache, padded compiled steps;
    DFlash runs eagerly beside the compiled target) drafts what it drafts eagerly: same
    tokens, accept counts and draft lengths, for a batch of one and a left-padded batch of
    two. After the first (warm-up) prompt no graph is compiled, the drafter's included."""
    draft, tree = draft_for(kind, target)
    k = 3
    ids_list = prompts(3, seed=9)  # 6, 9 and 12 tokens
    for batch in (1, 2):
        if batch == 1:
            cases = [(ids, None) for ids in ids_list]
        else:  # left-padded rows: (6, 9) tokens, then (9, 12)
            cases = [left_pad(ids_list[:2], 0, "cpu"), left_pad(ids_list[1:], 0, "cpu")]
        widths = (1, tree.size + 1) if tree is not None else (1, k + 1)
        compiled = CompiledTarget(
            target, 96, widths, make_drafter(draft, target).hidden_layers, "aot_eager",
            batch_size=batch,
        )  # fmt: skip
        compiled.warmup()
        eager_drafter, compiled_drafter = make_drafter(draft, target), make_drafter(draft, compiled)
        for i, (ids, mask) in enumerate(cases):
            if i == 1:  # the first case was the warm-up
                graphs = STATS.graphs
            kw = dict(k=k, max_new_tokens=20, attention_mask=mask, tree=tree, eos_token_ids=[])
            eager = generate(target, ids, eager_drafter, **kw)
            assert record(generate(compiled, ids, compiled_drafter, **kw)) == record(eager)
        assert STATS.graphs == graphs, f"{STATS.graphs - graphs} graphs compiled after warm-up"


@pytest.mark.parametrize(
    "kind, adaptive",
    [("eagle_tree", False), ("perfect", True), ("mtp", False), ("medusa_tree", False)],
)
def test_the_warmups_compile_every_shape_decoding_uses(target, kind, adaptive):
    """Built as evaluation builds them (train/eval/plan.py: compiled_decoding), the compiled
    target and drafter compile every shape before the first decode, none inside it: the
    EAGLE-2 tree levels (top_k wide), adaptive k's widths and a left-padded batch (its
    per-row masks and positions) included. With CUDA graphs, each of those shapes would
    otherwise also be recorded inside the timed decoding. ("perfect": a draft LM that is the
    target, so that adaptive k grows to 2k.)"""
    if kind == "perfect":
        draft, tree = draft_lm.from_target(target, num_layers=2, init="target"), None
    else:
        draft, tree = draft_for(kind, target)
    k = 3
    widths = (1, tree.size + 1) if tree is not None else (1, k + 1, 2 * k + 1)
    levels = (tree.top_k,) if tree is not None and tree.kind == "dynamic" else ()
    compiled = CompiledTarget(
        target, 96, widths, make_drafter(draft, target).hidden_layers, "aot_eager",
        batch_size=2, draft_widths=levels,
    )  # fmt: skip
    compiled.warmup()
    drafter = make_drafter(draft, compiled)
    graphs = STATS.graphs
    ids, mask = left_pad(prompts(2, seed=9), 0, "cpu")
    r = generate(compiled, ids, drafter, k=k, max_new_tokens=24, attention_mask=mask, tree=tree,
                 adaptive_k=adaptive, eos_token_ids=[])  # fmt: skip
    assert not adaptive or max(r.draft_lens) > k  # adaptive k went past k
    assert STATS.graphs == graphs, f"{STATS.graphs - graphs} graphs compiled while decoding"


def test_warmups_call_every_width_twice_with_cuda_graphs(target):
    """CUDA graphs record on a graph's second call, so with them every warm-up calls each
    width twice (the target's and a drafter step's); without them once."""
    for cudagraphs, calls in ((False, 1), (True, 2)):
        compiled = CompiledTarget(target, 64, (1, 4), mode="aot_eager")
        compiled.step.cudagraphs = cudagraphs  # as reduce-overhead sets it
        seen, fn = [], compiled.step.fn
        compiled.step.fn = lambda *a, fn=fn, seen=seen: seen.append(a[0].shape[1]) or fn(*a)
        compiled.warmup()
        assert sorted(seen) == [1] * calls + [4] * calls
        step = CachedStep(lambda x: x * 2, StaticKVCache(1, 1, 16, "cpu"), (1, 3), "aot_eager")
        step.compiled.cudagraphs = cudagraphs
        seen, fn = [], step.compiled.fn
        step.compiled.fn = lambda *a, fn=fn, seen=seen: seen.append(a[0].shape[1]) or fn(*a)
        step.warmup(lambda w: (torch.zeros(1, w),))
        assert sorted(seen) == [1] * calls + [3] * calls


def test_cuda_graph_recordings_are_counted():
    """STATS counts CUDA-graph recordings (torch announces each to dynamo's callbacks) beside
    the compiled graphs; other compile events do not count as recordings."""
    if not counts_recordings():
        pytest.skip(f"torch {torch.__version__} announces no CUDA-graph recordings (2.8+ does)")
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    Compiled(lambda x: x + 1, "aot_eager")  # the first Compiled registers the counter
    recorded = STATS.cudagraphs
    with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0"):
        pass
    assert STATS.cudagraphs == recorded + 1
    with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0"):
        pass
    assert STATS.cudagraphs == recorded + 1


def eval_cfg(**decode) -> OmegaConf:
    """conf/decode/chain.yaml with small compiled-evaluation settings; `decode` overrides any."""
    dec = OmegaConf.load("conf/decode/chain.yaml")
    small = dict(k=3, temperatures=[0.0], max_new_tokens=12, num_prompts=2, warmup=1,
                 dtype="float32", compile=True, compile_mode="aot_eager")  # fmt: skip
    dec.merge_with(small | decode)
    return OmegaConf.create({"seed": 0, "decode": dec})


def test_evaluate_checkpoint_keeps_the_graphs_between_checkpoints(target, monkeypatch):
    """decode.compile=true decodes the compiled path as the evaluation and the eager
    speculative decode beside it (`tau_eager_spec`). The second checkpoint compiles nothing
    (the kept draft copy takes the new weights in place) and still decodes with the NEW
    weights: a perfect draft after a random one gives the eager τ. Only the compiled spec
    decode is probed for the target's entropy."""
    probes = {"eager": [], "compiled": []}  # what evaluate handed generate, per path
    real_generate = decoding.metrics.generate

    def recording_generate(decode_target, prompt, drafter, *args, probe=None, **kwargs):
        path = "compiled" if isinstance(decode_target, CompiledTarget) else "eager"
        if drafter is not None:
            probes[path].append(probe)
        return real_generate(decode_target, prompt, drafter, *args, probe=probe, **kwargs)

    monkeypatch.setattr(decoding.metrics, "generate", recording_generate)
    settings = eval_settings(eval_cfg())
    eval_prompts = [{"input_ids": p[0].tolist()} for p in prompts(2, seed=11)]
    random_draft = draft_lm.from_target(target, num_layers=2, init="random")
    perfect = draft_lm.from_target(target, num_layers=2, init="target")  # the target itself
    first, copies = evaluate_checkpoint(target, random_draft, eval_prompts, settings, None)
    assert first["compiled_graphs"] > 0 and first["decode_path"] == "compiled"
    assert first["greedy/tau_eager_spec"] == first["greedy/tau"]
    second, _ = evaluate_checkpoint(target, perfect, eval_prompts, settings, None, copies)
    assert second["compiled_graphs"] == 0 and second["compile_s"] == 0.0
    assert second["greedy/tau_eager_spec"] == second["greedy/tau"] > first["greedy/tau"] + 1
    table = format_eval_table([first, second])
    assert "| speedup vs the fastest AR |" in table and "| loop efficiency |" in table
    row = f"| {second['greedy/speedup_best_ar']:.2f}x ({second['greedy/best_ar']}) |"
    assert row in table.splitlines()[-1]
    assert probes["eager"] and all(p is None for p in probes["eager"])
    # the evaluation's spec decode: probed but in its warm-up prompt, at both checkpoints
    assert [p is None for p in probes["compiled"]] == [True, False, False] * 2


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(compile_mode="fastest"), "decode.compile_mode"),
        (dict(warmup=0), "decode.warmup >= 1"),
        (dict(compile="yes"), "decode.compile must be true, false, only or auto"),
    ],
)
def test_bad_compile_settings_raise(change, words):
    check_decode(eval_cfg().decode)  # the good settings pass
    with pytest.raises(ValueError, match=words):
        check_decode(eval_cfg(**change).decode)


def test_a_forward_wider_than_the_widths_raises(target):
    compiled = CompiledTarget(target, max_len=64, widths=(1, 3), mode=None)
    out = compiled(prompts(1)[0])
    with pytest.raises(ValueError, match="wider than the compiled widths"):
        compiled(torch.ones(1, 4, dtype=torch.long), cache=out.cache)
    with pytest.raises(ValueError, match="static KV cache holds 64 positions"):
        compiled(torch.ones(1, 70, dtype=torch.long))


@pytest.mark.gpu
def test_cuda_graphs_equal_eager():
    """CUDA (scripts/gpu_check.sh): the `auto` mode there, reduce-overhead (inductor + CUDA
    graphs replayed over the static cache), decodes what the eager loop decodes, AR and with
    an EAGLE drafter, chain and dynamic tree, in fp32; once the compiled target and the
    drafter are built (their warm-ups), no graph is compiled and no CUDA graph recorded."""
    target = untied_target(device="cuda")
    eagle_draft, tree = draft_for("eagle_tree", target)
    eagle_draft = eagle_draft.to("cuda")
    k = 3
    for spec in (None, tree):
        widths = (1, k + 1) if spec is None else (1, spec.size + 1)
        levels = (spec.top_k,) if spec is not None else ()
        compiled = CompiledTarget(target, 96, widths, eagle_draft.hidden_layers, "auto",
                                  draft_widths=levels)  # fmt: skip
        assert compiled.mode == "reduce-overhead"
        compiled.warmup()
        drafters = {"eager": make_drafter(eagle_draft, target)}
        drafters["compiled"] = make_drafter(eagle_draft, compiled)
        graphs, recorded = STATS.graphs, STATS.cudagraphs
        assert recorded > 0  # the warm-ups recorded every width
        for ids in prompts(3, seed=12):
            ids = ids.to("cuda")
            kw = dict(k=k, max_new_tokens=20, eos_token_ids=[])
            eager = generate(target, ids, None, **kw)
            assert record(generate(compiled, ids, None, **kw)) == record(eager)
            eager = generate(target, ids, drafters["eager"], tree=spec, **kw)
            compiled_run = generate(compiled, ids, drafters["compiled"], tree=spec, **kw)
            assert record(compiled_run) == record(eager)
        assert STATS.graphs == graphs, f"{STATS.graphs - graphs} graphs compiled after warm-up"
        assert STATS.cudagraphs == recorded, f"{STATS.cudagraphs - recorded} CUDA graphs recorded"


def test_compiled_sampling_follows_the_target_distribution():
    """Losslessness on the compiled path: speculative sampling through a CompiledTarget (static
    cache, compiled widths 1 and k+1) with a draft that disagrees often draws (t1, t2, t3) from
    the eager target's exact distribution (G-test as tests/test_spec.py, same bins), and the
    test has power: the draft's own samples are rejected."""
    from decoding.drafter import Sampling

    target = untied_target()
    sampling = Sampling(temperature=1.0)
    ids = prompt_ids(target, "hello there")
    table = exact_triples(target, ids, sampling, min_p=5 / N_SINGLE)
    compiled = CompiledTarget(target, ids.shape[1] + 16, widths=(1, 3), mode="aot_eager")
    compiled.warmup()
    draft = noisy_copy(target.model, 0.5)
    drafter = DraftLMDrafter(draft, compiled)
    gen = torch.Generator().manual_seed(0)
    samples, accepts = [], []
    for i in range(N_SINGLE):
        if i == 1:  # after the first call every graph exists (the drafter's come on first use)
            graphs = STATS.graphs
        out = generate(compiled, ids, drafter, k=2, sampling=sampling, max_new_tokens=4,
                       generator=gen, eos_token_ids=NO_EOS)  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        accepts.append(out.accept_counts[0])
    assert STATS.graphs == graphs  # no graph compiled per round
    assert {0, 1, 2} <= set(accepts)  # every acceptance path was exercised
    assert g_test(samples, table) > P_THRESHOLD
    wrong = generate(Target(draft, target.tokenizer, "draft"), ids.expand(4 * N_SINGLE, -1), None,
                     sampling=sampling, max_new_tokens=3, generator=gen, eos_token_ids=NO_EOS)  # fmt: skip
    assert g_test([tuple(s) for s in wrong.sequences], table) < 1e-6
