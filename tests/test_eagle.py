"""EAGLE-1 / EAGLE-3 heads on the tiny random target: shapes, one step of training, the
training-time test's teacher forcing, d2t/t2d, the drafter's losslessness, and overfitting."""

import pytest
import torch

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from models import vocab
from models.eagle import EagleDraft, from_target
from models.protocol import DraftOutput
from models.target import TargetOutput
from models.target_loaders import build_tiny_random
from train.losses.divergences import forward_kl

torch.set_num_threads(1)


def _counts(target, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (target.vocab_size,), generator=g)


def _build(target, style, **kw):
    torch.manual_seed(0)
    if style == "eagle1":
        return from_target(
            target,
            None,
            style="eagle1",
            ttt_steps=kw.pop("ttt_steps", 1),
            vocab_size="full",
            feature_loss_weight=1.0,
            **kw,
        )
    return from_target(
        target,
        kw.pop("counts", _counts(target)),
        style="eagle3",
        ttt_steps=kw.pop("ttt_steps", 3),
        vocab_size=kw.pop("vocab_size", 32),
        **kw,
    )


def _loss(draft, target, input_ids, decay=0.8):
    """What the training loop computes: offset-weighted KL against the target, renormalised
    over the draft vocabulary, plus the aux loss."""
    out = target(input_ids, hidden_layers=draft.hidden_layers)
    d = draft(target, input_ids, out)
    p = out.logits if d.vocab_ids is None else out.logits[..., d.vocab_ids]
    T = input_ids.shape[1]
    total = 0.0
    for i, (logits, off) in enumerate(zip(d.logits, d.offsets)):
        q = logits[:, : T - off].reshape(-1, logits.shape[-1])
        pt = p[:, off:].reshape(-1, p.shape[-1])
        total = total + decay**i * forward_kl(q, pt, torch.ones(q.shape[0], dtype=torch.bool))
    return total + (d.aux_loss if d.aux_loss is not None else 0.0)


@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
def test_shapes_offsets_and_one_step_lowers_loss(tiny_target, style):
    draft = _build(tiny_target, style)
    ids = torch.randint(
        0, tiny_target.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
    )
    out = draft(tiny_target, ids, tiny_target(ids, hidden_layers=draft.hidden_layers))
    assert isinstance(out, DraftOutput)
    V = 32 if style == "eagle3" else tiny_target.vocab_size
    n = 3 if style == "eagle3" else 1
    assert out.offsets == list(range(1, n + 1))  # step s predicts the target at t + s + 1
    assert [tuple(x.shape) for x in out.logits] == [(2, 12, V)] * n
    if style == "eagle1":
        assert out.aux_loss is not None and out.aux_loss.item() > 0 and out.vocab_ids is None
    else:
        assert out.aux_loss is None and out.vocab_ids.shape == (32,)
    # Frozen target pieces are never part of the draft's parameters or checkpoint.
    assert all("embed" not in k or "norm" in k for k in draft.state_dict())
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    before = _loss(draft, tiny_target, ids)
    before.backward()
    opt.step()
    after = _loss(draft, tiny_target, ids)
    assert after.item() < before.item() - 1e-3


def _reference_step1(draft, target, ids, t, token):
    """Decode-path reference (own cache, explicit positions): run the draft over positions
    0..t with the real features, then one step at t+1 with its own hidden and `token`."""
    from transformers import DynamicCache

    out = target(ids, hidden_layers=draft.hidden_layers)
    feat = draft.fuse_features(out.hidden)[:, : t + 1]
    cache = DynamicCache(config=draft.config)
    mask = (torch.arange(t + 1)[None, :] <= torch.arange(t + 1)[:, None])[None, None]
    h = draft.step(feat, target.embed_tokens(ids[:, 1 : t + 2]), torch.arange(t + 1), cache, mask)
    h1 = draft.step(h[:, -1:], target.embed_tokens(token[:, None]), torch.tensor([t + 1]), cache)
    return draft.logits(h1, draft.head_weight(target))[:, 0]  # [B, V_draft]


def test_training_time_test_teacher_forces_ground_truth(tiny_target):
    # Random init: the identity init zeroes o_proj and down_proj, the only paths by which the
    # served layout lets the token embedding reach h, so the fed token would not show.
    draft = _build(tiny_target, "eagle3", ttt_steps=2, init="random").eval()
    ids = torch.randint(
        0, tiny_target.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2)
    )
    with torch.no_grad():
        train_out = draft(tiny_target, ids, tiny_target(ids, hidden_layers=draft.hidden_layers))
        step0_argmax = draft.vocab_ids()[train_out.logits[0].argmax(-1)]  # [1, T] target ids
        checked = 0
        for t in range(0, 13):
            truth = _reference_step1(draft, tiny_target, ids, t, ids[:, t + 2])
            torch.testing.assert_close(train_out.logits[1][:, t], truth, atol=1e-5, rtol=1e-5)
            if step0_argmax[0, t] != ids[0, t + 2]:  # feeding the draft's argmax differs here
                own = _reference_step1(draft, tiny_target, ids, t, step0_argmax[:, t])
                assert (train_out.logits[1][:, t] - own).abs().max() > 1e-3
                checked += 1
        assert checked >= 5


