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
               its training dtype, the draft in decode.dtype, and on a CPU with
               decode.compile each compiled graph's frozen, packed target weights
  verdicts     (a CPU measuring its dtypes) the timing copy of the target in the largest
               candidate dtype other than its own, one at a time, before the copies exist
  held-out     (train.heldout_proxy) at each checkpoint, no gradients: the held-out and
               validation rows' cached taps, one batch's target logits, the draft's float32
               logits, the loss's float32 working copies of one offset's rows (three at once)
               and the acceptance statistics' float32 full-vocabulary rows, 256 positions at
               a time
  regeneration the target answering prompts (train/data/answer_batch.py): its copy in
               data.regen_dtype, the slots' K/V, a prefill's K/V and widest activations
  ranks        DDP: the reducer's buckets (a second copy of the gradients); FSDP: the
               draft's state divided by the ranks, plus the unit unsharded for a forward and
               backward, the full state gathered for a checkpoint, the evaluation skeleton
  shapes       (a CPU) what oneDNN keeps for every matmul shape it meets, for good: one
               training step's matmuls replayed at new widths where the plan is made
               (train/run/shape_state.py), times the widths a run can train at (a multiple
               of train.pad_multiple up to data.max_len, no more than its micro-batches)
  feature cache  (train.feature_cache) bytes on disk: (taps + 1) x hidden x target dtype
               bytes per token, for at most (rows x data.max_len) tokens

These add up per phase (`MemoryPlan.phase_bytes`, the phases train/phase_memory.py
measures: start-up, data, feature pass, training, checkpoint, held-out proxy, evaluation);
the peak is the largest phase. The activations are counted on the meta device
(train/run/meta_forward.py) with attention as a fused kernel saves it, at data.max_len for
every row (a batch is padded to its longest: an upper bound); sizes on meta are float32
where a run autocasts to bf16 (CUDA). The target is never sharded (every rank runs all of
it). Measured against the plan: docs/memory.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from unittest import mock

import hydra.utils
import torch
from omegaconf import DictConfig
from transformers import PretrainedConfig

from models import vocab
from models.dtype_choice import CANDIDATES
from models.dtypes import resolve_dtype
from train.run.meta_forward import MetaScalars, activation_bytes, meta_target, parameter_counts
from train.run.shape_state import bytes_per_width, cached_widths, probe_widths, widths_met

