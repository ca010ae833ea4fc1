"""Packs: target-written conversations built once, shipped or kept, trained on without a
target forward (`data.pack`).

A pack is a directory holding `conversations.jsonl.gz` (one line per conversation: its
`source` — "self", a request the target wrote itself (train/data/self_prompts.py), or
"pool", a prompt of the embedded corpus —, `category`, `group`, the user's `prompt` and the
target's `answer_ids` with `finished`) and `manifest.json`: the target's name and weights
fingerprint, the chat template's hash, the answers' sampling and dtype, the sources and their
counts, what the self-prompt filters dropped, the protected prompts, the command and commit
that built it. `build_pack` writes one (scripts/build_pack.py: one resumable command, every
answer through the regeneration cache); `load_pack` reads one into training items, refusing
a pack written for other weights or another template (with the command that builds one for
this target), and dropping every conversation whose prompt is a near-copy of a protected
prompt (the run's eval prompts and the out-of-domain prompts), whatever seed split them.

The embedded SmolLM2 target's pack ships in train/data/packs/smollm2_135m (`data.pack:
builtin`).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

from models.target import Target
from train.data.self_prompts import NearCopies
from train.disk import write_atomic

BUILTIN = Path(__file__).parent / "packs" / "smollm2_135m"
FORMAT = 1
BUILD_COMMAND = "python scripts/build_pack.py --out DIR"  # + the run's target= / data. overrides


def template_hash(chat_template: str) -> str:
    return hashlib.sha256(chat_template.encode()).hexdigest()[:16]


def resolve_pack(setting: str | None) -> Path | None:
    """data.pack: null (no pack), builtin (the embedded target's), or a pack directory."""
    if setting in (None, "", "none"):
        return None
    path = BUILTIN if setting == "builtin" else Path(setting).expanduser()
    if not (path / "manifest.json").is_file() or not (path / "conversations.jsonl.gz").is_file():
        raise FileNotFoundError(
            f"data.pack={setting!r}: {path} holds no manifest.json and conversations.jsonl.gz; "
            f"build one with `{BUILD_COMMAND}` (docs/training.md, 'Packs')"
        )
    return path


def read_manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def check_pack(path: Path, manifest: dict, target: Target, chat_template: str) -> None:
    """Refuse a pack whose answers another target or template wrote."""
    want = {"weights": target.fingerprint, "chat_template": template_hash(chat_template)}
    have = {k: manifest.get(k) for k in want}
    if manifest.get("format") != FORMAT or have != want:
        raise ValueError(
            f"data.pack {path}: written by target {manifest.get('target')!r} (weights "
            f"{have['weights']}, template {have['chat_template']}), but this run's target "
            f"{target.name!r} has weights {want['weights']} and template {want['chat_template']}: "
            f"its answers are not this target's. Build a pack for it with `{BUILD_COMMAND} "
            "target=... data.chat_template=...`, or set data.pack=null"
        )


def load_pack(
    path: Path, target: Target, chat_template: str, prompt_ids, protected: list[str],
    max_tokens: int | None = None, sources: tuple[str, ...] = ("self", "pool"), val: int = 0,
) -> tuple[list[dict], list[dict], dict]:  # fmt: skip
    """Training items (`ids`, `flags`, `category`, `group`, `stream` "pack") of the pack at
    `path`, in file order, the answers' tokens up to `max_tokens` (None: all), from
    `sources`, after the first `val` conversations, held out as validation items (the same
    fields, stream "val"); `prompt_ids(messages)` renders a prompt with the run's template.
    Returns the training items, the validation items and their stats (conversations and
    answer tokens per source, dropped near-copies)."""
    manifest = read_manifest(path)
    check_pack(path, manifest, target, chat_template)
    guard = NearCopies(protected)
    items, held, stats = [], [], {"path": str(path), "protected_dropped": 0, "answer_tokens": 0}
    with gzip.open(path / "conversations.jsonl.gz", "rt") as f:
        for line in f:
            row = json.loads(line)
            if row["source"] not in sources:
                continue
            if max_tokens is not None and stats["answer_tokens"] >= max_tokens:
                break
            if guard.near(row["prompt"]):
                stats["protected_dropped"] += 1
                continue
            messages = [{"role": "user", "content": row["prompt"]}]
            ids = prompt_ids(messages)
            answer = row["answer_ids"]
            item = {"messages": messages, "category": row["category"], "group": row["group"],
                    "ids": ids + answer, "flags": [0] * len(ids) + [1] * len(answer)}  # fmt: skip
            if len(held) < val:
                held.append({**item, "stream": "val"})
                continue
            items.append({**item, "stream": "pack"})
            per = stats.setdefault(row["source"], {"conversations": 0, "answer_tokens": 0})
            per["conversations"] += 1
            per["answer_tokens"] += len(answer)
            stats["answer_tokens"] += len(answer)
    stats["val_conversations"] = len(held)
    return items, held, stats


def git_commit() -> str | None:
    """The commit the code was at, "-dirty" where tracked files had changes."""
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True)  # fmt: skip
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def write_pack(out: Path, rows: list[dict], manifest: dict) -> None:
    """The pack's two files, each written to a temporary name and renamed, the manifest last:
    a reader never sees a pack without its manifest or half a conversation file."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"conversations.jsonl.gz.tmp-{os.getpid()}"
    with gzip.GzipFile(tmp, "wb", mtime=0) as f:  # mtime 0: the same rows, the same bytes
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
    tmp.replace(out / "conversations.jsonl.gz")
    manifest = {"format": FORMAT, **manifest, "created": time.strftime("%Y-%m-%d")}
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=1) + "\n")
