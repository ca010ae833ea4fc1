"""Medusa heads: a fresh head is the target's head, heads are independent modules, head i
learns offset i+1 and the drafter uses it there, drafting is lossless, Medusa-2 keeps the
target intact and checkpoints hold only trained weights."""

import copy

import pytest
import torch

from decoding.drafter import Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from decoding.verify import sampling_probs
from models import medusa
from models.protocol import DraftModel
from models.target import Target
from models.target_loaders import build_tiny_random
from train.core.step import adapted_lm_kl, aux_loss
from train.losses.divergences import forward_kl


def _ids(vocab: int, shape=(2, 12), seed=0) -> torch.Tensor:
    return torch.randint(6, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -- a target whose greedy text is not one repeated token ---------------------------------
# The tiny random target has tied, sharpened embeddings, so its greedy continuation is the
# same token forever: any drafter that repeats the last token "works" on it. Untie the head
# and permute it: the next token after x is then perm[x] (~98% of steps), so the text
# walks through many tokens and token t+2 is NOT token t+1 (offsets become testable).
@pytest.fixture(scope="module")
def perm_target() -> Target:
    t = build_tiny_random(seed=0, device="cpu")
    perm = torch.randperm(t.vocab_size, generator=torch.Generator().manual_seed(0))
    emb = t.model.get_input_embeddings().weight
    head = torch.empty_like(emb)
    head[perm] = emb  # logit of y = perm[x] is emb_x . h: the largest when h ~ emb_x
    t.model.lm_head.weight = torch.nn.Parameter(head.clone(), requires_grad=False)
    t.model.config.tie_word_embeddings = False
    return Target(t.model, t.tokenizer, name=t.name + "-perm")


@pytest.fixture(scope="module")
def greedy_text(perm_target) -> torch.Tensor:
    prompts = _ids(perm_target.vocab_size, (44, 6), seed=1)
    out = perm_target.model.generate(prompts, max_new_tokens=34, min_new_tokens=34, do_sample=False)
    return out  # [44, 40]: 40 rows to train on, 4 held out


def _train(target: Target, text: torch.Tensor, offset_shift: int = 0, steps: int = 100):
    """The training loop's rule (models/protocol.py): logits[i][:, :T-off] against the
    target at [:, off:], weight 0.8**i. offset_shift=-1 trains head i on offset i: the bug."""
    torch.manual_seed(0)
    heads = medusa.from_target(target, head_init="copy", num_layers=1)
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    out = target(text, hidden_layers=heads.hidden_layers, use_cache=False)
    T, V = text.shape[1], target.vocab_size
    for _ in range(steps):
        draft = heads(target, text, out)
        loss = 0.0
        for i, (logits, off) in enumerate(zip(draft.logits, draft.offsets)):
            off = off + offset_shift
            d, t = logits[:, : T - off].reshape(-1, V), out.logits[:, off:].reshape(-1, V)
            loss = loss + 0.8**i * forward_kl(d, t, torch.ones(d.shape[0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return heads.eval()


@pytest.fixture(scope="module")
def trained(perm_target, greedy_text):
    return _train(perm_target, greedy_text[:40])


@pytest.fixture(scope="module")
def misaligned(perm_target, greedy_text):
    return _train(perm_target, greedy_text[:40], offset_shift=-1, steps=60)


def _head_top1(heads, target, text) -> list[float]:
    """Per head: how often head i's argmax at t is the target's argmax at t + i + 1."""
    out = target(text, hidden_layers=(-1,), use_cache=False)
    with torch.no_grad():
        draft = heads(target, text, out)
    want = out.logits.argmax(-1)  # [B, T]: the target's greedy token x_{t+1}
    T = text.shape[1]
    return [
        (lg[:, 5 : T - i - 1].argmax(-1) == want[:, 5 + i + 1 :]).float().mean().item()
        for i, lg in enumerate(draft.logits)
    ]


# -- construction -----------------------------------------------------------------------
@pytest.mark.parametrize("head_init", ["shared", "copy"])
@pytest.mark.parametrize("num_layers", [0, 1, 3])
def test_fresh_heads_equal_the_target_head(tiny_target, head_init, num_layers):
    ids = _ids(tiny_target.vocab_size)
    out = tiny_target(ids, hidden_layers=(-1,))
    heads = medusa.from_target(tiny_target, head_init=head_init, num_layers=num_layers)
    assert isinstance(heads, DraftModel)
    draft = heads(tiny_target, ids, out)
    assert draft.offsets == [1, 2, 3, 4]  # head i predicts x_{t+i+2}: offset i + 1
    assert draft.vocab_ids is None and draft.aux_loss is None
    for logits in draft.logits:
        assert torch.equal(logits, out.logits)  # exact: SiLU(0 h + 0) = 0


def test_heads_and_blocks_are_independent_modules(tiny_target):
    heads = medusa.from_target(tiny_target, num_heads=3, num_layers=2, head_init="copy")
    params = list(heads.parameters())  # parameters() lists a shared tensor once
    assert len(params) == 3 * 2 * 2 + 3  # (W, b) per block, 2 blocks x 3 heads, 3 out layers
    assert len({p.data_ptr() for p in params}) == len(params)
    ids = _ids(tiny_target.vocab_size)
    out = tiny_target(ids, hidden_layers=(-1,))
    with torch.no_grad():
        heads.blocks[1][1].linear.bias.fill_(0.5)  # head 1, second block only
        heads.out[2].weight.mul_(2.0)  # head 2's output layer only
    logits = heads(tiny_target, ids, out).logits
    assert torch.equal(logits[0], out.logits)
    assert not torch.allclose(logits[1], out.logits)
    assert torch.equal(logits[2], 2.0 * out.logits)
    # A copied output layer is the head's own: the target's head is untouched.
    assert torch.equal(tiny_target(ids).logits, out.logits)


@pytest.mark.parametrize("head_init", ["shared", "copy"])
def test_state_dict_holds_only_trained_weights_and_reloads_strictly(tiny_target, head_init):
    heads = medusa.from_target(tiny_target, num_heads=2, num_layers=1, head_init=head_init)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = heads.state_dict()
    expected = {f"blocks.{i}.0.linear.{w}" for i in range(2) for w in ("weight", "bias")}
    if head_init == "copy":
        expected |= {"out.0.weight", "out.1.weight"}
    assert set(state) == expected
    fresh = medusa.from_target(tiny_target, num_heads=2, num_layers=1, head_init=head_init)
    fresh.load_state_dict(state, strict=True)
    ids = _ids(tiny_target.vocab_size)
    out = tiny_target(ids, hidden_layers=(-1,))
    for a, b in zip(heads(tiny_target, ids, out).logits, fresh(tiny_target, ids, out).logits):
        assert torch.equal(a, b)


def test_bad_settings_say_what_to_change(tiny_target):
    with pytest.raises(ValueError, match="head_init='tied'.*shared.*copy"):
        medusa.from_target(tiny_target, head_init="tied")
    with pytest.raises(ValueError, match="num_heads >= 1"):
        medusa.from_target(tiny_target, num_heads=0)
    heads = medusa.from_target(tiny_target)
    ids = _ids(tiny_target.vocab_size)
    with pytest.raises(ValueError, match="hidden_layers"):
        heads(tiny_target, ids, tiny_target(ids))  # target run without the last hidden state
    drafter = make_drafter(heads, tiny_target)
    with pytest.raises(RuntimeError, match="before prefill"):
        drafter.propose(ids[:, -1], 2, Sampling())
    drafter.prefill(ids, tiny_target(ids, hidden_layers=(-1,)))
    with pytest.raises(ValueError, match="k .* must be >= 1"):
        drafter.propose(ids[:, -1], 0, Sampling())
    assert drafter.propose(ids[:, -1], 9, Sampling())[0].shape == (2, 4)  # clamped to K heads


# -- offsets ----------------------------------------------------------------------------
def test_head_i_learns_offset_i_plus_1(perm_target, greedy_text, trained, misaligned):
    held_out = greedy_text[40:]
    fresh = _head_top1(medusa.from_target(perm_target), perm_target, held_out)
    good = _head_top1(trained, perm_target, held_out)
    bad = _head_top1(misaligned, perm_target, held_out)
    # A fresh head predicts x_{t+1}, never x_{t+i+2} on this target's text.
    assert max(fresh) == 0.0, fresh
    assert min(good) >= 0.85, good
    # Trained against offset i instead of i + 1: every head is one token short.
    assert max(bad) <= 0.05, bad


def test_drafter_uses_head_i_for_draft_i_plus_1(perm_target, greedy_text, trained, misaligned):
    """Greedy spec decoding with the trained heads: every round accepts nearly all k=4
    drafts; the heads trained one offset short (the off-by-one bug) accept nothing."""
    prompts = greedy_text[40:, :6]
    reference = perm_target.model.generate(prompts, max_new_tokens=24, do_sample=False)[:, 6:]
    taus = []
    for heads in (trained, misaligned):
        for row in range(prompts.shape[0]):
            res = generate(
                perm_target,
                prompts[row : row + 1],
                make_drafter(heads, perm_target),
                k=4,
                max_new_tokens=24,
            )
            assert res.sequences[0] == reference[row].tolist()
            taus.append(res.tau)
    good, bad = sum(taus[:4]) / 4, sum(taus[4:]) / 4
    assert good >= 3.5, taus  # measured 4.09 (4.6, 4.6, 2.56, 4.6); k=4 caps it at 5
    assert bad <= 1.1, taus  # measured 1.0


# -- lossless decoding -----------------------------------------------------------------
@pytest.mark.parametrize("heads_kind", ["fresh", "trained"])
def test_greedy_drafting_equals_target_greedy_with_padding(perm_target, trained, heads_kind):
    heads = trained if heads_kind == "trained" else medusa.from_target(perm_target, num_layers=2)
    prompts = [_ids(perm_target.vocab_size, (1, n), seed=10 + n)[0] for n in (3, 7, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding, as the decoder requires
        ids[r, width - len(p) :], mask[r, width - len(p) :] = p, 1
    res = generate(
        perm_target,
        ids,
        make_drafter(heads, perm_target),
        k=3,
        max_new_tokens=20,
        attention_mask=mask,
    )  # both stop at the target's EOS
    for r, p in enumerate(prompts):
        want = perm_target.model.generate(p[None], max_new_tokens=20, do_sample=False)[0, len(p) :]
        assert res.sequences[r] == want.tolist()
    assert sum(res.accept_counts) > 0 if heads_kind == "trained" else True


def test_sampled_drafts_come_with_the_q_they_were_drawn_from(perm_target, trained):
    ids = _ids(perm_target.vocab_size, (3, 8))
    out = perm_target(ids, hidden_layers=(-1,))
    drafter = make_drafter(trained, perm_target)
    drafter.prefill(ids, out)
    sampling = Sampling(temperature=0.7, top_k=5, top_p=0.9)
    gen = torch.Generator().manual_seed(0)
    tokens, q = drafter.propose(ids[:, -1], 3, sampling, gen)
    assert tokens.shape == (3, 3) and q.shape == (3, 3, perm_target.vocab_size)
    with torch.no_grad():
        head_logits = torch.stack(trained.head_logits(out.hidden[-1][:, -1], perm_target), 1)
    assert torch.equal(q, sampling_probs(head_logits[:, :3], sampling))  # the verifier's warp
    assert (q.gather(-1, tokens[..., None]) > 0).all()
    assert ((q > 0).sum(-1) <= 5).all()  # top-k applied to q as to p


class _WrongQDrafter:
    """The classic bug: report q before the warp (temperature 1, no top-k) while sampling
    from the warped q. Used to show the check below can fail."""

    def __init__(self, drafter):
        self.drafter, self.hidden_layers = drafter, drafter.hidden_layers
        self.vocab_size = drafter.vocab_size

    def prefill(self, *args, **kwargs):
        self.drafter.prefill(*args, **kwargs)

    def commit(self, *args, **kwargs):
        self.drafter.commit(*args, **kwargs)

    def propose(self, last_tokens, k, sampling, generator=None):
        tokens, _ = self.drafter.propose(last_tokens, k, sampling, generator)
        d = self.drafter
        logits = torch.stack(d.heads.head_logits(d.feature, d.target, heads=tokens.shape[1]), 1)
        return tokens, sampling_probs(logits, Sampling(temperature=1.0))


def _second_token_tv(target, drafter, prompt, sampling, rows: int) -> float:
    """TV between the 2nd emitted token's empirical distribution and its exact marginal
    sum_c p(c | prompt) p(y | prompt, c). With max_new_tokens=3 the 2nd token is the
    verify outcome of one draft (accepted d_1, or a residual sample)."""
    res = generate(
        target,
        prompt.expand(rows, -1),
        drafter,
        k=1,
        sampling=sampling,
        max_new_tokens=3,
        eos_token_ids=[],
        generator=torch.Generator().manual_seed(0),
    )
    assert res.draft_lens[0] == 1
    second = torch.tensor([s[1] for s in res.sequences])
    p_first = sampling_probs(target(prompt).logits[0, -1], sampling)  # [V]
    firsts = p_first.nonzero()[:, 0]
    ext = torch.cat([prompt.expand(len(firsts), -1), firsts[:, None]], 1)
    p_second = sampling_probs(target(ext).logits[:, -1], sampling)  # [n, V]
    expected = (p_first[firsts, None] * p_second).sum(0)  # [V]
    observed = torch.bincount(second, minlength=target.vocab_size).float() / rows
    return 0.5 * (observed - expected).abs().sum().item()


def test_sampled_output_follows_the_target_distribution(perm_target, trained):
    sampling = Sampling(temperature=2.0, top_k=4)
    prompt = _ids(perm_target.vocab_size, (1, 6), seed=3)
    tv = _second_token_tv(perm_target, make_drafter(trained, perm_target), prompt, sampling, 20000)
    wrong = _second_token_tv(
        perm_target, _WrongQDrafter(make_drafter(trained, perm_target)), prompt, sampling, 20000
    )
    # Measured: 0.0019 with the drafter's q, 0.0196 with the wrong q.
    assert tv < 0.006, tv
    assert wrong > 0.008, wrong


# -- Medusa-2 ---------------------------------------------------------------------------
def _train_medusa2(target: Target, ids, lm_loss_weight: float, steps: int = 20):
    """Heads + LoRA on head 0's loss (offset 1), plus the model's aux loss."""
    mask = torch.ones_like(ids)
    out = target(ids, hidden_layers=(-1,), use_cache=False)
    torch.manual_seed(0)
    heads = medusa.from_target(
        target, medusa2=True, lora_rank=4, num_heads=2, lm_loss_weight=lm_loss_weight
    )
    opt = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=1e-2)
    V = target.vocab_size
    for _ in range(steps):
        draft = heads(target, ids, out, mask)
        head0 = forward_kl(
            draft.logits[0][:, :-1].reshape(-1, V),
            out.logits[:, 1:].reshape(-1, V),
            mask[:, 1:].reshape(-1),
        )
        opt.zero_grad()
        (head0 + aux_loss(draft, out.logits, mask)).backward()
        opt.step()
    return heads, adapted_lm_kl(heads(target, ids, out, mask), out.logits, mask).item()


def test_medusa2_starts_as_the_target_and_saves_only_heads_and_lora(tiny_target):
    ids = _ids(tiny_target.vocab_size, (2, 10))
    out = tiny_target(ids, hidden_layers=(-1,), use_cache=False)
    heads = medusa.from_target(tiny_target, medusa2=True, lora_rank=4, num_heads=2)
    mask = torch.ones_like(ids)
    draft = heads(tiny_target, ids, out, mask)
    # Fresh LoRA (B = 0): the adapted model is the target.
    assert aux_loss(draft, out.logits, mask).item() == 0.0
    for logits in draft.logits:
        assert torch.equal(logits, out.logits)
    trained_names = {n for n, p in heads.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trained_names) and any("lora_B" in n for n in trained_names)
    assert all(n.startswith("blocks.") or "lora_" in n for n in trained_names)
    assert set(heads.state_dict()) == trained_names  # no frozen backbone weights saved


def test_medusa2_lm_loss_keeps_the_adapted_target_close(tiny_target):
    ids = _ids(tiny_target.vocab_size, (2, 10))
    target_before = copy.deepcopy(tiny_target.model.state_dict())
    heads, kl_kept = _train_medusa2(tiny_target, ids, lm_loss_weight=1.0)
    _, kl_free = _train_medusa2(tiny_target, ids, lm_loss_weight=0.0)
    # The heads' loss drags the LoRA away from the target; the lm loss pulls it back
    # (measured: 0.034 vs 1.54 nats after 20 steps).
    assert kl_kept < 0.1 and kl_free > 0.5, (kl_kept, kl_free)
    after = tiny_target.model.state_dict()
    assert all(torch.equal(target_before[k], after[k]) for k in after)  # the target is untouched
    # Strict reload from the trained-only state dict; the merged target is the adapted model.
    fresh = medusa.from_target(tiny_target, medusa2=True, lora_rank=4, num_heads=2)
    fresh.load_state_dict(heads.state_dict(), strict=True)
    with torch.no_grad():
        adapted = heads.adapted(input_ids=ids, use_cache=False).last_hidden_state
        again = fresh.adapted(input_ids=ids, use_cache=False).last_hidden_state
        merged = heads.decoding_target(tiny_target)(ids, hidden_layers=(-1,)).hidden[-1]
    assert torch.equal(adapted, again)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(adapted, tiny_target(ids, hidden_layers=(-1,)).hidden[-1])


def test_bf16_copy_drafts_with_a_bf16_target(perm_target, trained):
    """The loop evaluates a bf16 copy of the draft with a bf16 copy of the target."""
    target16 = Target(
        copy.deepcopy(perm_target.model).to(torch.bfloat16), perm_target.tokenizer, "t16"
    )
    heads16 = copy.deepcopy(trained).to(torch.bfloat16)
    prompt = _ids(perm_target.vocab_size, (1, 6), seed=5)
    res = generate(
        target16, prompt, make_drafter(heads16, target16), k=4, max_new_tokens=16, eos_token_ids=[]
    )
    ar = generate(target16, prompt, None, max_new_tokens=16, eos_token_ids=[])
    assert res.sequences == ar.sequences
    assert res.tau >= 3.0
