"""The reduced draft vocabulary shared by EAGLE, DFlash and Domino (models/vocab.py) and its
decoder side (decoding/drafters/vocab.py): the most frequent ids, both checkpoint layouts
and their round trip, the check at build and load (never in a forward), the head rows, and
the draft ids and q mapped back to the target's vocabulary."""

import pytest
import torch
from torch import nn

from decoding.drafters.vocab import full_vocab_q, to_target_ids
from models import dflash, domino, eagle, vocab

torch.set_num_threads(1)
V = 128  # the tiny target's vocabulary


def counts(seed=0):
    return torch.rand(V, generator=torch.Generator().manual_seed(seed))


def holder(layout: str, size: int | None = 16) -> nn.Module:
    """A bare module carrying a vocabulary, as a draft does."""
    module = nn.Module()
    module.target_vocab_size = V
    vocab.attach(module, layout, size, V)
    return module


# -- the mapping as tensors ------------------------------------------------------------------
def test_most_frequent_keeps_the_top_counts_and_eos_ascending():
    c = counts()
    c[5] = 0.0  # EOS never seen: kept anyway
    before = c.clone()
    ids = vocab.most_frequent(c, 16, always_keep=[5])
    assert torch.equal(c, before)  # the caller's counts are left alone
    assert ids.shape == (16,) and bool((ids.diff() > 0).all()) and 5 in ids.tolist()
    others = c.clone()
    others[5] = -1.0
    assert set(ids.tolist()) - {5} == set(others.topk(15).indices.tolist())
    tied = vocab.most_frequent(torch.ones(V), 4)  # ties: the lower ids
    assert tied.tolist() == [0, 1, 2, 3]
    assert vocab.coverage(c, ids) == pytest.approx(float(c[ids].sum() / c.sum()))
    with pytest.raises(ValueError, match="draft vocab size"):
        vocab.most_frequent(c, V + 1)


def test_offsets_round_trip_and_target_to_draft():
    ids = vocab.most_frequent(counts(1), 16)
    d2t, t2d = vocab.to_offsets(ids, V)
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool and t2d.shape == (V,)
    assert torch.equal(torch.arange(16) + d2t, ids)  # EAGLE's offsets: i + d2t[i]
    assert torch.equal(vocab.from_offsets(d2t), ids)
    assert torch.equal(t2d.nonzero()[:, 0], ids)  # t2d marks exactly the draft ids
    assert torch.equal(vocab.to_draft(ids, ids), torch.arange(16))  # draft -> target -> draft
    outside = (~t2d).nonzero()[:5, 0]
    assert vocab.to_draft(outside, ids).tolist() == [-1] * 5
    assert vocab.is_valid(ids, V, t2d)
    assert not vocab.is_valid(ids.flip(0), V)  # not ascending
    assert not vocab.is_valid(ids, int(ids.max()))  # outside the target
    t2d[(~t2d).nonzero()[0, 0]] = True
    assert not vocab.is_valid(ids, V, t2d)  # t2d marks one id too many


def test_head_rows_and_vocab_size_setting():
    weight = torch.randn(V, 8)
    ids = torch.tensor([3, 7, 90])
    assert torch.equal(vocab.head_rows(weight, ids), weight[[3, 7, 90]])
    assert vocab.head_rows(weight, None) is weight
    assert vocab.reduced_size("full", V) is None and vocab.reduced_size(V, V) is None
    assert vocab.reduced_size(48, V) == 48
    for bad in (0, -3, "half", 1.5, True):
        with pytest.raises(ValueError, match="vocab_size"):
            vocab.reduced_size(bad, V)


