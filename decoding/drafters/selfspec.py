"""The self-speculative drafter (models/selfspec.py) for the shared decoder: chains, one KV
cache, eager and compiled.

A round, newest token c not yet in the cache, committed tokens in every layer:
    for j = 0..k-1: layers < L on x_j (x_0 = c, x_j = d_j), KV into the target's cache,
                    h_L -> exit -> final norm -> head -> d_{j+1} (q_{j+1})
    the verify [c, d_1..d_k]: layers < L on d_k only, layers >= L on all k + 1 from the
                    drafted h_L (the view: SharedCacheTarget, or CompiledSharedCache), every
                    layer one entry per token again
    the loop's crop of the rejected tail is then the same crop in every layer.
`stop_below` > 0 (Kangaroo): the round stops before a draft whose top probability under the
exit (temperature 1) is below it in every row; the first draft is always proposed.

Compiled (a `CompiledTarget`, decoding/compiled.py): the drafter builds `CompiledSharedCache`
over the compiled target's StaticKVCache. Its first layers write at slots of their own
(`SlotWriter`: a draft step writes slot past + j of layers < L and moves no length), so the
cache holds layers < L ahead of the rest as the eager DynamicCache does; three graphs frozen
with the target's weights run a round (`shallow`: embedding + layers < L at width 1; `head`:
final norm + head at width 1, after the exit's adapter, which stays eager as its weights
change per checkpoint; `deep`: layers >= L + final norm + head at the verify's widths).
Rolling back is the static cache's: entries past `length` are masked, in every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import DynamicCache

from decoding.compiled import CompiledTarget, pad_seq, unwrap
from decoding.drafter import Sampling
from decoding.inductor import Compiled
from decoding.verify import sampling_probs
from models.masks import left_padding, positions_and_mask
from models.selfspec import Drafted, SelfSpecExit, SharedCacheTarget, run_layers
from models.static_cache import SlotWriter, StaticKVCache
from models.target import TargetOutput


class SelfSpecDrafter:
    hidden_layers: tuple[int, ...] = ()  # h_L comes from its own layers < L, not the verify

    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ()
    replayable: ClassVar[bool] = False

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        return None  # layers < L draft any number

    def __init__(self, draft: SelfSpecExit, target: SharedCacheTarget | CompiledTarget):
        if isinstance(target, CompiledTarget):
            target = CompiledSharedCache(target, draft.exit_layer)
        elif not isinstance(target, SharedCacheTarget):
            raise ValueError(
                "the self-speculative drafter writes into the verifying target's cache: "
                "decode with draft.decoding_target(target) (or a CompiledTarget) as the "
                f"target and build the drafter on it, got a {type(target).__name__}"
            )
        self.draft, self.view, self.target = draft, target, target.target
        self.vocab_size = self.target.vocab_size
        self.cache: DynamicCache | StaticKVCache | None = None
        self.padded: Tensor | None = None  # [B, T] the prefill's attention mask, if padded

    @property
    def verify_target(self) -> SharedCacheTarget | CompiledSharedCache:
        """What this drafter's rounds verify with: the view that reuses the drafted work."""
        return self.view

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
        L = self.draft.exit_layer
        past = self.cache.get_seq_length(L)  # committed tokens (every layer holds them)
        pad = left_padding(self.padded)  # [B] the prefill's left padding, or None
        tokens, hiddens, drafts, qs = [last_tokens], [], [], []
        for j in range(k):
            h = self.view.shallow_step(tokens[-1][:, None], past + j, pad, self.cache)
            hiddens.append(h)
            logits = self.view.exit_logits(self.draft, h[:, -1]).float()  # [B, V]
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


