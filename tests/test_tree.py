"""Tree decoding through the target and the loop (decoding/tree.py); the tree structures and
the verification maths are tests/test_tree_verify.py.

- the target's tree forward equals fresh forwards over each node's root path, and after KV
  compaction the next logits and the whole cache equal a fresh forward over the sequence;
- greedy tree decoding == the target's greedy output (fp32) for several tree shapes, with an
  oracle drafter, Medusa heads (static trees) and EAGLE heads (dynamic EAGLE-2 trees);
- sampling at T=1 through the whole loop matches the target's exact distribution (G-test).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.drafters.ngram import NgramDrafter
from decoding.metrics import evaluate
from decoding.spec import generate
from decoding.tree import (
    DEFAULT_PATHS,
    DraftTree,
    TreeSpec,
    compact_cache,
    dynamic_tree,
    select_nodes,
    static_parents,
    static_tree,
    tree_forward,
)
from decoding.verify import node_depths
from models import eagle, medusa
from tests.helpers import (
    PROMPTS,
    exact_triples,
    g_test,
    hf_greedy,
    left_pad,
    prompt_ids,
    untied_target,
)

torch.set_num_threads(1)
V = 128
SHAPES = {
    "default": DEFAULT_PATHS,
    "chain": ((0,), (0, 0), (0, 0, 0)),
    "wide": ((0,), (1,), (2,), (3,), (4,), (5,)),
    "uneven": ((0,), (1,), (1, 0), (1, 1), (1, 1, 0), (1, 1, 0, 0), (2,), (2, 0)),
}


@pytest.fixture(scope="module")
def target():
    return untied_target()


@pytest.fixture(scope="module")
def refs(target):
    return [hf_greedy(target, prompt_ids(target, p), 24, []) for p in PROMPTS]


# -- the EAGLE-2 tree builder (decoding/tree.py: dynamic_tree, select_nodes) ---------------------
def test_dynamic_tree_by_hand():
    """depth 3, top_k 2, 6 nodes over V = 4, scores worked out by hand (probabilities):
    level 1: c0 = tok 0 (.5), c1 = tok 1 (.3); expand c0 -> c2 = tok 1 (.4), c3 = tok 0 (.05)
    and c1 -> c4 = tok 0 (.21), c5 = tok 2 (.06); level 2's best are c2, c4 (parent rows 0, 1
    of the previous call): c2 -> c6 = tok 3 (.32), c7 = tok 2 (.04); c4 -> c8 = tok 0 (.126),
    c9 = tok 1 (.063). Kept: c0 c1 c2 c4 c6 c8 (in candidate order)."""
    rows = {
        1: [[0.1, 0.8, 0.05, 0.05], [0.7, 0.05, 0.2, 0.05]],
        2: [[0.05, 0.05, 0.1, 0.8], [0.6, 0.3, 0.05, 0.05]],
    }
    calls = []

    def expand(d, beam_ids, beam_parent):
        calls.append((d, beam_ids.tolist(), beam_parent.tolist()))
        return torch.tensor([rows[d]]).log()  # [1, 2, 4]

    first = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    ids, parents = dynamic_tree(first, expand, depth=3, top_k=2, num_nodes=6)
    assert calls == [(1, [[0, 1]], [[0, 0]]), (2, [[1, 0]], [[0, 1]])]
    assert ids.tolist() == [[0, 1, 1, 0, 3, 0]]
    assert parents.tolist() == [[-1, -1, 0, 1, 2, 3]]
    ids, parents = dynamic_tree(first, expand, depth=1, top_k=3, num_nodes=2)
    assert ids.tolist() == [[0, 1]] and parents.tolist() == [[-1, -1]]


def test_select_nodes_keeps_the_shallower_of_equal_scores_per_row():
    """Row 0: c1 (depth 1) and its equal-scored child c3 tie with c2: the stable sort keeps the
    earlier candidates c1, c2. Row 1: the best three are c0, c2 and c2's child c3."""
    ids = torch.tensor([[20, 21, 22, 23], [10, 11, 12, 13]])
    score = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, -2.0, -0.5, -1.0]])
    parent = torch.tensor([[-1, -1, 0, 1], [-1, -1, 0, 2]])
    kept, parents = select_nodes(ids, score, parent, num_nodes=3)
    assert kept.tolist() == [[20, 21, 22], [10, 12, 13]]
    assert parents.tolist() == [[-1, -1, 0], [-1, 0, 1]]
    kept, parents = select_nodes(ids, score, parent, num_nodes=9)  # more than the candidates
    assert kept.tolist() == ids.tolist() and parents.tolist() == parent.tolist()