@pytest.mark.parametrize(
    "style,vocab_size", [("eagle3", 32), ("eagle3", "full"), ("eagle1", "full"), ("eagle1", 32)]
)
def test_every_ttt_step_equals_the_drafters_draft(tiny_target, style, vocab_size):
    """Train/decode parity at EVERY unroll step. The drafter is driven as decoding/spec.py
    drives it: prefill, then rounds of propose(k) and commit(n) with the target's features
    over the kept positions [last, d_1..d_n], k up to ttt_steps and n from 0 to k (full
    accept + bonus included), two rows. After the target verified position t (the context
    is x_0..x_{t+1}), the training forward runs over the context followed by the drafter's
    own drafts d_1..d_{k-1} as the teacher-forced continuation; its step s at anchor t has
    then read exactly what the drafter read for draft s+1, so the two must agree to fp32
    rounding. Sampling at temperature 1 makes q = softmax(draft logits) (scattered into the
    target vocabulary), so log q is compared with the training logits' log-softmax."""
    k_max = 4
    torch.manual_seed(0)
    # Random init, not the identity pass-through: that zeroes the layer's output projections,
    # which would hide the attention (mask, cache, positions) from both paths.
    draft = from_target(
        tiny_target,
        _counts(tiny_target),
        style=style,
        ttt_steps=k_max,
        vocab_size=vocab_size,
        init="random",
    ).eval()
    V = tiny_target.vocab_size
    draft_ids = torch.arange(V) if draft.vocab_ids() is None else draft.vocab_ids()  # [V_draft]
    layers = draft.hidden_layers
    drafter = make_drafter(draft, tiny_target)
    sampling = Sampling(temperature=1.0)
    gen, rng = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    committed = torch.randint(6, V, (2, 5), generator=rng)  # [B, N] verified, features known
    last = torch.randint(6, V, (2,), generator=rng)  # [B] x_{t+1}, not yet through the target
    drafter.prefill(committed, tiny_target(committed, hidden_layers=layers))
    for k, n in [(4, 1), (2, 0), (4, 4), (3, 2), (1, 1), (4, 3), (4, 0), (3, 3)]:
        drafts, q = drafter.propose(last, k, sampling, gen)  # [B, k], [B, k, V]
        context = torch.cat([committed, last[:, None]], 1)  # [B, t+2]
        t = context.shape[1] - 2
        seq = torch.cat([context, drafts[:, :-1]], 1)  # [B, t+1+k]
        with torch.no_grad():
            train = draft(tiny_target, seq, tiny_target(seq, hidden_layers=layers))
        for s in range(k):
            torch.testing.assert_close(
                train.logits[s][:, t].log_softmax(-1),
                q[:, s, draft_ids].log(),
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, s=s, t=t: f"unroll step {s}, anchor {t}: {m}",
            )
        correction = torch.randint(6, V, (2,), generator=rng)
        kept = torch.cat([context, drafts[:, :n]], 1)  # [B, t+2+n]
        out = tiny_target(kept, hidden_layers=layers)
        kept_out = TargetOutput(None, {la: h[:, -(n + 1) :] for la, h in out.hidden.items()}, None)
        drafter.commit(n, torch.cat([drafts[:, :n], correction[:, None]], 1), kept_out)
        committed, last = kept, correction
    # The drafts were varied tokens, so a token read one step too early or late shows.
    assert len(set(committed[:, 5:].flatten().tolist())) >= 10


def test_vocab_map_round_trip_and_checkpoint(tiny_target):
    counts = _counts(tiny_target)
    eos = tiny_target.eos_token_ids[0]
    counts[eos] = 0  # EOS is kept even when it never appears in the data
    d2t, t2d = vocab.to_offsets(vocab.most_frequent(counts, 32, always_keep=[eos]), len(counts))
    target_ids = torch.arange(32) + d2t
    assert (
        bool(t2d[eos]) and int(t2d.sum()) == 32 and bool((target_ids[1:] > target_ids[:-1]).all())
    )
    others = counts.clone()
    others[eos] = -1
    assert set(target_ids.tolist()) - {eos} == set(others.topk(31).indices.tolist())
    draft = _build(tiny_target, "eagle3", counts=counts)
    assert torch.equal(draft.vocab_ids(), target_ids)
    assert torch.equal(
        vocab.to_draft(draft.vocab_ids(), target_ids), torch.arange(32)
    )  # draft->target->draft
    outside = (~t2d).nonzero()[:3, 0]
    assert vocab.to_draft(outside, target_ids).tolist() == [-1, -1, -1]
    # The mapping lives in the checkpoint; a fresh draft without data reloads it exactly.
    state = draft.state_dict()
    assert {"d2t", "t2d"} <= set(state)
    fresh = from_target(tiny_target, None, style="eagle3", ttt_steps=3, vocab_size=32)
    fresh.load_state_dict(state, strict=True)
    ids = torch.randint(
        0, tiny_target.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3)
    )
    out = tiny_target(ids, hidden_layers=draft.hidden_layers)
    assert torch.equal(
        fresh(tiny_target, ids, out).logits[2], draft(tiny_target, ids, out).logits[2]
    )