class CompiledSharedCache:
    """`SharedCacheTarget` (models/selfspec.py) on the compiled path: called exactly like the
    CompiledTarget it wraps, every other attribute the compiled target's. After a drafting
    round whose tokens the call starts with, layers < L run only on the rest (`shallow`) and
    layers >= L on all, padded to a compiled width (`deep`); any other call is the compiled
    target's plain forward (the entries the round left in layers < L lie past the cache's
    length: masked, overwritten later, nothing to undo)."""

    same_weights = True  # not an adapted target (Medusa-2): its AR is the plain target's

    def __init__(self, compiled: CompiledTarget, exit_layer: int):
        plain = unwrap(compiled)
        self.compiled, self.exit_layer = compiled, exit_layer
        self.target = plain.target if isinstance(plain, SharedCacheTarget) else plain
        self.cache: StaticKVCache = compiled.cache
        self.ahead = SlotWriter(self.cache)  # layers < L of a drafted token: their own slot
        self.drafted: Drafted | None = None
        mode, freeze = compiled.mode, getattr(compiled.step, "freeze", False)
        # every weight in these graphs is the target's: frozen as the compiled target's are
        self.shallow = Compiled(self._shallow, mode, freeze) if mode else self._shallow
        self.head = Compiled(self._head, mode, freeze) if mode else self._head
        self.deep = Compiled(self._deep, mode, freeze) if mode else self._deep
        self.verify_widths = tuple(w for w in compiled.widths if w > 1)
        self.warmup()

    def __getattr__(self, name: str):  # device, dtype, vocab_size, widths, model, ...
        if name == "compiled":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.compiled, name)

    # The graphs (fixed shapes; the cache's buffers are written in place).
    def _shallow(self, ids: Tensor, position: Tensor, mask: Tensor) -> Tensor:
        """[B, 1] token at slot `ahead.start` -> [B, 1, H] h_L (layers < L written there)."""
        x = self.target.embed_tokens(ids)
        return run_layers(self.target, x, 0, self.exit_layer, position, mask, self.ahead)

    def _head(self, adapted: Tensor) -> Tensor:
        """[B, H] the exit's output -> [B, V] logits (the target's final norm and head)."""
        return self.target.head_logits(self.target.final_norm(adapted))

    def _deep(self, hidden: Tensor, positions: Tensor, mask: Tensor) -> Tensor:
        """[B, W, H] h_L at the reserved slots -> [B, W, V] (layers >= L written there)."""
        L, N = self.exit_layer, self.target.num_layers
        last = run_layers(self.target, hidden, L, N, positions, mask, self.cache)
        return self.target.head_logits(self.target.final_norm(last))

    def _inputs(self, start: int, width: int, pad: Tensor | None) -> tuple[Tensor, Tensor]:
        """Positions [B, width] and the bool mask [B, 1, width, max_len] of entries at slots
        start.. (one row per sequence, so a padded batch runs the unpadded batch's graph)."""
        B = self.cache.batch_size
        return positions_and_mask(start, width, pad, self.device, self.cache.max_len, B)

    @torch.inference_mode()  # the cache's buffers are inference tensors (the prefill's)
    def shallow_step(
        self, ids: Tensor, slot: int, pad: Tensor | None, cache: StaticKVCache | None = None
    ) -> Tensor:
        """Layers < L on `ids` [B, 1] at slot `slot` of this view's cache -> [B, 1, H] h_L."""
        if cache is not None and cache is not self.cache:
            raise ValueError("pass back the cache this view returned (out.cache)")
        if slot >= self.cache.max_len:
            raise ValueError(
                f"a draft at slot {slot} of a static cache of {self.cache.max_len}: build the "
                "CompiledTarget with a larger max_len (prompt + max_new_tokens + k + 1)"
            )
        self.ahead.start.fill_(slot)
        position, mask = self._inputs(slot, 1, pad)
        return self.shallow(ids, position, mask)

    @torch.inference_mode()
    def exit_logits(self, draft: SelfSpecExit, hidden: Tensor) -> Tensor:
        """[B, H] h_L -> [B, V]: the exit's adapter (eager: its weights change per
        checkpoint), then the target's final norm and head (compiled)."""
        return self.head(draft.adapt(hidden, self.target.dtype))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        cache: StaticKVCache | None = None,
        attention_mask: Tensor | None = None,  # [B, past + T] 2D (1 = real token)
        position_ids: Tensor | None = None,  # [B, T]
        hidden_layers: tuple[int, ...] = (),
        logits: bool = True,
        use_cache: bool = True,
    ) -> TargetOutput:
        drafted, self.drafted = self.drafted, None
        args = (input_ids, cache, attention_mask, position_ids, hidden_layers)
        if drafted is None or not logits or not drafted.continued_by(*args):
            return self.compiled(input_ids, cache, attention_mask, position_ids, hidden_layers,
                                 logits, use_cache)  # fmt: skip
        T, m, past = input_ids.shape[1], drafted.tokens.shape[1], self.cache.length
        pad = left_padding(attention_mask)  # [B] or None (the decode loop pads left)
        hidden = [drafted.hidden]
        for i in range(m, T):  # the round's last draft: layers < L on it
            hidden.append(self.shallow_step(input_ids[:, i : i + 1], past + i, pad))
        width = self.compiled.width(T)
        extra = torch.arange(1, width - T + 1, device=input_ids.device)
        positions = torch.cat([position_ids, position_ids[:, -1:] + extra], 1)  # [B, width]
        mask = self._inputs(past, width, pad)[1]
        self.cache.reserve(width)
        out = self.deep(pad_seq(torch.cat(hidden, 1), width), positions, mask)  # [B, width, V]
        self.cache.truncate(past + T)  # the padding rows' entries are dropped at once
        return TargetOutput(out[:, :T], {}, self.cache)

    __call__ = forward

    @torch.inference_mode()
    def warmup(self) -> None:
        """Compile every graph and width now, on a dummy sequence, so no decode pays for it."""
        B, device = self.cache.batch_size, self.device
        ids = torch.zeros(B, 1, dtype=torch.long, device=device)
        out = self.compiled(ids)  # an eager prefill: allocates the cache's buffers
        calls = self.deep.warm_calls if isinstance(self.deep, Compiled) else 1
        for _ in range(calls):
            h = self.shallow_step(ids, 1, None)  # [B, 1, H]
            self.head(h[:, -1])
            for width in self.verify_widths:
                positions, mask = self._inputs(1, width, None)
                self.cache.reserve(width)
                self.deep(pad_seq(h, width), positions, mask)
                out.cache.truncate(1)
        self.cache.reset()
