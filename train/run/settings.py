"""Start-up checks of a training config, and the values built from it for the rooms below.

`check_settings(cfg)` runs first in train.loop.run, before the target is loaded, so a bad
decode / evaluation / replay / loop setting fails in seconds instead of at the first evaluation
or rollout, hours into a run. What needs the target or the data (the context window:
`check_decode_context`) runs once they are loaded, before any training.

The checks are those of the code that uses each setting (decoding.verify.check_sampling,
decoding.tree.TreeSpec, train.core.replay.Replay, models.dtypes.resolve_dtype, the loss table,
train.core.optimizers.build_optimizer), called on the config values, with the config key in front
of their messages.

Past the set-up no function reads the config (docs/design.md §1): `eval_settings` and
`tracking_settings` read it once, with the defaults of a config written before a key existed,
into the values train/eval/ and train/report/tracking.py take.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from decoding.drafter import Sampling
from decoding.drafters import drafter_class
from decoding.inductor import resolve_mode
from decoding.rounds import check_context
from decoding.tree import TreeSpec
from decoding.verify import check_sampling
from models.dtypes import resolve_dtype
from models.target import Target
from train.core.optimizers import build_optimizer, optimizer_settings
from train.core.replay import Replay
from train.data.pack import resolve_pack
from train.data.prompt_file import spread
from train.data.regen_openai import check_backend_settings
from train.data.sources import check_source
from train.eval.settings import EvalSettings
from train.losses.divergences import LossSpec
from train.report.tracking import TrackingSettings
from train.run.init_from import detect_format


def _named(where: str, check: Callable, *args, **kwargs):
    """check(*args, **kwargs), its ValueError prefixed with the config key it is about."""
    try:
        return check(*args, **kwargs)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def check_dtype(where: str, value) -> None:
    """A dtype name, or "auto" (measured on this machine: models/dtype_choice.py)."""
    if value != "auto":
        _named(where, resolve_dtype, value)


def check_train(tc: DictConfig) -> None:
    for key in ("steps", "batch_size", "grad_accum", "log_every", "ckpt_every", "pad_multiple"):
        if not tc.get(key, 1) >= 1:
            raise ValueError(f"train.{key} must be >= 1, got {tc[key]}")
    if not tc.keep_last >= 0:
        raise ValueError(
            f"train.keep_last must be >= 0 (0 = keep every checkpoint), got {tc.keep_last}"
        )
    every = tc.get("eval_every")
    if every is not None and not (isinstance(every, int) and every >= 1):
        raise ValueError(
            f"train.eval_every must be a number of steps >= 1 or null (every checkpoint), "
            f"got {every!r}"
        )
    budget = tc.get("time_budget_s")
    if budget is not None and not budget > 0:
        raise ValueError(f"train.time_budget_s must be > 0 seconds or null, got {budget}")
    if tc.max_grad_norm is not None and not tc.max_grad_norm >= 0:
        raise ValueError(
            f"train.max_grad_norm must be > 0, or 0 / null for no clipping, got {tc.max_grad_norm}"
        )
    if not tc.offset_decay >= 0:
        raise ValueError(
            f"train.offset_decay (weight gamma^i of offset i) must be >= 0, got {tc.offset_decay}"
        )


def check_loss_and_optim(cfg: DictConfig) -> None:
    # name, temperature, labels, the loss's options
    loss = LossSpec.from_settings(OmegaConf.to_container(cfg.loss, resolve=True))
    vocab = cfg.get("draft", {}).get("model", {}).get("vocab_size", "full")
    if loss.labels_from_data and vocab != "full":
        raise ValueError(
            f"loss.labels=data trains on the data's tokens, which a reduced draft vocabulary "
            f"(draft.model.vocab_size={vocab}) cannot always predict; set "
            "draft.model.vocab_size=full, or loss.labels=target"
        )
    oc = cfg.optim
    # The loop's own build_optimizer (torch's AdamW checks lr, betas, eps, weight_decay; Muon
    # its settings): a matrix and a vector stand in for the draft, so optim=muon builds both.
    probe = [
        ("w", torch.zeros(2, 2, requires_grad=True)),
        ("b", torch.zeros(2, requires_grad=True)),
    ]
    settings = optimizer_settings(OmegaConf.to_container(oc, resolve=True))
    _named("optim", build_optimizer, probe, **settings)
    if not oc.warmup_steps >= 0:
        raise ValueError(f"optim.warmup_steps must be >= 0, got {oc.warmup_steps}")
    if not 0.0 <= oc.min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {oc.min_lr_ratio}")


def check_decode(dec: DictConfig) -> None:
    """The settings train/eval/evaluate.py decodes with after every checkpoint."""
    if not dec.k >= 1:
        raise ValueError(f"decode.k (draft tokens per round) must be >= 1, got {dec.k}")
    if not dec.temperatures:
        raise ValueError("decode.temperatures must list at least one temperature (0 = greedy)")
    for temp in dec.temperatures:
        sampling = Sampling(temperature=float(temp), top_k=int(dec.top_k), top_p=float(dec.top_p))
        _named("decode", check_sampling, sampling)
    if not dec.max_new_tokens >= 1:
        raise ValueError(f"decode.max_new_tokens must be >= 1, got {dec.max_new_tokens}")
    if dec.num_prompts is not None and not dec.num_prompts >= 1:
        raise ValueError(
            f"decode.num_prompts must be >= 1 (or null: every eval prompt), got {dec.num_prompts}"
        )
    if not dec.warmup >= 0:
        raise ValueError(f"decode.warmup (untimed prompts) must be >= 0, got {dec.warmup}")
    check_dtype("decode.dtype", dec.dtype)
    check_dtype("decode.draft_dtype", dec.get("draft_dtype", "auto"))
    if dec.get("compile", False) not in (True, False, "only", "auto"):
        raise ValueError(f"decode.compile must be true, false, only or auto, got {dec.compile!r}")
    if dec.get("compile", False):
        mode = dec.get("compile_mode", "auto")
        _named("decode.compile_mode", resolve_mode, mode, torch.device("cpu"))
        if not dec.warmup >= 1:
            raise ValueError(
                "decode.compile=true needs decode.warmup >= 1: the warm-up prompt keeps what a "
                "first decode pays once (allocations, caches) out of the timed decoding"
            )
    if dec.get("tree") is not None:
        _named("decode.tree", TreeSpec, **OmegaConf.to_container(dec.tree, resolve=True))
    lookup = dec.get("lookup_min_match", 0)
    if not isinstance(lookup, int) or isinstance(lookup, bool) or lookup < 0:
        raise ValueError(
            f"decode.lookup_min_match must be an integer >= 0 (0 = off), got {lookup!r}"
        )


def check_draft_decode(cfg: DictConfig) -> None:
    """The decode and replay settings the chosen draft kind's drafter accepts: what it
    declares (decoding/drafter.py: Drafter; decoding/drafters: DRAFTERS)."""
    kind, tree = cfg.draft.kind, cfg.decode.get("tree")
    drafter = _named("draft.kind", drafter_class, kind)
    replay = cfg.get("replay") is not None and cfg.replay.enabled
    if tree is not None and tree.kind not in drafter.tree_kinds:
        fits = [f"decode=tree_{t}" for t in drafter.tree_kinds] + ["decode=chain"]
        raise ValueError(
            f"draft={kind} cannot draft decode.tree.kind={tree.kind} trees "
            f"({drafter.__name__}); use {' or '.join(fits)}"
        )
    if replay and not drafter.replayable:
        raise ValueError(
            f"replay.enabled=true: draft={kind} cannot train on the positions a rollout picks "
            f"({drafter.__name__}.replayable is false); set replay.enabled=false"
        )
    most = drafter.max_draft_tokens(OmegaConf.to_container(cfg.draft.model, resolve=True))
    if most is None:
        return
    if tree is not None:
        wanted = [("decode.tree.depth", tree.depth)]
    elif cfg.decode.get("adaptive_k"):  # k grows up to 2k (decoding/spec.py)
        wanted = [("2 * decode.k (the adaptive_k ceiling)", 2 * cfg.decode.k)]
    else:
        wanted = [("decode.k", cfg.decode.k)]
    if replay:
        wanted.append(("replay.k", cfg.replay.k))
    for key, k in wanted:
        if k > most:
            raise ValueError(
                f"{key}={k} drafts per round but one round of a draft={kind} drafts at most "
                f"{most} tokens with these draft.model settings ({drafter.__name__}."
                f"max_draft_tokens); use {key} <= {most}, or train a draft that drafts more "
                "(DFlash / Domino: draft.model.block_size; MTP: draft.model.num_depths or "
                "recursive_last=true)"
            )


def check_replay(replay: DictConfig) -> None:
    """The settings of on-policy replay rollouts (train/core/replay.py)."""
    args = OmegaConf.to_container(replay, resolve=True)
    del args["enabled"]
    # Replay's constructor checks its losses, ratio, every, num_prompts, batch_size, capacity
    # and max_age; one stand-in row replaces the training data, which is not loaded yet.
    Replay([{"input_ids": [0], "loss_mask": [1]}], offsets=[0], pad_token_id=0, **args)
    if not args["k"] >= 1:
        raise ValueError(f"replay.k (drafts per round in rollouts) must be >= 1, got {args['k']}")
    if not args["max_new_tokens"] >= 1:
        raise ValueError(f"replay.max_new_tokens must be >= 1, got {args['max_new_tokens']}")
    sampling = Sampling(temperature=float(args["temperature"]), top_p=float(args["top_p"]))
    _named("replay", check_sampling, sampling)
    if args["dtype"] is not None:
        check_dtype("replay.dtype", args["dtype"])
    for key in ("rejected_weight", "position_decay"):
        if not args[key] >= 0:
            raise ValueError(f"replay.{key} must be >= 0, got {args[key]}")


def check_decode_context(target: Target, dec: DictConfig, eval_prompts: list[dict]) -> None:
    """After the target and the data are loaded, before any training: the longest prompt the
    evaluation decodes plus decode.max_new_tokens must fit the target's context window."""
    prompts = spread(eval_prompts, dec.get("num_prompts"))  # those train/eval/plan.py decodes
    if not prompts:
        return
    longest, new = max(len(p["input_ids"]) for p in prompts), int(dec.max_new_tokens)
    room = (target.context_length or 0) - longest
    check_context(
        target, longest, new, "decode.max_new_tokens after the longest eval prompt",
        f"set decode.max_new_tokens<={room}" if room >= 1 else "shorten the eval prompts",
    )  # fmt: skip


