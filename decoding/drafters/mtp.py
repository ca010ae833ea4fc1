"""The MTP drafter (models/mtp.py: DeepSeek-V3-style modules) for the shared decoder.

With the newest target feature at position P and the newest token x_{P+1}, draft j <= D comes
from module j at position P; for j > D (when `recursive_last`) module D runs again at position
P + j - D, fed its own previous output h^D in place of h^{D-1}. Each module keeps its own KV
cache over t, rolled back at commit to the entries whose inputs were all committed tokens. A
one-layer (served) draft runs its one module at every depth, each depth with its own cache,
and hands on each output's final norm (`MTP.feed`).
Compiled decoding (a `CompiledTarget`, decoding/compiled.py): the caches are StaticKVCaches
and each module's pass runs compiled at width 1 and at the target's widest forward (the
positions a module catches up on, padded), eagerly when wider (the prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor
from transformers import DynamicCache

from decoding.compiled import DRAFT_EXTRA_SLOTS, CachedStep, CompiledTarget, pad_seq, unwrap
from decoding.drafter import Sampling
from decoding.drafters.cache import crop_to
from decoding.verify import sampling_probs
from models.masks import left_padding, positions_and_mask
from models.mtp import MTP
from models.static_cache import StaticKVCache
from models.target import Target, TargetOutput


class MTPDrafter:
    """Chain drafter over an MTP draft (the Drafter protocol in decoding/drafter.py).

    State, for a committed sequence x_0..x_{N-1} with the target's features h^0_0..h^0_{N-1}:
      tokens [B, N]; features[0] = h^0 [B, N, H];
      features[d] [B, n_d, H] = module d's outputs at positions 0..n_d-1, where n_d is also the
      length of caches[d-1] (entries are appended and cropped together).
    propose() first brings module d up to date on the positions it has not seen, then drafts.
    """

    hidden_layers: tuple[int, ...] = (-1,)

    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ()
    replayable: ClassVar[bool] = True

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        """One module per draft token, unless the last one recurs (`recursive_last`)."""
        return None if model_settings.get("recursive_last", False) else model_settings["num_depths"]

    def __init__(self, model: MTP, target: Target | CompiledTarget):
        if model.vocab_size != target.vocab_size:
            raise ValueError(
                f"MTP draft built for a vocabulary of {model.vocab_size}, target has "
                f"{target.vocab_size}: build the draft from this target (models.mtp.from_target)."
            )
        self.model = model
        self.target = unwrap(target)
        self.num_depths = model.num_depths
        self.vocab_size = target.vocab_size
        self.steps = None  # compiled decoding: one step per module, each over its static cache
        if isinstance(target, CompiledTarget):
            size, B = target.max_len + DRAFT_EXTRA_SLOTS, target.cache.batch_size
            caches = [StaticKVCache(1, B, size, target.device) for _ in range(self.num_depths)]
            widths = (1, max(target.widths))
            self.steps = [
                CachedStep(self._module_step(d, cache), cache, widths, target.mode)
                for d, cache in enumerate(caches, start=1)
            ]
            for step in self.steps:
                step.warmup(self._dummy_step_args)

    def _dummy_step_args(self, width: int) -> tuple:
        cache = self.steps[0].cache
        B, H = cache.batch_size, self.model.block_config.hidden_size
        weight = self.model.depths[0].proj.weight
        prev = torch.zeros(B, width, H, dtype=weight.dtype, device=weight.device)
        tokens = torch.zeros(B, width, dtype=torch.long, device=weight.device)
        return prev, tokens, *positions_and_mask(0, width, None, weight.device, cache.max_len, B)

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        """`attention_mask` [B, T] (1 = real) when the decoder left-padded the prompts."""
        B, N = input_ids.shape
        # Left padding: row b's real tokens start at index pad[b]; position ids count real
        # tokens only (as the decoder does for the target) and pad entries are never attended.
        self.pad = left_padding(attention_mask)  # [B], None = no padding
        hidden = target_out.hidden[-1].to(self.model.depths[0].proj.weight.dtype)  # [B, N, H]
        self.tokens = input_ids
        self.features = [hidden] + [hidden.new_zeros(B, 0, hidden.shape[-1])] * self.num_depths
        if self.steps is None:
            self.caches = [DynamicCache() for _ in range(self.num_depths)]
        else:
            self.caches = [step.cache for step in self.steps]
            for cache in self.caches:
                cache.reset()
        self._pending: tuple[Tensor, Tensor] | None = None  # (last_tokens [B], drafts [B, k])

    def _run(self, depth: int, prev_hidden: Tensor, token_ids: Tensor, start: int) -> Tensor:
        """Module `depth` over positions start..start+L-1 with its cache; returns its h [B, L, H]."""
        module = self.model.module(depth)
        cache = self.caches[depth - 1]
        if cache.get_seq_length() != start:
            raise RuntimeError(
                f"MTP depth {depth}: cache holds {cache.get_seq_length()} positions, expected {start}."
            )
        L = prev_hidden.shape[1]
        if self.steps is None:
            positions, mask = positions_and_mask(start, L, self.pad, prev_hidden.device)
            cos_sin = self.model.rotary(prev_hidden, positions)
            embeds = self.target.embed_tokens(token_ids).to(prev_hidden.dtype)  # [B, L, H]
            hidden = module(prev_hidden, embeds, cos_sin, attention_mask=mask, cache=cache)
        else:  # dummy positions after the real ones, cropped at once
            step = self.steps[depth - 1]
            W = step.width(L)
            positions, mask = positions_and_mask(
                start, W, self.pad, prev_hidden.device, cache.max_len, prev_hidden.shape[0]
            )
            prev, ids = pad_seq(prev_hidden, W), pad_seq(token_ids, W)
            hidden = step(W, prev, ids, positions, mask)[:, :L]
            cache.truncate(start + L)
        # what the next depth (and the recursion) reads: normed with a one-layer draft
        self.features[depth] = torch.cat([self.features[depth], self.model.feed(depth, hidden)], 1)
        return hidden

    def _module_step(self, depth: int, cache: StaticKVCache):
        """Module `depth`'s pass over its static cache, as `CachedStep` compiles it."""
        module = self.model.module(depth)

        def step(prev_hidden: Tensor, token_ids: Tensor, positions: Tensor, mask: Tensor):
            cos_sin = self.model.rotary(prev_hidden, positions)
            embeds = self.target.embed_tokens(token_ids).to(prev_hidden.dtype)  # [B, W, H]
            return module(prev_hidden, embeds, cos_sin, attention_mask=mask, cache=cache)

        return step

    def _sample(
        self, depth: int, hidden: Tensor, sampling: Sampling, generator
    ) -> tuple[Tensor, Tensor | None]:
        logits = self.model.head(self.target, self.model.module(depth), hidden)  # [B, V]
        if sampling.greedy:
            return logits.argmax(-1), None
        probs = sampling_probs(logits, sampling)  # [B, V], the verifier's transform of p
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs

    @torch.no_grad()
    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        D = self.num_depths
        if k > D and not self.model.recursive_last:
            raise ValueError(
                f"k={k} drafts but the MTP draft has {D} modules and recursive_last=false: "
                f"decode with k <= {D}, or set draft.model.recursive_last=true."
            )
        seq = torch.cat([self.tokens, last_tokens[:, None]], dim=1)  # [B, N+1] x_0..x_N
        P = self.tokens.shape[1] - 1  # newest position with a target feature
        drafts, probs = [], []
        for j in range(1, k + 1):
            if j <= D:  # module j at positions n_j..P (catch-up + the draft position P)
                start = self.caches[j - 1].get_seq_length()
                prev = self.features[j - 1][:, start : P + 1]  # [B, P+1-start, H]
                hidden = self._run(j, prev, seq[:, start + j : P + j + 1], start)[:, -1]
                token, q = self._sample(j, hidden, sampling, generator)
            else:  # module D again at position P+j-D, its own last output standing in for h^{D-1}
                start = P + j - D
                prev = self.features[D][:, -1:]  # [B, 1, H]
                hidden = self._run(D, prev, seq[:, P + j : P + j + 1], start)[:, -1]
                token, q = self._sample(D, hidden, sampling, generator)
            drafts.append(token)
            probs.append(q)
            seq = torch.cat([seq, token[:, None]], dim=1)  # x_{P+j+1} = d_j
        drafts_t = torch.stack(drafts, dim=1)  # [B, k]
        self._pending = (last_tokens, drafts_t)
        return drafts_t, None if sampling.greedy else torch.stack(probs, dim=1)  # [B, k, V]

    @torch.no_grad()
    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        if self._pending is None:
            raise RuntimeError("MTPDrafter.commit called without a propose before it.")
        last_tokens, drafts = self._pending
        self._pending = None
        n = num_accepted
        if emitted.shape[1] != n + 1 or target_out.hidden[-1].shape[1] != n + 1:
            raise ValueError(
                f"commit(num_accepted={n}) needs emitted and target_out over n+1={n + 1} positions; "
                f"got {emitted.shape[1]} and {target_out.hidden[-1].shape[1]}."
            )
        if not torch.equal(emitted[:, :n], drafts[:, :n]):
            raise ValueError(
                "commit: the first num_accepted emitted tokens must be the accepted drafts."
            )
        N_old = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, last_tokens[:, None], emitted[:, :n]], dim=1)
        new_feats = target_out.hidden[-1].to(self.features[0].dtype)  # [B, n+1, H]
        self.features[0] = torch.cat([self.features[0], new_feats], dim=1)
        N_new = self.tokens.shape[1]  # = N_old + n + 1; emitted[:, n] is the next last_tokens
        for d in range(1, self.num_depths + 1):
            # Keep entries whose inputs were all committed: token x_{t+d} is committed for
            # t + d <= N_old + n, and positions >= N_old were recursive (not h^{d-1}) entries.
            keep = min(self.caches[d - 1].get_seq_length(), N_new - d, N_old)
            crop_to(self.caches[d - 1], keep)
            self.features[d] = self.features[d][:, :keep]
