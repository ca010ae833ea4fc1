"""DFlash and Domino decoding (decoding/drafters/dflash.py, decoding/drafters/domino.py) on
tiny random targets: lossless greedy decoding (chains, trees, left-padded batches), each
draft drawn from the q it returns, and sampled decoding that matches the target's
distribution. Drafts and helpers: tests/test_dflash.py."""

import pytest
import torch
from scipy.stats import chi2

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from decoding.tree import TreeSpec
from models.target import TargetOutput
from tests.test_dflash import KINDS, VARIANTS, build, step_loss
from tests.test_spec import N_SINGLE, P_THRESHOLD, exact_triples, g_test, make_target, prompt_ids

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return make_target()  # varied greedy text: an off-by-one shows


# -- lossless decoding -----------------------------------------------------------------------
@pytest.mark.parametrize("kind,vocab", VARIANTS)
def test_greedy_equals_target_greedy_chains_and_trees(target, kind, vocab):
    draft = build(target, kind, correction=True, vocab=vocab)
    drafter = make_drafter(draft, target)
    ids = prompt_ids(target, "write a poem about the sea")
    ar = generate(target, ids, None, max_new_tokens=24, eos_token_ids=[])
    for k in (3, 9):  # 9 > block_size - 1: one block drafts 4
        spec = generate(target, ids, drafter, k=k, max_new_tokens=24, eos_token_ids=[])
        assert spec.sequences == ar.sequences and max(spec.draft_lens) <= 4
    tree = TreeSpec(kind="dynamic", depth=3, top_k=3, num_nodes=8)
    spec = generate(target, ids, drafter, tree=tree, max_new_tokens=24, eos_token_ids=[])
    assert spec.sequences == ar.sequences
    # Left-padded batch: row 1 a shorter prompt.
    short = prompt_ids(target, "hi")
    batch = torch.zeros(2, ids.shape[1], dtype=torch.long)
    batch[0], batch[1, -short.shape[1] :] = ids[0], short[0]
    mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - short.shape[1]).long().expand(2, -1)
    mask = torch.stack([torch.ones_like(mask[0]), mask[1]])
    ar_b = generate(target, batch, None, max_new_tokens=16, attention_mask=mask, eos_token_ids=[])
    for tree_b in (None, tree):
        spec_b = generate(
            target, batch, drafter, k=4, tree=tree_b, max_new_tokens=16, attention_mask=mask,
            eos_token_ids=[],
        )  # fmt: skip
        assert spec_b.sequences == ar_b.sequences
    with pytest.raises(ValueError, match="dynamic trees"):
        drafter.prefill(ids, target(ids, hidden_layers=draft.hidden_layers))
        drafter.propose_tree(ids[:, -1], TreeSpec(kind="static"), Sampling())


@pytest.mark.parametrize("kind", KINDS)
def test_a_left_padded_row_drafts_as_if_alone(target, kind):
    """decoding/spec.py pads prompts left: a padded row's context positions count real tokens
    only and its padding is never context (garbage there changes nothing), so given the same
    target features it drafts exactly what it drafts alone, round after round."""
    draft = build(target, kind, correction=True).eval()
    long, short = prompt_ids(target, "write a poem about the sea"), prompt_ids(target, "hi")
    pad = long.shape[1] - short.shape[1]
    batch = torch.cat([long, torch.cat([torch.zeros(1, pad, dtype=torch.long), short], 1)])
    mask = torch.ones_like(batch)
    mask[1, :pad] = 0
    layers, sampling = draft.hidden_layers, Sampling(temperature=1.0)
    both, alone = make_drafter(draft, target), make_drafter(draft, target)
    # The same features for the row as when alone, and loud garbage in its padding slots.
    own, first = target(short, hidden_layers=layers), target(long, hidden_layers=layers)
    garbage = 1e3 * torch.randn(1, pad, target.hidden_size, generator=torch.Generator())
    hidden = {
        la: torch.cat([first.hidden[la], torch.cat([garbage, own.hidden[la]], 1)]) for la in layers
    }
    both.prefill(batch, TargetOutput(None, hidden, None), mask)
    alone.prefill(short, own)
    last, seq = torch.tensor([70, 71]), short
    for n in (2, 1):
        drafts, q = both.propose(last, 4, sampling, torch.Generator().manual_seed(0))
        _, q_alone = alone.propose(last[1:], 4, sampling, torch.Generator().manual_seed(0))
        # (Domino's q_2.. follow the drafts, which differ between the two generators.)
        same = 4 if kind == "dflash" else 1
        torch.testing.assert_close(q[1:, :same], q_alone[:, :same], atol=1e-6, rtol=1e-6)
        emitted = torch.cat([drafts[:, :n], torch.tensor([[72], [72]])], 1)  # n drafts + 1
        seq = torch.cat([seq, last[1:, None], drafts[1:, :n]], 1)
        out = target(seq, hidden_layers=layers)
        kept = TargetOutput(
            None, {la: h[:, -(n + 1) :].expand(2, -1, -1) for la, h in out.hidden.items()}, None
        )
        kept_alone = TargetOutput(
            None, {la: h[:, -(n + 1) :] for la, h in out.hidden.items()}, None
        )
        both.commit(n, emitted, kept)
        alone.commit(n, emitted[1:], kept_alone)
        last = torch.tensor([72, 72])


