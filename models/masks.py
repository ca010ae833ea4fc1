"""Position ids and attention masks of entries appended to a KV cache, with the left padding
of a batch of prompts (decoding/spec.py pads left): what every drafter that runs layers over
a cache (decoding/drafters/{eagle,mtp,selfspec}.py, models/selfspec.py) builds its inputs
from."""

from __future__ import annotations

import torch
from torch import Tensor


def left_padding(attention_mask: Tensor | None) -> Tensor | None:
    """[B] left-padding slots per row of a prefill's attention_mask [B, T] (1 = real token);
    None when no row is padded."""
    if attention_mask is None or not bool((attention_mask == 0).any()):
        return None
    return (attention_mask == 0).long().sum(-1)


def positions_and_mask(
    start: int,
    length: int,
    pad: Tensor | None,
    device: torch.device,
    kv_len: int | None = None,
    rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Position ids and attention mask of `length` entries appended at cache slots
    start..start+length-1, attending causally to the cache and to each other.

    With left padding `pad` [B], row b's first pad[b] slots are padding: position ids count
    real tokens only, and padding keys are masked out (a padding query still sees itself,
    so no softmax row is empty). Returns positions [1|B, length] and a bool mask (True =
    attend) [1|B, 1, length, start+length], or None for one unpadded query (it sees the
    whole cache). The mask is spelled out because sdpa's `is_causal` is top-left aligned,
    wrong beside a cache. `kv_len`: a static cache's size (decoding/compiled.py), whose
    attention reads every slot: the mask is then always given, kv_len wide, and hides the
    slots past the new entries. `rows` (with kv_len): positions and mask get that many rows
    even without padding, so that a padded batch runs the graph an unpadded one compiled."""
    if rows is not None:
        positions, mask = positions_and_mask(start, length, pad, device, kv_len)
        return positions.expand(rows, -1), mask.expand(rows, -1, -1, -1)
    slots = torch.arange(start, start + length, device=device)  # cache slots of the new entries
    keys = torch.arange(start + length if kv_len is None else kv_len, device=device)
    causal = keys[None, :] <= slots[:, None]  # [L, kv], bottom-right aligned
    if pad is None:
        needed = length > 1 or kv_len is not None
        return slots[None], causal[None, None] if needed else None  # [1, L], [1, 1, L, kv]
    positions = (slots[None, :] - pad[:, None]).clamp_min(0)  # [B, L]
    real = keys[None, :] >= pad[:, None]  # [B, kv]
    own = keys[None, :] == slots[:, None]  # [L, kv]
    return positions, (causal[None] & (real[:, None, :] | own[None]))[:, None]  # [B, 1, L, kv]
