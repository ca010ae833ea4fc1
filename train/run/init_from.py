"""Load a draft saved in any supported format into the draft built from the config
(`draft.init_from=DIR`): to evaluate an imported draft (scripts/evaluate.py --init-from) or to
warm-start training from it (train/loop.py; a resumed run keeps its own checkpoint instead).

Formats (`detect_format`; the writers are train/formats/export.py and train/formats/eagle.py):
  ours         a draftlab checkpoint `<run_dir>/checkpoints/step_N`, or a run directory (its
               newest checkpoint): draft.safetensors is the draft's own state_dict.
  hf           a `save_pretrained` causal LM (config.json + model.safetensors) -> draft=draft_lm.
  medusa       FasterDecoding/Medusa: config.json with medusa_num_heads / medusa_num_layers,
               medusa_lm_head.safetensors (or .pt): `{i}.{j}.linear.weight/bias`, `{i}.{L}.weight`.
  vllm-medusa  vLLM: config.json `model_type: medusa`, model.safetensors with
               `blocks.{i}.layers.{j}.weight[/bias]` (no bias unless `medusa_fc_bias`: a zero
               bias) and `lm_heads.{i}.weight` (only `lm_heads.0` with `original_lm_head`).
  speculators  config.json with `speculators_model_type` -> draft=eagle.
  eagle        the EAGLE-3 repository: an Eagle3 class in config.json `architectures`, or
               `midlayer.*` weights -> draft=eagle.
Medusa output layers: the Medusa repository trains one copy of the target's lm_head per head.
Heads with `head_init=copy` load them as they are; `head_init=shared` heads only when each one
IS the target's lm_head (else the error says to set head_init=copy).

Settings no tensor shows: a draftlab checkpoint's identity.json (train/run/identity.py) is compared
with the draft the config builds (draft kind, every draft.model setting but the fresh-start
ones, the taps resolved) and with the target's weights, and every difference is refused in
one message that says which settings are free to change; the EAGLE exports' recorded taps and
style are compared likewise.

Strict: every tensor of the draft's state_dict must come from the files and none may be left
over; checked before the draft is touched, then loaded into a copy first, so a failed import
leaves the draft as it was. Errors say what did not fit and which setting to change.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor, nn

from models.draft_lm import DraftLM
from models.eagle import EagleDraft
from models.medusa import MedusaHeads
from models.target import Target
from train.core.checkpoint import PREFIX, latest_checkpoint, load_tensors
from train.formats.eagle import norm_flags
from train.formats.eagle_read import in_tap_order, read_eagle_export
from train.formats.export import (
    IDENTITY_FILE,
    MEDUSA_WEIGHTS,
    VLLM_WEIGHTS,
    medusa_keys,
    vllm_medusa_keys,
)
from train.run.identity import FREE_ON_INIT, init_differences, refusal, target_differences

FORMATS = ("ours", "hf", "medusa", "vllm-medusa", "speculators", "eagle")
LOOKED_FOR = (
    "draft.yaml + draft.safetensors (a draftlab checkpoint), config.yaml + checkpoints/ (a run "
    "directory), or config.json with speculators_model_type (speculators), medusa_num_heads "
    "(medusa), model_type 'medusa' (vllm-medusa), an Eagle3 architecture or midlayer.* weights "
    "or fc.weight (eagle), architectures + model.safetensors (hf)"
)
# The draft.model setting that decides a tensor's presence, then its shape (first match).
COUNT_HINTS = {"adapted.": "medusa2 / lora_rank", "lora_": "lora_rank", "out.": "head_init",
               "d2t": "vocab_size", "t2d": "vocab_size", "vocab_ids": "vocab_size",
               "blocks.": "num_heads / num_layers", "depths.": "num_depths",
               "lm_head": "train_head", "layers.": "num_layers"}  # fmt: skip
SHAPE_HINTS = {"lora_": "lora_rank", "mlp.": "intermediate_size", "d2t": "vocab_size",
               "self_attn.": "num_heads / num_kv_heads", "t2d": "vocab_size",
               "vocab_ids": "vocab_size", "correction.2": "vocab_size",
               "lm_head": "vocab_size"}  # fmt: skip
# HF config fields that change a draft LM's maths without changing any tensor's shape.
HF_MATHS = ("model_type", "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
            "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")  # fmt: skip


NORM_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # EAGLE-3.1 (models/eagle.py)


class InitError(ValueError):
    """The files cannot initialise the draft built from the config; the draft is unchanged."""


def _json(file: Path) -> dict:
    return json.loads(file.read_text())


def _safetensors(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():  # a sharded save_pretrained
        return [path / f for f in sorted(set(_json(index)["weight_map"].values()))]
    return sorted(path.glob("*.safetensors"))


def detect_format(path: str | Path) -> str:
    """Which of FORMATS the directory `path` holds."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"draft.init_from={str(path)!r} is not a directory; {LOOKED_FOR}")
    if (path / "draft.yaml").is_file() and (path / "draft.safetensors").is_file():
        return "ours"
    if (path / "config.yaml").is_file() and (path / "checkpoints").is_dir():
        return "ours"
    config = _json(path / "config.json") if (path / "config.json").is_file() else {}
    archs = config.get("architectures") or []
    if "speculators_model_type" in config:
        return "speculators"
    if "medusa_num_heads" in config:
        return "medusa"
    if config.get("model_type") == "medusa" or "MedusaModel" in archs:
        return "vllm-medusa"
    if any("eagle3" in a.lower() for a in archs):
        return "eagle"
    for file in _safetensors(path)[:1]:
        with safe_open(str(file), framework="pt") as f:
            # EAGLE-3 (EAGLE repository, SGLang) or EAGLE-1 (vLLM's llama_eagle.py: fc over
            # [embedding, feature]); a plain HF LM's keys start with model. / lm_head.
            if any(k.startswith("midlayer.") or k == "fc.weight" for k in f.keys()):  # noqa: SIM118
                return "eagle"
    if archs and _safetensors(path):
        return "hf"
    raise InitError(f"{path} holds no draft format this project reads; looked for {LOOKED_FOR}")


