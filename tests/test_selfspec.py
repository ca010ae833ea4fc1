"""Self-speculative drafts (models/selfspec.py, decoding/drafters/selfspec.py): the draft is
the target's own first layers (its tensors, never copied) through a trained exit; draft and
verify share the target's one KV cache; decoding is lossless, chain, greedy and sampling."""

from __future__ import annotations

import shutil

import pytest
import torch

from decoding.compiled import CompiledTarget
from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.lookup import with_lookup
from decoding.drafters.selfspec import CompiledSharedCache
from decoding.inductor import STATS
from decoding.spec import generate
from models.selfspec import SharedCacheTarget, from_target
from models.target import Target
from models.target_loaders import build_tiny_random
from tests.helpers import (
    DEVICE,
    N_SINGLE,
    NO_EOS,
    P_THRESHOLD,
    PROMPTS,
    V,
    compose_debug,
    exact_triples,
    g_test,
    hf_greedy,
    left_pad,
    metrics_records,
    prompt_ids,
)

LAYERS = 4


def layered_target(deep: float) -> Target:
    """A 4-layer tiny target with an untied random head (varied greedy text) whose layers
    2..3 add `deep` times their usual output: 0 makes an exit after layer 1 exactly the
    target (every draft accepted), 0.5 close to it (rounds accept some)."""
    target = build_tiny_random(seed=0, vocab_size=V, num_layers=LAYERS, device="cpu")
    model = target.model
    g = torch.Generator().manual_seed(1000)
    model.config.tie_word_embeddings = False
    model.generation_config.eos_token_id = None  # the references run the whole length
    model.lm_head.weight = torch.nn.Parameter(torch.randn(V, 64, generator=g) * 0.5)
    with torch.no_grad():
        model.get_input_embeddings().weight.div_(8.0)
        for layer in model.model.layers[2:]:
            layer.self_attn.o_proj.weight.mul_(deep)
            layer.mlp.down_proj.weight.mul_(deep)
    return Target(model, target.tokenizer, "layered").to(DEVICE)


def exit_after(target: Target, exit_layer: int, noise: float = 0.0, **kw):
    with torch.random.fork_rng(devices=[]):  # its down projection's init: not the test order's
        torch.manual_seed(0)
        draft = from_target(target, exit_layer=exit_layer, rank=16, **kw)
    with torch.no_grad():  # a trained exit is no longer the identity
        draft.up.weight.normal_(0.0, noise, generator=torch.Generator().manual_seed(3))
    return draft


@pytest.fixture(scope="module")
def exact():
    return layered_target(0.0)


@pytest.fixture(scope="module")
def close():
    return layered_target(0.5)


def refs_of(target: Target, n: int = 24) -> list[list[int]]:
    return [hf_greedy(target, prompt_ids(target, p), n, NO_EOS) for p in PROMPTS]


def test_the_draft_is_the_targets_own_layers_and_head(close):
    draft = exit_after(close, 2)
    view = draft.decoding_target(close)
    drafter = make_drafter(draft, view)
    assert drafter.target is close and view.model is close.model
    assert drafter.target.model.model.layers[0] is close.model.model.layers[0]
    # the checkpoint holds the exit alone: an RMSNorm and the low-rank pair
    assert set(draft.state_dict()) == {"norm.weight", "down.weight", "up.weight"}
    assert sum(p.numel() for p in draft.parameters()) == 64 + 2 * 64 * 16
    target_storages = {p.untyped_storage().data_ptr() for p in close.model.parameters()}
    assert not target_storages & {p.untyped_storage().data_ptr() for p in draft.parameters()}


