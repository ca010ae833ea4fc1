"""Decoding copies (evaluation, replay rollouts) are the trained-on models in another dtype.

The reference for "the model in bf16" is what HF builds when loading the saved fp32 model
directly in bf16: weights rounded once, rotary inv_freq computed in float32. A copy made
with a bare `.to(bfloat16)` rounds inv_freq too and shifts every rotary angle. Copy and
reference hold bit-identical tensors and run the same kernels in the same process, so
their outputs must be EXACTLY equal (no tolerance needed, and none would catch less).
"""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from models.dtypes import draft_decode_copy
from models.target import Target, decode_copy
from models.target_loaders import build_tiny_random
from train.eval.evaluate import evaluate_checkpoint
from train.run.settings import eval_settings

BF16 = torch.bfloat16


@pytest.fixture
def fp32_target():
    return build_tiny_random(seed=0, device="cpu")


def _ids(n: int = 300, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))


def _inv_freqs(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in module.named_buffers() if n.endswith("inv_freq")}


def _loaded_in(model: torch.nn.Module, path, dtype: torch.dtype) -> torch.nn.Module:
    model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def test_target_decode_copy_is_the_target_loaded_in_bf16(fp32_target, tmp_path):
    reference = _loaded_in(fp32_target.model, tmp_path / "target", BF16)
    copy = decode_copy(fp32_target, BF16)
    assert copy.dtype == BF16 and fp32_target.dtype == torch.float32  # the original untouched
    trained = _inv_freqs(fp32_target.model)
    assert trained and all(b.dtype == torch.float32 for b in trained.values())
    for name, buf in _inv_freqs(copy.model).items():
        assert buf.dtype == torch.float32
        assert torch.equal(buf, trained[name])
    ids = _ids()
    with torch.no_grad():
        ours = copy.model(input_ids=ids, output_hidden_states=True)
        ref = reference(input_ids=ids, output_hidden_states=True)
    assert torch.equal(ours.hidden_states[-1], ref.hidden_states[-1])
    assert torch.equal(ours.logits, ref.logits)
    # No copy at all when the target already has the decoding dtype.
    assert decode_copy(fp32_target, torch.float32) is fp32_target


