"""The draft's optimizer from the flat settings of conf/optim/*.yaml (`build_optimizer`).

`optim=adamw` (the default): AdamW over every trainable parameter. `optim=muon`: Muon
(`torch.optim.Muon`, Newton-Schulz orthogonalised momentum) for the 2-D weight matrices of
hidden layers and AdamW for the rest (embeddings, output heads, norms, biases, 1-D and
degenerate [1, N] parameters), the split and defaults of vllm-project/speculators
(src/speculators/train/optimizers.py: split_named_params_for_muon, build_optimizers;
train/config/schema.py: OptimizerArgs). Speculators steps two optimizers in tandem; here
one `MuonWithAdamW` holds both as param groups, so the loop, the LR scheduler (every
group's lr scaled alike), gradient clipping and checkpoints (one state_dict) see one
optimizer as with AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

OPTIMIZERS = ("adamw", "muon")
SCHEDULE_KEYS = ("warmup_steps", "min_lr_ratio")  # train/core/schedule.py's, not the optimizer's
# 2-D weights that stay with AdamW: embeddings, codebooks and vocabulary heads (speculators'
# _ADAMW_NAME_HINTS, after Keller Jordan's Muon).
ADAMW_NAME_HINTS = ("embed_tokens", "lm_head", "codebook", "markov_w1", "markov_w2")
MUON_ADJUST_LR = ("original", "match_rms_adamw")
ADAMW_KEYS = ("name", "lr", "betas", "eps", "weight_decay")
MUON_KEYS = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_ns_steps", "muon_adjust_lr_fn")


def split_for_muon(
    named_params: Iterable[tuple[str, Tensor]],
) -> tuple[list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """Trainable parameters -> (Muon's, AdamW's): Muon takes a 2-D matrix with both sides
    > 1 whose name has none of ADAMW_NAME_HINTS; AdamW everything else."""
    muon, adamw = [], []
    for name, param in named_params:
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1
        (muon if matrix and not any(h in name for h in ADAMW_NAME_HINTS) else adamw).append(
            (name, param)
        )
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon over some parameters and AdamW over the others as ONE optimizer: its
    param_groups are the two inner optimizers' groups (the same dicts, so an LR scheduler
    reaches both) and its state holds both inner states, so state_dict / load_state_dict
    save and restore both. Muon's groups come first."""

    def __init__(self, muon: torch.optim.Muon | None, adamw: torch.optim.AdamW | None) -> None:
        self._inner = [o for o in (muon, adamw) if o is not None]
        if not self._inner:
            raise ValueError("no trainable parameters to optimize")
        self._sizes = [len(o.param_groups) for o in self._inner]
        super().__init__([g for o in self._inner for g in o.param_groups], defaults={})
        self._share()

    def _share(self) -> None:
        """Point the inner optimizers at this one's groups and state (again after a load,
        which replaces both)."""
        start = 0
        for inner, size in zip(self._inner, self._sizes, strict=True):
            inner.param_groups = self.param_groups[start : start + size]
            inner.state = self.state
            start += size

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._share()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner:
            inner.step()
        return loss


def optimizer_settings(optim: Mapping[str, Any]) -> dict[str, Any]:
    """conf/optim/*.yaml -> build_optimizer's keyword arguments (the schedule's keys left
    to train/core/schedule.py). A key neither uses, or a Muon key without optim=muon, is refused."""
    settings = {k: v for k, v in dict(optim).items() if k not in SCHEDULE_KEYS}
    name = settings.get("name", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not one of {list(OPTIMIZERS)}")
    known = ADAMW_KEYS + (MUON_KEYS if name == "muon" else ())
    unknown = sorted(set(settings) - set(known))
    if unknown:
        hint = " (a Muon setting: use optim=muon)" if unknown[0] in MUON_KEYS else ""
        raise ValueError(
            f"optim.{unknown[0]} is not a setting of optim.name={name}{hint}; its settings "
            f"are {list(known + SCHEDULE_KEYS)}"
        )
    return settings


def build_optimizer(
    named_params: Iterable[tuple[str, Tensor]],
    name: str = "adamw",
    lr: float = 1e-3,
    betas: Iterable[float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    muon_lr: float | None = None,  # None: lr (speculators' default)
    muon_momentum: float = 0.95,
    muon_weight_decay: float = 0.1,
    muon_ns_steps: int = 5,
    muon_adjust_lr_fn: str = "match_rms_adamw",
) -> torch.optim.Optimizer:
    """`name` "adamw": AdamW(lr, betas, eps, weight_decay) over every trainable parameter.
    "muon": `MuonWithAdamW`, Muon(muon_lr, muon_momentum, muon_weight_decay, muon_ns_steps,
    muon_adjust_lr_fn; Nesterov) over `split_for_muon`'s matrices and that AdamW over the
    rest. A ValueError names the bad setting."""
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.name={name!r} is not one of {list(OPTIMIZERS)}")
    named_params = list(named_params)
    adamw_args = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
    if name == "adamw":  # in the module's order, as every checkpoint's optimizer state is
        params = [p for _, p in named_params if p.requires_grad]
        return torch.optim.AdamW(params, **adamw_args)
    muon_params, adamw_params = split_for_muon(named_params)
    if muon_adjust_lr_fn not in MUON_ADJUST_LR:
        raise ValueError(
            f"optim.muon_adjust_lr_fn must be one of {list(MUON_ADJUST_LR)}, "
            f"got {muon_adjust_lr_fn!r}"
        )
    if isinstance(muon_ns_steps, bool) or not isinstance(muon_ns_steps, int) or muon_ns_steps < 1:
        raise ValueError(f"optim.muon_ns_steps must be an integer >= 1, got {muon_ns_steps!r}")
    for key, value in (("muon_lr", muon_lr), ("muon_momentum", muon_momentum)):
        if value is not None and not value >= 0.0:
            raise ValueError(f"optim.{key} must be >= 0, got {value}")
    if not muon_weight_decay >= 0.0:
        raise ValueError(f"optim.muon_weight_decay must be >= 0, got {muon_weight_decay}")
    muon = None
    if muon_params:
        muon = torch.optim.Muon(
            [p for _, p in muon_params],
            lr=lr if muon_lr is None else muon_lr,
            momentum=muon_momentum,
            weight_decay=muon_weight_decay,
            ns_steps=muon_ns_steps,
            adjust_lr_fn=muon_adjust_lr_fn,
        )
    adamw = torch.optim.AdamW([p for _, p in adamw_params], **adamw_args) if adamw_params else None
    return MuonWithAdamW(muon, adamw)
