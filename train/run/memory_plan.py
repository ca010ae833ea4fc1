"""A run's memory per rank, from its config alone: no weights read, nothing allocated.

The target and the draft are built on the meta device (shapes and dtypes, no storage) and
counted; the draft's activations are measured by running one meta forward of the training
step's shapes (the target's forward, then the draft's) and adding up the tensors autograd
saves for the backward (`torch.autograd.graph.saved_tensors_hooks`). What each line holds:

  target       every parameter of the frozen target in its training dtype
  draft        the draft's parameters (trainable and frozen) in their dtype (float32)
  gradients    one per trainable parameter, in its dtype
  optimizer    AdamW: 2 float32 states per trainable parameter, plus a float32 master copy
               when the parameters are not float32 (Muon: counted the same, an upper bound)
  activations  the saved tensors of one draft forward at train.batch_size x data.max_len,
               plus the target's output the step keeps (logits, taps), the draft's logits
               with their gradients, and the loss's float32 working copies of one offset; with gradient checkpointing of the draft's attention
               blocks: each block call keeps its input and one block's saved tensors at once
  evaluation   the copies decoding makes: the target in decode.dtype when that differs from
               its training dtype, and the draft in decode.dtype
  held-out     (train.heldout_proxy) at each checkpoint, no gradients: the held-out rows'
               cached taps, one batch's target logits, the draft's float32 logits, and the
               loss's float32 working copies of one offset's rows (three at once)
  feature cache  (train.feature_cache) bytes on disk: (taps + 1) x hidden x target dtype
               bytes per token, for at most (rows x data.max_len) tokens

The activations are an upper bound: on meta tensors attention takes PyTorch's math path and
keeps its [B, heads, T, T] probabilities, which the fused kernels of a real run (flash
attention, on CPU and CUDA) do not (with the math path forced, a real forward saves exactly
the meta count: tests/test_memory_plan.py); and sizes on meta are float32 where a run
autocasts to bf16 (CUDA). FSDP divides the draft's parameters, gradients and optimizer state
by the number of ranks; the target is never sharded (every rank runs all of it).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from unittest import mock

import hydra.utils
import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from models import vocab
from models.dtypes import resolve_dtype
from models.target import Target

GIB = 1024**3


class MetaScalars(TorchDispatchMode):
    """Meta tensors hold no values, so `.item()` (a Python `if` on a tensor, a count) and a
    copy to another device fail on them. Under this mode an item reads 1 (False for a bool:
    the input checks then pass) and a copy off the meta device is zeros of its shape: the
    branch a run with real values takes is not known, but shapes, all a plan needs, rarely
    depend on it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return {torch.bool: False}.get(args[0].dtype, 1)
        device = kwargs.get("device")
        off_meta = device is not None and torch.device(device).type != "meta"
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and off_meta:
            dtype = kwargs.get("dtype") or args[0].dtype
            return torch.zeros(args[0].shape, dtype=dtype, device=device)
        return func(*args, **kwargs)


FSDP_LAUNCH = "accelerate launch --config_file conf/accelerate/fsdp.yaml --num_processes"


