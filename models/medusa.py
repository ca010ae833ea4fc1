"""Medusa heads (Cai et al., 2024): K extra heads on the target's last hidden state.

Alignment (models/protocol.py): head i (0-based) at position t predicts token x_{t+i+2},
i.e. offset i+1; the target's own head covers offset 0 (x_{t+1}).

Each head = L residual blocks `h + SiLU(W h + b)` with W and b zero-initialised (SiLU(0) = 0,
so a fresh head passes h through unchanged and equals the target's next-token head), then
an output layer over the full vocabulary:
  head_init="shared" (default): the target's frozen lm_head, read from `target` at call time.
  head_init="copy": a trained copy of the target's lm_head per head (the paper's Medusa-1).
Why shared is the default here: on SmolLM2 a copied head is 49152x576 = 28.3M parameters,
so 4 copies add 113M trained parameters (0.45 GB fp32, ~1.8 GB with grads and AdamW state)
to train a 1.3M-parameter block stack, and their weight gradients are a third of the head
compute per step. At decode time a shared head also lets all k heads go through ONE
[k, H] x [H, V] matmul (flat cost in bf16 on this CPU) instead of k separate ones
(1.75 ms each). `copy` is there for paper-faithful runs and larger machines.

Medusa-2 (`medusa2=True`): joint training with a LoRA adapter (peft) on a private copy of
the target's backbone. The training loop keeps running the frozen original target under
no-grad; its logits are the teacher for every head AND for the adapted backbone's own
next-token prediction (`aux_loss` = lm_loss_weight * KL(p_target || p_adapted) over all
real tokens), which keeps the adapted model's outputs where they were. The heads read the
adapted hidden state. The copy's frozen base weights are dropped from `state_dict`, so a
checkpoint holds only the heads and the LoRA matrices. At decode time `merged_target()`
gives the adapted model (LoRA merged) to verify with; verifying with the original target
still works (the LoRA is kept close to it) but the heads then read slightly different
features from the ones they were trained on.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from models.protocol import DraftOutput, cast_keep_rotary
from train.losses import forward_kl

if TYPE_CHECKING:
    from decoding.tree import DraftTree, TreeSpec
    from train.target import Target, TargetOutput

HEAD_INITS = ("shared", "copy")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class ResBlock(nn.Module):
    """h + SiLU(W h + b), zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)  # the paper zeroes only W; SiLU(b) != 0 would shift h

    def forward(self, h: Tensor) -> Tensor:
        return h + F.silu(self.linear(h))


