"""On-policy replay of the draft's own rollouts (Draft-OPD style), for every draft kind.

Every `every` optimizer steps the current draft decodes training prompts in the shared
decoder; train/core/rollouts.py records the accepted and first-rejected positions of each round
and keeps the rollouts in a buffer. Here a replay batch of them is trained on: the frozen
target recomputes its distribution at the recorded positions (the batch goes through the
same target forward as offline data, which head drafts need anyway for their features).

Which draft logits are trained at a replay position (one offset per position):
  draft token i of a round comes from the draft's offset index j = min(i - 1, J - 1)
  (J = len(DraftOutput.offsets)) at draft position t = q - offsets[j], so by the
  protocol's alignment `logits[j][:, t]` pairs with the target at q. This is exactly
  what proposed the token at decode time:
    draft LM (offsets [0]): j = 0, t = q; it re-reads its own accepted drafts, which are
      the sequence's tokens, so teacher forcing on the rollout is the rollout.
    Medusa head j / MTP depth j+1 / EAGLE unroll step j (offsets 1..J): all read the
      target feature at the round's anchor t = s - 1 (s = position of the round's first
      token) and the accepted tokens after it: t = q - (j + 1) = s - 1.
  Drafts past the last offset (MTP recursive_last, EAGLE unrolled beyond ttt_steps) use
  the last offset at its own anchor: the teacher-forced version of the recursive step.

Losses: `accepted_loss` (default forward KL) on accepted positions, `rejected_loss`
(default reverse KL) on first-rejected positions, any of train.losses.divergences.LOSSES ("ce" =
the target's argmax as label), weighted by position_decay ** (i - 1), the rejected
stream by `rejected_weight`, normalised by the replay batch's position count. The step's
loss is (1 - ratio) * offline + ratio * replay once the buffer holds a rollout. Auxiliary
losses (EAGLE-1 feature regression, Medusa-2's LM loss) stay on the offline stream.

Several processes: every rank rolls out its own prompts (rows r, r + W, ...), keeps its
own buffer and trains on it; DDP averages the gradients. Buffers are saved per rank in
the checkpoint, and all sampling uses generators seeded by (seed, step, rank), so a
resumed run repeats the uninterrupted one.
"""

from __future__ import annotations

import copy
import time
from contextlib import nullcontext

import torch
from torch import Tensor

from decoding.drafter import Sampling
from models.dtype_choice import choose_dtype, time_forward
from models.dtypes import draft_decode_copy, resolve_dtype
from models.protocol import DraftOutput
from models.target import Target, decode_copy
from train.core.rollouts import ReplayBuffer, Rollout, prompt_prefix, rollout
from train.losses.divergences import LOSSES, LossSpec


def make_batch(
    rollouts: list[Rollout],
    num_offsets: int,
    pad_token_id: int,
    position_decay: float = 1.0,
) -> dict[str, Tensor]:
    """Right-padded input_ids/attention_mask [B, T], and per stream ("acc", "rej") the
    trained positions as flat index tensors [M]: row, target position q, offset index j
    (= min(i - 1, num_offsets - 1)) and weight position_decay ** (i - 1)."""
    T = max(len(r.input_ids) for r in rollouts)
    ids = torch.full((len(rollouts), T), pad_token_id, dtype=torch.long)
    attn = torch.zeros(len(rollouts), T, dtype=torch.long)
    batch = {"input_ids": ids, "attention_mask": attn}
    for b, r in enumerate(rollouts):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids)
        attn[b, : len(r.input_ids)] = 1
    for stream in ("acc", "rej"):
        recs = [
            (b, q, i)
            for b, r in enumerate(rollouts)
            for q, i in (r.accepted if stream == "acc" else r.rejected)
        ]
        cols = torch.tensor(recs, dtype=torch.long).reshape(-1, 3)  # [M, 3]: row, q, i
        b_idx, q_idx, i_idx = cols.unbind(-1)
        batch[f"{stream}_row"] = b_idx
        batch[f"{stream}_pos"] = q_idx
        batch[f"{stream}_off"] = (i_idx - 1).clamp_max(num_offsets - 1)
        batch[f"{stream}_weight"] = position_decay ** (i_idx - 1).float()
    return batch