def test_mtp_decode_copy_is_the_draft_built_in_bf16(fp32_target, tmp_path):
    from models.mtp import from_target

    draft = from_target(fp32_target, num_depths=2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.02 * torch.randn_like(p))  # trained-looking weights, not the init
    target_bf16 = Target(
        _loaded_in(fp32_target.model, tmp_path / "target", BF16), fp32_target.tokenizer, "t"
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(BF16)  # the draft built directly in bf16: float32 inv_freq
    try:
        reference = from_target(target_bf16, num_depths=2)
    finally:
        torch.set_default_dtype(default)
    reference.load_state_dict(draft.state_dict())  # rounds the fp32 weights once, as .to does
    copy = draft_decode_copy(draft, BF16)
    assert copy.depths[0].proj.weight.dtype == BF16
    assert copy.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(copy.rotary.inv_freq, draft.rotary.inv_freq)
    assert draft.depths[0].proj.weight.dtype == torch.float32  # the trained draft untouched
    ids = _ids()
    t_out = target_bf16(ids, hidden_layers=(-1,), use_cache=False)
    with torch.no_grad():
        ours, ref = copy(target_bf16, ids, t_out), reference(target_bf16, ids, t_out)
    for a, b in zip(ours.logits, ref.logits, strict=True):
        assert torch.equal(a, b)


def test_draft_lm_decode_copy_is_the_draft_loaded_in_bf16(fp32_target, tmp_path):
    from models.draft_lm import from_target

    draft = from_target(fp32_target, num_layers=1, init="random")
    reference = _loaded_in(draft.causal_lm(), tmp_path / "draft", BF16)
    copy = draft_decode_copy(draft, BF16)
    assert all(b.dtype == torch.float32 for b in _inv_freqs(copy).values())
    ids = _ids()
    with torch.no_grad():
        ours = copy.causal_lm()(input_ids=ids).logits
        ref = reference(input_ids=ids).logits
    assert ours.dtype == BF16 and torch.equal(ours, ref)


def test_replay_and_medusa2_copies_keep_rotary_float32(fp32_target):
    from models.draft_lm import from_target as draft_lm
    from models.medusa import from_target as medusa
    from train.core.replay import Replay

    replay = Replay(
        [{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}],
        offsets=[0],
        pad_token_id=0,
        dtype="bfloat16",
    )
    r_target, r_draft = replay._rollout_models(fp32_target, draft_lm(fp32_target, num_layers=1))
    assert r_target.dtype == BF16 and r_target is not fp32_target
    for module in (r_target.model, r_draft):
        inv = _inv_freqs(module)
        assert inv and all(b.dtype == torch.float32 for b in inv.values())
    # Medusa-2 decodes a merged copy of the (bf16) decoding target.
    heads = draft_decode_copy(medusa(fp32_target, medusa2=True, lora_rank=2), BF16)
    merged = heads.decoding_target(decode_copy(fp32_target, BF16))
    assert merged.dtype == BF16
    assert all(b.dtype == torch.float32 for b in _inv_freqs(merged.model).values())


def test_evaluation_reports_the_proxy_of_its_own_sampling(fp32_target):
    from models.draft_lm import from_target

    draft = from_target(fp32_target, num_layers=1, init="random")
    cfg = OmegaConf.create(
        {
            "seed": 0,
            "decode": {
                "k": 2, "temperatures": [0.0, 0.7], "top_k": 0, "top_p": 0.9,
                "max_new_tokens": 4, "num_prompts": 1, "warmup": 0, "dtype": "bfloat16",
            },
        }
    )  # fmt: skip
    prompts = [{"input_ids": [1, 4, 40, 50, 60]}]
    proxy = {"sim_tau": 9.0, "sim_tau_greedy": 1.5, "sim_tau_T0.7": 2.5}
    settings = eval_settings(cfg)
    result, _ = evaluate_checkpoint(fp32_target, draft, prompts, settings, proxy)
    assert result["greedy/proxy_tau"] == 1.5
    assert result["T0.7/proxy_tau"] == 2.5  # not the loss-temperature sim_tau
    assert result["T0.7/proxy_error"] == pytest.approx(2.5 - result["T0.7/tau"])
    # A train record without this temperature's proxy (written before it was configured):
    # no number rather than another temperature's.
    result, _ = evaluate_checkpoint(fp32_target, draft, prompts, settings, {"sim_tau_greedy": 1.5})
    assert "T0.7/proxy_tau" not in result and "T0.7/tau" in result


def _drafts(target):
    from models import dflash, draft_lm, eagle, medusa, mtp

    return {
        "draft_lm": draft_lm.from_target(target, num_layers=1, init="random"),
        "medusa": medusa.from_target(target, num_heads=2),
        "eagle": eagle.from_target(target, None, vocab_size="full", ttt_steps=2),
        "mtp": mtp.from_target(target, num_depths=2),
        "dflash": dflash.from_target(target, None, block_size=4, vocab_size="full"),
    }


@pytest.mark.parametrize("kind", ["draft_lm", "medusa", "eagle", "mtp", "dflash"])
@pytest.mark.parametrize("draft_dtype", ["float32", "bfloat16"])
def test_a_draft_in_another_dtype_than_the_target_decodes_losslessly(
    fp32_target, kind, draft_dtype
):
    """decode.draft_dtype is chosen apart from decode.dtype (train/eval/plan.py:
    draft_dtype_choice): every kind's drafter runs beside a target in the other dtype, and
    greedy decoding still gives the target's own greedy text."""
    draft = _drafts(fp32_target)[kind]
    cfg = OmegaConf.create(
        {
            "seed": 0,
            "decode": {
                "k": 3, "temperatures": [0.0], "top_k": 0, "top_p": 1.0, "max_new_tokens": 12,
                "num_prompts": 2, "warmup": 0, "dtype": "bfloat16", "draft_dtype": draft_dtype,
            },
        }
    )  # fmt: skip
    prompts = [{"input_ids": [1, 4, 40, 50, 60]}, {"input_ids": [1, 7, 9, 70, 3, 22]}]
    result, copies = evaluate_checkpoint(fp32_target, draft, prompts, eval_settings(cfg), None)
    assert result["dtypes"]["draft"]["dtype"] == draft_dtype
    assert result["dtypes"]["draft"]["source"] == "explicit"
    assert copies.target.dtype == BF16
    assert result["greedy/greedy_match_rate"] == 1.0


def test_ar_in_the_fastest_dtype_only_is_one_pass_fewer(fp32_target):
    """Where the fastest eager AR runs in another dtype ("ar_eager"), the AR in the decode
    dtype ("ar", decode.same_dtype_ar=true) is one more pass of 8 forwards a prompt: with it
    the speedup is against it and greedy match is measured; without it the speedup is against
    the fastest eager AR, and no greedy match (defined within one dtype) is reported."""
    from decoding.drafters import make_drafter
    from decoding.metrics import Pass, decode_prompts, summarize
    from models.draft_lm import from_target

    drafter = make_drafter(from_target(fp32_target, num_layers=1, init="random"), fp32_target)
    baseline = decode_copy(fp32_target, BF16)
    calls = {"float32": 0, "bfloat16": 0}
    for target, dtype in ((fp32_target, "float32"), (baseline, "bfloat16")):
        target.model.model.register_forward_pre_hook(
            lambda *_, dtype=dtype: calls.__setitem__(dtype, calls[dtype] + 1)
        )
    prompts = [torch.tensor([1, 4, 40, 50, 60]), torch.tensor([1, 7, 9, 70, 3, 22])]
    kw = dict(k=2, max_new_tokens=8, warmup=0, eos_token_ids=[])
    spec, fastest = Pass("spec", fp32_target, drafter), Pass("ar_eager", baseline)
    records = {}
    for same in (True, False):
        calls.update(float32=0, bfloat16=0)
        passes = [Pass("ar", fp32_target), spec, fastest] if same else [spec, fastest]
        decoded = decode_prompts(passes, prompts, **kw)
        records[same] = (dict(calls), summarize(decoded))
    (both, m_both), (one, m_one) = records[True], records[False]
    assert both["bfloat16"] == one["bfloat16"] > 0  # the fastest AR is decoded either way
    assert both["float32"] - one["float32"] == 2 * 8  # the same-dtype AR: 8 forwards a prompt
    assert (m_both["ar_dtype"], m_both["eager_ar_dtype"]) == ("float32", "bfloat16")
    assert m_both["greedy_match_rate"] == 1.0
    assert (m_one["ar_dtype"], m_one["eager_ar_dtype"]) == ("bfloat16", "bfloat16")
    assert m_one["speedup"] == m_one["speedup_eager_ar"] and m_one["greedy_match_rate"] is None
    assert "speedup_best_ar" not in m_one  # no compiled AR: no fastest-AR ratio
