"""On-policy replay (train/core/rollouts.py, train/core/replay.py) on the tiny random target: recorded
positions against the decoder and teacher-forced argmaxes, per-stream losses, offset
alignment of head drafts, the buffer, and `replay.enabled=true` end to end for every draft
kind."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from models.draft_lm import DraftLM
from models.protocol import DraftOutput
from models.target import Target
from tests.helpers import (
    PROMPTS,
    TINY_CPU_RUN,
    chat_ids,
    compose_train,
    metrics_records,
    noisy_copy,
    untied_target,
)
from train.core.replay import Replay, make_batch, replay_loss
from train.core.rollouts import ReplayBuffer, Rollout, prompt_prefix, record_rounds, rollout
from train.losses.divergences import LossSpec

GREEDY = Sampling()


def noisy_draft(target: Target, noise: float) -> DraftLM:
    """A draft LM = the target with a noisy head: accepts some drafts, rejects others."""
    return DraftLM(noisy_copy(target.model, noise))


def prompts(target: Target) -> list[list[int]]:
    return [chat_ids(target, t) for t in PROMPTS]


def _check_rollouts_against_teacher_forcing(target, draft, rolls) -> tuple[int, int]:
    """Greedy: an accepted draft is the draft's argmax = the target's argmax at q; a first
    rejected draft is the draft's argmax != the target's, and the row holds the target's."""
    n_acc = n_rej = 0
    for r in rolls:
        ids = torch.tensor([r.input_ids])
        with torch.no_grad():
            t_out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
            out = draft(target, ids, t_out, torch.ones_like(ids))
        t_arg = t_out.logits[0].argmax(-1)  # [T]
        J = len(out.offsets)
        for stream, recs in (("acc", r.accepted), ("rej", r.rejected)):
            for q, i in recs:
                j = min(i - 1, J - 1)
                d_arg = int(out.logits[j][0, q - out.offsets[j]].argmax())
                if q + 1 < len(r.input_ids):
                    assert r.input_ids[q + 1] == int(t_arg[q])  # greedy rollout = target's text
                if stream == "acc":
                    assert d_arg == int(t_arg[q]), (q, i)
                    n_acc += 1
                else:
                    assert d_arg != int(t_arg[q]), (q, i)
                    n_rej += 1
    return n_acc, n_rej


def test_recorded_positions_match_decoder_accept_counts():
    target = untied_target(device="cpu")
    draft = noisy_draft(target, noise=0.6)
    ps = prompts(target)
    rolls = rollout(target, draft, ps, k=4, sampling=GREEDY, max_new_tokens=30, eos_token_ids=[])
    for ids, r in zip(ps, rolls, strict=True):
        # The same rollout through the decoder directly: same rounds, same text.
        res = generate(
            target, torch.tensor([ids]), make_drafter(noisy_draft(target, 0.6), target),
            k=4, max_new_tokens=30, eos_token_ids=[],
        )  # fmt: skip
        assert r.input_ids[len(ids) :] == res.sequences[0][: len(r.input_ids) - len(ids)]
        assert len(r.accepted) == sum(res.accept_counts) == r.num_accepted
        assert len(r.rejected) == sum(
            n < d for n, d in zip(res.accept_counts, res.draft_lens, strict=True)
        )
        assert r.rounds == sum(d > 0 for d in res.draft_lens)
    n_acc, n_rej = _check_rollouts_against_teacher_forcing(target, draft, rolls)
    assert n_acc >= 5 and n_rej >= 5  # both streams really exercised


def test_head_draft_positions_use_the_proposing_offset():
    """Fresh Medusa heads equal the target's head on h_{s-1}, so every draft of a round is
    the round's first token; the teacher-forced check passes only if the rejected and
    accepted positions read head j = i - 1 at the round's anchor t = q - (j + 1)."""
    from models.medusa import from_target

    target = untied_target(seed=1, device="cpu")
    draft = from_target(target, num_heads=3, num_layers=1, head_init="shared")
    rolls = rollout(
        target, copy.deepcopy(draft), prompts(target), k=3, sampling=GREEDY,
        max_new_tokens=24, eos_token_ids=[],
    )  # fmt: skip
    n_acc, n_rej = _check_rollouts_against_teacher_forcing(target, draft, rolls)
    assert n_rej >= 10


