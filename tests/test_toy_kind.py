"""A draft kind defined only here (model, drafter, conf in tests/toy_conf/) trains, checkpoints,
resumes, evaluates and decodes through the real loop, with no line of train/ or decoding/
written for it: what docs/design.md §1 promises a new draft kind. Its drafter is registered
at run time in decoding.drafters.DRAFTERS, as a kind of a user's own would be."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import Tensor, nn

import decoding.drafters
from decoding.drafter import Drafter, Sampling
from decoding.drafters import make_drafter
from decoding.spec import generate
from decoding.verify import sampling_probs
from models.protocol import DraftModel, DraftOutput
from models.target import Target, TargetOutput
from models.target_loaders import build_tiny_random
from tests.helpers import TINY_CPU_RUN, compose_train
from train.core.checkpoint import list_checkpoints, load_draft
from train.loop import run

TOY_CONF = Path(__file__).resolve().parent / "toy_conf"


class ToyDraft(nn.Module):
    """x_{t+2} from the target's last hidden state at t: lm_head(h + W h), W from zeros."""

    kind = "toy"
    hidden_layers = (-1,)

    def __init__(self, hidden_size: int, init_scale: float = 0.0):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.normal_(self.proj.weight, std=init_scale)  # std 0: zeros, a logit lens

    def logits(self, h: Tensor, target: Target) -> Tensor:
        h = h.to(self.proj.weight.dtype)
        return target.head_logits((h + self.proj(h)).to(target.dtype))

    def forward(self, target, input_ids, target_out, attention_mask=None, loss_mask=None):
        return DraftOutput(logits=[self.logits(target_out.hidden[-1], target)], offsets=[1])

    def set_progress(self, progress: float) -> None:
        """No schedule of its own."""

    def decoding_target(self, target: Target) -> Target:
        return target


def from_target(target: Target, token_counts=None, init_scale: float = 0.0) -> ToyDraft:
    return ToyDraft(target.hidden_size, init_scale)


class ToyDrafter:
    """One draft per round: the toy head on the newest kept feature."""

    tree_kinds: ClassVar[tuple[str, ...]] = ()
    replayable: ClassVar[bool] = True
    hidden_layers = (-1,)

    @staticmethod
    def max_draft_tokens(model_settings: Mapping[str, Any]) -> int | None:
        return 1

    def __init__(self, model: ToyDraft, target: Target):
        self.model, self.target = model, target
        self.vocab_size = target.vocab_size
        self.feature: Tensor | None = None  # [B, H]

    def prefill(self, input_ids, target_out: TargetOutput, attention_mask=None) -> None:
        self.feature = target_out.hidden[-1][:, -1]

    @torch.no_grad()
    def propose(self, last_tokens, k: int, sampling: Sampling, generator=None):
        logits = self.model.logits(self.feature, self.target)[:, None].float()  # [B, 1, V]
        if sampling.greedy:
            return logits.argmax(-1), None
        q = sampling_probs(logits, sampling)  # [B, 1, V]
        return torch.multinomial(q[:, 0], 1, generator=generator), q

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        self.feature = target_out.hidden[-1][:, -1]


@pytest.fixture
def toy_kind(monkeypatch):
    monkeypatch.setitem(decoding.drafters.DRAFTERS, "toy", ToyDrafter)
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))  # test_toy_kind.from_target


def compose_toy(run_dir: Path, *overrides: str):
    return compose_train(
        *TINY_CPU_RUN, f"hydra.searchpath=[file://{TOY_CONF}]", "draft=toy", "loss=kl", "name=toy_kl",
        f"run_dir={run_dir}", "train.steps=4", "train.ckpt_every=2", "train.log_every=1",
        "train.batch_size=2", "optim.lr=0.01", "decode.k=1", "decode.num_prompts=2",
        "decode.max_new_tokens=8", "decode.temperatures=[0.0,1.0]", "decode.dtype=fp32",
        *overrides,
    )  # fmt: skip


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def test_a_kind_defined_in_the_tests_trains_checkpoints_resumes_and_decodes(tmp_path, toy_kind):
    summary = run(compose_toy(tmp_path / "full"))
    assert summary["steps"] == 4
    assert [p.name for p in list_checkpoints(tmp_path / "full")] == [
        "step_00000002",
        "step_00000004",
    ]
    train_records = records(tmp_path / "full", "train")
    assert train_records[-1]["loss"] < train_records[0]["loss"]  # it learns
    evals = records(tmp_path / "full", "eval")
    assert [e["step"] for e in evals] == [2, 4]
    assert evals[-1]["greedy/tau"] >= 1.0 and "T1/tau" in evals[-1]
    # The checkpoint folder carries the run's config and reloads as the toy kind.
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000004"
    assert (ckpt / "config.yaml").is_file()

    # Resumed from step 2: the same losses as the uninterrupted run.
    run(compose_toy(tmp_path / "cut", "train.steps=2"))
    run(compose_toy(tmp_path / "cut", "resume=true"))
    resumed = records(tmp_path / "cut", "train")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in train_records]


def test_the_loop_reports_progress_and_decodes_losslessly(tmp_path, toy_kind, monkeypatch):
    seen = []
    monkeypatch.setattr(ToyDraft, "set_progress", lambda self, progress: seen.append(progress))
    cfg = compose_toy(tmp_path, "train.eval_at_ckpt=false")
    target = build_tiny_random(vocab_size=128, device="cpu")
    draft = from_target(target, init_scale=0.05)
    assert isinstance(draft, DraftModel)
    drafter = make_drafter(draft, target)
    assert isinstance(drafter, ToyDrafter) and isinstance(drafter, Drafter)
    prompt = torch.tensor([[1, 4, 40, 50, 60, 70, 5, 6]])
    ar = generate(target, prompt, None, max_new_tokens=12)
    spec = generate(target, prompt, drafter, k=1, max_new_tokens=12)
    assert spec.sequences == ar.sequences  # greedy speculative = the target's greedy output
    run(cfg)
    assert seen == [0.0, 0.25, 0.5, 0.75]  # the share of training done before each step
    loaded = load_draft(tmp_path / "checkpoints" / "step_00000004", target)
    assert isinstance(loaded, ToyDraft)


def test_settings_the_toy_drafter_cannot_draft_are_refused(tmp_path, toy_kind):
    with pytest.raises(ValueError, match="decode.k=2 drafts per round .* at most 1"):
        run(compose_toy(tmp_path, "decode.k=2"))
    with pytest.raises(ValueError, match="draft=toy cannot draft decode.tree.kind=dynamic"):
        run(compose_toy(tmp_path, "decode=tree_dynamic"))
    assert not tmp_path.joinpath("checkpoints").exists()
