"""Raw-text chunks of the embedded corpus (train/data/corpus.py), not regenerated: whole
stdlib modules (code) and play scenes (prose), cut into line-aligned chunks of a token
budget, each a "Continue this file/scene:" conversation whose first lines are the user turn
and the rest the assistant turn. Only groups that are not held out give chunks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from train.data.corpus import held_out, play_files, play_speeches, python_fence, stdlib_files


def _raw_documents(category: str, seed: int) -> list[dict]:
    """Whole source texts of one category, seeded order: stdlib modules (code) or play
    scenes (prose), as lines, with the user prompt that introduces a chunk of them."""
    docs = []
    if category == "code":
        for path, rel in stdlib_files(seed):
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            docs.append(
                {
                    "group": f"stdlib:{rel}",
                    "lines": text.rstrip().splitlines(),
                    "intro": f"Continue this file, `{rel}` from Python's standard library:",
                    "fence": True,
                }
            )
        return docs
    for path in play_files():
        scenes: dict[tuple[str, str], list[str]] = {}
        title = ""
        for s in play_speeches(path):
            title = s["title"]
            scenes.setdefault((s["act"], s["scene"]), []).extend(
                [f"{s['speaker']}:", *s["lines"], ""]
            )
        for (act, scene), lines in scenes.items():
            docs.append(
                {
                    "group": f"play:{path.stem}",
                    "lines": lines[:-1],
                    "intro": f"Continue this scene from Shakespeare's {title} ({act}, {scene}):",
                    "fence": False,
                }
            )
    random.Random(seed).shuffle(docs)
    return docs


def _chunk_conversation(doc: dict, lines: list[str], n: int) -> dict:
    # The user turn shows the chunk's first lines; the assistant turn is the rest of it.
    k = min(8, max(2, len(lines) // 10))
    head, rest = "\n".join(lines[:k]).strip("\n"), "\n".join(lines[k:]).strip("\n")
    if doc["fence"]:
        head, rest = python_fence(head), python_fence(rest)
    return {
        "category": "code" if doc["fence"] else "prose",
        "group": doc["group"],
        "unit": f"{doc['group']}:chunk{n}",
        "messages": [
            {"role": "user", "content": f"{doc['intro']}\n\n{head}"},
            {"role": "assistant", "content": rest},
        ],
    }


def _chunks(
    category: str, seed: int, budget: int, line_tokens: Callable[[list[str]], list[int]]
) -> Iterator[dict]:
    """Consecutive line-aligned chunks of each document of a held-in group, each of about
    `budget` tokens of text at most (`line_tokens`: tokens per line, newline included).
    A chunk needs 4 lines (a head for the user turn, the rest for the answer); a document's
    tail under a quarter of the budget is dropped."""
    for doc in _raw_documents(category, seed):
        if held_out(doc["group"], seed):
            continue
        chunks, chunk, size = [], [], 0
        for line, cost in zip(doc["lines"], line_tokens(doc["lines"]), strict=True):
            if chunk and size + cost > budget:
                chunks.append(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += cost
        if size >= budget // 4:
            chunks.append(chunk)
        for n, lines in enumerate(c for c in chunks if len(c) >= 4):
            yield _chunk_conversation(doc, lines, n)


def raw_chunk_conversations(
    num: int, seed: int, budget: int, line_tokens: Callable[[list[str]], list[int]]
) -> list[dict]:
    """`num` raw-text chunks, alternately code (stdlib modules) and prose (play scenes),
    as "Continue this file/scene:" conversations: the first lines are the user turn, the
    rest of the chunk the assistant turn. `budget`: tokens of chunk text per row."""
    streams = [_chunks(c, seed, budget, line_tokens) for c in ("code", "prose")]
    out: list[dict] = []
    while len(out) < num and streams:
        for stream in list(streams):
            c = next(stream, None)
            if c is None:
                streams.remove(stream)
            elif len(out) < num:
                out.append(c)
    if len(out) < num:
        raise ValueError(
            f"data.num_raw_chunks={num}: the embedded corpus (stdlib modules, play scenes) "
            f"gives only {len(out)} chunks at data.max_len ({sum(c['category'] == 'code' for c in out)} "
            f"code); lower data.num_raw_chunks to at most {len(out)} or raise data.max_len"
        )
    return out


def raw_chunks_for(tok, tokenize: Callable, max_len: int, num: int, seed: int) -> list[dict]:
    """`num` chunk conversations that fit max_len tokens once `tokenize` (the chat template)
    has wrapped them: the budget is max_len less the template, the intro line and fences."""
    scaffold = tokenize([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])

    def line_tokens(lines: list[str]) -> list[int]:
        if not lines:
            return []
        ids = tok([line + "\n" for line in lines], add_special_tokens=False)["input_ids"]
        return [len(x) for x in ids]

    budget = max_len - len(scaffold[0]) - 32
    if budget < 32:
        raise ValueError(
            f"data.max_len={max_len} leaves no room for raw chunks after the chat "
            f"template ({len(scaffold[0])} tokens); raise data.max_len"
        )
    return list(raw_chunk_conversations(num, seed, budget, line_tokens))
