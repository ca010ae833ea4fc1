"""Export a trained draft in a layout a serving engine loads (docs/export.md).

    python scripts/export.py runs/distill_kl/seed0/checkpoints/step_00000120 --format hf --out out/draft
    python scripts/export.py CKPT --format medusa --out out/medusa        # FasterDecoding/Medusa
    python scripts/export.py CKPT --format vllm-medusa --out out/medusa   # vLLM's Medusa
    python scripts/export.py CKPT --format speculators --out out/eagle3   # EAGLE-3 for vLLM
    python scripts/export.py CKPT --format eagle --out out/eagle3         # EAGLE / SGLang / SpecForge

Formats, one plain function each (`export_hf`, `export_medusa`, `export_vllm_medusa`; the
EAGLE heads' `export_speculators`, `export_eagle` are in train/formats/eagle.py):
  hf           a distilled draft LM as a `save_pretrained` directory with the target's
               tokenizer (HF `assistant_model`, vLLM `draft_model`, SGLang standalone); for a
               Medusa-2 checkpoint, the merged (LoRA-adapted) target the heads were trained on.
  medusa       the Medusa repository's layout: `config.json` (`medusa_num_heads`,
               `medusa_num_layers`, `base_model_name_or_path`) and `medusa_lm_head.safetensors`
               with `{i}.{j}.linear.weight/bias` (block j of head i) and `{i}.{L}.weight` (head
               i's output layer, [V, H]); the layout of FasterDecoding/Medusa's
               `MedusaModel.medusa_head` (`Sequential(ResBlock * L, Linear(H, V, bias=False))`).
  vllm-medusa  vLLM's Medusa layout (vllm/model_executor/models/medusa.py,
               vllm/transformers_utils/configs/medusa.py): `config.json` with `model_type:
               medusa`, `architectures: ["MedusaModel"]`, `num_heads`, `num_hidden_layers`,
               `hidden_size`, `vocab_size`, `truncated_vocab_size`, `medusa_fc_bias: true`, and
               `model.safetensors` with `blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight`.
Both Medusa formats hold one output layer per head: with `head_init=shared` it is the
target's own lm_head, written once per head (neither engine shares one head across heads in
every version). A Medusa-2 checkpoint also gets `merged_target/` (an `hf` directory of the
adapted target) and `base_model_name_or_path` points there: its heads read the adapted model.
  speculators  an EAGLE-3 head as vLLM and the speculators library load it
               (`speculators_model_type: eagle3`), naming the served target (`verifier`) and
               the draft length per round (`speculative_tokens`).
  eagle        an EAGLE-3 head in the EAGLE / SGLang / SpecForge layout (`midlayer.*`,
               `LlamaForCausalLMEagle3`), or an EAGLE-1 head as vLLM's `llama_eagle.py`.
Which kind is written as which format: train/formats/kinds.py (`EXPORT_FORMATS`). Refused,
nothing written: a kind / format pair outside that table, MTP / DFlash / Domino drafts (no
format serves them: `REFUSED` there says why), a draft that does not fit the format (EAGLE:
see train/formats/eagle.py), a vocabulary that is not the target's, NaN/Inf weights, a
shared target head with a bias (Medusa engines' output layers have none), Medusa-repository
heads with more than one block per head (that repository repeats ONE
block L times, `[ResBlock(H)] * L`, so independent blocks cannot be expressed), and an
existing non-empty output directory unless `overwrite`. Every export is written into a
temporary directory beside `out`, read back and checked for every key and config field its
format requires, then renamed into place.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import hydra.utils
import torch
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import save_file
from torch import Tensor, nn

from models.draft_lm import DraftLM
from models.medusa import MedusaHeads
from models.target import Target
from train.core.checkpoint import load_draft
from train.disk import drop_dead_writers
from train.formats.checks import ExportError, check_finite, check_keys, check_vocab, read_back
from train.formats.dflash import export_dflash_speculators
from train.formats.eagle import export_eagle, export_speculators
from train.formats.kinds import check_kind_format, module_export_kind
from train.formats.mtp import export_mtp_speculators

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
VLLM_WEIGHTS = "model.safetensors"
MERGED_TARGET = "merged_target"
# Config fields each format's loader reads (Medusa: MedusaConfig in medusa/model/medusa_model.py;
# vLLM: MedusaConfig in vllm/transformers_utils/configs/medusa.py and the Medusa model).
MEDUSA_CONFIG_FIELDS = ("medusa_num_heads", "medusa_num_layers", "base_model_name_or_path")
VLLM_MEDUSA_CONFIG_FIELDS = (
    "model_type",
    "architectures",
    "num_heads",
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "truncated_vocab_size",
    "medusa_fc_bias",
)
HF_CONFIG_FIELDS = ("architectures", "model_type", "vocab_size", "hidden_size")


# -- the expected layouts (the tests name them too) ------------------------------------------
def medusa_keys(num_heads: int, num_layers: int) -> set[str]:
    """Keys of FasterDecoding/Medusa's `medusa_head` state dict."""
    keys = {f"{i}.{num_layers}.weight" for i in range(num_heads)}
    for i in range(num_heads):
        for j in range(num_layers):
            keys |= {f"{i}.{j}.linear.weight", f"{i}.{j}.linear.bias"}
    return keys


