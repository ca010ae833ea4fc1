"""Tree speculative decoding: many candidate continuations verified in ONE target forward.

A round drafts a tree below the root (the newest token c, not yet in the target's cache):
node i has a token, a parent (-1 = the root) and a depth. The target runs once over
[c, node_0..node_{N-1}] with
  - position ids   next_pos + depth (siblings share a position),
  - a 4D attention mask [B, 1, N+1, past+N+1]: every cached position (minus left padding)
    plus the node's own ancestors and itself (`tree_attention_mask`),
so position i+1 of the output is exactly the target's next-token distribution after the
root path of node i. Verification (decoding/verify.py: `tree_verify`) picks the accepted
path; the cache then keeps only [c, path] (`compact_cache`: index-select along the sequence
dim of every layer), so the next round cannot tell the tree apart from having decoded the
path alone (tests/test_tree.py compares against a fresh forward over the whole sequence).

Trees (`TreeSpec`):
  static   a fixed list of paths of candidate ranks (Medusa "choices"): path (0, 2) is the
           3rd candidate at depth 2 below the 1st candidate at depth 1.
  dynamic  EAGLE-2: expand the top_k most confident nodes of each depth (cumulative draft
           log-probability), top_k children each, for `depth` levels; keep the num_nodes
           most confident nodes (a child never outranks its parent, so the set is a tree);
           `dynamic_tree` builds it from a drafter's `expand` (EAGLE, DFlash, Domino).
A drafter that can draft trees implements `propose_tree` (`TreeDrafter`); its `commit` is
the chain one, called with the target's output at the kept positions [c, path[:n]].

Batches: like the chain loop (decoding/spec.py), every row keeps the common accepted depth
n plus one more token (its accepted node at depth n+1, or its correction), which is
lossless for the same reason. Rows may have different tree shapes (dynamic trees).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from decoding.drafter import Drafter, Sampling
from decoding.entropy import EntropyProbe, tree_positions
from decoding.rounds import (
    GREEDY,
    GenerationResult,
    StreamFn,
    check_inputs,
    count_emitted,
    emit,
    prefill,
    sync,
)
from decoding.verify import node_depths, tree_verify
from models.static_cache import StaticKVCache
from models.target import Target, TargetOutput

# 15 nodes, depth 4: in bf16 on a CPU the verify forward of 16 positions costs little more
# than a 1-token forward (figures: docs/design.md §5), so more width per depth is cheap,
# while Medusa's 4 heads bound the depth.
DEFAULT_PATHS: tuple[tuple[int, ...], ...] = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0),
)  # fmt: skip
TREE_KINDS = ("static", "dynamic")


@dataclass(frozen=True)
class TreeSpec:
    kind: str = "static"  # "static": fixed `paths`; "dynamic": EAGLE-2 (depth, top_k, num_nodes)
    paths: tuple[tuple[int, ...], ...] = DEFAULT_PATHS
    depth: int = 4  # dynamic: levels expanded
    top_k: int = 4  # dynamic: nodes expanded per level and children per expanded node
    num_nodes: int = 16  # dynamic: nodes kept after reranking

    def __post_init__(self) -> None:
        if self.kind not in TREE_KINDS:
            raise ValueError(f"tree kind {self.kind!r}; use one of {TREE_KINDS}")
        # Hydra/YAML gives lists: store hashable tuples (static_tree caches on them).
        object.__setattr__(self, "paths", tuple(tuple(int(r) for r in p) for p in self.paths))
        if self.kind == "static":
            static_tree(self.paths)  # validates
        elif min(self.depth, self.top_k, self.num_nodes) < 1:
            raise ValueError(
                f"dynamic tree needs depth, top_k, num_nodes >= 1, got {self.depth}, "
                f"{self.top_k}, {self.num_nodes}"
            )

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths) if self.kind == "static" else self.depth

    @property
    def size(self) -> int:
        """Drafted nodes per round (upper bound for dynamic trees)."""
        if self.kind == "static":
            return len(self.paths)
        return min(self.num_nodes, self.top_k + (self.depth - 1) * self.top_k**2)


@lru_cache(maxsize=64)
def static_tree(paths: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """Paths of candidate ranks -> the same paths sorted by (depth, ranks), so parents come
    first. Every prefix of a path must be a path (else a node would have no parent)."""
    if not paths:
        raise ValueError("a static tree needs at least one path, e.g. [[0], [0, 0]]")
    ordered = sorted(set(paths), key=lambda p: (len(p), p))
    if len(ordered) != len(paths):
        raise ValueError("static tree paths contain duplicates")
    present = set(ordered)
    for path in ordered:
        if not path or min(path) < 0:
            raise ValueError(f"tree path {list(path)} must be a non-empty list of ranks >= 0")
        if len(path) > 1 and path[:-1] not in present:
            raise ValueError(f"tree path {list(path)} has no parent path {list(path[:-1])}; add it")
    return tuple(ordered)


def static_parents(paths: tuple[tuple[int, ...], ...]) -> list[int]:
    """Parent node id of every path in `static_tree(paths)` order (-1 = the root)."""
    ordered = static_tree(paths)
    index = {p: i for i, p in enumerate(ordered)}
    return [index[p[:-1]] if len(p) > 1 else -1 for p in ordered]


# expand(depth, beam_ids, beam_parent) -> log-probs [B, k, V] of the children of the k nodes
# being expanded at `depth` (1 = level 1): their tokens beam_ids [B, k] (draft ids) and,
# per node, its parent's row among the nodes of the previous call (0 = the root at depth 1),
# so a drafter carrying per-node state (EAGLE's hidden, Domino's GRU state) gathers it there.
ExpandFn = Callable[[int, Tensor, Tensor], Tensor]


def dynamic_tree(
    first_logp: Tensor,  # [B, V] the root's draft log-probabilities (level 1)
    expand: ExpandFn,
    depth: int,
    top_k: int,
    num_nodes: int,
) -> tuple[Tensor, Tensor]:
    """EAGLE-2 dynamic tree -> (draft ids [B, n], parents [B, n], -1 = the root). Level 1:
    the root's top_k tokens; each further level: the top_k nodes of the previous level by
    cumulative draft log-probability are expanded (one `expand` call per level), each gives
    its top_k children; then `select_nodes` keeps the num_nodes most confident."""
    B, device = first_logp.shape[0], first_logp.device
    k = min(top_k, first_logp.shape[-1])
    score, ids = first_logp.topk(k, dim=-1)  # [B, k] level-1 candidates
    cand_ids, cand_score = [ids], [score]
    cand_parent = [torch.full((B, k), -1, dtype=torch.long, device=device)]
    level_offset = 0  # candidate id of the level's first node
    for d in range(1, depth):
        best = cand_score[-1].topk(k, dim=-1).indices  # [B, k] within the level
        beam_ids, beam_score = cand_ids[-1].gather(1, best), cand_score[-1].gather(1, best)
        # Level d's candidate j is child j % k of the previous call's node j // k (level 1:
        # j < k, all below the root, row 0).
        logp = expand(d, beam_ids, best // k)  # [B, k, V]
        top, child = logp.topk(k, dim=-1)  # [B, k, k]
        cand_ids.append(child.flatten(1))
        cand_score.append((beam_score[..., None] + top).flatten(1))
        cand_parent.append((level_offset + best)[..., None].expand(B, k, k).flatten(1))
        level_offset += cand_ids[-2].shape[1]
    ids, score, parent = (torch.cat(x, 1) for x in (cand_ids, cand_score, cand_parent))
    return select_nodes(ids, score, parent, num_nodes)


def select_nodes(
    ids: Tensor,  # [B, C] candidate tokens
    score: Tensor,  # [B, C] cumulative draft log-probability
    parent: Tensor,  # [B, C] candidate id of the parent (< own id), -1 = the root
    num_nodes: int,
) -> tuple[Tensor, Tensor]:
    """Keep the num_nodes highest-scoring candidates -> (ids [B, n], parents [B, n]
    renumbered to the kept nodes, -1 = the root). A child's score never exceeds its
    parent's and the stable sort keeps earlier (shallower) candidates first among equal
    scores, so every kept node's parent is kept: the set is a tree."""
    B = ids.shape[0]
    n = min(num_nodes, ids.shape[1])
    keep = score.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    keep = keep.sort(dim=-1).values  # [B, n] candidate order: parents before children
    new_id = torch.full_like(parent, -1).scatter_(
        1, keep, torch.arange(n, device=ids.device).expand(B, n)
    )
    kept_parent = parent.gather(1, keep)
    parents = torch.where(kept_parent >= 0, new_id.gather(1, kept_parent.clamp_min(0)), -1)
    return ids.gather(1, keep), parents