def test_draft_and_verify_share_one_cache_and_the_split_verify_is_the_forward(close):
    """A round's drafting writes layers < L into the target's cache (one entry per drafted
    input); the verify tops layers >= L up and every layer ends one entry per token; its
    logits are a plain forward's over the same tokens."""
    L, k = 2, 3
    draft = exit_after(close, L, noise=0.1)
    view = draft.decoding_target(close)
    drafter = make_drafter(draft, view)
    ids = prompt_ids(close, PROMPTS[1])
    out = view(ids)
    cache, past = out.cache, ids.shape[1]
    drafter.prefill(ids, out)
    last = out.logits[:, -1].argmax(-1)  # [1]
    drafts, _ = drafter.propose(last, k, Sampling())
    lengths = [cache.get_seq_length(i) for i in range(LAYERS)]
    assert lengths == [past + k] * L + [past] * (LAYERS - L)  # c, d1, d2 through layers < L
    assert drafter.cache is cache and view.drafted.cache is cache  # no cache of its own
    step = torch.cat([last[:, None], drafts], 1)  # [1, k + 1]
    position = torch.arange(past, past + k + 1, device=DEVICE)[None]
    verified = view(step, cache=cache, position_ids=position)
    assert [cache.get_seq_length(i) for i in range(LAYERS)] == [past + k + 1] * LAYERS
    plain = close(torch.cat([ids, step], 1))
    torch.testing.assert_close(verified.logits, plain.logits[:, past:], atol=1e-5, rtol=1e-5)
    assert view.drafted is None  # consumed: the next call without a round runs plainly


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("exit_layer", [1, 2, 3])
def test_greedy_equals_the_targets_greedy(close, k, exit_layer):
    draft = exit_after(close, exit_layer, noise=0.02)
    view = draft.decoding_target(close)
    accepted = []
    for text, ref in zip(PROMPTS, refs_of(close), strict=True):
        out = generate(view, prompt_ids(close, text), make_drafter(draft, view), k=k,
                       max_new_tokens=24, eos_token_ids=NO_EOS)  # fmt: skip
        assert out.sequences == [ref]
        assert max(out.draft_lens) == k
        accepted += out.accept_counts
    assert max(accepted) > 0 and min(accepted) < k  # rounds kept drafts, and cut some


@pytest.mark.parametrize("k", [2, 4])
def test_an_exact_exit_is_accepted_every_round(exact, k):
    """Layers >= 2 add nothing: the exit after layer 1 is the target, so every draft is
    accepted (tau = k + 1): the drafted KV and h_L are the ones the verify needs."""
    draft = exit_after(exact, 2)
    view = draft.decoding_target(exact)
    ids = prompt_ids(exact, PROMPTS[0])
    out = generate(view, ids, make_drafter(draft, view), k=k, max_new_tokens=1 + 3 * (k + 1),
                   eos_token_ids=NO_EOS)  # fmt: skip
    assert out.accept_counts == [k] * 3
    assert out.sequences == [hf_greedy(exact, ids, 1 + 3 * (k + 1), NO_EOS)]


def test_padded_batch_lookup_and_early_stop_equal_the_targets_greedy(close):
    ids, mask = left_pad([prompt_ids(close, p) for p in PROMPTS], close.tokenizer.pad_token_id)
    refs = refs_of(close)
    draft = exit_after(close, 2, noise=0.2)
    view = draft.decoding_target(close)
    out = generate(view, ids, make_drafter(draft, view), k=3, max_new_tokens=24,
                   attention_mask=mask, eos_token_ids=NO_EOS)  # fmt: skip
    assert out.sequences == refs
    looked = with_lookup(make_drafter(draft, view), 1)
    for text, ref in zip(PROMPTS, refs, strict=True):
        out = generate(view, prompt_ids(close, text), looked, k=3, max_new_tokens=24,
                       eos_token_ids=NO_EOS)  # fmt: skip
        assert out.sequences == [ref]
    assert looked.lookup_rounds > 0  # lookup drafted some rounds, the exit the others
    stopping = exit_after(close, 2, noise=0.2, stop_below=0.3)
    out = generate(view, ids, make_drafter(stopping, view), k=4, max_new_tokens=24,
                   attention_mask=mask, eos_token_ids=NO_EOS)  # fmt: skip
    assert out.sequences == refs
    assert min(out.draft_lens) < 4 < max(out.draft_lens) + 1  # rounds stopped early


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(0.7, top_p=0.9)])
def test_sampling_matches_the_targets_distribution(sampling):
    close = layered_target(0.1)  # closer still: rounds accept both drafts often enough
    ids = prompt_ids(close, "hello there")
    table = exact_triples(close, ids, sampling, min_p=5 / N_SINGLE)
    assert len(table) >= 8
    draft = exit_after(close, 2, noise=0.02)
    view = draft.decoding_target(close)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    samples, accepts = [], []
    for _ in range(N_SINGLE):
        out = generate(view, ids, make_drafter(draft, view), k=2, sampling=sampling,
                       max_new_tokens=4, generator=gen, eos_token_ids=NO_EOS)  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        accepts.append(out.accept_counts[0])
    assert {0, 1, 2} <= set(accepts)  # every acceptance path was exercised
    assert g_test(samples, table) > P_THRESHOLD


def test_drafter_refuses_a_plain_target(close):
    draft = exit_after(close, 2)
    with pytest.raises(ValueError, match="decoding_target"):
        make_drafter(draft, close)
    with pytest.raises(ValueError, match="exit_layer=4"):
        from_target(close, exit_layer=4)
    assert isinstance(draft.decoding_target(close), SharedCacheTarget)


