"""DeepSeek-V3-style multi-token prediction (MTP) heads as a draft.

D sequential modules on top of the frozen target. Module d (1-based) at position t:

    h^d_t = Block_d( W_d [ RMSNorm(h^{d-1}_t) ; RMSNorm(emb(x_{t+d})) ] )     h^0 = target's last hidden
    logits^d_t = lm_head( RMSNorm_d(h^d_t) )   ->  predicts x_{t+d+1}

Block_d is one Llama decoder layer (causal attention over t, rope copied from the target).
Embedding and output head are the target's (frozen, read from `target` at call time, never
stored here). Depth d at position t pairs with the target's distribution at t + d, so
`DraftOutput.offsets = [1, ..., D]` (models/protocol.py).

The served variant (`one_layer`, `qk_norm`; speculators' `mtp` type, what vLLM reads with
`num_nextn_predict_layers: 1`): ONE module serves every depth, depth d > 1 reading depth
d-1's NORMED output (its final_norm, as the library feeds its layer's output back), and the
block is a Qwen3 decoder layer (per-head RMSNorm of q and k before rotary). Positions and
offsets stay as above: the library's step k at row t is depth k+1 at position t.

Drafting (decoding/drafters/mtp.py): with the newest target feature at position P and the
newest token x_{P+1}, draft j <= D comes from module j at position P; for j > D (when
`recursive_last`) module D runs again at position P + j - D, fed its own previous output h^D
in place of h^{D-1} (what serving engines do to get more tokens than modules; never trained,
so expect lower acceptance there). Each module keeps its own KV cache over t, rolled back at
commit to the entries whose inputs were all committed tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from models.protocol import DraftOutput
from models.target import Target, TargetOutput


class MTPModule(nn.Module):
    """One depth: norm both inputs, concatenate, project 2H -> H, one decoder layer."""

    def __init__(self, block_config: LlamaConfig | Qwen3Config):
        super().__init__()
        hidden, eps = block_config.hidden_size, block_config.rms_norm_eps
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)  # for h^{d-1}
        self.embed_norm = LlamaRMSNorm(hidden, eps=eps)  # for emb(x_{t+d})
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        # layer 0 of its own cache; Qwen3's adds the per-head q / k norms
        layer = Qwen3DecoderLayer if isinstance(block_config, Qwen3Config) else LlamaDecoderLayer
        self.block = layer(block_config, layer_idx=0)
        self.final_norm = LlamaRMSNorm(hidden, eps=eps)  # own norm before the shared head

    def forward(
        self,
        prev_hidden: Tensor,  # [B, L, H] h^{d-1}
        embeds: Tensor,  # [B, L, H] emb(x_{t+d})
        position_embeddings: tuple[Tensor, Tensor],  # cos, sin [1, L, head_dim]
        attention_mask: Tensor | None = None,  # [1, 1, L, kv] bool; None = plain causal
        cache: DynamicCache | None = None,
    ) -> Tensor:
        x = torch.cat([self.hidden_norm(prev_hidden), self.embed_norm(embeds)], dim=-1)
        return self.block(  # [B, L, H] h^d (pre-norm; the next depth reads this)
            self.proj(x),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            cache=cache,
            use_cache=cache is not None,
        )


class MTP(nn.Module):
    """D MTP modules. Trained weights only; embedding and head come from the target."""

    kind = "mtp"
    hidden_layers: tuple[int, ...] = (-1,)  # h^0 = the target's last hidden state (after norm)

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        intermediate_size: int,
        rms_norm_eps: float,
        max_position_embeddings: int,
        rope_parameters: dict,
        num_depths: int = 2,
        recursive_last: bool = True,
        one_layer: bool = False,
        qk_norm: bool = False,
    ):
        super().__init__()
        if num_depths < 1:
            raise ValueError(f"num_depths={num_depths}: an MTP draft needs at least 1 module.")
        self.num_depths = num_depths
        self.recursive_last = recursive_last
        self.one_layer, self.qk_norm = one_layer, qk_norm
        self.vocab_size = vocab_size
        self.block_config = (Qwen3Config if qk_norm else LlamaConfig)(
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            num_hidden_layers=1,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=intermediate_size,
            rms_norm_eps=rms_norm_eps,
            max_position_embeddings=max_position_embeddings,
            rope_parameters=dict(rope_parameters),
            attn_implementation="sdpa",
        )
        modules = 1 if one_layer else num_depths
        self.depths = nn.ModuleList(MTPModule(self.block_config) for _ in range(modules))
        # inv_freq is a non-persistent buffer that follows .to(device); decoding copies are
        # cast with models.dtypes.cast_keep_rotary, which keeps it float32 (a bare
        # .to(bfloat16) would round it and shift every rotary angle).
        self.rotary = LlamaRotaryEmbedding(self.block_config)

    def module(self, depth: int) -> MTPModule:
        """The module of depth `depth` (1-based): the one module of a `one_layer` draft."""
        return self.depths[0 if self.one_layer else depth - 1]

    def feed(self, depth: int, hidden: Tensor) -> Tensor:
        """What depth `depth`'s output h^d hands the next depth: h^d itself, or with
        `one_layer` its final norm (speculators' mtp feeds its layer's normed output)."""
        return self.module(depth).final_norm(hidden) if self.one_layer else hidden

    def head(self, target: Target, module: MTPModule, hidden: Tensor) -> Tensor:
        # The frozen head may be in another dtype (a bf16 target under an fp32 draft).
        weight = target.lm_head.weight
        return F.linear(module.final_norm(hidden).to(weight.dtype), weight)  # [B, L, V]

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
        attention_mask: Tensor | None = None,  # [B, T], right-padded
        loss_mask: Tensor | None = None,  # unused: every position trains
    ) -> DraftOutput:
        B, T = input_ids.shape
        if self.num_depths >= T:
            raise ValueError(
                f"sequence length {T} <= num_depths={self.num_depths}: depth d needs token "
                "x_{t+d}; train on longer sequences or use fewer depths."
            )
        if attention_mask is not None and (attention_mask[:, 1:] > attention_mask[:, :-1]).any():
            # Causal attention alone is exact for right padding (real tokens never see the pads);
            # left padding would let real positions attend to pads.
            raise ValueError(
                "MTP training expects right-padded batches (train.data.prepare.collate pads right)."
            )
        if -1 not in target_out.hidden:
            raise ValueError(
                "target_out has no hidden[-1]: run the target with hidden_layers=draft.hidden_layers."
            )
        hidden = target_out.hidden[-1].to(self.depths[0].proj.weight.dtype)  # [B, T, H] h^0
        embeds = target.embed_tokens(input_ids)  # [B, T, H] frozen
        positions = torch.arange(T, device=input_ids.device)[None]  # [1, T]
        cos, sin = self.rotary(hidden, positions)  # [1, T, head_dim]
        logits = []
        for d in range(1, self.num_depths + 1):
            L = T - d  # positions t with x_{t+d} inside the sequence
            module = self.module(d)
            prev = hidden[:, :L] if d == 1 else self.feed(d - 1, hidden[:, :L])
            hidden = module(prev, embeds[:, d : d + L], (cos[:, :L], sin[:, :L]))
            # Zero-pad the hidden (not the logits: cheaper) to [B, T, H] so every offset has T
            # positions as the protocol says; the loop drops t >= T - d anyway.
            padded = torch.cat([hidden, hidden.new_zeros(B, d, hidden.shape[-1])], dim=1)
            logits.append(self.head(target, module, padded))  # [B, T, V]
        return DraftOutput(logits=logits, offsets=list(range(1, self.num_depths + 1)))


def from_target(
    target: Target,
    token_counts: Tensor | None = None,  # unused: MTP predicts over the full vocabulary
    num_depths: int = 2,
    recursive_last: bool = True,
    intermediate_size: int | None = None,  # None = the target's
    num_heads: int | None = None,  # None = the target's (num_kv_heads follows unless given)
    num_kv_heads: int | None = None,
    one_layer: bool = False,  # one module for every depth, fed its normed output (served)
    qk_norm: bool = False,  # Qwen3 decoder layers: per-head q / k RMSNorm (served)
) -> MTP:
    """Build an MTP draft whose sizes and rope settings are copied from the target."""
    cfg = target.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads = num_heads or cfg.num_attention_heads
    kv_heads = num_kv_heads or (cfg.num_key_value_heads if num_heads is None else heads)
    if heads % kv_heads:
        raise ValueError(f"num_heads={heads} is not a multiple of num_kv_heads={kv_heads}.")
    rope = target.rope_kwargs()
    if "rope_parameters" not in rope:
        raise ValueError(
            f"target {target.name} has no rope_parameters in its config; MTP copies them."
        )
    model = MTP(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),  # Cohere has layer_norm_eps
        max_position_embeddings=rope["max_position_embeddings"],
        rope_parameters=rope["rope_parameters"],
        num_depths=num_depths,
        recursive_last=recursive_last,
        one_layer=one_layer,
        qk_norm=qk_norm,
    )
    with torch.no_grad():  # start each module's own output norm from the target's final norm
        for module in model.depths:
            module.final_norm.weight.copy_(target.final_norm_weight)
    return model.to(device=target.device)
