"""Offline feature cache: the frozen target's forward over the training rows, run once.

A head draft (EAGLE-1/3, Medusa, MTP) reads the target's tapped hidden states and is trained
against the target's logits; the draft LM reads the logits only. Both are functions of the
row alone, so one pass over the rows can store them, and every later pass (epochs after the
first, other seeds, other losses on the same data) reads them instead of running the target.

Stored per row, in the target's dtype: each tapped hidden state the draft reads and the last
hidden state after the final norm (`hidden[-1]`, the input of the output head). The logits
are not stored ([T, V] per row); `cached_target_output` rebuilds them with the target's own
`head_logits` (lm_head plus the architecture's logit transform), as `Target.forward` does.
The final norm's input is not stored: no draft reads it, and transformers ties
`hidden_states[L]` to the normed state anyway. Size per token: (taps + 1) x hidden_size x
dtype bytes = 4 x 576 x 2 = 4.6 KB for EAGLE-3 on the embedded target in bf16.

Bit-identity. A row's features depend, at rounding level, on the micro-batch it ran in (the
padded width picks different kernels), online as well. The pass therefore runs the batches
of the loop's first epoch (`order`, `batch_size`): a run reading the cache sees in its first
epoch exactly the bits an online run computes, and later epochs (reshuffled batches) differ
from an online run by that same batch-to-batch rounding, not by anything the cache adds.

Layout: <root>/features/<key>/{index.json, shard_00000.safetensors, ...}, each shard holding
one [tokens, H] tensor per stored state. The key hashes the target's name, the fingerprint of
its weights (models/identity.py: re-saved weights at the same path are another target) and
its dtype, every row's token ids and the hidden layers, so a changed target, data or tap set
never reads a stale cache. The pass writes into a temporary directory renamed at the end: a key directory
is complete, and one that fails the checks in `_open` (missing or short shard, wrong shapes)
is deleted and rebuilt, never read.

Several processes (`ranks`, train/parallel/ranks.py) share the pass: the batches are those of one
process and batch b is run by rank b mod world (so every row gets the bits one process
gives it), each rank writes its part (`.part-<key>-<rank>of<world>`, renamed when complete;
a restarted rank whose part is complete does not run it again), and rank 0 moves the parts'
shards into the key directory with one row table.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor
from tqdm.auto import tqdm

from models.target import Target, TargetOutput
from train.data.prepare import collate
from train.data.regenerate import default_cache_root
from train.parallel.ranks import Ranks

FORMAT = 1  # bump when the layout changes: old caches then get a new key


@dataclass
class FeatureCache:
    path: Path
    hidden_layers: tuple[int, ...]  # what the draft asked for, in its order (-1 = "last")
    names: tuple[str, ...]  # stored states: "last" and "layer<i>" per tap
    dtype: torch.dtype  # of the stored states: the target's
    rows: list[list[int]]  # row index -> [shard, first token, length]
    shards: list  # open safetensors files (memory-mapped)


def _name(layer: int) -> str:
    return "last" if layer == -1 else f"layer{layer}"


def cache_settings(
    target: Target, train_rows, hidden_layers: tuple[int, ...], pad_multiple: int = 1
) -> dict:
    """Everything the cached features depend on; its hash names the cache directory."""
    rows = hashlib.sha256()
    for i in range(len(train_rows)):
        ids = torch.tensor(train_rows[i]["input_ids"], dtype=torch.int64)
        rows.update(ids.numel().to_bytes(8, "little") + ids.numpy().tobytes())
    return {
        "format": FORMAT,
        "target": target.name,
        "weights": target.fingerprint,
        "dtype": str(target.dtype).removeprefix("torch."),
        "hidden_size": target.hidden_size,
        "hidden_layers": list(hidden_layers),
        "num_rows": len(train_rows),
        "rows": rows.hexdigest(),
        # the batches' widths (train.pad_multiple): other widths, other bits; an unpadded
        # cache keeps the key it had
        **({"pad_multiple": pad_multiple} if pad_multiple > 1 else {}),
    }


def cache_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def build_feature_cache(
    target: Target,
    train_rows,  # datasets.Dataset or list of rows with "input_ids"
    hidden_layers: tuple[int, ...],
    cache_dir: str | Path | None = None,  # root; None = $DRAFTLAB_CACHE or ~/.cache/draftlab
    batch_size: int = 4,
    order: list[int] | None = None,  # row order of the pass; the loop gives its first epoch's
    shard_bytes: int = 256 << 20,
    progress: bool = True,
    ranks: Ranks | None = None,  # several processes: each runs its share of the batches
    pad_multiple: int = 1,  # the loop's train.pad_multiple: its batch widths, so its bits
) -> FeatureCache:
    """The target's features over every training row: read from the cache when a complete
    one exists for these settings, else computed in one pass (batches of `batch_size` rows
    in `order`, shared by the ranks), written atomically, then read."""
    ranks = ranks or Ranks()
    hidden_layers = tuple(hidden_layers)
    settings = cache_settings(target, train_rows, hidden_layers, pad_multiple)
    root = (Path(cache_dir).expanduser() if cache_dir else default_cache_root()) / "features"
    path = root / cache_key(settings)
    order = list(range(len(train_rows))) if order is None else [int(i) for i in order]
    if sorted(order) != list(range(len(train_rows))):
        raise ValueError(
            f"order must be a permutation of the {len(train_rows)} row indices (each row once)"
        )
    opened = _open_or_none(path, settings, warn=ranks.main)
    if all(ranks.gather(opened is not None)):
        return opened
    if ranks.main and path.exists():  # damaged: rebuilt
        shutil.rmtree(path)
    root.mkdir(parents=True, exist_ok=True)
    batches = [order[start : start + batch_size] for start in range(0, len(order), batch_size)]
    mine = [batch for b, batch in enumerate(batches) if b % ranks.world == ranks.rank]
    part = path if ranks.world == 1 else root / f".part-{path.name}-{ranks.rank}of{ranks.world}"
    if ranks.world == 1 or not _part_complete(part, settings):
        if ranks.world > 1:
            shutil.rmtree(part, ignore_errors=True)  # an incomplete part of an earlier start
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=root))  # one per builder
        try:
            _write(tmp, target, train_rows, hidden_layers, settings, mine, shard_bytes,
                   progress and ranks.main)  # fmt: skip
            try:
                os.rename(tmp, part)
            except OSError:  # another process finished the same cache first: keep its copy
                if not part.exists():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if ranks.world > 1:
        ranks.barrier()  # every part is complete
        if ranks.main:
            _merge_parts(root, path, settings, ranks.world)
        ranks.barrier()
    return _open(path, settings)


def _open_or_none(path: Path, settings: dict, warn: bool) -> FeatureCache | None:
    """The complete cache at `path`, or None when there is none or it is damaged."""
    if not path.exists():
        return None
    try:
        return _open(path, settings)
    except ValueError as err:
        if warn:
            warnings.warn(f"damaged feature cache {path} ({err}): rebuilding it", stacklevel=3)
        return None


def _part_complete(part: Path, settings: dict) -> bool:
    """A rank's part from an earlier start: its index is for these settings and its shards
    are all there."""
    try:
        index = json.loads((part / "index.json").read_text())
        return index["settings"] == settings and all(
            (part / s["file"]).is_file() and (part / s["file"]).stat().st_size == s["bytes"]
            for s in index["shards"]
        )
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _merge_parts(root: Path, path: Path, settings: dict, world: int) -> None:
    """Rank 0: the parts' shards renumbered into one key directory, their row tables made
    one (each row is in exactly one part), written atomically; the parts removed."""
    parts = [root / f".part-{path.name}-{r}of{world}" for r in range(world)]
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=root))
    try:
        rows: list = [None] * settings["num_rows"]
        shards: list[dict] = []
        names = None
        for rank, part in enumerate(parts):
            index = json.loads((part / "index.json").read_text())
            names = index["names"]
            offset = len(shards)
            for shard in index["shards"]:
                file = f"shard_{len(shards):05d}.safetensors"
                os.replace(part / shard["file"], tmp / file)
                shards.append({**shard, "file": file, "rank": rank})  # who computed it
            for i, row in enumerate(index["rows"]):
                if row is not None:
                    rows[i] = [offset + row[0], row[1], row[2]]
        index = {"settings": settings, "names": names, "shards": shards, "rows": rows}
        (tmp / "index.json").write_text(json.dumps(index))
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for part in parts:
        shutil.rmtree(part, ignore_errors=True)


@torch.no_grad()
def _write(tmp, target, train_rows, hidden_layers, settings, batches, shard_bytes,
           progress) -> None:  # fmt: skip
    """The features of the rows of `batches` (lists of row indices; each one forward) into
    `tmp`: shards and index.json, whose row table holds None for rows not in `batches`."""
    names = tuple(dict.fromkeys(["last", *map(_name, hidden_layers)]))
    taps = tuple(dict.fromkeys([la for la in hidden_layers if la != -1] + [-1]))  # once each
    pad_id = target.tokenizer.pad_token_id
    rows: list[list[int] | None] = [None] * len(train_rows)
    shards: list[dict] = []
    buffer: dict[str, list[Tensor]] = {n: [] for n in names}
    filled = 0  # tokens in the buffer

    def flush() -> None:
        nonlocal filled
        file = f"shard_{len(shards):05d}.safetensors"
        save_file({n: torch.cat(buffer[n]) for n in names}, tmp / file)  # [tokens, H] each
        shards.append({"file": file, "bytes": (tmp / file).stat().st_size, "tokens": filled})
        for n in names:
            buffer[n].clear()
        filled = 0

    token_bytes = len(names) * target.hidden_size * target.dtype.itemsize
    bar = tqdm(total=sum(map(len, batches)), desc="feature cache", unit="row", disable=not progress)
    for chunk in batches:
        # The loop's own collate: same padding, same widths, so the same bits.
        batch = collate([train_rows[i] for i in chunk], pad_id, settings.get("pad_multiple", 1))
        out = target(
            batch["input_ids"].to(target.device),
            attention_mask=batch["attention_mask"].to(target.device),
            hidden_layers=taps,
            logits=False,
            use_cache=False,
        )
        if out.hidden[-1].dtype != target.dtype:
            raise ValueError(
                f"target {target.name!r} returns {out.hidden[-1].dtype} hidden states but its "
                f"head is {target.dtype}: cast the whole target to one dtype (target.dtype)"
            )
        for b, i in enumerate(chunk):
            n = int(batch["attention_mask"][b].sum())
            for la in taps:
                buffer[_name(la)].append(out.hidden[la][b, :n].to("cpu", copy=True))  # [n, H]
            rows[i] = [len(shards), filled, n]
            filled += n
        if filled * token_bytes >= shard_bytes:
            flush()
        bar.update(len(chunk))
    bar.close()
    if filled:
        flush()
    index = {"settings": settings, "names": list(names), "shards": shards, "rows": rows}
    (tmp / "index.json").write_text(json.dumps(index))


def _open(path: Path, settings: dict) -> FeatureCache:
    """A complete cache for `settings`, its shards opened; ValueError says what is wrong."""
    try:
        return _open_index(path, settings, json.loads((path / "index.json").read_text()))
    except (OSError, KeyError, TypeError, IndexError) as err:  # JSON errors are ValueErrors
        raise ValueError(f"index.json unreadable or malformed: {err!r}") from None


def _open_index(path: Path, settings: dict, index: dict) -> FeatureCache:
    if index.get("settings") != settings:
        raise ValueError("index.json was written for other settings")
    hidden, shards = settings["hidden_size"], []
    for shard in index["shards"]:
        file = path / shard["file"]
        if not file.is_file() or file.stat().st_size != shard["bytes"]:
            raise ValueError(f"{shard['file']} is missing or not {shard['bytes']} bytes")
        try:
            f = safe_open(file, framework="pt", device="cpu")
        except SafetensorError as err:
            raise ValueError(f"{shard['file']} unreadable: {err}") from None
        stored = set(f.keys())
        for n in index["names"]:
            shape = f.get_slice(n).get_shape() if n in stored else None
            if shape != [shard["tokens"], hidden]:
                raise ValueError(f"{shard['file']}: {n} has shape {shape}")
        shards.append(f)
    rows = index["rows"]
    if len(rows) != settings["num_rows"] or any(
        r is None or r[1] + r[2] > index["shards"][r[0]]["tokens"] for r in rows
    ):
        raise ValueError("the row table does not cover every row")
    return FeatureCache(
        path=path,
        hidden_layers=tuple(settings["hidden_layers"]),
        names=tuple(index["names"]),
        dtype=getattr(torch, settings["dtype"]),
        rows=rows,
        shards=shards,
    )


@torch.no_grad()  # as Target.forward: training clones these into autograd graphs
def cached_target_output(
    cache: FeatureCache,
    target: Target,
    row_ids: list[int],  # train_rows indices of the batch, in batch order
    batch: dict[str, Tensor],  # collate(...) of those rows: input_ids, attention_mask [B, T]
) -> TargetOutput:
    """What `target(batch["input_ids"], attention_mask=..., hidden_layers=the draft's,
    use_cache=False)` returns, from the cache: hidden states at the real positions, zeros at
    the padding (masked out of every loss), and logits = target.head_logits(last)."""
    B, T = batch["input_ids"].shape
    lengths = batch["attention_mask"].sum(1).tolist()
    if cache.dtype != target.dtype:  # the key holds the dtype: a caller mixed up targets
        raise ValueError(f"{cache.path} holds {cache.dtype} features, the target is {target.dtype}")
    dev, H = target.device, target.hidden_size
    states = {n: torch.zeros(B, T, H, dtype=cache.dtype, device=dev) for n in cache.names}
    for b, i in enumerate(row_ids):
        shard, first, n = cache.rows[i]
        if n != lengths[b]:
            raise ValueError(
                f"row {i} has {lengths[b]} tokens in the batch but {n} in the feature cache "
                f"{cache.path}: pass the train_rows indices of the batch, in batch order"
            )
        for name in cache.names:
            states[name][b, :n] = cache.shards[shard].get_slice(name)[first : first + n].to(dev)
    last = states["last"]  # [B, T, H] after the final norm
    return TargetOutput(
        logits=target.head_logits(last),  # [B, T, V]
        hidden={la: states[_name(la)] for la in cache.hidden_layers},
        cache=None,
    )