# -- checks the formats share -------------------------------------------------------------------
def _check_kind(ok: bool, path: Path, fmt: str, wanted: str, draft: nn.Module) -> None:
    if not ok:
        kind = type(draft).__module__.removeprefix("models.")
        raise InitError(
            f"{path} holds a {wanted} draft ({fmt} format) but the config builds "
            f"draft={kind} ({type(draft).__name__}): set draft={wanted}"
        )


def _check_verifier(recorded: str | None, target: Target, path: Path) -> None:
    """By the last path component: the same model sits in another directory elsewhere."""
    tail = lambda name: str(name).rstrip("/").rsplit("/", 1)[-1].lower()  # noqa: E731
    names = {tail(n) for n in (target.name, getattr(target.config, "_name_or_path", "")) if n}
    if recorded and tail(recorded) not in names:
        raise InitError(
            f"{path} was trained for the verifier {recorded!r} but the target is "
            f"{target.name!r}: load that model as the target (target=hf target.path=...); if it "
            f"is the same model under another name, correct the name in {path}/config.json"
        )


def _check_size(what: str, got, want: int, target: Target, path: Path) -> None:
    if got is not None and got != want:
        raise InitError(
            f"{path} was made for a target with {what} {got}, but target {target.name!r} has "
            f"{want}: import it with the target it was trained for"
        )


def _hint(patterns: dict, key: str, settings: dict) -> str:
    names = next((v for p, v in patterns.items() if p in key), None)
    if names is None:
        return f"build the draft with the files' settings {settings}"
    shown = {n: "null" if v is None else v for n, v in settings.items()}
    sets = [f"draft.model.{n}" + (f"={shown[n]}" if n in shown else "")
            for n in names.split(" / ")]  # fmt: skip
    return f"set {' and '.join(sets)} as the files were built"


def _check_state(state: dict, draft: nn.Module, target: Target, where: str, settings: dict):
    want = {k: tuple(v.shape) for k, v in draft.state_dict().items()}
    missing, unknown = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unknown:
        raise InitError(
            f"{where}: the files lack {len(missing)} tensors of the draft built from the config "
            f"{missing[:4]} and hold {len(unknown)} unknown ones {unknown[:4]}; "
            + _hint(COUNT_HINTS, (missing or unknown)[0], settings)
        )
    for key, shape in want.items():
        got = tuple(state[key].shape)
        if got == shape:
            continue
        d = next((i for i, (w, g) in enumerate(zip(shape, got)) if w != g), 0)
        if len(got) == len(shape) and shape[d] in (target.vocab_size, target.hidden_size):
            what = "vocabulary" if shape[d] == target.vocab_size else "hidden size"
            hint = (f"the files' {what} is {got[d]}, target {target.name!r}'s {shape[d]}: they "
                    "were made for another target")  # fmt: skip
            if what == "hidden size" and "hidden_size" in settings:
                hint += f" (or a draft LM of that width: draft.model.hidden_size={got[d]})"
        else:
            hint = _hint(SHAPE_HINTS, key, settings)
        raise InitError(
            f"{where}: {key} is {list(got)} in the files but {list(shape)} in the draft built "
            f"from the config; {hint}"
        )


