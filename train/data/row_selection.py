"""The rows of a read and tokenized local source (train/data/local_source.py) chosen and
summed without holding them: eval prompts and the training order (`held_out_split`), the
usable rows in that order (`pick_rows`), and one pass of counts over what was picked
(`RowScan`: label counts, per-stream tokens, lengths, categories)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from datasets.table import InMemoryTable

from train.data.chat import shift_mask
from train.data.local_source import OK, ROW_FEATURES, STATUS_STATS, text_hash


def pick_rows(
    rows: datasets.Dataset, order: list[int], num_train: int | None, num_reference: int, stats: dict
) -> tuple[list[datasets.Dataset], np.ndarray]:
    """From the tokenized rows, in `order`, the usable ones: the first `num_train` (None: all;
    memory-mapped, stream "source") and the next `num_reference` (stream "reference", in
    Arrow memory), and the former's indices. `stats` counts the unusable rows by reason among
    those read to find them (the order up to the last row taken; all of it when it ran short),
    and the truncated ones taken."""
    order = np.asarray(order, dtype=np.int64)
    status = np.asarray(rows.data.column("status"))[order]
    usable_at = np.flatnonzero(status == OK)  # positions in `order`
    usable = order[usable_at]
    main = usable[: len(usable) if num_train is None else num_train]
    reference = usable[len(main) : len(main) + num_reference]
    taken = len(main) + len(reference)
    ran_short = num_train is None or taken < num_train + num_reference
    read = len(order) if ran_short else (int(usable_at[taken - 1]) + 1 if taken else 0)
    for code, name in STATUS_STATS.items():
        stats[name] += int((status[:read] == code).sum())
    stats["truncated"] += int(np.asarray(rows.data.column("truncated"))[usable[: len(main) + len(reference)]].sum())  # fmt: skip
    parts = [rows.select(main).remove_columns(["status", "truncated"])]
    if num_reference:
        table = rows.select(reference).remove_columns(["status", "truncated"]).with_format("arrow")[:]  # fmt: skip
        at = table.schema.get_field_index("stream")
        table = table.set_column(at, "stream", pa.array(["reference"] * len(table), pa.string()))
        parts.append(datasets.Dataset(InMemoryTable(table)))
    return parts, main


def held_out_split(
    conversations: datasets.Dataset, seed: int, num_eval: int, fits: Callable[[list[dict]], bool]
) -> tuple[list[dict], list[int], int]:
    """Eval prompts and the training order of a read source: the rows in seeded order, the
    first `num_eval` whose first user turn fits (`fits`) and is new held out as prompts
    (that turn and what precedes it); a row sharing a user turn with one of them is the same
    item and is dropped. Returns the eval conversations, the other rows' indices in seeded
    order, and how many were dropped."""
    order = list(range(len(conversations)))
    random.Random(seed).shuffle(order)
    eval_convs, eval_rows = [], set()
    for i in order:
        if len(eval_convs) == num_eval:
            break
        r = conversations[i]
        first_user = next((n + 1 for n, m in enumerate(r["messages"]) if m["role"] == "user"), 0)
        prompt = r["messages"][:first_user]
        fresh = prompt and all(prompt[-1]["content"] != c["messages"][-1]["content"] for c in eval_convs)  # fmt: skip
        if fresh and fits(prompt):
            eval_convs.append({"messages": prompt, "category": r["category"], "group": f"row:{r['index']}"})  # fmt: skip
            eval_rows.add(i)
    duplicates = rows_with_users(conversations, [c["messages"][-1]["content"] for c in eval_convs])  # fmt: skip
    order = [i for i in order if i not in eval_rows and i not in duplicates]
    return eval_convs, order, len(duplicates - eval_rows)


def rows_with_users(conversations: datasets.Dataset, user_texts: list[str]) -> set[int]:
    """Indices of conversations with a user turn equal to one of `user_texts`."""
    hashes = conversations.data.column("user_hashes").combine_chunks()
    hit = pc.is_in(pc.list_flatten(hashes), value_set=pa.array([text_hash(t) for t in user_texts], pa.int64()))  # fmt: skip
    parents = pc.list_parent_indices(hashes).to_numpy()
    return set(parents[hit.to_numpy(zero_copy_only=False)].tolist())


def row_sums(column: pa.ChunkedArray | pa.ListArray) -> np.ndarray:
    """Per row, the sum of a list column's values (e.g. trained tokens per row)."""
    lists = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = lists.offsets.to_numpy()
    running = np.concatenate([[0], np.cumsum(pc.list_flatten(lists).to_numpy().astype(np.int64))])
    return running[offsets[1:] - offsets[0]] - running[offsets[:-1] - offsets[0]]


