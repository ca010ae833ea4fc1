"""models/few_rows.py: linear layers whose few-row products run as W @ x^T, chosen per
machine by timing (train/eval/plan.py), for decoding alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import models.few_rows
import train.eval.plan
from models import draft_lm
from models.few_rows import MAX_ROWS, FewRowsLinear, choose_layouts, few_rows_products
from tests.helpers import untied_target
from tests.test_eval_compiled import auto_settings, eval_prompts
from train.eval.evaluate import evaluate_checkpoint


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5,), (1, 5), (4, 5), (1, 4, 5), (2, 4, 5), (3, 3, 5)])
def test_the_transposed_product_is_the_linear_one(bias, shape):
    """Every input shape and row count, both sides of MAX_ROWS: the same numbers as
    nn.Linear (to rounding), the same output shape, contiguous."""
    torch.manual_seed(0)
    plain = nn.Linear(5, 7, bias=bias)
    few = nn.Linear(5, 7, bias=bias)
    few.load_state_dict(plain.state_dict())
    few_rows_products(few, True)
    x = torch.randn(*shape)
    want, got = plain(x), few(x)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_transposed_path_is_taken_up_to_max_rows_only(monkeypatch):
    layer = nn.Linear(3, 2)
    few_rows_products(layer, True)
    plain_calls = []
    real = nn.Linear.forward
    monkeypatch.setattr(
        nn.Linear, "forward", lambda self, x: plain_calls.append(1) or real(self, x)
    )
    layer(torch.randn(MAX_ROWS, 3))
    assert plain_calls == []
    layer(torch.randn(MAX_ROWS + 1, 3))
    assert plain_calls == [1]


def test_the_swap_keeps_the_weights_and_swaps_back():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))

    class Wrapped(nn.Linear):  # a LoRA or quantized layer: not ours to change
        pass

    model.append(Wrapped(2, 2))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert few_rows_products(model, True) == 2
    assert [type(m) for m in model] == [FewRowsLinear, nn.ReLU, FewRowsLinear, Wrapped]
    assert model.state_dict().keys() == state.keys()
    assert few_rows_products(model, False) == 2
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear, Wrapped]


@pytest.mark.parametrize("faster", ["plain", "transposed"])
def test_choose_layouts_takes_the_faster_and_leaves_the_target_in_it(faster, monkeypatch, tmp_path):
    """The verdict follows the timings (faked: the layout the head has when timed), is cached
    per machine (the second choice reads it without timing) and is left applied."""
    target = untied_target(device="cpu")
    timed = []

    def fake_time_forward(t, dtype, rows, new, cached):
        layout = "transposed" if isinstance(t.model.lm_head, FewRowsLinear) else "plain"
        timed.append((layout, new))
        return 0.1 if layout == faster else 0.2

    monkeypatch.setattr(models.few_rows, "time_forward", fake_time_forward)
    widths = {"layout": (4, 1), "layout_ar": (1,)}
    choices = choose_layouts({"layout": target, "layout_ar": None}, widths, 64, tmp_path)
    assert set(choices) == {"layout"} and choices["layout"].dtype == faster
    assert timed == [("plain", 4), ("plain", 1), ("transposed", 4), ("transposed", 1)]
    assert isinstance(target.model.lm_head, FewRowsLinear) == (faster == "transposed")
    few_rows_products(target.model, False)
    again = choose_layouts({"layout": target}, widths, 64, tmp_path)
    assert again["layout"].source == "cached" and len(timed) == 4
    assert isinstance(target.model.lm_head, FewRowsLinear) == (faster == "transposed")


def test_an_eager_evaluation_decodes_in_the_layout_recorded_then_gives_the_target_back(
    monkeypatch, tmp_path
):
    """The plan applies the recorded verdict to the decoding copy (here the target itself,
    same dtype) for the decode, which stays lossless; the target leaves the evaluation as it
    came in (training goes on with it)."""
    target = untied_target(device="cpu")
    monkeypatch.setattr(models.few_rows, "time_forward", lambda t, *a: 0.1 if isinstance(
        t.model.lm_head, FewRowsLinear) else 0.2)  # fmt: skip
    monkeypatch.setattr(
        train.eval.plan, "time_forward", lambda t, dtype, *a: 0.1 if dtype == torch.float32 else 0.2
    )  # the AR in float32 too: greedy match checked
    seen = []
    real_forward = FewRowsLinear.forward
    monkeypatch.setattr(
        FewRowsLinear, "forward", lambda self, x: seen.append(1) or real_forward(self, x)
    )
    draft = draft_lm.from_target(target, num_layers=1, init="random")
    settings = auto_settings(tmp_path, False, linear_layout="auto")
    result, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert result["dtypes"]["layout"]["dtype"] == "transposed"
    assert seen, "the decode never ran a transposed product"
    assert result["greedy/greedy_match_rate"] == 1.0
    assert not any(isinstance(m, FewRowsLinear) for m in target.model.modules())


def test_an_explicit_layout_is_decoded_without_timing_and_a_wrong_one_refused(
    monkeypatch, tmp_path
):
    target = untied_target(device="cpu")
    monkeypatch.setattr(train.eval.plan, "choose_layouts", lambda *a: pytest.fail("timed"))
    draft = draft_lm.from_target(target, num_layers=1, init="random")
    settings = auto_settings(tmp_path, False, linear_layout="transposed")
    result, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert (result["dtypes"]["layout"]["dtype"], result["dtypes"]["layout"]["source"]) == (
        "transposed", "explicit")  # fmt: skip
    settings = replace(settings, linear_layout="plain")
    result, _ = evaluate_checkpoint(target, draft, eval_prompts(), settings, None)
    assert "layout" not in result["dtypes"]
    settings = replace(settings, linear_layout="sideways")
    with pytest.raises(ValueError, match="decode.linear_layout='sideways': use auto, plain"):
        evaluate_checkpoint(target, draft, eval_prompts(), settings, None)


def test_an_eager_dtype_is_judged_at_its_faster_layout(monkeypatch, tmp_path):
    """decode.dtype=auto with linear_layout=auto: each dtype's verify timed in both layouts and
    judged by the faster. Here bf16 beats plain float32 but not transposed float32 (as on the
    AVX2 EPYC): float32 is chosen, where plain linears alone would have chosen bf16."""
    target = untied_target(device="cpu")
    step = {(torch.float32, False): 0.30, (torch.float32, True): 0.15,
            (torch.bfloat16, False): 0.20, (torch.bfloat16, True): 0.25}  # fmt: skip

    def fake(t, dtype, rows, new, cached):
        if new > 8:  # the prompt's prefill: the same in every dtype
            return 0.0
        return step[dtype, isinstance(t.model.lm_head, FewRowsLinear)]

    monkeypatch.setattr(train.eval.plan, "time_forward", fake)
    monkeypatch.setattr(models.few_rows, "time_forward", fake)
    settings = auto_settings(tmp_path, False, dtype="auto", linear_layout="auto")
    copies = train.eval.plan.decode_copies(target, settings, eval_prompts())
    assert copies.dtypes["decode"]["dtype"] == "float32"
    assert copies.dtypes["decode"]["seconds"]["float32"] == pytest.approx(0.15)
    assert not any(isinstance(m, FewRowsLinear) for m in target.model.modules())
    settings = replace(settings, linear_layout="plain")
    plain = train.eval.plan.decode_copies(target, settings, eval_prompts())
    assert plain.dtypes["decode"]["dtype"] == "bfloat16"
