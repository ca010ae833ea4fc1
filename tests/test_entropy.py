"""decoding/entropy.py: acceptance against the target's entropy. The pure functions on hand
values; the chain and tree loops feeding the probe (counts = the positions the verifier
judged, greedy acceptance summing to the accepted drafts); the probe's time kept out of the
wall time."""

from __future__ import annotations

import json
import math
import types

import numpy as np
import pytest
import torch

import decoding.rounds
import decoding.spec
from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.entropy import (
    ENTROPY_EDGES,
    EntropyProbe,
    chain_positions,
    children_acceptance,
    entropy,
    entropy_alpha,
    expected_acceptance,
    judged_probs,
    least_squares,
    tree_positions,
)
from decoding.spec import generate
from decoding.tree import TreeSpec
from decoding.verify import greedy_verify, tree_greedy_verify
from models import medusa
from tests.helpers import noisy_copy, prompt_ids, untied_target

torch.set_num_threads(1)
GREEDY, T1 = Sampling(), Sampling(temperature=1.0)
LN2 = math.log(2.0)


def logits_of(*rows: list[float]) -> torch.Tensor:
    """Probability rows -> logits whose T=1 softmax is exactly those rows."""
    return torch.tensor(rows, dtype=torch.float64).log().float()


# -- the pure functions -----------------------------------------------------------------------
def test_entropy_and_expected_acceptance_by_hand():
    p = torch.tensor([[0.25] * 4, [0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert entropy(p).tolist() == pytest.approx([math.log(4), LN2, 0.0])
    q = torch.tensor([0.2, 0.5, 0.3])
    assert float(expected_acceptance(torch.tensor([0.5, 0.3, 0.2]), q)) == pytest.approx(0.7)
    # Greedy reports the T=1 softmax (the verifier's own p is a one-hot); T > 0 the verifier's
    # p: at T=0.5, [1/2, 1/4, 1/4] becomes [2/3, 1/6, 1/6].
    logits = logits_of([0.5, 0.25, 0.25])
    assert judged_probs(logits, GREEDY)[0].tolist() == pytest.approx([0.5, 0.25, 0.25])
    sharp = judged_probs(logits, Sampling(temperature=0.5))[0]
    assert sharp.tolist() == pytest.approx([2 / 3, 1 / 6, 1 / 6], abs=1e-6)
    h = -(2 / 3 * math.log(2 / 3) + 2 / 6 * math.log(1 / 6))
    assert float(entropy(sharp)) == pytest.approx(h, abs=1e-6)
    top1 = judged_probs(logits, Sampling(temperature=1.0, top_k=1))[0]  # top-k zeros: H = 0
    assert float(entropy(top1)) == 0.0


def test_chain_positions_greedy_by_hand():
    # Row 0: argmax 0, 1, 2 at positions 0..2; drafts 0, 1, 0 -> 2 accepted, the 3rd rejected.
    # Row 1: drafts 2, 1, 2 -> rejected at once. Row 2: all 3 accepted (no rejection judged).
    p = [[0.5, 0.25, 0.25], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]]
    logits = logits_of(*p).expand(3, 4, 3)  # [B, k+1, V]
    drafts = torch.tensor([[0, 1, 0], [2, 1, 2], [0, 1, 2]])
    n = greedy_verify(drafts, logits).num_accepted
    assert n.tolist() == [2, 0, 3]
    H, acc = chain_positions(drafts, None, logits, n, GREEDY, torch.tensor([True, True, True]))
    h = entropy(torch.tensor(p)).tolist()
    assert acc.tolist() == [1, 1, 0, 0, 1, 1, 1]  # row-major: up to and incl. the rejection
    assert H.tolist() == pytest.approx([h[0], h[1], h[2], h[0], h[0], h[1], h[2]])
    assert h[0] == pytest.approx(1.5 * LN2)
    # A finished row's drafts are not judged.
    H, acc = chain_positions(drafts, None, logits, n, GREEDY, torch.tensor([False, True, False]))
    assert acc.tolist() == [0] and H.tolist() == pytest.approx([h[0]])


def test_chain_positions_sampling_by_hand():
    p = [[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]
    logits = logits_of(*p)[None]  # [1, 3, 3]: k = 2
    q = torch.tensor([[[0.2, 0.5, 0.3], [0.1, 0.1, 0.8]]])  # [1, 2, 3]
    drafts = torch.tensor([[1, 2]])
    rows = torch.tensor([True])
    H, acc = chain_positions(drafts, q, logits, torch.tensor([0]), T1, rows)
    assert acc.tolist() == pytest.approx([0.7]) and H.tolist() == pytest.approx(
        [entropy(torch.tensor(p[0])).item()]
    )
    H, acc = chain_positions(drafts, q, logits, torch.tensor([2]), T1, rows)
    assert acc.tolist() == pytest.approx([0.7, 1.0])  # q = p at position 2
    with pytest.raises(ValueError, match="needs the draft distributions q"):
        chain_positions(drafts, None, logits, torch.tensor([2]), T1, rows)


def test_children_acceptance_by_hand():
    p = torch.tensor([0.5, 0.3, 0.2])
    # Deterministic candidates (q = one-hot): the p-mass of the candidates.
    # 1 - (1 - 0.3)(1 - 0.2 / 0.7) = 0.5
    assert float(children_acceptance(p, torch.tensor([1, 2]), None)) == pytest.approx(0.5)
    assert float(children_acceptance(p, torch.tensor([0, 1, 2]), None)) == pytest.approx(1.0)
    q = torch.tensor([0.2, 0.5, 0.3])
    # One sampled child: min(1, 0.3 / 0.5) = 0.6. A second child from the same q after the
    # residual r = normalize(max(p - q, 0)) = [1, 0, 0]: token 0 is then always accepted,
    # token 2 never.
    assert float(children_acceptance(p, torch.tensor([1]), q[None])) == pytest.approx(0.6)
    two = torch.stack([q, q])
    assert float(children_acceptance(p, torch.tensor([1, 0]), two)) == pytest.approx(1.0)
    assert float(children_acceptance(p, torch.tensor([1, 2]), two)) == pytest.approx(0.6)


def test_tree_positions_by_hand():
    # Nodes 0, 1 below the root; 2, 3 below node 0; 4 below node 2. V = 4.
    parents = torch.tensor([[-1, -1, 0, 0, 2]] * 2)
    tokens = torch.tensor([[0, 1, 2, 3, 0]] * 2)
    p = [
        [0.5, 0.3, 0.1, 0.1],  # root: argmax 0 = node 0
        [0.1, 0.2, 0.3, 0.4],  # after node 0: argmax 3 = node 3 (row 0)
        [0.25] * 4, [0.25] * 4, [0.25] * 4, [0.25] * 4,
    ]  # fmt: skip
    logits = logits_of(*p).expand(2, 6, 4).clone()
    logits[1, 1] = logits_of([0.7, 0.1, 0.1, 0.1])[0]  # row 1: argmax 0, not a child of node 0
    res = tree_greedy_verify(tokens, parents, logits.argmax(-1))
    assert res.num_accepted.tolist() == [2, 1]
    rows = torch.tensor([True, True])
    H, acc = tree_positions(tokens, parents, None, logits, res.path, res.num_accepted, GREEDY, rows)
    # Row 0: the root and node 0 judged (node 3 is an accepted leaf: its token is a bonus).
    # Row 1: the root (accepted), node 0 (no child accepted).
    assert acc.tolist() == [1, 1, 1, 0]
    h_root, h_0 = entropy(torch.tensor(p[0])).item(), entropy(torch.tensor(p[1])).item()
    h_0b = entropy(torch.tensor([0.7, 0.1, 0.1, 0.1])).item()
    assert H.tolist() == pytest.approx([h_root, h_0, h_root, h_0b])
    # Sampling with deterministic candidates: P(one child accepted) = p-mass of the children.
    H, acc = tree_positions(tokens, parents, None, logits, res.path, res.num_accepted, T1, rows)
    assert acc.tolist() == pytest.approx([0.8, 0.7, 0.8, 0.2])
    H, acc = tree_positions(
        tokens, parents, None, logits, res.path, res.num_accepted, T1, torch.tensor([False, True])
    )
    assert acc.tolist() == pytest.approx([0.8, 0.2])


def test_entropy_alpha_buckets_and_fit_by_hand():
    H = torch.tensor([0.1, 0.4, 0.7, 1.5, 5.0, 0.5, 4.0])  # 0.5 and 4.0 sit on edges
    acc = torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.2])
    s = entropy_alpha(H, acc)
    assert s["edges"] == [0.0, 0.5, 1.0, 2.0, 3.0, 4.0, None]  # None = inf (JSON has no inf)
    assert s["count"] == [2, 2, 1, 0, 0, 2]  # buckets are [lo, hi): an edge opens its bucket
    assert s["alpha"] == pytest.approx([1.0, 0.5, 0.5, None, None, 0.1])
    slope, intercept = np.polyfit(H.double().numpy(), acc.double().numpy(), 1)
    assert s["slope"] == pytest.approx(slope) and s["intercept"] == pytest.approx(intercept)
    json.dumps(s, allow_nan=False)
    assert least_squares(torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, 0.5, 0.0])) == (
        pytest.approx(-0.5),
        pytest.approx(1.0),
    )
    assert least_squares(torch.tensor([1.0, 1.0]), torch.tensor([0.0, 1.0])) == (None, None)
    empty = EntropyProbe().summary()
    assert empty["count"] == [0] * 6 and empty["alpha"] == [None] * 6 and empty["slope"] is None
    other = entropy_alpha(H, acc, edges=(0.0, 1.0, math.inf))
    assert other["count"] == [4, 3] and other["edges"] == [0.0, 1.0, None]
    with pytest.raises(ValueError, match="start at 0 and end at inf"):
        entropy_alpha(H, acc, edges=(0.0, 1.0, 2.0))
    with pytest.raises(ValueError, match="increase strictly"):
        entropy_alpha(H, acc, edges=(0.0, 2.0, 1.0, math.inf))
    assert ENTROPY_EDGES[0] == 0.0 and ENTROPY_EDGES[-1] == math.inf