class MedusaHeads(nn.Module):
    hidden_layers = (-1,)  # the last layer after the final norm: the input of lm_head

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        num_heads: int = 4,
        num_layers: int = 1,
        head_init: str = "shared",
        lm_head_weight: Tensor | None = None,  # [V, H], copied when head_init="copy"
        adapted_backbone: nn.Module | None = None,  # Medusa-2: LoRA-wrapped backbone copy
        lm_loss_weight: float = 1.0,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(
                f"Medusa needs num_heads >= 1 and num_layers >= 0, got {num_heads} and "
                f"{num_layers}; set draft.model.num_heads / draft.model.num_layers."
            )
        if head_init not in HEAD_INITS:
            raise ValueError(f"head_init={head_init!r}; use one of {HEAD_INITS}.")
        self.num_heads, self.vocab_size, self.head_init = num_heads, vocab_size, head_init
        # One Sequential per head and one ResBlock per layer: `[ResBlock(H)] * L` would
        # repeat the same module (shared weights).
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(hidden_size) for _ in range(num_layers)))
            for _ in range(num_heads)
        )
        self.out = None
        if head_init == "copy":
            if lm_head_weight is None or tuple(lm_head_weight.shape) != (vocab_size, hidden_size):
                got = None if lm_head_weight is None else tuple(lm_head_weight.shape)
                raise ValueError(
                    f"head_init='copy' needs the target's lm_head weight [V={vocab_size}, "
                    f"H={hidden_size}], got {got}; build with medusa.from_target(target)."
                )
            self.out = nn.ModuleList(
                nn.Linear(hidden_size, vocab_size, bias=False) for _ in range(num_heads)
            )
            with torch.no_grad():
                for linear in self.out:
                    linear.weight.copy_(lm_head_weight)
        self.adapted = adapted_backbone
        self.lm_loss_weight = lm_loss_weight
        if adapted_backbone is not None:
            self.register_state_dict_post_hook(_drop_frozen_backbone_keys)
            self.register_load_state_dict_post_hook(_ignore_frozen_backbone_keys)

    # -- the heads -------------------------------------------------------------
    def head_logits(self, hidden: Tensor, target: Target, heads: int | None = None) -> list[Tensor]:
        """Logits of the first `heads` heads on the same feature: list of [..., V]."""
        heads = self.num_heads if heads is None else heads
        if len(self.blocks[0]):  # run the blocks in their own dtype (bf16 draft, fp32 target...)
            hidden = hidden.to(self.blocks[0][0].linear.weight.dtype)
        feats = [self.blocks[i](hidden) for i in range(heads)]  # [..., H] each
        if self.out is not None:
            return [self.out[i](f) for i, f in enumerate(feats)]
        lm_head = target.lm_head
        # Shared frozen head: one matmul for all heads (one [.., heads*, H] call is flat in bf16).
        stacked = torch.stack(feats, dim=-2).to(lm_head.weight.dtype)  # [..., heads, H]
        return list(lm_head(stacked).unbind(dim=-2))  # heads x [..., V]

    # -- training --------------------------------------------------------------
    def forward(
        self,
        target: Target,
        input_ids: Tensor,  # [B, T]
        target_out: TargetOutput,
        attention_mask: Tensor | None = None,  # [B, T]
    ) -> DraftOutput:
        aux_loss = None
        if self.adapted is None:
            if -1 not in target_out.hidden:
                raise ValueError(
                    "Medusa reads the target's last hidden state: run the target with "
                    "hidden_layers=draft.hidden_layers (= (-1,))."
                )
            hidden = target_out.hidden[-1]  # [B, T, H], frozen
        else:
            hidden = self.adapted(
                input_ids=input_ids, attention_mask=attention_mask, use_cache=False
            ).last_hidden_state  # [B, T, H], grads flow into the LoRA matrices
            own_logits = target.head_logits(hidden.to(target.dtype))  # [B, T, V]
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            vocab = own_logits.shape[-1]
            lm_kl = forward_kl(
                own_logits.reshape(-1, vocab),
                target_out.logits.reshape(-1, vocab),
                mask.reshape(-1),
            )
            aux_loss = self.lm_loss_weight * lm_kl
        logits = self.head_logits(hidden, target)  # K x [B, T, V]
        return DraftOutput(
            logits=logits,
            offsets=[i + 1 for i in range(self.num_heads)],
            aux_loss=aux_loss,
            extras={} if aux_loss is None else {"lm_kl": lm_kl.detach()},
        )

    def make_drafter(self, target: Target) -> MedusaDrafter:
        return MedusaDrafter(self, target)

    # -- Medusa-2 at decode time --------------------------------------------------
    @torch.no_grad()
    def merged_target(self, target: Target) -> Target:
        """A new Target whose backbone is the adapted one with LoRA merged (Medusa-2 decoding)."""
        from train.target import Target

        if self.adapted is None:
            return target
        model = copy.deepcopy(target.model)
        backbone = copy.deepcopy(self.adapted)
        for module in backbone.modules():
            if hasattr(module, "merge") and hasattr(module, "lora_A"):
                module.merge()
        state = {
            k.replace(".base_layer", ""): v
            for k, v in backbone.state_dict().items()
            if "lora_" not in k
        }
        model.model.load_state_dict(state, strict=True)
        model = cast_keep_rotary(model, target.dtype)  # float32 rotary, as in `target`
        return Target(model, target.tokenizer, name=f"{target.name}+medusa2-lora")


def _is_frozen_backbone_key(key: str) -> bool:
    return ("." + key).find(".adapted.") >= 0 and "lora_" not in key


def _drop_frozen_backbone_keys(module, state_dict, prefix, local_metadata) -> None:
    # The LoRA copy's base weights are the target's; checkpoints hold only trained weights.
    for key in [
        k for k in state_dict if k.startswith(prefix) and _is_frozen_backbone_key(k[len(prefix) :])
    ]:
        del state_dict[key]


