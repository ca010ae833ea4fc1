"""A reduced draft vocabulary (models/vocab.py) seen from the decoder: a drafter draws draft
ids from q over its N draft ids, and the decoder verifies target ids against q over the
target's V ids (decoding/drafter.py). `vocab_ids` [N] long maps draft id i to target id
vocab_ids[i]; None is the full vocabulary, where both are the identity. Used by the EAGLE,
DFlash and Domino drafters.
"""

from __future__ import annotations

from torch import Tensor


def to_target_ids(ids: Tensor, vocab_ids: Tensor | None) -> Tensor:
    """Draft ids [...] -> target ids [...]."""
    return ids if vocab_ids is None else vocab_ids[ids]


def full_vocab_q(q: Tensor, vocab_ids: Tensor | None, vocab_size: int) -> Tensor:
    """q over the draft vocabulary [..., N] -> over the target's [..., V]: q at the draft
    ids, zero elsewhere (verification's residual covers those tokens)."""
    if vocab_ids is None:
        return q
    full = q.new_zeros(*q.shape[:-1], vocab_size)
    full[..., vocab_ids] = q
    return full
