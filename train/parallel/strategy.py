"""How a run spreads the draft over its processes: one process, DDP, or FSDP2.

The launch asks: `torchrun` or `accelerate launch` set WORLD_SIZE, and `accelerate launch
--config_file conf/accelerate/fsdp.yaml` adds ACCELERATE_USE_FSDP and one FSDP_* variable per
`fsdp_config` key. accelerate runs FSDP on accelerators only: under `Accelerator(cpu=True)` an
FSDP launch becomes plain multi-CPU DDP without a word. So the run shards the draft itself
with FSDP2 (`torch.distributed.fsdp.fully_shard`: gloo on a CPU, NCCL on GPUs) and keeps it
out of `accelerator.prepare`; DDP and single-process runs go through accelerate. A launch the
run cannot honour is refused before any work, naming the setting that would fix it, and
what ran is read back from the module itself (DDP-wrapped; parameters that are DTensors
sharded over more than one rank) for summary.json's `strategy`.

Under FSDP (the frozen target is never sharded: each rank runs its own copy):
- the trainable weights are broadcast from rank 0 before sharding, so every rank starts from
  the same draft whatever its RNG did;
- with train.bf16 on, a mixed-precision policy: parameters gathered in bfloat16 for the
  forward and backward, gradients reduced in float32, the sharded master weights and the
  optimizer float32 (`MixedPrecisionPolicy`; summary.json `strategy.mixed_precision`);
- gradient accumulation: the micro-batches before the last keep their gradients unsharded
  on each rank (`set_requires_gradient_sync(False)`), the last reduce-scatters their sum;
- each checkpoint gathers the draft's full state on the main rank alone, on the CPU, and
  the optimizer's keyed by parameter name (`fsdp_optimizer_state`); the main rank writes
  (draft.safetensors loads in one process);
- evaluation decodes an unsharded copy: a skeleton on the meta device (no storage between
  evaluations; weights shared with the target stay shared) whose weights are streamed in
  one parameter at a time (an all-gather each) for the evaluation and freed after it. A
  sharded module's forward all-gathers, so a rank decoding alone would wait forever;
- resume loads the full state into the sharded draft and optimizer on every rank
  (train/core/checkpoint.py: restore_trainer_state).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

FULL_ON_MAIN = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only, on CPU


@dataclass
class Strategy:
    """What the launch asked for, checked (`launch_strategy`), and under FSDP how to shard."""

    kind: str  # "single" | "ddp" | "fsdp"
    world_size: int
    reshard_after_forward: bool = True  # fsdp_reshard_after_forward
    wrap_classes: tuple[str, ...] = ()  # fsdp_transformer_layer_cls_to_wrap: sharded one by one
    wrapped: list[str] = field(default_factory=list)  # the modules sharded on their own
    unsharded: nn.Module | None = None  # fsdp: the evaluation skeleton, on the meta device
    mixed_precision: MixedPrecisionPolicy | None = None  # fsdp with train.bf16 on


def _flag(env: Mapping[str, str], key: str, default: str = "false") -> bool:
    return env.get(key, default).strip().lower() == "true"


def launch_strategy(replay: bool, optimizer: str, env: Mapping[str, str] = os.environ) -> Strategy:
    """The strategy the launch asks for, or a ValueError naming every FSDP setting this run
    cannot honour (before anything is loaded). `replay`: replay.enabled; `optimizer`:
    optim.name."""
    world = int(env.get("WORLD_SIZE", "1"))
    if not _flag(env, "ACCELERATE_USE_FSDP"):
        return Strategy("ddp" if world > 1 else "single", world)
    problems = []
    if env.get("FSDP_VERSION", "1") != "2":
        problems.append(f"fsdp_version {env.get('FSDP_VERSION', '1')}: only FSDP2 (fully_shard) "
                        "is run; set fsdp_config.fsdp_version: 2")  # fmt: skip
    if world < 2:
        problems.append(f"{world} process: FSDP over one process shards nothing; launch with "
                        "--num_processes 2 or more, or without the FSDP config")  # fmt: skip
    for key, fix in (
        ("FSDP_OFFLOAD_PARAMS", "fsdp_offload_params: false"),
        ("FSDP_ACTIVATION_CHECKPOINTING", "fsdp_activation_checkpointing: false"),
        ("FSDP_CPU_RAM_EFFICIENT_LOADING", "fsdp_cpu_ram_efficient_loading: false"),
    ):
        if _flag(env, key):
            problems.append(f"{key.lower()} is not implemented here; set {fix}")
    if env.get("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT") != "FULL_STATE_DICT":
        problems.append(f"fsdp_state_dict_type {env['FSDP_STATE_DICT_TYPE']}: checkpoints are "
                        "written once as full state; set FULL_STATE_DICT")  # fmt: skip
    policy = env.get("FSDP_AUTO_WRAP_POLICY", "NO_WRAP")
    if policy not in ("NO_WRAP", "TRANSFORMER_BASED_WRAP"):
        problems.append(f"fsdp_auto_wrap_policy {policy}: set TRANSFORMER_BASED_WRAP (the "
                        "classes of fsdp_transformer_layer_cls_to_wrap) or NO_WRAP")  # fmt: skip
    if replay:
        problems.append("replay.enabled=true: each rank decodes its own rollouts with the "
                        "draft, which a sharded draft cannot do alone; set "
                        "replay.enabled=false or launch with conf/accelerate/ddp.yaml")  # fmt: skip
    if optimizer == "muon":
        # Muon orthogonalises each weight matrix whole; under FSDP2 a rank holds row shards
        # (DTensors), which this project has not run Muon over: refused rather than guessed.
        problems.append("optim=muon: Muon over FSDP2's sharded matrices is not supported "
                        "here; use optim=adamw, or launch with conf/accelerate/ddp.yaml")  # fmt: skip
    if problems:
        raise ValueError("the launch asks for FSDP, which this run cannot honour: "
                         + "; ".join(problems))  # fmt: skip
    classes = env.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "") if policy != "NO_WRAP" else ""
    return Strategy(
        "fsdp", world, _flag(env, "FSDP_RESHARD_AFTER_FORWARD", "true"),
        tuple(c.strip() for c in classes.split(",") if c.strip()),
    )  # fmt: skip


def check_processes(strategy: Strategy, accelerator: Accelerator) -> None:
    """The processes accelerate joined must be the ones the launch started."""
    if accelerator.num_processes != strategy.world_size:
        raise ValueError(
            f"the launch started {strategy.world_size} processes but accelerate joined "
            f"{accelerator.num_processes} ({accelerator.distributed_type}): this run would not "
            "be the one launched. Launch with torchrun or accelerate launch --num_processes N."
        )


def shard(
    strategy: Strategy, draft: nn.Module, device: torch.device, bf16: bool = False,
    shared: tuple[torch.Tensor, ...] = (),
) -> nn.Module:  # fmt: skip
    """FSDP: broadcast the trainable weights from rank 0, keep an evaluation skeleton (meta
    tensors; `shared`, weights that are the target's, stay themselves), then fully_shard the
    modules of `wrap_classes` one by one and the draft as a whole, in place; with `bf16` under
    a mixed-precision policy (bf16 compute, float32 reduce and master weights). Else the draft
    as it is. The optimizer must be built after this: fully_shard replaces the parameters."""
    if strategy.kind != "fsdp":
        return draft
    for p in draft.parameters():  # equal on every rank, not equal by the seed alone
        if p.requires_grad:
            torch.distributed.broadcast(p.data, src=0)
    keep = {id(t) for t in shared}
    memo = {
        id(t): t if id(t) in keep else _meta_like(t)
        for t in (*draft.parameters(), *draft.buffers())
    }
    strategy.unsharded = copy.deepcopy(draft, memo).eval()
    if bf16:
        strategy.mixed_precision = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    kw = {"mesh": init_device_mesh(device.type, (strategy.world_size,)),
          "reshard_after_forward": strategy.reshard_after_forward}  # fmt: skip
    if strategy.mixed_precision is not None:
        kw["mp_policy"] = strategy.mixed_precision
    for name, module in draft.named_modules():
        if name and type(module).__name__ in strategy.wrap_classes:
            fully_shard(module, **kw)
            strategy.wrapped.append(name)
    fully_shard(draft, **kw)
    return draft


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """`t`'s shape and dtype on the meta device: no storage."""
    empty = torch.empty_like(t, device="meta")
    return nn.Parameter(empty, requires_grad=False) if isinstance(t, nn.Parameter) else empty


@contextmanager
def gradient_sync(draft: nn.Module, sync: bool, accelerator: Accelerator):
    """Micro-batches before the last of a step: no gradient reduction (DDP: accelerate's
    no_sync; FSDP2: unsharded gradients accumulate on each rank, the last micro-batch
    reduce-scatters their sum)."""
    if sync:
        yield
    elif isinstance(draft, FSDPModule):
        draft.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            draft.set_requires_gradient_sync(True)
    else:
        with accelerator.no_sync(draft):
            yield


def draft_sharded(draft: nn.Module) -> bool:
    """True when the draft's parameters are DTensors sharded over more than one rank."""
    return any(
        isinstance(p, DTensor)
        and p.device_mesh.size() > 1
        and any(pl.is_shard() for pl in p.placements)
        for p in draft.parameters()
    )


def strategy_ran(strategy: Strategy, accelerator: Accelerator, draft: nn.Module) -> dict:
    """What ran, read from the prepared module; refused when it is not what was launched."""
    ran = (
        "fsdp" if isinstance(draft, FSDPModule)
        else "ddp" if isinstance(draft, DistributedDataParallel) else "single"
    )  # fmt: skip
    sharded = draft_sharded(draft)
    if ran != strategy.kind or sharded != (strategy.kind == "fsdp"):
        raise RuntimeError(
            f"the launch asked for {strategy.kind} over {strategy.world_size} processes but "
            f"the draft is {ran} (sharded: {sharded}) after preparation; refusing to train "
            "under another strategy than the one launched"
        )
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    record = {"kind": ran, "world_size": accelerator.num_processes, "draft_sharded": sharded,
              "backend": backend, "device": str(accelerator.device)}  # fmt: skip
    if ran == "fsdp":
        record["fsdp_units"] = [*strategy.wrapped, "<draft>"]
        record["reshard_after_forward"] = strategy.reshard_after_forward
        policy = strategy.mixed_precision
        record["mixed_precision"] = None if policy is None else {
            "param_dtype": str(policy.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(policy.reduce_dtype).removeprefix("torch."),
            "master_weights": "float32",
        }  # fmt: skip
        record["initial_weights"] = "broadcast from rank 0"
    return record


def full_state(
    strategy: Strategy, accelerator: Accelerator, draft: nn.Module, optimizer
) -> tuple[dict, dict]:
    """(the draft's full state dict, the optimizer's state) for a checkpoint; every rank
    must call it (FSDP gathers). Under FSDP the main rank alone gets them, on the CPU (the
    other ranks get empty dicts)."""
    if strategy.kind == "fsdp":
        model = get_model_state_dict(draft, options=FULL_ON_MAIN)
        return model, get_optimizer_state_dict(draft, optimizer, options=FULL_ON_MAIN)
    return accelerator.get_state_dict(draft), optimizer.state_dict()


@contextmanager
def eval_draft(strategy: Strategy, core: nn.Module):
    """The draft evaluation decodes: the module itself, or under FSDP the skeleton with the
    sharded draft's weights streamed in, one all-gathered parameter at a time (every rank
    must enter), freed again on exit."""
    if strategy.kind != "fsdp":
        yield core
        return
    skeleton, filled = strategy.unsharded, []
    full: dict[int, torch.Tensor] = {}  # tied parameters: gathered once
    for name, p in core.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        module = skeleton.get_submodule(owner)
        if not module._parameters[leaf].is_meta:  # the target's own weight, shared
            continue
        if id(p) not in full:
            whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            # contiguous, as a checkpoint's tensors: a gathered LoRA matrix can come back
            # strided, and a matmul over other strides sums in another order (last bits)
            full[id(p)] = whole.contiguous()
        module._parameters[leaf] = nn.Parameter(full[id(p)], requires_grad=False)
        filled.append((module, leaf))
    for name, b in core.named_buffers(remove_duplicate=False):  # not sharded: shared
        owner, _, leaf = name.rpartition(".")
        skeleton.get_submodule(owner)._buffers[leaf] = b
    del full
    try:
        yield skeleton
    finally:
        for module, leaf in filled:
            module._parameters[leaf] = _meta_like(module._parameters[leaf])
