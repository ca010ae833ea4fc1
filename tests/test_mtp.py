"""MTP heads (models/mtp.py) on the tiny random target: alignment, causality, training, drafting."""

import pytest
import torch
import torch.nn.functional as F

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from decoding.verify import sampling_probs
from models.mtp import MTP, from_target
from models.protocol import DraftModel
from models.target_loaders import build_tiny_random
from train.eval.plan import decode_copy, draft_decode_copy

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target():
    return build_tiny_random(seed=0, device="cpu")


def make_mtp(target, num_depths=2, seed=0, **kw) -> MTP:
    torch.manual_seed(seed)
    return from_target(target, num_depths=num_depths, **kw)


def loop_loss(target, model, input_ids, decay=0.8):
    """The training loop's objective: forward KL per offset, weights decay**i (see the brief)."""
    out = target(input_ids, hidden_layers=model.hidden_layers)
    draft = model(target, input_ids, out)
    T = input_ids.shape[1]
    total = 0.0
    for i, (logits, off) in enumerate(zip(draft.logits, draft.offsets)):
        q = logits[:, : T - off].log_softmax(-1)
        p = out.logits[:, off:].log_softmax(-1)
        total = total + decay**i * F.kl_div(q, p, log_target=True, reduction="none").sum(-1).mean()
    return total


def test_contract_offsets_shapes_and_state_dict(target):
    model = make_mtp(target, num_depths=3)
    assert isinstance(model, DraftModel)
    ids = torch.randint(3, 128, (2, 9))
    out = model(target, ids, target(ids, hidden_layers=model.hidden_layers))
    assert out.offsets == [1, 2, 3]
    assert [tuple(x.shape) for x in out.logits] == [(2, 9, 128)] * 3
    for d, logits in enumerate(out.logits, start=1):  # positions t >= T-d have no x_{t+d}
        assert torch.equal(logits[:, 9 - d :], torch.zeros_like(logits[:, 9 - d :]))
        assert logits[:, : 9 - d].abs().amax(-1).amin() > 0  # every real position predicts
    keys = list(model.state_dict())
    assert not any("embed_tokens" in k or "lm_head" in k for k in keys)  # frozen: in the target
    reloaded = make_mtp(target, num_depths=3, seed=1)
    reloaded.load_state_dict(model.state_dict(), strict=True)
    again = reloaded(target, ids, target(ids, hidden_layers=(-1,)))
    assert all(torch.equal(a, b) for a, b in zip(out.logits, again.logits))


@pytest.mark.parametrize("changed", [4, 7])
def test_depth_d_at_t_sees_exactly_tokens_up_to_t_plus_d(target, changed):
    """Causality and the off-by-one in one: changing x_j must leave depth d's logits at
    t < j-d untouched (no peeking at x_{t+d+1}, the token it predicts) and change them at
    t = j-d (module d reads x_{t+d} itself, not x_{t+d-1})."""
    model = make_mtp(target, num_depths=3)
    ids = torch.randint(3, 128, (1, 12))
    ids2 = ids.clone()
    ids2[0, changed] = (ids[0, changed] + 5) % 128
    out1 = model(target, ids, target(ids, hidden_layers=(-1,)))
    out2 = model(target, ids2, target(ids2, hidden_layers=(-1,)))
    for d, (a, b) in enumerate(zip(out1.logits, out2.logits), start=1):
        diff = (a - b).abs().amax(-1)[0]  # [T]
        assert diff[: changed - d].max() < 1e-5, f"depth {d} sees a token after x_(t+{d})"
        assert diff[changed - d] > 1e-2, f"depth {d} at t does not read x_(t+{d})"


