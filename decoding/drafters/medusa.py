"""The Medusa drafter (models/medusa.py) for the shared decoder: chains, and static trees
(docs/tree.md). The heads read only the newest target feature, so the drafter keeps no
cache of its own. Compiled decoding (a `CompiledTarget`, decoding/compiled.py): one graph
computes every head; a round keeps the first k (or the tree's depth)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from decoding.compiled import CompiledTarget, unwrap
from decoding.drafter import Sampling
from decoding.inductor import Compiled
from decoding.tree import DraftTree, TreeSpec, static_parents, static_tree
from decoding.verify import sampling_probs
from models.medusa import MedusaHeads
from models.target import Target, TargetOutput


class MedusaDrafter:
    """Chain and static-tree drafting from Medusa heads (trees: `propose_tree`, docs/tree.md).

    Alignment at the start of a round: the newest token c (`last_tokens`) is known but not
    yet in the target's cache, so the newest target feature is h_t of the position BEFORE
    c, whose next token is c. Head i at t predicts x_{t+i+2}: head 0 gives the token after
    c (d_1), head j-1 gives d_j. The heads never see c itself; that is Medusa's design.
    After verification the kept positions are [c, d_1..d_n] and the newest one's feature
    predicts the new correction/bonus token, so it becomes the next round's h_t.
    """

    hidden_layers = (-1,)

    # Declared for the start-up checks (decoding/drafter.py: Drafter).
    tree_kinds: ClassVar[tuple[str, ...]] = ("static",)
    replayable: ClassVar[bool] = True

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        """No limit: past the last head a chain reuses it."""
        return None

    def __init__(self, heads: MedusaHeads, target: Target | CompiledTarget):
        self.heads, self.target = heads, unwrap(target)
        self.vocab_size = heads.vocab_size  # full target vocabulary (the decoder checks it)
        self.feature: Tensor | None = None  # [B, H]: last-layer feature before last_tokens
        self.all_heads = None  # compiled decoding: feature [B, H] -> every head's logits
        if isinstance(target, CompiledTarget) and target.mode is not None:
            self.all_heads = Compiled(self._all_heads, target.mode)
            B, H = target.cache.batch_size, target.hidden_size
            with torch.inference_mode():  # compile now, not in a timed round
                self.all_heads(torch.zeros(B, H, dtype=target.dtype, device=target.device))

    def _all_heads(self, feature: Tensor) -> Tensor:
        return torch.stack(self.heads.head_logits(feature, self.target), dim=1)  # [B, K, V]

    def _head_logits(self, k: int) -> Tensor:
        """The first k heads' logits on the newest feature, [B, k, V]."""
        if self.all_heads is None:
            return torch.stack(self.heads.head_logits(self.feature, self.target, heads=k), dim=1)
        return self.all_heads(self.feature)[:, :k]

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        # Prompts are left-padded for generation, so position -1 is every row's last token.
        self.feature = target_out.hidden[-1][:, -1]

    @torch.no_grad()
    def propose(
        self,
        last_tokens: Tensor,  # [B], unused: the heads read h_t only
        k: int,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if self.feature is None:
            raise RuntimeError("MedusaDrafter.propose called before prefill().")
        if k < 1:
            raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
        # K heads give at most K drafts; the decoder accepts a shorter proposal (adaptive k
        # may ask for more than K). Train more heads (draft.model.num_heads) for longer chains.
        k = min(k, self.heads.num_heads)
        logits = self._head_logits(k)  # [B, k, V]
        if sampling.greedy:
            return logits.argmax(-1), None
        q = sampling_probs(logits, sampling)  # [B, k, V], the verifier's own transform
        batch, _, vocab = q.shape
        tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).view(batch, k)
        return tokens, q

    @torch.no_grad()
    def propose_tree(
        self,
        last_tokens: Tensor,  # [B], unused (as in propose)
        tree: TreeSpec,
        sampling: Sampling,
        generator: torch.Generator | None = None,
        max_depth: int | None = None,
    ) -> DraftTree:
        """A static tree (Medusa "choices", Cartesian over the heads): the node at path
        (r_1..r_d) holds candidate r_d of head d-1, the same for every parent at that depth.
        Greedy: candidates = each head's top-k, q = None. Sampling: each head's candidates
        are drawn WITHOUT replacement from its q (Gumbel top-k), and node r carries q with
        candidates 0..r-1 removed and renormalised: the exact distribution it was drawn
        from given its earlier siblings, as tree verification requires (decoding/verify.py)."""
        if self.feature is None:
            raise RuntimeError("MedusaDrafter.propose_tree called before prefill().")
        if tree.kind != "static":
            raise ValueError(
                f"Medusa heads draft static trees (decode.tree.kind=static), got {tree.kind!r}"
            )
        depth = min(tree.max_depth, self.heads.num_heads, max_depth or tree.max_depth)
        paths = static_tree(tuple(p for p in tree.paths if len(p) <= depth))
        parents = static_parents(paths)
        ranks = max(p[-1] for p in paths) + 1  # candidates needed per head
        logits = self._head_logits(depth).float()  # [B, D, V]
        batch, _, vocab = logits.shape
        if ranks > vocab:
            raise ValueError(
                f"tree asks for candidate rank {ranks - 1} of a {vocab}-token vocabulary"
            )
        q_nodes = None
        if sampling.greedy:
            cand = logits.topk(ranks, dim=-1).indices  # [B, D, R]
        else:
            q = sampling_probs(logits, sampling)  # [B, D, V], the verifier's own transform
            cand, q_rank = _draw_without_replacement(
                q, logits, ranks, generator
            )  # [B,D,R], [B,D,R,V]
        node_depth = torch.tensor([len(p) - 1 for p in paths], device=logits.device)  # head ids
        node_rank = torch.tensor([p[-1] for p in paths], device=logits.device)
        tokens = cand[:, node_depth, node_rank]  # [B, N]
        if not sampling.greedy:
            q_nodes = q_rank[:, node_depth, node_rank]  # [B, N, V]
        parent_ids = torch.tensor(parents, device=logits.device).expand(batch, -1)
        return DraftTree(tokens, parent_ids, q_nodes)

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        # The newest kept position's feature: its next token is emitted[:, -1].
        self.feature = target_out.hidden[-1][:, -1]


