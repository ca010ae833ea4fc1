"""How a fresh DFlash or Domino draft (models/dflash.py, models/domino.py) starts from its
target: the layer sizes and rope settings it copies, its taps (DFlash's default spread or
checked `layers`), its vocabulary arguments, and the init of its output norm and mask vector.
Its reduced draft vocabulary is built by models/vocab.py."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models import vocab
from models.target import Target


def default_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's taps (z-lab `build_target_layer_ids`) as HF hidden_states indices (layer id
    + 1): one draft layer reads the middle target layer; n layers read n target layers
    spread evenly from layer 1 to layer L - 3. Clamped into the target (tiny targets)."""
    L, n = num_target_layers, num_draft_layers
    if n == 1:
        ids = [L // 2]
    else:
        start, end = 1, max(L - 3, 1)
        ids = [round(start + i * (end - start) / (n - 1)) for i in range(n)]
    return sorted({min(max(i, 0), L - 1) + 1 for i in ids})


def draft_vocab(target: Target, vocab_size: int | str) -> dict:
    """`vocab_size` ("full" or N) -> the constructor's vocabulary arguments."""
    size = vocab.reduced_size(vocab_size, target.vocab_size)
    return dict(target_vocab_size=target.vocab_size, draft_vocab_size=size)


def draft_sizes(target: Target, intermediate_size: int | None) -> dict:
    """The layer sizes and rope settings a DFlash / Domino draft copies from the target."""
    cfg = target.config
    rope = target.rope_kwargs()
    rope_parameters = rope.get("rope_parameters") or {
        "rope_type": "default",
        "rope_theta": rope.get("rope_theta", 10000.0),
    }
    return dict(
        hidden_size=target.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None) or target.hidden_size // cfg.num_attention_heads,
        intermediate_size=intermediate_size or cfg.intermediate_size,
        max_position_embeddings=rope["max_position_embeddings"],
        rope_parameters=rope_parameters,
        rms_norm_eps=getattr(cfg, "rms_norm_eps", 1e-5),
        hidden_act=getattr(cfg, "hidden_act", "silu"),
    )


def check_layers(target: Target, layers: list[int] | None, num_layers: int) -> list[int]:
    """The taps to read: `layers` checked against the target, or DFlash's default."""
    if layers is None:
        return default_layers(target.num_layers, num_layers)
    bad = [la for la in layers if not -1 <= la <= target.num_layers]
    if bad or not layers:
        raise ValueError(
            f"layers {list(layers)}: give target hidden_states indices 0..{target.num_layers} "
            "(-1 = last), at least one"
        )
    return list(layers)


def init_from_target(draft: nn.Module, target: Target, token_counts: Tensor | None) -> None:
    """Start the output norm of a DFlashDraft (or DominoDraft) from the target's final norm
    (the head sees target-sized features) and the mask vector at the size of a target
    embedding row; build a reduced vocabulary from `token_counts` (without them it must come
    from a checkpoint)."""
    if draft.vocab_ids is not None and token_counts is not None:
        vocab.build(draft, token_counts, target.eos_token_ids)
    with torch.no_grad():
        draft.norm.weight.copy_(target.final_norm_weight)
        # A number: a GPU scalar times a CPU randn raises; drawn on the CPU on every device.
        if draft.mask_token_id is not None:  # the served layout: the target's own row
            ids = torch.tensor([draft.mask_token_id], device=target.embed_tokens.weight.device)
            draft.mask_vector.copy_(target.embed_tokens(ids)[0].to(draft.mask_vector))
            return
        std = float(target.embed_tokens.weight.float().std())
        draft.mask_embedding.copy_(torch.randn(draft.mask_embedding.shape) * std)


def resolve_mask_token(target: Target, setting: int | str | None) -> int | None:
    """draft.model.mask_token_id: None (a learned vector), an id of the target's vocabulary, or
    "auto": the tokenizer's mask token, else its pad token."""
    if setting is None:
        return None
    if setting == "auto":
        tok = target.tokenizer
        found = None if tok is None else next(
            (i for i in (tok.mask_token_id, tok.pad_token_id) if i is not None), None
        )  # fmt: skip
        if found is None:
            raise ValueError(
                "mask_token_id=auto: the target's tokenizer has neither a mask nor a pad token; "
                "set draft.model.mask_token_id to an id of its vocabulary"
            )
        return int(found)
    if (
        isinstance(setting, bool)
        or not isinstance(setting, int)
        or not 0 <= setting < target.vocab_size
    ):
        raise ValueError(
            f"mask_token_id={setting!r}: give an id in 0..{target.vocab_size - 1}, auto, or null "
            "(a learned mask vector)"
        )
    return setting
