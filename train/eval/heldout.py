"""The held-out acceptance proxy: a learning curve at every checkpoint for seconds, where a
decode evaluation (train/eval/evaluate.py) costs minutes on a CPU.

The rows are the eval prompts answered by the target itself, greedily, decode.max_new_tokens
long: the text a greedy decode of those prompts produces (up to dtype rounding), regenerated
once and cached like the training answers (train/data/regenerate.py). The eval prompts are
held out from training by source item (train/data/prepare.py), so the draft never trains on
them.

At each checkpoint `HeldOut.record` runs the draft over those rows in eval mode without
gradients and measures what a training step measures (train/core/step.py: offset_losses, in the
step's autocast): α and top-1 per offset, simulated τ greedy and at every T > 0 decode
sampling. The training records' proxy is taken on rows the draft trains on, pass after pass,
and rises as the draft memorises them; this one is taken on text it has never seen, as the
decoder's evaluation is.

The target's taps and last hidden state for the rows are computed once, at the first
record, and kept in memory ((taps + 1) x hidden_size x 4 bytes per token: ~46 MB for 24
rows of ~200 tokens on the embedded target); each record rebuilds the logits from them with
the target's `head_logits`, as the feature cache does (train/core/feature_cache.py).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from models.target import Target, TargetOutput
from train.core.step import StepSetup, StepStats, offset_losses
from train.core.step_stats import StepWindow, sampling_tag
from train.data.chat import shift_mask
from train.data.prepare import collate
from train.data.regenerate import regenerate
from train.parallel.ranks import Ranks
from train.report.runs import HELDOUT_PREFIX

PREFIX = HELDOUT_PREFIX  # the record's keys, apart from those of train records in W&B's log


def heldout_rows(
    target: Target,
    eval_prompts: list[dict],  # PreparedData.eval_prompts: input_ids of each prompt
    max_new_tokens: int,  # decode.max_new_tokens: as long as the decoder's answers
    *,
    dtype: str,  # the regeneration dtype (data.regen_dtype as chosen for the training rows)
    batch_size: int = 16,
    seed: int = 0,
    cache_dir: str | None = None,
    chat_template: str | None = None,
    progress: bool = True,
    ranks: Ranks | None = None,
) -> list[dict]:
    """Each eval prompt with the target's greedy answer: input_ids, loss_mask (the answer's
    labels only, as the training rows'). Rows whose answer is empty are left out."""
    prompts = [list(p["input_ids"]) for p in eval_prompts]
    answers, _ = regenerate(
        target, prompts, max_new_tokens=max_new_tokens, temperature=0.0, top_p=1.0,
        batch_size=batch_size, dtype=dtype, seed=seed, cache_dir=cache_dir,
        chat_template=chat_template, progress=progress, ranks=ranks,
    )  # fmt: skip
    rows = []
    for ids, answer in zip(prompts, answers, strict=True):
        if answer["ids"]:
            flags = [0] * len(ids) + [1] * len(answer["ids"])
            rows.append({"input_ids": ids + answer["ids"], "loss_mask": shift_mask(flags)})
    return rows


