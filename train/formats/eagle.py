"""EAGLE heads (models/eagle.py) in the layouts serving engines load (the reader is
train/formats/eagle_read.py).

Call the writers through `train.formats.export.export` (temporary directory, read-back
checks, then rename; nothing is left on a refusal). Layouts, written from the anchors' own
files (vLLM `models/llama_eagle3.py`, `models/llama_eagle.py`,
`transformers_utils/configs/speculators/`; SGLang `models/llama_eagle3.py`; speculators
`models/eagle3/`; SpecForge `modeling/draft/llama3_eagle.py`):

  speculators  EAGLE-3 as vLLM and the speculators library load a speculators checkpoint
               (EAGLE-1 was dropped from speculators and vLLM's speculators reader registers
               no `eagle` type: refused).
      config.json  `speculators_model_type: eagle3`, `architectures: [Eagle3Speculator]`,
                   `speculators_config` {algorithm, proposal_methods [{proposal_type: greedy,
                   speculative_tokens = the draft length served per round}],
                   default_proposal_method, verifier {name_or_path = the served target's hub
                   id, architectures}}, `transformer_layer_config` (a Llama config of the one
                   layer, vocab_size = the target's), `draft_vocab_size`,
                   `target_hidden_size`, `norm_before_residual: false` (always written: vLLM's
                   reader defaults a missing one to TRUE), `norm_before_fc`/`fc_norm`/
                   `norm_output: false`, `eagle_aux_hidden_state_layer_ids` (non-default taps).
      model.safetensors  `fc.weight`, `layers.0.{input_layernorm, hidden_norm,
                   self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}
                   .weight`, `norm.weight`, `lm_head.weight`, `embed_tokens.weight` (the
                   target's embedding as the head reads it: the speculators library fills a
                   missing one only where it finds NaN, so without it the head runs on another
                   embedding), `d2t`/`t2d` (reduced vocabulary).
  eagle        EAGLE-3 in the EAGLE repository / SGLang / SpecForge layout: the same weights
               with `midlayer.` for `layers.0.` (SGLang's module is `midlayer`; vLLM renames it)
               and no embedding (SGLang, vLLM, SpecForge and the EAGLE repository take the
               target's), a flat Llama config with `architectures: [LlamaForCausalLMEagle3]`,
               `draft_vocab_size`, `target_hidden_size` and `tie_word_embeddings: false`
               (SGLang would otherwise use the embedding as lm_head).
               EAGLE-1 as vLLM's `llama_eagle.py`: `fc.weight` [H, 2H] over [embedding,
               feature], `layers.0.*` without input_layernorm, no head (the target's is used),
               `architectures: [LlamaForCausalLM]` (vLLM maps it to EagleLlamaForCausalLM).
A frozen head (`train_head=false`) is written as the target's lm_head rows at the draft ids.
EAGLE-3's `fc.weight` is served with the tap scale folded in (fc.weight[:, block i] *
tap_scale[i], exact: powers of two).

Tap order. Engines capture the taps while walking the target's layers (vLLM: `if idx in
aux_hidden_state_layers`, SGLang: `if i in layers_to_capture`) and concatenate them in that
order, so fc's column blocks are read in ASCENDING layer order whatever order the config
lists. draftlab's fc reads the taps in `draft.model.layers` order; the export permutes its
column blocks (after folding the tap scale) into ascending order and writes the ids sorted,
which is exact (a permutation of columns). The reader refuses a config listing them unsorted
(an older export might hold its blocks in the listed order) and
`train.formats.eagle_read.in_tap_order` permutes them back into a draft's own order.

Tap ids. draftlab's `layers` index HF's hidden_states: i = the residual stream entering
decoder layer i. vLLM's `eagle_aux_hidden_state_layer_ids` use the same numbers (it captures
`hidden_states + residual` before layer i); SGLang (and SpecForge) read
`eagle_config.eagle_aux_hidden_state_layer_ids` as j = the output of layer j and capture
before layer j + 1, so j = i - 1. Both default to (2, L//2, L-3) = draftlab's default, which
is then left out; other taps are written both ways in the `eagle` layout (top level for vLLM,
which reads it first, `eagle_config` for SGLang) and top level in `speculators`. Servable
taps: exactly 3, distinct, in 1..L-1 (0 is the bare embedding, which vLLM forms as
`hidden_states + residual` with no residual yet; L and -1 are after the final norm, never
captured).

`train.formats.eagle_read.read_eagle_export(path, target)` reads either layout back into
EagleDraft's state_dict keys (tap_scale = 1: the served fc already holds it; taps ascending)
plus the settings to build the draft.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from models import vocab
from models.eagle import EagleDraft
from models.eagle_init import default_eagle3_layers
from models.target import Target
from models.target_loaders import SMOLLM2_HUB_ID, SMOLLM2_NAME
from train.formats.checks import ExportError, check_finite, check_keys, check_vocab, read_back

WEIGHTS = "model.safetensors"
EMBEDDING = "embed_tokens.weight"  # written in speculators only
SPECULATORS_ARCH = "Eagle3Speculator"
EAGLE3_ARCH = "LlamaForCausalLMEagle3"  # SGLang's / SpecForge's class; vLLM's registry maps it
EAGLE1_ARCH = "LlamaForCausalLM"  # the EAGLE repository's EAGLE-1 configs; vLLM prefixes Eagle
# Config fields each reader needs (vLLM SpeculatorsConfig + update_eagle3; SGLang
# LlamaForCausalLMEagle3 / LlamaModel; vLLM EagleLlamaForCausalLM through its Llama config).
SPECULATORS_CONFIG_FIELDS = (
    "architectures",
    "speculators_model_type",
    "speculators_config",
    "transformer_layer_config",
    "draft_vocab_size",
    "target_hidden_size",
    "norm_before_residual",
    "norm_before_fc",
    "fc_norm",
    "norm_output",
)
SPECULATORS_SUB_FIELDS = ("algorithm", "proposal_methods", "default_proposal_method", "verifier")
LLAMA_CONFIG_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "rope_theta",
    "vocab_size",
    "tie_word_embeddings",
)
EAGLE3_CONFIG_FIELDS = ("architectures", "draft_vocab_size", "target_hidden_size")
EAGLE3_CONFIG_FIELDS += LLAMA_CONFIG_FIELDS
EAGLE1_CONFIG_FIELDS = ("architectures",) + LLAMA_CONFIG_FIELDS
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


# -- the expected layouts (the tests name them too) -------------------------------------------
def layer_keys(style: str, prefix: str = "layers.0.") -> set[str]:
    """The decoder layer's weights: EAGLE-3's first layer (2H q/k/v, input_layernorm on the
    embedding, hidden_norm on the feature) or EAGLE-1's (no input_layernorm)."""
    keys = {f"{prefix}self_attn.{p}.weight" for p in ATTN}
    keys |= {f"{prefix}mlp.{p}.weight" for p in MLP} | {f"{prefix}post_attention_layernorm.weight"}
    if style == "eagle3":
        keys |= {f"{prefix}input_layernorm.weight", f"{prefix}hidden_norm.weight"}
    return keys


