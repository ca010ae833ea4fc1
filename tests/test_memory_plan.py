"""The memory plan (train/run/memory_plan.py, scripts/plan.py): counts from the config alone, on
the meta device, equal to the real modules'; a launch that cannot fit is refused."""

import copy
import subprocess
import sys
from pathlib import Path

import hydra.utils
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.nn.attention import SDPBackend, sdpa_kernel

import train.loop
import train.run.setup
from models.target_loaders import build_tiny_random, target_config
from tests.helpers import compose_debug
from train.data.prepare import collate as prepare_collate
from train.loop import run
from train.run.memory_fit import check_fits
from train.run.memory_plan import plan_for_run, planned_dtype, regeneration_bytes
from train.run.meta_forward import activation_bytes, parameter_counts
from train.run.replan import (
    with_decode_dtypes,
    with_heldout_shapes,
    with_recorded_dtypes,
    with_train_batch,
)

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = Path(__file__).parent / "llama31_8b"  # Llama-3.1-8B's published config.json only
LLAMA_8B_PARAMS = 8_030_261_248


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[*overrides, "logger=none"])


def plan_of(cfg, dtype: str, ranks: int = 1, sharded: bool = False, cuda: bool = False,
            shapes: tuple[int, int] | None = (0, 0)):  # fmt: skip
    """The plan of `cfg`; `shapes`: its matmul shapes' state as given, not measured (a
    measurement differs run to run: None measures it)."""
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    return plan_for_run(cfg, config, name, dtype, ranks, sharded, cuda, shapes=shapes)