GIB = 1024**3


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
    heldout_kept_bytes: int = 0  # its rows' taps, kept after its first pass (the main rank's)
    heldout_position_bytes: int = 0  # a held-out batch's transients per position (rows x length)
    heldout_stats_bytes: int = 0  # its acceptance statistics' full-vocabulary rows, chunked
    heldout_shapes: list[tuple[int, int]] | None = None  # its batches, once known (re-planned)
    train_batch: tuple[int, int] | None = None  # the widest [rows, length] trained, once met
    no_grad_bytes: int | None = None  # a forward's draft logits and loss copies, no gradients
    regeneration_bytes: int = 0  # the data phase: the target answering the training prompts
    heldout_regeneration_bytes: int = 0  # the feature pass: answering the held-out prompts
    compiled_bytes: int = 0  # decode.compile on a CPU: the frozen graphs' packed weights
    compiled_weights: int = 0  # the target weights those graphs hold (elements, one copy)
    bucket_bytes: int = 0  # DDP: the gradient buckets, a second copy of the gradients
    gathered_bytes: int = 0  # FSDP: the unsharded unit in a forward / backward, accumulation
    checkpoint_bytes: int = 0  # FSDP: the full draft and optimizer state gathered to write
    skeleton_bytes: int = 0  # FSDP: the unsharded draft an evaluation streams in
    evaluates_early: bool = False  # an evaluation before the last step: its copies stay
    verdict_bytes: int = 0  # the dtype verdicts' timing copy of the target (models/dtype_choice.py)
    shape_bytes_per_width: int = 0  # a CPU: what one training width's matmul shapes keep
    matmuls_per_width: int = 0  # the distinct matmuls of one training step
    shape_widths: int = 0  # the widths counted: the bound, or those a run met (re-planned)

    @property
    def shape_bytes(self) -> int:
        """What the matmul shapes met keep from training on (train/run/shape_state.py)."""
        widths = cached_widths(self.shape_widths, self.matmuls_per_width)
        return self.shape_bytes_per_width * widths

    def peak_bytes(self, checkpointing: bool = False) -> int:
        """The most one rank holds: the largest of its phases (`phase_bytes`)."""
        return max(self.phase_bytes(checkpointing).values())

    def phase_bytes(self, checkpointing: bool = False) -> dict[str, int]:
        """The most one rank holds in each phase of a run (train/phase_memory.py's names): the
        process baseline and the target always; the draft from the feature pass on, its
        gradients and optimizer state from training on (gradients are freed after each
        step: a checkpoint and an evaluation hold none); what an evaluation copies stays for
        the rest of the run once it has run before the last step."""
        act = self.activation_bytes_checkpointed if checkpointing else self.activation_bytes
        bound = self.batch_size * self.max_len  # the positions `act` was counted at
        met = act if act is None or self.train_batch is None else act * math.prod(self.train_batch) // bound  # fmt: skip
        loaded = self.baseline_bytes + self.target_bytes
        # between steps; a held-out pass before the last step leaves its taps cached, the
        # steps leave oneDNN's state for their matmul shapes
        kept = loaded + self.draft_bytes + self.optimizer_bytes + self.heldout_kept_bytes
        kept += self.shape_bytes
        copies = self.evaluation_bytes if self.evaluates_early else 0
        return {
            # the preflight forward and the draft's autocast timing: one row, a draft copy
            "start-up": loaded + 2 * self.draft_bytes + self.gradient_bytes
            + (act or 0) // self.batch_size,
            "data": loaded + self.regeneration_bytes,
            "feature pass": loaded + self.draft_bytes + self.heldout_regeneration_bytes,
            "training": kept + copies + self.gradient_bytes + self.bucket_bytes
            + self.gathered_bytes + (met or 0),
            "checkpoint": kept + copies + self.checkpoint_bytes,
            "held-out proxy": kept - self.heldout_kept_bytes + copies + self.heldout_bytes,
            # the verdicts' timing copy is freed before the decoding copies are made
            "evaluation: copies and dtypes": kept + self.skeleton_bytes
            + max(self.verdict_bytes, self.evaluation_bytes - self.compiled_bytes),
            "evaluation: compile": kept + self.skeleton_bytes + self.evaluation_bytes,
            "evaluation": kept + self.skeleton_bytes + self.evaluation_bytes,
            "records": kept + self.evaluation_bytes,  # the last evaluation's copies, kept
        }  # fmt: skip

    def as_record(self) -> dict:
        return {**asdict(self), "shape_bytes": self.shape_bytes, "peak_bytes": self.peak_bytes(),
            "phases": self.phase_bytes()}  # fmt: skip


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
    mixed: bool = False,
    ar_dtypes: tuple[str, ...] = CANDIDATES,
    shape_probe: list[int] | None = None,
    draft_autocast: bool = False,
) -> MemoryPlan:
    """The memory plan of one launch (see the module docstring for each line). `decode_dtype`
    "auto": the larger draft copy (float32), and the target's copies of whichever dtype a CPU
    may measure faster (a caller on CUDA passes bfloat16, what auto gives there); `ar_dtypes`:
    the dtypes the fastest eager AR may take (on CUDA bfloat16 alone); `rows`: the training
    rows the feature cache would hold (0: no estimate); `shape_probe`: the widths at which a
    CPU plan measures what one width's matmul shapes keep (train/run/shape_state.py; None:
    not measured), the draft's in bf16 with `draft_autocast`, else in float32."""
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
            draft = hydra.utils.instantiate(
                draft_node, target=target, token_counts=counts, _convert_="all"
            )
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
    per_width = matmuls = 0
    if draft is not None and shape_probe:
        try:
            with torch.random.fork_rng(devices=[]):
                draft_dtype = torch.bfloat16 if draft_autocast else torch.float32
                per_width, matmuls = bytes_per_width(
                    draft, target, batch_size, shape_probe, dtype, draft_dtype
                )
        except Exception as err:  # a step that cannot run backward on meta tensors
            why = f"{type(err).__name__}: {err}"
            notes.append(f"the matmul shapes' state could not be measured ({why}); its line is 0")
    param_bytes = draft_bytes // max(1, trainable + frozen) if draft_bytes else 4
    gradients = trainable * param_bytes
    optimizer = trainable * (8 + (4 if param_bytes != 4 else 0))
    decode = torch.float32 if decode_dtype == "auto" else resolve_dtype(decode_dtype)
    element = decode.itemsize
    decodes = CANDIDATES if decode_dtype == "auto" else (decode_dtype,)
    evaluation = (trainable + frozen) * element
    evaluation += target_copy_bytes(target_params_frozen, dtype, decodes, ar_dtypes)
    per_token = taps * target_config.hidden_size * dtype.itemsize
    plan = MemoryPlan(
        target_name, str(dtype).removeprefix("torch."), target_params_frozen, target_bytes,
        draft_kind, trainable if draft is not None else None, frozen if draft is not None else None,
        draft_bytes, gradients, optimizer, act, act_ckpt, evaluation, per_token,
        per_token * rows * max_len, batch_size, max_len, ranks, sharded, notes,
    )  # fmt: skip
    plan.no_grad_bytes = no_grad
    plan.shape_bytes_per_width, plan.matmuls_per_width = per_width, matmuls
    if decode_dtype == "auto" or len(ar_dtypes) > 1:  # a dtype is measured: CPU, no record
        plan.verdict_bytes = timing_copy_bytes(target_params_frozen, dtype)
    return spread_over_ranks(plan, mixed)