def _ignore_frozen_backbone_keys(module, incompatible_keys) -> None:
    missing = incompatible_keys.missing_keys
    missing[:] = [k for k in missing if not _is_frozen_backbone_key(k)]


def from_target(
    target: Target,
    token_counts: Tensor | None = None,  # unused: Medusa heads predict the full vocabulary
    num_heads: int = 4,
    num_layers: int = 1,
    head_init: str = "shared",
    medusa2: bool = False,
    lora_rank: int = 8,
    lora_alpha: float = 16.0,
    lora_dropout: float = 0.0,
    lora_target_modules: tuple[str, ...] | list[str] = LLAMA_LINEARS,
    lm_loss_weight: float = 1.0,
) -> MedusaHeads:
    """Medusa heads sized from `target`; fresh heads reproduce the target's next-token head."""
    adapted = None
    if medusa2:
        from peft import LoraConfig, inject_adapter_in_model

        # A private copy: the loop's target stays frozen and is the teacher for the adapter.
        adapted = copy.deepcopy(target.model.model).requires_grad_(False)
        config = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=list(lora_target_modules),
        )
        adapted = inject_adapter_in_model(config, adapted)
        for name, param in adapted.named_parameters():
            param.requires_grad_("lora_" in name)
    heads = MedusaHeads(
        hidden_size=target.hidden_size,
        vocab_size=target.vocab_size,
        num_heads=num_heads,
        num_layers=num_layers,
        head_init=head_init,
        lm_head_weight=target.lm_head.weight.detach() if head_init == "copy" else None,
        adapted_backbone=adapted,
        lm_loss_weight=lm_loss_weight,
    )
    return heads.to(device=target.device)


# ---------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------


class MedusaDrafter:
    """Chain and static-tree drafting from Medusa heads (trees: `propose_tree`, docs/tree.md).

    Alignment at the start of a round: the newest token c (`last_tokens`) is known but not
    yet in the target's cache, so the newest target feature is h_t of the position BEFORE
    c, whose next token is c. Head i at t predicts x_{t+i+2}: head 0 gives the token after
    c (d_1), head j-1 gives d_j. The heads never see c itself; that is Medusa's design.
    After verification the kept positions are [c, d_1..d_n] and the newest one's feature
    predicts the new correction/bonus token, so it becomes the next round's h_t.
    """

    hidden_layers = (-1,)

    def __init__(self, heads: MedusaHeads, target: Target):
        self.heads, self.target = heads, target
        self.vocab_size = heads.vocab_size  # full target vocabulary (the decoder checks it)
        self.feature: Tensor | None = None  # [B, H]: last-layer feature before last_tokens

    def prefill(
        self, input_ids: Tensor, target_out: TargetOutput, attention_mask: Tensor | None = None
    ) -> None:
        # Prompts are left-padded for generation, so position -1 is every row's last token.
        self.feature = target_out.hidden[-1][:, -1]

    @torch.no_grad()
    def propose(
        self,
        last_tokens: Tensor,  # [B], unused: the heads read h_t only
        k: int,
        sampling: Sampling,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if self.feature is None:
            raise RuntimeError("MedusaDrafter.propose called before prefill().")
        if k < 1:
            raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
        # K heads give at most K drafts; the decoder accepts a shorter proposal (adaptive k
        # may ask for more than K). Train more heads (draft.model.num_heads) for longer chains.
        k = min(k, self.heads.num_heads)
        heads = self.heads.head_logits(self.feature, self.target, heads=k)  # k x [B, V]
        logits = torch.stack(heads, dim=1)  # [B, k, V]
        if sampling.greedy:
            return logits.argmax(-1), None
        q = sampling_probs(logits, sampling)  # [B, k, V], the verifier's own transform
        batch, _, vocab = q.shape
        tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=generator).view(batch, k)
        return tokens, q

    @torch.no_grad()
    def propose_tree(
        self,
        last_tokens: Tensor,  # [B], unused (as in propose)
        tree: TreeSpec,
        sampling: Sampling,
        generator: torch.Generator | None = None,
        max_depth: int | None = None,
    ) -> DraftTree:
        """A static tree (Medusa "choices", Cartesian over the heads): the node at path
        (r_1..r_d) holds candidate r_d of head d-1, the same for every parent at that depth.
        Greedy: candidates = each head's top-k, q = None. Sampling: each head's candidates
        are drawn WITHOUT replacement from its q (Gumbel top-k), and node r carries q with
        candidates 0..r-1 removed and renormalised: the exact distribution it was drawn
        from given its earlier siblings, as tree verification requires (decoding/verify.py)."""
        from decoding.tree import DraftTree, static_parents, static_tree

        if self.feature is None:
            raise RuntimeError("MedusaDrafter.propose_tree called before prefill().")
        if tree.kind != "static":
            raise ValueError(
                f"Medusa heads draft static trees (decode.tree.kind=static), got {tree.kind!r}"
            )
        depth = min(tree.max_depth, self.heads.num_heads, max_depth or tree.max_depth)
        paths = static_tree(tuple(p for p in tree.paths if len(p) <= depth))
        parents = static_parents(paths)
        ranks = max(p[-1] for p in paths) + 1  # candidates needed per head
        heads = self.heads.head_logits(self.feature, self.target, heads=depth)
        logits = torch.stack(heads, dim=1).float()  # [B, D, V]
        batch, _, vocab = logits.shape
        if ranks > vocab:
            raise ValueError(
                f"tree asks for candidate rank {ranks - 1} of a {vocab}-token vocabulary"
            )
        q_nodes = None
        if sampling.greedy:
            cand = logits.topk(ranks, dim=-1).indices  # [B, D, R]
        else:
            q = sampling_probs(logits, sampling)  # [B, D, V], the verifier's own transform
            cand, q_rank = _draw_without_replacement(
                q, logits, ranks, generator
            )  # [B,D,R], [B,D,R,V]
        node_depth = torch.tensor([len(p) - 1 for p in paths], device=logits.device)  # head ids
        node_rank = torch.tensor([p[-1] for p in paths], device=logits.device)
        tokens = cand[:, node_depth, node_rank]  # [B, N]
        if not sampling.greedy:
            q_nodes = q_rank[:, node_depth, node_rank]  # [B, N, V]
        parent_ids = torch.tensor(parents, device=logits.device).expand(batch, -1)
        return DraftTree(tokens, parent_ids, q_nodes)

    def commit(self, num_accepted: int, emitted: Tensor, target_out: TargetOutput) -> None:
        # The newest kept position's feature: its next token is emitted[:, -1].
        self.feature = target_out.hidden[-1][:, -1]


