"""The training loop: `run(cfg)`, config to summary.

Frozen target online, trainable draft, accelerate for devices and ranks. The pieces, in the
order `run` uses them: the start-up checks (train/run/settings.py), data (train/data/), the
draft and its warm start (train/run/init_from.py), the feature cache
(train/core/feature_cache.py), one process, DDP or FSDP2 (train/parallel/strategy.py), row order and LR
schedule (train/core/schedule.py), replay (train/core/replay.py), one optimizer step (train/core/step.py),
checkpoints and exact resume (train/core/checkpoint.py; what must match, train/run/identity.py),
evaluation (train/eval/evaluate.py), records and W&B (train/core/step_stats.py,
train/report/tracking.py). What `run` builds before its first step (accelerator, target,
draft, preflight, feature cache, replay) is in train/run/setup.py; what it records
(checkpoints with their evaluation, summary.json) in train/run/records.py.

With train.time_budget_s the run stops once that much training time (steps with their replay
rollouts, not checkpoints or evaluations) is spent, and `train.steps` is a cap: how runs of
different step cost are compared at equal wall-clock. Several ranks keep one clock: each
step counts the slowest rank's time (a max over ranks), so the LR schedule, which reads the
elapsed share of the budget, and the step the run stops at are the same on every rank.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from train.core.checkpoint import restore_trainer_state, resume_checkpoint, resume_setting
from train.core.optimizers import build_optimizer, optimizer_settings
from train.core.schedule import global_rows, lr_lambda, rank_chunks
from train.core.step import StepResult, TrainingDiverged, train_step
from train.core.step_stats import StepWindow, proxy_tags
from train.data.prepare import collate, prepare_data
from train.data.prompt_file import ood_prompts
from train.disk import write_atomic
from train.parallel.ranks import Ranks
from train.parallel.strategy import check_processes, launch_strategy, shard, strategy_ran
from train.phase_memory import PhaseMemory
from train.report.tracking import RunLog, finish_tracking, init_tracking
from train.run.files import (
    check_run_dir,
    clear_run,
    route_third_party_output,
    save_hydra_record,
    write_eval_prompts,
)
from train.run.identity import Resumed, check_resume, run_identity, schedule_settings
from train.run.init_from import check_init_from
from train.run.machine import choose_autocast, share_threads
from train.run.memory_plan import MemoryPlan
from train.run.records import (
    RunEvaluations,
    RunRecords,
    checkpoint_and_evaluate,
    evaluate_at,
    write_summary,
)
from train.run.replan import replan_evaluation, with_heldout_shapes, with_train_batch
from train.run.settings import (
    check_decode_context,
    check_settings,
    eval_settings,
    tracking_settings,
)
from train.run.setup import (
    build_draft,
    feature_cache,
    heldout_proxy,
    load_target,
    make_accelerator,
    make_replay,
    preflight,
    step_setup,
)

__all__ = ["TrainingDiverged", "run"]


def progress_bar(cfg: DictConfig, start_step: int, train_s: float, main: bool) -> tqdm:
    """Steps, or with a time budget the training seconds (the step count is not known)."""
    budget = cfg.train.get("time_budget_s")
    if budget is None:
        return tqdm(total=cfg.train.steps, initial=start_step, unit="step", desc=str(cfg.name),
                    disable=not main)  # fmt: skip
    return tqdm(
        total=budget, initial=min(train_s, budget), unit="s", disable=not main,
        desc=f"{cfg.name} (time budget)", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s{postfix}",
    )  # fmt: skip


def measured_memory(plan: MemoryPlan, memory: PhaseMemory) -> dict:
    """The main rank's memory plan (train/run/memory_plan.py) beside what it measured: the
    process's peak RSS and, on CUDA, the peak memory torch allocated, each overall and per
    phase (train/phase_memory.py), with the plan's figure for each phase."""
    measured = memory.record()
    planned = plan.phase_bytes()
    for name, phase in measured["phases"].items():
        phase["plan_bytes"] = planned.get(name)
    return {"plan_peak_bytes": plan.peak_bytes(), **measured, "plan": plan.as_record()}


def to_device(batch: dict[str, torch.Tensor], accelerator: Accelerator) -> dict[str, torch.Tensor]:
    return {k: v.to(accelerator.device) for k, v in batch.items()}


