"""Tree structures and tree verification maths (decoding/tree.py structures, the tree parts
of decoding/verify.py), no model; the loops are tests/test_tree.py.

- static trees: order, parents, depths, ancestor mask; bad paths and kinds are refused;
- tree verification by exact enumeration: greedy on a hand-built tree; the sampling step's
  output distribution equals p for i.i.d., without-replacement and deterministic siblings
  (and a misapplied rule does not), also for the hybrid tree's root (a lookup node and pad
  copies grafted after sampled siblings); two levels deep, the second token follows p given
  the first.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from decoding.drafters.lookup import graft
from decoding.tree import DraftTree, TreeSpec, ancestor_mask, static_parents, static_tree
from decoding.verify import node_depths, tree_greedy_verify, tree_rejection_verify


# -- structures ------------------------------------------------------------------------------
def test_static_tree_order_parents_depths_and_mask():
    paths = ((1, 0), (0,), (1,), (0, 0), (1, 0, 2))
    assert static_tree(paths) == ((0,), (1,), (0, 0), (1, 0), (1, 0, 2))
    parents = torch.tensor([static_parents(paths)])
    assert parents.tolist() == [[-1, -1, 0, 1, 3]]
    assert node_depths(parents).tolist() == [[1, 1, 2, 2, 3]]
    mask = ancestor_mask(parents)[0].int()  # rows/cols: root, nodes 0..4
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 0, 1, 0, 1, 1],
    ]
    with pytest.raises(ValueError, match="no parent path"):
        TreeSpec(paths=((0,), (1, 0)))
    with pytest.raises(ValueError, match="kind"):
        TreeSpec(kind="beam")
    assert TreeSpec(paths=[[0], [0, 0]]).paths == ((0,), (0, 0))  # YAML lists accepted


# -- verification: exact ----------------------------------------------------------------------
def test_greedy_tree_verify_takes_the_longest_matching_path():
    tokens = torch.tensor([[5, 7, 3, 9, 4, 8], [5, 7, 3, 9, 4, 8]])
    parents = torch.tensor([[-1, -1, 0, 1, 1, 4]] * 2)
    # Argmax at [root, node0..node5]. Row 0: root->7 (node1), node1->4 (node4), node4->8
    # (node5), node5->2 (bonus). Row 1: root->6, nothing accepted, correction 6.
    target_tokens = torch.tensor([[7, 3, 4, 0, 0, 8, 2], [6, 3, 4, 0, 0, 8, 2]])
    res = tree_greedy_verify(tokens, parents, target_tokens)
    assert res.num_accepted.tolist() == [3, 0]
    assert res.path.tolist() == [[1, 4, 5], [-1, -1, -1]]
    assert res.next_token.tolist() == [2, 6]


def sibling_schemes(q: torch.Tensor, m: int):
    """Yield (probability, sibling tokens, per-sibling q_j or None) for every draw."""
    V = q.shape[0]
    yield "deterministic", [(1.0, q.topk(m).indices.tolist(), None)]
    iid = []
    for xs in itertools.product(range(V), repeat=m):
        iid.append((float(torch.prod(q[list(xs)])), list(xs), q.expand(m, V)))
    yield "iid", iid
    wor = []
    for xs in itertools.permutations(range(V), m):
        prob, qs, left = 1.0, [], q.clone()
        for x in xs:
            qs.append(left / left.sum())
            prob *= float(qs[-1][x])
            left[x] = 0
        wor.append((prob, list(xs), torch.stack(qs)))
    yield "without_replacement", wor


def one_level_output(p, tokens, q_nodes):
    """Exact distribution of the emitted token for a root with len(tokens) children:
    thresholds a_j read off tree_rejection_verify (all rejected: u = 1), checked by
    accepting each child with u just below its threshold."""
    m, V = len(tokens), p.shape[0]
    P = p.expand(1, m + 1, V)
    toks = torch.tensor([tokens])
    parents = torch.full((1, m), -1)
    Q = None if q_nodes is None else q_nodes[None]
    res, dist = tree_rejection_verify(toks, parents, Q, P, uniforms=torch.ones(1, m, dtype=p.dtype))
    a = res.accept_prob[0]
    assert res.num_accepted.item() == 0 and not torch.isnan(a).any()
    out, reach = torch.zeros(V, dtype=p.dtype), 1.0
    for j in range(m):
        if a[j] > 0:
            u = torch.ones(1, m, dtype=p.dtype)
            u[0, j] = a[j] * (1 - 1e-9)
            hit, _ = tree_rejection_verify(toks, parents, Q, P, uniforms=u)
            assert hit.path.tolist() == [[j]]
        out[tokens[j]] += reach * a[j]
        reach *= 1 - float(a[j])
    return out + reach * dist[0]


@pytest.mark.parametrize("m", [1, 2, 3])
def test_sibling_sampling_step_outputs_exactly_p(m):
    g = torch.Generator().manual_seed(m)
    p = torch.rand(4, generator=g, dtype=torch.float64) ** 3
    p[2] = 0.0  # a token the target never emits
    p /= p.sum()
    q = torch.rand(4, generator=g, dtype=torch.float64) + 0.05
    q /= q.sum()
    for name, draws in sibling_schemes(q, m):
        total = torch.zeros(4, dtype=torch.float64)
        for prob, tokens, q_nodes in draws:
            total += prob * one_level_output(p, tokens, q_nodes)
        torch.testing.assert_close(total, p, rtol=0, atol=1e-12, msg=name)
    if m > 1:  # power: draws without replacement judged as if i.i.d. are NOT lossless
        p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
        q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
        _, wor = list(sibling_schemes(q, m))[2]
        wrong = sum(prob * one_level_output(p, t, q.expand(m, 4)) for prob, t, _ in wor)
        assert (wrong - p).abs().max() > 0.04


@pytest.mark.parametrize("lookup_token", [0, 3])
def test_sampled_siblings_then_grafted_lookup_and_pad_nodes_output_exactly_p(lookup_token):
    """The hybrid tree's root (decoding/drafters/lookup.py: graft) over a batch of two rows
    with the same two sampled siblings (i.i.d. or without replacement, each with its q_j):
    row 1 grafts a lookup token (a new one-hot node, or, where a draw carries it, nothing),
    row 0 none, so it is padded with a copy of its node 0 whenever row 1 grew. Every draw of
    every scheme enumerated: each row's emitted token is exactly p. (With q far from p the
    residual after the siblings stays spread, so a grafted node judged by any q but its
    one-hot is off by up to 0.02 here: checked by making graft's q uniform.)"""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    q = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    for name, draws in list(sibling_schemes(q, 2))[1:]:  # i.i.d., without replacement
        totals = torch.zeros(2, 4, dtype=torch.float64)
        for prob, xs, q_nodes in draws:
            base = DraftTree(
                torch.tensor([xs, xs]), torch.full((2, 2), -1), q_nodes.expand(2, 2, 4)
            )
            tree = graft(base, [[], [lookup_token]])
            assert (tree.parents == -1).all()  # one level: every node below the root
            for row in range(2):
                out = one_level_output(p, tree.tokens[row].tolist(), tree.q[row])
                totals[row] += prob * out
        for row in range(2):
            torch.testing.assert_close(totals[row], p, rtol=0, atol=1e-12, msg=f"{name} row {row}")