@dataclass
class HeldOut:
    """The held-out rows in batches, what each record measures with, and the target's
    outputs for the rows once computed."""

    batches: list[dict[str, Tensor]]  # collate()d, on the target's device
    setup: StepSetup  # the run's: samplings, offsets, loss, autocast
    k: int  # decode.k: simulated tau counts k drafts a round
    outputs: list[TargetOutput] = field(default_factory=list)  # logits=None: rebuilt per record
    prefix: str = PREFIX  # the record's keys: "heldout/" (eval prompts), "val/" (data.pack_val)

    @classmethod
    def from_rows(
        cls,
        rows: list[dict],
        pad_id: int,
        batch_size: int,
        device,
        setup: StepSetup,
        k: int,
        prefix: str = PREFIX,
        pad_multiple: int = 1,
    ) -> HeldOut:
        if not rows:
            raise ValueError(
                "train.heldout_proxy=true but the target's answer to every eval prompt was "
                "empty (it stopped at once): raise decode.max_new_tokens or set "
                "train.heldout_proxy=false"
            )
        chunks = [rows[i : i + batch_size] for i in range(0, len(rows), batch_size)]
        # widths padded as training's (train.pad_multiple): on a CPU each new width leaves
        # oneDNN state for good (docs/memory.md)
        batches = [
            {n: v.to(device) for n, v in collate(c, pad_id, pad_multiple).items()} for c in chunks
        ]
        return cls(batches, setup, k, prefix=prefix)

    @torch.no_grad()
    def _target_outputs(self, target: Target, hidden_layers: tuple[int, ...]) -> None:
        taps = tuple(dict.fromkeys([*hidden_layers, -1]))  # -1: the head's input, once
        for b in self.batches:
            out = target(b["input_ids"], attention_mask=b["attention_mask"], hidden_layers=taps,
                         logits=False, use_cache=False)  # fmt: skip
            hidden = {la: out.hidden[la] for la in taps}
            self.outputs.append(TargetOutput(logits=None, hidden=hidden, cache=None))

    @torch.no_grad()
    def record(self, draft: torch.nn.Module, target: Target) -> dict:
        """The proxy on the held-out rows: `prefix`ed keys of a train record (α, top-1
        and loss per offset, sim_tau, sim_tau_greedy, per T > 0 decode sampling alpha_<tag>
        and sim_tau_<tag>) plus `heldout/positions` and `heldout/seconds`. `draft` is the
        whole (unsharded) draft; each module's training mode is restored."""
        started, setup = time.perf_counter(), self.setup
        modes = {m: m.training for m in draft.modules()}  # some are built in eval mode
        layers = tuple(draft.hidden_layers)
        if not self.outputs or not set(layers) <= set(self.outputs[0].hidden):
            self.outputs = []
            self._target_outputs(target, layers)
        n_off = len(setup.offsets)
        tags = [sampling_tag(s) for s in setup.samplings[1:]]  # the T > 0 decode samplings
        window = StepWindow(n_off, tags)
        autocast = torch.autocast(target.device.type, torch.bfloat16) if setup.autocast else None
        draft.eval()
        try:
            for b, cached in zip(self.batches, self.outputs, strict=True):
                logits = target.head_logits(cached.hidden[-1])  # [B, T, V]
                t_out = TargetOutput(logits=logits, hidden={la: cached.hidden[la] for la in layers},
                                     cache=None)  # fmt: skip
                counts = torch.tensor(
                    [float(b["loss_mask"][:, off:].sum()) for off in setup.offsets]
                )
                stats = StepStats.zeros(n_off, len(setup.samplings), logits.device)
                with autocast or nullcontext():
                    out = draft(target, b["input_ids"], t_out, b["attention_mask"], b["loss_mask"])
                    offset_losses(
                        out, logits, b, counts.clamp_min(1.0).to(logits.device), setup, stats
                    )
                stats.tokens += b["attention_mask"].sum()
                window.add(stats, counts, 0.0, 0.0, 0.0, 1.0)
        finally:
            for module, training in modes.items():
                module.training = training
        window.counts.clamp_(min=1.0)  # an offset past every answer: 0, not 0 / 0
        rec = window.flush(0, 0.0, self.k, list(setup.offsets))
        keep = ("loss_per_offset", "alpha", "top1", "sim_tau", "sim_tau_greedy", "oov_share")
        keep += tuple(f"{kind}_{tag}" for tag in tags for kind in ("alpha", "sim_tau"))
        held = {self.prefix + key: rec[key] for key in keep}
        held[self.prefix + "positions"] = sum(int(b["loss_mask"].sum()) for b in self.batches)
        held[self.prefix + "seconds"] = round(time.perf_counter() - started, 2)
        return held
