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
[k, H] x [H, V] matmul (flat cost in bf16 on a CPU) instead of k separate ones, each a
large share of a token's cost (docs/design.md §5). `copy` is there for paper-faithful runs
and larger machines.

Medusa-2 (`medusa2=True`): joint training with a LoRA adapter (peft) on the target's
backbone: new modules over the target's own frozen weight tensors (no second copy), the
LoRA matrices float32 whatever the target's dtype. The training loop keeps running the
frozen original target under no-grad; its logits are the teacher for every head AND for the
adapted backbone's own next-token prediction (lm_loss_weight * KL(p_target || p_adapted)
over all real tokens, computed by the training step from `DraftOutput.adapted_logits`:
train/core/step_stats.py), which keeps the adapted model's outputs where they were. The heads
read the adapted hidden state. The frozen base weights are dropped from `state_dict`, so a
checkpoint holds only the heads and the LoRA matrices. At decode time `decoding_target()`
gives the adapted model to verify with (again over the decoding target's own weights, the
LoRA beside them, not merged); an export merges it into a copy (`merged_causal_lm`).
Verifying with the original target still works (the LoRA is kept close to it) but the heads
then read slightly different features from the ones they were trained on.

The decoder's drafter (chains and static trees) is decoding/drafters/medusa.py.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.dtypes import cast_keep_rotary
from models.protocol import DraftOutput
from models.target import Target, TargetOutput

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
    kind = "medusa"
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
        loss_mask: Tensor | None = None,  # unused: every position trains
    ) -> DraftOutput:
        adapted_logits = None
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
            # The adapted model's own next-token logits: the training step adds
            # lm_loss_weight * KL(p_target || p_adapted) (train/core/step.py: aux_loss).
            adapted_logits = target.head_logits(hidden.to(target.dtype))  # [B, T, V]
        logits = self.head_logits(hidden, target)  # K x [B, T, V]
        return DraftOutput(
            logits=logits,
            offsets=[i + 1 for i in range(self.num_heads)],
            adapted_logits=adapted_logits,
            adapted_loss_weight=self.lm_loss_weight if adapted_logits is not None else 0.0,
        )

    def set_progress(self, progress: float) -> None:
        """No schedule of its own: training progress changes nothing here."""

    # -- Medusa-2 at decode time and export --------------------------------------
    @torch.no_grad()
    def decoding_target(self, target: Target) -> Target:
        """The target the decoder verifies with: `target` itself for Medusa-1; for Medusa-2
        the adapted target over `target`'s own weights (new modules, the same tensors, this
        draft's LoRA beside them in float32, not merged): no copy of the target or of the
        backbone, and drafts are judged against (lossless with respect to) the adapted
        target."""
        if self.adapted is None:
            return target
        from peft import inject_adapter_in_model

        model = shared_copy(target.model)
        model.model = inject_adapter_in_model(copy.deepcopy(self.lora_config), model.model)
        float32_lora(model.model)
        lora = {k: v for k, v in self.adapted.state_dict().items() if "lora_" in k}
        _, unexpected = model.model.load_state_dict(lora, strict=False)
        if unexpected or len(lora) != sum("lora_" in k for k in model.model.state_dict()):
            raise ValueError(f"Medusa-2's LoRA does not fit the target {target.name}")
        return Target(model, target.tokenizer, name=f"{target.name}+medusa2-lora")

    @torch.no_grad()
    def merged_causal_lm(self, target: Target) -> nn.Module:
        """Medusa-2's adapted target as a plain HF causal LM, LoRA merged into a copy of
        the target's weights (an export writes it: train/formats/export.py)."""
        model = copy.deepcopy(target.model)
        backbone = copy.deepcopy(self.adapted)
        for module in backbone.modules():
            if hasattr(module, "merge") and hasattr(module, "lora_A"):
                module.merge()
        state = {
            k.replace(".base_layer", ""): v.to(target.dtype)
            for k, v in backbone.state_dict().items()
            if "lora_" not in k
        }
        model.model.load_state_dict(state, strict=True)
        return cast_keep_rotary(model, target.dtype)  # float32 rotary, as in `target`


def shared_copy(module: nn.Module) -> nn.Module:
    """A copy of `module`'s structure whose parameters and buffers are `module`'s own tensors
    (a deepcopy memo maps each to itself): no weight is copied."""
    memo = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return copy.deepcopy(module, memo)


def float32_lora(module: nn.Module) -> None:
    """LoRA matrices in float32 whatever the base's dtype (peft gives them the base layer's):
    AdamW then updates float32 weights, and peft's forward casts the input to them."""
    for name, param in module.named_parameters():
        if "lora_" in name:
            param.data = param.data.float()


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
        # peft only for Medusa-2: its import is slow, and Medusa-1 never needs it.
        from peft import LoraConfig, inject_adapter_in_model

        # The backbone's modules copied, its weights the target's own tensors (frozen, never
        # a second copy); the loop's target stays as it was and is the adapter's teacher.
        adapted = shared_copy(target.model.model)
        config = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            lora_dropout=lora_dropout,
            target_modules=list(lora_target_modules),
        )
        adapted = inject_adapter_in_model(config, adapted)
        float32_lora(adapted)
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
    heads.lora_config = config if medusa2 else None  # decoding_target adapts its target alike
    return heads.to(device=target.device)
