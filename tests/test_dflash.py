"""DFlash block drafts and Domino (models/dflash.py, models/domino.py) on tiny random
targets: the contract, the reduced vocabulary, block position i trained at offset i, no
answer leaking into a block, train/decode parity; and the drafts and helpers the other
DFlash tests share. Decoding: tests/test_dflash_decoding.py; Domino's curriculum, the
training step, the loop and the refusals: tests/test_dflash_training.py."""

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.dflash import DFlashDrafter
from decoding.drafters.domino import DominoDrafter
from decoding.spec import generate
from decoding.tree import TreeSpec
from models import dflash, domino
from models.protocol import DraftOutput
from models.target import TargetOutput
from models.target_loaders import build_tiny_random
from tests.test_spec import make_target, prompt_ids
from train.core.step import StepStats, offset_losses
from train.core.step_stats import decode_samplings
from train.run.setup import step_setup

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
    """The training step's objective and stats (train/core/step.py), as the loop calls it."""
    cfg = cfg or loop_cfg()
    loss_mask = torch.ones_like(ids) if loss_mask is None else loss_mask
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    counts = torch.tensor([float(loss_mask[:, off:].sum()) for off in out.offsets])
    setup = step_setup(cfg, out.offsets, decode_samplings(**cfg.decode))
    stats = StepStats.zeros(len(out.offsets), len(setup.samplings))
    total = offset_losses(out, target_logits, batch, counts, setup, stats)
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
    """Trained through the training step's own pairing (train/core/step_stats.py) on the target's
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