@pytest.mark.parametrize("kind,vocab", VARIANTS)
def test_each_draft_is_drawn_from_the_q_it_returns(target, kind, vocab):
    """Verification is lossless only if draft i was drawn from the q_i returned with it
    (given the drafts before it). 4000 identical rows draft at once: among the rows that
    drafted the same d_1..d_{i-1}, q_i is one distribution, and d_i's counts must fit it."""
    drafter = make_drafter(build(target, kind, correction=True, vocab=vocab), target)
    ids = prompt_ids(target, "hello there").expand(4000, -1)
    drafter.prefill(ids, target(ids, hidden_layers=drafter.hidden_layers))
    sampling = Sampling(temperature=2.0, top_p=0.95)  # a fresh draft is peaked: spread it
    gen = torch.Generator().manual_seed(0)
    tokens, q = drafter.propose(torch.full((4000,), 70), 2, sampling, gen)  # [R, 2], [R, 2, V]
    for i in range(2):
        same = torch.ones(4000, dtype=torch.bool)  # rows sharing the most frequent d_1
        if i == 1:
            same = tokens[:, 0] == tokens[:, 0].mode().values
        ref = q[same, i][0]
        torch.testing.assert_close(q[same, i], ref.expand(int(same.sum()), -1))
        expected = ref * int(same.sum())
        bins = expected >= 5
        observed = torch.bincount(tokens[same, i], minlength=128).float()
        obs = torch.cat([observed[bins], observed[~bins].sum()[None]])
        exp = torch.cat([expected[bins], expected[~bins].sum()[None]])
        assert int(same.sum()) >= 500 and int(bins.sum()) >= 3
        assert chi2.sf(float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum()), len(obs) - 1) > 1e-3