@dataclass
class DraftTree:
    tokens: Tensor  # [B, N] target token ids
    parents: Tensor  # [B, N] long, parent node id (< own id), -1 = the root
    q: Tensor | None  # [B, N, V]: node's draft distribution given its earlier siblings; None =
    #   deterministic candidates (greedy, top-k): verified as one-hot q (decoding/verify.py)


@runtime_checkable
class TreeDrafter(Protocol):
    hidden_layers: tuple[int, ...]

    def propose_tree(
        self,
        last_tokens: Tensor,  # [B]
        tree: TreeSpec,
        sampling: Sampling,
        generator: torch.Generator | None = None,
        max_depth: int | None = None,  # never draft deeper (the token budget)
    ) -> DraftTree: ...


def ancestor_mask(parents: Tensor) -> Tensor:
    """parents [B, N] -> [B, N+1, N+1] bool, row i: the positions [root, nodes] that position
    i may attend to (the root, its ancestors, itself). Position 0 is the root."""
    B, N = parents.shape
    mask = torch.eye(N + 1, dtype=torch.bool, device=parents.device).repeat(B, 1, 1)
    mask[:, :, 0] = True
    for i in range(N):
        parent_row = mask.gather(1, (parents[:, i] + 1)[:, None, None].expand(B, 1, N + 1))
        mask[:, i + 1] |= parent_row[:, 0]
    return mask


