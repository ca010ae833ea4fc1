"""A preallocated KV cache with in-place rollback, for compiled decoding (decoding/compiled.py).

Every layer holds keys and values [B, H_kv, max_len, D], allocated at its first write and
never reallocated, so a compiled forward sees the same shapes and addresses every round
(CUDA graphs replay from fixed addresses). The sequence occupies slots [0, length); a
forward of T tokens writes slots [length, length + T). Attention reads all max_len slots:
the caller's 4D mask hides the slots past the sequence, so what a slot holds there
(rolled-back drafts, padding) never matters.

A layer range may also be written at slots of its own (`SlotWriter`, the self-speculative
drafter's first layers, ahead of the rest): `length` then counts what every layer holds.

Rollback is bookkeeping only: `crop` / `truncate` move `length` back and the next forward overwrites
the stale slots; `compact` (tree decoding) copies the accepted path's entries down in
place. `length` is a Python int, kept outside any compiled graph; a forward reads only
`start`, a one-element device tensor set to `length` by `reserve` just before it runs.

The methods a transformers model calls on a cache (`update`, `get_seq_length`) and the
ones the decoding loops call on a DynamicCache (`crop`, `get_seq_length`) have the same
meaning here, so the eager loops run unchanged on either cache
(tests/test_compiled.py: next logits after random accept patterns equal DynamicCache.crop's).
"""

from __future__ import annotations

import torch
from torch import Tensor


class StaticKVCache:
    """Preallocated K/V for `num_layers` attention layers of batch `batch_size`, up to
    `max_len` positions each. Call `reserve(T)` before every forward of T new tokens."""

    def __init__(self, num_layers: int, batch_size: int, max_len: int, device: torch.device):
        self.num_layers, self.batch_size, self.max_len = num_layers, batch_size, max_len
        self.keys: list[Tensor | None] = [None] * num_layers  # [B, H_kv, max_len, D] each
        self.values: list[Tensor | None] = [None] * num_layers
        self.length = 0  # slots [0, length) hold the sequence
        # The first slot of a forward. NOT marked as a static address: inductor's freezing
        # (decoding/compiled.py, the CPU default) turns every static input that a graph does
        # not mutate into a constant, so a static `start` would be baked in at its value when
        # the graph was compiled and every later forward would write and mask the wrong slots.
        self.start = torch.zeros((), dtype=torch.long, device=device)

    def reserve(self, num_tokens: int) -> None:
        """The next forward writes `num_tokens` entries at slots [length, length + num_tokens)."""
        if self.length + num_tokens > self.max_len:
            raise ValueError(
                f"the static KV cache holds {self.max_len} positions; {self.length} are used "
                f"and a forward adds {num_tokens}. Build it with a larger max_len (prompt "
                "length + max_new_tokens + the widest verify forward)"
            )
        self.start.fill_(self.length)
        self.length += num_tokens

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Write this forward's [B, H_kv, T, D] at the reserved slots; return all max_len slots
        (what transformers' attention layers call)."""
        return self.write(key_states, value_states, layer_idx, self.start)

    def write(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, start: Tensor
    ) -> tuple[Tensor, Tensor]:
        """`update` at slots [start, start + T) of this layer, `start` a one-element device
        tensor: a layer written ahead of the others (`SlotWriter`) moves no `length`."""
        if self.keys[layer_idx] is None:
            self._allocate(layer_idx, key_states, value_states)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slots = start + torch.arange(key_states.shape[2], device=keys.device)  # [T]
        keys.index_copy_(2, slots, key_states)
        values.index_copy_(2, slots, value_states)
        return keys, values

    def _allocate(self, layer_idx: int, key_states: Tensor, value_states: Tensor) -> None:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "the static KV cache is allocated by its first forward, which must run eagerly "
                "(the prefill): a compiled graph cannot own the buffers it writes"
            )
        B, kv_heads, _, head_dim = key_states.shape
        if self.batch_size != B:
            raise ValueError(
                f"static KV cache built for batch {self.batch_size}, got a batch of {B}"
            )
        shape = (B, kv_heads, self.max_len, head_dim)
        kw = dict(dtype=key_states.dtype, device=key_states.device)
        self.keys[layer_idx] = torch.zeros(shape, **kw)
        self.values[layer_idx] = torch.zeros(shape[:3] + (value_states.shape[-1],), **kw)
        # Fixed addresses: compiled graphs (and CUDA graphs) treat them as static inputs.
        torch._dynamo.mark_static_address(self.keys[layer_idx])
        torch._dynamo.mark_static_address(self.values[layer_idx])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicCache.crop's meaning (transformers 5): drop the last -tokens_to_remove
        positions (0: none). In place: only `length` moves."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop takes minus the number of positions to drop, got {tokens_to_remove}; "
                "truncate(length) keeps the first `length`"
            )
        self.truncate(self.length + tokens_to_remove)

    def truncate(self, length: int) -> None:
        """Keep the first `length` positions."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate to {length} positions; the cache holds {self.length}")
        self.length = length

    @torch.inference_mode()  # the buffers are inference tensors (allocated while decoding)
    def compact(self, past_len: int, keep: Tensor) -> None:
        """Keep slots [0, past_len) plus, per row, the slots past_len + keep [B, m] (in order),
        moved down to [past_len, past_len + m); the rest is dropped. In place."""
        B, m = keep.shape
        if past_len + int(keep.max()) >= self.length:  # a sync, as the tree loop already has
            raise ValueError(f"compact: keep {keep.tolist()} past the {self.length} slots held")
        for keys, values in zip(self.keys, self.values):
            if keys is None:
                continue
            kv_heads, head_dim = keys.shape[1], keys.shape[3]
            idx = (past_len + keep)[:, None, :, None].expand(B, kv_heads, m, head_dim)
            moved_k, moved_v = keys.gather(2, idx), values.gather(2, idx)  # copies first
            keys[:, :, past_len : past_len + m] = moved_k
            values[:, :, past_len : past_len + m] = moved_v
        self.length = past_len + m

    def reset(self) -> None:
        """Empty, for the next prompt; the buffers (and their addresses) stay."""
        self.length = 0


class SlotWriter:
    """A cache for a range of layers that writes a StaticKVCache's buffers at slots of its own
    (`start`, set before each forward) and leaves its `length` alone: a self-speculative
    round (decoding/drafters/selfspec.py) runs the target's first layers on drafted tokens
    ahead of the rest; the verify then writes the other layers at the same slots."""

    def __init__(self, cache: StaticKVCache):
        self.cache = cache
        self.start = torch.zeros((), dtype=torch.long, device=cache.start.device)  # not static

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        return self.cache.write(key_states, value_states, layer_idx, self.start)