def test_reduced_vocab_without_mapping_is_refused(tiny_target):
    draft = from_target(tiny_target, None, style="eagle3", vocab_size=32)
    ids = torch.randint(0, tiny_target.vocab_size, (1, 8))
    out = tiny_target(ids, hidden_layers=draft.hidden_layers)
    with pytest.raises(ValueError, match="token_counts"):
        draft(tiny_target, ids, out)
    with pytest.raises(ValueError, match="d2t/t2d"):
        make_drafter(draft, tiny_target)
    bad = draft.state_dict()
    bad["t2d"] = torch.zeros_like(bad["t2d"])  # a checkpoint with a broken mapping
    with pytest.raises(ValueError, match="d2t/t2d"):
        draft.load_state_dict(bad)
    full = from_target(tiny_target, None, style="eagle3", vocab_size="full")
    assert full(tiny_target, ids, out).vocab_ids is None  # full head needs no mapping


@pytest.mark.parametrize("style", ["eagle1", "eagle3"])
def test_drafter_greedy_equals_target_greedy(tiny_target, style):
    draft = _build(tiny_target, style)
    drafter = make_drafter(draft, tiny_target)
    ids = torch.randint(
        6, tiny_target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(4)
    )
    ar = generate(tiny_target, ids, None, max_new_tokens=24, eos_token_ids=[])
    spec = generate(tiny_target, ids, drafter, k=3, max_new_tokens=24, eos_token_ids=[])
    assert spec.sequences == ar.sequences
    # Left-padded batch: row 0 is the same prompt, row 1 a shorter one.
    batch = torch.cat([ids, torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:, 3:]], 1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    ar_b = generate(
        tiny_target, batch, None, max_new_tokens=16, attention_mask=mask, eos_token_ids=[]
    )
    spec_b = generate(
        tiny_target, batch, drafter, k=3, max_new_tokens=16, attention_mask=mask, eos_token_ids=[]
    )
    assert spec_b.sequences == ar_b.sequences
    assert spec_b.sequences[0] == ar.sequences[0][:16]


def test_sampled_q_lives_on_draft_vocab(tiny_target):
    draft = _build(tiny_target, "eagle3")
    drafter = make_drafter(draft, tiny_target)
    ids = torch.randint(
        6, tiny_target.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5)
    )
    drafter.prefill(ids[:, :-1], tiny_target(ids[:, :-1], hidden_layers=draft.hidden_layers))
    g = torch.Generator().manual_seed(0)
    tokens, q = drafter.propose(ids[:, -1], 4, Sampling(temperature=0.7, top_p=0.9), g)
    assert tokens.shape == (2, 4) and q.shape == (2, 4, tiny_target.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, 4))
    assert float(q[..., ~draft.t2d].abs().max()) == 0.0  # zero outside the draft vocabulary
    assert bool((q.gather(-1, tokens[..., None]) > 0).all())  # each token drawn from its q


