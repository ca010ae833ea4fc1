"""Read an EAGLE head exported in the `speculators` or `eagle` layout (train/formats/eagle.py
describes both) back into `models.eagle.EagleDraft`'s state_dict keys, with the settings to
build that draft: `read_eagle_export(path, target)`, what `draft.init_from=DIR`
(train/run/init_from.py) calls for those formats. The served fc already holds the tap
scale, so the state read back has tap_scale = 1; its blocks are in ascending tap order (the
engines'), and `in_tap_order` permutes them into a draft's own order of the same taps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from models.eagle_init import default_eagle3_layers
from models.target import Target
from train.formats.eagle import EMBEDDING, WEIGHTS, embedding_table, served_keys, target_names


def read_eagle_export(path: Path, target: Target) -> tuple[dict[str, Tensor], dict]:
    """A `speculators` or `eagle` export (ours or another trainer's in the same layout) ->
    (state_dict keyed exactly like EagleDraft.state_dict(), settings) where settings =
    {style, layers (hidden_states indices), draft_vocab_size, intermediate_size, train_head}
    for `models.eagle.from_target`. Raises ValueError on a wrong target (hidden size,
    vocabulary, verifier), a variant this head cannot express, or unknown / missing keys."""
    path = Path(path)
    if not (path / "config.json").is_file() or not (path / WEIGHTS).is_file():
        raise ValueError(f"{path} is not an EAGLE export: need config.json and {WEIGHTS} there")
    config = json.loads((path / "config.json").read_text())
    weights = load_file(str(path / WEIGHTS))
    what = f"EAGLE export {path}"
    if "speculators_model_type" in config:
        style, layer = _speculators_settings(config, target, what)
        prefix = "layers.0."
    else:
        arch = (config.get("architectures") or [""])[0]
        style = "eagle3" if "Eagle3" in arch else "eagle1"
        layer, prefix = config, "midlayer." if style == "eagle3" else "layers.0."
    if config.get("norm_before_residual"):
        raise ValueError(
            f"{what} uses norm_before_residual=true; draftlab's head has the raw fc output "
            "as the first layer's residual"
        )
    # EAGLE-3.1 (models/eagle.py): the draft it loads into must be built with the same options
    norms = {k: bool(config.get(k)) for k in ("norm_before_fc", "fc_norm", "norm_output")}
    if config.get("target_hidden_size") not in (None, target.hidden_size):
        raise ValueError(
            f"{what} reads {config['target_hidden_size']}-wide target features, the target "
            f"{target.name!r} has {target.hidden_size}; load it with the target it was trained for"
        )
    H, L = target.hidden_size, target.num_layers
    _check_layer_config(layer, target, what)  # sizes first: the clearer message
    if "speculators_model_type" in config:
        _check_verifier(config, target, what)
    taps = _tap_layers(config, style, L, what)
    draft_vocab = int(config.get("draft_vocab_size") or target.vocab_size)
    reduced = draft_vocab < target.vocab_size
    if EMBEDDING in weights:  # ours in speculators; other trainers' in either layout
        _check_embedding(weights.pop(EMBEDDING), target, what)  # the head reads the target's
    expected = served_keys(style, reduced, prefix, norms=norms | {"taps": len(taps)})
    unknown, missing = sorted(set(weights) - expected), sorted(expected - set(weights))
    if unknown or missing:
        raise ValueError(
            f"{what}: unknown keys {unknown[:5]}, missing keys {missing[:5]} for a {style} head "
            f"({'reduced' if reduced else 'full'} vocabulary); draftlab reads the speculators and "
            "eagle layouts of train/formats/eagle.py"
        )
    state = {k.replace(prefix, "layers.0.", 1): v for k, v in weights.items()}
    n_in = state["fc.weight"].shape[1]
    if state["fc.weight"].shape[0] != H or n_in != (3 * H if style == "eagle3" else 2 * H):
        raise ValueError(
            f"{what}: fc.weight is {tuple(state['fc.weight'].shape)}, expected "
            f"({H}, {3 * H if style == 'eagle3' else 2 * H}) for the target's hidden size {H}"
        )
    train_head = False
    if style == "eagle3":
        state["tap_scale"] = torch.ones(len(taps))  # folded into the served fc
        head = state.pop("lm_head.weight")  # [V_draft, H]
        if reduced:
            state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
            ids = torch.arange(draft_vocab) + state["d2t"]
            if ids.min() < 0 or ids.max() >= target.vocab_size:
                raise ValueError(f"{what}: d2t maps outside the target's vocabulary")
        else:
            ids = torch.arange(draft_vocab)
        if head.shape != (draft_vocab, H):
            raise ValueError(
                f"{what}: lm_head is {tuple(head.shape)}, expected ({draft_vocab}, {H})"
            )
        # The target's own head rows (compared in the dtype the target is held in, as the
        # embedding is) mean an untrained head; anything else is the draft's.
        rows = target.lm_head.weight.detach().cpu()[ids]
        train_head = not torch.equal(head.to(rows.dtype), rows)
        if train_head:
            state["lm_head.weight"] = head
    settings = {
        "style": style,
        "layers": taps,
        "draft_vocab_size": draft_vocab,
        "intermediate_size": int(layer["intermediate_size"]),
        "train_head": train_head,
        **{k: v for k, v in norms.items() if v},  # EAGLE-3.1's options, where set
    }
    return state, settings


def _speculators_settings(config: dict, target: Target, what: str) -> tuple[str, dict]:
    if config["speculators_model_type"] != "eagle3":
        raise ValueError(
            f"{what}: speculators_model_type {config['speculators_model_type']!r}; draftlab "
            "reads eagle3 speculators checkpoints"
        )
    if "norm_before_residual" not in config:
        raise ValueError(
            f"{what} does not say norm_before_residual (vLLM assumes true, speculators false); "
            "refusing to guess the residual of the first layer"
        )
    return "eagle3", config.get("transformer_layer_config") or {}


def in_tap_order(
    state: dict[str, Tensor], settings: dict, layers: tuple[int, ...] | list[int]
) -> tuple[dict[str, Tensor], dict]:
    """The state read back (fc blocks and tap_scale in ascending tap order) in the order of
    `layers` (a draft's own `hidden_layers`) when those are the same distinct taps in another
    order; otherwise unchanged (a different set is the caller's refusal to make)."""
    taps, layers = list(settings.get("layers") or []), list(layers)
    if taps == layers or sorted(layers) != taps or len(set(taps)) != len(taps):
        return state, settings
    blocks = [taps.index(layer) for layer in layers]  # the draft's tap i is served block j
    fc = state["fc.weight"]
    H = fc.shape[0]
    state = dict(state)
    state["fc.weight"] = fc.view(H, len(taps), H)[:, blocks].reshape(H, len(taps) * H)
    if "tap_scale" in state:
        state["tap_scale"] = state["tap_scale"][blocks]
    if "input_norm.weight" in state:  # EAGLE-3.1: one weight per tap block, and one norm per tap
        weight = state["input_norm.weight"].view(len(taps), H)[blocks]
        state["input_norm.weight"] = weight.reshape(-1)
    if "fc_norm.0.weight" in state:
        norms = [state[f"fc_norm.{j}.weight"] for j in range(len(taps))]
        state |= {f"fc_norm.{i}.weight": norms[j] for i, j in enumerate(blocks)}
    return state, settings | {"layers": layers}


def _check_embedding(weight: Tensor, target: Target, what: str) -> None:
    """The export's embedding (the target's as stored) against the target's, compared in the
    dtype the target is held in: a float32 export matches a bfloat16 copy of its target."""
    table = embedding_table(target).cpu()
    same_shape = weight.shape == table.shape
    if same_shape and torch.equal(weight.to(table.dtype), table):
        return
    bf16 = torch.bfloat16
    if same_shape and torch.equal(weight, weight.to(bf16).to(weight.dtype)) and torch.equal(weight.to(bf16), table.to(bf16)):  # fmt: skip
        raise ValueError(
            f"{what} holds the target {target.name!r}'s embedding rounded to bfloat16 (an "
            "export of a run that held its target in bfloat16, written before exports took "
            "the stored weights, 2026-12-05): re-export its checkpoint with scripts/export.py"
        )
    raise ValueError(
        f"{what} holds an {EMBEDDING} {tuple(weight.shape)} that is not the target "
        f"{target.name!r}'s embedding; draftlab's EAGLE head reads the target's own, so this "
        "head (trained on another embedding, or for another target) cannot be imported"
    )


def _check_verifier(config: dict, target: Target, what: str) -> None:
    got = config.get("speculators_config", {}).get("verifier", {})
    name = Path(str(got.get("name_or_path", ""))).name.lower()
    archs = list(target.config.architectures or [type(target.model).__name__])
    if name not in target_names(target) or list(got.get("architectures") or []) != archs:
        raise ValueError(
            f"{what} was trained for verifier {got.get('name_or_path')!r} "
            f"({got.get('architectures')}), not the target {target.name!r} ({archs}); load it "
            "with the target it was trained for"
        )


def _check_layer_config(layer: dict, target: Target, what: str) -> None:
    """The exported layer must be the one from_target builds for `target`."""
    cfg = target.config
    want = {
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": getattr(cfg, "head_dim", None) or target.hidden_size // cfg.num_attention_heads,
    }
    bad = {k: (layer.get(k), v) for k, v in want.items() if layer.get(k, v) != v}
    if layer.get("attention_bias") or layer.get("mlp_bias"):
        bad["attention_bias/mlp_bias"] = (True, False)
    if bad:
        raise ValueError(
            f"{what} does not fit the target {target.name!r}: (exported, target) {bad}; "
            "load it with the target it was exported for"
        )
    theta = target.rope_kwargs().get("rope_parameters", {}).get("rope_theta")
    if theta is not None and layer.get("rope_theta", theta) != theta:
        raise ValueError(
            f"{what} has rope_theta {layer['rope_theta']}, the target {theta}: draftlab copies "
            "rope settings from the target"
        )


def _tap_layers(config: dict, style: str, num_layers: int, what: str) -> list[int]:
    """hidden_states indices from the config (vLLM's top-level ids, or SGLang's eagle_config
    ids + 1), the engines' default when neither is there."""
    if style == "eagle1":
        return [-1]
    vllm = config.get("eagle_aux_hidden_state_layer_ids")
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    sglang = [j + 1 for j in nested] if nested else None
    if vllm and sglang and list(vllm) != sglang:
        raise ValueError(
            f"{what}: eagle_aux_hidden_state_layer_ids {vllm} (vLLM: hidden_states indices) and "
            f"eagle_config's {nested} (SGLang: layer outputs, +1) name different taps"
        )
    taps = list(vllm or sglang or default_eagle3_layers(num_layers))
    if len(set(taps)) != 3 or not all(1 <= i <= num_layers - 1 for i in taps):
        raise ValueError(
            f"{what}: taps {taps} are not 3 distinct hidden_states indices in "
            f"1..{num_layers - 1} of the target"
        )
    if taps != sorted(taps):
        raise ValueError(
            f"{what} lists its taps {taps} out of ascending order: engines concatenate them "
            f"ascending ({sorted(taps)}), but an export written before they were sorted holds "
            "its fc blocks in the listed order, so which one this is cannot be told; "
            "re-export it from its checkpoint"
        )
    return [int(i) for i in taps]
