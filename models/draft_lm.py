"""A distilled draft LM: a small standalone Llama on the target's tokenizer.

Three starts (conf/draft/draft_lm.yaml):
  - `init: target` (default): a few Llama layers at the target's hidden size, with the
    target's embeddings and output head copied in (frozen unless `train_embeddings`), so
    the draft starts in the target's token space and only learns the layers.
  - `init: random`: every weight random (sizes from config).
  - `init_from: <HF path or hub id>`: a pretrained small LM that shares the target's
    vocabulary (checked), optionally trained through LoRA adapters (`lora_rank > 0`).

Position settings (`max_position_embeddings`, rope) are copied from the target for the
first two: a wrong value silently ruins tau while training accuracy looks fine.
Alignment: a draft LM predicts the next token, so `DraftOutput.offsets == [0]`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from models.protocol import DraftOutput
from models.target import Target, TargetOutput


class DraftLM(nn.Module):
    kind = "draft_lm"
    hidden_layers: tuple[int, ...] = ()  # a standalone LM reads no target features

    def __init__(self, model: PreTrainedModel):
        super().__init__()
        self.model = model  # a causal LM, possibly wrapped by peft

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    def set_progress(self, progress: float) -> None:
        """No schedule of its own: training progress changes nothing here."""

    def decoding_target(self, target: Target) -> Target:
        """The decoder verifies with the frozen target itself."""
        return target

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # [B, T]
        loss_mask: Tensor | None = None,  # unused: every position trains
    ) -> DraftOutput:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return DraftOutput(logits=[out.logits], offsets=[0])  # [B, T, V]

    def causal_lm(self) -> PreTrainedModel:
        """The plain HF causal LM (LoRA layers stay injected and active)."""
        get_base = getattr(self.model, "get_base_model", None)
        return get_base() if get_base is not None else self.model


def _config_from_target(
    target: Target,
    num_layers: int,
    hidden_size: int | None,
    intermediate_size: int | None,
    num_heads: int | None,
    num_kv_heads: int | None,
) -> LlamaConfig:
    tc = target.config
    hidden = hidden_size or target.hidden_size
    heads = num_heads or tc.num_attention_heads
    if hidden % heads:
        raise ValueError(
            f"draft hidden_size={hidden} is not divisible by num_heads={heads}; set "
            "draft.model.num_heads to a divisor of the hidden size"
        )
    kv_heads = num_kv_heads or min(getattr(tc, "num_key_value_heads", heads), heads)
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} must be a multiple of num_kv_heads={kv_heads}")
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size or getattr(tc, "intermediate_size", 4 * hidden),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-5),
        hidden_act=getattr(tc, "hidden_act", "silu"),
        tie_word_embeddings=bool(getattr(tc, "tie_word_embeddings", False)),
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        pad_token_id=getattr(tc, "pad_token_id", None),
        **target.rope_kwargs(),
    )


def from_target(
    target: Target,
    token_counts: Tensor | None = None,  # unused: a draft LM keeps the full vocabulary
    num_layers: int = 2,
    hidden_size: int | None = None,  # None = the target's
    intermediate_size: int | None = None,  # None = the target's
    num_heads: int | None = None,  # None = the target's
    num_kv_heads: int | None = None,  # None = the target's
    init: str = "target",  # target | random
    init_from: str | None = None,  # HF path / hub id of a pretrained draft; overrides init
    train_embeddings: bool = False,  # with init=target: also train the copied embeddings/head
    lora_rank: int = 0,  # > 0: train LoRA adapters on a pretrained draft (needs init_from)
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
) -> DraftLM:
    """Build a draft LM for `target` (see the module docstring for the three starts)."""
    if init not in ("target", "random"):
        raise ValueError(f"draft.model.init must be 'target' or 'random', got {init!r}")
    if lora_rank > 0 and init_from is None:
        raise ValueError(
            "lora_rank > 0 needs a pretrained draft: set draft.model.init_from=<HF path>, "
            "or lora_rank=0 to train a fresh draft fully"
        )
    torch.manual_seed(seed)
    if init_from is not None:
        model = AutoModelForCausalLM.from_pretrained(init_from, dtype=torch.float32)
        draft_vocab = model.get_output_embeddings().weight.shape[0]
        if draft_vocab != target.vocab_size:
            raise ValueError(
                f"draft {init_from!r} has a vocabulary of {draft_vocab} tokens but the target "
                f"{target.name!r} has {target.vocab_size}: a draft LM must share the target's "
                "tokenizer. Pick a draft from the same model family, or use init=target."
            )
    else:
        config = _config_from_target(
            target, num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads
        )
        model = LlamaForCausalLM(config)
        if init == "target":
            if config.hidden_size != target.hidden_size:
                raise ValueError(
                    f"init=target copies the target's embeddings, so hidden_size must be "
                    f"{target.hidden_size} (got {config.hidden_size}); use init=random for "
                    "a narrower draft"
                )
            with torch.no_grad():
                model.get_input_embeddings().weight.copy_(target.embed_tokens.weight)
                if not config.tie_word_embeddings:
                    model.get_output_embeddings().weight.copy_(target.lm_head.weight)
                model.model.norm.weight.copy_(target.final_norm_weight)
            if not train_embeddings:
                model.get_input_embeddings().requires_grad_(False)
                model.get_output_embeddings().requires_grad_(False)
    model = model.float().to(target.device)
    if lora_rank > 0:
        # peft only for LoRA drafts: its import is slow, and other drafts never need it.
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=list(lora_target_modules),
        )
        model = get_peft_model(model, lora)
    return DraftLM(model)
