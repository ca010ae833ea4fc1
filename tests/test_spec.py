"""The speculative loop: lossless greedy (token for token), lossless sampling (G-test),
τ = k+1 for a perfect draft and τ = 1 for an always-wrong one, EOS, batches, bad input.

DRAFTLAB_TEST_DEVICE=cuda runs these on a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from decoding.drafter import Sampling
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.spec import generate
from models.target import Target
from models.target_loaders import build_tiny_random
from tests.helpers import (
    DEVICE,
    N_SINGLE,
    NO_EOS,
    P_THRESHOLD,
    PROMPTS,
    V,
    exact_triples,
    g_test,
    hf_greedy,
    left_pad,
    noisy_copy,
    prompt_ids,
    shifted_copy,
    untied_target,
)

# tests/test_dflash.py imports make_target from here (tests.helpers.untied_target).
make_target = untied_target


@pytest.fixture(scope="module")
def target() -> Target:
    return untied_target()


@pytest.fixture(scope="module")
def refs(target):
    return [hf_greedy(target, prompt_ids(target, p), 24, NO_EOS) for p in PROMPTS]


def test_reference_is_not_degenerate(refs):
    assert all(len(set(r)) >= 8 for r in refs), refs  # else equality tests prove little


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("make_drafter", ["noisy", "ngram"])
def test_greedy_batch1_equals_target_greedy(target, refs, k, make_drafter):
    for text, ref in zip(PROMPTS, refs):
        drafter = (
            DraftLMDrafter(noisy_copy(target.model, 0.3), target)
            if make_drafter == "noisy"
            else NgramDrafter(vocab_size=V)
        )
        out = generate(
            target, prompt_ids(target, text), drafter, k=k, max_new_tokens=24, eos_token_ids=NO_EOS
        )
        assert out.sequences == [ref]
    assert out.draft_lens and max(out.draft_lens) == k


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_padded_batch_equals_target_greedy(target, refs, k):
    ids, mask = left_pad([prompt_ids(target, p) for p in PROMPTS], target.tokenizer.pad_token_id)
    drafter = DraftLMDrafter(noisy_copy(target.model, 0.3), target)
    out = generate(
        target, ids, drafter, k=k, max_new_tokens=24, attention_mask=mask, eos_token_ids=NO_EOS
    )
    assert out.sequences == refs
    ar = generate(target, ids, None, max_new_tokens=24, attention_mask=mask, eos_token_ids=NO_EOS)
    assert ar.sequences == refs


def test_eos_inside_an_accepted_draft_stops_each_row(target, refs):
    # EOS = the token row 0 emits at position 4 (first occurrence); perfect draft, k=5: the
    # first round drafts positions 1..5, so EOS is accepted in the middle of the chain.
    eos = refs[0][4]
    assert eos not in refs[0][:4]
    ids, mask = left_pad([prompt_ids(target, p) for p in PROMPTS], target.tokenizer.pad_token_id)
    out = generate(
        target,
        ids,
        DraftLMDrafter(target.model, target),
        k=5,
        max_new_tokens=24,
        attention_mask=mask,
        eos_token_ids=[eos],
    )
    for seq, ref in zip(out.sequences, refs):
        expected = ref[: ref.index(eos) + 1] if eos in ref else ref
        assert seq == expected
    assert out.sequences[0] == refs[0][:5]
    alone = generate(
        target,
        prompt_ids(target, PROMPTS[0]),
        DraftLMDrafter(target.model),
        k=5,
        max_new_tokens=24,
        eos_token_ids=[eos],
    )
    assert alone.sequences == [refs[0][:5]] and alone.rounds == 1  # prefill token + one round


def test_accepted_drafts_after_eos_are_not_counted(target, refs):
    # Perfect draft, k=4: round 1 drafts refs[0][1..4] = [x, EOS, y, z] and all four are
    # accepted, but the row stops at EOS: 2 drafts emitted (x, EOS), so accept_counts = [2].
    eos = refs[0][2]
    assert eos not in refs[0][:2] and eos not in refs[1]
    kw = dict(k=4, max_new_tokens=24, eos_token_ids=[eos])
    ids = prompt_ids(target, PROMPTS[0])
    alone = generate(target, ids, DraftLMDrafter(target.model), **kw)
    assert alone.sequences == [refs[0][:3]] and alone.rounds == 1
    # One verify forward emitted 2 tokens (x, EOS) and no bonus after the EOS: τ = 2.
    assert alone.accept_counts == [2] and alone.round_tokens == [2]
    assert alone.tau == alone.tau_drafted == 2.0
    assert len(alone.sequences[0]) == 1 + sum(alone.round_tokens)  # prefill token + rounds
    # Batch: the common accepted prefix cut after the last draft any unfinished row emitted.
    same = generate(target, ids.expand(2, -1), DraftLMDrafter(target.model), **kw)
    assert same.sequences == [refs[0][:3]] * 2 and same.accept_counts == [2]
    rows, mask = left_pad([ids, prompt_ids(target, PROMPTS[1])], target.tokenizer.pad_token_id)
    mixed = generate(target, rows, DraftLMDrafter(target.model), attention_mask=mask, **kw)
    assert mixed.sequences == [refs[0][:3], refs[1]]
    assert mixed.accept_counts[0] == 4  # row 1 emitted all four drafts
    # Row 1 never stops early, so τ is exactly its tokens per verify forward.
    assert len(mixed.sequences[1]) == 1 + mixed.rounds + sum(mixed.accept_counts)
    assert len(mixed.sequences[1]) == 1 + sum(mixed.round_tokens)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_perfect_draft_gives_tau_k_plus_1(target, k):
    # 1 prefill token + 4 full rounds of k+1: no round is shortened by the budget.
    n = 1 + 4 * (k + 1)
    out = generate(
        target,
        prompt_ids(target, PROMPTS[1]),
        DraftLMDrafter(target.model),
        k=k,
        max_new_tokens=n,
        eos_token_ids=NO_EOS,
    )
    assert out.accept_counts == [k] * 4 and out.tau == k + 1


def test_always_wrong_draft_gives_tau_1(target, refs):
    out = generate(
        target,
        prompt_ids(target, PROMPTS[0]),
        DraftLMDrafter(shifted_copy(target.model)),
        k=3,
        max_new_tokens=24,
        eos_token_ids=NO_EOS,
    )
    assert out.tau == 1.0 and set(out.accept_counts) == {0}
    assert out.sequences == [refs[0]]


def test_stream_gets_several_tokens_at_once_and_adaptive_k(target, refs):
    chunks: list[list[int]] = []
    out = generate(
        target,
        prompt_ids(target, PROMPTS[2]),
        DraftLMDrafter(target.model),
        k=2,
        max_new_tokens=24,
        eos_token_ids=NO_EOS,
        adaptive_k=True,
        stream=lambda rows: chunks.append(rows[0]),
    )
    assert [t for c in chunks for t in c] == out.sequences[0] == refs[2]
    assert max(len(c) for c in chunks) > 1
    assert out.draft_lens[:3] == [2, 4, 4]  # perfect draft: k grows by 2 up to max_k = 2k


class SpyDrafter(DraftLMDrafter):
    def prefill(self, *args, **kwargs):
        raise AssertionError("decoding started despite bad input")


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"k": 0}, "k"),
        ({"sampling": Sampling(temperature=-1.0)}, "temperature"),
        ({"sampling": Sampling(temperature=1.0, top_p=0.0)}, "top_p"),
        ({"sampling": Sampling(temperature=1.0, top_p=1.2)}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_bad_settings_raise_before_decoding(target, kwargs, word):
    with pytest.raises(ValueError, match=word):
        generate(target, prompt_ids(target, "hi"), SpyDrafter(target.model), **kwargs)


def test_bad_prompt_and_vocab_raise(target):
    with pytest.raises(ValueError, match="empty prompt"):
        generate(
            target, torch.zeros(1, 0, dtype=torch.long, device=DEVICE), SpyDrafter(target.model)
        )
    other = build_tiny_random(seed=3, vocab_size=V + 16, device=DEVICE)
    with pytest.raises(ValueError, match="vocabulary"):
        DraftLMDrafter(other.model, target)
    with pytest.raises(ValueError, match="vocabulary"):
        generate(target, prompt_ids(target, "hi"), SpyDrafter(other.model))


# ---------------------------------------------------------------------------------------
# Sampling is lossless: G-test of the first three tokens against the exact distribution.
# ---------------------------------------------------------------------------------------

N_SAMPLES = 1000  # the power check (one generate call)
N_BATCH = 4  # rows per call in the batched check, N_SINGLE rows in all


@pytest.mark.parametrize(
    "sampling", [Sampling(temperature=1.0), Sampling(temperature=0.7, top_p=0.9)]
)
def test_sampling_matches_target_distribution(target, sampling):
    ids = prompt_ids(target, "hello there")
    table = exact_triples(target, ids, sampling, min_p=5 / N_SAMPLES)  # bins: expected count >= 5
    single_table = exact_triples(target, ids, sampling, min_p=5 / N_SINGLE)
    assert len(single_table) >= 8
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    draft = noisy_copy(target.model, 0.5)
    # One row at a time: rounds accept 0, 1 or 2 drafts (max_new_tokens=4 -> k=2 first).
    samples, accepts = [], []
    drafter = DraftLMDrafter(draft, target)
    for _ in range(N_SINGLE):
        out = generate(
            target,
            ids,
            drafter,
            k=2,
            sampling=sampling,
            max_new_tokens=4,
            generator=gen,
            eos_token_ids=NO_EOS,
        )
        samples.append(tuple(out.sequences[0][:3]))
        accepts.append(out.accept_counts[0])
    assert {0, 1, 2} <= set(accepts)  # every acceptance path was exercised
    assert g_test(samples, single_table) > P_THRESHOLD
    # Small batches with a close draft, so rows often accept together: a round keeps the
    # common prefix n >= 1 and each row adds its own next draft or correction. Rows of a
    # batch are independent samples of p (decoding/spec.py), so one G-test pools them.
    close = DraftLMDrafter(noisy_copy(target.model, 0.05), target)
    samples, common = [], []
    for _ in range(N_SINGLE // N_BATCH):
        out = generate(
            target,
            ids.expand(N_BATCH, -1),
            close,
            k=2,
            sampling=sampling,
            max_new_tokens=4,
            generator=gen,
            eos_token_ids=NO_EOS,
        )
        samples += [tuple(s[:3]) for s in out.sequences]
        common.append(out.accept_counts[0])  # n of the first round (k=2), no EOS
    assert common.count(1) >= 10 and common.count(2) >= 10  # rows kept accepting together
    assert g_test(samples, single_table) > P_THRESHOLD
    # The test has power: the draft's own samples are rejected.
    draft_target = Target(draft, target.tokenizer, "draft")
    wrong = generate(
        draft_target,
        ids.expand(N_SAMPLES, -1),
        None,
        sampling=sampling,
        max_new_tokens=3,
        generator=gen,
        eos_token_ids=NO_EOS,
    )
    assert g_test([tuple(s) for s in wrong.sequences], table) < 1e-6