def test_record_rounds_positions_and_eos_cut():
    prompt = [5, 6, 7]  # first new token at position 3
    # rounds: 2 of 3 accepted, 3 of 3 accepted, 0 of 2 accepted (k shrinks at the budget)
    new = [10, 11, 12, 13, 14, 15, 16, 17, 18]  # 1 + 3 + 4 + 1 tokens
    r = record_rounds(prompt, new, [2, 3, 0], [3, 3, 2], step=5)
    # (target position q = p - 1 of the draft at p, index i in its round); rounds start
    # at s = 3, 6, 10: drafts at 4-6 (6 rejected), 7-9 (all accepted), 11 (rejected).
    assert r.accepted == [(3, 1), (4, 2), (6, 1), (7, 2), (8, 3)]
    assert r.rejected == [(5, 3), (10, 1)]
    assert r.input_ids == prompt + new[:8]  # cut after the last recorded q
    assert (r.rounds, r.drafted, r.num_accepted, r.step) == (3, 8, 5, 5)
    # EOS at position 7 (inside the second round): drafts after it were never emitted.
    cut = record_rounds(prompt, new[:5], [2, 3, 0], [3, 3, 2])
    assert cut.accepted == [(3, 1), (4, 2), (6, 1)] and cut.rejected == [(5, 3)]
    with pytest.raises(ValueError, match="batch of 1"):
        record_rounds(prompt, new, [2, 1], [3, 3])
    assert prompt_prefix([1, 2, 3, 4, 5], [0, 0, 1, 1, 0]) == [1, 2, 3]
    assert prompt_prefix([1, 2], [0, 0]) is None


def _rollout(q_i_acc, q_i_rej, n_tokens=12, step=0) -> Rollout:
    return Rollout(
        input_ids=list(range(n_tokens)), prompt_len=2, accepted=q_i_acc, rejected=q_i_rej,
        rounds=max(1, len(q_i_rej)), drafted=8, num_accepted=len(q_i_acc), step=step,
    )  # fmt: skip


def test_head_offsets_gather_the_proposing_logits():
    """logits[j][b, t] is marked 1000 j + t: a position (q, i) must read j = min(i-1, J-1)
    at t = q - offsets[j], and the target at q; vocab_ids restricts the target."""
    rolls = [_rollout([(3, 1), (4, 2), (5, 3)], [(6, 4)]), _rollout([(8, 5)], [(9, 1)])]
    batch = make_batch(rolls, num_offsets=3, pad_token_id=0, position_decay=0.5)
    B, T = batch["input_ids"].shape
    offsets = [1, 2, 3]
    logits = [torch.zeros(B, T, 4) for _ in offsets]
    for j in range(3):
        logits[j][..., 0] = 1000 * j + torch.arange(T).float()
    target_logits = torch.zeros(B, T, 6)
    target_logits[..., 2] = torch.arange(T).float()  # read through vocab_ids [2, 0, 1, 5]
    out = DraftOutput(logits=logits, offsets=offsets, vocab_ids=torch.tensor([2, 0, 1, 5]))
    from train.core.replay import gather_stream

    seen = []
    for stream in ("acc", "rej"):
        for d, t, w in gather_stream(out, target_logits, batch, stream):
            for row_d, row_t, wt in zip(d, t, w, strict=True):
                j, t_draft = divmod(int(row_d[0]), 1000)
                q = int(row_t[0])
                seen.append((q, j, t_draft, float(wt)))
    want = {  # (q, j = min(i-1, 2), t = q - offsets[j], weight 0.5^(i-1))
        (3, 0, 2, 1.0), (4, 1, 2, 0.5), (5, 2, 2, 0.25), (6, 2, 3, 0.125),
        (8, 2, 5, 0.0625), (9, 0, 8, 1.0),
    }  # fmt: skip
    assert sorted(seen) == sorted(want)


def test_each_stream_gets_its_configured_loss():
    torch.manual_seed(0)
    rolls = [_rollout([(3, 1), (4, 2)], [(5, 3)]), _rollout([(2, 1)], [(3, 2), (7, 1)])]
    batch = make_batch(rolls, num_offsets=1, pad_token_id=0, position_decay=0.5)
    B, T = batch["input_ids"].shape
    draft_logits = torch.randn(B, T, 16, requires_grad=True)
    target_logits = torch.randn(B, T, 16)
    out = DraftOutput(logits=[draft_logits], offsets=[0])

    def by_hand(acc_name: str, rej_name: str) -> torch.Tensor:
        def kl(b, q):  # KL(p || q)
            p, lq = F.softmax(target_logits[b, q], -1), F.log_softmax(draft_logits[b, q], -1)
            return (p * (p.log() - lq)).sum()

        def tv(b, q):
            p, qq = F.softmax(target_logits[b, q], -1), F.softmax(draft_logits[b, q], -1)
            return 0.5 * (p - qq).abs().sum()

        fns = {"kl": kl, "tv": tv}
        acc = [(0, 3, 1), (0, 4, 2), (1, 2, 1)]  # (row, q, i)
        rej = [(0, 5, 3), (1, 3, 2), (1, 7, 1)]
        total = sum(0.5 ** (i - 1) * fns[acc_name](b, q) for b, q, i in acc)
        total = total + 2.0 * sum(0.5 ** (i - 1) * fns[rej_name](b, q) for b, q, i in rej)
        return total / 6

    kl, tv = (LossSpec.from_settings({"name": n}) for n in ("kl", "tv"))
    loss, acc_sum, rej_sum = replay_loss(out, target_logits, batch, kl, tv, rejected_weight=2.0)
    torch.testing.assert_close(loss, by_hand("kl", "tv"))
    assert not torch.allclose(loss, by_hand("tv", "kl"))  # a swap would be caught
    assert float(acc_sum) > 0 and float(rej_sum) > 0
    loss.backward()
    assert draft_logits.grad[0, 5].abs().sum() > 0 and draft_logits.grad[0, 6].abs().sum() == 0


