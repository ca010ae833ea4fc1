"""The self-speculative drafter (models/selfspec.py) for the shared decoder: chains, one KV
cache. Eager only: the compiled path's static cache holds one length for every layer, and
a drafting round leaves layers < L ahead of the rest (train/eval/plan.py decodes this kind
eagerly beside a compiled AR).

A round, newest token c not yet in the cache, committed tokens in every layer:
    for j = 0..k-1: layers < L on x_j (x_0 = c, x_j = d_j), KV into the target's cache,
                    h_L -> exit -> final norm -> head -> d_{j+1} (q_{j+1})
    the verify [c, d_1..d_k]: layers < L on d_k only, layers >= L on all k + 1 from the
                    drafted h_L (SharedCacheTarget), every layer one entry per token again
    the loop's crop of the rejected tail is then the same crop in every layer.
`stop_below` > 0 (Kangaroo): the round stops before a draft whose top probability under the
exit (temperature 1) is below it in every row; the first draft is always proposed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import DynamicCache

from decoding.compiled import CompiledTarget
from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from models.masks import left_padding, positions_and_mask
from models.selfspec import Drafted, SelfSpecExit, SharedCacheTarget, run_layers
from models.target import TargetOutput


class SelfSpecDrafter:
    hidden_layers: tuple[int, ...] = ()  # h_L comes from its own layers < L, not the verify

    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ()
    replayable: ClassVar[bool] = False
    compiles: ClassVar[bool] = False  # see the module doc

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        return None  # layers < L draft any number

    def __init__(self, draft: SelfSpecExit, target: SharedCacheTarget):
        if isinstance(target, CompiledTarget):
            raise ValueError(
                "the self-speculative drafter decodes eagerly only: its rounds leave the "
                "target's first layers ahead of the rest, which the compiled path's static "
                "cache cannot hold; evaluate with decode.compile=false, or =only for a "
                "compiled AR beside the eager speculative decode"
            )
        if not isinstance(target, SharedCacheTarget):
            raise ValueError(
                "the self-speculative drafter writes into the verifying target's cache: "
                "decode with draft.decoding_target(target) as the target and build the "
                f"drafter on it, got a {type(target).__name__}"
            )
        self.draft, self.view, self.target = draft, target, target.target
        self.vocab_size = self.target.vocab_size
        self.cache: DynamicCache | None = None
        self.padded: Tensor | None = None  # [B, T] the prefill's attention mask, if padded

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        self.cache, self.padded = target_out.cache, attention_mask

    @torch.no_grad()
    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        if self.cache is None:
            raise RuntimeError("SelfSpecDrafter.propose called before prefill().")
        if k < 1:
            raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
        L, device = self.draft.exit_layer, last_tokens.device
        past = self.cache.get_seq_length(L)  # committed tokens (every layer holds them)
        pad = left_padding(self.padded)  # [B] the prefill's left padding, or None
        tokens, hiddens, drafts, qs = [last_tokens], [], [], []
        for j in range(k):
            x = self.target.embed_tokens(tokens[-1][:, None])  # [B, 1, H]
            position, mask = positions_and_mask(past + j, 1, pad, device)  # [B|1, 1], mask
            h = run_layers(self.target, x, 0, L, position, mask, self.cache)  # [B, 1, H] h_L
            hiddens.append(h)
            logits = self.draft.exit_logits(h[:, -1], self.target).float()  # [B, V]
            if j > 0 and self.draft.stop_below > 0:
                top = logits.softmax(-1).amax(-1)  # [B] the exit's confidence (T = 1)
                if bool((top < self.draft.stop_below).all()):
                    break
            if sampling.greedy:
                draft = logits.argmax(-1)  # [B]
            else:
                q = sampling_probs(logits, sampling)  # [B, V], the verifier's own transform
                draft = torch.multinomial(q, 1, generator=generator)[:, 0]
                qs.append(q)
            drafts.append(draft)
            tokens.append(draft)
        ran = len(hiddens)  # layers < L ran on tokens[:ran]: c and every draft but the last
        self.view.drafted = Drafted(
            self.cache, torch.stack(tokens[:ran], 1), torch.cat(hiddens, 1)
        )  # [B, ran], [B, ran, H]
        q_out = torch.stack(qs, 1) if qs else None  # [B, n, V]
        return torch.stack(drafts, 1), q_out  # [B, n]

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        """Nothing to do: the verify left one entry per token in every layer, and the loop's
        crop of the rejected tail cropped every layer alike."""
