"""What every exporter (train/formats/export.py, train/formats/eagle.py) shares: the refusal
type and the checks run before writing (finite weights, the target's vocabulary) and after
(read the written files back: every config field and weight key the format needs)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from models.target import Target


class ExportError(ValueError):
    """The draft cannot be exported in the asked format; nothing was written."""


# -- checks shared by every format -----------------------------------------------------------
def check_finite(state: dict[str, Tensor], what: str) -> None:
    bad = [k for k, t in state.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ExportError(
            f"{what} has NaN/Inf weights in {bad[:5]}{' ...' if len(bad) > 5 else ''}; "
            "export an earlier checkpoint of the run (scripts/compare.py shows its losses)"
        )


def check_vocab(draft_vocab: int, target: Target, what: str) -> None:
    if draft_vocab != target.vocab_size:
        raise ExportError(
            f"{what} predicts {draft_vocab} tokens but the target {target.name!r} has "
            f"{target.vocab_size}: engines verify draft ids as target ids, so the vocabularies "
            "must be the same; export against the target the draft was trained for"
        )


def read_back(out: Path, weights: str, config_fields: tuple[str, ...]) -> tuple[set[str], dict]:
    """The key set of `out/weights` and `out/config.json`, refusing a missing config field."""
    config = json.loads((out / "config.json").read_text())
    missing = [f for f in config_fields if f not in config]
    if missing:
        raise ExportError(f"written config.json lacks {missing} (an exporter bug)")
    with safe_open(str(out / weights), framework="pt") as f:
        keys = set(f.keys())
    return keys, config


def check_keys(got: set[str], expected: set[str], what: str) -> None:
    if got != expected:
        raise ExportError(
            f"{what}: missing {sorted(expected - got)[:5]}, unexpected "
            f"{sorted(got - expected)[:5]} (an exporter bug)"
        )
