"""A local chat source read and tokenized once, on disk: bounded memory, parallel, cached.

Two stages, each a directory of Arrow shards of SHARD_ROWS rows under <cache>/data/,
memory-mapped when read (as `datasets` does), never a Python list of the whole source:

1. `read_source`: the source's rows as conversations (`messages` role/content, `category`,
   `index` among the source's rows, `where`: its line in a .json/.jsonl file, else its
   index; `user_hashes`).
   Key: the file's bytes (blake2b) and the split; a dataset directory or hub name:
   `datasets`' own fingerprint; READ_FORMAT (the reader's version). A damaged row (not JSON, a turn that is not role/content, an
   unknown ShareGPT role) is reported with its line and skipped (`bad_rows=skip`: counted,
   the first ones listed) or refused there (`bad_rows=refuse`). Written by rank 0.
2. `tokenize_rows`: every conversation tokenized whole with the one chat template and its
   assistant mask (train/data/chat.py), the mask shifted, the row cut to max_len, a `status`
   per row. Key (`tokenized_key`): stage 1's, the tokenizer's vocabulary and special-tokens
   map (the template renders them), template, end tokens, max_len, FORMAT and the
   transformers version (its template rendering and tokenizers). Rank r writes shards r, r + world, ..., spread over `num_proc` processes; each
   shard is written to a temporary name and renamed, so an interrupted preparation resumes
   at its missing shards; then every rank maps all of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import datasets
import pyarrow.parquet as pq
import transformers
from datasets.arrow_writer import ArrowWriter
from tqdm.auto import tqdm

from train.data.chat import assistant_spans, encode_batch, fast_renderer, shift_mask, span_flags
from train.data.sources import FILE_BUILDERS, check_source, guess_category, to_messages
from train.disk import drop_dead_writers, out_of_space
from train.parallel.ranks import Ranks

SHARD_ROWS = 5000
# Raise when a stage's output changes for the same input: READ_FORMAT for stage 1 (to_messages,
# guess_category, the ShareGPT roles, `conversation`), FORMAT for stage 2 (the rows' columns,
# masks, status codes).
READ_FORMAT = 1
FORMAT = 1
OK, NO_ASSISTANT, TEMPLATE_MISMATCH, TRUNCATED_AWAY = range(4)  # tokenized `status`
STATUS_STATS = {
    NO_ASSISTANT: "skipped_no_assistant",
    TEMPLATE_MISMATCH: "skipped_template_mismatch",
    TRUNCATED_AWAY: "skipped_truncated_away",
}
TURN = {"role": datasets.Value("string"), "content": datasets.Value("string")}
CONVERSATION_FEATURES = datasets.Features(
    {
        "messages": datasets.List(TURN),
        "category": datasets.Value("string"),
        "where": datasets.Value("int64"),
        "index": datasets.Value("int64"),
        "user_hashes": datasets.List(datasets.Value("int64")),
    }
)
ROW_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "category": datasets.Value("string"),
        "group": datasets.Value("string"),
        "stream": datasets.Value("string"),
    }
)
TOKEN_FEATURES = datasets.Features(
    {
        **ROW_FEATURES,
        "stream": datasets.Value("string"),  # "source": the source's own answers
        "status": datasets.Value("int8"),
        "truncated": datasets.Value("bool"),
    }
)


def text_hash(text: str) -> int:
    """A stable signed 64-bit hash of a string (user turns compared across rows)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)  # fmt: skip