# -- the mapping on a draft --------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["offsets", "ids"])
def test_built_mapping_saves_under_its_keys_and_reloads(layout):
    built = holder(layout)
    vocab.build(built, counts(2), always_keep=[0])
    ids = vocab.draft_ids(built)
    assert built.vocab_ready and torch.equal(ids, vocab.most_frequent(counts(2), 16, [0]))
    state = built.state_dict()
    assert set(state) == set(vocab.LAYOUTS[layout])  # the checkpoint keys of each kind
    fresh = holder(layout)
    assert not fresh.vocab_ready
    with pytest.raises(ValueError, match="token_counts=prepared.token_counts"):
        vocab.require(fresh)
    fresh.load_state_dict(state)
    assert fresh.vocab_ready and torch.equal(vocab.draft_ids(fresh), ids)
    assert vocab.extras(fresh).keys() == {"vocab_coverage"}
    full = holder(layout, None)
    assert full.vocab_ready and vocab.draft_ids(full) is None and full.state_dict() == {}
    assert vocab.extras(full) == {}
    with pytest.raises(ValueError, match="full vocabulary"):
        vocab.build(full, counts())
    with pytest.raises(ValueError, match="token_counts has 64 entries"):
        vocab.build(holder(layout), counts()[:64])


@pytest.mark.parametrize(
    "layout, key, corrupt",
    [
        ("offsets", "t2d", lambda t: torch.zeros_like(t)),  # t2d disagrees with d2t
        ("offsets", "d2t", lambda t: t + 200),  # maps outside the target
        ("ids", "vocab_ids", lambda t: t.flip(0)),  # not ascending
        ("ids", "vocab_ids", lambda t: torch.full_like(t, -1)),  # the unbuilt placeholder
    ],
)
def test_a_bad_mapping_is_refused_at_load(layout, key, corrupt):
    built = holder(layout)
    vocab.build(built, counts(3))
    state = built.state_dict()
    state[key] = corrupt(state[key])
    keys = "/".join(vocab.LAYOUTS[layout])
    with pytest.raises(ValueError, match=f"no valid {keys} mapping"):
        holder(layout).load_state_dict(state)
    partial = holder(layout)  # a load without the mapping checks nothing: still unbuilt
    partial.load_state_dict({}, strict=False)
    assert not partial.vocab_ready


def test_real_drafts_share_the_mapping_and_check_it_only_at_build_and_load(
    tiny_target, monkeypatch
):
    """EAGLE (offsets) and DFlash / Domino (ids) build the same draft ids from the same
    counts; their forwards read the flag only; a broken checkpoint is refused at load."""
    c = counts(4)[: tiny_target.vocab_size]
    drafts = [
        eagle.from_target(tiny_target, c, ttt_steps=2, vocab_size=32),
        dflash.from_target(tiny_target, c, block_size=3, vocab_size=32),
        domino.from_target(tiny_target, c, block_size=3, vocab_size=32, gru_hidden_size=8,
                           correction_size=8),
    ]  # fmt: skip
    want = vocab.most_frequent(c, 32, tiny_target.eos_token_ids)
    calls = []
    original = vocab.is_valid
    monkeypatch.setattr(vocab, "is_valid", lambda *a: (calls.append(1), original(*a))[1])
    ids = torch.randint(6, tiny_target.vocab_size, (1, 8))
    for draft in drafts:
        assert torch.equal(vocab.draft_ids(draft), want)
        out = tiny_target(ids, hidden_layers=draft.hidden_layers)
        assert torch.equal(draft(tiny_target, ids, out).vocab_ids, want)
        assert not calls  # no check in a forward
        state = draft.state_dict()
        key = vocab.LAYOUTS[draft.vocab_layout][0]
        state[key] = state[key].flip(0)
        with pytest.raises(ValueError, match="no valid"):
            draft.load_state_dict(state)
        assert len(calls) == 1  # one check, at load
        calls.clear()


# -- the decoder side ----------------------------------------------------------------------------
def test_full_vocab_q_puts_q_at_the_draft_ids_and_zero_elsewhere():
    ids = torch.tensor([2, 5, 11, 40])
    q = torch.rand(3, 2, 4, generator=torch.Generator().manual_seed(0)).softmax(-1)
    full = full_vocab_q(q, ids, 64)
    assert full.shape == (3, 2, 64)
    assert torch.equal(full[..., ids], q)  # each draft id's q at its target id
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert float(full[..., outside].abs().max()) == 0.0
    torch.testing.assert_close(full.sum(-1), torch.ones(3, 2))
    assert full_vocab_q(q, None, 64) is q  # the full vocabulary: unchanged
    drafted = torch.tensor([[0, 3], [2, 1]])
    assert to_target_ids(drafted, ids).tolist() == [[2, 40], [11, 5]]
    assert to_target_ids(drafted, None) is drafted