def _draw_without_replacement(
    q: Tensor,  # [B, D, V] sampling distributions
    logits: Tensor,  # [B, D, V] raw logits (order of the fallback candidates)
    ranks: int,
    generator: torch.Generator | None,
) -> tuple[Tensor, Tensor]:
    """R draws without replacement per distribution (Gumbel top-k on log q) -> tokens
    [B, D, R] and, per draw, the distribution it came from given the earlier draws
    [B, D, R, V] (q minus earlier draws, renormalised). Once q's support is used up (top-k /
    top-p), the remaining candidates are the next tokens by logit, a deterministic choice:
    their distribution is their one-hot."""
    gumbel = -torch.empty_like(q).exponential_(generator=generator).log()
    keys = torch.where(q > 0, q.log() + gumbel, float("-inf"))
    drawn = keys.topk(ranks, dim=-1).indices  # [B, D, R]; invalid past the support
    support = (q > 0).sum(-1, keepdim=True)  # [B, D, 1]
    rank = torch.arange(ranks, device=q.device)
    fallback = logits.masked_fill(q > 0, float("-inf")).topk(ranks, dim=-1).indices
    late = rank >= support  # [B, D, R] draws past the support
    fallback = fallback.gather(-1, (rank - support).clamp_min(0))
    tokens = torch.where(late, fallback, drawn)
    earlier = F.one_hot(tokens, q.shape[-1]).cumsum(2) - F.one_hot(tokens, q.shape[-1])
    remaining = q[:, :, None] * (earlier == 0)  # [B, D, R, V]
    mass = remaining.sum(-1, keepdim=True)
    own = F.one_hot(tokens, q.shape[-1]).to(q.dtype)
    q_rank = torch.where(late[..., None], own, remaining / mass.clamp_min(1e-30))
    return tokens, q_rank