def test_buffer_capacity_age_out_priority_state():
    buf = ReplayBuffer(capacity=3, max_age=4)
    buf.add([_rollout([(3, 1)], [], step=s) for s in range(5)])
    assert len(buf) == 3 and [r.step for r in buf.items] == [2, 3, 4]  # FIFO
    buf.add([_rollout([], [], step=5)])  # nothing to train on: not stored
    assert [r.step for r in buf.items] == [2, 3, 4]
    buf.age_out(step=7)  # 7 - 2 > 4
    assert [r.step for r in buf.items] == [3, 4]
    assert len(buf.sample(10, torch.Generator().manual_seed(0))) == 2

    pri = ReplayBuffer(capacity=8, priority=True)
    calm = _rollout([(3, 1), (4, 2)], [])  # rejection rate 0 -> weight PRIORITY_FLOOR
    hard = _rollout([], [(3, 1)])  # rejection rate 1
    pri.add([calm, hard])
    g = torch.Generator().manual_seed(0)
    picks = [pri.sample(1, g)[0] is hard for _ in range(200)]
    assert sum(picks) > 170  # expected 200 / 1.05 = 190
    copy_ = ReplayBuffer(capacity=8)
    copy_.load_state_dict(pri.state_dict())
    assert copy_.items == pri.items
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(capacity=0)


KINDS = {
    "draft_lm": ["draft.model.num_layers=1", "draft.model.init=random"],
    "eagle": ["draft.model.ttt_steps=2", "draft.model.vocab_size=64"],
    "medusa": ["draft.model.num_heads=2"],
    "mtp": ["draft.model.num_depths=2"],
}


def _compose(run_dir: Path, *overrides: str):
    return compose_train(
        *TINY_CPU_RUN, "name=replay",
        f"run_dir={run_dir}", "train.steps=4", "train.log_every=2",
        "train.ckpt_every=4", "train.eval_at_ckpt=false", "decode.k=3",
        "replay.enabled=true", "replay.every=2", "replay.num_prompts=2",
        "replay.max_new_tokens=12", "replay.dtype=null", "replay.batch_size=2",
        *overrides,
    )  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_replay_runs_end_to_end_for_every_draft_kind(tmp_path, kind):
    from train.core.checkpoint import load_checkpoint
    from train.loop import run

    run(_compose(tmp_path, f"draft={kind}", *KINDS[kind]))
    recs = metrics_records(tmp_path)
    assert [r["step"] for r in recs] == [2, 4]
    for r in recs:
        assert r["replay/buffer_size"] == (2 if r["step"] == 2 else 4)  # rollouts at 0 and 2
        assert 0 < r["replay/token_share"] < 1 and r["replay/loss_share"] == 0.25
        assert 1.0 <= r["replay/tau"] <= 4.0 and 0 <= r["replay/accept_rate"] <= 1
        assert min(r["replay/loss_accepted"], r["replay/loss_rejected"]) > -1e-5  # rounding
    _, _, state = load_checkpoint(tmp_path / "checkpoints" / "step_00000004")
    assert len(state["replay"][0]["items"]) == 4


def test_replay_resume_repeats_the_uninterrupted_run(tmp_path):
    from train.core.checkpoint import load_checkpoint
    from train.loop import run

    extra = ["replay.every=3", "train.ckpt_every=2", "draft.model.num_layers=1"]
    run(_compose(tmp_path / "a", *extra))
    run(_compose(tmp_path / "b", *extra, "train.steps=2"))
    run(_compose(tmp_path / "b", *extra, "resume=true"))  # buffer restored from step 2
    a, _, _ = load_checkpoint(tmp_path / "a" / "checkpoints" / "step_00000004")
    b, _, _ = load_checkpoint(tmp_path / "b" / "checkpoints" / "step_00000004")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["lk", "lk_alpha", "dspark"])
def test_replay_refuses_losses_that_need_the_full_vocabulary(name):
    """The LK / DSpark losses take alpha over the target's full-vocabulary p and loss.* settings,
    which replay batches do not carry: refused at construction, not silently defaulted."""
    rows = [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}]
    with pytest.raises(ValueError, match=f"replay.accepted_loss='{name}'.*full-vocabulary"):
        Replay(rows, offsets=[1], pad_token_id=0, accepted_loss=name)
    with pytest.raises(ValueError, match=f"replay.rejected_loss='{name}'"):
        Replay(rows, offsets=[1], pad_token_id=0, rejected_loss=name)
    Replay(rows, offsets=[1], pad_token_id=0, accepted_loss="tv", rejected_loss="rkl")  # allowed