def file_hash(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------
# Stage 1: the source's rows as conversations
# ---------------------------------------------------------------------------------


def json_records(path: Path) -> Iterator[tuple[int, object]]:
    """(line, row) of a JSON-lines file, or of a file holding one JSON array; a line that is
    not JSON gives (line, ValueError). A damaged element of an array is refused: the
    elements after it cannot be found."""
    with path.open("rb") as f:
        array = f.read(4096).lstrip()[:1] == b"["
    if not array:
        with path.open("rb") as f:
            for line, text in enumerate(f, 1):
                if text.strip():
                    try:
                        yield line, json.loads(text)
                    except ValueError as err:
                        yield line, ValueError(f"not JSON ({err})")
        return
    decoder, buf, pos, line, eof = json.JSONDecoder(), "", 0, 1, False
    with path.open(encoding="utf-8") as f:

        def skip(chars: str) -> str:  # past whitespace and `chars`; the next char ("" at end)
            nonlocal buf, pos, line, eof
            while True:
                while pos < len(buf) and (buf[pos].isspace() or buf[pos] in chars):
                    line += buf[pos] == "\n"
                    pos += 1
                if pos < len(buf) or eof:
                    return buf[pos : pos + 1]
                buf, pos, eof = f.read(1 << 20), 0, False
                eof = not buf

        skip("[")
        while skip(",") not in ("]", ""):
            while True:
                try:
                    row, end = decoder.raw_decode(buf, pos)
                    if end < len(buf) or eof:
                        break
                except ValueError as err:
                    if eof or len(buf) - pos > 1 << 26:  # no element is 64 MB
                        raise ValueError(
                            f"{path}: line {line}: not JSON ({err}); a damaged element of a "
                            "JSON array cannot be skipped (the elements after it cannot be "
                            "found): mend it, or give one JSON object per line (.jsonl)"
                        ) from None
                more = f.read(1 << 20)
                eof = not more
                buf, pos = buf[pos:] + more, 0
            yield line, row
            line += buf.count("\n", pos, end)
            pos = end


def source_rows(source: str, split: str) -> tuple[Iterator[tuple[int, object]], str, int | None]:
    """(where, row) of every row, what `where` counts ("line" or "row") and the row count
    when known before reading."""
    path = Path(source).expanduser()
    if path.is_file() and FILE_BUILDERS[path.suffix] == "json":
        return json_records(path), "line", None
    if path.is_file():  # parquet, read a batch at a time
        table = pq.ParquetFile(path)

        def parquet_rows() -> Iterator[tuple[int, object]]:
            at = 0
            for batch in table.iter_batches(batch_size=1000):
                for row in batch.to_pylist():
                    yield at, row
                    at += 1

        return parquet_rows(), "row", table.metadata.num_rows
    ds = dataset_source(source, split)
    return enumerate(ds), "row", len(ds)


def dataset_source(source: str, split: str) -> datasets.Dataset:
    """A local dataset directory or a hub name, through `datasets` (memory-mapped)."""
    path = Path(source).expanduser()
    try:
        return datasets.load_dataset(str(path) if path.exists() else source, split=split)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"data.source={source!r} (split {split!r}) could not be loaded: {err}. A hub "
            "dataset needs network access or a populated HF cache; otherwise give a local "
            ".json/.jsonl/.parquet file or directory, or data=default for the embedded corpus"
        ) from err


def source_key(source: str, split: str) -> str:
    path = Path(source).expanduser()
    if path.is_file():
        return f"{path.stem[:40]}-{file_hash(path)}-r{READ_FORMAT}"
    return f"{path.name[:40]}-{split}-{dataset_source(source, split)._fingerprint}-r{READ_FORMAT}"


def conversation(row: object, source: str) -> dict:
    """One source row as a stage-1 row; ValueError when it is not a conversation."""
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"a row is a JSON object, not {type(row).__name__}")
    try:
        messages = to_messages(row, source)
    except (KeyError, TypeError, AttributeError) as err:  # a turn that is not role/content
        raise ValueError(
            f"a turn is not a {{role, content}} (OpenAI) or {{from, value}} (ShareGPT) object "
            f"({type(err).__name__}: {err})"
        ) from None
    if any(not isinstance(m["content"], str) or not isinstance(m["role"], str) for m in messages):
        raise ValueError("a turn's role and content are strings")
    users = [m["content"] for m in messages if m["role"] == "user"]
    return {
        "messages": messages,
        "category": row.get("category") or guess_category(users[0] if users else ""),
        "user_hashes": [text_hash(u) for u in users],
    }


