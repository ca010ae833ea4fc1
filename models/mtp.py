"""DeepSeek-V3-style multi-token prediction (MTP) heads as a draft, and their chain drafter.

D sequential modules on top of the frozen target. Module d (1-based) at position t:

    h^d_t = Block_d( W_d [ RMSNorm(h^{d-1}_t) ; RMSNorm(emb(x_{t+d})) ] )     h^0 = target's last hidden
    logits^d_t = lm_head( RMSNorm_d(h^d_t) )   ->  predicts x_{t+d+1}

Block_d is one Llama decoder layer (causal attention over t, rope copied from the target).
Embedding and output head are the target's (frozen, read from `target` at call time, never
stored here). Depth d at position t pairs with the target's distribution at t + d, so
`DraftOutput.offsets = [1, ..., D]` (models/protocol.py).

Drafting (MTPDrafter): with the newest target feature at position P and the newest token
x_{P+1}, draft j <= D comes from module j at position P; for j > D (when `recursive_last`)
module D runs again at position P + j - D, fed its own previous output h^D in place of
h^{D-1} (what serving engines do to get more tokens than modules; never trained, so expect
lower acceptance there). Each module keeps its own KV cache over t, rolled back at commit to
the entries whose inputs were all committed tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from models.protocol import DraftOutput

if TYPE_CHECKING:
    from train.target import Target, TargetOutput


class MTPModule(nn.Module):
    """One depth: norm both inputs, concatenate, project 2H -> H, one decoder layer."""

    def __init__(self, block_config: LlamaConfig):
        super().__init__()
        hidden, eps = block_config.hidden_size, block_config.rms_norm_eps
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)  # for h^{d-1}
        self.embed_norm = LlamaRMSNorm(hidden, eps=eps)  # for emb(x_{t+d})
        self.proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = LlamaDecoderLayer(block_config, layer_idx=0)  # layer 0 of its own cache
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
    ):
        super().__init__()
        if num_depths < 1:
            raise ValueError(f"num_depths={num_depths}: an MTP draft needs at least 1 module.")
        self.num_depths = num_depths
        self.recursive_last = recursive_last
        self.vocab_size = vocab_size
        self.block_config = LlamaConfig(
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
        self.depths = nn.ModuleList(MTPModule(self.block_config) for _ in range(num_depths))
        # inv_freq is a non-persistent buffer that follows .to(device); decoding copies are
        # cast with models.protocol.cast_keep_rotary, which keeps it float32 (a bare
        # .to(bfloat16) would round it and shift every rotary angle).
        self.rotary = LlamaRotaryEmbedding(self.block_config)

    def head(self, target: Target, module: MTPModule, hidden: Tensor) -> Tensor:
        # The frozen head may be in another dtype (a bf16 target under an fp32 draft).
        weight = target.lm_head.weight
        return F.linear(module.final_norm(hidden).to(weight.dtype), weight)  # [B, L, V]

    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # [B, T], right-padded
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
                "MTP training expects right-padded batches (train.data.collate pads right)."
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
        for d, module in enumerate(self.depths, start=1):
            L = T - d  # positions t with x_{t+d} inside the sequence
            hidden = module(hidden[:, :L], embeds[:, d : d + L], (cos[:, :L], sin[:, :L]))
            # Zero-pad the hidden (not the logits: cheaper) to [B, T, H] so every offset has T
            # positions as the protocol says; the loop drops t >= T - d anyway.
            padded = torch.cat([hidden, hidden.new_zeros(B, d, hidden.shape[-1])], dim=1)
            logits.append(self.head(target, module, padded))  # [B, T, V]
        return DraftOutput(logits=logits, offsets=list(range(1, self.num_depths + 1)))

    def make_drafter(self, target: Target) -> MTPDrafter:
        return MTPDrafter(self, target)


def from_target(
    target: Target,
    token_counts: Tensor | None = None,  # unused: MTP predicts over the full vocabulary
    num_depths: int = 2,
    recursive_last: bool = True,
    intermediate_size: int | None = None,  # None = the target's
    num_heads: int | None = None,  # None = the target's (num_kv_heads follows unless given)
    num_kv_heads: int | None = None,
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
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=rope["max_position_embeddings"],
        rope_parameters=rope["rope_parameters"],
        num_depths=num_depths,
        recursive_last=recursive_last,
    )
    with torch.no_grad():  # start each module's own output norm from the target's final norm
        for module in model.depths:
            module.final_norm.weight.copy_(target.final_norm_weight)
    return model.to(device=target.device)


# ---------------------------------------------------------------------------------
# Drafting
# ---------------------------------------------------------------------------------


class MTPDrafter:
    """Chain drafter over an MTP draft (the Drafter protocol in decoding/drafter.py).

    State, for a committed sequence x_0..x_{N-1} with the target's features h^0_0..h^0_{N-1}:
      tokens [B, N]; features[0] = h^0 [B, N, H];
      features[d] [B, n_d, H] = module d's outputs at positions 0..n_d-1, where n_d is also the
      length of caches[d-1] (entries are appended and cropped together).
    propose() first brings module d up to date on the positions it has not seen, then drafts.
    """

    hidden_layers: tuple[int, ...] = (-1,)

    def __init__(self, model: MTP, target: Target):
        if model.vocab_size != target.vocab_size:
            raise ValueError(
                f"MTP draft built for a vocabulary of {model.vocab_size}, target has "
                f"{target.vocab_size}: build the draft from this target (models.mtp.from_target)."
            )
        self.model = model
        self.target = target
        self.num_depths = model.num_depths
        self.vocab_size = target.vocab_size

    @torch.no_grad()
    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        """`attention_mask` [B, T] (1 = real) when the decoder left-padded the prompts."""
        B, N = input_ids.shape
        # Left padding: row b's real tokens start at index pads[b]; position ids count real
        # tokens only (as the decoder does for the target) and pad entries are never attended.
        if attention_mask is None:
            self.pads = torch.zeros(B, dtype=torch.long, device=input_ids.device)
        else:
            self.pads = (attention_mask == 0).long().sum(-1).to(input_ids.device)  # [B]
        hidden = target_out.hidden[-1].to(self.model.depths[0].proj.weight.dtype)  # [B, N, H]
        self.tokens = input_ids
        self.features = [hidden] + [hidden.new_zeros(B, 0, hidden.shape[-1])] * self.num_depths
        self.caches = [DynamicCache() for _ in range(self.num_depths)]
        self._pending: tuple[Tensor, Tensor] | None = None  # (last_tokens [B], drafts [B, k])

    def _run(self, depth: int, prev_hidden: Tensor, token_ids: Tensor, start: int) -> Tensor:
        """Module `depth` over positions start..start+L-1 with its cache; returns its h [B, L, H]."""
        module = self.model.depths[depth - 1]
        cache = self.caches[depth - 1]
        if cache.get_seq_length() != start:
            raise RuntimeError(
                f"MTP depth {depth}: cache holds {cache.get_seq_length()} positions, expected {start}."
            )
        L = prev_hidden.shape[1]
        q_idx = torch.arange(start, start + L, device=prev_hidden.device)  # [L] sequence index
        positions = (q_idx[None, :] - self.pads[:, None]).clamp_min(0)  # [B, L]
        cos_sin = self.model.rotary(prev_hidden, positions)
        mask = None  # unpadded single query: it attends to the whole cache
        if L > 1 or bool(self.pads.any()):
            # sdpa's is_causal is top-left aligned, wrong beside a cache: spell the mask out.
            k_idx = torch.arange(start + L, device=prev_hidden.device)  # [kv]
            causal = k_idx[None, :] <= q_idx[:, None]  # [L, kv]
            real = k_idx[None, :] >= self.pads[:, None]  # [B, kv]
            diag = k_idx[None, :] == q_idx[:, None]  # a pad query sees itself: no empty rows
            mask = ((causal[None] & real[:, None]) | diag[None])[:, None]  # [B, 1, L, kv]
        embeds = self.target.embed_tokens(token_ids).to(prev_hidden.dtype)  # [B, L, H]
        hidden = module(prev_hidden, embeds, cos_sin, attention_mask=mask, cache=cache)
        self.features[depth] = torch.cat([self.features[depth], hidden], dim=1)
        return hidden

    def _sample(
        self, depth: int, hidden: Tensor, sampling: Sampling, generator
    ) -> tuple[Tensor, Tensor | None]:
        logits = self.model.head(self.target, self.model.depths[depth - 1], hidden)  # [B, V]
        if sampling.greedy:
            return logits.argmax(-1), None
        probs = sampling_probs(logits, sampling)  # [B, V], the verifier's transform of p
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs

    @torch.no_grad()
    def propose(
        self, last_tokens: Tensor, k: int, sampling: Sampling, generator=None
    ) -> tuple[Tensor, Tensor | None]:
        D = self.num_depths
        if k > D and not self.model.recursive_last:
            raise ValueError(
                f"k={k} drafts but the MTP draft has {D} modules and recursive_last=false: "
                f"decode with k <= {D}, or set draft.model.recursive_last=true."
            )
        seq = torch.cat([self.tokens, last_tokens[:, None]], dim=1)  # [B, N+1] x_0..x_N
        P = self.tokens.shape[1] - 1  # newest position with a target feature
        drafts, probs = [], []
        for j in range(1, k + 1):
            if j <= D:  # module j at positions n_j..P (catch-up + the draft position P)
                start = self.caches[j - 1].get_seq_length()
                prev = self.features[j - 1][:, start : P + 1]  # [B, P+1-start, H]
                hidden = self._run(j, prev, seq[:, start + j : P + j + 1], start)[:, -1]
                token, q = self._sample(j, hidden, sampling, generator)
            else:  # module D again at position P+j-D, its own last output standing in for h^{D-1}
                start = P + j - D
                prev = self.features[D][:, -1:]  # [B, 1, H]
                hidden = self._run(D, prev, seq[:, P + j : P + j + 1], start)[:, -1]
                token, q = self._sample(D, hidden, sampling, generator)
            drafts.append(token)
            probs.append(q)
            seq = torch.cat([seq, token[:, None]], dim=1)  # x_{P+j+1} = d_j
        drafts_t = torch.stack(drafts, dim=1)  # [B, k]
        self._pending = (last_tokens, drafts_t)
        return drafts_t, None if sampling.greedy else torch.stack(probs, dim=1)  # [B, k, V]

    @torch.no_grad()
    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        if self._pending is None:
            raise RuntimeError("MTPDrafter.commit called without a propose before it.")
        last_tokens, drafts = self._pending
        self._pending = None
        n = num_accepted
        if emitted.shape[1] != n + 1 or target_out.hidden[-1].shape[1] != n + 1:
            raise ValueError(
                f"commit(num_accepted={n}) needs emitted and target_out over n+1={n + 1} positions; "
                f"got {emitted.shape[1]} and {target_out.hidden[-1].shape[1]}."
            )
        if not torch.equal(emitted[:, :n], drafts[:, :n]):
            raise ValueError(
                "commit: the first num_accepted emitted tokens must be the accepted drafts."
            )
        N_old = self.tokens.shape[1]
        self.tokens = torch.cat([self.tokens, last_tokens[:, None], emitted[:, :n]], dim=1)
        new_feats = target_out.hidden[-1].to(self.features[0].dtype)  # [B, n+1, H]
        self.features[0] = torch.cat([self.features[0], new_feats], dim=1)
        N_new = self.tokens.shape[1]  # = N_old + n + 1; emitted[:, n] is the next last_tokens
        for d in range(1, self.num_depths + 1):
            # Keep entries whose inputs were all committed: token x_{t+d} is committed for
            # t + d <= N_old + n, and positions >= N_old were recursive (not h^{d-1}) entries.
            keep = min(self.caches[d - 1].get_seq_length(), N_new - d, N_old)
            drop = self.caches[d - 1].get_seq_length() - keep
            if drop > 0:
                self.caches[d - 1].crop(-drop)
                self.features[d] = self.features[d][:, :keep]
