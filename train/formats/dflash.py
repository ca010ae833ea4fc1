"""DFlash in speculators' `dflash` format (speculators 0.9 `models/dflash/{config,core,
model_definitions}.py`, what vLLM's speculators reader and z-lab's layout load).

Only the served variant of draftlab's DFlash is written (models/dflash.py: `mask_token_id`
set, `qk_norm=True`): the library's layer is Qwen3's (per-head RMSNorm of q and k, context
keys included, before rotary), and its mask positions read the verifier's embedding row of
`mask_token_id`, which it reloads from the verifier; a learned mask vector has no place
there. Everything else maps one to one:

    fc.weight            [H, n*H]  column blocks in ascending tap order (engines capture the
                                   taps walking the layers; `aux_hidden_state_layer_ids`
                                   lists them sorted, HF hidden_states indices in 1..L-1)
    hidden_norm, norm    [H]
    layers.i.{input_layernorm, post_attention_layernorm}, self_attn.{q,k,v,o}_proj,
    self_attn.{q,k}_norm [D], mlp.{gate,up,down}_proj
    lm_head.weight, d2t, t2d   a reduced vocabulary only (the target head's rows at the
                               draft ids; d2t = id - index, t2d: in the draft vocabulary);
                               with the full vocabulary the library takes the verifier's head

The embedding is never written (the library always takes the verifier's). config.json:
`speculators_model_type: dflash`, `block_size`, `mask_token_id`, `aux_hidden_state_layer_ids`,
`draft_vocab_size`, `sample_from_anchor: false` (block slot 0 is the anchor, slots 1..B-1
predict: speculative_tokens = B - 1), and a qwen3 `transformer_layer_config` with explicit
head_dim and rope parameters. tests/test_dflash_speculators.py loads the export with the real
library and compares its logits with ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from models.dflash import DFlashDraft
from models.target import Target
from train.formats.checks import ExportError, check_finite, check_keys, check_vocab, read_back
from train.formats.eagle import WEIGHTS, embedding_table, speculators_config

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
MLP = ("gate_proj", "up_proj", "down_proj")
CONFIG_FIELDS = ("speculators_model_type", "speculators_config", "transformer_layer_config",
                 "draft_vocab_size", "block_size", "mask_token_id", "aux_hidden_state_layer_ids",
                 "sample_from_anchor")  # fmt: skip


def served_keys(num_layers: int, reduced_vocab: bool) -> set[str]:
    """The weight keys of a `dflash` export."""
    keys = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(num_layers):
        keys |= {f"layers.{i}.self_attn.{p}.weight" for p in ATTN}
        keys |= {f"layers.{i}.mlp.{p}.weight" for p in MLP}
        keys |= {f"layers.{i}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm")}
    return keys | ({"lm_head.weight", "d2t", "t2d"} if reduced_vocab else set())


def check_servable(draft: DFlashDraft, target: Target) -> None:
    if type(draft) is not DFlashDraft:
        raise ExportError(f"--format speculators writes DFlash drafts here; this is a {type(draft).__name__}")  # fmt: skip
    if draft.mask_token_id is None or not draft.qk_norm:
        raise ExportError(
            "this DFlash draft has a learned mask vector or no q/k norms, which speculators' "
            "dflash cannot hold; train the served variant (draft.model.mask_token_id=auto "
            "draft.model.qk_norm=true, +experiment=dflash_served_kl)"
        )
    check_vocab(draft.target_vocab_size or target.vocab_size, target, "the DFlash draft")
    L = target.num_layers
    bad = [t for t in draft.hidden_layers if not 1 <= t <= L - 1]
    if bad or len(set(draft.hidden_layers)) != len(draft.hidden_layers):
        raise ExportError(
            f"taps {list(draft.hidden_layers)}: an engine captures distinct layers 1..{L - 1} "
            "(0 is the bare embedding, L and -1 are after the final norm)"
        )
    check_verifier_tables(target, "the block's anchor inputs")


def check_verifier_tables(target: Target, inputs: str) -> None:
    """The library reloads the verifier's bare embedding table and a bias-free head: refused
    where the target's module scales its table (Gemma) or its head has a bias."""
    ids = torch.arange(target.vocab_size, device=target.embed_tokens.weight.device)
    if not torch.equal(embedding_table(target), target.embed_tokens.weight[ids].detach()):
        raise ExportError(
            f"the target {target.name!r} scales its embedding in its module; the library "
            f"reads the bare table, so {inputs} would differ"
        )
    if target.lm_head.bias is not None:
        raise ExportError("the target's lm_head has a bias; speculators' head has none")


def served_state(draft: DFlashDraft, target: Target) -> dict[str, Tensor]:
    """The served weights under speculators' names, float32 on the CPU."""
    order = sorted(range(len(draft.hidden_layers)), key=lambda i: draft.hidden_layers[i])
    state = {k: v for k, v in draft.state_dict().items() if k.split(".")[0] in ("hidden_norm", "norm", "layers")}  # fmt: skip
    fc = draft.fc.weight.detach()
    H = fc.shape[0]
    state["fc.weight"] = fc.view(H, len(order), H)[:, order].reshape(H, -1)
    if draft.vocab_ids is not None:
        ids = draft.vocab_ids.cpu()
        state["lm_head.weight"] = target.lm_head.weight.detach()[
            ids.to(target.lm_head.weight.device)
        ]
        state["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
    state = {
        k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype, copy=True)
        for k, v in state.items()
    }
    check_finite(state, "the DFlash draft")
    return state


def qwen3_layer_config(cfg, num_layers: int, vocab_size: int) -> dict:
    """A qwen3 `transformer_layer_config` at the sizes and rope of `cfg` (a draft's layer
    config), as the library builds its layers."""
    return {
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_layers,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": dict(cfg.rope_parameters),
        "vocab_size": vocab_size,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def export_dflash_speculators(
    draft: DFlashDraft, target: Target, out: Path, final: Path, verifier_id: str
) -> None:
    """The served DFlash variant in speculators' `dflash` format into `out` (the temporary
    directory of `train.formats.export.export`, renamed to `final` once these checks pass)."""
    check_servable(draft, target)
    state = served_state(draft, target)
    reduced = draft.vocab_ids is not None
    config = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "speculators_config": speculators_config(
            "dflash", target, verifier_id, draft.block_size - 1
        ),  # slots 1..B-1 of a block
        "transformer_layer_config": qwen3_layer_config(
            draft.config, len(draft.layers), target.vocab_size
        ),
        "draft_vocab_size": len(draft.vocab_ids) if reduced else target.vocab_size,
        "block_size": draft.block_size,
        "aux_hidden_state_layer_ids": sorted(draft.hidden_layers),
        "mask_token_id": int(draft.mask_token_id),
        "sample_from_anchor": False,
    }
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    got, _ = read_back(out, WEIGHTS, CONFIG_FIELDS)
    check_keys(got, served_keys(len(draft.layers), reduced), WEIGHTS)
