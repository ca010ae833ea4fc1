"""Answer a batch of prompts with the target: the regeneration engine of the hf backend.

A plain sampling loop over the target's KV cache, batch B, prompts left-padded:

    prefill [B, L] (the head at the last position only) -> sample -> one [B', 1] forward per
    token, where B' counts the rows still answering.

What makes it cheaper than transformers' `generate` on a CPU (scripts/bench_regen.py):
a row that ends its answer (EOS, or its share of the token budget) leaves the batch at once
(`DynamicCache.batch_select_indices`), so a batch costs what its answers cost rather than
B × its longest answer, and no per-step logits processors run. Greedy answers are the
target's argmax at every step, as `generate`'s are (equal token for token in
tests/test_regenerate.py); sampled ones draw from the target's distribution after
temperature and top-p with the caller's generator.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from decoding.drafter import Sampling
from decoding.verify import sample
from models.target import Target


@torch.inference_mode()
def answer_batch(
    target: Target,
    prompts: list[list[int]],  # token ids, the generation prompt included
    max_new_tokens: int,
    sampling: Sampling,
    eos_token_ids: list[int],
    pad_id: int,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt's answer, its EOS included where the target ended it."""
    device = target.device
    B, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)  # [B, L]
    attn = torch.zeros_like(input_ids)  # [B, L], 1 = real token
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attn[row, width - len(prompt) :] = 1
    input_ids, attn = input_ids.to(device), attn.to(device)
    padded = bool((attn == 0).any())
    positions = (attn.cumsum(-1) - 1).clamp_min(0)  # [B, L], counted over real tokens
    cache = DynamicCache()
    out = target(
        input_ids, cache=cache, attention_mask=attn if padded else None, position_ids=positions,
        hidden_layers=(-1,), logits=False,
    )  # fmt: skip
    logits = target.head_logits(out.hidden[-1][:, -1])  # [B, V]
    del out
    eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=device)
    rows = torch.arange(B, device=device)  # [B'] the prompts still answering
    next_pos = positions[:, -1] + 1  # [B']
    answers: list[list[int]] = [[] for _ in range(B)]
    for step in range(max_new_tokens):
        tokens = sample(logits, sampling, generator)  # [B']
        for row, token in zip(rows.tolist(), tokens.tolist(), strict=True):
            answers[row].append(token)
        if step == max_new_tokens - 1:
            break
        going = ~torch.isin(tokens, eos)  # [B']
        if not bool(going.any()):
            break
        if not bool(going.all()):  # finished rows leave the batch
            keep = going.nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, tokens, next_pos, attn = rows[keep], tokens[keep], next_pos[keep], attn[keep]
            padded = padded and bool((attn == 0).any())
        attn = torch.cat([attn, attn.new_ones(len(rows), 1)], 1)  # [B', T + 1]
        out = target(
            tokens[:, None], cache=cache, attention_mask=attn if padded else None,
            position_ids=next_pos[:, None],
        )  # fmt: skip
        logits = out.logits[:, -1]  # [B', V]
        next_pos = next_pos + 1
    return answers
