"""decoding/metrics.py: τ, α and the histogram from exactly known drafts."""

from __future__ import annotations

import json

from decoding.drafters import DraftLMDrafter
from decoding.metrics import acceptance_stats, evaluate, greedy_match
from decoding.spec import GenerationResult
from tests.test_spec import make_target, prompt_ids, shifted_copy


def test_acceptance_stats_by_hand():
    r = GenerationResult(sequences=[[]], accept_counts=[3, 0, 1, 3, 2], draft_lens=[3, 3, 3, 3, 0])
    s = acceptance_stats([r], k=3)
    assert s["tau"] == 1 + 7 / 4  # the AR-only last round (0 drafts) is not a verify round
    assert s["accept_hist"] == [1, 1, 0, 2]
    assert s["alpha"] == [3 / 4, 2 / 3, 1.0]
    assert s["accept_cumulative"] == [3 / 4, 2 / 4, 2 / 4]


def test_greedy_match():
    assert greedy_match([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert greedy_match([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert greedy_match([1, 2], [1, 2, 3, 4]) == 0.5


def test_evaluate_perfect_and_wrong_drafts():
    target = make_target()
    prompts = [prompt_ids(target, p)[0] for p in ("hello there", "write a poem about the sea")]
    k = 3
    perfect = evaluate(
        target,
        DraftLMDrafter(target.model),
        prompts,
        k=k,
        max_new_tokens=1 + 3 * (k + 1),
        warmup=1,
        eos_token_ids=[],
    )
    json.dumps(perfect)
    assert perfect["tau"] == k + 1 and perfect["alpha"] == [1.0] * k
    assert perfect["accept_hist"] == [0, 0, 0, 6]
    assert perfect["greedy_match_rate"] == 1.0 and perfect["greedy_exact_match"] == 1.0
    assert perfect["new_tokens"] == perfect["ar_new_tokens"] == 2 * 13
    wrong = evaluate(
        target,
        DraftLMDrafter(shifted_copy(target.model)),
        prompts,
        k=k,
        max_new_tokens=12,
        warmup=0,
        eos_token_ids=[],
    )
    assert wrong["tau"] == 1.0 and wrong["alpha"] == [0.0, None, None]
    assert wrong["accept_hist"] == [
        2 * 10,
        0,
        0,
        0,
    ]  # 1 prefill + 10 rounds + 1 AR step and wrong["greedy_match_rate"] == 1.0
    for key in (
        "tokens_per_s",
        "ar_tokens_per_s",
        "speedup",
        "predicted_speedup",
        "draft_time_share",
    ):
        assert wrong[key] > 0
