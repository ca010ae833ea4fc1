"""The training loop, one file of over 400 lines: `run` is one procedure, config to summary.

Frozen target online, trainable draft, accelerate for devices and ranks.

One optimizer step = `grad_accum` micro-batches of `batch_size` rows on every rank. The
global batch (batch_size x world_size x grad_accum rows) is cut from one seeded stream of
row indices (a fresh permutation per epoch), rank r taking its slice, so 2 ranks x 2 rows
see exactly the rows of 1 rank x 4 rows, and resuming only needs the step number.

Loss normalisation: each offset's loss is summed over trained positions and divided by
the GLOBAL count of trained positions (all ranks, all micro-batches of the step), times
world_size because DDP averages gradients. So the gradient is the token-mean over the
global batch whatever the split across ranks and micro-batches.

The target runs under no_grad rather than inference_mode: inference tensors cannot be
saved for backward, and the loss saves softmax(target logits); cloning [B, T, V] logits
out of inference mode every step would cost more than inference_mode saves.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import hydra.utils
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, gather_object, set_seed
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from train.checkpoint import (
    load_checkpoint,
    resume_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from train.data.prepare import collate, prepare_data
from train.evaluate import evaluate_checkpoint, format_eval_table
from train.feature_cache import build_feature_cache, cached_target_output
from train.init_from import init_draft_from
from train.losses import LOSSES
from train.replay import Replay
from train.report.tracking import setup_wandb_env, wandb_run_settings, wandb_summary
from train.settings import check_settings
from train.step_stats import StepWindow, aux_loss, offset_losses, offset_weights, proxy_tags


class TrainingDiverged(RuntimeError):
    pass


def _instantiate(node: DictConfig, **kwargs):
    """hydra.utils.instantiate, re-raising the builder's own error (its message says what
    to fix) instead of hydra's InstantiationException wrapper."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        if isinstance(err.__cause__, ValueError | FileNotFoundError | TypeError):
            raise err.__cause__ from None
        raise


def _make_accelerator(cfg: DictConfig) -> Accelerator:
    log_with = None
    if cfg.logger.kind == "wandb":
        setup_wandb_env()
        log_with = "wandb"
    elif cfg.logger.kind != "none":
        raise ValueError(f"logger.kind must be 'wandb' or 'none', got {cfg.logger.kind!r}")
    device = str(cfg.device)
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    return Accelerator(
        cpu=cpu, mixed_precision="bf16" if cfg.train.bf16 else "no", log_with=log_with
    )


def _lr_lambda(warmup: int, total: int, min_ratio: float, time_progress=None):
    """Linear warmup over `warmup` steps, then cosine to `min_ratio`. The cosine's progress
    is (step - warmup) / (total - warmup), or `time_progress()` (spent share of a training
    time budget) when given: a run stopped by its budget then anneals as fully as one
    stopped by its step count, however slow its steps are."""

    def fn(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if time_progress is not None:
            progress = min(1.0, time_progress())
        else:
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, num_rows: int) -> tuple[int, ...]:
    """The seeded order of one epoch, drawn once (not once per row: the feature cache asks
    for a whole epoch at a time)."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return tuple(torch.randperm(num_rows, generator=g).tolist())


def global_rows(step: int, rows_per_step: int, num_rows: int, seed: int) -> list[int]:
    """Row indices of optimizer step `step`: a contiguous slice of an endless stream that
    visits every row once per epoch in a seeded per-epoch order."""
    out, start = [], step * rows_per_step
    for j in range(start, start + rows_per_step):
        epoch, pos = divmod(j, num_rows)
        out.append(_epoch_order(seed, epoch, num_rows)[pos])
    return out


def _preflight(draft, target, sample_ids: torch.Tensor) -> list[int]:
    """One tiny forward: check the draft's vocabulary against the target, learn offsets."""
    with torch.no_grad():
        ids = sample_ids[None, :8].to(target.device)  # [1, <=8]
        t_out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
        out = draft(target, ids, t_out, torch.ones_like(ids))
    for logits in out.logits:
        want = target.vocab_size if out.vocab_ids is None else len(out.vocab_ids)
        if logits.shape[-1] != want:
            what = "the target's vocabulary" if out.vocab_ids is None else "len(vocab_ids)"
            raise ValueError(
                f"the draft predicts {logits.shape[-1]} tokens per position but {what} has "
                f"{want} (target {target.name!r}): the draft must use the target's tokenizer, "
                "or return vocab_ids mapping its reduced vocabulary to target ids."
            )
    return list(out.offsets)