def vllm_medusa_keys(num_heads: int, num_layers: int) -> set[str]:
    """Parameter names of vLLM's `Medusa` module with `medusa_fc_bias: true`."""
    keys = {f"lm_heads.{i}.weight" for i in range(num_heads)}
    for i in range(num_heads):
        for j in range(num_layers):
            keys |= {f"blocks.{i}.layers.{j}.weight", f"blocks.{i}.layers.{j}.bias"}
    return keys


# -- hf ----------------------------------------------------------------------------------------
def hf_model(draft: nn.Module, target: Target) -> nn.Module:
    """The plain HF causal LM a draft exports as: a draft LM (LoRA merged), or Medusa-2's
    merged target."""
    if isinstance(draft, DraftLM):
        model = draft.causal_lm()
        if model is not draft.model:  # peft-wrapped: merge the adapters into a copy
            model = copy.deepcopy(draft.model).merge_and_unload()
        return model
    if isinstance(draft, MedusaHeads) and draft.adapted is not None:
        return draft.merged_causal_lm(target)
    raise ExportError(
        f"--format hf exports a distilled draft LM (draft=draft_lm) or Medusa-2's merged "
        f"target (draft=medusa2); this checkpoint holds a {type(draft).__name__}. "
        "Use --format medusa / vllm-medusa for Medusa heads."
    )


def export_hf(draft: nn.Module, target: Target, out: Path) -> None:
    model = hf_model(draft, target)
    check_vocab(model.get_output_embeddings().weight.shape[0], target, "the draft LM")
    state = model.state_dict()
    check_finite(state, "the draft LM")
    model.save_pretrained(out, safe_serialization=True)
    target.tokenizer.save_pretrained(out)
    check_hf_dir(out, model, target)


def check_hf_dir(out: Path, model: nn.Module, target: Target) -> None:
    got, config = read_back(out, "model.safetensors", HF_CONFIG_FIELDS)
    if config["vocab_size"] != target.vocab_size:
        raise ExportError(f"written vocab_size {config['vocab_size']} != {target.vocab_size}")
    expected = set(model.state_dict())
    if config.get("tie_word_embeddings"):  # save_pretrained stores a tied head once
        expected -= {"lm_head.weight"}
    check_keys(got, expected, "model.safetensors")
    if not (out / "tokenizer_config.json").is_file():
        raise ExportError("the target's tokenizer was not written (an exporter bug)")


