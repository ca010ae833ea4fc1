"""Prompt lookup in front of a trained drafter (`decode.lookup_min_match`): a round whose
last `min_match` or more tokens occurred earlier in the prompt or the output drafts what
followed them (ngram.py: no model, no draft forward, a one-hot q); every other round drafts
the trained drafter's chain. vLLM's n-gram and SGLang's lookahead drafting do the first
alone; here they share one decode, and text that repeats (code, names, quoted prompt) is
drafted for free while the head keeps the rest.

Lossless: which drafter a round uses is a function of the tokens so far only, never of the
round's own draws or verification, and each draft is verified against the q it was drawn
from (one-hot for lookup, decoding/verify.py), so every round is a valid speculative step
(tests/test_lookup.py: equal to the target's greedy output, and the G-test of sampling).

The trained drafter still sees every verified position: in a lookup round it is asked for
one draft, which is dropped. `propose(k=1)` feeds it the positions committed since its last
round and no speculative entry, so its `commit` then takes the round's accepted tokens as
plain new input, whatever drafted them (what EAGLE's and the draft LM's commit do with
drafts they did not feed).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from decoding.drafter import Drafter, Sampling
from decoding.drafters.ngram import NgramDrafter
from models.target import TargetOutput


class LookupDrafter:
    """`base` (a trained chain drafter) with prompt lookup first (module docstring)."""

    tree_kinds: ClassVar[tuple[str, ...]] = ()  # chains only
    replayable: ClassVar[bool] = False  # a decoding wrapper: replay trains the base's draft

    def __init__(self, base: Drafter, min_match: int = 2, max_ngram: int = 4):
        if min_match < 1:
            raise ValueError(f"decode.lookup_min_match must be >= 1 (0 = off), got {min_match}")
        self.base = base
        self.lookup = NgramDrafter(max(max_ngram, min_match), min_match)
        self.hidden_layers = base.hidden_layers
        self.vocab_size = base.vocab_size
        self.rounds = self.lookup_rounds = 0  # rounds proposed, and those lookup drafted

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        padded = {} if attention_mask is None else {"attention_mask": attention_mask}
        self.base.prefill(input_ids, target_out, **padded)
        self.lookup.prefill(input_ids, target_out, attention_mask)

    @torch.no_grad()
    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        found = self.lookup.continuations(last_tokens, k)  # per row, [] = no match
        self.rounds += 1
        if all(found):  # every row has a continuation (a batch drafts one way)
            self.lookup_rounds += 1
            self.base.propose(last_tokens, 1, sampling, generator)  # absorbs; its draft dropped
            return self.lookup.drafts(found, sampling)  # [B, k'], one-hot q only when used
        return self.base.propose(last_tokens, k, sampling, generator)

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        self.base.commit(num_accepted, emitted, target_out)
        self.lookup.commit(num_accepted, emitted, target_out)


def with_lookup(drafter: Drafter, min_match: int) -> Drafter:
    """`drafter` behind prompt lookup of `min_match`+ tokens; unchanged for min_match = 0."""
    return drafter if not min_match else LookupDrafter(drafter, int(min_match))