def tree_attention_mask(
    parents: Tensor,  # [B, N]
    past_len: int,
    past_mask: Tensor | None,  # [B, past_len] 1 = real token (left padding), None = all real
    dtype: torch.dtype,
) -> Tensor:
    """The 4D additive mask [B, 1, N+1, past_len+N+1] for the target's tree forward
    (0 = attend, dtype min = masked; additive works for both eager and SDPA attention)."""
    B, N = parents.shape
    tree = ancestor_mask(parents)  # [B, N+1, N+1]
    if past_mask is None:
        past = torch.ones(B, N + 1, past_len, dtype=torch.bool, device=parents.device)
    else:
        past = past_mask.bool()[:, None, :].expand(B, N + 1, past_len)
    allowed = torch.cat([past, tree], dim=-1)[:, None]  # [B, 1, N+1, past+N+1]
    zero = torch.zeros((), dtype=dtype, device=parents.device)
    return zero.masked_fill(~allowed, torch.finfo(dtype).min)


def compact_cache(cache: DynamicCache | StaticKVCache, past_len: int, keep: Tensor) -> None:
    """Keep the cache's first `past_len` positions plus, per row, the tree positions `keep`
    [B, m] (offsets after past_len, in order); drop everything else. In place."""
    if isinstance(cache, StaticKVCache):  # the compiled path's cache (decoding/compiled.py)
        cache.compact(past_len, keep)
        return
    B, m = keep.shape
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(
                f"tree decoding compacts DynamicLayer caches; got {type(layer).__name__} "
                "(sliding-window / static / quantized caches are not supported)"
            )
        kv_heads, head_dim = layer.keys.shape[1], layer.keys.shape[3]
        idx = (past_len + keep)[:, None, :, None].expand(B, kv_heads, m, head_dim)
        keys, values = layer.keys.gather(2, idx), layer.values.gather(2, idx)  # copies first
        layer.keys[:, :, past_len : past_len + m] = keys
        layer.values[:, :, past_len : past_len + m] = values
        layer.keys = layer.keys[:, :, : past_len + m]
        layer.values = layer.values[:, :, : past_len + m]


def tree_forward(
    target: Target,
    cache: DynamicCache,
    last: Tensor,  # [B] the root: newest token, not yet in the cache
    tokens: Tensor,  # [B, N]
    parents: Tensor,  # [B, N]
    next_pos: Tensor,  # [B] position id of `last`
    past_mask: Tensor | None,  # [B, past] 1 = real token (left padding), None = no padding
    hidden_layers: tuple[int, ...] = (),
) -> TargetOutput:
    """ONE target forward over [last, tree] -> logits [B, N+1, V]: position i+1 is the
    target's next-token distribution after the root path of node i. The cache grows by N+1
    entries; `compact_cache` then keeps the accepted path only."""
    B = tokens.shape[0]
    depth = node_depths(parents)  # [B, N]
    step_ids = torch.cat([last[:, None], tokens], 1)  # [B, N+1]
    step_pos = next_pos[:, None] + torch.cat([depth.new_zeros(B, 1), depth], 1)  # [B, N+1]
    mask = tree_attention_mask(parents, cache.get_seq_length(), past_mask, target.dtype)
    return target(
        step_ids,
        cache=cache,
        attention_mask=mask,
        position_ids=step_pos,
        hidden_layers=hidden_layers,
    )


def _gather_out(out: TargetOutput, keep: Tensor) -> TargetOutput:
    """The tree forward at positions keep [B, m] (what the drafter's commit expects)."""

    def take(x: Tensor) -> Tensor:
        return x.gather(1, keep[:, :, None].expand(-1, -1, x.shape[-1]))

    return TargetOutput(
        logits=None if out.logits is None else take(out.logits),
        hidden={layer: take(h) for layer, h in out.hidden.items()},
        cache=out.cache,
    )