def write_conversations(source: str, split: str, bad_rows: str, out: Path, progress: bool) -> None:
    """Stage 1 into `out` (written beside it, renamed when whole): shards and info.json. The
    directory it is written in is this process's own, so two runs preparing one file on one
    cache never write into each other's; the first to finish renames its copy into place and
    the other drops its own (the same read of the same bytes)."""
    rows, unit, total = source_rows(source, split)
    host = socket.gethostname()
    drop_dead_writers(out.parent, f"{out.name}.tmp-{host}-")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-{host}-{os.getpid()}-", dir=out.parent))
    info: dict = {"unit": unit, "rows": 0, "bad_rows": 0, "bad_rows_first": []}
    try:
        writer, shard = None, 0
        bar = tqdm(total=total, unit="row", desc="read source", disable=not progress, mininterval=2)
        for index, (where, row) in enumerate(rows):
            bar.update(1)
            try:
                conv = conversation(row, source)
            except ValueError as err:
                if bad_rows == "refuse":  # (the copy is removed below, as for any error)
                    raise ValueError(
                        f"data.source={source!r} {unit} {where}: {err}; mend or remove the row, or "
                        "set data.bad_rows=skip to leave damaged rows out (counted in summary.json)"
                    ) from None
                info["bad_rows"] += 1
                if len(info["bad_rows_first"]) < 10:
                    info["bad_rows_first"].append(f"{unit} {where}: {str(err)[:200]}")
                continue
            if writer is None:
                path = tmp / f"conversations-{shard:05d}.arrow"
                writer = ArrowWriter(features=CONVERSATION_FEATURES, path=str(path))
            writer.write({**conv, "where": where, "index": index})
            info["rows"] += 1
            if info["rows"] % SHARD_ROWS == 0:
                writer.finalize()
                writer.close()
                writer, shard = None, shard + 1
        bar.close()
        if writer is not None:
            writer.finalize()
            writer.close()
        if not info["rows"]:
            first = "; ".join(info["bad_rows_first"][:3])
            raise ValueError(
                f"data.source={source!r} holds no readable conversation (split {split!r})"
                + (f": {first}" if first else "")
                + "; give one JSON object per line (.jsonl), a JSON list (.json) or a parquet "
                "table, each row a conversation (ShareGPT `conversations` or OpenAI `messages`)"
            )
        (tmp / "info.json").write_text(json.dumps(info))
    except BaseException as err:  # a read cut short leaves no copy behind
        shutil.rmtree(tmp, ignore_errors=True)
        fix = "Free space (data.cache_dir) and rerun."
        full = out_of_space(err, f"data.source={source!r} read into shards", out.parent, fix)
        if full is not None:
            raise full from err
        raise
    try:
        tmp.rename(out)  # atomic; refused where another run's copy is already in place
    except OSError:
        if not (out / "info.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def read_source(
    source: str, split: str, bad_rows: str, cache_root: Path, ranks: Ranks, progress: bool
) -> tuple[datasets.Dataset, dict, str]:
    """Stage 1: the conversations (memory-mapped), the read's info, its cache key."""
    check_source(source)
    if bad_rows not in ("skip", "refuse"):
        raise ValueError(f"data.bad_rows={bad_rows!r}: use skip or refuse")
    key = source_key(source, split)
    out = cache_root / "data" / "sources" / key
    if ranks.main and not (out / "info.json").exists():
        write_conversations(source, split, bad_rows, out, progress and ranks.main)
    ranks.barrier()
    info = json.loads((out / "info.json").read_text())
    if info["bad_rows"] and bad_rows == "refuse":  # read earlier with skip
        raise ValueError(
            f"data.source={source!r}: {info['bad_rows']} damaged rows "
            f"({'; '.join(info['bad_rows_first'][:3])}); mend them or set data.bad_rows=skip"
        )
    files = sorted(out.glob("conversations-*.arrow"))
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in files]), info, key  # fmt: skip


# ---------------------------------------------------------------------------------
# Stage 2: every conversation tokenized whole
# ---------------------------------------------------------------------------------


def tokenize_rows_batch(batch: list[list[dict]], tok, template: str, end_tokens: list[str], max_len: int) -> list[dict]:  # fmt: skip
    """input_ids, shifted loss_mask (cut to max_len), status and truncated of each
    conversation; the texts encoded in one call (the fast tokenizer's batch path)."""
    rows, texts, spans, render = [], [], [], fast_renderer(tok, template)
    for messages in batch:
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        row = {"input_ids": [], "loss_mask": [], "status": OK, "truncated": False}
        if last is None or last == 0 or messages[last - 1]["role"] == "assistant":
            row["status"] = NO_ASSISTANT
        else:
            try:
                text, row_spans = assistant_spans(
                    tok, messages, False, end_tokens, template, render
                )
                texts.append(text)
                spans.append(row_spans)
            except ValueError:  # e.g. a row that opens with an assistant turn
                row["status"] = TEMPLATE_MISMATCH
        rows.append(row)
    all_ids, offsets = encode_batch(tok, texts) if texts else ([], [])
    at = 0
    for row in rows:
        if row["status"] != OK:
            continue
        ids, flags = all_ids[at], span_flags(offsets[at], spans[at])
        at += 1
        row["truncated"] = len(ids) > max_len
        ids, mask = ids[:max_len], shift_mask(flags[:max_len])
        if not any(mask):
            row["status"] = TRUNCATED_AWAY if len(ids) == max_len else NO_ASSISTANT
            row["truncated"] = False
        else:
            row["input_ids"], row["loss_mask"] = ids, mask
    return rows


