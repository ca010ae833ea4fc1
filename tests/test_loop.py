"""The training loop on the tiny random target: runs, logs, checkpoints, evaluates, fails early."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from transformers import LlamaConfig, LlamaForCausalLM

import train.loop
from decoding.drafters import make_drafter
from decoding.drafters.draft_lm import DraftLMDrafter
from decoding.spec import generate
from models.draft_lm import from_target
from models.protocol import DraftOutput
from models.target_loaders import build_tiny_random
from train.core.checkpoint import list_checkpoints, load_checkpoint, load_draft
from train.core.schedule import lr_lambda
from train.core.step import StepStats, offset_losses
from train.data.prepare import collate, prepare_data
from train.loop import TrainingDiverged, run
from train.losses.divergences import LOSSES, Loss
from train.run.settings import eval_settings
from train.run.setup import preflight, step_setup

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_debug(run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            "train",
            overrides=["+experiment=debug", f"run_dir={run_dir}", *overrides],
        )


def _lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_debug_run_trains_checkpoints_evaluates(tmp_path):

    run_dir = tmp_path / "run"
    summary = run(compose_debug(run_dir, "train.steps=6", "train.ckpt_every=3"))
    lines = _lines(run_dir)
    train_lines = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [x["step"] for x in train_lines] == [1, 2, 3, 4, 5, 6]
    assert [x["step"] for x in evals] == [3, 6]  # evaluation after each checkpoint
    assert train_lines[-1]["loss"] < 0.8 * train_lines[0]["loss"]  # it learns
    assert train_lines[-1]["alpha"][0] > train_lines[0]["alpha"][0]
    for rec in train_lines:
        assert 0.0 <= rec["alpha"][0] <= 1.0 and rec["sim_tau"] >= 1.0
        assert rec["tokens_per_s"] > 0 and 0 < rec["target_time_share"] < 1
    for e in evals:
        assert 1.0 <= e["tau"] <= 5.0 and "greedy/proxy_error" in e
        assert e["greedy/proxy_tau"] - e["greedy/tau"] == pytest.approx(e["greedy/proxy_error"])
    assert (run_dir / "config.yaml").is_file()
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["tau_curve"] == [[3, evals[0]["tau"]], [6, evals[1]["tau"]]]
    assert summary["last_checkpoint"].endswith("step_00000006")
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000003", "step_00000006"]

    # Reload = instantiate + strict load; the weights are the saved ones.
    target = build_tiny_random(vocab_size=128, device="cpu")
    draft = load_draft(run_dir / "checkpoints" / "step_00000006", target)
    state, _, trainer_state = load_checkpoint(run_dir / "checkpoints" / "step_00000006")
    for name, value in draft.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0)
    assert trainer_state["step"] == 6 and trainer_state["rows_consumed"] == 6 * 4


def test_keep_last_prunes_old_checkpoints(tmp_path):

    run(
        compose_debug(
            tmp_path,
            "train.steps=4",
            "train.ckpt_every=1",
            "train.keep_last=2",
            "train.eval_at_ckpt=false",
        )
    )
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, monkeypatch):

    calls = {"n": 0}
    real_kl = LOSSES["kl"]

    def kl_nan_at_third_step(*args, **kwargs):
        calls["n"] += 1
        value = real_kl(*args, **kwargs)
        return value * float("nan") if calls["n"] == 3 else value

    monkeypatch.setitem(LOSSES, "kl", Loss(kl_nan_at_third_step))
    cfg = compose_debug(tmp_path, "train.steps=6", "train.ckpt_every=2", "train.eval_at_ckpt=false")
    with pytest.raises(TrainingDiverged, match="at step 3.*step_00000002 is kept"):
        run(cfg)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    state, _, trainer_state = load_checkpoint(tmp_path / "checkpoints" / "step_00000002")
    assert trainer_state["step"] == 2 and all(torch.isfinite(v).all() for v in state.values())


def test_resume_without_checkpoint_fails_before_training(tmp_path):

    with pytest.raises(FileNotFoundError, match="resume=true but .* holds no checkpoint"):
        run(compose_debug(tmp_path, "resume=true"))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_resume_auto_starts_afresh_then_resumes(tmp_path):
    """resume=auto, one launch line for a preemptible job: a run killed before its first
    checkpoint (its records, no checkpoint) starts afresh, one with a checkpoint resumes."""
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 9.0}\n')
    cfg = compose_debug(tmp_path, "train.eval_at_ckpt=false", "resume=auto", "train.ckpt_every=1")
    first = run(cfg)
    assert first["resumed_from"] is None
    assert [x["loss"] != 9.0 for x in _lines(tmp_path)] == [True, True]  # replaced
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000002")
    second = run(cfg)
    assert second["resumed_from"].endswith("step_00000001")
    assert [x["step"] for x in _lines(tmp_path)] == [1, 2]
    with pytest.raises(ValueError, match="resume='maybe'"):
        run(compose_debug(tmp_path, "resume=maybe"))
    with pytest.raises(ValueError, match="resume=auto and overwrite=true"):
        run(compose_debug(tmp_path, "resume=auto", "overwrite=true"))


def test_existing_checkpoints_need_resume_or_overwrite(tmp_path):

    cfg = compose_debug(tmp_path, "train.eval_at_ckpt=false")
    run(cfg)
    with pytest.raises(FileExistsError, match="resume=true .* overwrite=true"):
        run(cfg)
    summary = run(compose_debug(tmp_path, "train.eval_at_ckpt=false", "overwrite=true"))
    assert summary["resumed_from"] is None
    assert [x["step"] for x in _lines(tmp_path)] == [1, 2]  # old metrics were replaced


def test_draft_with_other_vocabulary_fails_before_training(tmp_path):

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            intermediate_size=64,
        )
    )
    other.save_pretrained(tmp_path / "other")
    cfg = compose_debug(tmp_path / "run", f"draft.model.init_from={tmp_path / 'other'}")
    with pytest.raises(ValueError, match="vocabulary of 100 tokens but the target .* has 128"):
        run(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_preflight_rejects_wrong_vocab_size(tiny_target):

    class WrongVocab(torch.nn.Module):
        hidden_layers = ()

        def forward(self, target, input_ids, target_out, attention_mask=None, loss_mask=None):
            return DraftOutput(logits=[torch.zeros(*input_ids.shape, 50)], offsets=[0])

    with pytest.raises(
        ValueError, match="predicts 50 tokens per position but the target's vocabulary"
    ):
        preflight(WrongVocab(), tiny_target, torch.arange(8))


def test_ce_data_labels_align_with_target_argmax(tmp_path):
    """The tiny data is the target's own fp32 greedy output, so at every trained position
    the data label x_{t+1} IS the target's argmax at t: both CE variants agree exactly.
    An off-by-one in the label shift breaks this."""

    target = build_tiny_random(vocab_size=128, device="cpu")
    cfg = compose_debug(tmp_path, "loss=ce", "loss.labels=data")
    prepared = prepare_data(target, **{**cfg.data, "num_train": 6})
    batch = collate([prepared.train[i] for i in range(4)], target.tokenizer.pad_token_id)

    draft = from_target(target, init="random", num_layers=1)
    t_out = target(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    out = draft(target, batch["input_ids"], t_out, batch["attention_mask"])
    count = batch["loss_mask"].sum().float()[None]
    losses = {}
    for labels in ("data", "target"):
        c = compose_debug(tmp_path, "loss=ce", f"loss.labels={labels}")
        setup = step_setup(c, [0], eval_settings(c).samplings)
        stats = StepStats.zeros(1, len(setup.samplings))
        losses[labels] = offset_losses(out, t_out.logits, batch, count, setup, stats).item()
    assert losses["data"] == pytest.approx(losses["target"], rel=1e-6)
    assert losses["data"] > 1.0  # a random draft: a real loss, not a vacuous 0


def test_draft_lm_copies_target_and_decodes_losslessly(tiny_target):

    draft = from_target(tiny_target, num_layers=1, init="target")
    lm = draft.causal_lm()
    assert torch.equal(lm.get_input_embeddings().weight, tiny_target.embed_tokens.weight)
    assert not lm.get_input_embeddings().weight.requires_grad
    assert lm.config.max_position_embeddings == tiny_target.config.max_position_embeddings
    assert lm.config.rope_parameters == tiny_target.config.rope_parameters
    drafter = make_drafter(draft, tiny_target)
    assert isinstance(drafter, DraftLMDrafter)
    prompt = torch.tensor([[1, 4, 40, 50, 60, 70, 5, 6]])
    ar = generate(tiny_target, prompt, None, max_new_tokens=12)
    spec = generate(tiny_target, prompt, drafter, k=3, max_new_tokens=12)
    assert spec.sequences == ar.sequences


def test_draft_lm_lora_on_pretrained(tmp_path, tiny_target):

    base = from_target(tiny_target, num_layers=1, init="random").causal_lm()
    base.save_pretrained(tmp_path / "pre")
    draft = from_target(tiny_target, init_from=str(tmp_path / "pre"), lora_rank=4)
    trainable = {n for n, p in draft.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with pytest.raises(ValueError, match="lora_rank > 0 needs a pretrained draft"):
        from_target(tiny_target, lora_rank=4)


def test_time_budget_stops_with_checkpoint_and_eval(tmp_path):

    # Any optimizer step takes longer than a microsecond: the budget ends the run after step 1,
    # which still gets its checkpoint, evaluation and summary.
    summary = run(compose_debug(tmp_path / "short", "train.steps=6", "train.time_budget_s=1e-6"))
    assert summary["steps"] == 1 and summary["stopped_by"] == "time_budget"
    assert 0 < summary["train_s"] < summary["wall_s"]  # the evaluation is not training time
    assert [p.name for p in list_checkpoints(tmp_path / "short")] == ["step_00000001"]
    assert [(x["kind"], x["step"]) for x in _lines(tmp_path / "short")] == [
        ("train", 1),
        ("eval", 1),
    ]
    _, _, state = load_checkpoint(tmp_path / "short" / "checkpoints" / "step_00000001")
    assert state["train_s"] == pytest.approx(summary["train_s"], abs=0.01)
    # The training seconds behind the evaluation, for learning curves (and scripts/evaluate.py)
    meta = json.loads(
        (tmp_path / "short" / "checkpoints" / "step_00000001" / "meta.json").read_text()
    )
    assert summary["final_eval"]["train_s"] == meta["train_s"] == round(state["train_s"], 2)

    # Resuming a run whose budget is spent trains no further and keeps its records.
    again = run(
        compose_debug(
            tmp_path / "short", "train.steps=6", "train.time_budget_s=1e-6", "resume=true"
        )
    )
    assert again["steps"] == 1 and again["stopped_by"] == "time_budget"
    # ...and its summary still holds the evaluation and train record from before the resume.
    assert again["tau_curve"] == summary["tau_curve"] == [[1, summary["final_eval"]["tau"]]]
    assert again["final_eval"] == summary["final_eval"]
    assert again["final_train"]["step"] == 1
    assert [x["step"] for x in _lines(tmp_path / "short")] == [1, 1]

    long = run(compose_debug(tmp_path / "long", "train.steps=3", "train.time_budget_s=1e9"))
    assert long["steps"] == 3 and long["stopped_by"] == "steps"
    with pytest.raises(ValueError, match="time_budget_s must be > 0"):
        run(compose_debug(tmp_path / "bad", "train.time_budget_s=0"))


def test_eval_every_evaluates_multiples_and_the_last_step(tmp_path):

    run(compose_debug(tmp_path, "train.steps=5", "train.ckpt_every=1", "train.eval_every=2"))
    evals = [x["step"] for x in _lines(tmp_path) if x["kind"] == "eval"]
    assert evals == [2, 4, 5]  # every checkpoint is written, only these are evaluated


def test_lr_schedule_follows_the_time_budget():

    spent = {"share": 0.0}
    by_time = lr_lambda(2, 1000, 0.1, lambda: spent["share"])
    by_step = lr_lambda(2, 10, 0.1)
    assert by_time(0) == by_step(0) == 0.5  # warmup counts steps either way
    for share, step in [(0.0, 2), (0.5, 6), (1.0, 10), (3.0, 10)]:
        spent["share"] = share  # share of the budget spent = share of the cosine done
        assert by_time(step) == pytest.approx(by_step(step))
    assert by_time(500) == pytest.approx(0.1)  # budget spent: floor, whatever the step


REPLAY = "replay.enabled=true"
BAD_SETTINGS = [
    (["decode.k=0"], r"decode.k \(draft tokens per round\) must be >= 1, got 0"),
    (["decode.temperatures=[0.0,-0.5]"], r"decode: temperature must be >= 0"),
    (["decode.temperatures=[]"], "decode.temperatures must list at least one"),
    (["decode.top_p=0"], r"decode: top_p must be in \(0, 1\]"),
    (["decode.top_p=1.5"], r"decode: top_p must be in \(0, 1\]"),
    (["decode.top_k=-1"], "decode: top_k must be >= 0"),
    (["decode.max_new_tokens=0"], "decode.max_new_tokens must be >= 1"),
    (["decode.num_prompts=0"], "decode.num_prompts must be >= 1"),
    (["decode.warmup=-1"], "decode.warmup .* must be >= 0"),
    (["decode.dtype=fp8"], "decode.dtype: unknown dtype 'fp8'"),
    (["decode=tree_dynamic", "decode.tree.depth=0"], "decode.tree: dynamic tree needs depth"),
    (["decode=tree_static", "decode.tree.paths=[[1,0]]"], r"decode.tree: tree path \[1, 0\]"),
    (["decode=tree_static"], "draft=draft_lm cannot draft decode.tree.kind=static trees"),
    (["decode=tree_dynamic"], "draft=draft_lm .*; use decode=chain"),
    (["draft=medusa", "decode=tree_dynamic"], "use decode=tree_static or decode=chain"),
    (["draft=eagle", "decode=tree_static"], "use decode=tree_dynamic or decode=chain"),
    (["draft=mtp", "decode=tree_static"], "draft=mtp cannot draft .*; use decode=chain"),
    (["draft=mtp", "draft.model.recursive_last=false", "decode.k=3"], "decode.k=3 drafts"),
    (
        ["draft=mtp", "draft.model.recursive_last=false", "decode.adaptive_k=true", "decode.k=2"],
        r"2 \* decode.k \(the adaptive_k ceiling\)=4",
    ),
    (
        ["draft=mtp", "draft.model.recursive_last=false", "decode.k=2", REPLAY, "replay.k=3"],
        "replay.k=3 drafts per round but one round of a draft=mtp drafts at most 2 tokens",
    ),
    (["data.num_eval=0"], "eval_at_ckpt=true but the data has no eval prompts"),
    (["train.eval_every=0"], "train.eval_every must be a number of steps >= 1 or null"),
    ([REPLAY, "replay.every=0"], r"replay.every \(0\)"),
    ([REPLAY, "replay.num_prompts=0"], r"replay.num_prompts \(0\)"),
    ([REPLAY, "replay.k=0"], "replay.k .* must be >= 1"),
    ([REPLAY, "replay.ratio=1.5"], "replay.ratio is the replay share"),
    ([REPLAY, "replay.capacity=0"], "replay.capacity must be >= 1"),
    ([REPLAY, "replay.accepted_loss=l2"], r"replay.accepted_loss='l2' is not one of"),
    ([REPLAY, "replay.temperature=-1"], "replay: temperature must be >= 0"),
    ([REPLAY, "replay.top_p=0"], "replay: top_p must be in"),
    ([REPLAY, "replay.max_new_tokens=0"], "replay.max_new_tokens must be >= 1"),
    ([REPLAY, "replay.dtype=fp8"], "replay.dtype: unknown dtype"),
    (["train.steps=0"], "train.steps must be >= 1"),
    (["train.batch_size=0"], "train.batch_size must be >= 1"),
    (["train.grad_accum=0"], "train.grad_accum must be >= 1"),
    (["train.log_every=0"], "train.log_every must be >= 1"),
    (["train.ckpt_every=0"], "train.ckpt_every must be >= 1"),
    (["train.keep_last=-1"], "train.keep_last must be >= 0"),
    (["train.max_grad_norm=-1"], "train.max_grad_norm must be > 0"),
    (["train.time_budget_s=0"], "train.time_budget_s must be > 0"),
    (["loss.name=l2"], "loss.name='l2' is not one of"),
    (["loss.temperature=0"], "loss.temperature must be > 0"),
    (["loss=kl", "+loss.labels=data"], "loss.labels=data but loss .kl. takes no labels"),
    (["draft.kind=nope"], "draft.kind: no drafter for draft kind .nope."),
    (["optim.lr=-1"], "optim: Invalid learning rate"),
]


@pytest.mark.parametrize(
    "overrides, message", BAD_SETTINGS, ids=[" ".join(o) for o, _ in BAD_SETTINGS]
)
def test_bad_setting_fails_before_the_target_is_loaded(tmp_path, monkeypatch, overrides, message):

    def no_loading(*args, **kwargs):
        raise AssertionError("the target/draft was built before the settings were checked")

    monkeypatch.setattr(train.loop, "load_target", no_loading)
    run_dir = tmp_path / "run"
    with pytest.raises(ValueError, match=message):
        train.loop.run(compose_debug(run_dir, *overrides))
    assert not run_dir.exists()  # no config, metrics or checkpoint written


def test_bad_setting_fails_fast_on_a_resumed_run(tmp_path):
    # The checks come before resume/overwrite handling too: overwrite=true deletes nothing.

    run(compose_debug(tmp_path, "train.eval_at_ckpt=false"))
    before = list_checkpoints(tmp_path)
    with pytest.raises(ValueError, match="decode.k"):
        run(compose_debug(tmp_path, "overwrite=true", "decode.k=0"))
    assert list_checkpoints(tmp_path) == before and before