# -- the formats: each gives (state keyed like draft.state_dict(), the files' draft settings) ----
def _our_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory's newest checkpoint."""
    if (path / "draft.yaml").is_file():
        return path
    if (newest := latest_checkpoint(path)) is None:
        raise InitError(f"run directory {path} holds no checkpoint ({PREFIX}N) in checkpoints/")
    return newest


def _read_ours(path: Path, draft: nn.Module, target: Target) -> tuple[dict, dict]:
    path = _our_checkpoint(path)
    settings = OmegaConf.to_container(OmegaConf.load(path / "draft.yaml").model, resolve=True)
    # models.medusa.from_target -> models.medusa
    module = settings.pop("_target_").rsplit(".", 1)[0]
    ok = module == type(draft).__module__
    _check_kind(ok, path, "ours", module.removeprefix("models."), draft)
    return load_tensors(path / "draft.safetensors"), settings


def _read_hf(path: Path, draft: nn.Module, target: Target) -> tuple[dict, dict]:
    config = _json(path / "config.json")
    _check_kind(isinstance(draft, DraftLM), path, "hf", "draft_lm", draft)
    if draft.causal_lm() is not draft.model:
        raise InitError(
            f"the config builds a LoRA draft LM (draft.model.lora_rank > 0): start it from {path} "
            "with draft.model.init_from=DIR (the base weights), not draft.init_from"
        )
    _check_size("a vocabulary of", config.get("vocab_size"), target.vocab_size, target, path)
    ours = draft.model.config.to_dict()
    differ = [f"{k}={config[k]!r}, not {ours[k]!r}" for k in HF_MATHS
              if k in config and k in ours and config[k] != ours[k]]  # fmt: skip
    if differ:
        raise InitError(
            f"{path} is not the draft LM the config builds for target {target.name!r} "
            f"({'; '.join(differ)}): start from it with draft.model.init_from=DIR, which keeps "
            "its own architecture and config"
        )
    state = {f"model.{k}": v for f in _safetensors(path) for k, v in load_file(f).items()}
    embed = state.get("model.model.embed_tokens.weight")
    if (
        ours.get("tie_word_embeddings")
        and "model.lm_head.weight" not in state
        and embed is not None
    ):
        state["model.lm_head.weight"] = embed  # save_pretrained stores a tied head once
    names = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads")
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "num_key_value_heads")  # fmt: skip
    return state, {n: config.get(f) for n, f in zip(names, fields)}


def _check_medusa(path: Path, fmt: str, draft: nn.Module, heads: int, layers: int) -> dict:
    _check_kind(isinstance(draft, MedusaHeads), path, fmt, "medusa", draft)
    if draft.adapted is not None:
        raise InitError(
            f"{path} ({fmt}) holds Medusa heads without Medusa-2's LoRA adapter: import it into "
            "draft=medusa, or start draft=medusa2 from a draftlab checkpoint"
        )
    settings = {"num_heads": heads, "num_layers": layers}
    if (heads, layers) != (draft.num_heads, len(draft.blocks[0])):
        raise InitError(
            f"{path} holds {heads} heads of {layers} blocks, the draft built from the config "
            f"{draft.num_heads} of {len(draft.blocks[0])}: {_hint(COUNT_HINTS, 'blocks.', settings)}"
        )
    return settings


def _check_file_keys(got: set[str], want: set[str], file: Path) -> None:
    if got != want:
        raise InitError(
            f"{file}: missing {sorted(want - got)[:4]}, unknown {sorted(got - want)[:4]} for the "
            "layout its config.json describes; it was not written with that config"
        )


