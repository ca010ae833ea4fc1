"""What `run` (train/loop.py) builds before its first step: the accelerator, the target and
draft from their configs (`load_target` with its dtype and memory plan, `build_draft`), the
preflight forward that checks the draft against the target, what every step computes with
(`step_setup`), the feature cache, the held-out proxy's rows and the replay."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import hydra.utils
import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs
from hydra.errors import InstantiationException
from omegaconf import DictConfig, OmegaConf

from decoding.drafter import Sampling
from models.dtype_choice import DtypeChoice
from models.protocol import DraftModel
from models.target import Target
from models.target_loaders import target_config
from train.core.feature_cache import FeatureCache, build_feature_cache
from train.core.replay import Replay
from train.core.schedule import global_rows
from train.core.step import StepSetup
from train.data.chat import resolve_chat_template
from train.data.prepare import PreparedData
from train.eval.heldout import HeldOut, heldout_rows
from train.losses.divergences import LossSpec
from train.parallel.ranks import Ranks, dist_timeout
from train.parallel.strategy import Strategy
from train.phase_memory import process_memory
from train.report.tracking import TrackingSettings, tracker
from train.run.identity import read_identity
from train.run.init_from import init_draft_from
from train.run.machine import PROBE_TOKENS, target_dtype
from train.run.memory_fit import check_fits, device_memory
from train.run.memory_plan import MemoryPlan, plan_for_run
from train.run.settings import gpu_index


def instantiate(node: DictConfig, **kwargs):
    """hydra.utils.instantiate, its builder given plain lists and dicts (`_convert_="all"`:
    hydra's default hands it ListConfigs and DictConfigs, and models/ takes values, not the
    config), re-raising the builder's own error (its message says what to fix) instead of
    hydra's InstantiationException wrapper."""
    try:
        return hydra.utils.instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        unknown = re.search(r"unexpected keyword argument '(\w+)'", str(cause))
        if isinstance(cause, TypeError) and unknown:  # e.g. +experiment=debug draft=eagle
            raise ValueError(
                f"{node.get('_target_')} takes no setting {unknown[1]!r} (set in this group's "
                "config or by an experiment written for another kind); remove it, e.g. "
                f"~draft.model.{unknown[1]} when it is a draft setting"
            ) from None
        if isinstance(cause, ValueError | FileNotFoundError | TypeError):
            raise cause from None
        raise


def load_target(
    cfg: DictConfig, device: torch.device, resume_from: Path | None, processes_here: int,
    strategy: Strategy, ranks: Ranks,
) -> tuple[Target, DtypeChoice, MemoryPlan]:  # fmt: skip
    """The frozen target, loaded straight into its training dtype on `device`, that
    dtype's choice, and the run's memory plan. Before any weight is read: the dtype is chosen from the target's config
    (train/run/machine.py: target_dtype; a resumed auto run keeps its checkpoint's), and a launch
    whose memory plan (train/run/memory_plan.py) exceeds the device's memory is refused."""
    config, name = target_config(OmegaConf.to_container(cfg.target, resolve=True))
    saved = (read_identity(resume_from).get("target") or {}).get("dtype") if resume_from else None
    tokens = min(PROBE_TOKENS, int(cfg.data.max_len))
    choice = target_dtype(cfg, config, name, device, tokens, saved, ranks)
    plan = plan_for_run(cfg, config, name, choice.dtype, strategy.world_size,
                        strategy.kind == "fsdp", device.type == "cuda", process_memory() or 0)  # fmt: skip
    memory = device_memory(device, processes_here)
    if memory is not None:
        check_fits(plan, *memory)
    return instantiate(cfg.target, dtype=choice.dtype, device=str(device)), choice, plan


def make_accelerator(cfg: DictConfig, tracking: TrackingSettings) -> Accelerator:
    """train.bf16: true -> accelerate's bf16 autocast; "auto" -> the same on CUDA, and on a
    CPU the measured choice (train/run/machine.py), applied by train_step itself. device=cuda:N
    makes GPU N current (train.run.settings.gpu_index). Every collective of a multi-process run
    waits at most train.dist_timeout_s (train/parallel/ranks.py). `tracking`: the logger
    (train/report/tracking.py)."""
    device = str(cfg.device)
    index = gpu_index(device, int(os.environ.get("WORLD_SIZE", "1")))
    if index is not None:  # accelerate's single process runs on "cuda", the current GPU
        torch.cuda.set_device(index)
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    bf16 = cfg.train.bf16
    mixed = "bf16" if bf16 is True or (bf16 == "auto" and not cpu) else "no"
    timeout = InitProcessGroupKwargs(timeout=dist_timeout(cfg.train.get("dist_timeout_s")))
    return Accelerator(
        cpu=cpu, mixed_precision=mixed, log_with=tracker(tracking), kwargs_handlers=[timeout]
    )