def test_two_level_tree_sampling_is_exact():
    """Root children A0=0, A1=1; A0 has children 2, 3; A1 has child 0. The target's
    distribution after a depth-1 node is P2[its token]. Enumerate every accept/reject
    pattern: the first token is distributed as p, and when a second token is emitted in the
    same round it is distributed as P2[first token]."""
    g = torch.Generator().manual_seed(0)
    Vs = 4
    p = torch.rand(Vs, generator=g, dtype=torch.float64) ** 2
    p /= p.sum()
    P2 = torch.rand(Vs, Vs, generator=g, dtype=torch.float64) ** 2
    P2 /= P2.sum(-1, keepdim=True)
    tokens = torch.tensor([[0, 1, 2, 3, 0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1]])
    leaf = torch.full((Vs,), 1.0 / Vs, dtype=torch.float64)
    P = torch.stack([p, P2[0], P2[1], leaf, leaf, leaf])[None]  # [1, N+1, V]
    joint = torch.zeros(Vs, Vs, dtype=torch.float64)  # (first, second) emitted together
    first_only = torch.zeros(Vs, dtype=torch.float64)
    for pattern in itertools.product([0.0, 1.0], repeat=5):
        u = torch.tensor([pattern], dtype=torch.float64)
        res, dist = tree_rejection_verify(tokens, parents, None, P, uniforms=u)
        a = res.accept_prob[0]
        tried = ~torch.isnan(a)
        on_path = set(res.path[0][res.path[0] >= 0].tolist())
        if any(u[0, i] == 0 and i not in on_path for i in tried.nonzero()[:, 0].tolist()):
            continue  # u=0 rejected only because a=0: the u=1 pattern covers it
        if any(u[0, i] == 0 for i in (~tried).nonzero()[:, 0].tolist()):
            continue  # untried nodes: count the pattern once (u=1)
        w = 1.0
        for i in tried.nonzero()[:, 0].tolist():
            w *= float(a[i]) if i in on_path else 1 - float(a[i])
        path = [int(tokens[0, i]) for i in res.path[0] if i >= 0]
        if len(path) >= 2:
            joint[path[0], path[1]] += w
        elif len(path) == 1:
            joint[path[0]] += w * dist[0]
        else:
            first_only += w * dist[0]
    torch.testing.assert_close(joint.sum(1) + first_only, p, rtol=0, atol=1e-12)
    for y in (0, 1):
        assert joint[y].sum() > 0
        torch.testing.assert_close(joint[y] / joint[y].sum(), P2[y], rtol=0, atol=1e-12)
