"""decoding/metrics.py: τ, α and the histogram from exactly known drafts; per-round step
costs from a fake clock."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

import decoding.metrics
import decoding.rounds
import decoding.spec
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.metrics import acceptance_stats, evaluate, greedy_match
from decoding.rounds import GenerationResult
from decoding.spec import generate
from models.draft_lm import DraftLM
from tests.helpers import noisy_copy, prompt_ids, shifted_copy, untied_target

ROOT = Path(__file__).resolve().parents[1]


def test_acceptance_stats_by_hand():
    r = GenerationResult(
        sequences=[[]],
        accept_counts=[3, 0, 1, 3, 0],
        draft_lens=[3, 3, 3, 3, 0],
        round_tokens=[4, 1, 2, 4, 1],  # accepted + the correction/bonus token
    )
    s = acceptance_stats([r], k=3)
    assert s["tau"] == r.tau == 1 + 7 / 5  # every verify forward, the last AR step included
    assert s["tau_drafted"] == r.tau_drafted == 1 + 7 / 4  # rounds with drafts only
    assert s["verify_rounds"] == 5 and s["drafted_rounds"] == 4
    assert s["accept_hist"] == [1, 1, 0, 2]
    assert s["alpha"] == [3 / 4, 2 / 3, 1.0]
    assert s["accept_cumulative"] == [3 / 4, 2 / 4, 2 / 4]
    # A last round cut by an accepted EOS draft (2 drafts emitted, no bonus): τ counts the 2.
    r.accept_counts[-1], r.draft_lens[-1], r.round_tokens[-1] = 2, 3, 2
    s = acceptance_stats([r], k=3)
    assert s["tau"] == r.tau == 13 / 5 and s["tau_drafted"] == 13 / 5


def test_greedy_match():
    assert greedy_match([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert greedy_match([1, 2, 3, 4], [1, 2, 9, 4]) == 0.5
    assert greedy_match([1, 2], [1, 2, 3, 4]) == 0.5


def test_evaluate_perfect_and_wrong_drafts():
    target = untied_target()
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
    # Every judged draft was accepted: 2 prompts x 3 rounds x k, each with acceptance 1.
    ent = perfect["entropy_alpha"]
    assert sum(ent["count"]) == 2 * 3 * k
    assert [a for a in ent["alpha"] if a is not None] == [1.0] * sum(c > 0 for c in ent["count"])
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
    assert wrong["accept_hist"] == [2 * 10, 0, 0, 0]  # 1 prefill + 10 rounds + 1 AR step
    assert wrong["verify_rounds"] == 2 * 11 and wrong["drafted_rounds"] == 2 * 10
    assert wrong["greedy_match_rate"] == 1.0 and wrong["greedy_exact_match"] == 1.0
    # One judged draft per drafted round (rejected at once), every one with acceptance 0.
    ent = wrong["entropy_alpha"]
    assert sum(ent["count"]) == wrong["drafted_rounds"]
    assert [a for a in ent["alpha"] if a is not None] == [0.0] * sum(c > 0 for c in ent["count"])
    for key in (
        "tokens_per_s",
        "ar_tokens_per_s",
        "speedup",
        "predicted_speedup",
        "draft_time_share",
    ):
        assert wrong[key] > 0


def test_evaluate_without_entropy_passes_no_probe(monkeypatch):
    """entropy=False (train/eval/evaluate.py's compiled pass): generate never gets a probe,
    entropy_alpha is None, and the acceptance numbers are those of the run with the probe."""
    target = untied_target()
    prompts = [prompt_ids(target, p)[0] for p in ("hello there", "a poem")]
    drafter = DraftLMDrafter(noisy_copy(target.model, 0.8))
    kw = dict(k=3, max_new_tokens=12, warmup=0, eos_token_ids=[])
    with_entropy = evaluate(target, drafter, prompts, **kw)
    probes = []
    real_generate = decoding.metrics.generate

    def recording_generate(*args, probe=None, **kwargs):
        probes.append(probe)
        return real_generate(*args, probe=probe, **kwargs)

    monkeypatch.setattr(decoding.metrics, "generate", recording_generate)
    without = evaluate(target, drafter, prompts, entropy=False, **kw)
    assert probes == [None] * 2 * len(prompts) and without["entropy_alpha"] is None
    assert sum(with_entropy["entropy_alpha"]["count"]) > 0
    for key in ("tau", "alpha", "accept_hist", "new_tokens", "greedy_match_rate"):
        assert without[key] == with_entropy[key]


class CostlyPrefillDrafter(DraftLMDrafter):
    """A draft LM whose prefill costs `prefill_s` more on the fake clock."""

    def __init__(self, model, target, clock, prefill_s: float):
        super().__init__(model, target)
        self.clock, self.prefill_s = clock, prefill_s

    def prefill(self, *args, **kwargs):
        self.clock.now += self.prefill_s
        return super().prefill(*args, **kwargs)


class TickClock:
    """perf_counter advancing one tick per call: every timed section lasts exactly one tick."""

    tick = 1e-3

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now


def test_drafter_prefill_is_not_a_per_round_cost(monkeypatch):
    clock = TickClock()
    for module in (decoding.rounds, decoding.spec):  # the prefill, and the rounds
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    target = untied_target()
    prompts = [prompt_ids(target, p)[0] for p in ("hello there", "write a poem about the sea")]
    draft = noisy_copy(target.model, 0.3)
    kw = dict(k=3, max_new_tokens=12, warmup=0, eos_token_ids=[])
    light = evaluate(target, CostlyPrefillDrafter(draft, target, clock, 0.0), prompts, **kw)
    heavy = evaluate(target, CostlyPrefillDrafter(draft, target, clock, 10.0), prompts, **kw)
    # Every round costs one tick of target forward, plus one tick each of propose and commit
    # when it drafted (the budget's last token is an AR step); prefills are left out.
    verify, drafted = heavy["verify_rounds"], heavy["drafted_rounds"]
    assert 0 < drafted < verify  # an AR step at the budget is a verify forward too
    t_draft = 2 * drafted / verify  # ticks per round
    for m in (light, heavy):
        assert m["t_target_step_ms"] == pytest.approx(1e3 * clock.tick)
        assert m["t_verify_ms"] == pytest.approx(1e3 * clock.tick)
        assert m["t_draft_round_ms"] == pytest.approx(1e3 * clock.tick * t_draft)
        assert m["predicted_speedup"] == pytest.approx(m["tau"] / (1 + t_draft))
        assert m["draft_time_share"] == pytest.approx(heavy["draft_time_share"])
        assert m["overhead_share"] == pytest.approx(heavy["overhead_share"])
    one = generate(
        target, prompt_ids(target, "hi"), CostlyPrefillDrafter(draft, target, clock, 10.0),
        k=3, max_new_tokens=8, eos_token_ids=[],
    )  # fmt: skip
    assert one.draft_prefill_s == pytest.approx(10.0 + clock.tick)
    assert one.draft_s == pytest.approx(clock.tick * 2 * sum(d > 0 for d in one.draft_lens))


def test_checkpoint_evaluation_reports_acceptance_vs_entropy_per_temperature():
    """evaluate_checkpoint at T = 0, 0.7, 1.0 (cfg.decode.temperatures): `<tag>/entropy_alpha`
    for each, counting every draft the verifier judged (the accepted ones and each round's
    first rejection), JSON-able as the eval records are written."""
    from hydra import compose, initialize_config_dir

    from train.eval.evaluate import evaluate_checkpoint
    from train.run.settings import eval_settings

    target = untied_target()
    overrides = ["decode.temperatures=[0.0,0.7,1.0]", "decode.max_new_tokens=16", "decode.k=3"]
    overrides += ["decode.dtype=fp32", "decode.warmup=0"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("train", overrides=overrides)
    prompts = [{"input_ids": prompt_ids(target, p)[0].tolist()} for p in ("hello", "a poem")]
    spec_runs = []  # what the evaluation decoded, to count the judged drafts independently
    real_generate = decoding.metrics.generate

    def recording_generate(*args, probe=None, **kwargs):
        result = real_generate(*args, probe=probe, **kwargs)
        if probe is not None:
            spec_runs.append(result)
        return result

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(decoding.metrics, "generate", recording_generate)
        draft = DraftLM(noisy_copy(target.model, 0.8))
        result, _ = evaluate_checkpoint(target, draft, prompts, eval_settings(cfg), None)
    json.dumps(result, allow_nan=False)
    assert len(spec_runs) == 3 * len(prompts)
    for i, tag in enumerate(("greedy", "T0.7", "T1")):
        ent = result[f"{tag}/entropy_alpha"]
        assert set(ent) == {"edges", "count", "alpha", "slope", "intercept"}
        assert ent["edges"] == [0.0, 0.5, 1.0, 2.0, 3.0, 4.0, None]
        runs = spec_runs[i * len(prompts) : (i + 1) * len(prompts)]
        judged = sum(
            min(n + 1, d) for r in runs for n, d in zip(r.accept_counts, r.draft_lens) if d > 0
        )
        assert sum(ent["count"]) == judged > 0
        accepted = sum(sum(r.accept_counts) for r in runs)
        mean = sum(a * c for a, c in zip(ent["alpha"], ent["count"]) if c) / judged
        if tag == "greedy":  # 0/1 outcomes: their sum is the accepted drafts
            assert mean * judged == pytest.approx(accepted)
        assert 0.0 <= mean <= 1.0 and ent["slope"] is not None