def run(cfg: DictConfig) -> dict:
    """Train cfg.draft on cfg.target; checkpoints, evaluation and summary in cfg.run_dir."""
    check_settings(cfg)  # every decode / replay / loop setting, before anything is loaded
    accelerator = _make_accelerator(cfg)
    main, rank, world = (
        accelerator.is_main_process,
        accelerator.process_index,
        accelerator.num_processes,
    )
    run_dir = Path(cfg.run_dir)
    resume_from = resume_checkpoint(Path(cfg.run_dir), bool(cfg.resume), bool(cfg.overwrite))
    accelerator.wait_for_everyone()
    if main and cfg.overwrite and resume_from is None:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        for name in ("metrics.jsonl", "summary.json"):
            (run_dir / name).unlink(missing_ok=True)
    tc = cfg.train
    set_seed(cfg.seed)

    # -- target, data, draft ------------------------------------------------------
    target = _instantiate(cfg.target)
    target.to(accelerator.device)
    with accelerator.main_process_first():  # rank 0 fills the regeneration cache
        prepared = prepare_data(target, **OmegaConf.to_container(cfg.data, resolve=True))
    train_rows = prepared.train.select_columns(["input_ids", "loss_mask"])
    pad_id = target.tokenizer.pad_token_id
    draft = _instantiate(cfg.draft.model, target=target, token_counts=prepared.token_counts)
    draft.to(accelerator.device)
    if cfg.draft.get("init_from") and resume_from is None:  # resume: the checkpoint wins
        init_draft_from(cfg.draft.init_from, draft, target)
    offsets = _preflight(draft, target, torch.tensor(train_rows[0]["input_ids"]))
    features = None  # train.feature_cache: the target's features over the rows, computed once
    if tc.get("feature_cache"):
        with accelerator.main_process_first():  # rank 0 builds, the others read
            first_epoch = global_rows(0, len(train_rows), len(train_rows), cfg.seed)
            features = build_feature_cache(
                target, train_rows, draft.hidden_layers, cfg.data.get("cache_dir"),
                batch_size=tc.batch_size, order=first_epoch, progress=main,
            )  # fmt: skip
    # A draft that trains at sampled positions (DFlash / Domino anchors) takes the loss mask,
    # to place them where x_{t+1} is trained; the others never see it.
    takes_loss_mask = "loss_mask" in inspect.signature(draft.forward).parameters
    params = [p for p in draft.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the draft has no trainable parameters; check draft.model settings")
    oc = cfg.optim
    optimizer = torch.optim.AdamW(
        params, lr=oc.lr, betas=tuple(oc.betas), eps=oc.eps, weight_decay=oc.weight_decay
    )
    # Training time so far: optimizer steps with their replay rollouts, not checkpoints or
    # evaluations. With train.time_budget_s the run stops once it is spent (tc.steps is then
    # a cap), which is how runs of different step cost are compared at equal wall-clock.
    budget = tc.get("time_budget_s")
    clock = {"train_s": 0.0}
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        _lr_lambda(
            oc.warmup_steps,
            tc.steps,
            oc.min_lr_ratio,
            None if budget is None else lambda: clock["train_s"] / budget,
        ),
    )
    replay = None  # on-policy replay of the draft's own rollouts (train/replay.py)
    if cfg.get("replay") is not None and cfg.replay.enabled:
        replay_args = OmegaConf.to_container(cfg.replay, resolve=True)
        del replay_args["enabled"]
        replay = Replay(
            train_rows, offsets=offsets, pad_token_id=pad_id, seed=cfg.seed, rank=rank,
            world_size=world, loss_temperature=float(cfg.loss.temperature), **replay_args,
        )  # fmt: skip

    start_step = 0
    if resume_from is not None:
        if accelerator.distributed_type == DistributedType.FSDP:
            raise NotImplementedError(
                "resume=true under FSDP is not supported: the checkpoint holds the main rank's "
                "optimizer shard only. Resume with DDP (conf/accelerate/ddp.yaml) or start afresh."
            )
        draft_state, _, state = load_checkpoint(resume_from)
        if state["world_size"] != world:
            raise ValueError(
                f"{resume_from} was written by {state['world_size']} processes; "
                f"resume with the same number (got {world})"
            )
        draft.load_state_dict(draft_state, strict=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"][rank])
        if replay is not None and state.get("replay"):
            replay.load_state_dict(state["replay"][rank])
        start_step = state["step"]
        clock["train_s"] = state.get("train_s", 0.0)
    draft, optimizer = accelerator.prepare(draft, optimizer)  # scheduler stepped by hand
    core = accelerator.unwrap_model(draft)

    # -- logging ------------------------------------------------------------------
    metrics_path = run_dir / "metrics.jsonl"
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        if resume_from is not None and metrics_path.exists():  # drop lines past the checkpoint
            kept = [
                ln
                for ln in metrics_path.read_text().splitlines()
                if ln and json.loads(ln)["step"] <= start_step
            ]
            metrics_path.write_text("".join(ln + "\n" for ln in kept))
    if cfg.logger.kind == "wandb":
        wb = wandb_run_settings(cfg)  # group = runs differing only in seed; tags = kind, loss, data
        accelerator.init_trackers(
            cfg.logger.project,
            config=OmegaConf.to_container(cfg, resolve=True),
            init_kwargs={
                "wandb": {
                    "name": wb["name"],
                    "group": wb["group"],
                    "tags": wb["tags"],
                    "dir": str(run_dir),
                    "entity": cfg.logger.get("entity"),
                }
            },
        )

    def log(record: dict) -> None:
        if main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            accelerator.log(
                {k: v for k, v in record.items() if isinstance(v, int | float)}, step=record["step"]
            )

    # -- the loop -----------------------------------------------------------------
    loss_fn = LOSSES[cfg.loss.name]
    temperature = float(cfg.loss.temperature)
    k_decode = int(cfg.decode.k)
    rows_per_step = tc.batch_size * world * tc.grad_accum
    n_off = len(offsets)
    window = StepWindow(n_off, proxy_tags(cfg.decode))
    # A resumed run's summary covers the whole run: records up to the checkpoint come back.
    earlier = []
    if main and resume_from is not None and metrics_path.exists():
        earlier = [json.loads(ln) for ln in metrics_path.read_text().splitlines()]
    eval_history = [
        {k: v for k, v in r.items() if k != "kind"} for r in earlier if r["kind"] == "eval"
    ]
    last_eval: dict = eval_history[-1] if eval_history else {}
    trained = [r for r in earlier if r["kind"] == "train"]
    proxy = trained[-1] if trained else None  # the newest train record (alpha per offset, sim tau)
    last_ckpt = str(resume_from) if resume_from else None
    target_eval = None  # decoding copies (train.evaluate.DecodeCopies), built at the first eval
    t_run = time.perf_counter()
    # With a time budget the bar counts training seconds: the step count is not known ahead.
    bar = tqdm(
        total=tc.steps if budget is None else budget,
        initial=start_step if budget is None else min(clock["train_s"], budget),
        unit="step" if budget is None else "s",
        disable=not main,
        desc=str(cfg.name) if budget is None else f"{cfg.name} (time budget)",
        bar_format=None if budget is None else "{l_bar}{bar}| {n:.0f}/{total:.0f} s{postfix}",
    )

    done = start_step
    # A resumed run whose budget was already spent trains no further.
    out_of_time = budget is not None and clock["train_s"] >= budget
    last_step = start_step if out_of_time else tc.steps
    for step in range(start_step, last_step):
        t_step = time.perf_counter()
        if hasattr(core, "set_progress"):  # a loss that follows training (Domino's curriculum)
            core.set_progress(clock["train_s"] / budget if budget else step / tc.steps)
        rows = global_rows(step, rows_per_step, len(train_rows), cfg.seed)
        micro, chunks = [], []
        for a in range(tc.grad_accum):
            chunk = rows[
                (a * world + rank) * tc.batch_size : (a * world + rank + 1) * tc.batch_size
            ]
            chunks.append(chunk)
            batch = collate([train_rows[i] for i in chunk], pad_id)
            micro.append({k: v.to(accelerator.device) for k, v in batch.items()})
        # Global count of trained positions per offset (all micro-batches, all ranks).
        counts = torch.tensor(
            [[float(b["loss_mask"][:, off:].sum()) for off in offsets] for b in micro],
            device=accelerator.device,
        ).sum(0)  # [n_off]
        counts = accelerator.reduce(counts, reduction="sum").clamp_min(1.0)
        # loss, alpha, top1 sums; aux; alpha per decode sampling; tokens (train/step_stats.py)
        stats = torch.zeros(window.size, device=accelerator.device)
        t_target = 0.0
        replay_share = 0.0  # replay's share of the loss; the offline part gets 1 - share
        if replay is not None:  # own rollouts + backward, before the syncing micro-batch
            replay.maybe_rollout(step, target, core)
            with accelerator.no_sync(draft):
                offline = float(counts[0]) / world  # this rank's share, for the log
                replay_share = replay.backward(step, draft, core, target, accelerator, offline)
        for a, b in enumerate(micro):
            t0 = time.perf_counter()
            if features is not None:
                t_out = cached_target_output(features, target, chunks[a], b)
            else:
                with torch.no_grad():
                    t_out = target(
                        b["input_ids"],
                        attention_mask=b["attention_mask"],
                        hidden_layers=tuple(core.hidden_layers),
                        use_cache=False,
                    )
            if t_out.logits.is_cuda:
                torch.cuda.synchronize()
            t_target += time.perf_counter() - t0
            sync = a == tc.grad_accum - 1
            with accelerator.no_sync(draft) if not sync else nullcontext():
                extra = {"loss_mask": b["loss_mask"]} if takes_loss_mask else {}
                out = draft(target, b["input_ids"], t_out, b["attention_mask"], **extra)
                loss = offset_losses(
                    out, t_out.logits, b, offsets, counts, loss_fn, temperature, cfg, stats
                )
                loss = loss * world * (1.0 - replay_share)
                aux = aux_loss(out, t_out.logits, b["attention_mask"])
                if aux is not None:
                    loss = loss + aux / tc.grad_accum
                    stats[3 * n_off] += aux.detach().float() / tc.grad_accum
                stats[-1] += b["attention_mask"].sum()
                accelerator.backward(loss)
        stats = accelerator.reduce(stats, reduction="sum")
        stats[3 * n_off] /= world
        grad_norm = accelerator.clip_grad_norm_(params, tc.max_grad_norm or float("inf"))
        weights = offset_weights(out, tc)  # train.offset_decay ** i, or the draft's own
        loss_value = float(sum(weights[i] * stats[i] / counts[i] for i in range(n_off)))
        loss_value += float(stats[3 * n_off])
        if not (math.isfinite(loss_value) and math.isfinite(float(grad_norm))):
            bar.close()
            kept = (
                f"the last good checkpoint {last_ckpt} is kept"
                if last_ckpt
                else "no checkpoint was written yet"
            )
            raise TrainingDiverged(
                f"non-finite training signal at step {step + 1}: loss={loss_value}, "
                f"grad_norm={float(grad_norm)}; the update was not applied and {kept}. "
                "Lower optim.lr, enable gradient clipping (train.max_grad_norm) or check the data."
            )
        optimizer.step()
        step_time = time.perf_counter() - t_step
        clock["train_s"] += step_time
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        window.add(stats, counts, loss_value, float(grad_norm), t_target, step_time)
        done = step + 1
        bar.update(1 if budget is None else min(step_time, budget - bar.n))
        out_of_time = False
        if budget is not None:  # every rank stops at the same step
            spent = torch.tensor(float(clock["train_s"] >= budget), device=accelerator.device)
            out_of_time = bool(accelerator.reduce(spent, reduction="sum") > 0)
        last = done == tc.steps or out_of_time
        if done % tc.log_every == 0 or last:
            rec = window.flush(done, scheduler.get_last_lr()[0], k_decode, offsets)
            if replay is not None:
                rec.update(replay.flush())
            bar.set_postfix(loss=f"{rec['loss']:.4f}", alpha=f"{rec['alpha'][0]:.3f}")
            log(rec)
            proxy = rec
        if done % tc.ckpt_every == 0 or last:
            # Collectives first, on every rank (FSDP gathers the full state dict here).
            draft_state = accelerator.get_state_dict(draft)
            rng_all = gather_object([rng_state()])  # one entry per rank
            replay_all = gather_object([replay.state_dict()]) if replay is not None else None
            if main:
                state = {
                    "step": done,
                    "rows_consumed": done * rows_per_step,
                    "world_size": world,
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "rng": rng_all,
                    "replay": replay_all,  # every rank's buffer
                    "train_s": clock["train_s"],
                }
                last_ckpt = str(
                    save_checkpoint(
                        run_dir,
                        done,
                        draft_state,
                        OmegaConf.to_yaml(cfg.draft, resolve=True),
                        state,
                        tc.keep_last,
                        meta={"loss": loss_value, "name": str(cfg.name)},
                    )
                )
                every = tc.get("eval_every")  # null: every checkpoint; N: multiples of N + last
                if tc.eval_at_ckpt and (last or not every or done % every == 0):
                    rng = rng_state()  # evaluation must not shift the training RNG stream
                    last_eval, target_eval = evaluate_checkpoint(
                        target, core, prepared.eval_prompts, cfg, proxy, target_eval
                    )
                    set_rng_state(rng)
                    last_eval["step"] = done
                    eval_history.append(last_eval)
                    log({"kind": "eval", **last_eval})
            accelerator.wait_for_everyone()
        if out_of_time:
            break
    bar.close()

    summary = {}
    if main:
        wall = time.perf_counter() - t_run
        steps_run = done - start_step
        summary = {
            "name": str(cfg.name),
            "run_dir": str(run_dir),
            "steps": done,
            "stopped_by": "time_budget" if out_of_time else "steps",
            "train_s": round(clock["train_s"], 2),  # steps + rollouts, all sessions of the run
            "resumed_from": str(resume_from) if resume_from else None,
            "last_checkpoint": last_ckpt,
            "world_size": world,
            "wall_s": round(wall, 2),
            "steps_per_s": steps_run / wall if wall > 0 else None,
            "tokens_per_s": window.total_tokens / window.total_time if window.total_time else None,
            "target_time_share": window.total_target / window.total_time
            if window.total_time
            else None,
            "final_train": proxy,
            "final_eval": last_eval or None,
            "tau_curve": [[e["step"], e.get("tau")] for e in eval_history],
            "data_stats": prepared.stats,
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        if cfg.logger.kind == "wandb":  # final τ, speedup, α_i in W&B's own run table
            accelerator.get_tracker("wandb", unwrap=True).summary.update(wandb_summary(summary))
        if eval_history:
            print(f"\n{cfg.name}: decoder evaluation (k={cfg.decode.k}) -> {run_dir}/summary.json")
            print(format_eval_table(eval_history), flush=True)
    accelerator.end_training()
    return summary
