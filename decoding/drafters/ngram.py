"""N-gram prompt lookup (Saxena 2023), the training-free baseline drafter: no model, no
target features; it proposes what followed the newest earlier occurrence of the last tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from decoding.drafter import Sampling
from models.target import TargetOutput


class NgramDrafter:
    """Prompt lookup (Saxena 2023): find the newest earlier occurrence of the last n tokens
    (n from max_ngram down to min_ngram) in the prompt + output, and propose what followed.
    Deterministic, so q is the one-hot of each proposal (lossless under sampling too)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, vocab_size: int | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.vocab_size = vocab_size

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        rows = input_ids.tolist()
        if attention_mask is not None:
            keep = attention_mask.bool().tolist()
            rows = [[t for t, m in zip(r, km) if m] for r, km in zip(rows, keep)]
        self.history = rows  # per row: every token in the target's cache
        self.num_logits = target_out.logits.shape[-1]  # prefill logits: last position only
        self.device = input_ids.device

    def _lookup(self, tokens: list[int], k: int) -> list[int]:
        """Newest match followed by k tokens, else the newest match (shorter continuation)."""
        for n in range(min(self.max_ngram, len(tokens) - 1), self.min_ngram - 1, -1):
            pattern = tokens[-n:]
            best: list[int] = []
            for j in range(len(tokens) - n - 1, -1, -1):  # newest match first
                if tokens[j : j + n] == pattern:
                    cont = tokens[j + n : j + n + k]
                    if len(cont) == k:
                        return cont
                    best = best or cont
            if best:
                return best
        return []

    def continuations(self, last_tokens: Tensor, k: int) -> list[list[int]]:
        """Per row, what followed the newest earlier match of its last tokens (up to k; [] =
        no match). Records `last_tokens` for `commit`."""
        self.last = last_tokens.tolist()
        return [self._lookup(h + [t], k) for h, t in zip(self.history, self.last)]

    def drafts(self, found: list[list[int]], sampling: Sampling) -> tuple[Tensor, Tensor | None]:
        """`continuations` as drafts [B, k'] and their one-hot q [B, k', V] (None if greedy)."""
        width = max(len(f) for f in found)
        # Rows with shorter matches repeat their last token: harmless, verification judges it.
        rows = [f + [f[-1] if f else t] * (width - len(f)) for f, t in zip(found, self.last)]
        drafts = torch.tensor(rows, dtype=torch.long, device=self.device).view(len(rows), width)
        if sampling.greedy:
            return drafts, None
        q = torch.nn.functional.one_hot(drafts, self.num_logits).float()  # [B, k', V]
        return drafts, q

    def propose(
        self,
        last_tokens: Tensor,
        k: int,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        return self.drafts(self.continuations(last_tokens, k), sampling)

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        kept = emitted[:, :-1].tolist()  # accepted drafts; emitted[:, -1] is the next `last`
        for h, t, extra in zip(self.history, self.last, kept):
            h.append(t)
            h.extend(extra)
