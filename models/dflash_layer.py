"""The layer of a DFlash block draft (models/dflash.py; Domino's backbone, models/domino.py):
a Llama decoder layer whose attention reads, besides its own block, the keys and values of
the fused target context (`BlockAttention.context_kv`, cached once per verified position by
the drafter, decoding/drafters/dflash.py). `qk_norm`: Qwen3's per-head RMSNorm of queries
and keys (context keys too) before rotary, the layer z-lab's served DFlash has."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, rotate_half


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + rotate_half(x) * sin


class BlockAttention(nn.Module):
    """Attention of the block's positions over [context ; own block]. Shapes: B rows, N
    blocks per row, P positions per block, C context entries, h heads of size D (kv heads
    repeated to h)."""

    def __init__(self, config: LlamaConfig, qk_norm: bool = False):
        super().__init__()
        H, D, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            D,
        )
        self.q_proj = nn.Linear(H, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(H, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, H, bias=bias)
        self.q_norm = self.k_norm = None  # Qwen3 layers: per head, before rotary
        if qk_norm:
            self.q_norm = LlamaRMSNorm(D, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(D, eps=config.rms_norm_eps)

    def _norm(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        return x if norm is None else norm(x)

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Context [B, C, H] (fused target features) at rotary cos/sin [B|1, C, D] -> keys and
        values [B, h, C, D], kv heads repeated once here (a drafter caches them as they are)."""
        B, C, _ = ctx.shape
        k = self.k_proj(ctx).view(B, C, self.num_kv_heads, self.head_dim).transpose(1, 2)
        k = self._norm(k, self.k_norm)
        v = self.v_proj(ctx).view(B, C, self.num_kv_heads, self.head_dim).transpose(1, 2)
        group = self.num_heads // self.num_kv_heads
        k = _rope(k, cos[:, None], sin[:, None])
        return k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

    def forward(
        self,
        x: Tensor,  # [B, N, P, H] the block's normed hidden
        cos: Tensor,  # [B, N, P, D]
        sin: Tensor,  # [B, N, P, D]
        ctx_k: Tensor,  # [B, h, C, D] (context_kv)
        ctx_v: Tensor,  # [B, h, C, D]
        ctx_mask: Tensor,  # [B, N, C] bool: the context entries each block sees
    ) -> Tensor:
        B, N, P, _ = x.shape
        h, kv, D = self.num_heads, self.num_kv_heads, self.head_dim

        def heads(proj: nn.Linear, n: int) -> Tensor:
            return proj(x).view(B, N, P, n, D).permute(0, 3, 1, 2, 4)  # [B, n, N, P, D]

        q = _rope(self._norm(heads(self.q_proj, h), self.q_norm), cos[:, None], sin[:, None])
        k = _rope(self._norm(heads(self.k_proj, kv), self.k_norm), cos[:, None], sin[:, None])
        v = heads(self.v_proj, kv)
        group = h // kv
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [B, h, N, P, D]
        scale = D**-0.5
        s_ctx = torch.einsum("bhnpd,bhcd->bhnpc", q, ctx_k) * scale  # [B, h, N, P, C]
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, :, None, :], float("-inf"))
        s_own = torch.einsum("bhnpd,bhnkd->bhnpk", q, k) * scale  # [B, h, N, P, P]: bidirectional
        probs = torch.cat([s_ctx, s_own], -1).float().softmax(-1).to(v.dtype)
        C = ctx_k.shape[2]
        out = torch.einsum("bhnpc,bhcd->bhnpd", probs[..., :C], ctx_v)
        out = out + torch.einsum("bhnpk,bhnkd->bhnpd", probs[..., C:], v)  # [B, h, N, P, D]
        return self.o_proj(out.permute(0, 2, 3, 1, 4).reshape(B, N, P, h * D))


class DFlashLayer(nn.Module):
    """A Llama decoder layer whose attention also reads the context keys/values."""

    def __init__(self, config: LlamaConfig, qk_norm: bool = False):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.self_attn = BlockAttention(config, qk_norm)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_mask)
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, N, P, H]