@dataclass
class MemoryPlan:
    """Bytes per rank (and the feature cache's bytes on disk) for one launch."""

    target_name: str
    target_dtype: str
    target_params: int
    target_bytes: int
    draft_kind: str
    draft_trainable: int | None  # None: the draft could not be built on the meta device
    draft_frozen: int | None
    draft_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int | None  # None: the meta forward failed (see notes)
    activation_bytes_checkpointed: int | None
    evaluation_bytes: int
    feature_cache_bytes_per_token: int
    feature_cache_bytes: int
    batch_size: int
    max_len: int
    ranks: int
    sharded: bool  # FSDP: the draft's state divided by `ranks`
    notes: list[str] = field(default_factory=list)
    baseline_bytes: int = 0  # a CPU run: the process before the target (interpreter, libraries)
    heldout_bytes: int = 0  # train.heldout_proxy: its checkpoint-time pass (0: off)
    no_grad_bytes: int | None = None  # a forward's draft logits and loss copies, no gradients

    def peak_bytes(self, checkpointing: bool = False) -> int:
        """The most one rank holds: its baseline, the target and the draft's state always,
        then the larger of a training step's activations and an evaluation's copies."""
        act = self.activation_bytes_checkpointed if checkpointing else self.activation_bytes
        state = self.draft_bytes + self.gradient_bytes + self.optimizer_bytes
        fixed = self.baseline_bytes + self.target_bytes + state
        return fixed + max(act or 0, self.evaluation_bytes, self.heldout_bytes)

    def phase_bytes(self) -> dict[str, int]:
        """The most one rank holds in each phase of a run (train/run/phase_memory.py's names)."""
        state = self.draft_bytes + self.gradient_bytes + self.optimizer_bytes
        loaded = self.baseline_bytes + self.target_bytes
        return {
            "start-up": loaded + state,
            "data": loaded,
            "feature pass": loaded + self.draft_bytes,
            "training": loaded + state + (self.activation_bytes or 0),
            "held-out proxy": loaded + state + self.heldout_bytes,
            "evaluation": loaded + state + self.evaluation_bytes,
        }

    def as_record(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes(), "phases": self.phase_bytes()}


def meta_target(config: PretrainedConfig, dtype: torch.dtype, name: str) -> Target:
    """The target of `config` on the meta device in `dtype`: its shapes, no storage."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Target(model, None, name=name, check_head=False)


def parameter_counts(module: torch.nn.Module) -> tuple[int, int, int]:
    """(trainable, frozen, bytes) over the module's parameters, shared ones counted once."""
    trainable = frozen = nbytes = 0
    for p in module.parameters():
        trainable += p.numel() if p.requires_grad else 0
        frozen += 0 if p.requires_grad else p.numel()
        nbytes += p.numel() * p.element_size()
    return trainable, frozen, nbytes


def fused_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`F.scaled_dot_product_attention` as a fused kernel runs it (flash attention, on CPU and
    CUDA): it saves q, k, v, the output and a logsumexp per row for the backward, not the
    [B, heads, T, T] probabilities of PyTorch's math path, the one meta tensors would take.
    Counted through the CPU flash kernel's own meta function, on meta tensors only: it
    takes grouped k, v as they are (`enable_gqa`: saved once, as the kernel does)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # additive, as the kernel takes
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def activation_bytes(
    draft: torch.nn.Module, target: Target, batch_size: int, max_len: int, fused: bool = True
) -> tuple[int, int, int]:
    """(without, with gradient checkpointing, without gradients) bytes of one training forward at
    [batch_size, max_len], measured on meta tensors: the tensors autograd saves during the
    draft's forward, plus the target's output the step keeps and the draft's logits with
    their gradients (the same count on real modules: how the tests check the meta run).
    `fused`: attention counted as a fused kernel saves (`fused_attention`); False: as the
    modules call it (on real tensors, the kernel SDPA picks).
    Checkpointed: the saved tensors outside attention blocks, each block
    call's input, and the largest block call's saved tensors (recomputed one at a time)."""
    ids = torch.zeros(batch_size, max_len, dtype=torch.long, device=target.device)
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0  # a padded batch, as training's are: attention then takes a mask
    saved = {"bytes": 0}
    calls: list[tuple[int, int]] = []  # per block call: (saved bytes, input bytes)
    starts: list[int] = []

    # Each storage once (q, k and v save the same input; a view saves its base) and no
    # parameter: a weight saved for the input's gradient is counted under parameters.
    params = [*draft.parameters(), *target.model.parameters()]
    seen = {p.untyped_storage()._cdata: p for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen[storage._cdata] = storage  # held: an id is never reused while counting
            saved["bytes"] += storage.nbytes()
        return t

    def before(module, args, kwargs) -> None:
        starts.append(saved["bytes"])

    def after(module, args, kwargs, out) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        size = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
        calls.append((saved["bytes"] - starts.pop(), size))

    blocks = [m for m in draft.modules() if hasattr(m, "self_attn")]
    hooks = [m.register_forward_pre_hook(before, with_kwargs=True) for m in blocks]
    hooks += [m.register_forward_hook(after, with_kwargs=True) for m in blocks]
    try:
        with MetaScalars():
            t_out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
        sdpa = fused_attention if fused else F.scaled_dot_product_attention
        attention = mock.patch.object(F, "scaled_dot_product_attention", sdpa)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), MetaScalars(), attention:
            out = draft(target, ids, t_out, mask, mask)
    finally:
        for hook in hooks:
            hook.remove()
    kept = sum(t.numel() * t.element_size() for t in [t_out.logits, *t_out.hidden.values()])
    logits = 2 * sum(x.numel() * 4 for x in out.logits)  # float32 logits and their gradients
    in_blocks = sum(s for s, _ in calls)
    checkpointed = saved["bytes"] - in_blocks + sum(i for _, i in calls)
    checkpointed += max((s for s, _ in calls), default=0)
    # the loss's float32 working copies of one offset's rows (the draft's, the target's at its
    # ids, a log-softmax: three at once), beside what the step keeps; without gradients the
    # draft's float32 logits once
    working = 3 * max((x.numel() * 4 for x in out.logits), default=0)
    no_grad = logits // 2 + working
    return saved["bytes"] + kept + logits + working, checkpointed + kept + logits + working, no_grad


