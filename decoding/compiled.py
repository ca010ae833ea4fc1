"""The compiled decoding path (`decode.compile=only`; docs/fastpath.md).

Eager decoding of a small target is bound by per-operator overhead, not by reading the
weights (the figures for SmolLM2-135M on 2 CPU cores, with their commands: docs/fastpath.md).
This path removes it without touching the loops of decoding/spec.py and decoding/tree.py:

  - `CompiledTarget` wraps a `Target` and is called exactly like one. Its KV cache is a
    preallocated `StaticKVCache` (models/static_cache.py): the loop's `cache.crop` and the
    tree's compaction are in place. The prefill (any prompt length) runs eagerly on that
    cache; every later forward is padded to one of a few fixed `widths` (1 for AR, k+1 for a
    chain, tree size + 1 for a tree) and runs a graph compiled once per width, so rounds with
    any accept count, fewer drafts or a smaller tree reuse the same graphs. The padding
    tokens sit after the real ones, are masked out of every real query and are cropped off
    the cache at once.
  - Drafters built on a `CompiledTarget` (decoding/drafters/) compile their own steps the
    same way: `CachedStep` runs a step over a drafter's static cache, compiled at the fixed
    widths the drafter pads to, eagerly beyond them (their prefill).
  - `Compiled` (decoding/inductor.py) is torch.compile with fixed shapes and full graphs, through one backend that
    counts the graphs it compiles, the CUDA graphs it records and the seconds the calls that
    did either took (`STATS`), so compile time is reported apart from decoding time and a
    recompile or a new recording shows up as a count. CUDA: CUDA graphs (mode
    reduce-overhead), recorded on a graph's SECOND call (the first runs it eagerly), so every
    warm-up calls each width twice. CPU: inductor with the target's weights frozen into the
    graph (constant-folded, packed for the CPU matmul library).
  - Every shape decoding will use is compiled (and recorded) by the warm-ups, none inside a
    timed decode: the target's widths, a drafter's (EAGLE-2 tree levels: `draft_widths`),
    and one mask shape for every batch (a left-padded batch's per-row masks and positions
    are the shape an unpadded batch's are expanded to).

Modes (`decode.compile_mode`, decoding/inductor.py): `auto` (reduce-overhead on CUDA,
cpp-gemm on CPU: inductor's C++ GEMM template over the frozen weights, measured against the
others in docs/fastpath.md), torch.compile's `default`, `reduce-overhead`, `max-autotune`,
`max-autotune-no-cudagraphs`, and `aot_eager` (no code generation: only traces and checks
guards, quick enough for tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from decoding.inductor import Compiled, resolve_mode
from decoding.rounds import sync
from models.static_cache import StaticKVCache
from models.target import Target, TargetOutput

# Slots a drafter's cache holds beyond the target's: a round's speculative entries (a chain's
# k - 1, an EAGLE-2 tree's (depth - 1) * top_k) before commit crops them.
DRAFT_EXTRA_SLOTS = 256


def pad_seq(x: Tensor, width: int, dim: int = 1) -> Tensor:
    """x padded with zeros along `dim` to `width` entries (dummy rows after the real ones)."""
    extra = width - x.shape[dim]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(*x.shape[:dim], extra, *x.shape[dim + 1 :])], dim)


class CachedStep:
    """A drafter's step over its StaticKVCache: `step(width, *args)` reserves `width` slots,
    then runs `fn(*args)`, compiled when width <= max(widths) (each width compiles once),
    eagerly when wider (a prefill, of any prompt length). Callers pad their inputs to
    `width(n)`, the smallest of `widths` that fits n, so a few graphs serve every round."""

    def __init__(self, fn: Callable, cache: StaticKVCache, widths: Iterable[int], mode: str | None):
        self.fn, self.cache = fn, cache
        self.widths = tuple(sorted(set(widths)))
        self.compiled = Compiled(fn, mode) if mode is not None else fn

    def width(self, num_tokens: int) -> int:
        return next((w for w in self.widths if w >= num_tokens), num_tokens)

    def __call__(self, width: int, *args):
        self.cache.reserve(width)
        return (self.compiled if width <= self.widths[-1] else self.fn)(*args)

    @torch.inference_mode()
    def warmup(self, args_for: Callable[[int], tuple]) -> None:
        """Compile (and with CUDA graphs record) every width now, on dummy inputs
        `args_for(width)`, so that no decoding round pays for it (a width may first be needed
        late: a catch-up after the first accepted draft). The eager first call allocates the
        cache."""
        widest = self.widths[-1]
        self.cache.reset()
        self.cache.reserve(widest)
        self.fn(*args_for(widest))
        calls = self.compiled.warm_calls if isinstance(self.compiled, Compiled) else 1
        for width in self.widths:
            for _ in range(calls):
                self.cache.reset()
                self(width, *args_for(width))
        self.cache.reset()


class CompiledTarget:
    """A `Target` over a StaticKVCache whose forwards after the prefill run compiled at fixed
    widths. Called like a Target (`forward(input_ids, cache=, attention_mask=, position_ids=,
    hidden_layers=, logits=)`); every other attribute is the wrapped target's.

    max_len: positions the cache holds (longest prompt + max_new_tokens + widest forward).
    widths: token counts of the compiled forwards; a forward of T tokens runs at the
        smallest width >= T (AR: 1, chain: k + 1, tree: tree size + 1).
    hidden_layers: every layer any drafter will ask for (-1 is always there): the graphs
        return all of them, so drafters with different taps share them.
    mode: a `MODES` entry, or None: the static cache and padding without compiling.
    freeze: inductor freezing of the target's weights (None: on CPU, where it packs them
        for the matmul library; the weights must then never change).
    draft_widths: widths the drafters' own compiled steps need beyond 1 and the widest
        forward (an EAGLE-2 tree level: the tree's top_k), compiled by their warm-ups.
    """

    def __init__(
        self,
        target: Target,
        max_len: int,
        widths: Iterable[int],
        hidden_layers: Iterable[int] = (),
        mode: str | None = "auto",
        freeze: bool | None = None,
        batch_size: int = 1,
        draft_widths: Iterable[int] = (),
    ):
        self.target = target
        self.max_len = max_len
        self.widths = tuple(sorted({int(w) for w in widths}))
        self.draft_widths = tuple(sorted({int(w) for w in draft_widths}))
        if not self.widths or self.widths[0] < 1:
            raise ValueError(f"widths must be token counts >= 1, got {self.widths}")
        self.hidden_layers = tuple(dict.fromkeys((*hidden_layers, -1)))
        self.mode = None if mode is None else resolve_mode(mode, target.device)
        self.cache = StaticKVCache(target.num_layers, batch_size, max_len, target.device)
        if freeze is None:
            freeze = target.device.type == "cpu"
        self.step = self._step
        if self.mode is not None:  # named for its compile seconds (STATS.by_graph)
            name = f"{target.num_layers}-layer target {str(target.dtype).removeprefix('torch.')}"
            self.step = Compiled(self._step, self.mode, freeze, name)

    def __getattr__(self, name: str):  # device, dtype, vocab_size, head_logits, model, ...
        if name == "target":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.target, name)

    def width(self, num_tokens: int) -> int:
        for w in self.widths:
            if w >= num_tokens:
                return w
        raise ValueError(
            f"a forward of {num_tokens} tokens is wider than the compiled widths {self.widths}; "
            "build the CompiledTarget with widths covering k + 1 (2k + 1 with adaptive_k) "
            "or the tree size + 1"
        )

    def _step(
        self, input_ids: Tensor, position_ids: Tensor, mask: Tensor | dict, logits: bool
    ) -> tuple[Tensor | None, tuple[Tensor, ...]]:
        """The forward the graphs hold: [B, W] tokens over the static cache -> logits
        [B, W, V] and the hidden layers of `self.hidden_layers`."""
        want_hidden = any(layer != -1 for layer in self.hidden_layers)
        out = self.target.model.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            cache=self.cache,
            use_cache=True,
            output_hidden_states=want_hidden,
        )
        last = out.last_hidden_state  # [B, W, H] after the final norm
        hidden = tuple(last if h == -1 else out.hidden_states[h] for h in self.hidden_layers)
        return (self.target.head_logits(last) if logits else None), hidden

    def _mask(
        self,
        attention_mask: Tensor | None,  # [B, past + T] 2D (1 = real) or [B, 1, T, past + T]
        position_ids: Tensor,  # [B, T]
        past: int,
        width: int,
    ) -> Tensor | dict[str, Tensor]:
        """The additive mask over all max_len slots, [B, 1, width, max_len]: the mask an
        eager forward over a DynamicCache would use (causal minus left padding, or the
        tree's), per layer type for sliding windows (Target._layer_masks), then the slots
        past the sequence and the padding rows blocked. One row per sequence even when the
        rows share it: a padded batch's graph is then the unpadded one's."""
        B, T = position_ids.shape
        device, dtype = position_ids.device, self.target.dtype
        if attention_mask is not None and attention_mask.dim() == 4:
            full = attention_mask
            if full.dtype == torch.bool:
                full = torch.zeros((), dtype=dtype, device=device).masked_fill(
                    ~full, torch.finfo(dtype).min
                )
        else:
            keys = torch.arange(past + T, device=device)
            allowed = keys[None, :] <= (past + torch.arange(T, device=device))[:, None]  # [T, K]
            allowed = allowed[None, None]  # [1, 1, T, K]
            if attention_mask is not None:
                allowed = allowed & attention_mask.bool()[:, None, None, :]  # [B, 1, T, K]
            full = torch.zeros((), dtype=dtype, device=device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
        if full.shape[-1] != past + T:
            raise ValueError(
                f"a 4D attention mask over {full.shape[-1]} keys, but the cache holds {past} "
                f"and the call adds {T}"
            )
        masks = self.target._layer_masks(full, position_ids, past)

        def pad(m: Tensor) -> Tensor:
            blocked = torch.finfo(dtype).min
            m = F.pad(m, (0, self.max_len - m.shape[-1], 0, width - T), value=blocked)
            return m.expand(self.cache.batch_size, -1, -1, -1)

        return {k: pad(m) for k, m in masks.items()} if isinstance(masks, dict) else pad(masks)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: Tensor,  # [B, T]
        cache: StaticKVCache | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        hidden_layers: tuple[int, ...] = (),
        logits: bool = True,
        use_cache: bool = True,
    ) -> TargetOutput:
        """Target.forward over the static cache. cache=None starts a new sequence (the
        prefill: eager, any length); later calls pass the cache this call returned."""
        if not use_cache:
            return self.target(
                input_ids, attention_mask=attention_mask, position_ids=position_ids,
                hidden_layers=hidden_layers, logits=logits, use_cache=False,
            )  # fmt: skip
        missing = [layer for layer in hidden_layers if layer not in self.hidden_layers]
        if missing:
            raise ValueError(
                f"hidden layers {missing} were not compiled in; build the CompiledTarget with "
                f"hidden_layers covering every drafter's (has {self.hidden_layers})"
            )
        B, T = input_ids.shape
        if cache is None:  # a new sequence: the prefill, eager at its own length
            self.cache.reset()
            past, width, run = 0, T, self._step
        elif cache is not self.cache:
            raise ValueError("pass back the cache this CompiledTarget returned (out.cache)")
        else:
            past, width, run = self.cache.length, self.width(T), self.step
            logits = True  # the compiled graphs always include the head
        if position_ids is None:
            position_ids = (past + torch.arange(T, device=input_ids.device)).expand(B, T)
        mask = self._mask(attention_mask, position_ids, past, width)
        # Padding rows: dummy token 0 at the positions after the last real one.
        extra = torch.arange(1, width - T + 1, device=input_ids.device)
        ids = pad_seq(input_ids, width)
        pos = torch.cat([position_ids, position_ids[:, -1:] + extra], 1)  # [B, width]
        self.cache.reserve(width)
        out_logits, hidden = run(ids, pos, mask, logits)
        self.cache.truncate(past + T)  # the padding rows' entries are dropped at once
        return TargetOutput(
            logits=None if out_logits is None else out_logits[:, :T],
            hidden={h: x[:, :T] for h, x in zip(self.hidden_layers, hidden) if h in hidden_layers},
            cache=self.cache,
        )

    __call__ = forward

    @torch.inference_mode()
    def warmup(self) -> float:
        """Compile (and with CUDA graphs record) every width now, on a dummy sequence, so no
        decode pays for it; returns the seconds it took."""
        t0 = time.perf_counter()
        device = self.target.device
        ids = torch.zeros(self.cache.batch_size, 1, dtype=torch.long, device=device)
        out = self.forward(ids, hidden_layers=self.hidden_layers)
        calls = self.step.warm_calls if isinstance(self.step, Compiled) else 1
        for w in self.widths:
            tokens = torch.zeros(self.cache.batch_size, w, dtype=torch.long, device=device)
            for _ in range(calls):
                self.forward(tokens, cache=out.cache, hidden_layers=self.hidden_layers)
                out.cache.truncate(1)
        out.cache.reset()
        sync(device)
        return time.perf_counter() - t0

    def release(self) -> None:
        """Give back the graphs and what they hold (`Compiled.release`: with freezing, a copy
        of the target's weights packed for the matmuls), which inductor otherwise keeps for
        the life of the process: for a throwaway compile such as the dtype proxy's."""
        if isinstance(self.step, Compiled):
            self.step.release()


def unwrap(target: Target | CompiledTarget) -> Target:
    """The plain Target under a CompiledTarget (for code traced into a drafter's graph)."""
    return target.target if isinstance(target, CompiledTarget) else target
