"""The speculative loop: lossless greedy (token for token), lossless sampling (G-test),
τ = k+1 for a perfect draft and τ = 1 for an always-wrong one, EOS, batches, bad input.

DRAFTLAB_TEST_DEVICE=cuda runs these on a GPU (scripts/gpu_check.sh).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from scipy.stats import chi2
from transformers import GenerationConfig

from decoding.drafter import Sampling
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.ngram import NgramDrafter
from decoding.spec import generate
from decoding.verify import sampling_probs
from models.target import Target
from models.target_loaders import build_tiny_random

DEVICE = os.environ.get("DRAFTLAB_TEST_DEVICE", "cpu")
V = 128
NO_EOS: list[int] = []


def make_target(seed: int = 0) -> Target:
    """build_tiny_random's greedy output is one token repeated (its tied, x8 embeddings make
    it copy its input); an untied random head gives varied text and a spread distribution."""
    target = build_tiny_random(seed=seed, vocab_size=V, device="cpu")
    model = target.model
    g = torch.Generator().manual_seed(1000 + seed)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(
        torch.randn(V, 64, generator=g) * 0.5, requires_grad=False
    )
    with torch.no_grad():
        model.get_input_embeddings().weight.div_(8.0)
    return target.to(DEVICE)


def noisy_copy(model: torch.nn.Module, noise: float, seed: int = 7) -> torch.nn.Module:
    """A draft LM that mostly agrees with the target: its head plus Gaussian noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = draft.lm_head.weight
        draft.lm_head.weight = torch.nn.Parameter(
            w + noise * torch.randn(w.shape, generator=g).to(w), requires_grad=False
        )
    return draft


def shifted_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A draft whose logits are the target's rolled by one id: its argmax is never the target's."""
    draft = copy.deepcopy(model)
    with torch.no_grad():
        draft.lm_head.weight = torch.nn.Parameter(
            draft.lm_head.weight.roll(1, 0), requires_grad=False
        )
    return draft


def prompt_ids(target: Target, text: str) -> torch.Tensor:
    ids = target.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )["input_ids"]
    return torch.tensor([ids], device=DEVICE)


PROMPTS = ["hello there", "write a poem about the sea", "Q: capital of France?"]


def hf_greedy(target: Target, ids: torch.Tensor, n: int, eos: list[int]) -> list[int]:
    """Reference: transformers' own greedy decoding of one unpadded prompt."""
    cfg = GenerationConfig(
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=0,
        eos_token_id=eos or None,
        pad_token_id=target.tokenizer.pad_token_id,
    )
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
    return out[0, ids.shape[1] :].tolist()


def left_pad(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), T), pad, device=DEVICE)
    mask = torch.zeros((len(rows), T), dtype=torch.long, device=DEVICE)
    for b, r in enumerate(rows):
        ids[b, T - r.shape[1] :] = r[0]
        mask[b, T - r.shape[1] :] = 1
    return ids, mask


@pytest.fixture(scope="module")
def target() -> Target:
    return make_target()


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
N_SINGLE = 400  # one generate call per sample (~25 ms each on this CPU)
N_BATCH = 4  # rows per call in the batched check, N_SINGLE rows in all
P_THRESHOLD = 1e-3  # seeded, so deterministic; a correct sampler fails this 0.1% of seeds


def exact_triples(target: Target, ids: torch.Tensor, sampling: Sampling, min_p: float) -> dict:
    """P(t1, t2, t3) for every triple with probability >= min_p, from batched forwards."""
    p1 = sampling_probs(target(ids).logits[0, -1], sampling)  # [V]
    seq1 = torch.cat([ids.expand(V, -1), torch.arange(V, device=DEVICE)[:, None]], 1)  # [V, T+1]
    pair = p1[:, None] * sampling_probs(target(seq1).logits[:, -1], sampling)  # [V, V]
    idx = (pair >= min_p).nonzero()  # [P, 2]
    seq2 = torch.cat([ids.expand(len(idx), -1), idx], 1)  # [P, T+2]
    p3 = sampling_probs(target(seq2).logits[:, -1], sampling)  # [P, V]
    joint = pair[idx[:, 0], idx[:, 1]][:, None] * p3  # [P, V]
    table = {}
    for (a, b), row in zip(idx.tolist(), joint.tolist()):
        for c, p in enumerate(row):
            if p >= min_p:
                table[(a, b, c)] = p
    return table


def g_test(samples: list[tuple[int, int, int]], table: dict) -> float:
    counts = dict.fromkeys(table, 0)
    other = 0
    for s in samples:
        if s in counts:
            counts[s] += 1
        else:
            other += 1
    n = len(samples)
    observed = list(counts.values()) + [other]
    expected = [n * p for p in table.values()] + [n * (1 - sum(table.values()))]
    g = 2 * sum(o * torch.tensor(o / e).log().item() for o, e in zip(observed, expected) if o > 0)
    return float(chi2.sf(g, df=len(observed) - 1))


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
