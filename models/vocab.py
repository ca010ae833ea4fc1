"""The reduced draft vocabulary (EAGLE-3, Li et al. 2025), shared by EAGLE (models/eagle.py)
and DFlash / Domino (models/dflash.py, models/domino.py).

A draft predicts over N of the target's V ids: the N most frequent trained label tokens
(`token_counts` from the data, EOS always kept), ascending by target id. Draft id i is
target id ids[i]; the head is the target's frozen lm_head rows at those ids (nothing new to
train). The decoder maps draft ids and q back to the target's vocabulary with
decoding/drafters/vocab.py.

The mapping lives in the draft's state_dict as buffers registered on the draft itself, in
one of two layouts whose names are the checkpoint keys:
  "offsets"  EAGLE, the layout engines serve (vLLM, SGLang, speculators; the EAGLE exporter
             in train/formats/ writes it as-is): d2t [N] long with target id = i + d2t[i],
             and t2d [V] bool, True where a target id is in the draft vocabulary.
  "ids"      DFlash, Domino: vocab_ids [N] long, the target ids themselves.
`attach` registers them on a draft (unbuilt: no valid mapping), `build` fills them from
token counts. The mapping is checked once, after it is built or loaded (a load hook), and
the verdict kept in the draft's `vocab_ready`: forwards and drafters read that flag only
(`require`), so a vocabulary never built nor loaded is refused at first use, and a broken
checkpoint at load. A draft that uses this module keeps `target_vocab_size` (V).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

LAYOUTS = {"offsets": ("d2t", "t2d"), "ids": ("vocab_ids",)}  # the checkpoint keys


# -- the mapping as tensors ------------------------------------------------------------------
def reduced_size(vocab_size: int | str, target_size: int) -> int | None:
    """A draft's `vocab_size` setting ("full" or N) -> N, or None for the full vocabulary
    (also when N covers the target's)."""
    if vocab_size == "full" or (isinstance(vocab_size, int) and vocab_size >= target_size):
        return None
    if isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and vocab_size > 0:
        return vocab_size
    raise ValueError(f"vocab_size must be 'full' or a positive int, got {vocab_size!r}")


def most_frequent(token_counts: Tensor, size: int, always_keep: Iterable[int] = ()) -> Tensor:
    """The `size` most frequent target ids of `token_counts` [V] (ties -> the lower id;
    `always_keep`, e.g. EOS, forced in), ascending: [size] long on the CPU."""
    counts = token_counts.detach().flatten().double().cpu().clone()  # never the caller's
    if not 0 < size <= counts.numel():
        raise ValueError(
            f"draft vocab size must be in 1..{counts.numel()} (target vocab), got {size}"
        )
    counts[list(always_keep)] = float("inf")
    return torch.argsort(counts, descending=True, stable=True)[:size].sort().values


def coverage(token_counts: Tensor, ids: Tensor) -> float:
    """Share of the counted tokens whose id is in `ids`."""
    counts = token_counts.detach().flatten().double().cpu()
    return float(counts[ids.cpu()].sum() / counts.sum().clamp_min(1.0))


def to_offsets(ids: Tensor, target_size: int) -> tuple[Tensor, Tensor]:
    """ids [N] -> EAGLE's d2t [N] (target id = i + d2t[i]) and t2d [V] bool."""
    t2d = torch.zeros(target_size, dtype=torch.bool, device=ids.device)
    t2d[ids] = True
    return ids - torch.arange(ids.numel(), device=ids.device), t2d


def from_offsets(d2t: Tensor) -> Tensor:
    """EAGLE's d2t [N] -> the target ids [N]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def is_valid(ids: Tensor, target_size: int, t2d: Tensor | None = None) -> bool:
    """`ids` strictly ascending inside 0..V-1, and `t2d` (if given) True exactly there."""
    ok = ids.numel() > 0 and bool(
        (ids.min() >= 0) & (ids.max() < target_size) & (ids.diff() > 0).all()
    )
    if ok and t2d is not None:
        ok = int(t2d.sum()) == ids.numel() and bool(t2d[ids].all())
    return ok


def to_draft(target_ids: Tensor, ids: Tensor) -> Tensor:
    """Target ids -> draft ids (positions in the ascending `ids`); -1 outside the vocabulary."""
    pos = torch.searchsorted(ids, target_ids).clamp_max(ids.numel() - 1)
    return torch.where(ids[pos] == target_ids, pos, -1)


def head_rows(weight: Tensor, ids: Tensor | None) -> Tensor:
    """The target's head [V, H] -> the rows the draft predicts over [N, H] (all of them for
    the full vocabulary, ids None)."""
    return weight if ids is None else weight.index_select(0, ids.to(weight.device))


# -- the mapping on a draft --------------------------------------------------------------------
def attach(module: nn.Module, layout: str, draft_size: int | None, target_size: int | None) -> None:
    """Give `module` a reduced vocabulary of `draft_size` ids in `layout` (buffers unbuilt,
    `vocab_ready` False until `build` or a load brings a valid mapping), or the full
    vocabulary for draft_size None (the layout's buffers None, ready)."""
    if layout not in LAYOUTS:
        raise ValueError(f"vocabulary layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    if draft_size is not None and not (target_size and 0 < draft_size < target_size):
        raise ValueError(
            f"draft_vocab_size={draft_size}: a reduced draft vocabulary needs 0 < size < the "
            f"target's vocabulary ({target_size}); use null for the whole head"
        )
    module.vocab_layout = layout
    module.vocab_ready = draft_size is None
    module.vocab_coverage = 1.0  # share of the trained label tokens inside the draft vocab
    if draft_size is None:
        for key in LAYOUTS[layout]:
            module.register_buffer(key, None)
        return
    if layout == "offsets":
        module.register_buffer("d2t", torch.zeros(draft_size, dtype=torch.long))
        module.register_buffer("t2d", torch.zeros(target_size, dtype=torch.bool))
    else:
        module.register_buffer("vocab_ids", torch.full((draft_size,), -1))
    module.register_load_state_dict_post_hook(_check_loaded)


def draft_ids(module: nn.Module) -> Tensor | None:
    """Draft id -> target id [N] long, on the buffers' device; None for the full vocabulary."""
    if module.vocab_layout == "ids":
        return module.vocab_ids
    return None if module.d2t is None else from_offsets(module.d2t)


def build(module: nn.Module, token_counts: Tensor, always_keep: Iterable[int] = ()) -> None:
    """Fill `module`'s mapping with the most frequent ids of `token_counts` [V] (the training
    data's label counts; `always_keep`: EOS), record their coverage and check it."""
    ids = draft_ids(module)
    if ids is None:
        raise ValueError("building a reduced vocabulary for a draft with the full vocabulary")
    if token_counts.numel() != module.target_vocab_size:
        raise ValueError(
            f"token_counts has {token_counts.numel()} entries, the target vocab "
            f"{module.target_vocab_size}"
        )
    new = most_frequent(token_counts, ids.numel(), always_keep)
    if module.vocab_layout == "ids":
        module.vocab_ids.copy_(new)
    else:
        d2t, t2d = to_offsets(new, module.target_vocab_size)
        module.d2t.copy_(d2t)
        module.t2d.copy_(t2d)
    module.vocab_coverage = coverage(token_counts, new)
    check(module)


def check(module: nn.Module) -> None:
    """Validate `module`'s mapping, keep the verdict in `vocab_ready`, refuse a bad one."""
    ids = draft_ids(module)
    t2d = module.t2d if module.vocab_layout == "offsets" else None
    module.vocab_ready = ids is None or is_valid(ids, module.target_vocab_size, t2d)
    require(module)


def require(module: nn.Module) -> None:
    """Refuse a reduced vocabulary that was never built or loaded, or failed its check."""
    if module.vocab_ready:
        return
    keys = "/".join(LAYOUTS[module.vocab_layout])
    raise ValueError(
        f"{type(module).__name__} with a reduced vocabulary of {draft_ids(module).numel()} "
        f"tokens has no valid {keys} mapping. Build it from the training data (from_target(..., "
        f"token_counts=prepared.token_counts)), load a checkpoint that holds {keys}, or set "
        "draft.model.vocab_size=full."
    )


def extras(module: nn.Module) -> dict[str, Tensor]:
    """The training log's `vocab_coverage` of a reduced vocabulary ({} for the full one)."""
    if draft_ids(module) is None:
        return {}
    return {"vocab_coverage": torch.tensor(module.vocab_coverage)}


def _check_loaded(module: nn.Module, incompatible_keys) -> None:
    """Load hook: check the mapping a checkpoint brought (not when it lacks the keys)."""
    keys = LAYOUTS[module.vocab_layout]
    missing = {key.rsplit(".", 1)[-1] for key in incompatible_keys.missing_keys}
    if not missing & set(keys):
        check(module)