def test_llama_3_1_8b_target_is_two_bytes_per_parameter_in_bf16():
    cfg = compose_train("+experiment=eagle_tv", "target=hf", f"target.path={LLAMA_8B}")
    dtype = planned_dtype(str(cfg.target.dtype), cuda=True)  # auto on CUDA: bfloat16
    plan = plan_of(cfg, dtype, ranks=8, cuda=True)
    assert (plan.target_dtype, plan.target_params) == ("bfloat16", LLAMA_8B_PARAMS)
    assert plan.target_bytes == 2 * LLAMA_8B_PARAMS
    # EAGLE-3 taps 3 layers plus the last: (3 + 1) x 4096 x 2 bytes per token (docs/scaling.md)
    assert plan.feature_cache_bytes_per_token == 32_768
    # AdamW: 2 float32 states per trainable float32 parameter, no master copy
    assert plan.optimizer_bytes == 8 * plan.draft_trainable
    assert plan.gradient_bytes == 4 * plan.draft_trainable
    # the draft's state sharded over 8 ranks (FSDP), the target not
    fsdp = plan_of(cfg, dtype, ranks=8, sharded=True, cuda=True)
    assert fsdp.target_bytes == plan.target_bytes
    assert fsdp.optimizer_bytes == -(-plan.optimizer_bytes // 8)


@pytest.mark.parametrize("kind", ["draft_lm", "eagle", "medusa2", "mtp", "dflash"])
def test_tiny_plan_counts_what_the_built_modules_hold(kind):
    cfg = compose_train("target=tiny_random", f"draft={kind}")
    plan = plan_of(cfg, "float32")
    target = build_tiny_random(seed=0, device="cpu")
    counts = torch.arange(target.vocab_size, 0, -1, dtype=torch.float32)
    draft = hydra.utils.instantiate(cfg.draft.model, target=target, token_counts=counts)
    trainable, frozen, nbytes = parameter_counts(draft)
    assert plan.target_params == sum(p.numel() for p in target.model.parameters())
    assert plan.target_bytes == 4 * plan.target_params
    assert (plan.draft_trainable, plan.draft_frozen, plan.draft_bytes) == (trainable, frozen, nbytes)  # fmt: skip
    assert plan.activation_bytes is not None, plan.notes
    assert 0 < plan.activation_bytes_checkpointed <= plan.activation_bytes


@pytest.mark.parametrize("kind", ["draft_lm", "eagle", "mtp"])
def test_meta_activations_equal_a_real_forwards_saved_tensors(kind):
    """The meta forward (values unknown, `.item()` read as 1, attention through the fused
    kernel's meta function) saves what a real one does on the fused (flash) kernel, the one
    a run picks; PyTorch's math path keeps the [B, heads, T, T] probabilities besides."""
    cfg = compose_train("target=tiny_random", f"draft={kind}", "train.batch_size=2", "data.max_len=64")  # fmt: skip
    plan = plan_of(cfg, "float32")
    target = build_tiny_random(seed=0, device="cpu")
    counts = torch.arange(target.vocab_size, 0, -1, dtype=torch.float32)
    draft = hydra.utils.instantiate(cfg.draft.model, target=target, token_counts=counts)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        real = activation_bytes(draft.train(), target, 2, 64, fused=False)[:2]
    assert (plan.activation_bytes, plan.activation_bytes_checkpointed) == real
    with sdpa_kernel(SDPBackend.MATH):
        math, math_ckpt, _ = activation_bytes(draft, target, 2, 64, fused=False)
    assert math > plan.activation_bytes and math_ckpt >= plan.activation_bytes_checkpointed


def test_activations_grow_with_the_batch():
    small = plan_of(compose_train("target=tiny_random", "draft=eagle1", "train.batch_size=2"), "float32")  # fmt: skip
    large = plan_of(compose_train("target=tiny_random", "draft=eagle1", "train.batch_size=4"), "float32")  # fmt: skip
    assert large.activation_bytes == pytest.approx(2 * small.activation_bytes, rel=0.01)


def test_a_plan_over_the_memory_is_refused_with_the_numbers_and_what_fits():
    cfg = compose_train("+experiment=eagle_tv", "target=hf", f"target.path={LLAMA_8B}",
                        "train.heldout_proxy=false")  # fmt: skip
    plan = plan_of(cfg, "bfloat16", ranks=8, cuda=True)
    check_fits(plan, 80 * 2**30, "80 GiB")  # fits: nothing raised
    with pytest.raises(ValueError, match=r"needs 23\.\d\d GiB per rank but 22 GiB is 22\.00 GiB") as err:  # fmt: skip
        check_fits(plan, 22 * 2**30, "22 GiB")
    message = str(err.value)
    assert "target weights       14.96 GiB" in message
    assert "FSDP over 8 ranks" in message  # the draft's state sharded brings it under 22 GiB
    one = plan_of(cfg, "bfloat16", ranks=1, cuda=True)
    with pytest.raises(ValueError, match="FSDP over 4 ranks"):  # the fewest GPUs that fit
        check_fits(one, 22 * 2**30, "22 GiB")
    with pytest.raises(ValueError, match="No setting tried fits.*the target alone needs 14.96 GiB"):
        check_fits(plan, 10 * 2**30, "10 GiB")


def test_plan_script_refuses_a_gpu_too_small(tmp_path):
    args = ["+experiment=eagle_tv", "target=hf", f"target.path={LLAMA_8B}", "--gpus", "8"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plan.py"), *args, "--gpu-mem", "16"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "8,030,261,248 params, bfloat16" in done.stdout
    assert "per rank but --gpu-mem 16 GiB is 16.00 GiB" in done.stderr


def test_a_run_is_refused_before_the_target_loads(tmp_path, monkeypatch):
    """train.py's run checks the same plan against the device's memory at start."""

    def loaded(*args, **kwargs):
        raise AssertionError("the target was loaded although the plan does not fit")

    monkeypatch.setattr(train.run.setup, "device_memory", lambda device, here: (1000, "test RAM"))  # fmt: skip
    monkeypatch.setattr(train.run.setup, "instantiate", loaded)
    with pytest.raises(ValueError, match="memory plan: .* per rank but test RAM is 0.00 GiB"):
        run(compose_debug(tmp_path / "run", f"data.cache_dir={tmp_path}/c"))
    assert not (tmp_path / "run").exists()


def test_each_phase_holds_what_runs_in_it():
    """The phases add what each holds: DDP its gradient buckets, FSDP the unsharded unit and
    the checkpoint's gathered state, regeneration its K/V, an evaluation before the last step
    its copies for the rest of the run, a compiled evaluation its graphs' weights."""
    base = ("+experiment=eagle_tv", "target=hf", f"target.path={LLAMA_8B}", "data.pack=null",
            "data.num_train=64", "train.time_budget_s=null", "train.steps=8")  # fmt: skip
    one = plan_of(compose_train(*base, "train.ckpt_every=8"), "float32")
    ddp = plan_of(compose_train(*base, "train.ckpt_every=8"), "float32", ranks=2)
    fsdp = plan_of(compose_train(*base, "train.ckpt_every=8"), "float32", ranks=2, sharded=True)
    early = plan_of(compose_train(*base, "train.ckpt_every=4", "train.eval_every=null"), "float32")
    phases, draft = one.phase_bytes(), one.draft_trainable
    assert ddp.phase_bytes()["training"] - phases["training"] == one.gradient_bytes == 4 * draft
    assert ddp.phase_bytes()["evaluation"] == phases["evaluation"]
    assert fsdp.gathered_bytes == 8 * draft and fsdp.checkpoint_bytes == 12 * draft
    kept = fsdp.baseline_bytes + fsdp.target_bytes + fsdp.draft_bytes + fsdp.optimizer_bytes
    assert fsdp.phase_bytes()["checkpoint"] - kept == fsdp.checkpoint_bytes
    # the data phase answers 64 prompts in 64 slots: its K/V at least, 32 layers x 8 K/V heads
    kv = 64 * (256 + 128) * 32 * 2 * 8 * 128 * 4
    assert phases["data"] - (one.baseline_bytes + one.target_bytes) >= kv
    assert plan_of(compose_train(*base, "data.num_train=0", "data.pack=builtin"),
                   "float32").regeneration_bytes == 0  # fmt: skip
    assert not one.evaluates_early and early.evaluates_early
    held = early.phase_bytes()["training"] - phases["training"]  # eagle_tv: a held-out proxy
    assert held == early.evaluation_bytes + early.heldout_kept_bytes
    assert early.evaluation_bytes > 0 and early.heldout_kept_bytes > 0
    eager = plan_of(compose_train(*base, "train.ckpt_every=8", "decode.compile=false"), "float32")
    assert one.compiled_bytes > 0 and eager.compiled_bytes == 0
    assert one.evaluation_bytes - eager.evaluation_bytes == one.compiled_bytes
    # a held-out pass before the last step leaves its rows' taps cached for the rest of the run
    # (the eval prompts' answers: no pack, so no validation rows)
    proxy = ("train.heldout_proxy=true", "data.num_eval=8")
    late = plan_of(compose_train(*base, "train.ckpt_every=8", *proxy), "float32")
    kept = plan_of(compose_train(*base, "train.ckpt_every=4", *proxy), "float32")
    taps = 8 * late.max_len * late.feature_cache_bytes_per_token
    assert late.heldout_kept_bytes == 0 and kept.heldout_kept_bytes == taps > 0
    assert kept.phase_bytes()["training"] - late.phase_bytes()["training"] == taps
    assert kept.phase_bytes()["held-out proxy"] == late.phase_bytes()["held-out proxy"]
    assert one.peak_bytes() == max(phases.values())


def test_the_held_out_answers_are_planned_in_the_training_targets_dtype():
    """train.heldout_proxy's answers come from the target as it trains (no copy in the
    regeneration dtype, its K/V in the target's dtype); the data phase's answers from a copy
    in data.regen_dtype."""
    base = ("+experiment=eagle_tv", "target=hf", f"target.path={LLAMA_8B}", "data.pack=null",
            "data.num_train=64", "data.num_eval=8", "train.heldout_proxy=true",
            "data.regen_dtype=float32", "train.time_budget_s=null", "train.steps=8")  # fmt: skip
    cfg = compose_train(*base)
    plan = plan_of(cfg, "bfloat16")
    config, _ = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    answering = dict(config=config, slots=int(cfg.data.regen_batch_size),
                     prompt=plan.max_len // 2, new=int(cfg.data.max_new_tokens))  # fmt: skip
    assert plan.heldout_regeneration_bytes == regeneration_bytes(prompts=8, element=2, **answering)
    copy_ = plan.target_params * 4  # the data phase answers with a float32 copy
    assert plan.regeneration_bytes == copy_ + regeneration_bytes(prompts=64, element=4, **answering)


def test_a_run_records_each_phase_beside_the_plan(tmp_path, monkeypatch):
    """summary.json memory.phases: every phase the run went through, measured, with the
    plan's figure for it (train/phase_memory.py, MemoryPlan.phase_bytes)."""
    trained: set[tuple[int, int]] = set()  # the micro-batches' shapes, as the loop collates them

    def collate(*args, **kwargs):
        batch = prepare_collate(*args, **kwargs)
        trained.add(tuple(batch["input_ids"].shape))
        return batch

    monkeypatch.setattr(train.loop, "collate", collate)
    # decode.compile=auto without a compile record (a cache of its own): admitted with the
    # compiled graphs counted, decoded eagerly
    summary = run(compose_train("+experiment=debug", f"run_dir={tmp_path}", "train.heldout_proxy=true",
                                "decode.compile=auto", f"data.cache_dir={tmp_path / 'cache'}",
                                "train.pad_multiple=8"))  # fmt: skip
    phases = summary["memory"]["phases"]
    assert {"start-up", "data", "feature pass", "training", "checkpoint", "held-out proxy",
            "evaluation", "records"} <= set(phases)  # fmt: skip
    for name, phase in phases.items():
        assert phase["peak_rss_bytes"] > 0 and phase["plan_bytes"] > 0, name
        start = phase["start_rss_bytes"]  # None: the start-up's peak came before any phase
        assert (start is None and name == "start-up") or 0 < start <= phase["peak_rss_bytes"]
    assert summary["memory"]["peak_rss_bytes"] == max(p["peak_rss_bytes"] for p in phases.values())
    plan = summary["memory"]["plan"]  # re-made with the widest batch the run trained
    rows, length = plan["train_batch"]
    assert rows == plan["batch_size"] and 0 < length <= plan["max_len"]
    # training's batches and the held-out proxy's padded alike (train.pad_multiple)
    assert length % 8 == 0 and all(width % 8 == 0 for _, width in plan["heldout_shapes"])
    # the matmul shapes' state: measured where the plan was made, for the shapes trained
    assert plan["shape_widths"] == len(trained) > 1 and plan["matmuls_per_width"] > 0
    assert not any("matmul shapes" in note for note in plan["notes"]), plan["notes"]
    assert plan["shape_bytes"] == plan["shape_bytes_per_width"] * len(trained)
    # and with the copies its evaluation made, in the dtypes it chose, no graph compiled
    assert summary["final_eval"]["decode_path"] == "eager"
    assert plan["compiled_weights"] > 0 and plan["compiled_bytes"] == 0
    dtypes = {use: summary["dtypes"][use]["dtype"] for use in ("decode", "ar", "draft")}
    size = {"float32": 4, "bfloat16": 2}
    others = {dtypes["decode"], dtypes["ar"]} - {plan["target_dtype"]}
    draft = (plan["draft_trainable"] + plan["draft_frozen"]) * size[dtypes["draft"]]
    copies = sum(plan["target_params"] * size[d] for d in others)
    assert plan["evaluation_bytes"] == copies + draft + plan["compiled_bytes"]


def test_the_held_out_pass_is_re_planned_with_its_batches_as_they_are():
    """The bound (every batch train.batch_size rows of data.max_len) re-planned with batches of
    exactly that shape is the bound; shorter batches count their own positions and taps."""
    cfg_args = ("+experiment=eagle_tv", "data.num_eval=8", "data.pack=null",
                "train.batch_size=4", "data.max_len=512")  # fmt: skip
    bound = plan_of(compose_train(*cfg_args), "float32")
    assert bound.heldout_bytes > 0 and bound.heldout_kept_bytes > 0
    as_bound = with_heldout_shapes(copy.copy(bound), [(4, 512), (4, 512)])  # 8 answers
    assert as_bound.heldout_bytes == pytest.approx(bound.heldout_bytes, rel=1e-6)
    short = with_heldout_shapes(copy.copy(bound), [(4, 300), (3, 120)])
    per_token = bound.feature_cache_bytes_per_token
    taps = (4 * 300 + 3 * 120) * per_token
    assert short.heldout_kept_bytes == taps and short.heldout_shapes == [(4, 300), (3, 120)]
    stats = bound.heldout_stats_bytes  # worked 256 positions at a time: no batch's size
    assert short.heldout_bytes == taps + 4 * 300 * bound.heldout_position_bytes + stats
    nucleus = plan_of(compose_train(*cfg_args, "decode.top_p=0.9"), "float32")
    assert stats == 256 * 49152 * 4 * 2  # SmolLM2's vocabulary, z and exp(z) in float32
    assert nucleus.heldout_stats_bytes == stats * 7 // 2  # top-p: its sort and cumsum too
    assert with_heldout_shapes(copy.copy(bound), []).heldout_bytes == bound.heldout_bytes


def test_training_is_re_planned_with_the_widest_batch_a_run_met():
    """A run that met batches as wide as the bound plans the bound; one whose widest batch
    held half the positions plans half the activations, nothing else moved. The summary of a
    run records the batch it met (`train_batch`)."""
    cfg = compose_train("+experiment=eagle_tv", "data.pack=null", "train.batch_size=4",
                        "data.max_len=512")  # fmt: skip
    bound = plan_of(cfg, "float32")
    act = bound.activation_bytes
    assert act and bound.train_batch is None
    at_bound = with_train_batch(copy.copy(bound), (4, 512)).phase_bytes()
    assert at_bound == bound.phase_bytes()
    half = with_train_batch(copy.copy(bound), (2, 512))
    assert half.train_batch == (2, 512)
    phases, bound_phases = half.phase_bytes(), bound.phase_bytes()
    assert phases["training"] == bound_phases["training"] - act // 2
    assert {k: v for k, v in phases.items() if k != "training"} == {
        k: v for k, v in bound_phases.items() if k != "training"
    }
    assert with_train_batch(copy.copy(bound), None).phase_bytes() == bound_phases


def test_a_compiled_self_speculative_evaluation_plans_its_rounds_graphs():
    """decode.compile on a CPU: every kind's graphs (the AR and the verify) hold the target's
    weights twice each; the self-speculative rounds' graphs (layers < L; layers >= L and the
    head; the head alone) hold them, and the head, once more."""
    common = ("data.pack=null", "data.num_train=8", "decode.compile=only", "decode.dtype=float32")
    eagle = plan_of(compose_train("+experiment=eagle_tv", *common), "float32")
    self_spec = plan_of(compose_train("+experiment=selfspec_kl", *common), "float32")
    assert eagle.compiled_bytes == 2 * 2 * eagle.target_params * 4  # widths 1 and k + 1
    head = 49152 * 576  # SmolLM2-135M's vocabulary x hidden size
    rounds = 2 * (self_spec.target_params + head) * 4
    assert self_spec.compiled_bytes == eagle.compiled_bytes + rounds


@pytest.mark.parametrize("trained", ["bfloat16", "float32"])
def test_the_evaluation_is_re_planned_with_the_dtypes_it_measured(trained):
    """decode.dtype=auto on a CPU: the admission counts the larger of what the verdicts may
    give (every combination of the decoding and the eager AR's dtype, compiled or not, within
    it, and one of them at it); the re-plan counts what they gave: a target copy per dtype
    other than the training one, the draft in its dtype, the compiled graphs' two copies of
    the weights in the decoding dtype, none where the evaluation decoded eagerly."""
    cfg = compose_train("+experiment=eagle_tv", "data.pack=null", "data.num_train=8")
    bound = plan_of(cfg, trained)
    params, draft = bound.target_params, bound.draft_trainable + bound.draft_frozen
    weights = 2 * params  # the AR's graph and the verify's
    assert bound.compiled_weights == weights
    size = {"bfloat16": 2, "float32": 4}
    evaluations = {}
    for decode in size:
        for ar in size:
            for compiled in (True, False):
                got = with_decode_dtypes(copy.copy(bound), decode, ar, "float32", compiled)
                copies = sum(params * size[d] for d in {decode, ar} - {trained})
                graphs = 2 * weights * size[decode] if compiled else 0
                assert got.compiled_bytes == graphs
                assert got.evaluation_bytes == copies + 4 * draft + graphs
                evaluations[decode, ar, compiled] = got.evaluation_bytes
    assert max(evaluations.values()) == bound.evaluation_bytes
    # the first run at c2e9f94: a bf16 target decoding in bf16 compiled, its eager AR float32
    if trained == "bfloat16":
        assert evaluations["bfloat16", "float32", True] == 4 * params + 4 * draft + 4 * weights
    eager = plan_of(compose_train("+experiment=eagle_tv", "train.eval_at_ckpt=false"), trained)
    assert with_decode_dtypes(copy.copy(eager), "bfloat16", "float32", "float32", True) == eager


@pytest.mark.parametrize("trained", ["bfloat16", "float32"])
def test_the_dtype_verdicts_timing_copy_is_planned_where_a_verdict_is_measured(trained):
    """A CPU measuring its dtypes times a copy of the target in the other candidate dtype
    (float32 beside a bf16 target: 4 bytes a parameter; bf16 beside a float32 one: 2), freed
    before the decoding copies are made: the copies-and-dtypes phase holds the larger of the
    two. Verdicts read from their records, or all explicit on CUDA, time nothing."""
    cfg = compose_train("+experiment=eagle_tv", "data.pack=null", "data.num_train=8")
    bound = plan_of(cfg, trained)
    other = {"bfloat16": 4, "float32": 2}[trained]
    assert bound.verdict_bytes == other * bound.target_params
    assert plan_of(cfg, trained, cuda=True).verdict_bytes == 0
    no_eval = compose_train("+experiment=eagle_tv", "train.eval_at_ckpt=false")
    assert plan_of(no_eval, trained).verdict_bytes == 0  # nothing decoded, nothing timed
    kept = bound.phase_bytes()["checkpoint"]
    for measured in (True, False):
        for decode in ("bfloat16", "float32"):
            records = {use: {"dtype": decode, "source": "measured" if measured else "cached"}
                       for use in ("decode", "ar", "draft")}  # fmt: skip
            got = with_recorded_dtypes(copy.copy(bound), records, compiled=True)
            assert got.verdict_bytes == (other * bound.target_params if measured else 0)
            copies = got.evaluation_bytes - got.compiled_bytes
            phase = got.phase_bytes()["evaluation: copies and dtypes"]
            assert phase == kept + max(got.verdict_bytes, copies)