# -- Medusa ------------------------------------------------------------------------------------
def medusa_tensors(heads: MedusaHeads, target: Target) -> list[tuple[list[Tensor], list[Tensor]]]:
    """Per head: ([W_0 [H, H], b_0 [H], W_1, b_1, ...] of its blocks, [output weight [V, H]]),
    fp32 on the CPU, after the checks both Medusa formats share."""
    if not isinstance(heads, MedusaHeads):
        raise ExportError(
            f"--format medusa / vllm-medusa exports Medusa heads (draft=medusa or medusa2); "
            f"this checkpoint holds a {type(heads).__name__}"
        )
    check_vocab(heads.vocab_size, target, "the Medusa heads")
    if heads.out is None and target.lm_head.bias is not None:
        raise ExportError(
            "the heads share the target's lm_head, which has a bias; Medusa engines' "
            "output layers have none, so the exported heads would not be the trained ones"
        )
    result = []
    for i in range(heads.num_heads):
        blocks = [t for block in heads.blocks[i] for t in (block.linear.weight, block.linear.bias)]
        out_w = heads.out[i].weight if heads.out is not None else target.lm_head.weight
        # A copy per head: safetensors stores no shared storage, and each engine wants its own.
        copies = [t.detach().to("cpu", torch.float32, copy=True) for t in (*blocks, out_w)]
        result.append((copies[:-1], copies[-1:]))
    check_finite(
        {f"head{i}.{n}": t for i, (b, o) in enumerate(result) for n, t in enumerate(b + o)},
        "the Medusa heads",
    )
    return result


def base_model_path(heads: MedusaHeads, target: Target, out_final: Path, tmp: Path) -> str:
    """Where the engine loads the target from; Medusa-2 writes its merged target beside."""
    if heads.adapted is not None:
        export_hf(heads, target, tmp / MERGED_TARGET)
        return str((out_final / MERGED_TARGET).resolve())
    return str(getattr(target.model.config, "_name_or_path", "") or target.name)


