"""Prompt lookup in front of a trained drafter (decoding/drafters/lookup.py): both drafters
draft rounds of one decode, and the decode stays lossless: the target's greedy output token
for token (a draft LM and an EAGLE-3 head behind it, one row and a left-padded batch), and
the target's distribution under sampling (G-test); the same for the hybrid tree (lookup
grafted onto an EAGLE-2 or a Medusa tree, within the tree's size). Bad settings are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.drafters.eagle import EagleDrafter
from decoding.drafters.lookup import LookupDrafter, fewer_nodes, graft, with_lookup
from decoding.drafters.ngram import NgramDrafter
from decoding.spec import generate
from decoding.tree import DraftTree, TreeSpec
from models import medusa
from models.eagle import from_target
from tests.helpers import (
    N_SINGLE,
    NO_EOS,
    P_THRESHOLD,
    PROMPTS,
    compose_train,
    exact_triples,
    g_test,
    hf_greedy,
    left_pad,
    noisy_copy,
    prompt_ids,
    untied_target,
)
from train.run.settings import check_decode


@pytest.fixture(scope="module")
def target():
    return untied_target()


@pytest.fixture(scope="module")
def refs(target):
    return [hf_greedy(target, prompt_ids(target, p), 24, NO_EOS) for p in PROMPTS]


def _eagle(target):
    torch.manual_seed(0)
    counts = torch.randint(
        0, 1000, (target.vocab_size,), generator=torch.Generator().manual_seed(0)
    )
    return from_target(target, counts, style="eagle3", ttt_steps=3, vocab_size=32, init="random")


@pytest.mark.parametrize("base", ["draft_lm", "eagle"])
@pytest.mark.parametrize("min_match", [1, 2])
def test_greedy_equals_the_targets_with_both_drafters_used(target, refs, base, min_match):
    rounds = lookups = 0
    for text, ref in zip(PROMPTS, refs):
        inner = (
            DraftLMDrafter(noisy_copy(target.model, 0.3), target)
            if base == "draft_lm"
            else EagleDrafter(_eagle(target), target)
        )
        drafter = LookupDrafter(inner, min_match=min_match)
        out = generate(
            target, prompt_ids(target, text), drafter, k=3, max_new_tokens=24, eos_token_ids=NO_EOS
        )
        assert out.sequences == [ref]
        rounds, lookups = rounds + drafter.rounds, lookups + drafter.lookup_rounds
    assert 0 < lookups < rounds  # both drafters drafted rounds


def test_padded_batch_greedy_equals_the_targets(target, refs):
    ids, mask = left_pad([prompt_ids(target, p) for p in PROMPTS], target.tokenizer.pad_token_id)
    drafter = LookupDrafter(DraftLMDrafter(noisy_copy(target.model, 0.3), target), min_match=1)
    out = generate(
        target, ids, drafter, k=3, max_new_tokens=24, attention_mask=mask, eos_token_ids=NO_EOS
    )
    assert out.sequences == refs
    assert 0 < drafter.lookup_rounds < drafter.rounds


def test_sampling_follows_the_target_distribution(target):
    """The prompt ends with its own first three tokens, so rounds often find a continuation
    (half of the 400 decodes drafted a lookup round here) and the others draft the draft LM's."""
    sampling = Sampling(temperature=1.0)
    ids = prompt_ids(target, "hello there")
    ids = torch.cat([ids, ids[:, :3]], dim=1)  # [1, T+3]
    table = exact_triples(target, ids, sampling, min_p=5 / N_SINGLE)
    assert len(table) >= 8
    gen = torch.Generator().manual_seed(0)
    base = DraftLMDrafter(noisy_copy(target.model, 0.5), target)
    samples, rounds, lookups = [], 0, 0
    for _ in range(N_SINGLE):
        drafter = LookupDrafter(base, min_match=1)
        out = generate(
            target, ids, drafter, k=2, sampling=sampling, max_new_tokens=4, generator=gen,
            eos_token_ids=NO_EOS,
        )  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        rounds, lookups = rounds + drafter.rounds, lookups + drafter.lookup_rounds
    assert N_SINGLE // 4 <= lookups < rounds  # both drafters drafted the first three tokens
    assert g_test(samples, table) > P_THRESHOLD