def check_regen_backend(data: DictConfig) -> None:
    """data.regen_backend and its server settings (no network: the server is asked when
    prompts are left to answer, train/data/regen_openai.py)."""
    if not data.get("regenerate", True):
        return
    request = data.get("regen_request")
    if isinstance(request, DictConfig):
        request = OmegaConf.to_container(request, resolve=True)
    check_backend_settings(
        data.get("regen_backend", "hf"), data.get("regen_url"), data.get("regen_model"),
        data.get("regen_concurrency", 8), data.get("regen_retries", 3),
        data.get("regen_timeout", 600), request, data.get("chat_template"),
        data.get("max_failed_share", 0.01),
    )  # fmt: skip


def check_data_reading(data: DictConfig) -> None:
    """data.bad_rows, data.num_proc, data.regenerate_turns (train/data/local_source.py, turns.py),
    data.self_prompts and the pack settings (train/data/self_prompts.py, pack.py)."""
    choices = {"bad_rows": ("skip", "refuse"), "regenerate_turns": ("last", "all")}
    for key, allowed in choices.items():
        if data.get(key, allowed[0]) not in allowed:
            raise ValueError(f"data.{key}={data.get(key)!r}: use {' or '.join(allowed)}")
    procs = data.get("num_proc")
    if procs is not None and not (isinstance(procs, int) and procs >= 1):
        raise ValueError(f"data.num_proc={procs!r}: a number of processes >= 1, or null (the CPUs)")
    count = data.get("self_prompts", 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ValueError(f"data.self_prompts={count!r}: a number of requests to draw >= 0")
    resolve_pack(data.get("pack"))  # a missing pack: refused before the target loads
    tokens = data.get("pack_tokens")
    if tokens is not None and not (isinstance(tokens, int) and tokens > 0):
        raise ValueError(f"data.pack_tokens={tokens!r}: a number of answer tokens > 0, or null")
    sources = list(data.get("pack_sources", ["self", "pool"]) or [])
    if not sources or set(sources) - {"self", "pool"}:
        raise ValueError(f"data.pack_sources={sources}: a non-empty list of self and/or pool")


def check_unset(cfg: DictConfig) -> None:
    """A mandatory value left at ??? (target=hf's target.path, data=local's data.source)."""
    unset = sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra."))
    if unset:
        raise ValueError(
            f"{', '.join(unset)} must be set: pass "
            f"{' '.join(f'{k}=...' for k in unset)} (e.g. target.path=DIR_OR_HUB_ID, "
            "data.source=FILE.jsonl)"
        )


def gpu_index(device: str, world_size: int) -> int | None:
    """`device` -> the GPU a single process must make current (N of cuda:N), else None;
    refuses a GPU this machine or launch cannot give. accelerate places one process on
    "cuda", the current GPU, and rank i of a multi-process launch on cuda:i, whatever
    `device` says, so cuda:N is honoured by making N current, and only in one process."""
    if not device.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        raise ValueError(f"device={device} but CUDA is not available here; use device=cpu or auto")
    index = torch.device(device).index
    if index is None:
        return None
    if world_size > 1:
        raise ValueError(
            f"device={device} names one GPU, but this launch runs {world_size} processes and "
            "accelerate puts rank i on cuda:i; use device=cuda (CUDA_VISIBLE_DEVICES picks "
            "the GPUs)"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(
            f"device={device} but this machine has {count} GPU(s), cuda:0..{count - 1}"
        )
    return index


def check_settings(cfg: DictConfig) -> None:
    """Raise a ValueError naming the first bad setting and what it must be."""
    check_unset(cfg)
    check_source(cfg.data.source)  # a missing or empty file, before the target loads
    if cfg.draft.get("init_from") and str(cfg.resume).lower() != "true":  # no draft we read
        detect_format(cfg.draft.init_from)
    check_train(cfg.train)
    check_loss_and_optim(cfg)
    check_decode(cfg.decode)
    check_dtype("data.regen_dtype", cfg.data.get("regen_dtype", "auto"))
    check_regen_backend(cfg.data)
    check_data_reading(cfg.data)
    check_dtype("target.dtype", cfg.target.get("dtype", "float32"))
    if cfg.train.bf16 not in (True, False, "auto"):
        raise ValueError(
            f"train.bf16 must be true, false or auto (measured on this machine), got "
            f"{cfg.train.bf16!r}"
        )
    check_draft_decode(cfg)
    if cfg.train.eval_at_ckpt and not cfg.data.num_eval >= 1:
        raise ValueError(
            "train.eval_at_ckpt=true but the data has no eval prompts; set data.num_eval > 0"
        )
    if cfg.train.get("heldout_proxy") and not cfg.data.num_eval >= 1:
        raise ValueError(
            "train.heldout_proxy=true scores the draft on the eval prompts, but the data has "
            "none; set data.num_eval > 0, or train.heldout_proxy=false"
        )
    if cfg.get("replay") is not None and cfg.replay.enabled:
        check_replay(cfg.replay)


def eval_settings(cfg: DictConfig) -> EvalSettings:
    """What train/eval/ decodes with (train/eval/settings.py): cfg.decode, the run's seed
    where decode.seed is unset, and the data's cache and chat template."""
    dec, data = cfg.decode, cfg.get("data") or {}
    tree = dec.get("tree")  # decode=tree_static / tree_dynamic: draft trees (decoding/tree.py)
    return EvalSettings(
        k=int(dec.get("k", 4)),
        temperatures=tuple(float(t) for t in dec.get("temperatures", [0.0])),
        top_k=int(dec.get("top_k", 0)),
        top_p=float(dec.get("top_p", 1.0)),
        max_new_tokens=int(dec.get("max_new_tokens", 64)),
        num_prompts=dec.get("num_prompts"),
        warmup=int(dec.get("warmup", 1)),
        seed=int(dec.get("seed", cfg.seed)),
        dtype=str(dec.get("dtype", "auto")),
        draft_dtype=dec.get("draft_dtype"),
        same_dtype_ar=bool(dec.get("same_dtype_ar", True)),
        compile=dec.get("compile", False),
        compile_mode=str(dec.get("compile_mode", "auto")),
        adaptive_k=bool(dec.get("adaptive_k", False)),
        lookup_min_match=dec.get("lookup_min_match", 0),
        linear_layout=str(dec.get("linear_layout", "plain")),
        tree=None if tree is None else TreeSpec(**OmegaConf.to_container(tree, resolve=True)),
        ood_prompts=dec.get("ood_prompts"),
        ood_num_prompts=dec.get("ood_num_prompts"),
        cache_dir=data.get("cache_dir"),
        chat_template=data.get("chat_template"),
    )


def tracking_settings(cfg: DictConfig) -> TrackingSettings:
    """What train/report/tracking.py logs with: cfg.logger and, for W&B, the run's resolved
    config (resolved only then: `${hydra:...}` needs a Hydra run, which a composed config
    without a logger, in tests or scripts, lacks)."""
    logger = cfg.logger
    wandb = logger.kind == "wandb"
    return TrackingSettings(
        kind=logger.kind,
        project=logger.get("project"),
        entity=logger.get("entity"),
        run_config=OmegaConf.to_container(cfg, resolve=True) if wandb else {},
    )