def timing_copy_bytes(params: int, trained: torch.dtype) -> int:
    """The dtype verdicts' largest transient (models/dtype_choice.py: time_forward): the
    target copied into a candidate dtype other than its training one to time a forward, one
    candidate at a time (the 2-layer compiled proxies are a fraction of it)."""
    return max((params * resolve_dtype(c).itemsize for c in CANDIDATES
                if resolve_dtype(c) != trained), default=0)  # fmt: skip


def target_copy_bytes(
    params: int, trained: torch.dtype, decodes: tuple[str, ...], ars: tuple[str, ...]
) -> int:
    """The most the evaluation's copies of the target hold (train/eval/plan.py: copies_in):
    one in the decoding dtype and one in the fastest eager AR's, each where it is not the
    training dtype (the training target itself decodes in its own), over every dtype each
    may take."""
    return max(
        sum(params * d.itemsize for d in {resolve_dtype(dec), resolve_dtype(ar)} - {trained})
        for dec in decodes
        for ar in ars
    )


# Inductor's freezing on a CPU (decode.compile): each compiled graph holds the target's linear
# weights again, packed for the GEMM kernels, beside the frozen originals it was folded from
# (the first run's compile step against this count: docs/memory.md "Every phase of a run").
COMPILED_COPIES = 2


# sampling_cutoffs works this many positions at a time over the full vocabulary, in float32:
# its scaled logits and logsumexp's exponentials (2 rows); under top-k / top-p also a masked
# copy, the sort's values and int64 indices, a softmax and its cumulative sum (7 rows)
CUTOFF_ROWS = 256


def cutoff_bytes(vocab_size: int, dec: DictConfig) -> int:
    """The acceptance statistics' working rows at once (train/losses/acceptance.py)."""
    truncated = bool(dec.get("top_k")) or float(dec.get("top_p", 1.0) or 1.0) < 1.0
    return CUTOFF_ROWS * vocab_size * 4 * (7 if truncated else 2)


def compiles_on_cpu(dec: DictConfig, cuda: bool) -> bool:
    """Whether an evaluation compiles with frozen weights: decode.compile only / true on a
    CPU (auto compiles only where a compile record says it pays: counted as compiled)."""
    return not cuda and str(dec.get("compile", False)).lower() in ("true", "only", "auto")


