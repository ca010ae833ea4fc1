"""What the chain loop (decoding/spec.py) and the tree loop (decoding/tree.py) share: the
result record of a generation, the input checks, the target's prefill with the first token
and the drafter's prefill, and how a round's tokens are counted and emitted up to EOS.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import DynamicCache

from decoding.drafter import Drafter, Sampling
from decoding.verify import check_sampling, emitted_drafts, sample
from models.target import Target

GREEDY = Sampling()  # frozen, so a safe default
StreamFn = Callable[[list[list[int]]], None]  # per-row tokens emitted this round (may be several)


@dataclass
class GenerationResult:
    sequences: list[list[int]]  # per row: the NEW tokens, EOS included if hit
    # Per verify round: accepted drafts that were emitted (`count_emitted`), and drafts
    # offered (0 = no drafts: AR step, n-gram miss, last token of the budget; tree: depth).
    accept_counts: list[int] = field(default_factory=list)
    draft_lens: list[int] = field(default_factory=list)
    # Per verify round: tokens emitted, correction/bonus included (= accepted + 1, except in
    # a round cut by an accepted EOS draft, which emits no token after it). Batches: the
    # most any row emitted.
    round_tokens: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # tree rounds: drafted nodes per round
    rounds: int = 0  # target forwards after the prefill
    prefill_s: float = 0.0  # the target's prefill and first sample
    draft_prefill_s: float = 0.0  # inside drafter.prefill
    draft_s: float = 0.0  # inside drafter.propose/commit (per-round drafter cost)
    verify_s: float = 0.0  # inside the target's verify forwards
    total_s: float = 0.0  # whole call, both prefills included

    @property
    def tau(self) -> float:
        """Tokens emitted per target verify forward, bonus included, over EVERY verify forward
        (rounds without drafts count, with 0 accepted): design.md §3."""
        n = self.round_tokens
        return sum(n) / len(n) if n else 1.0

    @property
    def tau_drafted(self) -> float:
        """τ over the rounds that had drafts only (>= tau)."""
        counted = [n for n, d in zip(self.round_tokens, self.draft_lens) if d > 0]
        return sum(counted) / len(counted) if counted else 1.0

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def rounds_s(self) -> float:
        """Wall time of the decoding rounds: the whole call minus both prefills."""
        return self.total_s - self.prefill_s - self.draft_prefill_s

    @property
    def overhead_s(self) -> float:
        """Time in the rounds outside target and drafter calls (verify maths, bookkeeping)."""
        return self.rounds_s - self.draft_s - self.verify_s


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_context(target: Target, prompt_tokens: int, new_tokens: int, what: str, fix: str) -> None:
    """Refuse `prompt_tokens` + `new_tokens` positions beyond the target's context window
    (Target.context_length): past it rope runs outside its trained range, or a learned
    position table runs out, and the decode silently goes wrong. `what` names the prompt and
    the new-token setting, `fix` the settings that would fit. (Decoding feeds at most
    prompt + new_tokens - 1 positions; the last token is emitted, never fed.)"""
    window = target.context_length
    if window is not None and prompt_tokens + new_tokens > window:
        raise ValueError(
            f"{what}: {prompt_tokens} prompt tokens + {new_tokens} new tokens = "
            f"{prompt_tokens + new_tokens} positions, beyond the context window of target "
            f"{target.name!r} ({window} positions, config.max_position_embeddings); {fix}"
        )


def check_inputs(
    target: Target,
    input_ids: Tensor,
    drafter: Drafter | None,
    k: int,
    sampling: Sampling,
    max_new_tokens: int,
    attention_mask: Tensor | None,
) -> None:
    """Every bad input raises a ValueError saying what was wrong, before any decoding."""
    if k < 1:
        raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
    check_sampling(sampling)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be [B, T] token ids, got shape {tuple(input_ids.shape)}; "
            "add a batch dimension with input_ids[None]"
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"empty prompt (input_ids shape {tuple(input_ids.shape)}): give at least one "
            "token per row, e.g. the chat template with add_generation_prompt=True"
        )
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(attention_mask.shape)} != input_ids "
                f"shape {tuple(input_ids.shape)}"
            )
        if (attention_mask.sum(-1) == 0).any():
            raise ValueError("a row of attention_mask is all zeros: that row's prompt is empty")
        if (attention_mask[:, -1] == 0).any():
            raise ValueError(
                "prompts must be LEFT-padded (the last column of attention_mask must "
                "be 1); set tokenizer.padding_side = 'left'"
            )
    longest = (
        int(attention_mask.sum(-1).max()) if attention_mask is not None else input_ids.shape[1]
    )
    check_context(
        target, longest, max_new_tokens, "decoding",
        "lower max_new_tokens or shorten the prompt",
    )  # fmt: skip
    vocab = None if drafter is None else drafter.vocab_size  # None: plain AR decoding
    if vocab is not None and vocab != target.vocab_size:
        raise ValueError(
            f"the drafter's vocabulary has {vocab} entries but the target's has "
            f"{target.vocab_size}; a draft must share the target's tokenizer"
        )


@dataclass
class PrefillState:
    result: GenerationResult
    cache: DynamicCache
    attn: Tensor | None  # [B, T_cache] 2D mask when prompts are padded, else None
    last: Tensor  # [B] the first new token, not yet in the cache
    next_pos: Tensor  # [B] position id of `last`
    first: list[int]  # `last` as a list (already appended to the sequences)
    finished: list[bool]  # per row: EOS emitted
    eos: set[int]
    eos_ids: Tensor  # [E] the same ids on the device
    t_start: float


def prefill(
    target: Target,
    input_ids: Tensor,  # [B, T]
    drafter: Drafter | None,
    sampling: Sampling,
    attention_mask: Tensor | None,
    generator: torch.Generator | None,
    eos_token_ids: list[int] | None,
) -> PrefillState:
    """The target's prefill (head at the last position only), the first sampled token and
    the drafter's prefill; shared by the chain loop and the tree loop (decoding/tree.py)."""
    device = target.device
    input_ids = input_ids.to(device)
    B, T = input_ids.shape
    padded = attention_mask is not None and bool((attention_mask == 0).any())
    # Keep the mask only when there is padding: HF's causal-mask fast path is cheaper.
    attn = attention_mask.to(device).long() if padded else None  # [B, T_cache + pending]
    if padded:
        positions = (attn.cumsum(-1) - 1).clamp_min(0)  # [B, T]
    else:
        positions = torch.arange(T, device=device).expand(B, T)
    hidden_layers = tuple(drafter.hidden_layers) if drafter is not None else ()
    result = GenerationResult(sequences=[[] for _ in range(B)])

    sync(device)
    t_start = time.perf_counter()
    # The head only at the last prompt position: the full-vocabulary head is a large share of
    # a token's cost on SmolLM2 (docs/design.md §5), and a 1-row head rounds (bf16) like
    # transformers' own generate.
    out = target(
        input_ids,
        attention_mask=attn,
        position_ids=positions,
        hidden_layers=tuple(dict.fromkeys(hidden_layers + (-1,))),
        logits=False,
    )
    out.logits = target.head_logits(out.hidden[-1][:, -1:])  # [B, 1, V]
    if -1 not in hidden_layers:
        del out.hidden[-1]
    last = sample(out.logits[:, -1], sampling, generator)  # [B], not yet in the cache
    sync(device)
    result.prefill_s = time.perf_counter() - t_start
    if drafter is not None:
        t0 = time.perf_counter()
        if padded:
            drafter.prefill(input_ids, out, attention_mask=attn)
        else:
            drafter.prefill(input_ids, out)
        sync(device)
        result.draft_prefill_s = time.perf_counter() - t0
    eos = set(target.eos_token_ids if eos_token_ids is None else eos_token_ids)
    first = last.tolist()
    for b in range(B):
        result.sequences[b].append(first[b])
    finished = [t in eos for t in first]
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    return PrefillState(
        result, out.cache, attn, last, positions[:, -1] + 1, first, finished, eos, eos_ids, t_start
    )


def count_emitted(accepted: Tensor, finished: list[bool], eos_ids: Tensor) -> int:
    """What `accept_counts` records for a round that kept the common accepted drafts
    `accepted` [B, n] (call before `emit`): the accepted drafts that were emitted. A row
    stops at its first EOS, so drafts after it do not count. For B=1 this is exact; for a
    batch it is the common prefix n cut after the last draft that any row unfinished at
    the round's start emitted (the max over those rows)."""
    active = torch.tensor([not f for f in finished], device=accepted.device)  # [B]
    return int(emitted_drafts(accepted, eos_ids)[active].max())


def emit(
    result: GenerationResult, emitted: Tensor, finished: list[bool], eos: set[int]
) -> list[list[int]]:
    """Append each unfinished row's emitted tokens [B, n+1] up to its first EOS; returns
    the tokens each row emitted (for `stream`)."""
    new: list[list[int]] = [[] for _ in range(len(finished))]
    for b, row in enumerate(emitted.tolist()):
        if finished[b]:
            continue
        for tok in row:
            new[b].append(tok)
            if tok in eos:
                finished[b] = True
                break
        result.sequences[b].extend(new[b])
    return new