# -- the loops ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target():
    return untied_target()


def judged_chain(result) -> int:
    """Positions a chain round judges: the accepted drafts plus the rejected one, if any."""
    return sum(min(n + 1, d) for n, d in zip(result.accept_counts, result.draft_lens) if d > 0)


@pytest.mark.parametrize("sampling", [GREEDY, T1, Sampling(temperature=0.7, top_p=0.9)])
def test_chain_probe_counts_the_judged_drafts(target, sampling):
    drafter = DraftLMDrafter(noisy_copy(target.model, 0.8))
    probe = EntropyProbe()
    g = torch.Generator().manual_seed(0)
    runs = [
        generate(target, prompt_ids(target, text), drafter, k=3, sampling=sampling,
                 max_new_tokens=20, eos_token_ids=[], generator=g, probe=probe)
        for text in ("hello there", "write a poem about the sea")
    ]  # fmt: skip
    accepted = sum(sum(r.accept_counts) for r in runs)
    assert 0 < accepted < sum(sum(r.draft_lens) for r in runs)  # both outcomes occur
    s = probe.summary()
    assert sum(s["count"]) == probe.count == sum(judged_chain(r) for r in runs)
    a = torch.cat(probe.acceptance)
    assert bool(((a >= 0) & (a <= 1 + 1e-6)).all()) and bool((torch.cat(probe.entropy) >= 0).all())
    if sampling.greedy:  # 0/1 outcomes: they add up to the accepted drafts
        assert float(a.sum()) == accepted
    assert s["slope"] is not None