def export_medusa(heads: MedusaHeads, target: Target, out: Path, final: Path) -> None:
    tensors = medusa_tensors(heads, target)
    num_layers = len(heads.blocks[0])
    if num_layers > 1:
        for i, (blocks, _) in enumerate(tensors):
            if any(not torch.equal(blocks[2 * j], blocks[0]) for j in range(1, num_layers)):
                raise ExportError(
                    f"head {i} has {num_layers} independent residual blocks, but the Medusa "
                    "repository builds each head from ONE block repeated ([ResBlock(H)] * L), "
                    "so it cannot load them; use --format vllm-medusa (independent blocks)"
                )
    state = {}
    for i, (blocks, (out_w,)) in enumerate(tensors):
        for j in range(num_layers):
            state[f"{i}.{j}.linear.weight"] = blocks[2 * j]
            state[f"{i}.{j}.linear.bias"] = blocks[2 * j + 1]
        state[f"{i}.{num_layers}.weight"] = out_w
    config = {
        "medusa_num_heads": heads.num_heads,
        "medusa_num_layers": num_layers,
        "base_model_name_or_path": base_model_path(heads, target, final, out),
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
    }
    save_file(state, str(out / MEDUSA_WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    target.tokenizer.save_pretrained(out)  # the Medusa repo's training script saves it too
    got, _ = read_back(out, MEDUSA_WEIGHTS, MEDUSA_CONFIG_FIELDS)
    check_keys(got, medusa_keys(heads.num_heads, num_layers), MEDUSA_WEIGHTS)


def export_vllm_medusa(heads: MedusaHeads, target: Target, out: Path, final: Path) -> None:
    tensors = medusa_tensors(heads, target)
    num_layers = len(heads.blocks[0])
    state = {}
    for i, (blocks, (out_w,)) in enumerate(tensors):
        for j in range(num_layers):
            state[f"blocks.{i}.layers.{j}.weight"] = blocks[2 * j]
            state[f"blocks.{i}.layers.{j}.bias"] = blocks[2 * j + 1]
        state[f"lm_heads.{i}.weight"] = out_w
    config = {
        "model_type": "medusa",
        "architectures": ["MedusaModel"],
        "num_heads": heads.num_heads,
        "num_hidden_layers": num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "truncated_vocab_size": target.vocab_size,  # full vocabulary: no token_map
        "medusa_fc_bias": True,  # vLLM's blocks have no bias unless this is set
        "base_model_name_or_path": base_model_path(heads, target, final, out),
    }
    save_file(state, str(out / VLLM_WEIGHTS))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    got, _ = read_back(out, VLLM_WEIGHTS, VLLM_MEDUSA_CONFIG_FIELDS)
    check_keys(got, vllm_medusa_keys(heads.num_heads, num_layers), VLLM_WEIGHTS)


def refuse(fmt: str, draft: nn.Module) -> None:
    """Refuse a format the draft's kind is not written as (train/formats/kinds.py)."""
    check_kind_format(module_export_kind(draft), fmt)


def check_served_settings(fmt: str, verifier: str | None, speculative_tokens: int | None) -> None:
    """speculators needs both (see `export`); the other formats write neither."""
    if fmt != "speculators":
        given = [n for n, v in (("--verifier", verifier), ("--speculative-tokens",
                                                             speculative_tokens)) if v is not None]  # fmt: skip
        if given:
            them = "them" if len(given) > 1 else "it"
            raise ExportError(f"{' and '.join(given)}: only --format speculators writes {them}")
        return
    if not verifier or not verifier.strip():
        raise ExportError(
            "--format speculators names the served target (verifier.name_or_path) and the "
            "target's hub id is not known here: pass --verifier ID, the hub id or path the "
            "engine loads the target from (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)"
        )
    k = speculative_tokens
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ExportError(
            f"--format speculators writes the draft length per round (speculative_tokens, "
            f"vLLM's default num_speculative_tokens); got {speculative_tokens!r}: pass "
            "--speculative-tokens K >= 1 (scripts/export.py defaults it to the run's decode.k)"
        )


def check_out_dir(out: Path, overwrite: bool) -> None:
    """--out can take the export: not a non-empty directory (without --overwrite) or a file,
    and under a directory (scripts/export.py checks it before the target loads)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise FileExistsError(
            f"{out} exists and is not empty; pass --overwrite to replace it, or another --out"
        )
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file; give a directory")
    above = next(p for p in out.parents if p.exists())  # the root always exists
    if not above.is_dir():
        raise FileExistsError(f"--out {out}: {above} is a file, not a directory")


# -- the entry point ---------------------------------------------------------------------------
IDENTITY_FILE = "draftlab_identity.json"  # an export's record of what it was trained against


def export(
    draft: nn.Module,
    target: Target,
    fmt: str,
    out: str | Path,
    overwrite: bool = False,
    verifier: str | None = None,
    speculative_tokens: int | None = None,
    identity: dict | None = None,
) -> Path:
    """Write `draft` (for `target`) in format `fmt` to `out` atomically; returns `out`.
    `speculators` also needs `verifier` (the id the engine serves the target as; the
    exporting machine's path would mean nothing where it is served) and `speculative_tokens`
    (the draft length per round the engine proposes; scripts/export.py takes both from the
    checkpoint's config unless given); the other formats take neither. `identity`: the
    checkpoint's identity record (train/run/identity.py): an export for another target than the
    one trained against (its head rows and embedding would be another model's) is refused,
    and the record is written beside the weights as IDENTITY_FILE, so an import
    (draft.init_from) compares the target it loads into. A target held in another dtype than
    it is stored in is refused: its embedding and head would be written rounded (load it with
    dtype "stored", as `load_run_draft` does)."""
    refuse(fmt, draft)
    if target.stored_dtype not in (None, target.dtype):
        raise ExportError(
            f"the target {target.name!r} is held in {target.dtype} but stored in "
            f"{target.stored_dtype}: the export would write its tensors rounded to "
            f"{target.dtype}, which is not the target an engine serves (nor what a "
            f"{target.stored_dtype} run imports). Load it with dtype=stored "
            "(scripts/export.py does)."
        )
    check_served_settings(fmt, verifier, speculative_tokens)
    trained = (identity or {}).get("target")
    if trained is not None and trained["weights"] != target.fingerprint:
        raise ExportError(
            f"the target loaded for the export ({target.name}, weights {target.fingerprint}) "
            f"is not the one this draft was trained against ({trained['name']}, weights "
            f"{trained['weights']}): the export would take its head rows and embedding from "
            "another model. Point the checkpoint's config.yaml target at the trained one."
        )
    writers: dict[str, Callable[[Path, Path], None]] = {
        "hf": lambda tmp, final: export_hf(draft, target, tmp),
        "medusa": lambda tmp, final: export_medusa(draft, target, tmp, final),
        "vllm-medusa": lambda tmp, final: export_vllm_medusa(draft, target, tmp, final),
        "eagle": lambda tmp, final: export_eagle(draft, target, tmp, final),
        "speculators": lambda tmp, final: {
            "dflash_served": export_dflash_speculators,
            "mtp_served": export_mtp_speculators,
        }.get(
            module_export_kind(draft), lambda *args: export_speculators(*args, speculative_tokens)
        )(draft, target, tmp, final, verifier),
    }
    out = Path(out)
    check_out_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".tmp-export-{out.name}-{socket.gethostname()}-"
    drop_dead_writers(out.parent, prefix)  # what killed exports of `out` on this host left
    tmp = out.parent / f"{prefix}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with torch.no_grad():
            writers[fmt](tmp, out)
        if identity is not None:  # which target and draft settings these weights belong to
            (tmp / IDENTITY_FILE).write_text(json.dumps(identity, indent=2))
        if out.exists():  # --overwrite (or an empty dir): swap, never half-replace
            old = out.parent / f".tmp-old-{out.name}-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def checkpoint_config(ckpt: str | Path) -> DictConfig:
    """The resolved config a checkpoint `<run_dir>/checkpoints/step_N` was trained with: its own
    config.yaml, else its run directory's. Runs written before the target loaders moved to
    models/ name them `train.target.*`; they are read as `models.target_loaders.*`."""
    ckpt = Path(ckpt)
    for config in (ckpt / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if config.is_file():
            break
    else:
        raise FileNotFoundError(
            f"no config.yaml in {ckpt} nor in its run directory {ckpt.parent.parent}: give a "
            "checkpoint written by a training run (<run_dir>/checkpoints/step_N, kept inside "
            "its run directory), whose config names the target and the data"
        )
    cfg = OmegaConf.load(config)
    loader = str(cfg.target.get("_target_", ""))
    if loader.startswith("train.target."):
        cfg.target._target_ = "models.target_loaders." + loader.removeprefix("train.target.")
    return cfg


def load_target(cfg: DictConfig) -> Target:
    """The target `cfg.target` names (a loader and its arguments)."""
    node = OmegaConf.to_container(cfg.target, resolve=True)
    return hydra.utils.get_method(node.pop("_target_"))(**node)


def load_run_draft(ckpt: str | Path, device: str = "cpu") -> tuple[nn.Module, Target]:
    """A checkpoint `<run_dir>/checkpoints/step_N` -> (draft, target from the run's config,
    loaded in the dtype its weights are stored in, whatever the run held it in: what an
    export writes of it, e.g. a speculators head's embedding, is then the target's own)."""
    ckpt = Path(ckpt)
    if not (ckpt / "draft.yaml").is_file():
        raise FileNotFoundError(
            f"{ckpt} is not a draftlab checkpoint (no draft.yaml); give "
            "<run_dir>/checkpoints/step_N"
        )
    cfg = checkpoint_config(ckpt)
    cfg.target.device = device
    if "dtype" in inspect.signature(hydra.utils.get_method(cfg.target._target_)).parameters:
        cfg.target.dtype = "stored"
    target = load_target(cfg)
    return load_draft(ckpt, target).eval(), target