def gather_stream(
    out: DraftOutput, target_logits: Tensor, batch: dict[str, Tensor], stream: str
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Per offset index j with positions in `stream`: (draft rows [m, Vd], target rows
    [m, Vd] (restricted to vocab_ids), weights [m]); logits[j] at t = q - offsets[j]."""
    if out.positions is not None:
        raise ValueError(
            "on-policy replay trains the draft at the rolled-out positions, but this draft "
            "returns logits at its own sampled anchors only (DFlash / Domino); set "
            "replay.enabled=false"
        )
    rows, pos = batch[f"{stream}_row"], batch[f"{stream}_pos"]
    off_idx, weight = batch[f"{stream}_off"], batch[f"{stream}_weight"]
    groups = []
    for j, (logits, off) in enumerate(zip(out.logits, out.offsets, strict=True)):
        sel = off_idx == j
        if not bool(sel.any()):
            continue
        r, q = rows[sel].to(logits.device), pos[sel].to(logits.device)
        d = logits[r, q - off].float()  # [m, Vd]
        t = target_logits[r, q]  # [m, V]
        if out.vocab_ids is not None:
            t = t.index_select(-1, out.vocab_ids.to(t.device))  # [m, Vd]
        groups.append((d, t, weight[sel].to(logits.device)))
    return groups


def stream_loss_sum(loss: LossSpec, groups: list[tuple[Tensor, Tensor, Tensor]]) -> Tensor | None:
    """sum over positions of weight * loss (losses take a 0/1 mask: one call per weight)."""
    total = None
    for d, t, w in groups:
        for value in torch.unique(w).tolist():
            sel = w == value
            ones = torch.ones(int(sel.sum()), device=d.device)
            part = value * loss.sum(d[sel], t[sel], ones)
            total = part if total is None else total + part
    return total


def replay_loss(
    out: DraftOutput,
    target_logits: Tensor,  # [B, T, V]
    batch: dict[str, Tensor],
    accepted: LossSpec,
    rejected: LossSpec,
    rejected_weight: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """(accepted_sum + rejected_weight * rejected_sum) / positions, and the two stream sums
    (detached) for logging. Each sum is over weighted positions of its own stream."""
    acc = stream_loss_sum(accepted, gather_stream(out, target_logits, batch, "acc"))
    rej = stream_loss_sum(rejected, gather_stream(out, target_logits, batch, "rej"))
    n = len(batch["acc_pos"]) + len(batch["rej_pos"])
    loss = out.logits[0].sum() * 0.0  # keeps the graph connected when a stream is empty
    zero = loss.detach()
    acc = zero if acc is None else acc
    rej = zero if rej is None else rej
    loss = loss + (acc + rejected_weight * rej) / max(n, 1)
    return loss, acc.detach(), rej.detach()


def _replay_loss(key: str, name: str, temperature: float) -> LossSpec:
    """replay.accepted_loss / rejected_loss as a LossSpec at the loss temperature. A loss
    whose alpha needs the target's full-vocabulary distribution (`full_vocab_alpha`) is
    refused: a replay batch gathers the target at the draft's ids only."""
    if name not in LOSSES:
        raise ValueError(f"replay.{key}={name!r} is not one of {sorted(LOSSES)}")
    spec = LossSpec.from_settings({"name": name, "temperature": temperature})
    if spec.loss.full_vocab_alpha:
        raise ValueError(
            f"replay.{key}={name!r}: this loss computes alpha over the target's "
            "full-vocabulary distribution, which a replay batch does not carry; use a loss "
            "without it (kl, rkl, tv or ce) for replay"
        )
    return spec


class Replay:
    """Rollouts every `every` steps, the buffer, and the replay share of each step's loss."""

    def __init__(
        self,
        train_rows,  # sequence of {"input_ids", "loss_mask"} (PreparedData.train)
        *,
        offsets: list[int],
        pad_token_id: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        loss_temperature: float = 1.0,
        every: int = 10,
        ratio: float = 0.25,
        batch_size: int = 4,
        capacity: int = 64,
        max_age: int | None = None,
        priority: bool = False,
        accepted_loss: str = "kl",
        rejected_loss: str = "rkl",
        rejected_weight: float = 1.0,
        position_decay: float = 1.0,
        num_prompts: int = 4,
        k: int = 4,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        dtype: str | None = None,
    ):
        self.accepted, self.rejected = (
            _replay_loss(name, value, loss_temperature)
            for name, value in (("accepted_loss", accepted_loss), ("rejected_loss", rejected_loss))
        )
        if not 0.0 <= ratio < 1.0:
            raise ValueError(
                f"replay.ratio is the replay share of the loss, in [0, 1); got {ratio}"
            )
        if every < 1 or num_prompts < 1 or batch_size < 1:
            raise ValueError(
                f"replay.every ({every}), replay.num_prompts ({num_prompts}) and "
                f"replay.batch_size ({batch_size}) must be >= 1"
            )
        prompts = [prompt_prefix(r["input_ids"], r["loss_mask"]) for r in train_rows]
        prompts = [p for i, p in enumerate(prompts) if p is not None and i % world_size == rank]
        if not prompts:
            raise ValueError("replay needs training rows with a trained (assistant) part")
        self.prompts, self.offsets, self.pad_token_id = prompts, list(offsets), pad_token_id
        self.seed, self.rank = seed, rank
        self.every, self.ratio = every, ratio
        self.batch_size, self.num_prompts, self.k = batch_size, num_prompts, k
        self.max_new_tokens, self.dtype = max_new_tokens, dtype
        self.rejected_weight, self.position_decay = rejected_weight, position_decay
        self.sampling = Sampling(temperature=temperature, top_p=top_p)
        self.buffer = ReplayBuffer(capacity, max_age, priority)
        self._target_copy: Target | None = None
        self._reset_window()

    def _reset_window(self) -> None:
        keys = ("rounds", "accepted", "drafted", "rollout_s", "acc_loss", "rej_loss")
        keys += ("n_acc", "n_rej", "offline", "steps", "weight")
        self.win = dict.fromkeys(keys, 0.0)

    def _generator(self, step: int, salt: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            ((self.seed * 1_000_003 + step) * 31 + salt) * 64 + self.rank
        )

    def _rollout_models(self, target: Target, draft: torch.nn.Module):
        """The target (a copy only when the dtype differs) and a COPY of the draft, in the
        rollout dtype with float32 rotary frequencies (train/eval/plan.py): drafters may
        freeze or convert the module they wrap (DraftLMDrafter sets requires_grad=False),
        which must not touch the trained one."""
        if self.dtype is None:
            return target, copy.deepcopy(draft).eval()
        if self.dtype == "auto":  # the faster verify of k + 1 tokens here, decided once
            cached = 32 * round((64 + self.max_new_tokens / 2) / 32)
            shapes = {"target": target.name, "rows": 1, "new": self.k + 1, "cached": cached}
            measure = lambda dt: time_forward(target, dt, 1, self.k + 1, cached)  # noqa: E731
            self.dtype = choose_dtype("replay", "auto", shapes, measure, target.device).dtype
        dtype = resolve_dtype(self.dtype)
        if target.dtype != dtype:
            if self._target_copy is None:  # frozen: one copy for the whole run
                self._target_copy = decode_copy(target, dtype)
            target = self._target_copy
        return target, draft_decode_copy(draft, dtype)

    def maybe_rollout(self, step: int, target: Target, draft: torch.nn.Module) -> None:
        """Every `every` steps (step 0 included): decode num_prompts training prompts."""
        self.buffer.age_out(step)
        if step % self.every:
            return
        t0 = time.perf_counter()
        g = self._generator(step, 1)
        pick = torch.randperm(len(self.prompts), generator=g)[: self.num_prompts].tolist()
        r_target, r_draft = self._rollout_models(target, draft)
        rollouts = rollout(
            r_target,
            r_draft,
            [self.prompts[i] for i in pick],
            k=self.k,
            sampling=self.sampling,
            max_new_tokens=self.max_new_tokens,
            generator=torch.Generator(device=r_target.device).manual_seed(g.initial_seed()),
            step=step,
        )
        del r_draft
        self.buffer.add(rollouts)
        self.win["rounds"] += sum(r.rounds for r in rollouts)
        self.win["accepted"] += sum(r.num_accepted for r in rollouts)
        self.win["drafted"] += sum(r.drafted for r in rollouts)
        self.win["rollout_s"] += time.perf_counter() - t0

    def backward(
        self, step: int, draft, core, target: Target, accelerator, offline_positions: float,
        autocast=nullcontext,  # the step's bf16 autocast context (train.bf16=auto on a CPU)
    ) -> float:  # fmt: skip
        """Target + draft forward on a replay batch and backward of ratio * replay loss.
        Returns the replay share of this step's loss (0 while the buffer is empty), by which
        the caller scales the offline loss with (1 - share)."""
        self.win["steps"] += 1
        self.win["offline"] += offline_positions
        picked = self.buffer.sample(self.batch_size, self._generator(step, 2))
        if not picked:
            return 0.0
        batch = make_batch(picked, len(self.offsets), self.pad_token_id, self.position_decay)
        ids = batch["input_ids"].to(accelerator.device)
        attn = batch["attention_mask"].to(accelerator.device)
        with torch.no_grad():
            t_out = target(
                ids, attention_mask=attn, hidden_layers=tuple(core.hidden_layers), use_cache=False
            )
        with autocast():
            out = draft(target, ids, t_out, attn)
            loss, acc, rej = replay_loss(
                out, t_out.logits, batch, self.accepted, self.rejected, self.rejected_weight
            )
        accelerator.backward(self.ratio * loss)
        n_acc, n_rej = len(batch["acc_pos"]), len(batch["rej_pos"])
        self.win["acc_loss"] += float(acc)
        self.win["rej_loss"] += float(rej)
        self.win["n_acc"] += n_acc
        self.win["n_rej"] += n_rej
        self.win["weight"] += self.ratio
        return self.ratio

    def flush(self) -> dict:
        """Log fields since the last flush (this rank's numbers)."""
        w = self.win
        replayed = w["n_acc"] + w["n_rej"]
        rec = {
            "replay/buffer_size": len(self.buffer),
            "replay/buffer_positions": self.buffer.num_positions(),
            "replay/token_share": replayed / max(replayed + w["offline"], 1.0),
            "replay/loss_share": w["weight"] / max(w["steps"], 1.0),
            "replay/loss_accepted": w["acc_loss"] / max(w["n_acc"], 1.0),
            "replay/loss_rejected": w["rej_loss"] / max(w["n_rej"], 1.0),
            "replay/rollout_s": w["rollout_s"],
        }
        if w["rounds"]:  # acceptance at rollout time (tau counts the bonus token)
            rec["replay/tau"] = 1.0 + w["accepted"] / w["rounds"]
            rec["replay/accept_rate"] = w["accepted"] / max(w["drafted"], 1.0)
        self._reset_window()
        return rec

    def state_dict(self) -> dict:
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)