def test_overfit_reaches_tau_near_k_plus_1(tiny_target):
    """A head trained on the target's own greedy continuation of one prompt drafts it back."""
    k = 4
    prompt = torch.randint(
        6, tiny_target.vocab_size, (1, 8), generator=torch.Generator().manual_seed(6)
    )
    cont = generate(tiny_target, prompt, None, max_new_tokens=40, eos_token_ids=[]).sequences[0]
    corpus = torch.cat([prompt, torch.tensor([cont])], 1)  # [1, 48]
    counts = torch.bincount(corpus[0], minlength=tiny_target.vocab_size)
    n_used = int((counts > 0).sum())
    draft = _build(tiny_target, "eagle3", counts=counts, ttt_steps=k, vocab_size=max(n_used, 8))
    out = tiny_target(corpus, hidden_layers=draft.hidden_layers)
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    for _ in range(150):
        d = draft(tiny_target, corpus, out)
        p = out.logits[..., d.vocab_ids]
        loss = sum(
            forward_kl(lg[0, : 48 - off], p[0, off:], torch.ones(48 - off, dtype=torch.bool))
            for lg, off in zip(d.logits, d.offsets)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    res = generate(
        tiny_target,
        prompt,
        make_drafter(draft, tiny_target),
        k=k,
        max_new_tokens=40,
        eos_token_ids=[],
    )
    assert res.sequences[0] == cont
    assert res.tau >= k + 1 - 0.5, f"tau {res.tau:.2f}, loss {loss.item():.3f}"


def test_config_copies_target_positions(tiny_target):
    draft = _build(tiny_target, "eagle3")
    assert isinstance(draft, EagleDraft)
    assert draft.config.max_position_embeddings == tiny_target.config.max_position_embeddings
    assert (
        draft.config.rope_parameters["rope_theta"]
        == tiny_target.config.rope_parameters["rope_theta"]
    )
    assert draft.hidden_layers == (2, 1, 1)  # low/mid/high taps of a 2-layer target
    draft_bf16 = _build(tiny_target, "eagle3").to(torch.bfloat16)
    assert draft_bf16.rotary.inv_freq.dtype == torch.float32  # rotary angles are not rounded
    assert torch.equal(draft_bf16.rotary.inv_freq, draft.rotary.inv_freq)
    assert draft_bf16.fc.weight.dtype == torch.bfloat16
    assert "rotary.inv_freq" in dict(draft.named_buffers())  # moved by .to(device)
    assert not any("rotary" in key for key in draft.state_dict())  # never saved or exported


def test_pre_served_checkpoint_is_refused_with_a_clear_message(tiny_target):
    draft = _build(tiny_target, "eagle3")
    old = {k: v for k, v in draft.state_dict().items() if not k.startswith("fc.")}
    old["input_proj.weight"] = torch.zeros(64, 128)  # the layout before issue #16
    old["fuse.weight"] = torch.zeros(64, 192)
    with pytest.raises(ValueError, match="pre-served layout.*Retrain"):
        draft.load_state_dict(old)


def test_identity_init_is_the_logit_lens_of_the_deepest_tap():
    """A fresh EAGLE-3 head: fc picks the (scaled) deepest tap, o_proj and down_proj are
    zero, so step 0 gives lm_head(final_norm(h_deepest)) whatever the tap scale."""
    target = build_tiny_random(seed=0, num_layers=8, device="cpu")
    draft = from_target(target, None, ttt_steps=2, vocab_size="full")
    assert draft.hidden_layers == (2, 4, 5)
    ids = torch.randint(6, target.vocab_size, (1, 10), generator=torch.Generator().manual_seed(8))
    out = target(ids, hidden_layers=draft.hidden_layers)
    with torch.no_grad():
        lens = target.lm_head(target.final_norm(out.hidden[5]))  # [1, T, V]
        # (up to the norm's eps, which sees the tap times its scale)
        torch.testing.assert_close(draft(target, ids, out).logits[0], lens, atol=1e-4, rtol=1e-4)


def test_tap_scale_brings_each_tap_to_unit_size_by_a_power_of_two():
    target = build_tiny_random(seed=0, num_layers=8, device="cpu")
    draft = from_target(target, None, ttt_steps=1, vocab_size="full")
    scale = draft.tap_scale
    assert torch.equal(scale, torch.exp2(scale.log2().round()))  # exact to fold at export
    ids = torch.randint(6, target.vocab_size, (2, 24), generator=torch.Generator().manual_seed(9))
    out = target(ids, hidden_layers=draft.hidden_layers)
    for layer, s in zip(draft.hidden_layers, scale):
        rms = (out.hidden[layer][:, 1:] * s).pow(2).mean(-1).sqrt().median()
        assert 0.5 <= float(rms) <= 2.0, (layer, float(rms))


def test_target_layer_init_starts_one_target_layer_deeper():
    """init=target_layer: step 0 of a fresh EAGLE-3 head is the target layer that the
    deepest tap (5) enters, so the head starts as the logit lens of hidden_states[6]."""
    target = build_tiny_random(seed=0, num_layers=8, device="cpu")
    draft = from_target(target, None, ttt_steps=2, vocab_size="full", init="target_layer")
    assert draft.hidden_layers == (2, 4, 5)
    ids = torch.randint(6, target.vocab_size, (2, 10), generator=torch.Generator().manual_seed(8))
    out = target(ids, hidden_layers=(*draft.hidden_layers, 6))
    with torch.no_grad():
        lens = target.lm_head(target.final_norm(out.hidden[6]))  # [2, T, V]
        torch.testing.assert_close(draft(target, ids, out).logits[0], lens, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="init=target_layer.*eagle1"):
        from_target(target, None, style="eagle1", vocab_size="full", init="target_layer")
