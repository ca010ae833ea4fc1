"""The draft's own rollouts for on-policy replay (train/core/replay.py), and the buffer keeping them.

The current draft decodes training prompts in the shared decoder (`decoding.spec.generate`).
The target verifies every draft, so the continuation is the target's own output (lossless):
the draft sees the prefixes it meets at decode time, but never trains on text the target
would not write. From each rollout we record, round by round (`record_rounds`):
  - accepted: the positions of the drafts the target accepted,
  - rejected: the position of the first rejected draft of the round (where the target
    emitted its correction token instead), if the round did not accept all its drafts.
A position is stored as the TARGET position q = p - 1 whose distribution predicts the
token at sequence position p, plus the draft's index i (1-based) inside its round.
The first rejected position is the first place where the draft's context and the
rollout's agree and the draft was wrong; later drafts of the round were never checked.

The target's distribution is NOT stored (49k floats per position); the frozen target
recomputes it when a record is trained on.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from models.target import Target

PRIORITY_FLOOR = 0.05  # sampling weight of a rollout with no rejection, when priority is on


@dataclass
class Rollout:
    input_ids: list[int]  # prompt + emitted tokens, cut after the last recorded position
    prompt_len: int
    accepted: list[tuple[int, int]]  # (target position q, draft index i in its round)
    rejected: list[tuple[int, int]]  # first rejected draft of a round: (q, i)
    rounds: int  # verify rounds that had drafts
    drafted: int  # draft tokens proposed in those rounds
    num_accepted: int  # drafts the target accepted (= sum of the decoder's accept counts)
    step: int  # training step of the rollout (for age-out)

    @property
    def rejection_rate(self) -> float:
        return len(self.rejected) / max(self.rounds, 1)


def prompt_prefix(input_ids: list[int], loss_mask: list[int]) -> list[int] | None:
    """The prompt of a training row: tokens up to the first trained position t inclusive
    (loss_mask[t] = 1 means x_{t+1} is the first assistant token). None if nothing is trained."""
    for t, m in enumerate(loss_mask):
        if m:
            return list(input_ids[: t + 1])
    return None


def record_rounds(
    prompt: list[int],
    new_tokens: list[int],
    accept_counts: list[int],
    draft_lens: list[int],
    step: int = 0,
) -> Rollout:
    """Accepted / first-rejected positions of one decoded row (batch of 1).

    Round r starts at s_r (its first token was emitted before it: the prefill's sample or
    the previous round's correction/bonus); its drafts d_1..d_k sit at s_r + 1..s_r + k;
    n_r were accepted, so s_{r+1} = s_r + n_r + 1. Only positions whose token was emitted
    are kept (a row stops at EOS even if drafts after it were accepted)."""
    seq = list(prompt) + list(new_tokens)
    s = len(prompt)  # the first new token was sampled at prefill, without a draft
    accepted, rejected, rounds, drafted = [], [], 0, 0
    for n, k in zip(accept_counts, draft_lens, strict=True):
        if not 0 <= n <= k:
            raise ValueError(f"round with {k} drafts cannot accept {n}")
        rounds += k > 0
        drafted += k
        accepted += [(s + i - 1, i) for i in range(1, n + 1) if s + i < len(seq)]
        if n < k and s + n + 1 < len(seq):
            rejected.append((s + n, n + 1))
        s += n + 1
    if s + 1 < len(seq):  # s is now the position of the last emitted token (or past EOS)
        raise ValueError(
            f"the accept counts cover {s + 1 - len(prompt)} new tokens but the row has "
            f"{len(new_tokens)}: pass the GenerationResult of this very row (batch of 1)"
        )
    last = max([q for q, _ in accepted + rejected], default=len(prompt) - 1)
    return Rollout(
        input_ids=seq[: last + 1],
        prompt_len=len(prompt),
        accepted=accepted,
        rejected=rejected,
        rounds=rounds,
        drafted=drafted,
        num_accepted=sum(accept_counts),
        step=step,
    )


@torch.no_grad()
def rollout(
    target: Target,
    draft: torch.nn.Module,
    prompts: list[list[int]],
    *,
    k: int,
    sampling: Sampling,
    max_new_tokens: int,
    generator: torch.Generator | None = None,
    eos_token_ids: list[int] | None = None,
    step: int = 0,
) -> list[Rollout]:
    """Decode each prompt alone (batch of 1: a batch keeps only the rows' common accepted
    prefix, which would hide each row's own rejections) and record its rounds."""
    out = []
    for ids in prompts:
        drafter = make_drafter(draft, target)  # fresh drafter state per prompt
        res = generate(
            target,
            torch.tensor([ids], device=target.device),
            drafter,
            k=k,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            generator=generator,
            eos_token_ids=eos_token_ids,
        )
        out.append(record_rounds(ids, res.sequences[0], res.accept_counts, res.draft_lens, step))
    return out


class ReplayBuffer:
    """Rollouts, newest last. FIFO beyond `capacity`; rollouts older than `max_age` training
    steps are dropped; `priority` samples rollouts in proportion to their rejection rate
    (share of rounds that ended in a rejection, floored at PRIORITY_FLOOR)."""

    def __init__(self, capacity: int, max_age: int | None = None, priority: bool = False):
        if capacity < 1:
            raise ValueError(f"replay.capacity must be >= 1 rollout, got {capacity}")
        if max_age is not None and max_age < 0:
            raise ValueError(f"replay.max_age must be >= 0 steps or null (never), got {max_age}")
        self.capacity, self.max_age, self.priority = capacity, max_age, priority
        self.items: list[Rollout] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, rollouts: list[Rollout]) -> None:
        self.items.extend(r for r in rollouts if r.accepted or r.rejected)
        del self.items[: max(0, len(self.items) - self.capacity)]

    def age_out(self, step: int) -> None:
        if self.max_age is not None:
            self.items = [r for r in self.items if step - r.step <= self.max_age]

    def sample(self, n: int, generator: torch.Generator) -> list[Rollout]:
        n = min(n, len(self.items))
        if n == 0:
            return []
        if self.priority:
            w = torch.tensor([max(r.rejection_rate, PRIORITY_FLOOR) for r in self.items])
        else:
            w = torch.ones(len(self.items))
        idx = torch.multinomial(w, n, replacement=False, generator=generator)
        return [self.items[i] for i in idx.tolist()]

    def num_positions(self) -> int:
        return sum(len(r.accepted) + len(r.rejected) for r in self.items)

    def state_dict(self) -> dict:
        return {"items": [asdict(r) for r in self.items]}

    def load_state_dict(self, state: dict) -> None:
        self.items = []
        for r in state["items"]:
            r = dict(r)
            r["accepted"] = [tuple(x) for x in r["accepted"]]
            r["rejected"] = [tuple(x) for x in r["rejected"]]
            self.items.append(Rollout(**r))
