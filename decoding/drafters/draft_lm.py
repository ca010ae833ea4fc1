"""The draft-LM drafter (models/draft_lm.py, or any HF causal LM on the target's tokenizer):
a standalone model that reads no target features, with its own KV cache. Compiled decoding
(a `CompiledTarget`, decoding/compiled.py): the draft runs as a CompiledTarget of its own,
over a static cache, compiled at widths 1 and 2 (a round feeds at most one pending token
and the newest one, then one draft at a time)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel

from decoding.compiled import DRAFT_EXTRA_SLOTS, CompiledTarget
from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from models.draft_lm import DraftLM
from models.static_cache import StaticKVCache
from models.target import Target, TargetOutput


class DraftLMDrafter:
    """Any HF causal LM sharing the target's tokenizer, with its own KV cache.

    Cache invariant between rounds: the draft cache holds every kept token except the
    ones in `self.pending` (accepted drafts it never fed, e.g. d_k after a full accept)
    and the newest emitted token, which `propose` receives as `last_tokens`."""

    hidden_layers: tuple[int, ...] = ()

    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ()
    replayable: ClassVar[bool] = True

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        """No limit: a standalone LM drafts token by token."""
        return None

    def __init__(
        self, model: PreTrainedModel | DraftLM, target: Target | CompiledTarget | None = None
    ):
        if isinstance(model, DraftLM):  # a trained draft of models/draft_lm.py
            model = model.causal_lm()
        self.model = model.eval().requires_grad_(False)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        if target is not None and self.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft LM vocabulary size {self.vocab_size} != target's {target.vocab_size}: "
                "a standalone draft must use the target's tokenizer (same ids, same size)"
            )
        self.cache: DynamicCache | StaticKVCache | None = None
        self.lm = None  # compiled decoding: the draft as a CompiledTarget (never frozen: the
        # weights of a run's draft copy change at every checkpoint, the graphs stay)
        if isinstance(target, CompiledTarget):
            size = target.max_len + DRAFT_EXTRA_SLOTS
            draft = Target(model, target.tokenizer, name="draft")
            B = target.cache.batch_size
            self.lm = CompiledTarget(draft, size, (1, 2), (), target.mode, False, B)
            self.lm.warmup()

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    def _forward(self, ids: Tensor) -> Tensor:
        """Feed ids [B, m] at the next positions; returns the last position's logits [B, V]."""
        B, m = ids.shape
        positions = self.next_pos[:, None] + torch.arange(m, device=ids.device)  # [B, m]
        if self.attn is not None:
            self.attn = torch.cat([self.attn, self.attn.new_ones(B, m)], 1)
        logits = self._call(ids, positions)
        self.next_pos = self.next_pos + m
        return logits

    def _call(self, ids: Tensor, positions: Tensor) -> Tensor:
        """The draft over ids [B, m] at `positions` with its cache -> the last logits [B, V]."""
        if self.lm is not None:
            new = self.cache is None  # the prefill: a new sequence in the static cache, whose
            out = self.lm(  # head runs at the last position only, as logits_to_keep=1 does
                ids, cache=self.cache, attention_mask=self.attn, position_ids=positions,
                hidden_layers=(-1,), logits=not new,
            )  # fmt: skip
            self.cache = out.cache
            return self.lm.head_logits(out.hidden[-1][:, -1]) if new else out.logits[:, -1]
        out = self.model(
            input_ids=ids,
            cache=self.cache,
            attention_mask=self.attn,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        B, T = input_ids.shape
        self.cache = DynamicCache(config=self.model.config) if self.lm is None else None
        self.attn = None if attention_mask is None else attention_mask[:, :0].long()
        self.next_pos = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        if attention_mask is not None:
            # Left padding: position ids count real tokens only; pads sit at position 0.
            positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)  # [B, T]
            self.attn = attention_mask.long()
            self._call(input_ids, positions)
            self.next_pos = positions[:, -1] + 1
        else:
            self._forward(input_ids)
        self.pending = input_ids[:, :0]  # [B, 0]
        self.fed_drafts = 0

    def propose(
        self,
        last_tokens: Tensor,
        k: int,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        feed = torch.cat([self.pending, last_tokens[:, None]], 1)  # [B, m]
        drafts, qs = [], []
        for i in range(k):
            logits = self._forward(feed)  # [B, V]
            if sampling.greedy:
                tok = logits.argmax(-1)
            else:
                probs = sampling_probs(logits, sampling)  # [B, V]
                tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
                qs.append(probs)
            drafts.append(tok)
            if i < k - 1:  # d_k is only fed if it is accepted (next round, as pending)
                feed = tok[:, None]
        self.fed_drafts = k - 1
        q = torch.stack(qs, 1) if qs else None  # [B, k, V]
        return torch.stack(drafts, 1), q  # [B, k]

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        # The cache holds [last, d_1..d_{k-1}] from this round; keep [last, d_1..d_n].
        drop = self.fed_drafts - min(num_accepted, self.fed_drafts)
        if drop > 0:
            self.cache.crop(-drop)
            if self.attn is not None:
                self.attn = self.attn[:, :-drop]
            self.next_pos = self.next_pos - drop
        self.pending = emitted[:, self.fed_drafts : num_accepted]  # accepted but never fed
        self.fed_drafts = 0
