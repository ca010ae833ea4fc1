"""The DFlash drafter (models/dflash.py) for the shared decoder: ONE draft forward per
round proposes up to block_size - 1 tokens, and EAGLE-2-style dynamic trees from the same
forward.

State between calls. The draft's cache holds, per draft layer, the keys and values of the
context c (the fused target features) of every verified position; they depend on the
target's features only, so each position's are computed once and never rolled back:
  kv       per layer ([B, h, capacity, D] keys, values) buffers; slots 0..length-1 are the
           context (left padding first). New entries are written in place after them and
           the buffers double when full, so a round never copies the whole context (a
           concatenation per round made a generation O(L^2) in copies).
  pending  [B, P, H] context of the positions verified since the last round, not yet in kv
After prefill pending covers the prompt; after commit it covers the kept positions
[last, d_1..d_n], whose target features the verify forward produced.

propose(k): the block [last, mask x (B-1)] at positions a..a+B-1 (a = the position of
`last`, the newest token, whose feature is not known yet) attends to the whole cache (every
position < a) and to itself; block position i gives draft i, drawn from its own q_i. The
draws are independent (DFlash does not feed drafts back), so q_i is exactly the
distribution draft i was drawn from given the drafts before it, as verification requires.
Nothing speculative enters the cache, so commit only queues the kept positions' context.
Domino (decoding/drafters/domino.py) replaces the independent draws by one cheap causal
correction step per token.

Trees (`decode=tree_dynamic`): the block's per-position distributions give every level of
an EAGLE-2 dynamic tree (decoding/tree.py): level d expands the top_k most confident nodes
of level d-1 (cumulative log-probability) with the top_k tokens of block position d, and the
num_nodes most confident nodes are kept. Candidates are a deterministic function of the
draft's outputs, so q = None (verified as one-hot drafts; lossless at any temperature).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from decoding.drafter import Sampling
from decoding.drafters.vocab import full_vocab_q, to_target_ids
from decoding.tree import DraftTree, TreeSpec, dynamic_tree
from decoding.verify import sampling_probs
from models import vocab
from models.dflash import DFlashDraft
from models.masks import left_padding
from models.target import Target, TargetOutput


class DFlashDrafter:
    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ("dynamic",)
    replayable: ClassVar[bool] = False

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        """One block forward drafts block_size - 1 tokens. Not replayable: the draft trains at
        its own sampled anchors, not at the positions a rollout picks (train/core/replay.py)."""
        return model_settings.get("block_size", 8) - 1

    def __init__(self, model: DFlashDraft, target: Target):
        vocab.require(model)  # refuse a reduced vocabulary that was never built or loaded
        if model.target_vocab_size not in (None, target.vocab_size):
            raise ValueError(
                f"this {type(model).__name__} was built for a target vocabulary of "
                f"{model.target_vocab_size} ids, the target has {target.vocab_size}: its draft ids "
                "would map to the wrong tokens; use the target it was trained on"
            )
        self.model = model.eval()
        self.hidden_layers = model.hidden_layers
        self.vocab_size = target.vocab_size  # full target vocabulary (the decoder checks it)
        self.embed = target.embed_tokens
        with torch.no_grad():  # [V_draft, H]: the target's head rows, gathered once
            self.head = vocab.head_rows(target.lm_head.weight, model.vocab_ids).detach()
        # [V_draft] draft id -> target id; None = full. Read once with the head rows: a
        # drafter serves the vocabulary its model had when it was built.
        self.vocab_ids = model.vocab_ids
        self.kv: list[tuple[Tensor, Tensor]] | None = None
        self.pending: Tensor | None = None
        self.length = 0  # cache slots
        self.pad: Tensor | None = None  # [B] left padding per row, None = no padding

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        self.kv, self.length = None, 0
        self.pending = self.model.context(target_out.hidden)  # [B, T, H]
        self.pad = left_padding(attention_mask)

    def _block(self, last_tokens: Tensor, call: str) -> Tensor:
        """Catch the cache up on the pending context, then run the block anchored at
        `last_tokens` [B] -> its normed hidden [B, block_size, H]."""
        if self.pending is None:
            raise RuntimeError(
                f"DFlashDrafter.{call} called twice without commit (or before prefill)"
            )
        device = last_tokens.device
        slots = torch.arange(self.length, self.length + self.pending.shape[1], device=device)
        positions = slots[None] if self.pad is None else (slots[None] - self.pad[:, None])
        self._append(self.model.context_kv(self.pending, positions.clamp_min(0)))
        self.pending = None
        B = last_tokens.shape[0]
        anchor = torch.full((B, 1), self.length, device=device)  # [B, 1] position of last
        ctx_mask = torch.ones(B, 1, self.length, dtype=torch.bool, device=device)
        if self.pad is not None:  # padding slots are never context
            anchor = anchor - self.pad[:, None]
            real = torch.arange(self.length, device=device)[None, :] >= self.pad[:, None]
            ctx_mask = real[:, None]
        kv = [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self.kv]
        h = self.model.blocks(self.embed(last_tokens)[:, None], anchor, kv, ctx_mask)
        return h[:, 0]  # [B, P, H]

    def _append(self, new: list[tuple[Tensor, Tensor]]) -> None:
        """Write every layer's new keys and values [B, h, n, D] after the cached ones,
        doubling the buffers when they are full (each entry copied O(1) times on average)."""
        end = self.length + new[0][0].shape[2]
        capacity = 0 if self.kv is None else self.kv[0][0].shape[2]
        if end > capacity:
            grown = []
            for i, (nk, nv) in enumerate(new):
                B, h, _, D = nk.shape
                k, v = (x.new_empty(B, h, max(end, 2 * capacity), D) for x in (nk, nv))
                if self.kv is not None:
                    k[:, :, : self.length] = self.kv[i][0][:, :, : self.length]
                    v[:, :, : self.length] = self.kv[i][1][:, :, : self.length]
                grown.append((k, v))
            self.kv = grown
        for (k, v), (nk, nv) in zip(self.kv, new, strict=True):
            k[:, :, self.length : end] = nk
            v[:, :, self.length : end] = nv
        self.length = end

    @torch.no_grad()
    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        if k < 1:
            raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
        # One block gives at most block_size - 1 drafts; the decoder accepts a shorter
        # proposal (adaptive k may ask for more). Train a larger draft.model.block_size.
        k = min(k, self.model.block_size - 1)
        h = self._block(last_tokens, "propose")  # [B, P, H]
        return self._draw(h, last_tokens, k, sampling, generator)

    def _draw(
        self, h: Tensor, last_tokens: Tensor, k: int, sampling: Sampling, generator
    ) -> tuple[Tensor, Tensor | None]:
        """Drafts 1..k from block positions 1..k, each drawn from its own q."""
        logits = self.model.logits(h[:, 1 : k + 1], self.head)  # [B, k, V_draft]
        if sampling.greedy:
            return to_target_ids(logits.argmax(-1), self.vocab_ids), None
        q = sampling_probs(logits, sampling)  # [B, k, V_draft] float32, the verifier's transform
        B, _, V = q.shape
        choice = torch.multinomial(q.reshape(-1, V), 1, generator=generator).view(B, k)
        drafted = to_target_ids(choice, self.vocab_ids)  # [B, k]
        return drafted, full_vocab_q(q, self.vocab_ids, self.vocab_size)  # [B, k, V]

    def _child_logp(
        self, h: Tensor, d: int, parents: Tensor, states: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """Log-probabilities [B, m, V_draft] of the token at block position d + 1 below each
        of `parents` [B, m] (target ids of tree nodes at depth d; the root `last` at d = 0).
        DFlash's do not depend on the parent; Domino's do, through `states`
        (decoding/drafters/domino.py)."""
        logits = self.model.logits(h[:, d + 1], self.head)  # [B, V_draft]
        logp = logits.float().log_softmax(-1)[:, None]
        return logp.expand(-1, parents.shape[1], -1), None

    @torch.no_grad()
    def propose_tree(
        self,
        last_tokens: Tensor,  # [B]
        tree: TreeSpec,
        sampling: Sampling,
        generator: torch.Generator | None = None,
        max_depth: int | None = None,
    ) -> DraftTree:
        """A dynamic (EAGLE-2) tree from one block forward: level d has the top_k tokens of
        block position d below each of the top_k most confident nodes of level d - 1; the
        num_nodes most confident candidates are kept (a child never outscores its parent
        and ties keep the shallower first, so they form a tree). q = None."""
        if tree.kind != "dynamic":
            raise ValueError(
                f"the {type(self).__name__} drafts dynamic trees (decode=tree_dynamic), got "
                f"{tree.kind!r}; static paths are for Medusa heads"
            )
        depth = min(tree.depth, max_depth or tree.depth, self.model.block_size - 1)
        h = self._block(last_tokens, "propose_tree")  # [B, P, H]
        logp, state = self._child_logp(h, 0, last_tokens[:, None], None)  # [B, 1, V]
        # The state after each node of the last expanded level, i.e. its children's state
        # before their own token (Domino's GRU; None for DFlash); the root's first.
        prev_state = state  # [B, 1, G] | None

        def expand(d: int, beam_ids: Tensor, beam_parent: Tensor) -> Tensor:
            nonlocal prev_state
            beam_state = None
            if prev_state is not None:
                G = prev_state.shape[-1]
                beam_state = prev_state.gather(1, beam_parent[..., None].expand(-1, -1, G))
            parents = to_target_ids(beam_ids, self.vocab_ids)  # [B, k] target ids
            logp, prev_state = self._child_logp(h, d, parents, beam_state)  # [B, k, V_draft]
            return logp

        ids, parents = dynamic_tree(logp[:, 0], expand, depth, tree.top_k, tree.num_nodes)
        return DraftTree(to_target_ids(ids, self.vocab_ids), parents, None)

    @torch.no_grad()
    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        ctx = self.model.context(target_out.hidden)  # [B, n+1, H]
        if ctx.shape[1] != emitted.shape[1] or emitted.shape[1] != num_accepted + 1:
            raise ValueError(
                f"commit: expected target_out over the n+1={num_accepted + 1} kept positions and "
                f"emitted [B, n+1]; got {ctx.shape[1]} positions and emitted {tuple(emitted.shape)}"
            )
        self.pending = ctx