@torch.inference_mode()
def generate_tree(
    target: Target,
    input_ids: Tensor,  # [B, T], left-padded if rows differ in length
    drafter: Drafter,
    tree: TreeSpec,
    *,
    sampling: Sampling = GREEDY,
    max_new_tokens: int = 64,
    attention_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    stream: StreamFn | None = None,
    eos_token_ids: list[int] | None = None,
    probe: EntropyProbe | None = None,  # (target entropy, acceptance) per judged depth
) -> GenerationResult:
    """Tree speculative decoding (also reachable as `decoding.spec.generate(..., tree=)`).
    `result.draft_lens` holds each round's tree depth, `result.tree_sizes` its node count;
    `probe` as in `decoding.spec.generate` (its time left out of `total_s`)."""
    check_inputs(target, input_ids, drafter, 1, sampling, max_new_tokens, attention_mask)
    if not isinstance(tree, TreeSpec):
        raise ValueError(f"tree must be a decoding.tree.TreeSpec, got {type(tree).__name__}")
    if not isinstance(drafter, TreeDrafter):
        raise ValueError(
            f"{type(drafter).__name__} cannot draft trees (no propose_tree); decode with a "
            "chain (tree=None, conf decode=chain) or use a Medusa / EAGLE drafter"
        )
    device = target.device
    B = input_ids.shape[0]
    hidden_layers = tuple(drafter.hidden_layers)
    state = prefill(target, input_ids, drafter, sampling, attention_mask, generator, eos_token_ids)
    result, cache, attn, last, next_pos = (
        state.result, state.cache, state.attn, state.last, state.next_pos
    )  # fmt: skip
    finished = state.finished
    if stream is not None:
        stream([[t] for t in state.first])
    generated = 1
    probe_s = 0.0

    while generated < max_new_tokens and not all(finished):
        max_depth = min(tree.max_depth, max_new_tokens - generated - 1)  # never past the budget
        # ---- propose -----------------------------------------------------------------------
        if max_depth > 0:
            t0 = time.perf_counter()
            draft = drafter.propose_tree(last, tree, sampling, generator, max_depth=max_depth)
            sync(device)
            result.draft_s += time.perf_counter() - t0
            tokens, parents, q = draft.tokens, draft.parents.to(device), draft.q
        else:  # the last token of the budget: a plain AR step
            tokens = parents = torch.zeros(B, 0, dtype=torch.long, device=device)
            q = None
        N = tokens.shape[1]
        # ---- one target forward over [last, tree] ------------------------------------------
        past_len = cache.get_seq_length()
        t0 = time.perf_counter()
        out = tree_forward(target, cache, last, tokens, parents, next_pos, attn, hidden_layers)
        sync(device)
        result.verify_s += time.perf_counter() - t0
        # ---- verify: accepted path per row, common depth n over unfinished rows -------------
        res = tree_verify(tokens, parents, q, out.logits, sampling, generator)
        n_rows = res.num_accepted.tolist()
        n_common = min(n_rows[b] for b in range(B) if not finished[b])
        if probe is not None and N > 0:
            t0 = time.perf_counter()
            rows = torch.tensor([not f for f in finished], device=device)
            H, accept = tree_positions(
                tokens, parents, q, out.logits, res.path, res.num_accepted, sampling, rows
            )
            probe.add(H, accept)
            sync(device)
            probe_s += time.perf_counter() - t0
        # A finished row's accepted path may be shorter than n: its -1 entries point at node
        # 0 instead (any node will do: the row emits nothing and its outputs are not read).
        path = res.path[:, :n_common].clamp_min(0)  # [B, n] node ids
        if n_common < res.path.shape[1]:  # a row that went deeper emits its next node instead
            deeper = tokens.gather(1, res.path[:, n_common : n_common + 1].clamp_min(0))[:, 0]
            next_tok = torch.where(res.num_accepted > n_common, deeper, res.next_token)
        else:
            next_tok = res.next_token
        emitted = torch.cat([tokens.gather(1, path), next_tok[:, None]], 1)  # [B, n+1]
        # ---- keep only [last, path] in the cache ------------------------------------------
        keep = torch.cat([path.new_zeros(B, 1), path + 1], 1)  # [B, n+1] forward positions
        compact_cache(cache, past_len, keep)
        if attn is not None:
            attn = torch.cat([attn, attn.new_ones(B, n_common + 1)], 1)
        next_pos = next_pos + n_common + 1
        last = next_tok
        result.rounds += 1
        result.draft_lens.append(int(node_depths(parents).max()) if N else 0)
        result.tree_sizes.append(N)
        result.accept_counts.append(count_emitted(emitted[:, :n_common], finished, state.eos_ids))
        if max_depth > 0:
            t0 = time.perf_counter()
            drafter.commit(n_common, emitted, _gather_out(out, keep))
            sync(device)
            result.draft_s += time.perf_counter() - t0
        del out
        # ---- emit, stop at EOS / budget ------------------------------------------------------
        new = emit(result, emitted, finished, state.eos)
        result.round_tokens.append(max(len(row) for row in new))
        generated += n_common + 1
        if stream is not None:
            stream(new)

    sync(device)
    result.total_s = time.perf_counter() - state.t_start - probe_s
    return result
