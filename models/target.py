"""The frozen target LM: logits + requested hidden layers from any HF causal LM.

Loaders (the embedded SmolLM2, any hub id or directory, the tiny random test models) live in
models/target_loaders.py.

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
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import DynamicCache, PreTrainedTokenizerBase

from models.dtypes import cast_keep_rotary
from models.identity import weights_fingerprint


@dataclass
class TargetOutput:
    logits: Tensor | None  # [B, T, V] (float32 when the model runs in fp32)
    hidden: dict[int, Tensor]  # layer index -> [B, T, H]; -1 = last layer after final norm
    cache: DynamicCache | None


class Target:
    """A frozen causal LM. `forward` gives logits, chosen hidden layers and a KV cache."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None,
        name: str,
        check_head: bool = True,  # False: a model on the meta device (train/run/memory_plan.py)
        stored_dtype: torch.dtype | None = None,  # the weights' dtype on disk (None: unknown)
    ):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name  # a stable id, shown in records and cache keys
        self.config = model.config
        # What an export writes the target's tensors in (train/formats/export.py): a copy
        # rounded to the dtype the run holds them in is not the target an engine serves.
        self.stored_dtype = stored_dtype
        self._fingerprint: str | None = None
        if check_head:
            self._check_head()

    @property
    def fingerprint(self) -> str:
        """Which weights these are (models/identity.py), computed once: the target is frozen.
        Checkpoints record it; it keys the feature and regeneration caches."""
        if self._fingerprint is None:
            self._fingerprint = weights_fingerprint(self.model)
        return self._fingerprint

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
    def context_length(self) -> int | None:
        """The most positions the target was built for (config.max_position_embeddings), or
        None when its config does not say. Beyond it rope runs past its trained range or a
        learned position table runs out: prompt + new tokens must fit (decoding/rounds.py:
        check_context)."""
        n = getattr(self.config, "max_position_embeddings", None)
        return int(n) if n else None

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
        """[H] the final norm's per-channel scale, as a Llama RMSNorm holds it. Gemma's
        norms store `scale - 1` (they compute x * (1 + weight)), so a draft copying
        `final_norm.weight` into its own Llama norm would start at zero output. Read off
        the norm itself, with a probe of mean 0 and no zero entry (alternating +-1): a
        LayerNorm (Cohere) subtracts the mean, so a constant probe would map to zero, while
        on a mean-0 probe RMSNorm and LayerNorm agree. out(p) - out(-p) cancels any bias."""
        signs = torch.ones(self.hidden_size, device=self.device)
        signs[1::2] = -1.0
        probe = (signs - signs.mean()).to(self.dtype)  # [H] mean 0 even when H is odd
        unit = probe.float() / probe.float().pow(2).mean().sqrt()  # [H] probe / its RMS
        with torch.no_grad():
            up, down = self.final_norm(1024.0 * probe[None]), self.final_norm(-1024.0 * probe[None])
        return ((up[0].float() - down[0].float()) / (2 * unit)).to(self.dtype)

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
        if dtype is not None:  # rotary frequencies stay float32 (models/dtypes.py)
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


def decode_copy(target: Target, dtype: torch.dtype) -> Target:
    """The target in the decoding dtype: the training target itself when it already has
    that dtype, else a frozen copy with float32 rotary frequencies (the training target is
    untouched)."""
    if target.dtype == dtype:
        return target
    model = cast_keep_rotary(copy.deepcopy(target.model), dtype)
    return Target(model, target.tokenizer, name=target.name)