def preflight(draft: DraftModel, target: Target, sample_ids: torch.Tensor) -> list[int]:
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


def step_setup(
    cfg: DictConfig, offsets: list[int], decode_samplings: dict[str, Sampling]
) -> StepSetup:
    """What every step computes with (train/core/step.py): cfg.loss, alpha measured at its
    temperature and at the T > 0 ones of `decode_samplings` (train/eval/settings.py:
    EvalSettings.samplings), cfg.train's offset weights, mask, clipping and feature noise."""
    loss = LossSpec.from_settings(OmegaConf.to_container(cfg.loss, resolve=True))
    samplings = [Sampling(temperature=loss.temperature)]
    samplings += [s for s in decode_samplings.values() if not s.greedy]
    tc = cfg.train
    return StepSetup(
        loss, list(offsets), samplings, float(tc.offset_decay),
        bool(tc.get("mask_out_of_vocab", False)), tc.get("max_grad_norm"),
        feature_noise=float(tc.get("feature_noise", 0.0)),
    )  # fmt: skip


def build_draft(cfg: DictConfig, target: Target, prepared: PreparedData, warm_start: bool):
    """The draft of cfg.draft.model on the target's device; `draft.init_from` loads an
    exported or published draft into it when `warm_start` (a resumed run loads its own
    checkpoint instead)."""
    draft = instantiate(cfg.draft.model, target=target, token_counts=prepared.token_counts)
    draft.to(target.device)
    if cfg.draft.get("init_from") and warm_start:
        init_draft_from(cfg.draft.init_from, draft, target, cfg.draft)
    return draft


def feature_cache(
    cfg: DictConfig, accelerator: Accelerator, target: Target, draft: DraftModel, rows
) -> FeatureCache | None:
    """train.feature_cache: the target's features over the rows, computed once in the
    loop's first-epoch order (every rank its share of the batches), then read by every rank."""
    if not cfg.train.get("feature_cache"):
        return None
    first_epoch = global_rows(0, len(rows), len(rows), cfg.seed)
    start = time.perf_counter()
    cache = build_feature_cache(
        target, rows, draft.hidden_layers, cfg.data.get("cache_dir"),
        batch_size=cfg.train.batch_size, order=first_epoch,
        progress=accelerator.is_main_process, ranks=Ranks.current(),
        pad_multiple=int(cfg.train.get("pad_multiple") or 1),
    )  # fmt: skip
    if accelerator.is_main_process:  # a stage line: computed once, then read in seconds
        print(f"[draftlab] features: the target's taps {tuple(draft.hidden_layers)} over "
              f"{len(rows)} rows, ready in {time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip
    return cache


def make_replay(
    cfg: DictConfig, rows, offsets: list[int], pad_id: int, accelerator
) -> Replay | None:
    """On-policy replay of the draft's own rollouts (train/core/replay.py), when enabled."""
    if cfg.get("replay") is None or not cfg.replay.enabled:
        return None
    args = OmegaConf.to_container(cfg.replay, resolve=True)
    del args["enabled"]
    return Replay(
        rows, offsets=offsets, pad_token_id=pad_id, seed=cfg.seed,
        rank=accelerator.process_index, world_size=accelerator.num_processes,
        loss_temperature=float(cfg.loss.temperature), **args,
    )  # fmt: skip


def heldout_proxy(
    cfg: DictConfig, target: Target, prepared: PreparedData, setup: StepSetup
) -> list[HeldOut] | None:
    """train.heldout_proxy: the eval prompts with the target's greedy answers, as long as the
    decoder's (train/eval/heldout.py), answered by the target as it trains (its dtype now: no
    copy in another; every rank answers its share), and the validation rows a pack holds out
    (data.pack_val: `val/` keys), the ones recipe decisions read."""
    if not cfg.train.get("heldout_proxy"):
        return None
    data = cfg.data
    rows = heldout_rows(
        target, prepared.eval_prompts, int(cfg.decode.get("max_new_tokens", 64)),
        dtype=str(target.dtype).removeprefix("torch."),
        batch_size=int(data.get("regen_batch_size", 16)), seed=int(data.get("seed", 0)),
        cache_dir=data.get("cache_dir"),
        chat_template=resolve_chat_template(target.tokenizer, data.get("chat_template")),
        progress=bool(data.get("progress", True)), ranks=Ranks.current(),
    )  # fmt: skip
    pad, size, k = target.tokenizer.pad_token_id, int(cfg.train.batch_size), int(cfg.decode.k)
    multiple = int(cfg.train.get("pad_multiple") or 1)
    proxies = [HeldOut.from_rows(rows, pad, size, target.device, setup, k, pad_multiple=multiple)]
    if prepared.val_rows:
        proxies.append(HeldOut.from_rows(prepared.val_rows, pad, size, target.device, setup, k,
                                         prefix="val/", pad_multiple=multiple))  # fmt: skip
    return proxies
