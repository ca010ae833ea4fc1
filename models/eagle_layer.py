"""EAGLE's one decoder layer in the layout serving engines load (models/eagle.py holds the
draft around it: fc over the taps, the unrolled training-time test, the head)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm


class EagleLayer(nn.Module):
    """The draft's decoder layer, served layout. EAGLE-3: q/k/v read cat(input_layernorm(
    embedding), hidden_norm(feature)) (2H wide, as vLLM's / speculators' first layer), the
    residual is the raw feature. EAGLE-1: a Llama layer without input_layernorm over the fc
    output (vLLM replaces it by Identity)."""

    def __init__(self, config: LlamaConfig, style: str):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.two_inputs = style == "eagle3"
        self.self_attn = LlamaAttention(config, layer_idx=0)
        if self.two_inputs:
            D, bias = self.self_attn.head_dim, config.attention_bias
            self.self_attn.q_proj = nn.Linear(2 * H, config.num_attention_heads * D, bias=bias)
            self.self_attn.k_proj = nn.Linear(2 * H, config.num_key_value_heads * D, bias=bias)
            self.self_attn.v_proj = nn.Linear(2 * H, config.num_key_value_heads * D, bias=bias)
            self.input_layernorm = LlamaRMSNorm(H, eps=eps)  # on the token embedding
            self.hidden_norm = LlamaRMSNorm(H, eps=eps)  # on the feature
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self,
        hidden: Tensor,  # [B, P, H]: EAGLE-3 feature g (or the previous step's h); EAGLE-1 fc output
        embeds: Tensor | None,  # [B, P, H] EAGLE-3: emb(next token); EAGLE-1: None (inside fc)
        attention_mask: Tensor | None,  # [B|1, 1, P, kv] bool, True = attend
        position_embeddings: tuple[Tensor, Tensor],
        cache: DynamicCache,
    ) -> Tensor:
        x = hidden
        if self.two_inputs:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, _ = self.self_attn(
            x, position_embeddings=position_embeddings, attention_mask=attention_mask, cache=cache
        )
        h = hidden + attn  # residual = the raw feature (norm_before_residual = false)
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, P, H]
