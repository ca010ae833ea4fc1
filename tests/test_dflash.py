"""DFlash block drafts and Domino (models/dflash.py, models/domino.py) on tiny random
targets: the contract, block position i trained at offset i, no answer leaking into a
block, train/decode parity, lossless greedy and sampled decoding (chains and trees),
Domino's curriculum, the training step at sampled anchors, the loop, the export refusal."""

import json
import math
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from scipy.stats import chi2

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.dflash import DFlashDrafter
from decoding.drafters.domino import DominoDrafter
from decoding.spec import generate
from decoding.tree import TreeSpec
from models import dflash, domino
from models.domino import DominoDraft, base_loss_weight
from models.protocol import DraftOutput
from models.target import TargetOutput
from models.target_loaders import build_tiny_random
from tests.test_spec import N_SINGLE, P_THRESHOLD, exact_triples, g_test, make_target, prompt_ids
from train.export import refuse
from train.export_checks import ExportError
from train.losses import forward_kl
from train.replay import gather_stream
from train.step_stats import offset_losses, stats_size

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
KINDS = ("dflash", "domino")
# The decoding tests run each kind over the target's whole head and over a reduced draft
# vocabulary (48 of the tiny target's 128 ids: draft ids map to target ids, q is scattered
# back to the full vocabulary).
VARIANTS = [pytest.param(k, v, id=f"{k}-{v}") for v in ("full", 48) for k in KINDS]


@pytest.fixture(scope="module")
def target():
    return make_target()  # varied greedy text: an off-by-one shows


def seeded_counts(seed=3):
    """Label counts for a reduced vocabulary: random, so the draft ids are scattered over
    the target's."""
    return torch.rand(128, generator=torch.Generator().manual_seed(seed))


def build(target, kind, seed=0, correction=False, vocab="full", counts=None, **kw):
    """A fresh draft; `correction=True` gives Domino's zero-initialised W2 random values so
    that the correction head shows in what is compared. `vocab`: "full" or a reduced
    vocabulary size, built from `counts` (seeded random counts by default)."""
    torch.manual_seed(seed)
    kw = {"block_size": 5, "num_anchors": None, **kw}
    if vocab != "full":
        kw |= {"vocab_size": vocab, "token_counts": seeded_counts() if counts is None else counts}
    if kind == "dflash":
        return dflash.from_target(target, **kw)
    draft = domino.from_target(target, gru_hidden_size=32, correction_size=32, **kw)
    if correction:
        with torch.no_grad():
            draft.correction[2].weight.normal_(0, 0.3)
    return draft


def block_logits(draft, target, ids, hidden=None):
    """Every position an anchor: logits [B, T-1, P-1, V] (row t = the block after x_0..x_t)."""
    out = target(ids, hidden_layers=draft.hidden_layers)
    if hidden is not None:
        out = TargetOutput(out.logits, hidden, None)
    with torch.no_grad():
        d = draft(target, ids, out)
    assert torch.equal(d.positions, torch.arange(ids.shape[1] - 1).expand(ids.shape[0], -1))
    return torch.stack(d.logits, 2)


def loop_cfg(**train):
    return OmegaConf.create(
        {
            "train": {"offset_decay": 0.8, **train},
            "loss": {"name": "kl", "temperature": 1.0},
            "decode": {"temperatures": [0.0, 0.7], "top_k": 0, "top_p": 1.0},
        }
    )


def step_loss(out, target_logits, ids, loss_mask=None, cfg=None):
    """The training step's objective and stats (train/step_stats.py), as the loop calls it."""
    cfg = cfg or loop_cfg()
    loss_mask = torch.ones_like(ids) if loss_mask is None else loss_mask
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    counts = torch.tensor([float(loss_mask[:, off:].sum()) for off in out.offsets])
    stats = torch.zeros(stats_size(len(out.offsets), 1))
    total = offset_losses(
        out, target_logits, batch, out.offsets, counts, forward_kl, 1.0, cfg, stats
    )
    return total, stats, counts


