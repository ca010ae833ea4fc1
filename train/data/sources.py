"""Chat data sources: a local .json/.jsonl/.parquet file, a local dataset directory or a hub
dataset (through `datasets.load_dataset`), in ShareGPT (`conversations` with from/value) or
OpenAI (`messages` with role/content) form: each row's turns as messages (`to_messages`); read
and tokenized on disk by train/data/local_source.py.
`check_source` refuses a source that cannot hold any (unset, missing, empty, of another file
type) before the target is loaded (train/run/settings.py).
"""

from __future__ import annotations

import re
from pathlib import Path

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}


def to_messages(row: dict, source: str) -> list[dict]:
    """A row's turns as role/content messages (OpenAI form, or ShareGPT's from/value)."""
    if row.get("messages") is not None:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    if row.get("conversations") is not None:
        out = []
        for m in row["conversations"]:
            role = m.get("from", m.get("role"))
            if role not in SHAREGPT_ROLES:
                raise ValueError(
                    f"data.source={source!r}: unknown ShareGPT role {role!r}; expected one of "
                    f"{sorted(SHAREGPT_ROLES)}"
                )
            out.append({"role": SHAREGPT_ROLES[role], "content": m.get("value", m.get("content"))})
        return out
    raise ValueError(
        f"data.source={source!r}: rows need a `messages` column (OpenAI form: role/content) or a "
        f"`conversations` column (ShareGPT form: from/value); found {sorted(row)}"
    )


def guess_category(text: str) -> str:
    if "```" in text or re.search(r"\bdef |\bimport |\bfunction\b|\bclass \w+", text):
        return "code"
    return "qa" if text.rstrip().endswith("?") else "prose"


FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _has_text(path: Path) -> bool:
    """Whether a text file holds anything but whitespace (reads up to its first such line)."""
    with path.open("rb") as f:
        return any(line.strip() for line in f)


def check_source(source: str | None) -> None:
    """Refuse a data.source that cannot hold conversations, before the target is loaded: an
    unset one, a path that does not exist, a file of another type, an empty file. (A hub
    name is only tried when loaded; a file's rows are checked then too.)"""
    if source is None or str(source).strip() in ("", "???"):
        raise ValueError(
            "data.source is not set; data=local needs data.source=<file.json|file.jsonl|"
            "file.parquet|dataset dir|hub name>, or use data=default for the embedded corpus"
        )
    if source == "embedded":
        return
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix not in FILE_BUILDERS:
            raise ValueError(
                f"data.source={source!r}: unsupported file type {path.suffix!r}; "
                f"use one of {sorted(FILE_BUILDERS)} or a dataset directory"
            )
        if path.suffix != ".parquet" and not _has_text(path):
            raise ValueError(
                f"data.source={source!r} is empty; it needs one conversation per row "
                "(ShareGPT `conversations` or OpenAI `messages`)"
            )
    elif (source.startswith((".", "/", "~")) or path.suffix in FILE_BUILDERS) and not path.exists():
        raise FileNotFoundError(
            f"data.source={source!r} does not exist; give a .json/.jsonl/"
            ".parquet file, a dataset directory, a hub name or 'embedded'"
        )
