"""One optimizer step: target forward, draft forward, offset losses, statistics, backward,
clipping. `train_step` is the whole per-step body of the training loop (train/loop.py), and
`offset_losses` its loss.

Loss normalisation: each offset's loss is summed over trained positions and divided by the
GLOBAL count of trained positions (all ranks, all micro-batches of the step), times
world_size because DDP averages gradients. So the gradient is the token-mean over the global
batch whatever the split across ranks and micro-batches.

`offset_losses` sums the configured loss (`LossSpec`, train/losses/divergences.py) over every draft
offset (Medusa heads, MTP depths, EAGLE unroll steps; a draft LM has one offset 0), weighted
offset_decay**i or by the draft's own weights, and adds per-offset sums to a `StepStats`.
`aux_loss` adds what a draft trains besides its offsets: its own weighted
`DraftOutput.aux_loss` (EAGLE-1 feature regression) and, for a draft that adapts the target
(Medusa-2), weight * KL(p_target || p_adapted), both summed over positions and divided by
the global batch's real tokens (a mean over the batch whatever its split, as the offsets').

The acceptance statistics are the decoder's (train/losses/acceptance.py): top-1 agreement with the
target's full-vocabulary argmax (greedy), and alpha = Σ min(p, q) over the draft's ids with
the target's un-renormalised full-vocabulary p, at the loss temperature and at every T > 0
decode sampling (decode.temperatures) with its top-k / top-p, which train/eval/evaluate.py
compares with the decoder's tau. The loss itself keeps the target renormalised over a reduced draft
vocabulary, except for losses that declare `full_vocab_alpha` (the TV family), which get the
full-vocabulary logsumexp (`target_log_norm`).

Reduced draft vocabulary: a position whose target argmax lies outside it can never be a
greedy hit; `StepStats.oov` counts them (offset 0's positions), and
`train.mask_out_of_vocab=true` drops them from the loss (SpecForge's position mask). The
loss is still divided by the count of all trained positions, so masked positions weigh 0.

The target runs under no_grad rather than inference_mode: inference tensors cannot be saved
for backward, and the loss saves softmax(target logits).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from functools import partial

import torch
from accelerate import Accelerator
from torch import Tensor

from decoding.drafter import Sampling
from models.protocol import DraftModel, DraftOutput
from models.target import Target, TargetOutput
from train.core.feature_cache import FeatureCache, cached_target_output
from train.core.replay import Replay
from train.losses.acceptance import acceptance_proxy, sampling_cutoffs, top1_agreement
from train.losses.divergences import LossSpec, forward_kl
from train.parallel.strategy import gradient_sync


class TrainingDiverged(RuntimeError):
    pass


@dataclass(frozen=True)
class StepSetup:
    """What every step of a run computes with, resolved once from the config by the set-up
    (train/run/setup.py: step_setup)."""

    loss: LossSpec
    offsets: list[int]  # the draft's offsets (DraftOutput.offsets)
    # The samplings alpha is measured at: the loss temperature first, then every T > 0
    # decode sampling (StepStats.alpha rows, in this order).
    samplings: list[Sampling]
    offset_decay: float = 0.8  # train.offset_decay: weight gamma^i of offset i
    mask_out_of_vocab: bool = False  # train.mask_out_of_vocab
    max_grad_norm: float | None = None  # train.max_grad_norm; 0 / None = no clipping
    # bf16 autocast of the draft's forward and loss, applied here: train.bf16=auto on a CPU
    # where it measured faster (train/run/machine.py). train.bf16=true is accelerate's autocast.
    autocast: bool = False
    feature_noise: float = 0.0  # train.feature_noise: `noisy_features`' scale, 0 = off


@dataclass
class StepStats:
    """Sums over one step's trained positions (this rank's until `reduce`)."""

    loss: Tensor  # [n_off] loss sum per offset
    alpha: Tensor  # [n_samplings, n_off] alpha sums, one row per StepSetup.samplings entry
    top1: Tensor  # [n_off] greedy hits against the target's full-vocabulary argmax
    aux: Tensor  # [] the auxiliary loss (EAGLE-1 features, Medusa-2 LM) over the global batch
    oov: Tensor  # [] trained positions at offset 0 whose target argmax is outside the draft vocab
    tokens: Tensor  # [] real tokens the draft read

    @classmethod
    def zeros(cls, n_off: int, n_samplings: int, device: torch.device | str = "cpu") -> StepStats:
        z = lambda *shape: torch.zeros(*shape, device=device)  # noqa: E731
        return cls(z(n_off), z(n_samplings, n_off), z(n_off), z(()), z(()), z(()))

    def flat(self) -> Tensor:
        """Every field in one 1-D tensor, in field order."""
        return torch.cat([getattr(self, f.name).reshape(-1) for f in fields(self)])

    def reduce(self, accelerator: Accelerator) -> StepStats:
        """Summed over ranks in one collective (each rank's `aux` is its share of the global
        batch's, so the sum is the global one)."""
        flat = accelerator.reduce(self.flat(), reduction="sum")
        out, start = {}, 0
        for f in fields(self):
            p = getattr(self, f.name)
            out[f.name] = flat[start : start + p.numel()].view(p.shape)
            start += p.numel()
        return StepStats(**out)


def offset_weights(
    out: DraftOutput, offset_decay: float, loss: LossSpec | None = None
) -> list[float]:
    """The loss weight of each offset: the draft's own (`DraftOutput.offset_weights`, DFlash's
    exp(-(i-1)/gamma)) or offset_decay ** i; 1 for a loss that weighs positions by their
    chain of drafts itself (`Loss.chain_weights`, D-PACE)."""
    if loss is not None and loss.loss.chain_weights is not None:
        return [1.0] * len(out.offsets)
    if out.offset_weights is not None:
        return list(out.offset_weights)
    return [offset_decay**i for i in range(len(out.offsets))]


def _rows_at(x: Tensor, off: int, index: Tensor | None) -> Tensor:
    """x [B, T, ...] where an offset's logits pair with it: x[:, off:] [B, T-off, ...] for
    logits at every position, else x at `index` [B, N] (the draft's positions + off, inside
    the sequence) [B, N, ...]."""
    if index is None:
        return x[:, off:]
    # Whole rows by flat index: one row copy per pair, where a gather over an expanded
    # [B, N, V] index computes an address per element.
    B, T = x.shape[:2]
    flat = (index + T * torch.arange(B, device=index.device)[:, None]).reshape(-1)  # [B*N]
    return x.reshape(B * T, *x.shape[2:]).index_select(0, flat).view(*index.shape, *x.shape[2:])


def offset_losses(
    out: DraftOutput,
    target_logits: Tensor,  # [B, T, V]
    batch: dict[str, Tensor],  # input_ids, attention_mask, loss_mask [B, T]
    counts: Tensor,  # [n_off] global trained positions per offset
    setup: StepSetup,
    stats: StepStats,
) -> Tensor:
    """Sum over offsets of w_i * loss_i (w_i = `offset_weights`), each normalised by the
    global count; adds the per-offset sums to `stats`. A draft trained at sampled positions
    (`out.positions`, DFlash anchors) is paired with the target there, and its sums are
    scaled up to the micro-batch's trained positions (a ratio estimate: the anchors are drawn
    uniformly among the answer positions), so every normalisation and logged mean stays a
    per-position mean."""
    total, T, loss = 0.0, batch["input_ids"].shape[1], setup.loss
    # Target-side numbers shared by every offset, from the full vocabulary, computed once:
    # its argmax and, per sampling, two numbers per position that give its p (no [B, T, V] copy).
    V = target_logits.shape[-1]
    flat = target_logits.reshape(-1, V)  # [B*T, V] a view
    top = target_logits.argmax(-1)  # [B, T]
    # The loss temperature is usually one of the decode's (T = 1): one pass over V per sampling.
    unique = {s: sampling_cutoffs(flat, s).view(*top.shape, 2) for s in dict.fromkeys(setup.samplings)}  # fmt: skip
    cutoffs = [unique[s] for s in setup.samplings]  # [B, T, 2] each
    in_vocab = None  # [V] bool: target ids inside a reduced draft vocabulary
    if setup.mask_out_of_vocab and out.vocab_ids is None:
        raise ValueError(
            "train.mask_out_of_vocab=true needs a reduced draft vocabulary (EAGLE-3's "
            "draft.model.vocab_size); this draft predicts the full vocabulary: set it to false"
        )
    if loss.labels_from_data and out.vocab_ids is not None:
        raise ValueError("loss.labels=data needs a full-vocabulary draft; use labels=target")
    at_draft_ids = target_logits  # [B, T, Vd] the target at the draft's ids
    if out.vocab_ids is not None:
        in_vocab = torch.zeros(V, dtype=torch.bool, device=top.device)
        in_vocab[out.vocab_ids.to(top.device)] = True
        # Once for every offset: a column gather over [B, T, V] per offset cost 6% of an
        # EAGLE-3 step on the embedded target (5 offsets, V = 49152 -> 8192).
        at_draft_ids = target_logits.index_select(-1, out.vocab_ids.to(target_logits.device))
    weights = offset_weights(out, setup.offset_decay, loss)
    chain = None  # [N] per offset: D-PACE's weights, from every offset of each chain at once
    if loss.loss.chain_weights is not None:
        chain = loss.loss.chain_weights(
            out.logits, out.offsets, out.positions, at_draft_ids, batch["loss_mask"],
            loss.temperature, **loss.options,
        )  # fmt: skip
    for i, (logits, off) in enumerate(zip(out.logits, setup.offsets, strict=True)):
        if off != out.offsets[i]:
            raise ValueError(
                f"the draft changed its offsets between calls ({setup.offsets} -> {out.offsets})"
            )
        index, scale = None, 1.0  # logits at sampled positions: their targets at index [B, N]
        if out.positions is not None:
            index = (out.positions + off).clamp(0, T - 1)
        d = (logits if index is not None else logits[:, : T - off]).float()  # [B, T-off|N, Vd]
        t = _rows_at(at_draft_ids, off, index)  # [B, T-off|N, Vd]
        d, t = d.reshape(-1, d.shape[-1]), t.reshape(-1, t.shape[-1])  # [N, Vd]
        mask = _rows_at(batch["loss_mask"], off, index)  # [B, T-off|N]
        if index is not None:
            mask = mask * ((out.positions >= 0) & (out.positions + off < T))
            scale = batch["loss_mask"][:, off:].sum() / mask.sum().clamp_min(1)
        mask = mask.reshape(-1)  # [N]
        top_i = _rows_at(top, off, index).reshape(-1)  # [N] the target's full-vocabulary argmax
        loss_mask = mask
        if in_vocab is not None:
            oov = ~in_vocab[top_i]  # [N] greedy misses whatever the draft does
            if i == 0:
                stats.oov += (oov & mask.bool()).sum() * scale
            if setup.mask_out_of_vocab:
                loss_mask = mask * ~oov
        labels = None
        if loss.labels_from_data:
            ids = batch["input_ids"]
            pad = ids.new_zeros(ids.shape[0], 1)
            labels = _rows_at(torch.cat([ids[:, 1:], pad], 1), off, index).reshape(
                -1
            )  # x_{t+off+1}
        log_norm = None  # [N] the full-vocabulary logsumexp, for the losses that declare it
        if loss.loss.full_vocab_alpha:
            log_norm = _rows_at(cutoffs[0], off, index)[..., 1].reshape(-1)
        position_weights = None if chain is None else chain[i]
        loss_sum = loss.sum(d, t, loss_mask, labels, log_norm, position_weights)
        if out.base_logits is not None and out.base_loss_weight > 0:  # Domino's curriculum
            base = out.base_logits[i] if index is not None else out.base_logits[i][:, : T - off]
            base_sum = loss.sum(
                base.float().reshape(d.shape), t, loss_mask, labels, log_norm, position_weights
            )
            loss_sum = (1 - out.base_loss_weight) * loss_sum + out.base_loss_weight * base_sum
        loss_sum = loss_sum * scale
        total = total + weights[i] * loss_sum / counts[i]
        stats.loss[i] += loss_sum.detach()
        # The decoder's view on every trained position, masked from the loss or not.
        stats.top1[i] += top1_agreement(d, top_i, mask, out.vocab_ids, reduction="sum") * scale
        alpha_sums = {}  # sampling -> this offset's alpha sum, computed once per sampling
        for j, (sampling, cut) in enumerate(zip(setup.samplings, cutoffs, strict=True)):
            if sampling not in alpha_sums:
                cut_i = _rows_at(cut, off, index).reshape(-1, 2)  # [N, 2]
                alpha_sums[sampling] = scale * acceptance_proxy(
                    d, t, mask, sampling, cut_i, reduction="sum"
                )
            stats.alpha[j, i] += alpha_sums[sampling]
    return total


def adapted_lm_kl(out: DraftOutput, target_logits: Tensor, attention_mask: Tensor | None) -> Tensor:
    """KL(p_target || p_adapted) summed over the real tokens: how far a draft's adapted target
    (Medusa-2's LoRA, `out.adapted_logits` [B, T, V]) has moved from the frozen one
    (`target_logits` [B, T, V])."""
    own = out.adapted_logits  # [B, T, V]
    if attention_mask is None:
        attention_mask = torch.ones(own.shape[:2], dtype=torch.long, device=own.device)
    vocab = own.shape[-1]
    return forward_kl(
        own.reshape(-1, vocab), target_logits.reshape(-1, vocab), attention_mask.reshape(-1),
        reduction="sum",
    )  # fmt: skip


def aux_loss(
    out: DraftOutput, target_logits: Tensor, attention_mask: Tensor | None
) -> Tensor | None:
    """The draft's loss besides its offsets, weighted and summed over this micro-batch's
    positions: its own `aux_loss` (EAGLE-1 feature regression) plus, when it adapts the
    target (Medusa-2), adapted_loss_weight * KL(p_target || p_adapted), which keeps the
    adapted model's outputs where they were. The step divides it by the global batch's real
    tokens. None when the draft has neither."""
    total = out.aux_loss
    if out.adapted_logits is not None:
        lm = out.adapted_loss_weight * adapted_lm_kl(out, target_logits, attention_mask)
        total = lm if total is None else total + lm
    return total


@dataclass
class StepResult:
    stats: StepStats  # reduced over ranks
    counts: Tensor  # [n_off] global trained positions per offset
    loss: float  # the step's loss: weighted per-offset means + auxiliary loss
    grad_norm: float  # before clipping
    target_s: float  # seconds in the target's forward (or the feature cache)


def train_step(
    step: int,
    draft: torch.nn.Module,  # as prepared: DDP-wrapped, FSDP2-sharded (train/parallel/strategy.py), bare
    core: DraftModel,  # the unwrapped draft
    target: Target,
    micro: list[dict[str, Tensor]],  # grad_accum micro-batches on the device
    rows: list[list[int]],  # their row indices (the feature cache reads by row)
    setup: StepSetup,
    accelerator: Accelerator,
    params: list[torch.nn.Parameter],  # the prepared module's trainable parameters
    features: FeatureCache | None = None,
    replay: Replay | None = None,
) -> StepResult:
    """Forward and backward of one optimizer step over `micro`, gradients clipped; the
    optimizer is stepped by the caller once the result is known to be finite."""
    world, n_off = accelerator.num_processes, len(setup.offsets)
    # Global count of trained positions per offset (all micro-batches, all ranks).
    counts = torch.tensor(
        [[float(b["loss_mask"][:, off:].sum()) for off in setup.offsets] for b in micro],
        device=accelerator.device,
    ).sum(0)  # [n_off]
    counts = accelerator.reduce(counts, reduction="sum").clamp_min(1.0)
    # Global real tokens: the auxiliary losses are means over them, whatever the split.
    real = torch.stack([b["attention_mask"].sum() for b in micro]).sum().float()
    real = accelerator.reduce(real.to(accelerator.device), reduction="sum").clamp_min(1.0)
    stats = StepStats.zeros(n_off, len(setup.samplings), accelerator.device)
    target_s = 0.0
    replay_share = 0.0  # replay's share of the loss; the offline part gets 1 - share
    autocast = partial(
        torch.autocast, accelerator.device.type, torch.bfloat16, enabled=setup.autocast
    )
    if replay is not None:  # own rollouts + backward, before the syncing micro-batch
        replay.maybe_rollout(step, target, core)
        with gradient_sync(draft, False, accelerator):
            offline = float(counts[0]) / world  # this rank's share, for the log
            replay_share = replay.backward(
                step, draft, core, target, accelerator, offline, autocast
            )
    for a, b in enumerate(micro):
        t0 = time.perf_counter()
        t_out = noisy_features(
            target_output(target, core, b, rows[a], features), setup.feature_noise
        )
        if t_out.logits.is_cuda:
            torch.cuda.synchronize()
        target_s += time.perf_counter() - t0
        sync = a == len(micro) - 1
        with gradient_sync(draft, sync, accelerator):
            with autocast():
                out = draft(target, b["input_ids"], t_out, b["attention_mask"], b["loss_mask"])
                loss = offset_losses(out, t_out.logits, b, counts, setup, stats)
                aux = aux_loss(out, t_out.logits, b["attention_mask"])
            loss = loss * world * (1.0 - replay_share)
            if aux is not None:  # its share of the global mean, x world as the offsets'
                aux = aux / real
                loss = loss + aux * world
                stats.aux += aux.detach().float()
            stats.tokens += b["attention_mask"].sum()
            accelerator.backward(loss)
    stats = stats.reduce(accelerator)
    grad_norm = accelerator.clip_grad_norm_(params, setup.max_grad_norm or float("inf"))
    weights = offset_weights(out, setup.offset_decay, setup.loss)
    loss_value = float(sum(weights[i] * stats.loss[i] / counts[i] for i in range(n_off)))
    loss_value += float(stats.aux)
    return StepResult(stats, counts, loss_value, float(grad_norm), target_s)


def noisy_features(out: TargetOutput, scale: float) -> TargetOutput:
    """EAGLE's feature augmentation: each tap the draft reads plus uniform noise U(-a, a) per
    element, a = `scale` x that position's RMS over the hidden size (the same setting
    perturbs every layer alike, whatever its magnitude), so the draft learns from features a
    little off the ones the target computed, as its own drafted features are at decode time;
    the target's logits (the labels) are untouched. EAGLE's own (U(-0.1, 0.1) x 512 / T)
    scales with the row's length instead. scale 0: `out` itself."""
    if scale <= 0:
        return out
    hidden = {}
    for layer, h in out.hidden.items():  # [B, T, H] each
        rms = h.float().pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 1]
        noise = (torch.rand_like(h, dtype=torch.float32) * 2 - 1) * scale * rms
        hidden[layer] = (h.float() + noise).to(h.dtype)
    return TargetOutput(logits=out.logits, hidden=hidden, cache=out.cache)


def target_output(
    target: Target,
    core: DraftModel,
    batch: dict[str, Tensor],
    rows: list[int],
    features: FeatureCache | None,
) -> TargetOutput:
    """The frozen target's logits and the taps the draft reads for `batch`: from the feature
    cache (train.feature_cache) when there is one, else one no-grad forward."""
    if features is not None:
        return cached_target_output(features, target, rows, batch)
    with torch.no_grad():
        return target(
            batch["input_ids"],
            attention_mask=batch["attention_mask"],
            hidden_layers=tuple(core.hidden_layers),
            use_cache=False,
        )