def plan_memory(
    target_config: PretrainedConfig,
    target_name: str,
    target_dtype: str,
    draft_node: DictConfig,
    draft_kind: str,
    batch_size: int,
    max_len: int,
    ranks: int = 1,
    sharded: bool = False,
    decode_dtype: str = "auto",
    rows: int = 0,
) -> MemoryPlan:
    """The memory plan of one launch (see the module docstring for each line). `decode_dtype`
    "auto": the larger copy (float32), as a CPU may measure either (a caller on CUDA passes
    bfloat16, what auto gives there); `rows`: the training rows the feature cache would
    hold (0: no estimate)."""
    if batch_size < 1 or max_len < 1 or ranks < 1:
        raise ValueError(
            f"batch_size, max_len and ranks must be >= 1, got {batch_size}, {max_len}, {ranks}"
        )
    dtype = resolve_dtype(target_dtype)
    target = meta_target(target_config, dtype, target_name)
    _, target_params_frozen, target_bytes = parameter_counts(target.model)
    notes: list[str] = []
    draft = None
    try:
        # Made-up label counts: a reduced draft vocabulary needs some (its size is a setting)
        counts = torch.arange(target.vocab_size, 0, -1, dtype=torch.float32)
        # A meta mapping of draft to target ids holds no values to check: it counts as built
        skip_check = mock.patch.object(vocab, "check", lambda m: setattr(m, "vocab_ready", True))
        # fork_rng: a draft that seeds itself leaves the run's RNG as it was
        with torch.random.fork_rng(devices=[]), torch.device("meta"), MetaScalars(), skip_check:
            draft = hydra.utils.instantiate(draft_node, target=target, token_counts=counts)
    except Exception as err:  # a draft loaded from files (init_from) cannot be built on meta
        why = f"{type(err).__name__}: {err}"
        notes.append(f"the draft was not built on the meta device ({why}); its lines are 0")
    trainable = frozen = draft_bytes = 0
    act = act_ckpt = no_grad = None
    taps = 1
    if draft is not None:
        trainable, frozen, draft_bytes = parameter_counts(draft)
        taps = len({la for la in draft.hidden_layers if la != -1}) + 1
        try:
            with torch.random.fork_rng(devices=[]):  # DFlash samples its anchors
                act, act_ckpt, no_grad = activation_bytes(
                    draft.train(), target, batch_size, max_len
                )
        except Exception as err:  # a data-dependent step (e.g. sampled anchors) on meta
            why = f"{type(err).__name__}: {err}"
            notes.append(f"the activations could not be measured on the meta device ({why})")
    param_bytes = draft_bytes // max(1, trainable + frozen) if draft_bytes else 4
    gradients = trainable * param_bytes
    optimizer = trainable * (8 + (4 if param_bytes != 4 else 0))
    if sharded:
        state = (draft_bytes, gradients, optimizer)
        draft_bytes, gradients, optimizer = (math.ceil(b / ranks) for b in state)
    decode = torch.float32 if decode_dtype == "auto" else resolve_dtype(decode_dtype)
    element = decode.itemsize
    evaluation = (trainable + frozen) * element
    if decode != dtype:
        evaluation += target_params_frozen * element
    per_token = taps * target_config.hidden_size * dtype.itemsize
    plan = MemoryPlan(
        target_name, str(dtype).removeprefix("torch."), target_params_frozen, target_bytes,
        draft_kind, trainable if draft is not None else None, frozen if draft is not None else None,
        draft_bytes, gradients, optimizer, act, act_ckpt, evaluation, per_token,
        per_token * rows * max_len, batch_size, max_len, ranks, sharded, notes,
    )  # fmt: skip
    plan.no_grad_bytes = no_grad
    return plan