def served_keys(
    style: str, reduced_vocab: bool, prefix: str = "layers.0.", embedding: bool = False,
    norms: dict | None = None,
) -> set[str]:  # fmt: skip
    """Weight keys of an export: speculators (prefix `layers.0.`, with the embedding) or eagle
    (`midlayer.` for EAGLE-3; EAGLE-1 keeps `layers.0.`; no embedding); `norms`: the EAGLE-3.1
    flags (`norm_flags`) and the number of taps."""
    keys = {"fc.weight"} | layer_keys(style, prefix)
    if style == "eagle3":
        keys |= {"norm.weight", "lm_head.weight"} | ({"d2t", "t2d"} if reduced_vocab else set())
    if norms and norms.get("norm_before_fc"):
        keys.add("input_norm.weight")
    if norms and norms.get("fc_norm"):
        keys |= {f"fc_norm.{i}.weight" for i in range(norms["taps"])}
    return keys | ({EMBEDDING} if embedding else set())


def norm_flags(draft: EagleDraft) -> dict:
    """EAGLE-3.1's options as speculators' config names them (models/eagle.py)."""
    is3 = draft.style == "eagle3"
    return {
        "norm_before_fc": is3 and draft.input_norm is not None,
        "fc_norm": is3 and draft.fc_norm is not None,
        "norm_output": bool(draft.norm_output),
        "taps": len(draft.hidden_layers),
    }


