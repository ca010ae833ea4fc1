"""The names of decode samplings in records, and `StepWindow`, which turns the statistics
of training steps (train/core/step.py: StepStats) into the `kind: train` records of metrics.jsonl:
loss per offset, alpha and top-1 per offset, simulated tau, alpha at every T > 0 decode
sampling (`alpha_T0.7`), out-of-vocabulary share, throughput.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from decoding.drafter import Sampling
from train.losses.acceptance import simulated_tau


def sampling_tag(sampling: Sampling) -> str:
    """The name of a decode sampling in eval and train records: "greedy", "T0.7"."""
    return "greedy" if sampling.greedy else f"T{sampling.temperature:g}"


def decode_samplings(
    temperatures: Iterable[float], top_k: int, top_p: float
) -> dict[str, Sampling]:
    """tag -> Sampling of every temperature the decoder evaluates (decode.temperatures, each
    with decode.top_k / top_p)."""
    out = {}
    for temp in temperatures:
        sampling = Sampling(temperature=float(temp), top_k=int(top_k), top_p=float(top_p))
        out[sampling_tag(sampling)] = sampling
    return out


def proxy_tags(samplings: Mapping[str, Sampling]) -> list[str]:
    """The T > 0 decode samplings (`decode_samplings`) the acceptance proxy is computed at,
    in `stats` order."""
    return [tag for tag, s in samplings.items() if not s.greedy]


class StepWindow:
    """Running sums between two log lines, plus run totals for the summary. `tags` are the
    T > 0 decode samplings of the proxy (`proxy_tags`)."""

    def __init__(self, n_off: int, tags: list[str]):
        self.n_off, self.tags = n_off, list(tags)
        self.total_tokens = self.total_time = self.total_target = 0.0
        self._reset()

    def _reset(self) -> None:
        n, m = self.n_off, 1 + len(self.tags)
        self.loss_sums, self.top1_sums = torch.zeros(n), torch.zeros(n)
        self.alpha_sums = torch.zeros(m, n)  # row 0: the loss temperature, then `tags`
        self.oov, self.tokens = 0.0, 0.0
        self.counts = torch.zeros(self.n_off)
        self.loss = self.grad_norm = self.time = self.target_time = 0.0
        self.steps = 0

    def add(self, stats, counts, loss, grad_norm, t_target, t_step) -> None:
        """One step: its StepStats (reduced over ranks), trained positions per offset [n_off],
        loss, grad norm, seconds in the target and in the whole step."""
        self.loss_sums += stats.loss.cpu()
        self.alpha_sums += stats.alpha.cpu()
        self.top1_sums += stats.top1.cpu()
        self.oov += float(stats.oov)
        self.tokens += float(stats.tokens)
        self.counts += counts.cpu()
        self.loss += loss
        self.grad_norm += grad_norm
        self.time += t_step
        self.target_time += t_target
        self.steps += 1
        self.total_tokens += float(stats.tokens)
        self.total_time += t_step
        self.total_target += t_target

    def flush(self, step: int, lr: float, k: int, offsets: list[int]) -> dict:
        n, oov = self.n_off, self.oov
        alpha = (self.alpha_sums[0] / self.counts).tolist()
        top1 = (self.top1_sums / self.counts).tolist()
        rec = {
            "kind": "train",
            "step": step,
            "loss": self.loss / self.steps,
            "loss_per_offset": (self.loss_sums / self.counts).tolist(),
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
            "tokens_per_s": self.tokens / self.time,
            "target_time_share": self.target_time / self.time,
        }
        for j, tag in enumerate(self.tags, start=1):
            alpha_t = (self.alpha_sums[j] / self.counts).tolist()
            rec[f"alpha_{tag}"], rec[f"sim_tau_{tag}"] = alpha_t, simulated_tau(alpha_t, k)
        for i in range(n):
            rec[f"alpha_{i}"], rec[f"top1_{i}"] = alpha[i], top1[i]
        self._reset()
        return rec

    def totals(self) -> dict[str, float | None]:
        """Run totals for the summary: tokens per second and the target's share of the time."""
        if not self.total_time:
            return {"tokens_per_s": None, "target_time_share": None}
        return {
            "tokens_per_s": self.total_tokens / self.total_time,
            "target_time_share": self.total_target / self.total_time,
        }
