"""The contract between the shared speculative decoder and a draft (chain drafting).

One decoding round, batch B, k draft tokens:
  1. `propose(k, sampling)` -> tokens [B, k] and the q each was drawn from [B, k, V]
     (full target vocabulary, after the same temperature/top-k/top-p transform the
     verifier applies to p; for greedy, q may be None).
  2. The decoder runs ONE target forward over [last, d_1..d_k] (k+1 positions), verifies,
     and keeps n accepted drafts (same n for every row: the batch keeps the common
     prefix, see decoding/spec.py) plus one correction/bonus token c.
  3. `commit(...)` tells the drafter what was kept, with the target's output for the
     kept positions (hidden states the drafter asked for), so it can roll its own cache
     back to the accepted prefix and absorb the new features.

Drafters keep their own state (KV caches, last features) between calls. One drafter per
draft kind lives in decoding/drafters/ (`make_drafter` picks it for a trained draft).
A drafter whose rounds leave work in the target's own cache (the self-speculative one)
verifies through a view of the target it was built on, its `verify_target`; the decoder
is then called with that view (train/eval/compiled.py: compiled_decoding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import Tensor

from models.target import TargetOutput


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@runtime_checkable
class Drafter(Protocol):
    # Target hidden layers (HF hidden_states indices, -1 = last after norm) the decoder must
    # return from every target forward; () for drafters that need none.
    hidden_layers: tuple[int, ...]
    # The target vocabulary its q covers (the decoder checks it against the target's);
    # None for a drafter with no vocabulary of its own (prompt lookup).
    vocab_size: int | None

    # What a drafter of a trained draft kind declares (decoding/drafters: DRAFTERS), read by
    # the start-up checks before any model is loaded (train/run/settings.py):
    # the decode.tree.kind values its `propose_tree` drafts (() = chains only),
    tree_kinds: ClassVar[tuple[str, ...]]
    # whether its draft can train on the positions an on-policy rollout picks (train/core/replay.py),
    replayable: ClassVar[bool]

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        """The most tokens one round drafts (chain k or tree depth) for a draft built with
        `model_settings` (conf draft.model); None = no limit."""
        ...

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        """Called once after the target's prefill over the prompt `input_ids` [B, T].
        `target_out.hidden` covers all T positions; `target_out.logits` only the LAST one,
        [B, 1, V] (the head over a whole prompt is costly). `attention_mask` [B, T]
        (1 = real token) is passed, as a keyword, only when prompts are LEFT-padded; the
        target's position ids are then cumsum(mask) - 1, and later rounds append ones."""
        ...

    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        """`last_tokens` [B]: the newest emitted token (not yet in the target's cache).
        Returns draft tokens [B, k] and q [B, k, V] (None when greedy)."""
        ...

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        """After verification: `emitted` [B, num_accepted + 1] = accepted drafts + the
        correction/bonus token. `target_out` is the verify forward sliced to the kept
        positions [last, d_1..d_n] (n+1 positions), i.e. the features whose next tokens
        are `emitted`."""
        ...
