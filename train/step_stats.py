"""One optimizer step's loss and statistics, and their aggregation between log lines.

`offset_losses` sums the configured loss over every draft offset (Medusa heads, MTP depths,
EAGLE unroll steps; the draft LM has one offset 0), normalised by the GLOBAL count of trained
positions per offset and weighted offset_decay**i, and accumulates per-offset sums into
`stats`. `aux_loss` adds what a draft trains besides its offsets: its own weighted
`DraftOutput.aux_loss` (EAGLE-1 feature regression) and, for a draft that adapts the target
(Medusa-2), weight * KL(p_target || p_adapted). `StepWindow` turns the sums into the
`kind: train` records of metrics.jsonl.

The acceptance statistics are the decoder's (train/losses.py): top-1 agreement with the
target's full-vocabulary argmax (greedy), and alpha = Σ min(p, q) over the draft's ids with
the target's un-renormalised full-vocabulary p, at the loss temperature (`alpha`) and at
every T > 0 decode sampling of cfg.decode, with its top-k / top-p (`alpha_T0.7`), which is
what train/evaluate.py compares with the decoder's tau. The loss itself keeps the target
renormalised over a reduced draft vocabulary, except the alpha / TV terms of the TV family
(`lk`, `lk_alpha`, `dspark`), which get the full-vocabulary logsumexp (`target_log_norm`).
A loss's own options (conf/loss/*.yaml beyond name / temperature / labels) are passed on.

Reduced draft vocabulary: a position whose target argmax lies outside it can never be a
greedy hit; `oov_share` logs their share (offset 0's positions), and
`train.mask_out_of_vocab=true` drops them from the loss (SpecForge's position mask). The
loss is still divided by the count of all trained positions, so masked positions weigh 0.

Layout of `stats` (one tensor, reduced across ranks), n = number of offsets, m = number of
T > 0 decode samplings:
  [0, n) loss sums | [n, 2n) alpha at the loss temperature | [2n, 3n) top-1 hits |
  3n auxiliary loss | [3n+1, 3n+1+mn) alpha per decode sampling, offset-minor |
  3n+1+mn out-of-vocabulary positions at offset 0 | last: tokens.
"""

from __future__ import annotations

import inspect

import torch
from omegaconf import DictConfig
from torch import Tensor

from decoding.drafter import Sampling
from models.protocol import DraftOutput
from train.losses import (
    acceptance_proxy,
    forward_kl,
    loss_options,
    sampling_cutoffs,
    simulated_tau,
    top1_agreement,
)


def sampling_tag(sampling: Sampling) -> str:
    """The name of a decode sampling in eval and train records: "greedy", "T0.7"."""
    return "greedy" if sampling.greedy else f"T{sampling.temperature:g}"


def decode_samplings(dec: DictConfig) -> dict[str, Sampling]:
    """tag -> Sampling of every temperature the decoder evaluates (cfg.decode)."""
    out = {}
    for temp in dec.get("temperatures", [0.0]):
        sampling = Sampling(
            temperature=float(temp),
            top_k=int(dec.get("top_k", 0)),
            top_p=float(dec.get("top_p", 1.0)),
        )
        out[sampling_tag(sampling)] = sampling
    return out


def proxy_tags(dec: DictConfig) -> list[str]:
    """The T > 0 decode samplings the acceptance proxy is computed at, in `stats` order."""
    return [tag for tag, s in decode_samplings(dec).items() if not s.greedy]


def stats_size(n_off: int, num_tags: int) -> int:
    """Slots of `stats` for n_off offsets and num_tags T > 0 decode samplings (layout above)."""
    return (3 + num_tags) * n_off + 3


def _alpha_slot(n_off: int, j: int) -> int:
    """First slot of alpha sampling j: 0 = the loss temperature, j >= 1 = decode sampling j."""
    return n_off if j == 0 else (2 + j) * n_off + 1


def _oov_slot(n_off: int, num_tags: int) -> int:
    return (3 + num_tags) * n_off + 1


def offset_weights(out: DraftOutput, train_cfg: DictConfig) -> list[float]:
    """The loss weight of each offset: the draft's own (`DraftOutput.offset_weights`, DFlash's
    exp(-(i-1)/gamma)) or train.offset_decay ** i."""
    if out.offset_weights is not None:
        return list(out.offset_weights)
    return [train_cfg.offset_decay**i for i in range(len(out.offsets))]


def _rows_at(x: Tensor, off: int, index: Tensor | None) -> Tensor:
    """x [B, T, ...] where an offset's logits pair with it: x[:, off:] [B, T-off, ...] for
    logits at every position, else x at `index` [B, N] (the draft's positions + off, inside
    the sequence) [B, N, ...]."""
    if index is None:
        return x[:, off:]
    # Whole rows by flat index: a row copy per pair, where gather over an expanded [B, N, V]
    # index does per-element index arithmetic (63 ms vs a few ms for 4 x 72 rows of 49,152).
    B, T = x.shape[:2]
    flat = (index + T * torch.arange(B, device=index.device)[:, None]).reshape(-1)  # [B*N]
    return x.reshape(B * T, *x.shape[2:]).index_select(0, flat).view(*index.shape, *x.shape[2:])