@pytest.fixture(scope="module")
def close_drafts(target):
    """One draft of each kind trained through the training step (KL) on the target's own
    sampled continuations of the sampling test's prompt: close enough that rounds accept 0,
    1 and 2 drafts."""
    ids = prompt_ids(target, "hello there")
    rows = generate(
        target, ids.expand(8, -1), None, sampling=Sampling(temperature=1.0), max_new_tokens=6,
        generator=torch.Generator().manual_seed(1), eos_token_ids=[],
    ).sequences  # fmt: skip
    seqs = torch.cat([ids.expand(8, -1), torch.tensor(rows)], 1)  # [8, T]
    loss_mask = torch.zeros_like(seqs)
    loss_mask[:, ids.shape[1] - 1 :] = 1  # the positions that predict the continuation
    out_t = target(seqs, hidden_layers=build(target, "dflash").hidden_layers)
    counts = torch.bincount(seqs.flatten(), minlength=128).float()  # the vocab covers the text
    drafts = {}
    for kind, vocab in [(k, v) for v in ("full", 48) for k in KINDS]:
        draft = build(target, kind, vocab=vocab, counts=counts)
        opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
        for _ in range(60):
            loss, _, _ = step_loss(draft(target, seqs, out_t), out_t.logits, seqs, loss_mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
        drafts[kind, vocab] = draft.eval()
    return drafts


@pytest.mark.parametrize("kind,vocab", VARIANTS)
def test_sampling_matches_target_distribution(target, close_drafts, kind, vocab):
    """G-test of the first three tokens against the exact distribution (tests/test_spec.py),
    one row per call: rounds accept 0, 1 or 2 drafts."""
    sampling = Sampling(temperature=1.0)
    ids = prompt_ids(target, "hello there")
    table = exact_triples(target, ids, sampling, min_p=5 / N_SINGLE)
    drafter = make_drafter(close_drafts[kind, vocab], target)
    gen = torch.Generator().manual_seed(0)
    samples, accepts = [], []
    for _ in range(N_SINGLE):
        out = generate(target, ids, drafter, k=2, sampling=sampling, max_new_tokens=4,
                       generator=gen, eos_token_ids=[])  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        accepts.append(out.accept_counts[0])
    assert {0, 1, 2} <= set(accepts), set(accepts)  # every acceptance path was exercised
    assert g_test(samples, table) > P_THRESHOLD


# -- the context cache -----------------------------------------------------------------------
def recomputing(drafter):
    """The same drafter without a cache across rounds: before every block forward it drops
    its context keys and values and computes them anew from all the context it was given
    (the prefill's and every commit's)."""
    seen, prefill, commit, block = [], drafter.prefill, drafter.commit, drafter._block

    def prefill_(input_ids, target_out, attention_mask=None):
        prefill(input_ids, target_out, attention_mask)
        seen[:] = [drafter.pending]

    def commit_(num_accepted, emitted, target_out):
        commit(num_accepted, emitted, target_out)
        seen.append(drafter.pending)

    def block_(last_tokens, call):
        drafter.kv, drafter.length, drafter.pending = None, 0, torch.cat(seen, 1)
        return block(last_tokens, call)

    drafter.prefill, drafter.commit, drafter._block = prefill_, commit_, block_
    return drafter


def proposals(drafter) -> list:
    """Records what every propose returns: (tokens, q)."""
    out, propose = [], drafter.propose

    def propose_(*args, **kwargs):
        out.append(propose(*args, **kwargs))
        return out[-1]

    drafter.propose = propose_
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_the_cached_context_drafts_what_recomputing_it_drafts(target, kind):
    """The drafter writes each verified position's context keys and values once into buffers
    that double when full (no per-round concatenation of the whole context): over a long
    generation (~300 cached positions, several doublings) its proposals equal those of a
    drafter that recomputes the whole context every round, greedy, sampled and as trees: the
    same tokens, and q within float32 rounding (a projection over the whole context and one
    over the new rows may round the same row differently)."""
    draft = build(target, kind, correction=True)
    ids = prompt_ids(target, "write a poem about the sea")
    tree = TreeSpec(kind="dynamic", depth=3, top_k=2, num_nodes=5)
    cases = ((Sampling(), None), (Sampling(temperature=1.0), None), (Sampling(), tree))
    for sampling, shape in cases:
        cached, fresh = make_drafter(draft, target), recomputing(make_drafter(draft, target))
        logs = proposals(cached), proposals(fresh)
        runs = [
            generate(target, ids, d, k=4, sampling=sampling, tree=shape, max_new_tokens=280,
                     eos_token_ids=[], generator=torch.Generator().manual_seed(5))
            for d in (cached, fresh)
        ]  # fmt: skip
        assert runs[0].sequences == runs[1].sequences
        assert runs[0].accept_counts == runs[1].accept_counts
        for (tokens, q), (tokens_r, q_r) in zip(*logs, strict=True):
            assert torch.equal(tokens, tokens_r)
            if q is not None or q_r is not None:  # a matmul over more rows may round differently
                torch.testing.assert_close(q, q_r, rtol=1e-5, atol=1e-7)
        assert cached.length > 280 and cached.kv[0][0].shape[2] < 2 * cached.length