def test_a_round_drafts_the_lookups_one_hot_or_exactly_the_base_drafters(target):
    """Round by round: a last token seen before gives what followed its newest occurrence
    with one-hot q, and no draft forward of the base beyond one absorbed step; an unseen
    one gives exactly the base drafter's drafts and q (same generator state)."""
    sampling, V = Sampling(temperature=1.0), target.vocab_size
    ids = torch.tensor([[5, 9, 7, 3, 9, 4, 6]])
    out = target(ids, use_cache=True)  # the prefill the decoder runs
    model = noisy_copy(target.model, 0.3)
    lookup = LookupDrafter(DraftLMDrafter(model, target), min_match=1)
    lookup.prefill(ids, out)
    drafts, q = lookup.propose(torch.tensor([9]), 3, sampling, torch.Generator().manual_seed(1))
    assert drafts.tolist() == [[4, 6, 9]]  # after the newest 9: 4, 6, then the 9 itself
    torch.testing.assert_close(q, torch.nn.functional.one_hot(drafts, V).float())
    assert (lookup.rounds, lookup.lookup_rounds) == (1, 1)
    unseen = next(t for t in range(V) if t not in ids[0].tolist())
    plain = DraftLMDrafter(model, target)
    plain.prefill(ids, out)
    want = plain.propose(torch.tensor([unseen]), 3, sampling, torch.Generator().manual_seed(2))
    lookup = LookupDrafter(DraftLMDrafter(model, target), min_match=1)
    lookup.prefill(ids, out)
    got = lookup.propose(torch.tensor([unseen]), 3, sampling, torch.Generator().manual_seed(2))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (lookup.rounds, lookup.lookup_rounds) == (1, 0)


def test_with_lookup_and_bad_settings(target):
    base = DraftLMDrafter(noisy_copy(target.model, 0.3), target)
    assert with_lookup(base, 0) is base
    assert isinstance(with_lookup(base, 3), LookupDrafter)
    with pytest.raises(ValueError, match="lookup_min_match must be >= 1"):
        LookupDrafter(base, min_match=-1)
    dec = compose_train("+experiment=debug").decode
    for bad in (-1, 1.5, True):
        dec.lookup_min_match = bad
        with pytest.raises(ValueError, match="decode.lookup_min_match must be an integer"):
            check_decode(dec)
    tree = compose_train("+experiment=debug", "decode=tree_dynamic", "decode.lookup_min_match=2")
    check_decode(tree.decode)  # the hybrid tree
    chains_only = LookupDrafter(NgramDrafter(), min_match=1)
    with pytest.raises(ValueError, match="cannot draft trees"):
        chains_only.propose_tree(torch.tensor([1]), TreeSpec(), Sampling())


# -- the hybrid tree: lookup grafted onto the base's tree -------------------------------------
def test_graft_follows_shared_nodes_appends_the_rest_and_pads_rows():
    V = 12
    q = torch.rand(2, 3, V)
    base = DraftTree(
        tokens=torch.tensor([[5, 6, 7], [4, 8, 9]]),
        parents=torch.tensor([[-1, -1, 0], [-1, 0, 0]]),
        q=q,
    )
    # Row 0: 5 is node 0 (followed), then 9 and 3 are new below it; row 1: no continuation.
    got = graft(base, [[5, 9, 3], []])
    assert got.tokens.tolist() == [[5, 6, 7, 9, 3], [4, 8, 9, 4, 4]]
    assert got.parents.tolist() == [[-1, -1, 0, 0, 3], [-1, 0, 0, -1, -1]]
    torch.testing.assert_close(got.q[:, :3], q)  # the base's q unchanged
    torch.testing.assert_close(got.q[:, 3:], F.one_hot(got.tokens[:, 3:], V).float())
    # A continuation that is already a root path adds nothing; greedy (q None) stays None.
    same = graft(DraftTree(base.tokens, base.parents, None), [[5, 7], [4, 9]])
    assert torch.equal(same.tokens, base.tokens) and same.q is None


def test_fewer_nodes_keeps_a_valid_tree_of_that_size():
    dynamic = TreeSpec(kind="dynamic", depth=4, top_k=4, num_nodes=12)
    assert fewer_nodes(dynamic, 3).size == 9 and fewer_nodes(dynamic, 20).size == 1
    static = TreeSpec(paths=((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)))
    assert fewer_nodes(static, 2).paths == ((0,), (1,), (0, 0), (0, 1))


