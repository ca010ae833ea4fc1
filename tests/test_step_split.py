"""One optimizer step (train/core/step.py: train_step) gives the same loss, statistics and
gradients whether its batch comes whole or split into micro-batches: every loss, the drafts'
auxiliary ones included, is a mean over the global batch. The split across ranks reduces the
same sums (tests/test_parallel*.py launch that), so this is what makes a 2-rank run equal a
1-process one for drafts with an auxiliary loss (EAGLE-1 features, Medusa-2's LM KL)."""

import copy

import hydra.utils
import pytest
import torch
from accelerate import Accelerator

from models.target_loaders import build_tiny_random
from tests.helpers import TINY_CPU_RUN, compose_train
from train.core.step import train_step
from train.data.prepare import collate
from train.run.settings import eval_settings
from train.run.setup import preflight, step_setup


def _rows(n: int = 4) -> list[dict]:
    """Rows of very different lengths: a split batch's halves hold different token counts."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (6, 40, 9, 33)[:n]:
        ids = torch.randint(1, 128, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "loss_mask": [int(t >= length // 4) for t in range(length)]})
    return rows


@pytest.mark.parametrize(
    "draft_args",
    [
        ["draft=eagle1", "draft.model.feature_loss_weight=0.5", "draft.model.ttt_steps=2"],
        ["draft=medusa2", "draft.model.num_heads=2"],
    ],
)
def test_a_split_batch_steps_like_the_whole_batch(draft_args):
    cfg = compose_train(*TINY_CPU_RUN, *draft_args)
    target = build_tiny_random(seed=0, device="cpu")
    torch.manual_seed(0)
    draft = hydra.utils.instantiate(
        cfg.draft.model, target=target, token_counts=torch.ones(target.vocab_size)
    )
    with torch.no_grad():  # Medusa-2 starts as the target (LoRA B = 0): move it off, so
        for name, p in draft.named_parameters():  # its KL to the target is not 0
            if "lora_B" in name:
                p.normal_(0, 0.05)
    rows, pad = _rows(), target.tokenizer.pad_token_id
    offsets = preflight(draft, target, torch.tensor(rows[0]["input_ids"]))
    setup = step_setup(cfg, offsets, eval_settings(cfg).samplings)
    results = {}
    for name, groups in (("whole", [[0, 1, 2, 3]]), ("split", [[0, 1], [2, 3]])):
        model = copy.deepcopy(draft)
        micro = [collate([rows[i] for i in g], pad) for g in groups]
        params = [p for p in model.parameters() if p.requires_grad]
        out = train_step(
            1, model, model, target, micro, groups, setup, Accelerator(cpu=True), params,
        )  # fmt: skip
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[name] = (out, grads)
    (whole, g_whole), (split, g_split) = results["whole"], results["split"]
    assert float(whole.stats.aux) > 0
    torch.testing.assert_close(split.stats.aux, whole.stats.aux, rtol=1e-5, atol=1e-7)
    assert split.loss == pytest.approx(whole.loss, rel=1e-5)
    assert g_split.keys() == g_whole.keys()
    for n, g in g_whole.items():
        torch.testing.assert_close(g_split[n], g, rtol=1e-4, atol=1e-6, msg=n)