def process_memory(key: str = "VmRSS") -> int | None:
    """This process's resident memory in bytes (`VmRSS`; `VmHWM`: its peak so far), from
    /proc/self/status; None where there is none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def plan_for_run(
    cfg: DictConfig, target_config: PretrainedConfig, target_name: str, target_dtype: str,
    ranks: int, sharded: bool, cuda: bool, baseline: int = 0,
) -> MemoryPlan:  # fmt: skip
    """`plan_memory` for a run's config (train.py's overrides) on `ranks` processes; a CPU
    run's plan adds `baseline`, the process's own bytes before the target."""
    decode = str(cfg.decode.get("dtype", "auto"))
    data = cfg.data
    rows = sum(int(data.get(k) or 0) for k in ("num_train", "num_reference", "num_raw_chunks"))
    plan = plan_memory(
        target_config, target_name, target_dtype, cfg.draft.model, str(cfg.draft.kind),
        int(cfg.train.batch_size), int(data.max_len), ranks, sharded,
        "bfloat16" if decode == "auto" and cuda else decode, rows,
    )  # fmt: skip
    plan.baseline_bytes = 0 if cuda else baseline
    replay = bool((cfg.get("replay") or {}).get("enabled"))
    if not (cfg.train.eval_at_ckpt or replay):  # no decoding, no decoding copies
        plan.evaluation_bytes = 0
    if cfg.train.get("heldout_proxy") and plan.no_grad_bytes is not None:
        rows, dtype = int(data.get("num_eval") or 0), resolve_dtype(target_dtype).itemsize
        logits = plan.batch_size * plan.max_len * target_config.vocab_size * dtype
        taps = rows * plan.max_len * plan.feature_cache_bytes_per_token
        plan.heldout_bytes = taps + logits + plan.no_grad_bytes
    return plan


def planned_dtype(setting: str, cuda: bool) -> str:
    """The target dtype a plan counts: target.dtype, or for "auto" what a run takes on CUDA
    (bfloat16) and on a CPU the larger candidate (float32: the measured choice may be
    either)."""
    if setting != "auto":
        return str(resolve_dtype(setting)).removeprefix("torch.")
    return "bfloat16" if cuda else "float32"


def device_memory(device: torch.device, processes_here: int = 1) -> tuple[int, str] | None:
    """(bytes one rank may use, what they are), or None when unknown: a CUDA device's total
    memory, or on a CPU the host's RAM shared by the processes on it."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index} total memory"
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
        share = f" / {processes_here} processes" if processes_here > 1 else ""
        return ram // max(1, processes_here), f"host RAM{share}"
    return None


def gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def fitting_settings(plan: MemoryPlan, available: int) -> list[str]:
    """The settings that would make `plan` fit in `available` bytes per rank."""
    fixes = []
    if not plan.sharded:
        # the launch's own ranks when it has several, else the fewest GPUs that would do
        for n in [plan.ranks] if plan.ranks > 1 else (2, 4, 8, 16, 32, 64):
            sharded = MemoryPlan(**{**asdict(plan), "ranks": n, "sharded": True})
            for name in ("draft_bytes", "gradient_bytes", "optimizer_bytes"):
                setattr(sharded, name, math.ceil(getattr(plan, name) / n))
            if sharded.peak_bytes() <= available:
                per_rank = gib(sharded.peak_bytes())
                fixes.append(f"FSDP over {n} ranks ({FSDP_LAUNCH} {n}): {per_rank} per rank")
                break
    if plan.activation_bytes:
        fixed = plan.peak_bytes() - max(
            plan.activation_bytes, plan.evaluation_bytes, plan.heldout_bytes
        )
        per_row = plan.activation_bytes / plan.batch_size
        rows = int((available - fixed) // per_row) if available > fixed else 0
        if 1 <= rows < plan.batch_size and plan.evaluation_bytes + fixed <= available:
            fixes.append(f"train.batch_size={rows} (train.grad_accum keeps the global batch)")
        if plan.peak_bytes(checkpointing=True) <= available:
            fixes.append(
                f"gradient checkpointing of the draft's blocks: {gib(plan.peak_bytes(True))} "
                "per rank (not a setting of this project yet)"
            )
    return fixes


def check_fits(plan: MemoryPlan, available: int, what: str) -> None:
    """Refuse (ValueError) a launch whose plan exceeds `available` bytes per rank, with its
    numbers and the settings that would make it fit."""
    if plan.peak_bytes() <= available:
        return
    fixes = fitting_settings(plan, available)
    advice = ("Settings that fit: " + "; ".join(fixes)) if fixes else (
        "No setting tried fits (FSDP, a smaller batch, checkpointing): the target alone "
        f"needs {gib(plan.target_bytes)}; use a device with more memory or a smaller dtype."
    )  # fmt: skip
    raise ValueError(
        f"memory plan: this launch needs {gib(plan.peak_bytes())} per rank but {what} is "
        f"{gib(available)}.\n{format_plan(plan)}\n{advice}\n"
        "(python scripts/plan.py <the same overrides> prints this plan.)"
    )


def format_plan(plan: MemoryPlan) -> str:
    """The plan as lines of text, one per item."""
    shard = f", draft state sharded over {plan.ranks} ranks (FSDP)" if plan.sharded else ""
    count = f"{plan.draft_trainable or 0:,} trainable + {plan.draft_frozen or 0:,} frozen"
    count = "?" if plan.draft_trainable is None else count
    baseline = (
        "  process baseline  {:>12}  (this process before the target: interpreter, libraries)"
    )
    lines = [
        f"per rank, {plan.ranks} rank(s){shard}; batch {plan.batch_size} x {plan.max_len} tokens",
        f"  target weights    {gib(plan.target_bytes):>12}  ({plan.target_params:,} params, {plan.target_dtype}, {plan.target_name})",  # fmt: skip
        f"  draft parameters  {gib(plan.draft_bytes):>12}  ({plan.draft_kind}: {count})",
        f"  gradients         {gib(plan.gradient_bytes):>12}",
        f"  optimizer state   {gib(plan.optimizer_bytes):>12}  (AdamW: 2 float32 states per trainable param)",  # fmt: skip
        f"  activations       {gib(plan.activation_bytes):>12}  (tensors a meta forward saves, attention as a fused kernel)",  # fmt: skip
        f"  activations ckpt  {gib(plan.activation_bytes_checkpointed):>12}  (with gradient checkpointing of the draft's blocks)",  # fmt: skip
        f"  evaluation copies {gib(plan.evaluation_bytes):>12}  (decode.dtype copies of target and draft; 0: no decoding)",  # fmt: skip
        f"  held-out proxy    {gib(plan.heldout_bytes):>12}  (train.heldout_proxy: cached taps, a batch's logits, a forward)",  # fmt: skip
        f"  peak              {gib(plan.peak_bytes()):>12}  (with checkpointing: {gib(plan.peak_bytes(True))})",  # fmt: skip
        f"  feature cache     {plan.feature_cache_bytes_per_token:,} bytes/token on disk; {gib(plan.feature_cache_bytes)} for the rows x max_len",  # fmt: skip
    ]
    if plan.baseline_bytes:
        lines.insert(1, baseline.format(gib(plan.baseline_bytes)))
    return "\n".join(lines + [f"  note: {n}" for n in plan.notes])