def _medusa_outputs(outs: list[Tensor], draft: MedusaHeads, target: Target, path: Path) -> dict:
    """Per-head output layers [V, H] -> `out.{i}.weight` (head_init=copy), or nothing when
    each one is the target's lm_head (what head_init=shared reads)."""
    for w in outs:
        _check_size("a vocabulary of", w.shape[0], target.vocab_size, target, path)
        _check_size("hidden size", w.shape[1], target.hidden_size, target, path)
    if draft.out is not None:
        return {f"out.{i}.weight": w for i, w in enumerate(outs)}
    head = target.lm_head
    own = [i for i, w in enumerate(outs)
           if head.bias is not None or not torch.equal(w, head.weight.detach().to("cpu", w.dtype))]  # fmt: skip
    if own:
        raise InitError(
            f"{path}: the output layers of heads {own} are trained copies, not target "
            f"{target.name!r}'s lm_head, but the config's heads share that lm_head "
            "(draft.model.head_init=shared): set draft.model.head_init=copy"
        )
    return {}


def _read_medusa(path: Path, draft: nn.Module, target: Target) -> tuple[dict, dict]:
    config = _json(path / "config.json")
    heads, layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    settings = _check_medusa(path, "medusa", draft, heads, layers)
    file = path / MEDUSA_WEIGHTS
    if file.is_file():
        w = load_file(file)
    elif (file := path / "medusa_lm_head.pt").is_file():  # what the repository's loader reads
        w = torch.load(file, map_location="cpu", weights_only=True)
    else:
        raise InitError(f"{path} has neither {MEDUSA_WEIGHTS} nor medusa_lm_head.pt")
    w = {k.removeprefix("medusa_head."): v for k, v in w.items()}
    _check_file_keys(set(w), medusa_keys(heads, layers), file)
    # The repository repeats ONE block L times: its file holds L copies, loaded as L blocks.
    state = {f"blocks.{i}.{j}.linear.{p}": w[f"{i}.{j}.linear.{p}"]
             for i in range(heads) for j in range(layers) for p in ("weight", "bias")}  # fmt: skip
    outs = [w[f"{i}.{layers}.weight"] for i in range(heads)]
    state |= _medusa_outputs(outs, draft, target, path)  # sizes first: the clearer message
    _check_verifier(config.get("base_model_name_or_path"), target, path)
    return state, settings


def _read_vllm_medusa(path: Path, draft: nn.Module, target: Target) -> tuple[dict, dict]:
    config = _json(path / "config.json")
    heads, layers = int(config["num_heads"]), int(config["num_hidden_layers"])
    settings = _check_medusa(path, "vllm-medusa", draft, heads, layers)
    w = {k.removeprefix("medusa_heads."): v for k, v in load_file(path / VLLM_WEIGHTS).items()}
    vocab = config.get("vocab_size")
    if "token_map" in w or config.get("truncated_vocab_size", vocab) != vocab:
        raise InitError(
            f"{path} drafts over a truncated vocabulary (token_map); draftlab's Medusa heads "
            "predict the target's whole vocabulary, so it cannot be imported"
        )
    bias, shared = config.get("medusa_fc_bias", False), config.get("original_lm_head", False)
    if shared and "lm_head.weight" in w:  # one output layer for all heads, under vLLM's name
        w["lm_heads.0.weight"] = w.pop("lm_head.weight")
    want = {k for k in vllm_medusa_keys(heads, layers) if bias or not k.endswith(".bias")}
    if shared:
        want = {k for k in want if not k.startswith("lm_heads.")} | {"lm_heads.0.weight"}
    _check_file_keys(set(w), want, path / VLLM_WEIGHTS)
    state = {}
    for i in range(heads):
        for j in range(layers):
            weight = w[f"blocks.{i}.layers.{j}.weight"]  # [H, H]
            state[f"blocks.{i}.{j}.linear.weight"] = weight
            zero = torch.zeros(weight.shape[0], dtype=weight.dtype)  # medusa_fc_bias: false
            state[f"blocks.{i}.{j}.linear.bias"] = w.get(f"blocks.{i}.layers.{j}.bias", zero)
    outs = [w[f"lm_heads.{0 if shared else i}.weight"] for i in range(heads)]
    state |= _medusa_outputs(outs, draft, target, path)  # sizes first: the clearer message
    _check_verifier(config.get("base_model_name_or_path"), target, path)
    return state, settings


