"""Answer many prompts with the target: the regeneration engine of the hf backend.

Continuous batching over a fixed number of slots, each holding one prompt's answer:

    while prompts are left or a slot is busy:
        every free slot takes the next prompt: the new prompts are prefilled together (head at
        their last position only), their K/V copied into their slots, their first token sampled
        one [slots, 1] forward: every slot's next token, written at that slot's own position

A slot whose answer ends (EOS, or max_new_tokens) is refilled before the next step, so every
step runs a full batch, and a batch never waits for its longest answer; the K/V is
preallocated (`SlotCache`), so no step copies the cache to grow it. Side by side on the
2-core AVX2 CPU (`scripts/bench_regen.py`, 32 prompts, 2 interleaved repeats, float32,
docs/bench_regen_cpu.json) it ran at 65 tokens/s with 64 slots against 62 for transformers'
`generate` in batches of 16, and 54 with 16 slots; every answer was the same. Its gains are
the answers saved one by one and sampling that does not depend on the batch, more than speed.

Greedy answers are the target's argmax at every step (equal to plain decoding of each prompt
alone in tests/test_regenerate.py). Sampled answers draw from the target's distribution after
temperature and top-p, prompt i with its own generator seeded `seeds[i]`, so the random
draws of an answer do not depend on the slot, the batch or the process that answers it (its
logits can, at the rounding level: which prompts share a prefill changes the kernels' shapes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from transformers import DynamicCache

from decoding.drafter import Sampling
from decoding.verify import sampling_probs
from models.target import Target


class SlotCache:
    """K/V of `slots` sequences, each in its own row from position 0 (no padding), up to
    `max_len` positions: [slots, H_kv, max_len, D] per layer. `lengths[s]` positions of slot s
    are filled; a one-token forward writes each slot's new entry at its own `lengths[s]`.
    Attention reads all max_len positions: the caller's 4D mask hides the unfilled ones."""

    def __init__(self, slots: int, max_len: int, device: torch.device):
        self.slots, self.max_len = slots, max_len
        self.keys: list[Tensor] = []  # per layer, allocated by the first `fill`
        self.values: list[Tensor] = []
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)  # [S]
        self.visible = max_len  # positions a step attends over (`decode_step` sets it)

    def fill(self, slot: int, prefill: DynamicCache, row: int, length: int) -> None:
        """Slot `slot` takes row `row` of a left-padded prefill: its last `length` positions."""
        for i, layer in enumerate(prefill.layers):
            keys, values = layer.keys[row, :, -length:], layer.values[row, :, -length:]
            if len(self.keys) <= i:
                shape = (self.slots, keys.shape[0], self.max_len)
                self.keys.append(keys.new_zeros(*shape, keys.shape[-1]))
                self.values.append(values.new_zeros(*shape, values.shape[-1]))
            self.keys[i][slot, :, :length] = keys
            self.values[i][slot, :, :length] = values
        self.lengths[slot] = length

    def keep(self, slots: list[int]) -> None:
        """Only these slots from now on, in this order (one copy of their K/V): once no prompt
        is left, the draining slots stop paying for the free ones."""
        index = torch.tensor(slots, device=self.lengths.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.lengths = self.lengths.index_select(0, index)
        self.slots = len(slots)

    def update(
        self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[Tensor, Tensor]:
        """Write this step's [S, H_kv, 1, D] at each slot's own position; return positions
        [0, visible) of every slot (views: nothing is copied)."""
        rows = torch.arange(self.slots, device=self.lengths.device)
        self.keys[layer_idx][rows, :, self.lengths] = key_states[:, :, 0]
        self.values[layer_idx][rows, :, self.lengths] = value_states[:, :, 0]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        return keys[:, :, : self.visible], values[:, :, : self.visible]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.visible


def _step_mask(target: Target, lengths: Tensor, visible: int) -> Tensor | dict[str, Tensor]:
    """[S, 1, 1, visible] additive mask: slot s sees its positions 0..lengths[s] (the step's
    own entry included); per layer type for sliding-window models (as Target._layer_masks)."""
    keys = torch.arange(visible, device=lengths.device)  # [K]
    seen = keys[None, :] <= lengths[:, None]  # [S, K]
    dtype = target.dtype
    blocked = torch.finfo(dtype).min

    def additive(allowed: Tensor) -> Tensor:
        zeros = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return zeros.masked_fill(~allowed, blocked)[:, None, None, :]

    types = getattr(target.config, "layer_types", None) or ()
    window = getattr(target.config, "sliding_window", None)
    if "sliding_attention" not in types or not window:
        return additive(seen)
    near = lengths[:, None] - keys[None, :] < window  # [S, K]
    return {"full_attention": additive(seen), "sliding_attention": additive(seen & near)}


def decode_step(target: Target, cache: SlotCache, last: Tensor) -> Tensor:
    """One token per slot (`last` [S]) at each slot's own position -> next-token logits [S, V].
    Calls the decoder itself, not Target.forward: the per-layer-type masks there assume one
    cache length for every row, where each slot here has its own. The caller moves
    `cache.lengths` on for the slots whose token it keeps."""
    cache.visible = int(cache.lengths.max()) + 1  # the longest slot, this step's entry included
    hidden = target.model.model(
        input_ids=last[:, None],
        cache=cache,
        use_cache=True,
        attention_mask=_step_mask(target, cache.lengths, cache.visible),
        position_ids=cache.lengths[:, None],
    ).last_hidden_state  # [S, 1, H] after the final norm
    return target.head_logits(hidden[:, -1])


@torch.inference_mode()
def answer_prompts(
    target: Target,
    prompts: list[list[int]],  # token ids, the generation prompt included; answered in order
    max_new_tokens: int,
    sampling: Sampling,
    eos_token_ids: list[int],
    pad_id: int,
    slots: int = 64,
    seeds: list[int] | None = None,  # per prompt, for sampling (default: its index)
    on_answer: Callable[[int, list[int]], None] | None = None,  # (prompt index, answer)
    on_token: Callable[[], None] | None = None,  # each token decoded, answers in flight too
) -> list[list[int]]:
    """The new tokens of each prompt's answer, its EOS included where the target ended it;
    `on_answer` is called as each answer ends (so a caller can save it at once), `on_token`
    as each token is decoded (a progress bar's rate: finished answers alone lag behind)."""
    device = target.device
    slots = max(1, min(slots, len(prompts)))
    max_len = max(len(p) for p in prompts) + max_new_tokens
    cache = SlotCache(slots, max_len, device)
    ends = set(eos_token_ids)
    seeds = list(range(len(prompts))) if seeds is None else seeds
    generators: dict[int, torch.Generator] = {}
    answers: list[list[int]] = [[] for _ in prompts]
    owner = [-1] * slots  # the prompt each slot answers, -1 = free
    last = torch.zeros(slots, dtype=torch.long, device=device)  # [S] each slot's newest token
    pending = iter(range(len(prompts)))
    left = len(prompts)  # prompts no slot has taken yet

    def pick(logits: Tensor, rows: list[int]) -> list[int]:  # logits [n, V], rows: prompts
        if sampling.greedy:
            return logits.argmax(-1).tolist()
        probs = sampling_probs(logits, sampling)
        return [int(torch.multinomial(p, 1, generator=generators[i])) for p, i in zip(probs, rows)]

    def take(slot: int, token: int) -> bool:
        """Append the slot's token; True while its answer goes on (else the slot is freed)."""
        i = owner[slot]
        answers[i].append(token)
        if on_token is not None:
            on_token()
        if token in ends or len(answers[i]) == max_new_tokens:
            owner[slot] = -1
            generators.pop(i, None)
            if on_answer is not None:
                on_answer(i, answers[i])
            return False
        return True

    while True:
        free = [s for s in range(slots) if owner[s] == -1]
        new = [i for _, i in zip(free, pending)]  # the next prompts, one per free slot
        left -= len(new)
        if new:
            for slot, i in zip(free, new):
                owner[slot] = i
                if not sampling.greedy:
                    generators[i] = torch.Generator(device).manual_seed(seeds[i])
            width = max(len(prompts[i]) for i in new)
            ids = torch.full((len(new), width), pad_id, dtype=torch.long)  # [n, L] left-padded
            attn = torch.zeros_like(ids)
            for row, i in enumerate(new):
                ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
                attn[row, width - len(prompts[i]) :] = 1
            ids, attn = ids.to(device), attn.to(device)
            padded = bool((attn == 0).any())
            out = target(
                ids, cache=DynamicCache(), attention_mask=attn if padded else None,
                position_ids=(attn.cumsum(-1) - 1).clamp_min(0), hidden_layers=(-1,),
                logits=False,
            )  # fmt: skip
            first = pick(target.head_logits(out.hidden[-1][:, -1]), new)  # [n]
            for row, (slot, i) in enumerate(zip(free, new)):
                cache.fill(slot, out.cache, row, len(prompts[i]))
                last[slot] = first[row]
                take(slot, first[row])
            del out
            continue  # answers that ended on their first token free their slots again
        busy = [s for s in range(slots) if owner[s] != -1]
        if not busy:
            return answers
        if left == 0 and len(busy) <= slots // 2:  # draining: drop the free slots
            cache.keep(busy)
            owner, last, slots = [owner[s] for s in busy], last[busy], len(busy)
            busy = list(range(slots))
        logits = decode_step(target, cache, last)  # [S, V]
        cache.lengths += torch.tensor([owner[s] != -1 for s in range(slots)], device=device)
        tokens = pick(logits[busy], [owner[s] for s in busy])  # [n busy]
        for slot, token in zip(busy, tokens):
            last[slot] = token
            take(slot, token)