def offset_losses(out, target_logits, batch, offsets, counts, loss_fn, temperature, cfg, stats):
    """Sum over offsets of w_i * loss_i (w_i = `offset_weights`), each normalised by the
    global count. A draft trained at sampled positions (`out.positions`, DFlash anchors) is
    paired with the target there, and its sums are scaled up to the micro-batch's trained
    positions (a ratio estimate: the anchors are drawn uniformly among the answer positions),
    so every normalisation and logged mean stays a per-position mean."""
    total, n_off, T = 0.0, len(offsets), batch["input_ids"].shape[1]
    proxies = [Sampling(temperature=temperature)]  # the loss temperature, then the decode's
    proxies += [s for s in decode_samplings(cfg.decode).values() if not s.greedy]
    if stats.numel() != stats_size(n_off, len(proxies) - 1):
        raise ValueError(
            f"stats has {stats.numel()} slots; {n_off} offsets and {len(proxies) - 1} decode "
            f"temperatures > 0 need stats_size(...) = {stats_size(n_off, len(proxies) - 1)}"
        )
    # Target-side numbers shared by every offset, from the full vocabulary, computed once:
    # its argmax and, per sampling, two numbers per position that give its p (no [B, T, V] copy).
    V = target_logits.shape[-1]
    flat = target_logits.reshape(-1, V)  # [B*T, V] a view
    top = target_logits.argmax(-1)  # [B, T]
    # The loss temperature is usually one of the decode's (T = 1): one pass over V per sampling.
    unique = {s: sampling_cutoffs(flat, s).view(*top.shape, 2) for s in dict.fromkeys(proxies)}
    cutoffs = [unique[s] for s in proxies]  # [B, T, 2] each
    in_vocab = None  # [V] bool: target ids inside a reduced draft vocabulary
    mask_oov = bool(cfg.train.get("mask_out_of_vocab", False))
    if mask_oov and out.vocab_ids is None:
        raise ValueError(
            "train.mask_out_of_vocab=true needs a reduced draft vocabulary (EAGLE-3's "
            "draft.model.vocab_size); this draft predicts the full vocabulary: set it to false"
        )
    if out.vocab_ids is not None:
        in_vocab = torch.zeros(V, dtype=torch.bool, device=top.device)
        in_vocab[out.vocab_ids.to(top.device)] = True
    options = loss_options(loss_fn, cfg.loss)  # its own settings: LK's eta, ...
    takes = inspect.signature(loss_fn).parameters
    weights = offset_weights(out, cfg.train)
    for i, (logits, off) in enumerate(zip(out.logits, offsets, strict=True)):
        if off != out.offsets[i]:
            raise ValueError(
                f"the draft changed its offsets between calls ({offsets} -> {out.offsets})"
            )
        index, scale = None, 1.0  # logits at sampled positions: their targets at index [B, N]
        if out.positions is not None:
            index = (out.positions + off).clamp(0, T - 1)
        d = (logits if index is not None else logits[:, : T - off]).float()  # [B, T-off|N, Vd]
        t = _rows_at(target_logits, off, index)  # [B, T-off|N, V]
        if out.vocab_ids is not None:
            t = t.index_select(-1, out.vocab_ids.to(t.device))  # [B, T-off, Vd]
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
                stats[_oov_slot(n_off, len(proxies) - 1)] += (oov & mask.bool()).sum() * scale
            if mask_oov:
                loss_mask = mask * ~oov
        kwargs = dict(options)
        if "target_log_norm" in takes:  # the TV family: alpha over the full-vocabulary p
            kwargs["target_log_norm"] = _rows_at(cutoffs[0], off, index)[..., 1].reshape(-1)
        if "labels" in takes and cfg.loss.get("labels", "target") == "data":
            ids = batch["input_ids"]
            pad = ids.new_zeros(ids.shape[0], 1)
            labels = _rows_at(torch.cat([ids[:, 1:], pad], 1), off, index)  # x_{t+off+1}
            if out.vocab_ids is not None:
                raise ValueError(
                    "loss.labels=data needs a full-vocabulary draft; use labels=target"
                )
            kwargs["labels"] = labels.reshape(-1)
        loss_sum = loss_fn(d, t, loss_mask, temperature=temperature, reduction="sum", **kwargs)
        if out.base_logits is not None and out.base_loss_weight > 0:  # Domino's curriculum
            base = out.base_logits[i] if index is not None else out.base_logits[i][:, : T - off]
            base_sum = loss_fn(
                base.float().reshape(d.shape), t, loss_mask, temperature=temperature,
                reduction="sum", **kwargs,
            )  # fmt: skip
            loss_sum = (1 - out.base_loss_weight) * loss_sum + out.base_loss_weight * base_sum
        loss_sum = loss_sum * scale
        total = total + weights[i] * loss_sum / counts[i]
        stats[i] += loss_sum.detach()
        # The decoder's view on every trained position, masked from the loss or not.
        top1 = top1_agreement(d, top_i, mask, out.vocab_ids, reduction="sum")
        stats[2 * n_off + i] += top1 * scale
        alpha_sums = {}  # sampling -> this offset's alpha sum, computed once per sampling
        for j, (sampling, cut) in enumerate(zip(proxies, cutoffs, strict=True)):
            if sampling not in alpha_sums:
                cut_i = _rows_at(cut, off, index).reshape(-1, 2)  # [N, 2]
                alpha_sums[sampling] = scale * acceptance_proxy(
                    d, t, mask, sampling, cut_i, reduction="sum"
                )
            stats[_alpha_slot(n_off, j) + i] += alpha_sums[sampling]
    return total