def diverged(step: int, result: StepResult, last_checkpoint: str | None) -> TrainingDiverged:
    """The error for a non-finite loss or gradient norm: the update is not applied."""
    kept = f"the last good checkpoint {last_checkpoint} is kept" if last_checkpoint else "no checkpoint was written yet"  # fmt: skip
    return TrainingDiverged(
        f"non-finite training signal at step {step + 1}: loss={result.loss}, "
        f"grad_norm={result.grad_norm}; the update was not applied and {kept}. "
        "Lower optim.lr, enable gradient clipping (train.max_grad_norm) or check the data."
    )


def run(cfg: DictConfig) -> dict:
    """Train cfg.draft on cfg.target; checkpoints, evaluation and summary in cfg.run_dir.
    The run sets torch's thread count to its share of the cores (train/run/machine.py); a caller
    that runs it in-process (tests, a notebook) gets its own count back."""
    threads = torch.get_num_threads()
    try:
        return train_run(cfg)
    finally:
        torch.set_num_threads(threads)


def train_run(cfg: DictConfig) -> dict:
    """`run` itself."""
    check_settings(cfg)  # every decode / replay / loop setting, before anything is loaded
    # The values the rooms below take, read from the checked config once (docs/design.md §1)
    decode, tracking = eval_settings(cfg), tracking_settings(cfg)
    evaluations = RunEvaluations(decode, bool(cfg.train.eval_at_ckpt), cfg.train.get("eval_every"))
    replay_on = cfg.get("replay") is not None and bool(cfg.replay.enabled)
    # single / DDP / FSDP, or the launch refused with why
    strategy = launch_strategy(replay_on, str(cfg.optim.get("name", "adamw")))
    accelerator = make_accelerator(cfg, tracking)
    memory = PhaseMemory(accelerator.device)  # peak RSS per phase: summary.json's memory
    check_processes(strategy, accelerator)
    main, rank, world = accelerator.is_main_process, accelerator.process_index, accelerator.num_processes  # fmt: skip
    run_dir, tc = Path(cfg.run_dir), cfg.train
    resume, overwrite = resume_setting(run_dir, cfg.resume, bool(cfg.overwrite))  # auto decided
    resume_from = resume_checkpoint(run_dir, resume, overwrite)
    check_run_dir(run_dir, resume, overwrite)  # no mixed records
    accelerator.wait_for_everyone()
    set_seed(cfg.seed)

    # -- target, data, draft, optimizer ---------------------------------------------
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # processes on this machine
    threads = share_threads(local, accelerator.device)
    ranks = Ranks.current()  # regeneration, feature cache, evaluation: each rank its share
    # Its dtype chosen and the memory plan checked before a weight is read (train/run/setup.py)
    target, target_choice, plan = load_target(cfg, accelerator.device, resume_from, local, strategy, ranks)  # fmt: skip
    resumed: Resumed | None = None  # the saved run continued exactly, or refused here
    if resume_from is not None:
        resumed = check_resume(cfg, resume_from, target, world, strategy.kind)
        for note in resumed.notes if main else []:
            print(f"[resume] {note}", flush=True)
    elif cfg.draft.get("init_from"):
        check_init_from(cfg.draft, target)
    with memory.phase("data"):  # the target's regeneration of answers, when not cached
        prepared = prepare_data(
            target, **OmegaConf.to_container(cfg.data, resolve=True), ranks=ranks
        )
    if tc.eval_at_ckpt or tc.get("heldout_proxy"):  # eval prompts + new tokens fit the window
        check_decode_context(target, cfg.decode, prepared.eval_prompts)
        ood = ood_prompts(decode.ood_prompts, target.tokenizer, decode.chat_template)
        check_decode_context(target, cfg.decode, ood)  # decode.ood_prompts, decoded beside
    train_rows = prepared.train.select_columns(["input_ids", "loss_mask"])
    pad_id, pad_multiple = target.tokenizer.pad_token_id, int(tc.get("pad_multiple") or 1)
    dtypes = {"train_target": target_choice}
    draft = build_draft(cfg, target, prepared, warm_start=resume_from is None)
    offsets = preflight(draft, target, torch.tensor(train_rows[0]["input_ids"]))
    with memory.phase("feature pass"):
        features = feature_cache(cfg, accelerator, target, draft, train_rows)
    setup = step_setup(cfg, offsets, decode.samplings)
    dtypes["train_draft"] = choose_autocast(
        tc.bf16, cfg, target, draft, setup, train_rows[0], ranks
    )
    for choice in dtypes.values():
        if main and choice.source != "explicit":
            print(f"dtype {choice.describe()}", flush=True)
    if tc.bf16 == "auto" and accelerator.device.type == "cpu":
        setup = replace(setup, autocast=dtypes["train_draft"].dtype == "bfloat16")
    if strategy.kind == "fsdp" and accelerator.mixed_precision == "bf16":
        setup = replace(setup, autocast=True)  # accelerate's autocast comes with prepare only
    with memory.phase("feature pass"):  # None unless train.heldout_proxy: its rows' taps
        heldout = heldout_proxy(cfg, target, prepared, setup)
    shapes = [tuple(b["input_ids"].shape) for proxy in heldout or () for b in proxy.batches]
    plan = with_heldout_shapes(plan, shapes)  # the held-out batches as they are, not the bound
    if not any(p.requires_grad for p in draft.parameters()):
        raise ValueError("the draft has no trainable parameters; check draft.model settings")
    # FSDP: before the optimizer sees it; weights the draft shares with the target (Medusa-2's
    # backbone) stay shared in the evaluation skeleton
    shared = tuple(target.model.parameters())
    draft = shard(strategy, draft, accelerator.device, setup.autocast, shared)
    oc, budget = cfg.optim, tc.get("time_budget_s")
    optim = optimizer_settings(OmegaConf.to_container(oc, resolve=True))  # optim.name and its own
    optimizer = build_optimizer(draft.named_parameters(), **optim)
    clock = {"train_s": 0.0}  # training seconds so far: steps with their replay rollouts
    sched = resumed.schedule if resumed else schedule_settings(cfg)  # a run keeps its own
    sched_budget = sched["time_budget_s"]
    time_share = None if sched_budget is None else (lambda: clock["train_s"] / sched_budget)
    schedule = lr_lambda(sched["warmup_steps"], sched["steps"], sched["min_lr_ratio"], time_share)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)  # stepped by hand
    replay = make_replay(cfg, train_rows, offsets, pad_id, accelerator)
    start_step = 0
    if resume_from is not None:
        start_step, clock["train_s"] = restore_trainer_state(
            resume_from, draft, optimizer, scheduler, replay, rank, world, strategy.kind == "fsdp"
        )  # fmt: skip
    if strategy.kind != "fsdp":  # sharded by shard() above, not by accelerate
        draft, optimizer = accelerator.prepare(draft, optimizer)
    core = accelerator.unwrap_model(draft)
    params = [p for p in draft.parameters() if p.requires_grad]  # the prepared ones: clipped
    ran = strategy_ran(strategy, accelerator, draft)  # refused if not what was launched

    # -- records: the run directory is created (or, with overwrite, cleared) only now ----
    if main:  # each segment keeps its own config: config.yaml, config.resume-<step>.yaml
        if overwrite and resume_from is None:
            clear_run(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        segment = "config.yaml" if resumed is None else f"config.resume-{start_step:08d}.yaml"
        write_atomic(run_dir / segment, OmegaConf.to_yaml(cfg, resolve=True))
        data = OmegaConf.to_container(cfg.data, resolve=True)  # its eval prompts, beside it:
        write_eval_prompts(run_dir, prepared.eval_prompts, data)  # scripts/evaluate.py reads them
        save_hydra_record(run_dir, cfg)
    route_third_party_output(run_dir)  # inductor's autotuning tables, warnings: a log file
    log = RunLog(run_dir, accelerator, start_step if resume_from is not None else None)
    init_tracking(accelerator, tracking, run_dir)
    records = RunRecords.resumed(
        log.earlier, resume_from, rows_consumed=resumed.rows_consumed if resumed else 0,
        schedule=sched, identity=run_identity(cfg, target, core),
    )  # fmt: skip
    window = StepWindow(len(offsets), proxy_tags(decode.samplings))
    rows_per_step = tc.batch_size * world * tc.grad_accum
    t_run = time.perf_counter()
    bar = progress_bar(cfg, start_step, clock["train_s"], main)

    # -- the loop ---------------------------------------------------------------------
    # the widest micro-batch trained and the shapes met: the plan re-made with them
    done, widest, shapes_met = start_step, (0, 0), set()
    memory.begin("training")  # its evaluations are phases of their own
    out_of_time = budget is not None and clock["train_s"] >= budget  # spent before a resume
    if resume_from is not None:  # what a kill between the checkpoint and its evaluation lost
        evaluate_at(evaluations, accelerator, strategy, core, target, prepared, records, log,
                    start_step, start_step >= tc.steps or out_of_time, clock["train_s"],
                    heldout, owed=True)  # fmt: skip
    for step in range(start_step, start_step if out_of_time else tc.steps):
        t_step = time.perf_counter()
        core.set_progress(time_share() if time_share else step / sched["steps"])
        rows = global_rows(records.rows_consumed, rows_per_step, len(train_rows), cfg.seed)
        chunks = rank_chunks(rows, tc.batch_size, tc.grad_accum, rank, world)
        micro = [
            to_device(collate([train_rows[i] for i in c], pad_id, pad_multiple), accelerator)
            for c in chunks
        ]
        result = train_step(step, draft, core, target, micro, chunks, setup, accelerator,
                            params, features, replay)  # fmt: skip
        shapes_met.update(tuple(m["input_ids"].shape) for m in micro)
        widest = max([widest, *shapes_met], key=math.prod)
        if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
            bar.close()
            raise diverged(step, result, records.last_checkpoint)
        optimizer.step()
        records.rows_consumed += rows_per_step
        step_time = ranks.slowest(time.perf_counter() - t_step)  # one clock for all ranks
        clock["train_s"] += step_time
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.add(result.stats, result.counts, result.loss, result.grad_norm, result.target_s, step_time)  # fmt: skip
        done = step + 1
        bar.update(1 if budget is None else min(step_time, budget - bar.n))
        # every rank reads the same clock: the same LR, and the same step to stop at
        out_of_time = budget is not None and clock["train_s"] >= budget
        last = done == tc.steps or out_of_time
        if done % tc.log_every == 0 or last:
            record = window.flush(done, scheduler.get_last_lr()[0], decode.k, offsets)
            record["train_s"] = round(clock["train_s"], 2)  # learning curves in seconds
            if replay is not None:
                record.update(replay.flush())
            bar.set_postfix(loss=f"{record['loss']:.4f}", alpha=f"{record['alpha'][0]:.3f}")
            log.write(record)
            records.last_train = record
        if last:  # what the last checkpoint's evaluation keeps is the records' phase
            memory.begin("records")
        if done % tc.ckpt_every == 0 or last:
            checkpoint_and_evaluate(cfg, evaluations, accelerator, strategy, draft, core,
                                    optimizer, scheduler, replay, target, prepared, records,
                                    log, done, last, clock["train_s"], result.loss,
                                    heldout)  # fmt: skip
        if out_of_time:
            break
    bar.close()
    if memory.stack[-1] == "training":  # a run resumed at its end trains no step
        memory.begin("records")

    summary = {}
    if main:
        wall = time.perf_counter() - t_run
        if records.decode_copies is not None:  # the evaluation's copies as its verdicts made them
            plan = replan_evaluation(plan, records.decode_copies)
        summary = {
            "name": str(cfg.name),
            "run_dir": str(run_dir),
            "steps": done,
            "stopped_by": "time_budget" if out_of_time else "steps",
            "train_s": round(clock["train_s"], 2),  # steps + rollouts, all segments of the run
            "resumed_from": str(resume_from) if resume_from else None,
            "world_size": world,
            "strategy": ran,  # what ran, read from the prepared draft (train/parallel/strategy.py)
            "wall_s": round(wall, 2),
            "steps_per_s": (done - start_step) / wall if wall > 0 else None,
            **window.totals(),  # tokens_per_s, target_time_share
            "data_stats": prepared.stats,
            "threads": threads,  # torch threads per process and why (train/run/machine.py)
            "dtypes": {use: choice.as_record() for use, choice in dtypes.items()},
            "memory": measured_memory(with_train_batch(plan, widest, len(shapes_met)), memory),
        }
        summary = write_summary(cfg, run_dir, summary, records)
        finish_tracking(accelerator, tracking, summary)
    accelerator.end_training()
    return summary