# -- the target's tree forward and KV compaction --------------------------------------------------
def random_tree(paths, batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor(static_parents(paths)).expand(batch, -1)
    return torch.randint(6, V, parents.shape, generator=g), parents


def root_path(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


def test_tree_forward_equals_a_fresh_forward_per_node(target):
    ids = prompt_ids(target, PROMPTS[0])
    out = target(ids[:, :-1])
    tokens, parents = random_tree(DEFAULT_PATHS, 1, seed=0)
    next_pos = torch.tensor([ids.shape[1] - 1])
    tree_out = tree_forward(target, out.cache, ids[:, -1], tokens, parents, next_pos, None)
    fresh = target(ids, use_cache=False).logits[0, -1]
    torch.testing.assert_close(tree_out.logits[0, 0], fresh, rtol=1e-5, atol=1e-5)
    for i in range(tokens.shape[1]):
        seq = torch.cat([ids[0], tokens[0, root_path(parents[0].tolist(), i)]])[None]
        fresh = target(seq, use_cache=False).logits[0, -1]
        torch.testing.assert_close(tree_out.logits[0, i + 1], fresh, rtol=1e-5, atol=1e-5)


def test_compacted_cache_equals_decoding_the_accepted_path(target):
    """Left-padded batch of two rows, each keeping a different root path of the tree."""
    rows = [prompt_ids(target, PROMPTS[0]), prompt_ids(target, PROMPTS[1])]
    ids, mask = left_pad(rows, target.tokenizer.pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = target(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1])
    past = out.cache.get_seq_length()
    tokens, parents = random_tree(SHAPES["uneven"], 2, seed=1)
    tree_forward(target, out.cache, ids[:, -1], tokens, parents, positions[:, -1], mask[:, :-1])
    paths = [root_path(parents[0].tolist(), 5), root_path(parents[1].tolist(), 7)]  # depths 4, 2
    n = 2  # the batch keeps the common depth
    keep = torch.tensor([[0] + [i + 1 for i in path[:n]] for path in paths])
    compact_cache(out.cache, past, keep)
    assert out.cache.get_seq_length() == past + n + 1
    nxt = torch.tensor([[11], [12]])
    attn = torch.cat([mask, torch.ones(2, n + 1, dtype=mask.dtype)], 1)
    step = target(nxt, cache=out.cache, attention_mask=attn, position_ids=positions[:, -1:] + n + 1)
    for b, path in enumerate(paths):
        real = rows[b][0]
        seq = torch.cat([real, tokens[b, path[:n]], nxt[b]])[None]
        fresh = target(seq, use_cache=True)
        torch.testing.assert_close(step.logits[b, -1], fresh.logits[0, -1], rtol=1e-5, atol=1e-5)
        pad = ids.shape[1] - real.shape[0]
        for layer, ref in zip(out.cache.layers, fresh.cache.layers):
            torch.testing.assert_close(layer.keys[b, :, pad:], ref.keys[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                layer.values[b, :, pad:], ref.values[0], rtol=1e-5, atol=1e-5
            )


# -- greedy decoding is the target's greedy output ------------------------------------------------
class OracleTreeDrafter:
    """Knows the reference continuation; puts the right token at a random rank per depth
    and, with probability `miss`, a wrong one, so accepted paths run down random branches
    and stop at random depths."""

    hidden_layers = ()
    vocab_size = None  # any target's

    def __init__(self, ref: list[int], miss: float, seed: int = 0):
        self.ref, self.miss, self.rng = ref, miss, random.Random(seed)

    def prefill(self, input_ids, target_out, attention_mask=None):
        self.pos = 1  # ref[0] is the prefill's token (`last`)

    def propose_tree(self, last_tokens, tree, sampling, generator=None, max_depth=None):
        paths = static_tree(tuple(p for p in tree.paths if len(p) <= max_depth))
        depth = max(map(len, paths))
        good = [self.rng.choice(sorted({p[d] for p in paths if len(p) > d})) for d in range(depth)]
        tokens = []
        for path in paths:
            d = len(path)
            on_track = list(path) == good[:d] and self.pos + d - 1 < len(self.ref)
            right = self.ref[self.pos + d - 1] if on_track else -1
            tok = right if on_track and self.rng.random() > self.miss else None
            tokens.append(tok if tok is not None else (right + 1 + 7 * path[-1]) % V)
        parents = torch.tensor([static_parents(paths)])
        return DraftTree(torch.tensor([tokens]), parents, None)

    def commit(self, num_accepted, emitted, target_out):
        self.pos += emitted.shape[1]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_tree_decoding_equals_target_greedy(target, refs, shape):
    paths = SHAPES[shape]
    paths = tuple(tuple(min(r, 3) for r in p) for p in paths) if shape != "wide" else paths
    accepted = []
    for i, (text, ref) in enumerate(zip(PROMPTS, refs)):
        drafter = OracleTreeDrafter(ref, miss=0.35, seed=i)
        out = generate(
            target, prompt_ids(target, text), drafter, tree=TreeSpec(paths=paths),
            max_new_tokens=24, eos_token_ids=[],
        )  # fmt: skip
        assert out.sequences == [ref]
        assert out.tree_sizes[0] == len(paths)  # later rounds near the budget are pruned
        accepted += out.accept_counts
    depth = max(map(len, paths))
    assert max(accepted) >= min(2, depth) and 0 in accepted  # deep paths and corrections


class FirstCandidateOracle:
    """A batch: row b's first-candidate path (0, 0, ...) holds refs[b] up to new token
    stops[b] and a wrong token after it; every other node is wrong too."""

    hidden_layers = ()
    vocab_size = None  # any target's

    def __init__(self, refs: list[list[int]], stops: list[int]):
        self.refs, self.stops = refs, stops

    def prefill(self, input_ids, target_out, attention_mask=None):
        self.pos = 1  # refs[b][0] is the prefill's token (`last`)

    def propose_tree(self, last_tokens, tree, sampling, generator=None, max_depth=None):
        paths = static_tree(tuple(p for p in tree.paths if len(p) <= max_depth))
        tokens = []
        for ref, stop in zip(self.refs, self.stops):
            row = []
            for path in paths:
                i = self.pos + len(path) - 1  # the new token this node would be
                good = i < stop and not any(path)
                row.append(ref[i] if good else (ref[i] + 1 + path[-1]) % V)
            tokens.append(row)
        parents = torch.tensor([static_parents(paths)] * len(self.refs))
        return DraftTree(torch.tensor(tokens), parents, None)

    def commit(self, num_accepted, emitted, target_out):
        self.pos += emitted.shape[1]


def test_tree_batch_keeps_decoding_after_a_row_stops(target, refs):
    """Row 0 stops at EOS (new token 2) in round 1 and then rejects every node, while row 1
    keeps accepting whole paths: the common depth n >= 1 exceeds row 0's accepted depth."""
    eos = refs[0][2]
    assert eos not in refs[0][:2] and eos not in refs[1]
    ids, mask = left_pad(
        [prompt_ids(target, p) for p in PROMPTS[:2]], target.tokenizer.pad_token_id
    )
    drafter = FirstCandidateOracle(refs[:2], stops=[3, len(refs[1])])
    out = generate(
        target, ids, drafter, tree=TreeSpec(), max_new_tokens=24, attention_mask=mask,
        eos_token_ids=[eos],
    )  # fmt: skip
    assert out.sequences == [refs[0][:3], refs[1]]
    assert out.accept_counts[:2] == [2, 4]  # round 2: row 1 alone accepts the full depth
    assert len(out.sequences[1]) == 1 + out.rounds + sum(out.accept_counts)  # τ is row 1's


def test_tree_accepted_nodes_after_eos_are_not_counted(target, refs):
    # Round 1's accepted path is [x, EOS, y, z] (depth 4), but the row stops at EOS.
    eos = refs[0][2]
    drafter = FirstCandidateOracle(refs[:1], stops=[len(refs[0])])
    out = generate(
        target, prompt_ids(target, PROMPTS[0]), drafter, tree=TreeSpec(), max_new_tokens=24,
        eos_token_ids=[eos],
    )  # fmt: skip
    assert out.sequences == [refs[0][:3]] and out.draft_lens == [4]
    assert out.accept_counts == [2] and out.round_tokens == [2] and out.tau == 2.0  # no bonus


@pytest.mark.parametrize("shape", ["default", "uneven"])
def test_medusa_static_tree_greedy_equals_target_greedy_padded(target, refs, shape):
    heads = medusa.from_target(target, num_heads=4)
    ids, mask = left_pad([prompt_ids(target, p) for p in PROMPTS], target.tokenizer.pad_token_id)
    out = generate(
        target, ids, make_drafter(heads, target), tree=TreeSpec(paths=SHAPES[shape]),
        max_new_tokens=24, attention_mask=mask, eos_token_ids=[],
    )  # fmt: skip
    assert out.sequences == refs
    single = generate(
        target, prompt_ids(target, PROMPTS[1]), make_drafter(heads, target),
        tree=TreeSpec(paths=SHAPES[shape]), max_new_tokens=24, eos_token_ids=[],
    )  # fmt: skip
    assert single.sequences == [refs[1]] and single.tau > 1.0


def build_eagle(target):
    torch.manual_seed(0)
    counts = torch.randint(0, 1000, (V,), generator=torch.Generator().manual_seed(0))
    # A random (not identity) start: its drafts are accepted sometimes and rejected sometimes,
    # which the sampling test needs to exercise both branches.
    return eagle.from_target(
        target, counts, style="eagle3", ttt_steps=2, vocab_size=64, init="random"
    )


@pytest.mark.parametrize("depth, top_k, num_nodes", [(1, 3, 3), (3, 2, 6), (4, 3, 12)])
def test_eagle_dynamic_tree_greedy_equals_target_greedy_padded(
    target, refs, depth, top_k, num_nodes
):
    draft = build_eagle(target)
    tree = TreeSpec(kind="dynamic", depth=depth, top_k=top_k, num_nodes=num_nodes)
    ids, mask = left_pad([prompt_ids(target, p) for p in PROMPTS], target.tokenizer.pad_token_id)
    out = generate(
        target, ids, make_drafter(draft, target), tree=tree, max_new_tokens=24,
        attention_mask=mask, eos_token_ids=[],
    )  # fmt: skip
    assert out.sequences == refs
    assert out.tree_sizes[0] == num_nodes and out.draft_lens[0] == depth


def test_eagle_tree_nodes_are_the_drafts_top_k_along_their_path(target):
    """Every node's token is among the top_k of the draft's distribution after its root
    path, computed step by step with a fresh drafter (own cache, chain positions)."""
    draft = build_eagle(target)
    ids = prompt_ids(target, PROMPTS[2])
    tree_spec = TreeSpec(kind="dynamic", depth=3, top_k=3, num_nodes=10)
    prompt_out = target(ids[:, :-1], hidden_layers=draft.hidden_layers)
    drafter = make_drafter(draft, target)
    drafter.prefill(ids[:, :-1], prompt_out)
    tree = drafter.propose_tree(ids[:, -1], tree_spec, Sampling())
    parents = tree.parents[0].tolist()
    assert len(parents) == 10 and all(-1 <= p < i for i, p in enumerate(parents))
    assert max(node_depths(tree.parents)[0].tolist()) == 3
    vocab_ids = draft.vocab_ids()
    for i in range(10):
        ref = make_drafter(draft, target)
        ref.prefill(ids[:, :-1], prompt_out)
        start = ids.shape[1] - 1
        h = ref._run(ref.pending_feature, torch.cat([ref.pending_tokens, ids[:, -1:]], 1), 0)
        h = h[:, -1:]
        for j, node in enumerate(root_path(parents, i)[:-1]):
            h = ref._run(h, tree.tokens[:, node : node + 1], start + j)
        logits = draft.logits(h, ref.head)[0, 0]
        assert int(tree.tokens[0, i]) in vocab_ids[logits.topk(3).indices].tolist()


# -- sampling through the loop: G-test at T=1 --------------------------------------------------
N_SINGLE = 300


@pytest.mark.parametrize("kind", ["medusa_static", "eagle_dynamic"])
def test_tree_sampling_matches_target_distribution(target, kind):
    sampling = Sampling(temperature=1.0)
    ids = prompt_ids(target, "hello there")
    table = exact_triples(target, ids, sampling, min_p=5 / N_SINGLE)
    assert len(table) >= 8
    if kind == "medusa_static":
        drafter = make_drafter(medusa.from_target(target), target)
        tree = TreeSpec(paths=((0,), (1,), (2,), (0, 0), (0, 1), (1, 0)))
    else:
        drafter = make_drafter(build_eagle(target), target)
        tree = TreeSpec(kind="dynamic", depth=2, top_k=3, num_nodes=6)
    gen = torch.Generator().manual_seed(0)
    samples, accepts = [], []
    for _ in range(N_SINGLE):
        out = generate(
            target, ids, drafter, tree=tree, sampling=sampling, max_new_tokens=4,
            generator=gen, eos_token_ids=[],
        )  # fmt: skip
        samples.append(tuple(out.sequences[0][:3]))
        accepts.append(out.accept_counts[0])
    assert {0, 1} <= set(accepts)  # rejections and acceptances both exercised
    assert g_test(samples, table) > 1e-3


def test_sampled_medusa_tree_q_is_each_nodes_conditional(target):
    drafter = make_drafter(medusa.from_target(target), target)
    ids = prompt_ids(target, "hi")
    drafter.prefill(ids, target(ids, hidden_layers=(-1,)))
    tree = drafter.propose_tree(
        ids[:, -1], TreeSpec(paths=((0,), (1,), (2,), (0, 0))), Sampling(temperature=0.8, top_k=2),
        torch.Generator().manual_seed(0),
    )  # fmt: skip
    q = tree.q[0]
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    t = tree.tokens[0].tolist()
    assert len(set(t[:3])) == 3  # siblings drawn without replacement
    assert q[0, t[0]] > 0 and q[1, t[0]] == 0  # sibling 2's q excludes sibling 1's token
    assert (q[1] > 0).sum() == 1  # top_k=2: one token left for the 2nd draw
    assert q[2, t[2]] == 1.0  # support used up: the 3rd candidate is deterministic


# -- errors and metrics ----------------------------------------------------------------------------
def test_bad_tree_requests_say_what_to_do(target):
    ids = prompt_ids(target, "hi")
    with pytest.raises(ValueError, match="cannot draft trees"):
        generate(target, ids, NgramDrafter(vocab_size=V), tree=TreeSpec())
    with pytest.raises(ValueError, match="static trees"):
        generate(target, ids, make_drafter(medusa.from_target(target), target),
                 tree=TreeSpec(kind="dynamic"))  # fmt: skip
    with pytest.raises(ValueError, match="dynamic"):
        generate(target, ids, make_drafter(build_eagle(target), target), tree=TreeSpec())


def test_evaluate_reports_tree_size_and_tau(target):
    prompts = [prompt_ids(target, p) for p in PROMPTS[:2]]
    drafter = make_drafter(medusa.from_target(target), target)
    m = evaluate(target, drafter, prompts, tree=TreeSpec(), max_new_tokens=16, eos_token_ids=[])
    # 15 nodes per round except rounds pruned to the token budget (max_new_tokens=16)
    assert 12 < m["tree_size"] < len(DEFAULT_PATHS) and m["k"] == 4
    assert m["tree"]["kind"] == "static" and m["greedy_exact_match"] == 1.0
    assert m["tau"] > 1.0 and len(m["alpha"]) == 4


@pytest.mark.parametrize("decode, kind", [("tree_static", "medusa"), ("tree_dynamic", "eagle")])
def test_checkpoint_evaluation_uses_the_configured_tree(target, decode, kind):
    from hydra import compose, initialize_config_dir

    from train.eval.evaluate import evaluate_checkpoint
    from train.run.settings import eval_settings

    conf = str(Path(__file__).resolve().parents[1] / "conf")
    overrides = [f"decode={decode}", "decode.temperatures=[0.0,1.0]", "decode.max_new_tokens=12"]
    with initialize_config_dir(config_dir=conf, version_base=None):
        cfg = compose(
            "train", overrides=[*overrides, "decode.dtype=fp32", "decode.same_dtype_ar=true"]
        )
    draft = medusa.from_target(target) if kind == "medusa" else build_eagle(target)
    prompts = [{"input_ids": prompt_ids(target, p)[0].tolist()} for p in PROMPTS]
    result, _ = evaluate_checkpoint(target, draft, prompts, eval_settings(cfg), last_train=None)
    assert result["greedy/tree"]["kind"] == cfg.decode.tree.kind
    assert 0 < result["greedy/tree_size"] <= 16 and result["T1/tree_size"] > 0
    assert result["greedy/greedy_exact_match"] == 1.0