def test_depth_d_learns_x_t_plus_d_plus_1(target):
    """Sequences of pairs (a, f(a)) with a random and f a fixed permutation: x_{t+d+1} is
    predictable from x_{t+d} alone when t+d+1 is odd. Trained with the protocol pairing
    (logits[i][:, t] vs token x_{t+offsets[i]+1}), each depth must reach ~100% there; a module
    reading x_{t+d-1} instead stays at chance (1/16)."""
    torch.manual_seed(0)
    alphabet = torch.arange(20, 36)  # 16 ordinary tokens
    f = alphabet[torch.randperm(16)]

    def batch(B=32, pairs=8):
        a = torch.randint(0, 16, (B, pairs))
        return torch.stack([alphabet[a], f[a]], dim=-1).reshape(B, 2 * pairs)  # [B, 16]

    model = make_mtp(target, num_depths=2)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(120):
        ids = batch()
        out = model(target, ids, target(ids, hidden_layers=(-1,)))
        loss = 0.0
        for logits, off in zip(out.logits, out.offsets):
            labels = ids[:, off + 1 :]  # x_{t+off+1}
            pred = logits[:, : labels.shape[1]]
            odd = (torch.arange(labels.shape[1]) + off + 1) % 2 == 1  # label index odd
            loss = loss + F.cross_entropy(pred[:, odd].flatten(0, 1), labels[:, odd].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    ids = batch(B=64)
    with torch.no_grad():
        out = model(target, ids, target(ids, hidden_layers=(-1,)))
    for logits, off in zip(out.logits, out.offsets):
        labels = ids[:, off + 1 :]
        odd = (torch.arange(labels.shape[1]) + off + 1) % 2 == 1
        acc = (logits[:, : labels.shape[1]].argmax(-1) == labels)[:, odd].float().mean().item()
        assert acc > 0.9, f"offset {off}: accuracy {acc:.2f} on x_(t+{off}+1)"


def test_one_step_lowers_the_loop_loss(target):
    model = make_mtp(target)
    ids = torch.randint(3, 128, (4, 24))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = loop_loss(target, model, ids)
    opt.zero_grad()
    before.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert target.lm_head.weight.grad is None  # the target stays frozen
    opt.step()
    with torch.no_grad():
        after = loop_loss(target, model, ids)
    assert after < before - 1e-3


# ------------------------------------------------------------------------------------
# Drafting
# ------------------------------------------------------------------------------------


@torch.no_grad()
def reference_q(model, target, committed, last, drafts, sampling):
    """Draft distributions recomputed from scratch, no caches: module j at position P for
    j <= D, then module D at P+1, P+2, ... fed its own previous output (recursive_last); a
    one-layer draft feeds each output's final norm (MTP.feed)."""
    D = model.num_depths
    P = committed.shape[1] - 1
    seq = torch.cat([committed, last[:, None], drafts], 1)  # x_0..x_{P+1}, d_1..d_k
    emb = target.embed_tokens(seq)
    h = target(committed, hidden_layers=(-1,)).hidden[-1]  # h^0 [B, P+1, H]

    def run(module, prev, first_token):
        L = prev.shape[1]
        cos_sin = model.rotary(prev, torch.arange(L)[None])
        return module(prev, emb[:, first_token : first_token + L], cos_sin)

    qs, inputs = [], h  # what depth j reads: h^0, then depth j-1's output as fed
    for j in range(1, min(drafts.shape[1], D) + 1):
        module = model.module(j)
        out = run(module, inputs[:, : P + 1], j)
        qs.append(sampling_probs(model.head(target, module, out[:, -1]), sampling))
        depth_inputs, inputs = inputs, model.feed(j, out)  # normed with one_layer
    recursive = [inputs[:, -1]]
    for _ in range(D + 1, drafts.shape[1] + 1):
        prev = torch.cat([depth_inputs[:, : P + 1], torch.stack(recursive, 1)], 1)
        out = run(model.module(D), prev, D)[:, -1]
        qs.append(sampling_probs(model.head(target, model.module(D), out), sampling))
        recursive.append(model.feed(D, out))
    return torch.stack(qs, 1)  # [B, k, V]


@pytest.mark.parametrize("served", [False, True])
def test_drafter_caches_and_rollback_match_recompute(target, served):
    """Random k (1..4 with D=2: recursion included) and random accepted counts n (0..k, full
    accepts with a bonus too): every round's q must equal a from-scratch recomputation, so
    the per-module caches are caught up and rolled back exactly. Served: one Qwen3 module for
    both depths, each depth (and the recursion) fed the previous output's final norm."""
    model = make_mtp(target, num_depths=2, one_layer=served, qk_norm=served)
    if served:  # every weight off its init: a norm left out or fed twice shows
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    drafter = make_drafter(model, target)
    sampling = Sampling(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    rng = torch.Generator().manual_seed(1)
    committed = torch.randint(3, 128, (2, 6), generator=rng)
    drafter.prefill(committed, target(committed, hidden_layers=(-1,)))
    last = torch.randint(3, 128, (2,), generator=rng)
    seen_n = set()
    for k in [3, 1, 4, 2, 4, 1, 3, 4, 2, 3]:
        drafts, q = drafter.propose(last, k, sampling, gen)
        assert drafts.shape == (2, k) and q.shape == (2, k, 128)
        torch.testing.assert_close(
            q, reference_q(model, target, committed, last, drafts, sampling), atol=2e-5, rtol=1e-4
        )
        n = int(torch.randint(0, k + 1, (1,), generator=rng))
        seen_n.add((n, k))
        correction = torch.randint(3, 128, (2,), generator=rng)
        emitted = torch.cat([drafts[:, :n], correction[:, None]], 1)
        kept = torch.cat([committed, last[:, None], drafts[:, :n]], 1)
        hidden = target(kept, hidden_layers=(-1,))
        drafter.commit(
            n, emitted, hidden.__class__(None, {-1: hidden.hidden[-1][:, -(n + 1) :]}, None)
        )
        committed, last = kept, correction
    assert any(n == k for n, k in seen_n) and any(0 < n < k for n, k in seen_n)


def test_left_padded_row_drafts_like_the_unpadded_row(target):
    """A row with 3 left pads must get the same draft distributions as that row alone."""
    model = make_mtp(target, num_depths=2)
    rng = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 128, (1, 5), generator=rng)
    other = torch.randint(3, 128, (1, 8), generator=rng)
    padded = torch.cat([other, torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt], 1)])
    mask = torch.ones_like(padded)
    mask[1, :3] = 0

    def features(ids, attn):
        pos = (attn.cumsum(-1) - 1).clamp_min(0)
        return target(ids, attention_mask=attn, position_ids=pos, hidden_layers=(-1,))

    batch, alone = make_drafter(model, target), make_drafter(model, target)
    batch.prefill(padded, features(padded, mask), attention_mask=mask)
    alone.prefill(prompt, features(prompt, torch.ones_like(prompt)))
    kept_b, kept_a = padded, prompt
    # Sampled rounds compare q exactly (k=1: q does not depend on an earlier sample); greedy
    # rounds compare longer chains (recursion included) and commit partial accepts.
    for k, n, sampling in [
        (1, 0, Sampling(1.0)),
        (3, 2, Sampling()),
        (1, 0, Sampling(1.0)),
        (4, 3, Sampling()),
        (2, 2, Sampling()),
        (1, 0, Sampling(1.0)),
    ]:
        last = torch.randint(3, 128, (2,), generator=rng)
        d_b, q_b = batch.propose(last, k, sampling)
        d_a, q_a = alone.propose(last[1:], k, sampling)
        if sampling.greedy:
            assert torch.equal(d_b[1:], d_a)
        else:
            torch.testing.assert_close(q_b[1:], q_a, atol=2e-5, rtol=1e-4)  # n = 0 here
        emitted = torch.cat([d_b[:, :n], last[:, None]], 1)  # any correction token will do
        kept_b = torch.cat([kept_b, last[:, None], d_b[:, :n]], 1)
        kept_a = torch.cat([kept_a, last[1:, None], d_a[:, :n]], 1)
        mask = torch.cat([mask, torch.ones(2, n + 1, dtype=torch.long)], 1)
        out_b = features(kept_b, mask)
        out_a = features(kept_a, torch.ones_like(kept_a))
        batch.commit(n, emitted, type(out_b)(None, {-1: out_b.hidden[-1][:, -(n + 1) :]}, None))
        alone.commit(n, emitted[1:], type(out_a)(None, {-1: out_a.hidden[-1][:, -(n + 1) :]}, None))