def compiled_pair(target: Target, draft, mode: str | None, batch: int = 1, widths=(1, 4)):
    """The compiled target and the drafter on it, as train/eval/compiled.py builds them."""
    compiled = CompiledTarget(target, 96, widths, (), mode, batch_size=batch)
    compiled.warmup()
    drafter = make_drafter(draft, compiled)
    return compiled, drafter, drafter.verify_target


def test_compiled_rounds_share_the_compiled_targets_one_cache(close):
    """On the compiled path the drafter writes layers < L into the compiled target's static
    cache at slots past the committed length (the length moves only with the verify); the
    verify's logits are a plain forward's, every layer's slots then hold the plain
    forward's keys, and no second cache is allocated."""
    L, k = 2, 3
    draft = exit_after(close, L, noise=0.1)
    compiled, drafter, view = compiled_pair(close, draft, "aot_eager")
    assert isinstance(view, CompiledSharedCache) and view.target is close
    ids = prompt_ids(close, PROMPTS[1])
    out = view(ids)
    cache, past = out.cache, ids.shape[1]
    assert cache is compiled.cache
    drafter.prefill(ids, out)
    last = out.logits[:, -1].argmax(-1)  # [1]
    drafts, _ = drafter.propose(last, k, Sampling())
    assert cache.length == past and drafter.cache is cache  # drafting moved no length
    step = torch.cat([last[:, None], drafts], 1)  # [1, k + 1]
    position = torch.arange(past, past + k + 1, device=DEVICE)[None]
    verified = view(step, cache=cache, position_ids=position)
    assert cache.length == past + k + 1 and view.drafted is None
    plain = close(torch.cat([ids, step], 1))
    torch.testing.assert_close(verified.logits, plain.logits[:, past:], atol=1e-5, rtol=1e-5)
    for layer in range(LAYERS):  # layers < L from the drafting steps, >= L from the verify
        want = plain.cache.layers[layer].keys[..., : past + k + 1, :]
        got = cache.keys[layer][..., : past + k + 1, :]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sum(t is not None for t in cache.keys) == LAYERS  # one buffer per layer, that's all


@pytest.mark.parametrize("mode", [None, "aot_eager"])
def test_compiled_greedy_equals_the_targets_greedy_with_no_compile_while_decoding(close, mode):
    """A padded batch, prompt lookup and the early stop on the compiled path: the target's
    greedy output; after the warm-ups nothing compiles (aot_eager traces and guards as
    inductor does)."""
    ids, mask = left_pad([prompt_ids(close, p) for p in PROMPTS], close.tokenizer.pad_token_id)
    refs = refs_of(close)
    draft = exit_after(close, 2, noise=0.2)
    stopping = exit_after(close, 2, noise=0.2, stop_below=0.3)
    compiled, drafter, view = compiled_pair(close, draft, mode, batch=len(PROMPTS))
    stop_drafter = make_drafter(stopping, compiled)
    graphs = STATS.graphs
    out = generate(view, ids, drafter, k=3, max_new_tokens=24, attention_mask=mask,
                   eos_token_ids=NO_EOS)  # fmt: skip
    assert out.sequences == refs
    out = generate(stop_drafter.verify_target, ids, stop_drafter, k=3, max_new_tokens=24,
                   attention_mask=mask, eos_token_ids=NO_EOS)  # fmt: skip
    assert out.sequences == refs
    assert min(out.draft_lens) < 3  # rounds stopped early: the verify padded to width 4
    assert STATS.graphs == graphs, f"{STATS.graphs - graphs} graphs compiled while decoding"
    _, single, single_view = compiled_pair(close, draft, mode)
    looked, accepted = with_lookup(single, 1), []
    for text, ref in zip(PROMPTS, refs, strict=True):
        for drafter_ in (single, looked):
            out = generate(single_view, prompt_ids(close, text), drafter_, k=3,
                           max_new_tokens=24, eos_token_ids=NO_EOS)  # fmt: skip
            assert out.sequences == [ref]
        accepted += out.accept_counts
    assert max(accepted) > 0 and min(accepted) < 3  # rounds kept drafts, and cut some
    assert looked.lookup_rounds > 0  # lookup drafted some rounds, the exit the others


def test_a_compiled_exact_exit_is_accepted_every_round(exact):
    """The exit after layer 1 is the target: on the compiled path too every draft is
    accepted, so the KV the drafting steps left in layers < L is the one the verify needs."""
    k = 3
    draft = exit_after(exact, 2)
    _, drafter, view = compiled_pair(exact, draft, "aot_eager")
    ids = prompt_ids(exact, PROMPTS[0])
    out = generate(view, ids, drafter, k=k, max_new_tokens=1 + 3 * (k + 1), eos_token_ids=NO_EOS)
    assert out.accept_counts == [k] * 3
    assert out.sequences == [hf_greedy(exact, ids, 1 + 3 * (k + 1), NO_EOS)]


