"""The EAGLE drafter (models/eagle.py, served layout) for the shared decoder: autoregressive
in feature space, own KV cache. Each draft step feeds the layer's pre-norm output h back as
the next feature, as vLLM and SGLang do; logits = head(norm(h)) (EAGLE-1: head(h)).

State between calls (positions are the target's positions; the draft cache holds one entry
per position whose real target feature and next token are both known):
  pending_feature [B, P, H]  step-0 features (EAGLE-3: fc over the taps; EAGLE-1: the last
                             hidden state) not yet run through the draft layer
  pending_tokens  [B, P-1]   the tokens after each of them except the last, which is the
                             `last_tokens` the decoder passes to `propose`.
After prefill: P = prompt length. After commit: P = n+1 (the verified positions
[last, d_1..d_n], whose next tokens are `emitted` = [d_1..d_n, c]; c comes back as
`last_tokens`).

propose(k): one layer pass over the P pending positions (causal, appended to the cache) ->
hidden at the newest position -> draft token 1; then k-1 single-position passes feeding the
draft's own hidden and the drafted token (exactly the training-time-test pattern). The
cache then holds k-1 speculative entries; commit crops them and the next propose replaces
them with entries computed from the target's real features.

Reduced vocabulary: the head is the [V_draft, H] slice gathered once here, so a step never
touches the target's full output head; draft ids and q go back to the target's vocabulary
through decoding/drafters/vocab.py (q zero outside the draft vocabulary).
Left-padded batches (decoding/spec.py passes `attention_mask` to prefill): row b's first
pad[b] cache entries are padding (decoding/drafters/cache.py: position ids over real
tokens, pad keys masked out).
Compiled decoding (a `CompiledTarget`, decoding/compiled.py): the cache is a StaticKVCache
and the layer pass runs compiled at fixed widths: 1 (a draft step), the target's widest
forward (the pending positions, padded) and the tree's top_k (a tree level: the compiled
target's `draft_widths`), all compiled by the warm-up when the drafter is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import DynamicCache

from decoding.compiled import DRAFT_EXTRA_SLOTS, CachedStep, CompiledTarget, pad_seq, unwrap
from decoding.drafter import Sampling
from decoding.drafters.cache import crop_to
from decoding.drafters.vocab import full_vocab_q, to_target_ids
from decoding.tree import DraftTree, TreeSpec, dynamic_tree
from decoding.verify import sampling_probs
from models import vocab
from models.eagle import EagleDraft
from models.masks import left_padding, positions_and_mask
from models.static_cache import StaticKVCache
from models.target import Target, TargetOutput


class EagleDrafter:
    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ("dynamic",)
    replayable: ClassVar[bool] = True

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        """No limit: the head recurs on its own features, any k or tree depth."""
        return None

    def __init__(self, model: EagleDraft, target: Target | CompiledTarget):
        vocab.require(model)  # refuse a reduced vocabulary without d2t/t2d
        compiled = target if isinstance(target, CompiledTarget) else None
        target = unwrap(target)
        self.model = model.eval()
        self.hidden_layers = model.hidden_layers
        self.embed = target.embed_tokens
        self.vocab_size = target.vocab_size  # full target vocabulary (the decoder checks it)
        with torch.no_grad():
            head = model.head_weight(target).detach()  # [V_draft, H], gathered once
            self.head = head.to(model.fc.weight.dtype)
        self.vocab_ids = model.vocab_ids()  # [V_draft] draft id -> target id, None if full
        if self.vocab_ids is not None:
            self.vocab_ids = self.vocab_ids.to(self.head.device)
        self.cache: DynamicCache | None = None
        self.pending_feature: Tensor | None = None
        self.pending_tokens: Tensor | None = None
        self.kept_len = 0  # cache length holding only real-feature positions
        self.pad: Tensor | None = None  # [B] left-padding per row, None = no padding
        self.step = None  # compiled decoding: the layer pass over a static cache
        if compiled is not None:
            B, size = compiled.cache.batch_size, compiled.max_len + DRAFT_EXTRA_SLOTS
            self.cache = StaticKVCache(1, B, size, compiled.device)
            widths = (1, max(compiled.widths), *compiled.draft_widths)  # draft_widths: tree levels
            self.step = CachedStep(self._layer, self.cache, widths, compiled.mode)
            self.step.warmup(self._dummy_step_args)

    def _dummy_step_args(self, width: int) -> tuple:
        B, H = self.cache.batch_size, self.model.config.hidden_size
        device = self.head.device
        feature = torch.zeros(B, width, H, dtype=self.model.fc.weight.dtype, device=device)
        tokens = torch.zeros(B, width, dtype=torch.long, device=device)
        return feature, tokens, *positions_and_mask(0, width, None, device, self.cache.max_len, B)

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        if self.step is None:
            self.cache = DynamicCache(config=self.model.config)
        else:
            self.cache = self.step.cache
            self.cache.reset()
        self.pending_feature = self.model.fuse_features(target_out.hidden)  # [B, T, H]
        self.pending_tokens = input_ids[:, 1:]  # [B, T-1]
        self.kept_len = 0
        self.pad = left_padding(attention_mask)  # [B], None = no padding

    def _layer(self, feature: Tensor, tokens: Tensor, positions: Tensor, mask: Tensor | None):
        return self.model.step(feature, self.embed(tokens), positions, self.cache, mask)

    def _run(self, feature: Tensor, tokens: Tensor, start: int) -> Tensor:
        """The layer over P new positions start..start+P-1 of the cache -> hidden [B, P, H]."""
        P = tokens.shape[1]
        if self.step is None:
            positions, mask = positions_and_mask(start, P, self.pad, tokens.device)
            return self._layer(feature, tokens, positions, mask)
        W = self.step.width(P)  # dummy positions after the real ones, cropped below
        size = self.cache.max_len
        B = tokens.shape[0]
        positions, mask = positions_and_mask(start, W, self.pad, tokens.device, size, B)
        h = self.step(W, pad_seq(feature, W), pad_seq(tokens, W), positions, mask)
        self.cache.truncate(start + P)
        return h[:, :P]

    def _run_pending(self, last_tokens: Tensor, call: str) -> Tensor:
        """The layer over the positions committed since the last round, ending with
        `last_tokens` [B]: their entries join the cache for good. Returns the draft's hidden
        at the newest position [B, 1, H], whose logits give the first draft."""
        if self.pending_feature is None:
            raise RuntimeError(
                f"EagleDrafter.{call} called twice without commit (or before prefill)"
            )
        tokens = torch.cat([self.pending_tokens, last_tokens[:, None]], dim=1)  # [B, P]
        start = self.cache.get_seq_length()
        h = self._run(self.pending_feature, tokens, start)[:, -1:]  # [B, 1, H]
        self.kept_len = start + tokens.shape[1]
        self.pending_feature = self.pending_tokens = None
        return h

    @torch.no_grad()
    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        h = self._run_pending(last_tokens, "propose")  # [B, 1, H]
        draft_tokens, draft_q = [], []
        for i in range(k):
            logits = self.model.logits(h, self.head)[:, 0]  # [B, V_draft]
            if sampling.greedy:
                choice = logits.argmax(-1)  # [B]
            else:
                q = sampling_probs(logits, sampling)  # [B, V_draft] float32
                choice = torch.multinomial(q, 1, generator=generator)[:, 0]
                draft_q.append(q)
            token = to_target_ids(choice, self.vocab_ids)  # [B] target ids
            draft_tokens.append(token)
            if i < k - 1:
                h = self._run(h, token[:, None], self.kept_len + i)  # [B, 1, H]
        drafted = torch.stack(draft_tokens, dim=1)  # [B, k]
        if sampling.greedy:
            return drafted, None
        q_draft = torch.stack(draft_q, dim=1)  # [B, k, V_draft]
        return drafted, full_vocab_q(q_draft, self.vocab_ids, self.vocab_size)  # [B, k, V]

    @torch.no_grad()
    def propose_tree(
        self,
        last_tokens: Tensor,  # [B]
        tree: TreeSpec,
        sampling: Sampling,
        generator: torch.Generator | None = None,
        max_depth: int | None = None,
    ) -> DraftTree:
        """EAGLE-2 dynamic tree. Level 1: the root's top_k tokens. Each further level: the
        top_k nodes of the previous level by cumulative draft log-probability are run
        through the layer together (one call per level; each attends to the real cache and
        its own ancestors' entries), each gives its top_k children. Finally the num_nodes
        candidates with the highest cumulative log-probability are kept: a child's score
        never exceeds its parent's and ties keep the shallower first, so they form a tree.
        The candidates are a deterministic function of the draft's outputs, so q = None
        (verified as one-hot drafts; lossless at any temperature, decoding/verify.py)."""
        if tree.kind != "dynamic":
            raise ValueError(
                f"the EAGLE drafter drafts dynamic (EAGLE-2) trees (decode.tree.kind=dynamic), "
                f"got {tree.kind!r}; static paths are for Medusa heads"
            )
        depth = min(tree.depth, max_depth or tree.depth)
        h_root = self._run_pending(last_tokens, "propose_tree")  # [B, 1, H]
        B, device = h_root.shape[0], last_tokens.device
        root_pos = torch.full((B,), self.kept_len - 1, device=device)
        prefix = torch.ones(B, self.kept_len, dtype=torch.bool, device=device)
        if self.pad is not None:
            root_pos = root_pos - self.pad
            prefix = torch.arange(self.kept_len, device=device)[None, :] >= self.pad[:, None]

        logp = self.model.logits(h_root, self.head).float().log_softmax(-1)[:, 0]  # [B, V_draft]
        # Per node of the last expanded level (the root first): its layer output, which is
        # its children's input feature, and its beam slot path in the draft cache.
        prev_hidden = h_root  # [B, 1, H]
        prev_slots = torch.zeros(B, 1, 0, dtype=torch.long, device=device)  # [B, 1, 0]

        def expand(d: int, beam_ids: Tensor, beam_parent: Tensor) -> Tensor:
            nonlocal prev_hidden, prev_slots
            k = beam_ids.shape[1]
            H = prev_hidden.shape[-1]
            beam_hidden = prev_hidden.gather(1, beam_parent[..., None].expand(-1, -1, H))
            slots = prev_slots.gather(1, beam_parent[..., None].expand(-1, -1, d - 1))
            slots = torch.cat([slots, torch.arange(k, device=device).expand(B, k)[..., None]], -1)
            # The new entries see the real prefix and, per earlier level, their ancestor's slot.
            tree_mask = torch.nn.functional.one_hot(slots, k).flatten(-2).bool()  # [B, k, d*k]
            mask = torch.cat([prefix[:, None].expand(B, k, -1), tree_mask], -1)[:, None]
            target_ids = to_target_ids(beam_ids, self.vocab_ids)
            positions = root_pos[:, None] + d
            if self.step is None:
                h = self._layer(beam_hidden, target_ids, positions, mask)  # [B, k, H]
            else:  # the static cache's attention reads every slot: hide the ones past the tree
                mask = F.pad(mask, (0, self.cache.max_len - mask.shape[-1]))
                positions = positions.expand(B, k)  # the shapes the warm-up compiled
                h = self.step(k, beam_hidden, target_ids, positions, mask)
            prev_hidden, prev_slots = h, slots
            return self.model.logits(h, self.head).float().log_softmax(-1)  # [B, k, V_draft]

        ids, parents = dynamic_tree(logp, expand, depth, tree.top_k, tree.num_nodes)
        return DraftTree(to_target_ids(ids, self.vocab_ids), parents, None)

    @torch.no_grad()
    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        # Drop the k-1 speculative entries; the accepted drafts' entries are recomputed from
        # the target's real features at the next propose.
        crop_to(self.cache, self.kept_len)
        feature = self.model.fuse_features(target_out.hidden)  # [B, n+1, H]
        if feature.shape[1] != emitted.shape[1] or emitted.shape[1] != num_accepted + 1:
            raise ValueError(
                f"commit: expected target_out over the n+1={num_accepted + 1} kept positions and "
                f"emitted [B, n+1]; got {feature.shape[1]} positions and emitted {tuple(emitted.shape)}"
            )
        self.pending_feature = feature
        self.pending_tokens = emitted[:, :-1]