class RowScan:
    """Trained label counts, per-stream rows / tokens / trained tokens, the longest row and
    rows per category, summed over batches of rows (Arrow tables or record batches)."""

    def __init__(self, vocab_size: int):
        self.counts = np.zeros(vocab_size, dtype=np.int64)
        self.streams: dict[str, dict] = {}
        self.longest, self.categories = 0, {}

    def add(self, batch: pa.Table | pa.RecordBatch, stream: str | None = None) -> None:
        """One batch; its rows' stream is `stream`, or its `stream` column's."""
        if not batch.num_rows:
            return
        ids = pc.list_flatten(batch["input_ids"]).to_numpy().astype(np.int64)
        mask = pc.list_flatten(batch["loss_mask"]).to_numpy().astype(bool)
        # A row's last mask entry is 0 (shift_mask), so flat neighbours never cross rows.
        labels = ids[1:][mask[:-1]]
        self.counts += np.bincount(labels, minlength=len(self.counts))[: len(self.counts)]
        lengths = pc.list_value_length(batch["input_ids"]).to_numpy()
        trained = row_sums(batch["loss_mask"])
        names = np.array([stream] * batch.num_rows if stream else batch["stream"].to_pylist())
        self.longest = max(self.longest, int(lengths.max()))
        for name in dict.fromkeys(names.tolist()):
            at = names == name
            st = self.streams.setdefault(name, {"rows": 0, "tokens": 0, "trained_tokens": 0})
            st["rows"] += int(at.sum())
            st["tokens"] += int(lengths[at].sum())
            st["trained_tokens"] += int(trained[at].sum())
        for count in pc.value_counts(batch["category"]).to_pylist():
            self.categories[count["values"]] = self.categories.get(count["values"], 0) + count["counts"]  # fmt: skip

    def add_dataset(self, rows: datasets.Dataset) -> None:
        for batch in rows.with_format("arrow").iter(10_000):
            self.add(batch)

    def add_shards(self, files: list[Path], picked: np.ndarray, stream: str) -> None:
        """The rows `picked` (global indices over `files`, in order) of tokenized shards,
        read a record batch at a time into memory that is freed after it: a scan of 10^6
        rows does not map the whole files into this process."""
        picked = np.sort(picked)
        start = 0
        for path in files:
            with pa.OSFile(str(path)) as f:
                for batch in pa.ipc.open_stream(f):
                    end = start + batch.num_rows
                    lo, hi = np.searchsorted(picked, [start, end])
                    if hi > lo:
                        keep = np.zeros(batch.num_rows, dtype=bool)
                        keep[picked[lo:hi] - start] = True
                        self.add(batch.filter(pa.array(keep)), stream)
                    start = end


def rows_dataset(items: list[dict], max_len: int, stats: dict) -> datasets.Dataset:
    """In-memory training rows from tokenized items (`ids`, per-token assistant `flags`,
    `group`, `stream`, `category`): cut to `max_len` (`stats["truncated"]` counts them), the
    mask shifted to what each position predicts; an item left with nothing to train is
    skipped and counted."""
    columns: dict[str, list] = {k: [] for k in ROW_FEATURES}
    for it in items:
        ids, flags = it["ids"], it["flags"]
        if len(ids) > max_len:
            ids, flags = ids[:max_len], flags[:max_len]
            stats["truncated"] += 1
        mask = shift_mask(flags)
        if sum(mask) == 0:
            skip = "skipped_truncated_away" if len(ids) == max_len else "skipped_no_assistant"
            stats[skip] += 1
            continue
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        columns["category"].append(it.get("category", "chat"))
        columns["group"].append(it["group"])
        columns["stream"].append(it["stream"])
    return datasets.Dataset.from_dict(columns, features=ROW_FEATURES)