def test_compiled_sampling_matches_the_targets_distribution():
    """The compiled path's rounds (the static cache, its slots ahead, the padded verify;
    mode None: the graphs' code uncompiled) sample the target's exact distribution."""
    close = layered_target(0.1)
    sampling = Sampling(temperature=1.0)
    ids = prompt_ids(close, "hello there")
    table = exact_triples(close, ids, sampling, min_p=5 / N_SINGLE)
    draft = exit_after(close, 2, noise=0.02)
    _, drafter, view = compiled_pair(close, draft, None, widths=(1, 3))
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    samples, accepts = [], []
    for _ in range(N_SINGLE):
        out = generate(view, ids, drafter, k=2, sampling=sampling, max_new_tokens=4,
                       generator=gen, eos_token_ids=NO_EOS)  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        accepts.append(out.accept_counts[0])
    assert {0, 1, 2} <= set(accepts)
    assert g_test(samples, table) > P_THRESHOLD


def test_training_reads_h_L_and_a_fresh_exit_is_the_plain_early_exit(close):
    draft = from_target(close, exit_layer=2, rank=8)
    ids = prompt_ids(close, PROMPTS[2])
    out = close(ids, hidden_layers=draft.hidden_layers)
    logits = draft(close, ids, out).logits[0]
    early = close.head_logits(close.final_norm(out.hidden[2]))
    torch.testing.assert_close(logits, early)


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    from train.core.checkpoint import list_checkpoints, load_checkpoint
    from train.loop import run

    torch.set_num_threads(1)
    common = ("draft=selfspec", "~draft.model.num_layers", "~draft.model.init",
              "draft.model.exit_layer=1", "draft.model.rank=8",
              "train.steps=4", "train.ckpt_every=2", "train.keep_last=2")  # fmt: skip
    run(compose_debug(tmp_path, *common))
    want = {x["step"]: x["loss"] for x in metrics_records(tmp_path) if x["kind"] == "train"}
    evals = [x for x in metrics_records(tmp_path) if x["kind"] == "eval"]
    assert evals and evals[-1]["greedy/greedy_exact_match"] == 1.0  # decoded, losslessly
    newest = list_checkpoints(tmp_path)[-1]
    want_state = {n: t.clone() for n, t in load_checkpoint(newest)[0].items()}
    shutil.rmtree(newest)
    run(compose_debug(tmp_path, *common, "resume=true"))
    got = {x["step"]: x["loss"] for x in metrics_records(tmp_path) if x["kind"] == "train"}
    assert got == want and len(got) == 4
    for name, value in load_checkpoint(newest)[0].items():
        assert torch.equal(value, want_state[name]), name


def test_cpp_gemm_compiled_rounds_equal_the_eager_ones(close):
    """The CPU's mode, inductor code with the target's weights frozen into the three graphs
    (the exit's adapter stays eager): round for round the eager decode."""
    draft = exit_after(close, 2, noise=0.02)
    view = draft.decoding_target(close)
    # width 4 alone: the rounds' graphs are the view's; the compiled target's own at width 1
    # (the AR's) is the one every kind shares, tested in tests/test_compiled.py
    _, drafter, compiled_view = compiled_pair(close, draft, "cpp-gemm", widths=(4,))
    kw = dict(k=3, max_new_tokens=16, eos_token_ids=NO_EOS)
    for text in PROMPTS[:2]:
        eager = generate(view, prompt_ids(close, text), make_drafter(draft, view), **kw)
        got = generate(compiled_view, prompt_ids(close, text), drafter, **kw)
        assert (got.sequences, got.accept_counts) == (eager.sequences, eager.accept_counts)


def test_a_run_evaluates_the_self_speculative_draft_compiled(tmp_path):
    """decode.compile=true: the run's evaluation decodes the speculative passes on the
    compiled path (the drafter's view of the compiled target), losslessly, beside the eager
    speculative decode."""
    from train.loop import run

    torch.set_num_threads(1)
    summary = run(compose_debug(
        tmp_path, "draft=selfspec", "~draft.model.num_layers", "~draft.model.init",
        "draft.model.exit_layer=1", "draft.model.rank=8", "decode.compile=true",
        "decode.compile_mode=aot_eager", "decode.dtype=float32", "decode.draft_dtype=float32",
    ))  # fmt: skip
    final = summary["final_eval"]
    assert final["greedy/path"] == "compiled" and final["compiled_graphs"] > 0
    assert final["greedy/greedy_exact_match"] == 1.0  # the compiled AR's greedy output
    assert final["greedy/tau_eager_spec"] == final["greedy/tau"]  # the eager decode's rounds