def regeneration_bytes(
    config: PretrainedConfig, prompts: int, slots: int, prompt: int, new: int, element: int,
    ranks: int = 1,
) -> int:  # fmt: skip
    """What answering `prompts` prompts holds besides the target (train/data/answer_batch.py):
    the slots' preallocated K/V up to the longest prompt plus `new` tokens, a prefill's K/V of
    as many prompts at once, and the prefill's widest activations (a layer's MLP) and
    last-position logits in float32."""
    slots = max(1, min(slots, math.ceil(prompts / ranks)))
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = config.num_hidden_layers * 2 * kv_heads * head_dim * element
    cache = slots * (prompt + new) * per_token
    prefill = slots * prompt * per_token
    mlp = 3 * slots * prompt * config.intermediate_size * element
    logits = slots * config.vocab_size * 4
    return cache + prefill + mlp + logits


def spread_over_ranks(plan: MemoryPlan, mixed: bool = False) -> MemoryPlan:
    """`plan`'s per-rank lines for its `ranks` and `sharded` (in place; its draft state as
    one process holds it). DDP: the reducer's buckets, a copy of every gradient. FSDP: the
    draft's state divided by the ranks, plus one unit unsharded at a time for a forward and
    backward (the whole draft, the default unit: its parameters gathered, in bf16 with
    `mixed`, and its gradients before they are reduce-scattered), the full state a
    checkpoint gathers on the main rank (float32 weights and two AdamW states) and the
    evaluation's unsharded skeleton."""
    full, trainable = (plan.draft_trainable or 0) + (plan.draft_frozen or 0), plan.draft_trainable or 0  # fmt: skip
    plan.bucket_bytes = plan.gathered_bytes = plan.checkpoint_bytes = plan.skeleton_bytes = 0
    if plan.sharded:
        for name in ("draft_bytes", "gradient_bytes", "optimizer_bytes"):
            setattr(plan, name, math.ceil(getattr(plan, name) / plan.ranks))
        plan.gathered_bytes = full * (2 if mixed else 4) + trainable * 4
        plan.checkpoint_bytes = full * 4 + trainable * 8
        plan.skeleton_bytes = full * 4
    elif plan.ranks > 1:
        plan.bucket_bytes = plan.gradient_bytes
    return plan


