"""A training step's memory measured on the meta device, for the memory plan
(train/run/memory_plan.py): shapes and dtypes, no storage, nothing allocated.

`activation_bytes` runs one meta forward of the training step's shapes (the target's
forward, then the draft's) and adds up the tensors autograd saves for the backward
(`torch.autograd.graph.saved_tensors_hooks`); attention is counted as a fused kernel saves
it (`fused_attention`): on meta tensors PyTorch's math path would keep [B, heads, T, T]
probabilities that the flash kernels of a real run do not.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from models.target import Target


class MetaScalars(TorchDispatchMode):
    """Meta tensors hold no values, so `.item()` (a Python `if` on a tensor, a count) and a
    copy to another device fail on them. Under this mode an item reads 1 (False for a bool:
    the input checks then pass) and a copy off the meta device is zeros of its shape: the
    branch a run with real values takes is not known, but shapes, all a plan needs, rarely
    depend on it."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return {torch.bool: False}.get(args[0].dtype, 1)
        device = kwargs.get("device")
        off_meta = device is not None and torch.device(device).type != "meta"
        if func is torch.ops.aten._to_copy.default and args[0].is_meta and off_meta:
            dtype = kwargs.get("dtype") or args[0].dtype
            return torch.zeros(args[0].shape, dtype=dtype, device=device)
        return func(*args, **kwargs)


def meta_target(config: PretrainedConfig, dtype: torch.dtype, name: str) -> Target:
    """The target of `config` on the meta device in `dtype`: its shapes, no storage."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return Target(model, None, name=name, check_head=False)


def parameter_counts(module: torch.nn.Module) -> tuple[int, int, int]:
    """(trainable, frozen, bytes) over the module's parameters, shared ones counted once."""
    trainable = frozen = nbytes = 0
    for p in module.parameters():
        trainable += p.numel() if p.requires_grad else 0
        frozen += 0 if p.requires_grad else p.numel()
        nbytes += p.numel() * p.element_size()
    return trainable, frozen, nbytes


def fused_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
    scale: float | None = None, enable_gqa: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`F.scaled_dot_product_attention` as a fused kernel runs it (flash attention, on CPU and
    CUDA): it saves q, k, v, the output and a logsumexp per row for the backward, not the
    [B, heads, T, T] probabilities of PyTorch's math path, the one meta tensors would take.
    Counted through the CPU flash kernel's own meta function, on meta tensors only: it
    takes grouped k, v as they are (`enable_gqa`: saved once, as the kernel does)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # additive, as the kernel takes
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def activation_bytes(
    draft: torch.nn.Module, target: Target, batch_size: int, max_len: int, fused: bool = True
) -> tuple[int, int, int]:
    """(without, with gradient checkpointing, without gradients) bytes of one training forward at
    [batch_size, max_len], measured on meta tensors: the tensors autograd saves during the
    draft's forward, plus the target's output the step keeps and the draft's logits with
    their gradients (the same count on real modules: how the tests check the meta run).
    `fused`: attention counted as a fused kernel saves (`fused_attention`); False: as the
    modules call it (on real tensors, the kernel SDPA picks).
    Checkpointed: the saved tensors outside attention blocks, each block
    call's input, and the largest block call's saved tensors (recomputed one at a time)."""
    ids = torch.zeros(batch_size, max_len, dtype=torch.long, device=target.device)
    mask = torch.ones_like(ids)
    mask[-1, -1] = 0  # a padded batch, as training's are: attention then takes a mask
    saved = {"bytes": 0}
    calls: list[tuple[int, int]] = []  # per block call: (saved bytes, input bytes)
    starts: list[int] = []

    # Each storage once (q, k and v save the same input; a view saves its base) and no
    # parameter: a weight saved for the input's gradient is counted under parameters.
    params = [*draft.parameters(), *target.model.parameters()]
    seen = {p.untyped_storage()._cdata: p for p in params}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in seen:
            seen[storage._cdata] = storage  # held: an id is never reused while counting
            saved["bytes"] += storage.nbytes()
        return t

    def before(module, args, kwargs) -> None:
        starts.append(saved["bytes"])

    def after(module, args, kwargs, out) -> None:
        first = args[0] if args else kwargs.get("hidden_states")
        size = first.numel() * first.element_size() if isinstance(first, torch.Tensor) else 0
        calls.append((saved["bytes"] - starts.pop(), size))

    blocks = [m for m in draft.modules() if hasattr(m, "self_attn")]
    hooks = [m.register_forward_pre_hook(before, with_kwargs=True) for m in blocks]
    hooks += [m.register_forward_hook(after, with_kwargs=True) for m in blocks]
    try:
        with MetaScalars():
            t_out = target(ids, hidden_layers=tuple(draft.hidden_layers), use_cache=False)
        sdpa = fused_attention if fused else F.scaled_dot_product_attention
        attention = mock.patch.object(F, "scaled_dot_product_attention", sdpa)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), MetaScalars(), attention:
            out = draft(target, ids, t_out, mask, mask)
    finally:
        for hook in hooks:
            hook.remove()
    kept = sum(t.numel() * t.element_size() for t in [t_out.logits, *t_out.hidden.values()])
    logits = 2 * sum(x.numel() * 4 for x in out.logits)  # float32 logits and their gradients
    in_blocks = sum(s for s, _ in calls)
    checkpointed = saved["bytes"] - in_blocks + sum(i for _, i in calls)
    checkpointed += max((s for s, _ in calls), default=0)
    # the loss's float32 working copies of one offset's rows (the draft's, the target's at its
    # ids, a log-softmax: three at once), beside what the step keeps; without gradients the
    # draft's float32 logits once
    working = 3 * max((x.numel() * 4 for x in out.logits), default=0)
    no_grad = logits // 2 + working
    return saved["bytes"] + kept + logits + working, checkpointed + kept + logits + working, no_grad