# -- the contract ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_contract_offsets_weights_anchors_and_state_dict(target, kind):
    draft = build(target, kind, num_anchors=3, gamma=4.0)
    ids = torch.randint(6, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # row 1 right-padded after 12 tokens
    out = draft(target, ids, target(ids, hidden_layers=draft.hidden_layers), mask)
    assert isinstance(out, DraftOutput) and out.offsets == [1, 2, 3, 4]  # block position i
    assert out.offset_weights == pytest.approx([math.exp(-(i - 1) / 4.0) for i in range(1, 5)])
    B, N = out.positions.shape
    assert [tuple(x.shape) for x in out.logits] == [(2, N, 128)] * 4
    real = out.positions[out.positions >= 0]
    assert len(real) == 3 * 2  # num_anchors x rows, drawn over the whole batch
    assert int(out.positions[1].max()) <= 10  # the anchor x_{t+1} is a real token
    for row in out.positions:  # ascending, padding (-1) last
        kept = row[row >= 0]
        assert torch.equal(kept, kept.sort().values) and bool((row[len(kept) :] == -1).all())
    # Every real position gets drawn: uniform over the batch's candidates.
    seen = torch.zeros(2, 19, dtype=torch.bool)
    torch.manual_seed(0)
    for _ in range(200):
        pos = draft.sample_anchors(mask.bool())
        for b in range(2):
            seen[b, pos[b][pos[b] >= 0]] = True
    assert seen[0].all() and seen[1, :11].all() and not seen[1, 11:].any()
    keys = list(draft.state_dict())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)  # frozen: in the target
    assert "mask_embedding" in keys and ("prefix_gru.weight_ih_l0" in keys) == (kind == "domino")
    fresh = build(target, kind, seed=1)
    fresh.load_state_dict(draft.state_dict(), strict=True)