def test_drafter_refuses_k_beyond_depths_without_recursion(target):
    model = make_mtp(target, num_depths=2, recursive_last=False)
    drafter = make_drafter(model, target)
    ids = torch.randint(3, 128, (1, 5))
    drafter.prefill(ids, target(ids, hidden_layers=(-1,)))
    drafts, q = drafter.propose(ids[:, -1], 2, Sampling(), None)
    assert drafts.shape == (1, 2) and q is None
    with pytest.raises(ValueError, match="recursive_last"):
        drafter.propose(ids[:, -1], 3, Sampling(), None)


def distill(target) -> MTP:
    """An MTP draft distilled (loop loss) on the target's own greedy continuations, so that
    drafts get accepted and the decoder exercises partial and full accepts."""
    torch.manual_seed(0)
    prompts = torch.randint(3, 128, (16, 6))
    seqs = generate(target, prompts, None, max_new_tokens=26, eos_token_ids=[]).sequences
    data = torch.cat([prompts, torch.tensor(seqs)], 1)  # [16, 32]
    model = make_mtp(target)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(60):
        loss = loop_loss(target, model, data[(step % 2) * 8 : (step % 2) * 8 + 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.fixture(scope="module")
def distilled(target):
    return distill(target)


@pytest.fixture(scope="module")
def qwen3_target():
    """An untied output head: the tied tiny Llama's greedy output just repeats the last prompt
    token (its logits are ~emb(x)·emb(x)), this one's greedy and sampled outputs vary."""
    return build_tiny_random(seed=0, arch="qwen3", device="cpu")


@pytest.fixture(scope="module")
def qwen3_distilled(qwen3_target):
    return distill(qwen3_target)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_spec_equals_target_greedy(target, distilled, k):
    torch.manual_seed(1)
    # Two rows of different lengths, left-padded: exercises the drafter's padding path.
    ids = torch.randint(3, 128, (2, 7))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = target.tokenizer.pad_token_id, 0
    ref = generate(target, ids, None, max_new_tokens=40, attention_mask=mask, eos_token_ids=[])
    spec = generate(
        target,
        ids,
        make_drafter(distilled, target),
        k=k,
        max_new_tokens=40,
        attention_mask=mask,
        eos_token_ids=[],
    )
    assert spec.sequences == ref.sequences
    assert sum(spec.accept_counts) > 0  # drafts were accepted: rollback paths were taken
    single = generate(
        target, ids[:1], make_drafter(distilled, target), k=k, max_new_tokens=40, eos_token_ids=[]
    )
    assert single.sequences[0] == ref.sequences[0]
    assert single.tau > 1.2


# bf16 decoding (design.md §3: in bf16, 1-row and k-row kernels round differently). bf16 keeps
# 8 significant bits (relative rounding 2^-9 per operation); through the target's layers and
# one MTP module, logits of size |l| <= 5 move by ~0.03 (measured: bf16 vs fp32 target logits
# differ by <= 0.025, draft log q by <= 0.06 on likely tokens). Two bf16 kernels then disagree
# by at most ~0.05, so logits within BF16_TIE = 0.1 of each other are a tie that rounding may
# break either way. (This target's bf16 top-2 margin is > 0.1 at 32 of the 40 greedy steps
# checked, median ~0.2, so a token that is not the target's choice shows at most steps.)
BF16_TIE = 0.1


def test_bf16_greedy_spec_equals_bf16_target_greedy(qwen3_target, qwen3_distilled):
    """bf16 copies built as the per-checkpoint evaluation builds them (float32 rotary):
    greedy spec decoding must emit the bf16 target's own greedy AR output (the same loop,
    drafter=None) token for token, except that the two may part at a bf16 tie; and every
    emitted token must be the bf16 target's argmax up to such a tie. The drafts must be
    accepted (tau), so the bf16 drafter's caches and rollback are exercised."""
    target16 = decode_copy(qwen3_target, torch.bfloat16)
    model16 = draft_decode_copy(qwen3_distilled, torch.bfloat16)
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(3))
    ar = generate(target16, ids, None, max_new_tokens=40, eos_token_ids=[])
    for k in (2, 4):  # k = 4 > 2 modules: recursive drafts too
        spec = generate(
            target16, ids, make_drafter(model16, target16), k=k, max_new_tokens=40, eos_token_ids=[]
        )
        assert spec.tau > 1.8, f"k={k}: bf16 drafts rarely accepted, tau {spec.tau:.2f}"
        for b, (row, ar_row) in enumerate(zip(spec.sequences, ar.sequences)):
            with torch.no_grad():
                full = torch.tensor([ids[b].tolist() + row])
                logits = target16(full).logits[0, ids.shape[1] - 1 : -1].float()  # [40, V]
            chosen = logits.gather(-1, torch.tensor(row)[:, None])[:, 0]  # [40]
            gap = logits.max(-1).values - chosen
            assert gap.max() <= BF16_TIE, f"k={k} row {b}: token {int(gap.argmax())} not argmax"
            part = next((i for i, (a, r) in enumerate(zip(row, ar_row)) if a != r), None)
            if part is not None:  # same prefix, so logits[part] is the AR step's p
                tie = (logits[part, row[part]] - logits[part, ar_row[part]]).abs()
                assert tie <= BF16_TIE, f"k={k} row {b}: spec and AR part at {part}, no tie"


def test_bf16_drafter_q_matches_fp32_reference(qwen3_target, qwen3_distilled):
    """The bf16 drafter, driven through rounds of propose/commit (k up to 4 > 2 modules,
    partial and full accepts), must draw every draft from q within bf16 rounding of the
    fp32 draft's distribution recomputed from scratch (reference_q) for the same tokens.
    At temperature 0.7 a logit error of 0.06 moves q by a factor <= e^(2*0.06/0.7) ~ 1.19:
    measured TV <= 0.009 here; 0.03 leaves room for other CPUs, while drafting bugs move q
    far more (measured: module j reading x_(t+j-1): TV 0.78; commit keeping an uncommitted
    cache entry: 0.09; recursion fed h^(D-1): 0.31)."""
    target16 = decode_copy(qwen3_target, torch.bfloat16)
    drafter = make_drafter(draft_decode_copy(qwen3_distilled, torch.bfloat16), target16)
    sampling = Sampling(temperature=0.7)
    gen, rng = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    committed = torch.randint(3, 128, (2, 8), generator=rng)
    drafter.prefill(committed, target16(committed, hidden_layers=(-1,)))
    last = torch.randint(3, 128, (2,), generator=rng)
    for k, n in [(3, 1), (1, 0), (4, 2), (2, 2), (4, 4), (3, 0), (4, 3)]:
        drafts, q = drafter.propose(last, k, sampling, gen)
        assert q.dtype == torch.float32  # verification divides by q: never bf16
        ref = reference_q(qwen3_distilled, qwen3_target, committed, last, drafts, sampling)
        tv = 0.5 * (q - ref).abs().sum(-1)  # [B, k]
        assert tv.max() < 0.03, f"k={k}: TV(q_bf16, q_fp32) per draft {tv.tolist()}"
        correction = torch.randint(3, 128, (2,), generator=rng)
        kept = torch.cat([committed, last[:, None], drafts[:, :n]], 1)
        out = target16(kept, hidden_layers=(-1,))
        drafter.commit(
            n,
            torch.cat([drafts[:, :n], correction[:, None]], 1),
            type(out)(None, {-1: out.hidden[-1][:, -(n + 1) :]}, None),
        )
        committed, last = kept, correction


def test_served_layout_is_one_qwen3_module_and_decodes_losslessly(target):
    """one_layer + qk_norm: one module's weights whatever num_depths (q/k norms in its
    attention), and its chain decode reproduces the target's greedy output."""
    model = make_mtp(target, num_depths=3, one_layer=True, qk_norm=True)
    keys = set(model.state_dict())
    assert {k.split(".")[1] for k in keys if k.startswith("depths.")} == {"0"}
    assert {
        "depths.0.block.self_attn.q_norm.weight",
        "depths.0.block.self_attn.k_norm.weight",
    } <= keys
    assert all(model.module(d) is model.depths[0] for d in (1, 2, 3))
    ids = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(2))
    ref = generate(target, ids, None, max_new_tokens=24, eos_token_ids=[])
    spec = generate(target, ids, make_drafter(model, target), k=4, max_new_tokens=24,
                    eos_token_ids=[])  # fmt: skip
    assert spec.sequences == ref.sequences