def adapted_lm_kl(out: DraftOutput, target_logits: Tensor, attention_mask: Tensor | None) -> Tensor:
    """KL(p_target || p_adapted) over the real tokens: how far a draft's adapted target
    (Medusa-2's LoRA, `out.adapted_logits` [B, T, V]) has moved from the frozen one
    (`target_logits` [B, T, V])."""
    own = out.adapted_logits  # [B, T, V]
    if attention_mask is None:
        attention_mask = torch.ones(own.shape[:2], dtype=torch.long, device=own.device)
    vocab = own.shape[-1]
    return forward_kl(
        own.reshape(-1, vocab), target_logits.reshape(-1, vocab), attention_mask.reshape(-1)
    )


def aux_loss(
    out: DraftOutput, target_logits: Tensor, attention_mask: Tensor | None
) -> Tensor | None:
    """The draft's loss besides its offsets, weighted: its own `aux_loss` (EAGLE-1 feature
    regression) plus, when it adapts the target (Medusa-2), adapted_loss_weight *
    KL(p_target || p_adapted), which keeps the adapted model's outputs where they were.
    None when the draft has neither."""
    total = out.aux_loss
    if out.adapted_logits is not None:
        lm = out.adapted_loss_weight * adapted_lm_kl(out, target_logits, attention_mask)
        total = lm if total is None else total + lm
    return total


class StepWindow:
    """Running sums between two log lines, plus run totals for the summary. `tags` are the
    T > 0 decode samplings of the proxy (proxy_tags(cfg.decode))."""

    def __init__(self, n_off: int, tags: list[str]):
        self.n_off, self.tags = n_off, list(tags)
        self.size = stats_size(n_off, len(self.tags))
        self.total_tokens = self.total_time = self.total_target = 0.0
        self._reset()

    def _reset(self) -> None:
        self.sums = torch.zeros(self.size)
        self.counts = torch.zeros(self.n_off)
        self.loss = self.grad_norm = self.time = self.target_time = 0.0
        self.steps = 0

    def add(self, stats, counts, loss, grad_norm, t_target, t_step) -> None:
        self.sums += stats.cpu()
        self.counts += counts.cpu()
        self.loss += loss
        self.grad_norm += grad_norm
        self.time += t_step
        self.target_time += t_target
        self.steps += 1
        self.total_tokens += float(stats[-1])
        self.total_time += t_step
        self.total_target += t_target

    def flush(self, step: int, lr: float, k: int, offsets: list[int]) -> dict:
        n = self.n_off
        alpha = (self.sums[n : 2 * n] / self.counts).tolist()
        top1 = (self.sums[2 * n : 3 * n] / self.counts).tolist()
        oov = float(self.sums[_oov_slot(n, len(self.tags))])
        rec = {
            "kind": "train",
            "step": step,
            "loss": self.loss / self.steps,
            "loss_per_offset": (self.sums[:n] / self.counts).tolist(),
            "offsets": offsets,
            "alpha": alpha,
            "top1": top1,
            "sim_tau": simulated_tau(alpha, k),
            "sim_tau_greedy": simulated_tau(top1, k),
            "oov_positions": oov,
            "oov_share": oov / max(float(self.counts[0]), 1.0),
            "lr": lr,
            "grad_norm": self.grad_norm / self.steps,
            "steps_per_s": self.steps / self.time,
            "tokens_per_s": float(self.sums[-1]) / self.time,
            "target_time_share": self.target_time / self.time,
        }
        for j, tag in enumerate(self.tags, start=1):
            start = _alpha_slot(n, j)
            alpha_t = (self.sums[start : start + n] / self.counts).tolist()
            rec[f"alpha_{tag}"], rec[f"sim_tau_{tag}"] = alpha_t, simulated_tau(alpha_t, k)
        for i in range(n):
            rec[f"alpha_{i}"], rec[f"top1_{i}"] = alpha[i], top1[i]
        self._reset()
        return rec
