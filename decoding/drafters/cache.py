"""Bookkeeping of a drafter's own KV cache, shared by the EAGLE and MTP drafters.

Their caches hold one entry per sequence position, in the target's order, with the left
padding of a batch of prompts at the start of each row (decoding/spec.py pads left). A
round appends entries (the positions the drafter catches up on, then its speculative
ones) and `commit` crops back to the entries built from committed tokens.
"""

from __future__ import annotations

from transformers import DynamicCache

from models.static_cache import StaticKVCache


def crop_to(cache: DynamicCache | StaticKVCache, length: int) -> None:
    """Drop the entries past `length` (the speculative ones of the last round)."""
    cache.crop(min(0, length - cache.get_seq_length()))