def tokenize_shard(job: tuple) -> int:
    """One stage-2 shard from one stage-1 shard (a worker process's unit of work)."""
    conv_path, out_path, tok, template, end_tokens, max_len = job
    conv = datasets.Dataset.from_file(conv_path)
    tmp = f"{out_path}.tmp-{os.getpid()}"
    try:
        writer = ArrowWriter(features=TOKEN_FEATURES, path=tmp)
        for start in range(0, len(conv), 500):
            batch = conv[start : start + 500]
            rows = tokenize_rows_batch(batch["messages"], tok, template, end_tokens, max_len)
            for row, category, index in zip(rows, batch["category"], batch["index"], strict=True):
                writer.write({**row, "category": category, "group": f"row:{index}", "stream": "source"})  # fmt: skip
        writer.finalize()
        writer.close()
    except BaseException as err:  # no partial shard left behind, none ever under its name
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        fix = "Free space and rerun: the shards already written are kept and not redone."
        full = out_of_space(err, f"tokenized shard {Path(out_path).name}", Path(out_path).parent, fix)  # fmt: skip
        if full is not None:
            raise full from err
        raise
    os.replace(tmp, out_path)
    return len(conv)


def tokenizer_hash(tok) -> str:
    backend = tok.backend_tokenizer.to_str() if tok.is_fast else repr(sorted(tok.get_vocab().items()))  # fmt: skip
    return hashlib.blake2b(backend.encode(), digest_size=16).hexdigest()


def tokenized_key(conv_key: str, tok, template: str, end_tokens: list[str], max_len: int) -> str:
    """Stage 2's directory name: everything its rows depend on besides stage 1's."""
    special = sorted((k, str(v)) for k, v in tok.special_tokens_map.items())
    settings = [conv_key, tokenizer_hash(tok), special, template, end_tokens, max_len, FORMAT,
                transformers.__version__]  # fmt: skip
    return hashlib.blake2b(json.dumps(settings).encode(), digest_size=16).hexdigest()


def tokenize_rows(
    conv_key: str, tok, template: str, end_tokens: list[str], max_len: int, cache_root: Path,
    num_proc: int | None, ranks: Ranks, progress: bool,
) -> datasets.Dataset:  # fmt: skip
    """Stage 2 (memory-mapped), in stage 1's row order; shards this rank lacks written first."""
    out = cache_root / "data" / "tokenized" / tokenized_key(conv_key, tok, template, end_tokens, max_len)  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    conv_files = sorted((cache_root / "data" / "sources" / conv_key).glob("conversations-*.arrow"))
    shards = [out / f"rows-{s:05d}.arrow" for s in range(len(conv_files))]
    todo = [s for s in ranks.mine(len(shards)) if not shards[s].exists()]
    jobs = [(str(conv_files[s]), str(shards[s]), tok, template, end_tokens, max_len) for s in todo]
    procs = min(len(jobs), num_proc or max(1, (os.cpu_count() or 1) // ranks.world))
    total = sum(datasets.Dataset.from_file(j[0]).num_rows for j in jobs)
    bar = tqdm(total=total, unit="row", desc="tokenize", disable=not (progress and ranks.main and jobs))  # fmt: skip
    if procs > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one thread per process
        with multiprocessing.get_context("spawn").Pool(procs) as pool:
            for rows in pool.imap_unordered(tokenize_shard, jobs):
                bar.update(rows)
    else:
        for job in jobs:
            bar.update(tokenize_shard(job))
    bar.close()
    ranks.barrier()
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in shards])