# -- the served target -------------------------------------------------------------------------
def hub_id(target_cfg: Mapping) -> str | None:
    """The hub id an engine loads the target as, from a run's `target` config (its loader and
    arguments): the embedded SmolLM2's, or `path` when it names a hub id rather than a local
    directory; None when unknown (a local directory, a test model)."""
    loader = str(target_cfg.get("_target_", "")).rsplit(".", 1)[-1]
    if loader == "load_smollm2":
        return SMOLLM2_HUB_ID
    path = str(target_cfg.get("path") or "")
    local = path.startswith((".", "/", "~")) or Path(path).expanduser().exists()
    if loader == "load_hf_target" and path and path.count("/") <= 1 and not local:
        return path
    return None


def target_names(target: Target) -> set[str]:
    """The names a verifier of `target` may be written under (compared case-insensitively by
    their last path component): its hub id where known, its name and HF's _name_or_path."""
    names = {target.name, str(getattr(target.config, "_name_or_path", "") or "")}
    if target.name == SMOLLM2_NAME:
        names.add(SMOLLM2_HUB_ID)
    return {Path(n).name.lower() for n in names if n}


# -- checks before writing ---------------------------------------------------------------------
def check_servable(draft: EagleDraft, target: Target, fmt: str) -> None:
    if not isinstance(draft, EagleDraft):
        raise ExportError(
            f"--format {fmt} exports EAGLE heads (draft=eagle or eagle1); this checkpoint holds "
            f"a {type(draft).__name__}"
        )
    check_vocab(draft.target_vocab_size, target, "the EAGLE head")
    if draft.config.hidden_size != target.hidden_size:
        raise ExportError(
            f"the EAGLE head is {draft.config.hidden_size} wide but the target "
            f"{target.name!r} has hidden size {target.hidden_size}; export against its own target"
        )
    if target.lm_head.bias is not None:
        raise ExportError("the target's lm_head has a bias; EAGLE engines' heads have none")
    flags = [k for k, on in norm_flags(draft).items() if on and k != "taps"]
    if flags and fmt != "speculators":
        raise ExportError(
            f"this EAGLE-3.1 head uses {flags}, which the EAGLE / SGLang / SpecForge layout "
            "(--format eagle) cannot say: SGLang's llama_eagle3 has no such norms. Use "
            "--format speculators (speculators, recent vLLM)"
        )
    if draft.style == "eagle1":
        if fmt == "speculators":
            raise ExportError(
                "speculators has no EAGLE-1 format any more (vLLM's speculators reader knows "
                "eagle3 / peagle / dflash / medusa / dspark); use --format eagle (vLLM's "
                "llama_eagle.py layout)"
            )
        if draft.hidden_layers != (-1,) or draft.reduced_vocab or draft.lm_head is not None:
            raise ExportError(
                "served EAGLE-1 reads the target's last hidden state (layers=[-1]) and drafts "
                "over the full vocabulary with the target's own head; this head has "
                f"layers={list(draft.hidden_layers)}, vocabulary {draft.draft_vocab_size}, "
                f"train_head={draft.lm_head is not None}"
            )
        return
    L, taps = target.num_layers, draft.hidden_layers
    if len(taps) != 3 or len(set(taps)) != 3 or not all(1 <= i <= L - 1 for i in taps):
        raise ExportError(
            f"served EAGLE-3 fuses exactly 3 distinct taps from hidden_states 1..{L - 1} (the "
            f"residual stream entering a layer; -1/{L} are after the final norm, which engines "
            f"never capture); this head reads {list(taps)}. Train with draft.model.layers=null "
            f"(default {list(default_eagle3_layers(L))}) or 3 taps in that range"
        )
    if draft.reduced_vocab:
        try:
            vocab.check(draft)
        except ValueError as err:
            raise ExportError(
                f"a reduced vocabulary without a valid d2t/t2d mapping: {err}"
            ) from err