def test_a_hybrid_round_grafts_the_lookup_onto_the_bases_tree(target):
    """One round by hand, a sampled Medusa tree (per-node q): the continuation after the
    newest earlier 9 is a root path of the tree, its new nodes come after the base's with
    one-hot q, the base drafted that many nodes fewer, and an unseen last token gives the
    base's tree unchanged."""
    sampling, V = Sampling(temperature=1.0), target.vocab_size
    ids = torch.tensor([[5, 9, 7, 3, 9, 4, 6]])
    heads = medusa.from_target(target)
    out = target(ids, hidden_layers=make_drafter(heads, target).hidden_layers)  # the prefill
    tree = TreeSpec(paths=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))

    def propose(lookup: bool, last: int, spec: TreeSpec, seed: int):
        drafter = make_drafter(heads, target)
        drafter = LookupDrafter(drafter, min_match=1) if lookup else drafter
        drafter.prefill(ids, out)
        gen = torch.Generator().manual_seed(seed)
        return drafter, drafter.propose_tree(torch.tensor([last]), spec, sampling, gen)

    drafter, got = propose(True, 9, tree, 0)
    _, base = propose(False, 9, fewer_nodes(tree, 3), 0)  # the continuation 4, 6, 9: 3 tokens
    n = base.tokens.shape[1]
    assert n == 2 and torch.equal(got.tokens[:, :n], base.tokens)  # the base's nodes first
    torch.testing.assert_close(got.q[:, :n], base.q)
    torch.testing.assert_close(got.q[:, n:], F.one_hot(got.tokens[:, n:], V).float())
    parents, tokens = got.parents[0].tolist(), got.tokens[0].tolist()
    node, path = len(tokens) - 1, []  # the deepest node is the continuation's last
    while node >= 0:
        path.insert(0, tokens[node])
        node = parents[node]
    assert path == [4, 6, 9] and len(tokens) <= tree.size
    assert (drafter.rounds, drafter.lookup_rounds) == (1, 1)
    unseen = next(t for t in range(V) if t not in ids[0].tolist())
    drafter, got = propose(True, unseen, tree, 1)
    _, want = propose(False, unseen, tree, 1)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.q, want.q)
    assert (drafter.rounds, drafter.lookup_rounds) == (1, 0)


@pytest.mark.parametrize("base", ["eagle_dynamic", "medusa_static"])
def test_hybrid_tree_greedy_equals_the_targets_within_the_tree_size(target, refs, base):
    """Left-padded batch: every row's output is the target's greedy one, lookup grafted nodes
    in some rounds and not in others, and no round verified more than the tree's size."""
    if base == "eagle_dynamic":
        inner = EagleDrafter(_eagle(target), target)
        tree = TreeSpec(kind="dynamic", depth=3, top_k=3, num_nodes=8)
    else:
        inner = make_drafter(medusa.from_target(target), target)
        tree = TreeSpec(paths=((0,), (1,), (0, 0), (1, 0), (0, 0, 0)))
    ids, mask = left_pad([prompt_ids(target, p) for p in PROMPTS], target.tokenizer.pad_token_id)
    drafter = LookupDrafter(inner, min_match=1)
    out = generate(
        target, ids, drafter, tree=tree, max_new_tokens=24, attention_mask=mask,
        eos_token_ids=NO_EOS,
    )  # fmt: skip
    assert out.sequences == refs
    assert 0 < drafter.lookup_rounds < drafter.rounds
    assert max(out.tree_sizes) <= tree.size


@pytest.mark.parametrize("base", ["eagle_dynamic", "medusa_static"])
def test_hybrid_tree_sampling_follows_the_target_distribution(target, base):
    """As the chain's G-test, with an EAGLE-2 tree (deterministic nodes) or a sampled Medusa
    tree (per-node q, one-hot rows appended) that lookup grafts onto."""
    sampling = Sampling(temperature=1.0)
    ids = prompt_ids(target, "hello there")
    ids = torch.cat([ids, ids[:, :3]], dim=1)  # [1, T+3]
    table = exact_triples(target, ids, sampling, min_p=5 / N_SINGLE)
    gen = torch.Generator().manual_seed(0)
    if base == "eagle_dynamic":
        inner = EagleDrafter(_eagle(target), target)
        tree = TreeSpec(kind="dynamic", depth=2, top_k=2, num_nodes=4)
    else:
        inner = make_drafter(medusa.from_target(target), target)
        tree = TreeSpec(paths=((0,), (1,), (0, 0), (1, 0)))
    samples, rounds, lookups = [], 0, 0
    for _ in range(N_SINGLE):
        drafter = LookupDrafter(inner, min_match=1)
        out = generate(
            target, ids, drafter, tree=tree, sampling=sampling, max_new_tokens=4, generator=gen,
            eos_token_ids=NO_EOS,
        )  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        rounds, lookups = rounds + drafter.rounds, lookups + drafter.lookup_rounds
    assert N_SINGLE // 4 <= lookups < rounds
    assert g_test(samples, table) > P_THRESHOLD