def plan_for_run(
    cfg: DictConfig, target_config: PretrainedConfig, target_name: str, target_dtype: str,
    ranks: int, sharded: bool, cuda: bool, baseline: int = 0,
    shapes: tuple[int, int] | None = None,
) -> MemoryPlan:  # fmt: skip
    """`plan_memory` for a run's config (train.py's overrides) on `ranks` processes; a CPU
    run's plan adds `baseline`, the process's own bytes before the target, and the state
    its matmul shapes keep, measured here or given as `shapes` (bytes per width, matmuls
    per width: a run's record re-planned)."""
    decode = str(cfg.decode.get("dtype", "auto"))
    data = cfg.data
    rows = sum(int(data.get(k) or 0) for k in ("num_train", "num_reference", "num_raw_chunks"))
    pad = int(cfg.train.get("pad_multiple") or 1)
    measure = not cuda and shapes is None
    plan = plan_memory(
        target_config, target_name, target_dtype, cfg.draft.model, str(cfg.draft.kind),
        int(cfg.train.batch_size), int(data.max_len), ranks, sharded,
        "bfloat16" if decode == "auto" and cuda else decode, rows,
        mixed=str(cfg.train.get("bf16")) == "true",  # FSDP gathers bf16 parameters
        ar_dtypes=("bfloat16",) if cuda else CANDIDATES,
        shape_probe=probe_widths(int(data.max_len), pad) if measure else None,
        # train.bf16 auto: the larger state, bf16's (a CPU's choice is made after the plan)
        draft_autocast=str(cfg.train.get("bf16")).lower() in ("true", "auto"),
    )  # fmt: skip
    plan.baseline_bytes = 0 if cuda else baseline
    if shapes is not None and not cuda:
        plan.shape_bytes_per_width, plan.matmuls_per_width = shapes
    micro_batches = int(cfg.train.steps) * int(cfg.train.get("grad_accum") or 1)
    plan.shape_widths = widths_met(int(data.max_len), pad, micro_batches)
    replay = bool((cfg.get("replay") or {}).get("enabled"))
    tc, dec = cfg.train, cfg.decode
    if not (tc.eval_at_ckpt or replay):  # no decoding: no decoding copies, no verdicts
        plan.evaluation_bytes = plan.verdict_bytes = 0
    dtype = resolve_dtype(target_dtype)
    regen = planned_dtype(str(data.get("regen_dtype", "auto")), cuda)
    regen_copy = 0 if resolve_dtype(regen) == dtype else plan.target_params * resolve_dtype(regen).itemsize  # fmt: skip
    answering = dict(config=target_config, slots=int(data.get("regen_batch_size") or 16),
                     prompt=plan.max_len // 2, new=int(data.get("max_new_tokens") or 128),
                     element=resolve_dtype(regen).itemsize, ranks=ranks)  # fmt: skip
    hf = str(data.get("regen_backend", "hf")) == "hf"
    asked = int(data.get("num_train") or 0) + int(data.get("self_prompts") or 0)
    if data.get("regenerate", True) and hf and asked:
        plan.regeneration_bytes = regen_copy + regeneration_bytes(prompts=asked, **answering)
    if tc.get("heldout_proxy") and hf:
        num_eval = int(data.get("num_eval") or 0)
        # answered by the target as it trains (train/run/setup.py: heldout_proxy): its dtype, no copy
        own = answering | {"element": dtype.itemsize}
        plan.heldout_regeneration_bytes = regeneration_bytes(prompts=num_eval, **own)
    if compiles_on_cpu(dec, cuda) and plan.evaluation_bytes:
        widths = 3 if dec.get("adaptive_k") else 2  # 1 (the AR) and k + 1 (the verify)
        element = (
            4 if str(dec.get("dtype", "auto")) == "auto" else resolve_dtype(dec.dtype).itemsize
        )
        weights = widths * plan.target_params
        if str(cfg.draft.kind) == "selfspec":  # its rounds' graphs: layers < L, layers >= L
            weights += plan.target_params + target_config.vocab_size * target_config.hidden_size
        plan.compiled_weights = weights
        plan.compiled_bytes = COMPILED_COPIES * weights * element  # and the head again
        plan.evaluation_bytes += plan.compiled_bytes
    every, steps = tc.get("eval_every"), int(tc.steps)
    plan.evaluates_early = bool(tc.eval_at_ckpt) and int(tc.ckpt_every) < steps and (
        every is None or int(every) < steps
    )  # fmt: skip
    if cfg.train.get("heldout_proxy") and plan.no_grad_bytes is not None:
        # the eval prompts' answers and data.pack_val's validation rows, each a proxy
        val_rows = int(data.get("pack_val") or 0) if data.get("pack") else 0  # a pack's only
        rows = int(data.get("num_eval") or 0) + val_rows
        positions = plan.batch_size * plan.max_len  # a batch's bound: rows of data.max_len
        # per position: the target's logits and the draft's forward without gradients; the
        # acceptance statistics' float32 rows of the full vocabulary are worked CUTOFF_ROWS
        # positions at a time (train/losses/acceptance.py: sampling_cutoffs), whatever the batch
        logits = target_config.vocab_size * resolve_dtype(target_dtype).itemsize
        plan.heldout_position_bytes = logits + plan.no_grad_bytes // positions
        plan.heldout_stats_bytes = cutoff_bytes(target_config.vocab_size, dec)
        taps = rows * plan.max_len * plan.feature_cache_bytes_per_token
        plan.heldout_bytes = (
            taps + positions * plan.heldout_position_bytes + plan.heldout_stats_bytes
        )
        plan.heldout_kept_bytes = taps if int(tc.ckpt_every) < steps else 0
    return plan


def planned_dtype(setting: str, cuda: bool) -> str:
    """The target dtype a plan counts: target.dtype, or for "auto" what a run takes on CUDA
    (bfloat16) and on a CPU the larger candidate (float32: the measured choice may be
    either)."""
    if setting != "auto":
        return str(resolve_dtype(setting)).removeprefix("torch.")
    return "bfloat16" if cuda else "float32"
