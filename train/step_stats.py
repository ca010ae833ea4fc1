"""One optimizer step's loss and statistics, and their aggregation between log lines.

`offset_losses` sums the configured loss over every draft offset (Medusa heads, MTP depths,
EAGLE unroll steps; the draft LM has one offset 0), normalised by the GLOBAL count of trained
positions per offset and weighted offset_decay**i, and accumulates per-offset sums of the
loss, the acceptance proxy Σ min(p, q) and top-1 agreement into `stats`. `StepWindow` turns
those sums into the `kind: train` records of metrics.jsonl.
"""

from __future__ import annotations

import torch

from train.losses import acceptance_proxy, simulated_tau, top1_agreement


def offset_losses(out, target_logits, batch, offsets, counts, loss_fn, temperature, cfg, stats):
    """Sum over offsets of gamma^i * loss_i, each normalised by the global count."""
    total, n_off, T = 0.0, len(offsets), batch["input_ids"].shape[1]
    for i, (logits, off) in enumerate(zip(out.logits, offsets, strict=True)):
        if off != out.offsets[i]:
            raise ValueError(
                f"the draft changed its offsets between calls ({offsets} -> {out.offsets})"
            )
        d = logits[:, : T - off].float()  # [B, T-off, Vd]
        t = target_logits[:, off:]  # [B, T-off, V]
        if out.vocab_ids is not None:
            t = t.index_select(-1, out.vocab_ids.to(t.device))  # [B, T-off, Vd]
        d, t = d.reshape(-1, d.shape[-1]), t.reshape(-1, t.shape[-1])  # [N, Vd]
        mask = batch["loss_mask"][:, off:].reshape(-1)  # [N]
        kwargs = {}
        if cfg.loss.name == "ce" and cfg.loss.get("labels", "target") == "data":
            ids = batch["input_ids"]
            pad = ids.new_zeros(ids.shape[0], 1)
            labels = torch.cat([ids[:, off + 1 :], pad], 1)  # [B, T-off]: x_{t+off+1}
            if out.vocab_ids is not None:
                raise ValueError(
                    "loss.labels=data needs a full-vocabulary draft; use labels=target"
                )
            kwargs["labels"] = labels.reshape(-1)
        loss_sum = loss_fn(d, t, mask, temperature=temperature, reduction="sum", **kwargs)
        total = total + cfg.train.offset_decay**i * loss_sum / counts[i]
        stats[i] += loss_sum.detach()
        stats[n_off + i] += acceptance_proxy(d, t, mask, reduction="sum")
        stats[2 * n_off + i] += top1_agreement(d, t, mask, reduction="sum")
    return total


class StepWindow:
    """Running sums between two log lines, plus run totals for the summary."""

    def __init__(self, n_off: int):
        self.n_off = n_off
        self.total_tokens = self.total_time = self.total_target = 0.0
        self._reset()

    def _reset(self) -> None:
        self.sums = torch.zeros(3 * self.n_off + 2)
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
            "lr": lr,
            "grad_norm": self.grad_norm / self.steps,
            "steps_per_s": self.steps / self.time,
            "tokens_per_s": float(self.sums[-1]) / self.time,
            "target_time_share": self.target_time / self.time,
        }
        for i in range(n):
            rec[f"alpha_{i}"], rec[f"top1_{i}"] = alpha[i], top1[i]
        self._reset()
        return rec
