"""MTP in speculators' `mtp` format (speculators 0.9 `models/mtp/{config,core,
model_definitions}.py`: MTPDraftModel, what vLLM reads with `num_nextn_predict_layers: 1`).

Only the served variant of draftlab's MTP is written (models/mtp.py: `one_layer`, `qk_norm`):
the library holds ONE Qwen3 next-n layer and runs step k+1 on step k's normed output at the
same positions, which is draftlab's depth k+2 of a one-layer draft. Its weights map one to one:

    mtp_layers.0.hidden_layernorm   <- hidden_norm     (the target's last hidden, h^0 or fed)
    mtp_layers.0.token_layernorm    <- embed_norm
    mtp_layers.0.input_proj  [H, 2H] <- proj, column blocks swapped: the library concatenates
                                       [embedding ; hidden], draftlab [hidden ; embedding]
    mtp_layers.0.final_layernorm    <- final_norm      (before the verifier's lm_head)
    mtp_layers.0.{input_layernorm, post_attention_layernorm, self_attn.{q,k,v,o}_proj,
                  self_attn.{q,k}_norm, mlp.{gate,up,down}_proj} <- block.*

The embedding and the head are the verifier's (the library reloads both from it). config.json:
`speculators_model_type: mtp`, `num_nextn_predict_layers: 1`, a qwen3
`transformer_layer_config` at the block's sizes (its num_hidden_layers is the target's: the
library reads it as the layer whose hidden state it takes), and speculative_tokens = the
draft's depths (the steps it was trained for). tests/test_export_mtp.py loads the export with
the real library and compares every step's logits with ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from models.mtp import MTP
from models.target import Target
from train.formats.checks import ExportError, check_finite, check_keys, check_vocab, read_back
from train.formats.dflash import check_verifier_tables, qwen3_layer_config
from train.formats.eagle import WEIGHTS, speculators_config

CONFIG_FIELDS = ("speculators_model_type", "speculators_config", "transformer_layer_config",
                 "num_nextn_predict_layers")  # fmt: skip
LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
         "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "hidden_layernorm", "token_layernorm",
         "input_proj", "final_layernorm")  # fmt: skip
SERVED_KEYS = {f"mtp_layers.0.{name}.weight" for name in LAYER}


def check_servable(draft: MTP, target: Target) -> None:
    if not (draft.one_layer and draft.qk_norm):
        raise ExportError(
            "this MTP draft has a module per depth or no q/k norms, which speculators' mtp "
            "cannot hold (one Qwen3 next-n layer fed its normed output); train the served "
            "variant (draft.model.one_layer=true draft.model.qk_norm=true, "
            "+experiment=mtp_served_kl)"
        )
    check_vocab(draft.vocab_size, target, "the MTP draft")
    check_verifier_tables(target, "the layer's token inputs")


def served_state(draft: MTP) -> dict[str, Tensor]:
    """The one module under speculators' names, float32 on the CPU."""
    module, H = draft.depths[0], draft.block_config.hidden_size
    proj = module.proj.weight.detach()
    state = {
        "hidden_layernorm.weight": module.hidden_norm.weight,
        "token_layernorm.weight": module.embed_norm.weight,
        "input_proj.weight": torch.cat([proj[:, H:], proj[:, :H]], dim=1),
        "final_layernorm.weight": module.final_norm.weight,
        **module.block.state_dict(),
    }
    state = {
        f"mtp_layers.0.{k}": v.detach().to("cpu", torch.float32, copy=True)
        for k, v in state.items()
    }
    check_finite(state, "the MTP draft")
    return state


def export_mtp_speculators(
    draft: MTP, target: Target, out: Path, final: Path, verifier_id: str
) -> None:
    """The served MTP variant in speculators' `mtp` format into `out` (the temporary directory
    of `train.formats.export.export`, renamed to `final` once these checks pass)."""
    check_servable(draft, target)
    config = {
        "architectures": ["MTPDraftModel"],
        "speculators_model_type": "mtp",
        "num_nextn_predict_layers": 1,
        "speculators_config": speculators_config(
            "mtp", target, verifier_id, draft.num_depths
        ),  # the steps it was trained for
        # its num_hidden_layers: the layer whose hidden state the library reads (the last)
        "transformer_layer_config": qwen3_layer_config(
            draft.block_config, target.num_layers, target.vocab_size
        ),
    }
    save_file(served_state(draft), str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    got, _ = read_back(out, WEIGHTS, CONFIG_FIELDS)
    check_keys(got, SERVED_KEYS, WEIGHTS)
