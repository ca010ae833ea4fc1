"""Prompt lookup in front of a trained drafter (`decode.lookup_min_match`): a round whose
last `min_match` or more tokens occurred earlier in the prompt or the output drafts what
followed them (ngram.py: no model, no draft forward, a one-hot q); every other round drafts
the trained drafter's chain. vLLM's n-gram and SGLang's lookahead drafting do the first
alone; here they share one decode, and text that repeats (code, names, quoted prompt) is
drafted for free while the head keeps the rest.

Trees (`propose_tree`, the hybrid): the base drafts its tree with as many nodes fewer as the
longest lookup continuation has tokens (a dynamic tree drops its least confident nodes, a
static one its last paths), and each row's continuation is grafted onto it as a trie
(`graft`): it follows the nodes that already carry its tokens and appends the rest. So the
verify stays within the tree's size + 1 positions, the width it was budgeted (and compiled)
for, and a round proposes both the head's branches and the text that repeats.

Lossless: which drafter a round uses is a function of the tokens so far only, and every
lookup node of the tokens so far and the base's nodes, never of the round's verification
(its uniforms), and each draft is verified
against the q it was drawn from (one-hot for lookup, decoding/verify.py), so every round is
a valid speculative step (tests/test_lookup.py: equal to the target's greedy output, and the
G-test of sampling). In a tree the grafted nodes come after every base node, so a base
node's q given its earlier siblings is unchanged, and a deterministic sibling tried after
them is one more valid rejection step (exact enumeration: tests/test_tree_verify.py).

The trained drafter still sees every verified position: in a lookup round it is asked for
one draft, which is dropped. `propose(k=1)` feeds it the positions committed since its last
round and no speculative entry, so its `commit` then takes the round's accepted tokens as
plain new input, whatever drafted them (what EAGLE's and the draft LM's commit do with
drafts they did not feed).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from decoding.drafter import Drafter, Sampling
from decoding.drafters.ngram import NgramDrafter
from decoding.tree import DraftTree, TreeDrafter, TreeSpec, static_tree
from models.target import TargetOutput


class LookupDrafter:
    """`base` (a trained drafter) with prompt lookup first (module docstring)."""

    replayable: ClassVar[bool] = False  # a decoding wrapper: replay trains the base's draft

    def __init__(self, base: Drafter, min_match: int = 2, max_ngram: int = 4):
        if min_match < 1:
            raise ValueError(f"decode.lookup_min_match must be >= 1 (0 = off), got {min_match}")
        self.base = base
        self.lookup = NgramDrafter(max(max_ngram, min_match), min_match)
        self.hidden_layers = base.hidden_layers
        self.vocab_size = base.vocab_size
        self.tree_kinds = getattr(base, "tree_kinds", ())  # the base's trees, lookup grafted
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

    @torch.no_grad()
    def propose_tree(
        self,
        last_tokens: Tensor,  # [B]
        tree: TreeSpec,
        sampling: Sampling,
        generator: torch.Generator | None = None,
        max_depth: int | None = None,
    ) -> DraftTree:
        """The base's tree with each row's lookup continuation grafted on, within tree.size
        nodes (module docstring)."""
        if not isinstance(self.base, TreeDrafter):
            raise ValueError(
                f"{type(self.base).__name__} cannot draft trees (no propose_tree), with prompt "
                "lookup or without; decode with a chain (decode=chain)"
            )
        depth = min(tree.max_depth, max_depth or tree.max_depth)
        found = self.lookup.continuations(last_tokens, min(depth, tree.size - 1))
        self.rounds += 1
        room = max(len(f) for f in found)
        if room:
            self.lookup_rounds += 1
            tree = fewer_nodes(tree, room)
        drafted = self.base.propose_tree(last_tokens, tree, sampling, generator, max_depth)
        return graft(drafted, found) if room else drafted

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        self.base.commit(num_accepted, emitted, target_out)
        self.lookup.commit(num_accepted, emitted, target_out)


def fewer_nodes(tree: TreeSpec, n: int) -> TreeSpec:
    """`tree` with n nodes fewer (at least one left): a dynamic tree keeps its most confident
    size - n nodes; a static tree drops its last n paths in (depth, ranks) order, the deepest,
    which are never a kept path's parent."""
    keep = max(tree.size - n, 1)
    if tree.kind == "dynamic":
        return dataclasses.replace(tree, num_nodes=keep)
    return dataclasses.replace(tree, paths=static_tree(tree.paths)[:keep])


def graft(tree: DraftTree, paths: list[list[int]]) -> DraftTree:
    """Each row's `paths[b]` (tokens root-down, [] = none) merged into its tree as a trie:
    where a node with the path's next token hangs below the current one the path follows
    it, otherwise a node is appended (after every base node: the base's q per node stays
    valid; an appended node's q is one-hot). Rows are then padded to a common size with
    copies of their node 0 below the root, one-hot q: tried after node 0, a copy is never
    accepted when node 0 is deterministic (greedy ties go to the lower id; sampling has zeroed
    its token in the residual), and is one more valid sibling when node 0 was sampled."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    for row_tokens, row_parents, path in zip(tokens, parents, paths):
        at = -1  # the root
        for token in path:
            below = [i for i, p in enumerate(row_parents) if p == at and row_tokens[i] == token]
            if below:
                at = below[0]
            else:
                row_tokens.append(token)
                row_parents.append(at)
                at = len(row_tokens) - 1
    size = max(len(row) for row in tokens)
    for row_tokens, row_parents in zip(tokens, parents):
        pad = size - len(row_tokens)
        row_tokens += [row_tokens[0]] * pad
        row_parents += [-1] * pad
    device = tree.tokens.device
    new_tokens = torch.tensor(tokens, dtype=torch.long, device=device)  # [B, N']
    new_parents = torch.tensor(parents, dtype=torch.long, device=tree.parents.device)
    q = tree.q
    if q is not None:  # [B, N, V] -> [B, N', V], the appended nodes one-hot
        extra = F.one_hot(new_tokens[:, q.shape[1] :], q.shape[-1])
        q = torch.cat([q, extra.to(q.dtype)], dim=1)
    return DraftTree(new_tokens, new_parents, q)


def with_lookup(drafter: Drafter, min_match: int) -> Drafter:
    """`drafter` behind prompt lookup of `min_match`+ tokens; unchanged for min_match = 0."""
    return drafter if not min_match else LookupDrafter(drafter, int(min_match))