def _read_eagle(path: Path, draft: nn.Module, target: Target, fmt: str) -> tuple[dict, dict]:
    _check_kind(isinstance(draft, EagleDraft), path, fmt, "eagle", draft)
    state, s = in_tap_order(*read_eagle_export(path, target), draft.hidden_layers)
    settings = {"style": s.get("style"), "layers": s.get("layers"),
                "vocab_size": s.get("draft_vocab_size"), "train_head": s.get("train_head"),
                "intermediate_size": s.get("intermediate_size")}  # fmt: skip
    if s.get("style") not in (None, getattr(draft, "style", None)):
        raise InitError(
            f"{path} holds an {s['style']} head, the config builds {draft.style}: set "
            f"draft={'eagle1' if s['style'] == 'eagle1' else 'eagle'}"
        )
    # EAGLE-3.1's options change the maths (norm_output without any weight): set alike
    flags = {k: bool(s.get(k)) for k in NORM_FLAGS}
    built = {k: v for k, v in norm_flags(draft).items() if k in NORM_FLAGS}
    if flags != built:
        fix = " ".join(f"draft.model.{k}={str(v).lower()}" for k, v in flags.items())
        raise InitError(f"{path} was trained with {flags}, the config builds {built}: set {fix}")
    # The taps' weights have the same shapes whichever layers they read (in this order).
    n, taps = target.num_layers + 1, s.get("layers")  # hidden_states indices, -1 = the last
    if taps is not None and [i % n for i in taps] != [i % n for i in draft.hidden_layers]:
        raise InitError(
            f"{path} reads target layers {list(s['layers'])}, the draft built from the config "
            f"{list(draft.hidden_layers)}: set draft.model.layers={list(s['layers'])}. "
            + FREE_ON_INIT
        )
    return state, settings


READERS = {
    "ours": _read_ours,
    "hf": _read_hf,
    "medusa": _read_medusa,
    "vllm-medusa": _read_vllm_medusa,
    "speculators": lambda path, draft, target: _read_eagle(path, draft, target, "speculators"),
    "eagle": lambda path, draft, target: _read_eagle(path, draft, target, "eagle"),
}


def _refuse_differences(path: Path, diffs: list) -> None:
    if diffs:
        raise InitError(refusal(
            f"draft.init_from={str(path)!r}: the checkpoint was trained with other settings than "
            "the draft and target of this run:", diffs, FREE_ON_INIT,
        ))  # fmt: skip


def _check_export_target(path: Path, target: Target) -> None:
    """An export written by scripts/export.py names the target it was trained against
    (IDENTITY_FILE): refused when `target` is another one."""
    record = path / IDENTITY_FILE if path.is_dir() else None
    if record is not None and record.is_file():
        saved = json.loads(record.read_text()).get("target")
        now = {"name": target.name, "weights": target.fingerprint}
        _refuse_differences(path, target_differences(saved, now, ("weights",)))


def check_init_from(draft_cfg, target: Target) -> str:
    """Before the data is prepared: `draft_cfg.init_from` holds a draft format, and a draftlab
    checkpoint's settings match `draft_cfg` (the taps as configured: the load compares them
    resolved) and the target; an export's recorded target matches it. Returns the format."""
    path = Path(draft_cfg.init_from).expanduser()
    fmt = detect_format(path)
    if fmt == "ours":
        _refuse_differences(path, init_differences(_our_checkpoint(path), target, draft_cfg))
    else:
        _check_export_target(path, target)
    return fmt


def init_draft_from(path: str | Path, draft: nn.Module, target: Target, draft_cfg=None) -> str:
    """Load the draft saved in `path` (any of FORMATS) into `draft`, built from the config's
    `draft_cfg` (cfg.draft; without it a draftlab checkpoint's taps are compared, not its
    other settings) for `target`; returns the format. On any error `draft` is unchanged."""
    path = Path(path).expanduser()
    fmt = detect_format(path)
    if fmt == "ours":
        ckpt = _our_checkpoint(path)
        _refuse_differences(path, init_differences(ckpt, target, draft_cfg, draft))
    else:
        _check_export_target(path, target)
    state, settings = READERS[fmt](path, draft, target)
    _check_state(state, draft, target, f"draft.init_from={str(path)!r} ({fmt})", settings)
    # The draft's own load checks (e.g. EAGLE's vocabulary map) run on a copy first.
    copy.deepcopy(draft).load_state_dict(state, strict=True)
    draft.load_state_dict(state, strict=True)
    return fmt