def test_tree_probe_counts_one_position_per_judged_depth(target):
    drafter = make_drafter(medusa.from_target(target), target)
    for sampling in (GREEDY, T1):
        probe = EntropyProbe()
        r = generate(
            target, prompt_ids(target, "hello there"), drafter, tree=TreeSpec(),
            sampling=sampling, max_new_tokens=20, eos_token_ids=[], probe=probe,
            generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        drafted = [(n, d) for n, d in zip(r.accept_counts, r.draft_lens) if d > 0]
        # Depths 0..n-1 of the accepted path always have children; depth n when not a leaf.
        assert sum(n for n, _ in drafted) <= probe.count <= sum(n + 1 for n, _ in drafted)
        a = torch.cat(probe.acceptance)
        if sampling.greedy:
            assert float(a.sum()) == sum(n for n, _ in drafted)
        assert bool(((a >= 0) & (a <= 1 + 1e-6)).all())


def test_probe_time_is_not_decoding_time(target, monkeypatch):
    """A probe that costs 10 s per round on a fake clock leaves the wall time alone."""
    clock = types.SimpleNamespace(now=0.0)

    def perf_counter() -> float:
        clock.now += 1e-3
        return clock.now

    def slow_positions(*args, **kwargs):
        clock.now += 10.0
        return chain_positions(*args, **kwargs)

    for module in (decoding.rounds, decoding.spec):  # the prefill, and the rounds
        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(decoding.spec, "chain_positions", slow_positions)
    drafter = DraftLMDrafter(noisy_copy(target.model, 0.3))
    kw = dict(k=3, max_new_tokens=12, eos_token_ids=[])
    ids = prompt_ids(target, "hello there")
    plain = generate(target, ids, drafter, **kw)
    probed = generate(target, ids, drafter, probe=EntropyProbe(), **kw)
    drafted = sum(d > 0 for d in probed.draft_lens)
    assert drafted > 0 and plain.draft_lens == probed.draft_lens
    # Left out: the probe's 10 s per round (the probe's own timer call adds one fake tick).
    assert probed.total_s - plain.total_s == pytest.approx(1e-3 * drafted)