def tap_order(taps: tuple[int, ...] | list[int]) -> list[int]:
    """Positions of `taps` in ascending layer order: the order engines concatenate them in
    (module docstring), so fc's blocks are written (and read back) in this order."""
    return sorted(range(len(taps)), key=lambda i: taps[i])


def tap_ids(draft: EagleDraft, target: Target) -> list[int] | None:
    """vLLM's `eagle_aux_hidden_state_layer_ids` (= hidden_states indices), ascending; None for
    the engines' default taps."""
    taps = sorted(draft.hidden_layers)
    return None if taps == list(default_eagle3_layers(target.num_layers)) else taps


def embedding_table(target: Target) -> Tensor:
    """[V, H] the embedding the head reads: the target's embedding module applied to every id
    (Gemma's module scales its table, so the bare weight would not be it)."""
    ids = torch.arange(target.vocab_size, device=target.embed_tokens.weight.device)
    return target.embed_tokens(ids).detach()


def served_state(draft: EagleDraft, target: Target) -> dict[str, Tensor]:
    """The served weights under speculators' names, fp32 on the CPU."""
    state = {
        k: v
        for k, v in draft.state_dict().items()
        if k.startswith("layers.0.") or k == "norm.weight"
    }
    fc = draft.fc.weight.detach().float().cpu()  # [H, n*H]
    if draft.style == "eagle3":
        H = fc.shape[0]
        scale = draft.tap_scale.float().cpu().repeat_interleave(H)  # [n*H]
        fc = fc * scale[None, :]  # fold: the served fc reads the raw taps
        order = tap_order(draft.hidden_layers)  # engines concatenate the taps ascending
        fc = fc.view(H, len(order), H)[:, order].reshape(H, len(order) * H)
        if draft.input_norm is not None:  # EAGLE-3.1: its weight in the served tap order too
            weight = draft.input_norm.weight.detach().view(len(order), H)[order]
            state["input_norm.weight"] = weight.reshape(-1)
        if draft.fc_norm is not None:
            for j, i in enumerate(order):
                state[f"fc_norm.{j}.weight"] = draft.fc_norm[i].weight
        head = draft.head_weight(target).detach()  # [V_draft, H]
        state["lm_head.weight"] = head
        if draft.reduced_vocab:
            state["d2t"], state["t2d"] = draft.d2t, draft.t2d
    state["fc.weight"] = fc
    state = {
        k: (
            v.detach().to("cpu", torch.float32, copy=True)
            if v.is_floating_point()
            else v.detach().to("cpu", copy=True)
        )
        for k, v in state.items()
    }
    check_finite(state, "the EAGLE head")
    return state