@pytest.mark.parametrize("kind", KINDS)
def test_reduced_vocabulary_is_the_target_heads_rows_saved_and_checked(target, kind):
    """vocab_size=N keeps the N most frequent trained ids (EOS forced in), ascending; the
    block's logits over them equal a full-vocabulary draft's at those ids (same weights,
    Domino's W2 rows scattered: the head is the target's rows, nothing new to train);
    vocab_ids travels in the state dict; a vocabulary never built is refused by training and
    by the drafter, with the fix in the message."""
    counts = seeded_counts()
    draft = build(target, kind, correction=True, vocab=48)
    ids = draft.vocab_ids
    assert ids.shape == (48,) and bool((ids.diff() > 0).all())
    assert set(target.eos_token_ids) <= set(ids.tolist())
    inside = torch.zeros(128, dtype=torch.bool)
    inside[ids] = True
    others = inside.clone()
    others[target.eos_token_ids] = False  # forced in whatever its count
    assert float(counts[others].min()) >= float(counts[~inside].max())
    full = build(target, kind, vocab="full")
    state = {k: v for k, v in draft.state_dict().items() if k != "vocab_ids"}
    if kind == "domino":
        w2 = torch.zeros(128, 32)
        w2[ids] = state["correction.2.weight"]
        state["correction.2.weight"] = w2
    full.load_state_dict(state, strict=True)
    x = torch.randint(6, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    out_t = target(x, hidden_layers=draft.hidden_layers)
    with torch.no_grad():
        reduced, whole = draft(target, x, out_t), full(target, x, out_t)
    assert torch.equal(reduced.vocab_ids, ids) and whole.vocab_ids is None
    for r, w in zip(reduced.logits, whole.logits, strict=True):
        assert r.shape[-1] == 48
        torch.testing.assert_close(r, w[..., ids])
    coverage = float(reduced.extras["vocab_coverage"])
    assert coverage == pytest.approx(float(counts[ids].sum() / counts.sum()))
    # Reload: a draft built without counts has no vocabulary until the state dict brings it.
    sizes = {} if kind == "dflash" else dict(gru_hidden_size=32, correction_size=32)
    module = dflash if kind == "dflash" else domino
    unbuilt = module.from_target(target, block_size=5, num_anchors=None, vocab_size=48, **sizes)
    with pytest.raises(ValueError, match="no valid vocab_ids.*vocab_size=full"):
        make_drafter(unbuilt, target)
    with pytest.raises(ValueError, match="no valid vocab_ids"):
        unbuilt(target, x, out_t)
    unbuilt.load_state_dict(draft.state_dict(), strict=True)
    with torch.no_grad():
        for a, b in zip(unbuilt(target, x, out_t).logits, reduced.logits, strict=True):
            assert torch.equal(a, b)
    for bad in (0, "half", 1.5):
        with pytest.raises(ValueError, match="vocab_size"):
            module.from_target(target, vocab_size=bad, **sizes)
    # The caller's counts are left alone (float64 on the CPU once got EOS's count set to inf).
    counts64 = counts.double()
    module.from_target(target, vocab_size=48, token_counts=counts64, **sizes)
    assert torch.equal(counts64, counts.double())
    other = build_tiny_random(vocab_size=256, device="cpu")  # ids would map to other tokens
    with pytest.raises(ValueError, match="target vocabulary of 128 ids"):
        make_drafter(draft, other)


def test_anchors_sit_on_answer_tokens_when_given_the_loss_mask(target):
    """Given the batch's loss mask (the loop passes it), a block is anchored only where its
    anchor x_{t+1} is an answer token (loss_mask[t] = 1), as decoding anchors its first block
    at the first answer token; every such position is drawn, no other."""
    draft = build(target, "dflash", num_anchors=2)
    ids = torch.randint(6, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # row 1 right-padded
    loss_mask = torch.zeros_like(ids)
    loss_mask[0, 4:9] = 1  # row 0: the answer is x_5..x_9
    loss_mask[1, 9:12] = 1  # row 1: x_10..x_12, then padding
    want = loss_mask[:, :-1].bool()
    seen = torch.zeros(2, 15, dtype=torch.bool)
    torch.manual_seed(0)
    for _ in range(100):
        pos = draft.sample_anchors(mask.bool(), loss_mask)
        assert int((pos >= 0).sum()) == 4  # num_anchors x rows, from 8 candidates
        for b in range(2):
            seen[b, pos[b][pos[b] >= 0]] = True
    assert torch.equal(seen, want)
    out_t = target(ids, hidden_layers=draft.hidden_layers)
    out = draft(target, ids, out_t, mask, loss_mask=loss_mask)
    real = out.positions[out.positions >= 0]
    assert len(real) == 4 and bool(loss_mask.gather(1, out.positions.clamp_min(0))[
        out.positions >= 0].all())  # fmt: skip
    with pytest.raises(ValueError, match="does not match input_ids"):
        draft(target, ids, out_t, mask, loss_mask=loss_mask[:, 1:])


# -- block position i is trained at offset i --------------------------------------------------
@pytest.mark.parametrize("kind,vocab", VARIANTS)
def test_block_position_i_learns_the_token_at_offset_i_and_decodes_it(target, kind, vocab):
    """Trained through the training step's own pairing (train/step_stats.py) on the target's
    greedy continuation of one prompt, block position i at anchor t must give the target's
    argmax at position t + i (= x_{t+1+i}); an off-by-one anywhere (offsets, anchor, the
    context it reads) teaches the neighbour token instead. Then the drafter decodes the same
    text back with tau near block_size, as a chain and as a dynamic tree (with a reduced
    vocabulary: only if every draft id is mapped back to its target id, parents included)."""
    P = 5
    prompt = prompt_ids(target, "hello there")
    cont = generate(target, prompt, None, max_new_tokens=40, eos_token_ids=[]).sequences[0]
    ids = torch.cat([prompt, torch.tensor([cont])], 1)  # [1, T]
    assert len(set(cont)) >= 10  # varied text: the neighbour token is a different one
    counts = torch.bincount(ids.flatten(), minlength=128).float()  # the vocab covers the text
    draft = build(target, kind, block_size=P, vocab=vocab, counts=counts)
    out_t = target(ids, hidden_layers=draft.hidden_layers)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(250):
        loss, _, _ = step_loss(draft(target, ids, out_t), out_t.logits, ids)
        opt.zero_grad()
        loss.backward()
        opt.step()
    greedy = out_t.logits.argmax(-1)[0]  # [T]: the target's next token after each position
    logits = block_logits(draft.eval(), target, ids)[0]  # [T-1, P-1, V_draft]
    to_target = torch.arange(128) if draft.vocab_ids is None else draft.vocab_ids
    start = prompt.shape[1] - 1  # anchors in the continuation
    for i in range(1, P):
        t = torch.arange(start, ids.shape[1] - i)
        hit = (to_target[logits[t, i - 1].argmax(-1)] == greedy[t + i]).float().mean()
        assert hit >= 0.9, f"block position {i}: {hit:.2f}"
    res = generate(target, prompt, make_drafter(draft, target), k=P - 1, max_new_tokens=40,
                   eos_token_ids=[])  # fmt: skip
    assert res.sequences[0] == cont
    assert res.tau >= P - 1, f"tau {res.tau:.2f}"  # a fresh draft: about 1
    tree = TreeSpec(kind="dynamic", depth=P - 1, top_k=2, num_nodes=8)
    res = generate(target, prompt, make_drafter(draft, target), tree=tree, max_new_tokens=40,
                   eos_token_ids=[])  # fmt: skip
    assert res.sequences[0] == cont
    assert res.tau >= P - 1, f"tree tau {res.tau:.2f}"


# -- nothing leaks into a block --------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_a_block_reads_no_later_token_and_no_later_feature(target, kind):
    """The block after x_0..x_t (anchor x_{t+1}) reads target features at positions <= t
    and tokens up to the anchor; DFlash reads no later token at all, Domino's position i
    the teacher-forced x_{t+2}..x_{t+i} and nothing later."""
    draft = build(target, kind, correction=True).eval()
    ids = torch.randint(6, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    t, T, P = 6, 16, draft.block_size
    base = block_logits(draft, target, ids)[0, t]  # [P-1, V]
    hidden = target(ids, hidden_layers=draft.hidden_layers).hidden
    for j in range(t + 2, T):  # a later token: block position i reads it iff t + 1 + i > j
        changed = ids.clone()
        changed[0, j] = (changed[0, j] + 7) % 128
        moved = (block_logits(draft, target, changed, hidden)[0, t] - base).abs().amax(-1)
        for i in range(1, P):
            reads = kind == "domino" and j < t + 1 + i
            assert bool(moved[i - 1] > 1e-4) == reads, (j, i, moved.tolist())
    for j in (t - 1, t, t + 1, t + 2):  # target features: strictly before the anchor t + 1
        bumped = {la: h.clone() for la, h in hidden.items()}
        for h in bumped.values():
            h[0, j] += 1.0
        moved = (block_logits(draft, target, ids, bumped)[0, t] - base).abs().max()
        assert bool(moved > 1e-4) == (j <= t), (j, float(moved))
    anchor = ids.clone()
    anchor[0, t + 1] = (anchor[0, t + 1] + 7) % 128  # the anchor token itself is read
    assert (block_logits(draft, target, anchor, hidden)[0, t] - base).abs().max() > 1e-4


# -- train/decode parity ---------------------------------------------------------------------
@pytest.mark.parametrize("kind,vocab", VARIANTS)
def test_training_blocks_equal_the_drafters_q(target, kind, vocab):
    """Driven as decoding/spec.py drives it (prefill, rounds of propose(k) and commit(n) with
    the target's features over the kept positions), the drafter's q at T = 1 equals the
    training forward's block at the same anchor over the same text (its drafts teacher-forced
    for Domino), at every block position, two rows."""
    draft = build(target, kind, correction=True, vocab=vocab).eval()
    drafter = make_drafter(draft, target)
    assert isinstance(drafter, DominoDrafter if kind == "domino" else DFlashDrafter)
    ids = torch.arange(128) if draft.vocab_ids is None else draft.vocab_ids  # draft id -> target id
    layers, sampling = draft.hidden_layers, Sampling(temperature=1.0)
    gen, rng = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    committed = torch.randint(6, 128, (2, 5), generator=rng)
    last = torch.randint(6, 128, (2,), generator=rng)
    drafter.prefill(committed, target(committed, hidden_layers=layers))
    for k, n in [(4, 1), (2, 0), (4, 4), (3, 2), (1, 1), (4, 3)]:
        drafts, q = drafter.propose(last, k, sampling, gen)  # [B, k], [B, k, V]
        context = torch.cat([committed, last[:, None]], 1)
        t = context.shape[1] - 2  # block after x_0..x_t, anchor x_{t+1} = last
        seq = torch.cat([context, drafts], 1)
        train = block_logits(draft, target, seq)[:, t]  # [B, P-1, V_draft]
        torch.testing.assert_close(
            train[:, :k].log_softmax(-1), q[..., ids].log(), atol=1e-5, rtol=1e-5,
            msg=lambda m, t=t: f"anchor {t}: {m}",
        )  # fmt: skip
        assert q.shape[-1] == 128 and torch.isin(drafts, ids).all()  # target ids, target width
        torch.testing.assert_close(q.sum(-1), torch.ones(2, k))  # nothing outside the vocab
        correction = torch.randint(6, 128, (2,), generator=rng)
        kept = torch.cat([context, drafts[:, :n]], 1)
        out = target(kept, hidden_layers=layers)
        kept_out = TargetOutput(None, {la: h[:, -(n + 1) :] for la, h in out.hidden.items()}, None)
        drafter.commit(n, torch.cat([drafts[:, :n], correction[:, None]], 1), kept_out)
        committed, last = kept, correction


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


# -- Domino's curriculum ---------------------------------------------------------------------
def test_curriculum_weight_goes_from_lambda_start_to_zero(target):
    assert [base_loss_weight(p) for p in (0.0, 0.25, 0.5, 0.75, 1.0)] == [1.0, 0.5, 0.0, 0, 0]
    assert base_loss_weight(0.1, lambda_start=0.8, decay_ratio=0.2) == pytest.approx(0.4)
    draft = build(target, "domino", correction=True)
    assert draft.base_loss_weight == 0.0  # never told its progress: the corrected loss only
    ids = torch.randint(6, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    out_t = target(ids, hidden_layers=draft.hidden_layers)
    assert draft(target, ids, out_t).base_logits is None
    draft.set_progress(0.1)  # the loop calls this before every step
    out = draft(target, ids, out_t)
    assert out.base_loss_weight == pytest.approx(0.8) and len(out.base_logits) == 4
    # The step's loss is (1 - w) * loss(corrected) + w * loss(backbone), position by position.
    blended, _, _ = step_loss(out, out_t.logits, ids)
    plain = DraftOutput(out.logits, out.offsets, positions=out.positions,
                        offset_weights=out.offset_weights)  # fmt: skip
    base = DraftOutput(out.base_logits, out.offsets, positions=out.positions,
                       offset_weights=out.offset_weights)  # fmt: skip
    final_loss = float(step_loss(plain, out_t.logits, ids)[0].detach())
    base_loss = float(step_loss(base, out_t.logits, ids)[0].detach())
    assert base_loss != pytest.approx(final_loss)  # the correction head is not zero
    assert float(blended.detach()) == pytest.approx(0.2 * final_loss + 0.8 * base_loss, rel=1e-5)
    assert draft.eval()(target, ids, out_t).base_logits is None  # evaluation: corrected only


# -- the training step at sampled anchors -----------------------------------------------------
def test_step_at_sampled_anchors_pairs_like_the_dense_layout_and_keeps_means(target):
    draft = build(target, "dflash", gamma=2.0)
    ids = torch.randint(6, 128, (2, 14), generator=torch.Generator().manual_seed(6))
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:] = 1
    out_t = target(ids, hidden_layers=draft.hidden_layers)
    out = draft(target, ids, out_t)  # every position: N = T - 1
    # The same logits laid out densely ([B, T, V], as a Medusa head's) give the same step.
    dense = [torch.cat([x, torch.zeros(2, 1, 128)], 1) for x in out.logits]
    dense_out = DraftOutput(dense, out.offsets, offset_weights=out.offset_weights)
    total, stats, counts = step_loss(out, out_t.logits, ids, loss_mask)
    total_d, stats_d, _ = step_loss(dense_out, out_t.logits, ids, loss_mask)
    torch.testing.assert_close(total, total_d)
    torch.testing.assert_close(stats, stats_d)
    # The draft's position weights exp(-(i-1)/gamma) replace train.offset_decay ** (i-1).
    per_offset = stats[:4] / counts
    want = sum(math.exp(-i / 2.0) * per_offset[i] for i in range(4))
    assert float(total.detach()) == pytest.approx(float(want), rel=1e-5)
    # Sampled anchors: sums are scaled to the micro-batch's trained positions, so a draft
    # that is exactly the target logs alpha = top-1 = 1 (not the sampled share of it).
    few = torch.tensor([[5, 7, 9], [4, 8, -1]])  # 3 and 2 anchors in the trained region
    at = [(few + off).clamp(0, 13)[..., None].expand(-1, -1, 128) for off in out.offsets]
    perfect = DraftOutput([out_t.logits.gather(1, i) for i in at], out.offsets, positions=few)
    _, stats_p, counts_p = step_loss(perfect, out_t.logits, ids, loss_mask)
    torch.testing.assert_close(stats_p[4:8] / counts_p, torch.ones(4))  # alpha
    torch.testing.assert_close(stats_p[8:12] / counts_p, torch.ones(4))  # top-1


@pytest.mark.parametrize("vocab", ["full", 64])
def test_loop_trains_domino_with_its_curriculum(tmp_path, monkeypatch, vocab):
    """Two steps of the real loop on the tiny target (debug experiment): the draft is told
    its progress before each step, the records are finite, the checkpoint reloads (a
    reduced vocabulary built from the data's counts, and reloaded with the checkpoint)."""
    from train.checkpoint import load_draft
    from train.loop import run

    seen, masks = [], []
    original = DominoDraft.set_progress
    monkeypatch.setattr(
        DominoDraft, "set_progress", lambda self, p: (seen.append(p), original(self, p))
    )
    sample = DominoDraft.sample_anchors
    monkeypatch.setattr(
        DominoDraft,
        "sample_anchors",
        lambda self, r, m=None: (masks.append(m), sample(self, r, m))[1],
    )
    run_dir = tmp_path / "run"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "+experiment=debug", f"run_dir={run_dir}", "draft=domino", "decode.k=3",
                "~draft.model.init", "draft.model.block_size=4", "draft.model.num_anchors=8",
                "draft.model.gru_hidden_size=16", "draft.model.correction_size=16",
                f"draft.model.vocab_size={vocab}",
            ],
        )  # fmt: skip
    run(cfg)
    assert seen == [0.0, 0.5]
    # The preflight forward has no loss mask; both training steps pass the batch's.
    assert masks[0] is None and len(masks) == 3 and all(m is not None for m in masks[1:])
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    assert [x["offsets"] for x in train_lines] == [[1, 2, 3]] * 2
    weights = [math.exp(-i / 4.0) for i in range(3)]  # conf gamma 4, not offset_decay 0.8 ** i
    for rec in train_lines:
        assert math.isfinite(rec["loss"]) and all(0.0 <= a <= 1.0 for a in rec["alpha"])
        logged = sum(w * x for w, x in zip(weights, rec["loss_per_offset"], strict=True))
        assert rec["loss"] == pytest.approx(logged, rel=1e-5)
    assert any(x["kind"] == "eval" and x["tau"] >= 1.0 for x in lines)

    tiny = build_tiny_random(device="cpu")
    loaded = load_draft(run_dir / "checkpoints" / "step_00000002", tiny)
    assert isinstance(loaded, DominoDraft) and loaded.block_size == 4
    if vocab == "full":
        assert loaded.vocab_ids is None
    else:  # the run's vocabulary, not the -1 placeholder of a draft built without counts
        assert loaded.vocab_ids.shape == (64,) and bool((loaded.vocab_ids.diff() > 0).all())
        assert set(tiny.eos_token_ids) <= set(loaded.vocab_ids.tolist())
        make_drafter(loaded, tiny)  # passes check_vocab


# -- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["decode.k=8"], r"decode.k=8 but one draft=dflash block drafts at most .* = 7"),
        (["decode=tree_dynamic", "decode.tree.depth=8"], r"decode.tree.depth=8 .* at most"),
        (["decode=tree_static"], "cannot draft decode.tree.kind=static"),
        (["replay.enabled=true"], "set replay.enabled=false"),
        (["draft=domino", "draft.model.block_size=4", "decode.k=4"], "draft=domino block"),
        (
            ["loss=ce", "loss.labels=data"],
            r"draft.model.vocab_size=8192\) cannot .*vocab_size=full",
        ),
    ],
)
def test_startup_checks_refuse_what_a_block_cannot_draft(overrides, message):
    from train.settings import check_settings

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        good = compose("train", overrides=["+experiment=dflash_kl", "decode=tree_dynamic"])
        bad = compose("train", overrides=["+experiment=dflash_kl", *overrides])
    check_settings(good)  # a dynamic tree of depth <= block_size - 1 fits
    with pytest.raises(ValueError, match=message):
        check_settings(bad)


@pytest.mark.parametrize("kind", KINDS)
def test_export_and_replay_refuse_clearly(target, kind):
    draft = build(target, kind)
    with pytest.raises(ExportError, match="not exported"):
        refuse("speculators", draft)
    ids = torch.randint(6, 128, (1, 8))
    out = draft(target, ids, target(ids, hidden_layers=draft.hidden_layers))
    with pytest.raises(ValueError, match="replay.enabled=false"):
        gather_stream(out, torch.zeros(1, 8, 128), {}, "acc")
