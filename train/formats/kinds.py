"""Which draft kind can be written in which export format: the one table `scripts/export.py`
(before the target loads, from the checkpoint's draft.yaml) and `export` (from the module)
both check, and the reasons the kinds with no format are refused (docs/export.md)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from omegaconf import OmegaConf
from torch import nn

from models.eagle import EagleDraft
from models.medusa import MedusaHeads
from train.formats.checks import ExportError

# A draft's export kind: its `kind`, refined where one kind trains two layouts (EAGLE-1 /
# EAGLE-3 are both kind eagle; Medusa-2 is kind medusa with a LoRA-adapted target).
EXPORT_FORMATS: dict[str, tuple[str, ...]] = {
    "draft_lm": ("hf",),
    "medusa": ("medusa", "vllm-medusa"),
    "medusa2": ("hf", "medusa", "vllm-medusa"),  # hf: the merged (adapted) target
    "eagle": ("speculators", "eagle"),  # EAGLE-3
    "eagle1": ("eagle",),
    "mtp": (),  # a module per depth, Llama layers
    "mtp_served": ("speculators",),  # one_layer + qk_norm (models/mtp.py)
    "dflash": (),  # the learned-mask-vector layout
    "dflash_served": ("speculators",),  # mask_token_id + qk_norm (models/dflash.py)
    "domino": (),
    "selfspec": (),  # the target's own layers and a trained exit: no engine loads it
}
FORMATS = ("hf", "medusa", "vllm-medusa", "eagle", "speculators")

# Why a kind has no format. Every claim about a library is from its source: speculators 0.9
# `models/mtp/{config,core,model_definitions}.py`, `models/dflash/config.py`.
REFUSED: dict[str, str] = {
    "mtp": (
        "this MTP checkpoint is not exported: speculators 0.9's `mtp` type (MTPDraftModel, "
        "what vLLM reads) holds ONE Qwen3-family next-n layer (its attention RMS-normalises q "
        "and k per head; a `llama` transformer_layer_config is refused) and drafts step k+1 "
        "from that layer's normed output; this draft has a Llama module per depth, each fed "
        "the pre-norm h^d, so no key map gives the same maths (tests/test_export_mtp.py). "
        "Train the served variant instead (draft.model.one_layer=true draft.model.qk_norm="
        "true, +experiment=mtp_served_kl): --format speculators writes it."
    ),
    "dflash": (
        "this DFlash checkpoint is not exported: SGLang, the z-lab reference and speculators "
        "load z-lab's DFlash layout (Qwen3 draft layers with q_norm / k_norm, and a mask token "
        "id whose embedding row feeds the mask positions); this draft has Llama layers and a "
        "learned mask vector with no token id, so no key map gives the same maths "
        "(docs/dflash.md). Train the served variant instead (draft.model.mask_token_id=auto "
        "draft.model.qk_norm=true, +experiment=dflash_served_kl): --format speculators "
        "writes it."
    ),
    "domino": (
        "Domino checkpoints are not exported: its backbone is draftlab's DFlash layout, which "
        "no engine loads (see draft=dflash, docs/dflash.md), and no engine format holds its "
        "GRU correction head. Evaluate it with scripts/evaluate.py instead."
    ),
    "selfspec": (
        "self-speculative checkpoints are not exported: no engine loads a trained exit on a "
        "target's own layers. vLLM has no self-speculative method (its LayerSkip pull request, "
        "vllm-project/vllm#18994, was closed); transformers' `assistant_early_exit=L` drafts "
        "from layer L through the model's own final norm and head, with no adapter, which is "
        "this kind untrained (a zero exit). Evaluate it with scripts/evaluate.py instead."
    ),
}

# Why a kind is not written as a format its sibling kind has.
MISMATCH_REASONS: dict[tuple[str, str], str] = {
    ("eagle1", "speculators"): (
        "speculators has no EAGLE-1 format any more (vLLM's speculators reader knows eagle3 / "
        "peagle / dflash / medusa / dspark); use --format eagle (vLLM's llama_eagle.py layout)"
    ),
}


def module_export_kind(draft: nn.Module) -> str:
    """The export kind of a draft module (`EXPORT_FORMATS`' key)."""
    if isinstance(draft, MedusaHeads) and draft.adapted is not None:
        return "medusa2"
    if isinstance(draft, EagleDraft) and draft.style == "eagle1":
        return "eagle1"
    if (
        draft.kind == "dflash"
        and getattr(draft, "mask_token_id", None) is not None
        and draft.qk_norm
    ):
        return "dflash_served"
    if draft.kind == "mtp" and draft.one_layer and draft.qk_norm:
        return "mtp_served"
    return draft.kind


def checkpoint_export_kind(ckpt: str | Path) -> str:
    """The export kind of a checkpoint, read from its draft.yaml (no weights, no target)."""
    path = Path(ckpt) / "draft.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{ckpt} is not a draftlab checkpoint (no draft.yaml); give "
            "<run_dir>/checkpoints/step_N"
        )
    draft_cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return config_export_kind(draft_cfg)


def config_export_kind(draft_cfg: Mapping) -> str:
    """The export kind a draft config (`kind` and `model` of conf/draft/*.yaml) builds."""
    kind, model = str(draft_cfg.get("kind")), draft_cfg.get("model") or {}
    if kind == "medusa" and model.get("medusa2"):
        return "medusa2"
    if kind == "eagle" and model.get("style") == "eagle1":
        return "eagle1"
    if kind == "dflash" and model.get("mask_token_id") is not None and model.get("qk_norm"):
        return "dflash_served"
    if kind == "mtp" and model.get("one_layer") and model.get("qk_norm"):
        return "mtp_served"
    return kind


def check_kind_format(kind: str, fmt: str) -> None:
    """Refuse a format the kind cannot be written as, with the kind's reason or its formats."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: use one of {FORMATS}")
    if kind in REFUSED:
        raise ExportError(REFUSED[kind])
    if kind not in EXPORT_FORMATS:
        raise ExportError(
            f"draft kind {kind!r} has no export format (the kinds that have: "
            f"{formats_by_kind()}); evaluate it with scripts/evaluate.py instead"
        )
    allowed = EXPORT_FORMATS[kind]
    if fmt not in allowed:
        why = f": {MISMATCH_REASONS[kind, fmt]}" if (kind, fmt) in MISMATCH_REASONS else ""
        raise ExportError(
            f"a {kind} draft is written as {' or '.join(allowed)}, not --format {fmt}{why} "
            f"(docs/export.md: {formats_by_kind()})"
        )


def formats_by_kind() -> str:
    """`EXPORT_FORMATS` in one line, for --format's help and the refusals."""
    parts = [f"{kind}: {', '.join(fmts) or 'none'}" for kind, fmts in EXPORT_FORMATS.items()]
    return "; ".join(parts)
