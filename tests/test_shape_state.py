"""What a CPU run keeps for every matmul shape it meets (train/run/shape_state.py): the
plan replays one training step's matmuls as the real step has them, and counts what they
keep from training on, for the widths a run can meet or met."""

import copy

import hydra.utils
import pytest
import torch
from omegaconf import OmegaConf

from models.target_loaders import build_tiny_random, target_config
from tests.test_memory_plan import ROOT, compose_train
from train.run.memory_plan import plan_for_run
from train.run.meta_forward import MetaScalars, meta_target
from train.run.replan import with_train_batch
from train.run.shape_state import cached_widths, probe_widths, step_matmuls, widths_met


def draft_on(cfg, target):
    counts = torch.arange(target.vocab_size, 0, -1, dtype=torch.float32)
    return hydra.utils.instantiate(cfg.draft.model, target=target, token_counts=counts).train()


@pytest.mark.parametrize("kind", ["eagle", "mtp", "draft_lm"])
def test_the_meta_step_records_the_matmuls_real_modules_run(kind):
    """Every matmul of a real step (shapes and strides: oneDNN keys a primitive by both) is
    recorded on the meta device, where the plan records them, and nothing else."""
    cfg = compose_train("target=tiny_random", f"draft={kind}")
    target = build_tiny_random(seed=0, device="cpu")
    real = step_matmuls(draft_on(cfg, target), target, 2, 24)
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    meta = meta_target(config, torch.float32, name)
    with torch.device("meta"), MetaScalars():
        meta_draft = draft_on(cfg, meta)
    on_target, on_draft = step_matmuls(meta_draft, meta, 2, 24)
    assert (set(on_target), set(on_draft)) == (set(real[0]), set(real[1]))
    assert on_target and on_draft
    trainable = [m for m in meta_draft.modules() if isinstance(m, torch.nn.Linear)
                 and m.weight.requires_grad]  # fmt: skip
    assert trainable
    # the backward is recorded: each trainable linear's weight gradient, [out, in]
    for linear in trainable:
        assert any(a[0][0] == linear.out_features and b[0][-1] == linear.in_features
                   for _, (a, b, *_) in on_draft), linear  # fmt: skip
    assert {p.grad for p in meta_draft.parameters()} == {None}  # nothing left on the draft


def test_a_plan_counts_the_shapes_from_training_on(monkeypatch):
    """The line is kept from training on (never before: no training width met yet), for
    one width per multiple of train.pad_multiple up to data.max_len, no more than the
    micro-batches trained or the caches hold, and re-planned with the shapes a run met."""
    args = ("+experiment=eagle_tv", "train.time_budget_s=null", "train.steps=100")
    config, name = target_config(OmegaConf.to_container(compose_train(*args).target, resolve=True))  # fmt: skip

    def plan(*extra, shapes=(2**20, 20), cuda=False):
        return plan_for_run(compose_train(*args, *extra), config, name, "bfloat16", 1, False,
                            cuda, shapes=shapes)  # fmt: skip

    none, counted = plan(shapes=(0, 20)).phase_bytes(), plan()
    assert counted.shape_widths == 32  # 512 / 16
    for phase, planned in counted.phase_bytes().items():
        added = 32 * 2**20 if phase not in ("start-up", "data", "feature pass") else 0
        assert planned - none[phase] == added, phase
    assert plan("train.steps=10").shape_widths == 10
    assert plan("train.steps=10", "train.grad_accum=2").shape_widths == 20
    wide = plan("train.pad_multiple=1", "train.steps=1000")
    assert wide.shape_widths == 512 and wide.shape_bytes == 51 * 2**20  # 1,024 // 20 widths cached
    assert with_train_batch(copy.copy(counted), (4, 512), 7).shape_bytes == 7 * 2**20
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "100")  # 5 widths of 20 matmuls
    assert counted.shape_bytes == 5 * 2**20 and cached_widths(3, 20) == 3
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0")  # the caches off
    assert counted.shape_bytes == 0
    assert widths_met(100, 16) == 7 and widths_met(100, 16, micro_batches=4) == 4
    assert plan(cuda=True).shape_bytes == 0  # oneDNN's caches are the CPU's


def test_the_probes_are_widths_a_run_pads_to_of_at_least_16():
    """Three widths a run meets (multiples of train.pad_multiple, data.max_len rounded up to
    one), none under MIN_PROBE (a few rows may take a matrix-vector kernel) where the run
    has wider ones; fewer where fewer exist, and a plan with fewer than two notes that it
    did not measure."""
    assert probe_widths(512, 16) == [16, 32, 48]
    assert probe_widths(512, 1) == [16, 17, 18]
    assert probe_widths(512, 40) == [40, 80, 120]
    assert probe_widths(20, 16) == [16, 32]  # a 20-token row is padded to 32
    # every width under MIN_PROBE: the run's widest, never none (its matmuls keep state too)
    assert probe_widths(8, 16) == [16] and probe_widths(8, 1) == [6, 7, 8]
    assert probe_widths(12, 4) == [4, 8, 12]
    cfg = compose_train("target=tiny_random", "draft=eagle", "data.max_len=16", "train.pad_multiple=16")  # fmt: skip
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    plan = plan_for_run(cfg, config, name, "float32", 1, False, False)
    assert plan.shape_bytes_per_width == 0
    assert any("one warms up, at least one more is measured" in note for note in plan.notes)


def test_a_target_too_large_to_replay_is_noted_not_copied():
    """The replay copies the step's operands: over REPLAY_LIMIT (an 8B's vocabulary
    projection, 2 GiB in float32) the plan notes that it did not measure, and reads 0."""
    cfg = compose_train("+experiment=eagle_tv", "target=hf",
                        f"target.path={ROOT / 'tests' / 'llama31_8b'}", "data.pack=null")  # fmt: skip
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    plan = plan_for_run(cfg, config, name, "float32", 1, False, False)
    assert plan.shape_bytes_per_width == 0
    assert any("over the 256 MiB replayed" in note for note in plan.notes), plan.notes