def llama_config(draft: EagleDraft, target: Target) -> dict:
    """The one layer's Llama config, as each engine builds its draft layer from it."""
    cfg = draft.config
    rope = dict(cfg.rope_parameters)
    theta = rope.pop("rope_theta", 10000.0)
    return {
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": theta,
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def verifier(target: Target, name: str) -> dict:
    """speculators' verifier entry: `name` (the served target's id) and the target's classes."""
    return {
        "name_or_path": name,
        "architectures": list(target.config.architectures or [type(target.model).__name__]),
    }


def speculators_config(algorithm: str, target: Target, name: str, speculative_tokens: int) -> dict:
    """speculators' `speculators_config`: one greedy proposal of `speculative_tokens` drafts
    per round, verified by the target served as `name`."""
    proposal = {"proposal_type": "greedy", "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1, "accept_tolerance": 0.0}  # fmt: skip
    return {"algorithm": algorithm, "proposal_methods": [proposal],
            "default_proposal_method": "greedy", "verifier": verifier(target, name)}  # fmt: skip


# -- writers -----------------------------------------------------------------------------------
def export_speculators(
    draft: EagleDraft,
    target: Target,
    out: Path,
    final: Path,
    verifier_id: str,
    speculative_tokens: int,
) -> None:
    """EAGLE-3 in the speculators format into `out` (the temporary directory of
    `train.formats.export.export`, renamed to `final` after these checks pass).
    `verifier_id`: the id the engine serves the target as; `speculative_tokens`: the draft
    length it proposes per round (vLLM's default num_speculative_tokens)."""
    check_servable(draft, target, "speculators")
    state = served_state(draft, target)
    state[EMBEDDING] = embedding_table(target).to("cpu", torch.float32, copy=True)
    check_finite({EMBEDDING: state[EMBEDDING]}, "the target's embedding")
    config = {
        "architectures": [SPECULATORS_ARCH],
        "speculators_model_type": "eagle3",
        "speculators_config": speculators_config("eagle3", target, verifier_id, speculative_tokens),
        "transformer_layer_config": llama_config(draft, target),
        "draft_vocab_size": draft.draft_vocab_size,
        "target_hidden_size": target.hidden_size,
        "norm_before_residual": False,
        **{k: v for k, v in norm_flags(draft).items() if k != "taps"},  # EAGLE-3.1
        "tie_word_embeddings": False,
    }
    ids = tap_ids(draft, target)
    if ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = ids
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    got, written = read_back(out, WEIGHTS, SPECULATORS_CONFIG_FIELDS)
    missing = [f for f in SPECULATORS_SUB_FIELDS if f not in written["speculators_config"]]
    if missing or written["norm_before_residual"] is not False:
        raise ExportError(f"written speculators_config lacks {missing} (an exporter bug)")
    keys = served_keys("eagle3", draft.reduced_vocab, embedding=True, norms=norm_flags(draft))
    check_keys(got, keys, WEIGHTS)


def export_eagle(draft: EagleDraft, target: Target, out: Path, final: Path) -> None:
    """EAGLE-3 in the EAGLE / SGLang / SpecForge layout, or EAGLE-1 in vLLM's, into `out`."""
    check_servable(draft, target, "eagle")
    state = served_state(draft, target)
    config = llama_config(draft, target)
    if draft.style == "eagle3":
        state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
        config |= {
            "architectures": [EAGLE3_ARCH],
            "draft_vocab_size": draft.draft_vocab_size,
            "target_hidden_size": target.hidden_size,
        }
        ids = tap_ids(draft, target)
        if ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM: hidden_states indices
            config["eagle_config"] = {  # SGLang / SpecForge: output of layer j = i - 1
                "eagle_aux_hidden_state_layer_ids": [i - 1 for i in ids],
                "use_aux_hidden_state": True,
            }
        fields, prefix = EAGLE3_CONFIG_FIELDS, "midlayer."
    else:
        config["architectures"] = [EAGLE1_ARCH]
        fields, prefix = EAGLE1_CONFIG_FIELDS, "layers.0."
    save_file(state, str(out / WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    got, _ = read_back(out, WEIGHTS, fields)
    check_keys(got, served_keys(draft.style, draft.reduced_vocab, prefix), WEIGHTS)