def _draw_without_replacement(
    q: Tensor,  # [B, D, V] sampling distributions
    logits: Tensor,  # [B, D, V] raw logits (order of the fallback candidates)
    ranks: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """R draws without replacement per distribution (Gumbel top-k on log q) -> tokens
    [B, D, R] and, per draw, the distribution it came from given the earlier draws
    [B, D, R, V] (q minus earlier draws, renormalised). Once q's support is used up (top-k /
    top-p), the remaining candidates are the next tokens by logit, a deterministic choice:
    their distribution is their one-hot."""
    gumbel = -torch.empty_like(q).exponential_(generator=generator).log()
    keys = torch.where(q > 0, q.log() + gumbel, float("-inf"))
    drawn = keys.topk(ranks, dim=-1).indices  # [B, D, R]; invalid past the support
    support = (q > 0).sum(-1, keepdim=True)  # [B, D, 1]
    rank = torch.arange(ranks, device=q.device)
    fallback = logits.masked_fill(q > 0, float("-inf")).topk(ranks, dim=-1).indices
    late = rank >= support  # [B, D, R] draws past the support
    fallback = fallback.gather(-1, (rank - support).clamp_min(0))
    tokens = torch.where(late, fallback, drawn)
    earlier = F.one_hot(tokens, q.shape[-1]).cumsum(2) - F.one_hot(tokens, q.shape[-1])
    remaining = q[:, :, None] * (earlier == 0)  # [B, D, R, V]
    mass = remaining.sum(-1, keepdim=True)
    own = F.one_hot(tokens, q.shape[-1]).to(q.dtype)
    q_rank = torch.where(late[..., None], own, remaining / mass.clamp_min(1e-30))
    return tokens, q_rank
