"""Chat data for draft training: sources, eval prompts, training rows, batches.

`prepare_data(target, **cfg.data)` is the one entry point. Every source becomes a list
of conversations (`messages` with role/content); a held-out slice becomes the eval
prompts; the rest is (by default) re-answered by the target (train/data/regenerate.py) and
tokenized with ONE chat template, used for regeneration, training masks and evaluation
prompts alike, with the assistant-only loss mask (train/data/chat.py).

Sources: "embedded" (train/data/corpus.py: HumanEval, Shakespeare, CPython stdlib; no network),
a local .json/.jsonl/.parquet file, or a local directory / hub dataset name (both go
through `datasets.load_dataset(source, split=...)`), in ShareGPT (`conversations` with
from/value) or OpenAI (`messages` with role/content) form.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from torch import Tensor

from models.dtype_choice import DtypeChoice, choose_dtype, time_forward
from models.target import Target
from train.data.chat import resolve_chat_template, shift_mask, tokenize_conversation
from train.data.corpus import CATEGORIES, embedded_conversations, reference_conversations
from train.data.raw_chunks import raw_chunk_conversations
from train.data.regenerate import regenerate as regenerate_responses

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclass
class PreparedData:
    train: datasets.Dataset  # input_ids, loss_mask (+ category, group, stream for inspection)
    eval_prompts: list[dict]  # category, messages, input_ids, group
    token_counts: Tensor  # [V] counts of trained label tokens
    stats: dict


# ---------------------------------------------------------------------------------
# Local files and hub datasets
# ---------------------------------------------------------------------------------


def _messages(row: dict, source: str) -> list[dict]:
    if row.get("messages") is not None:
        return [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    if row.get("conversations") is not None:
        out = []
        for m in row["conversations"]:
            role = m.get("from", m.get("role"))
            if role not in SHAREGPT_ROLES:
                raise ValueError(
                    f"{source}: unknown ShareGPT role {role!r}; expected one of "
                    f"{sorted(SHAREGPT_ROLES)}"
                )
            out.append({"role": SHAREGPT_ROLES[role], "content": m.get("value", m.get("content"))})
        return out
    raise ValueError(
        f"{source}: rows need a `messages` column (OpenAI form: role/content) or a "
        f"`conversations` column (ShareGPT form: from/value); found {sorted(row)}"
    )


def _guess_category(text: str) -> str:
    if "```" in text or re.search(r"\bdef |\bimport |\bfunction\b|\bclass \w+", text):
        return "code"
    return "qa" if text.rstrip().endswith("?") else "prose"


def load_conversations(source: str, split: str = "train") -> list[dict]:
    """Rows of a local json/jsonl/parquet file, a local dataset directory or a hub dataset."""
    path = Path(source).expanduser()
    builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
    if path.is_file():
        if path.suffix not in builders:
            raise ValueError(
                f"data.source={source!r}: unsupported file type {path.suffix!r}; "
                f"use one of {sorted(builders)} or a dataset directory"
            )
        ds = datasets.load_dataset(builders[path.suffix], data_files=str(path), split="train")
    else:
        if source.startswith((".", "/", "~")) and not path.exists():
            raise FileNotFoundError(
                f"data.source={source!r} does not exist; give a .json/.jsonl/"
                ".parquet file, a dataset directory, a hub name or 'embedded'"
            )
        try:  # a local dataset directory and a hub name take the same path
            ds = datasets.load_dataset(str(path) if path.exists() else source, split=split)
        except (OSError, ValueError) as err:
            raise FileNotFoundError(
                f"data.source={source!r} (split {split!r}) could not be loaded: {err}. A hub "
                "dataset needs network access or a populated HF cache; otherwise give a local "
                ".json/.jsonl/.parquet file or directory, or data=default for the embedded corpus"
            ) from err
    rows = []
    for i, row in enumerate(ds):
        messages = _messages(row, source)
        first_user = next((m["content"] for m in messages if m["role"] == "user"), "")
        rows.append(
            {
                "messages": messages,
                "group": f"row:{i}",
                "category": row.get("category") or _guess_category(first_user),
            }
        )
    return rows


# ---------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------


def collate(rows: list[dict], pad_token_id: int) -> dict[str, Tensor]:
    """Right-padded batch: input_ids, attention_mask, loss_mask, each [B, T]."""
    width = max(len(r["input_ids"]) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(rows), width), dtype=torch.long)  # [B, T]
    for b, r in enumerate(rows):
        n = len(r["input_ids"])
        input_ids[b, :n] = torch.tensor(r["input_ids"])
        attention_mask[b, :n] = 1
        loss_mask[b, :n] = torch.tensor(r["loss_mask"])
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


# ---------------------------------------------------------------------------------
# The entry point
# ---------------------------------------------------------------------------------


def regen_dtype_choice(
    target: Target, setting: str, items: list[dict], rows: int, max_new_tokens: int,
    cache_dir: str | None,
) -> DtypeChoice:  # fmt: skip
    """data.regen_dtype, or with "auto" the faster dtype for batched generation on this
    machine (models/dtype_choice.py): one step of `rows` rows over a cache as long as a
    typical prompt plus half an answer (rounded to 32 tokens, so similar data share a key)."""
    prompt = sorted(len(it["ids"]) for it in items)[len(items) // 2]
    cached = max(32, 32 * round((prompt + max_new_tokens / 2) / 32))
    shapes = {"target": target.name, "rows": rows, "new": 1, "cached": cached}
    return choose_dtype(
        "regenerate", setting, shapes,
        lambda dtype: time_forward(target, dtype, rows, 1, cached), target.device, cache_dir,
    )  # fmt: skip


def prepare_data(
    target: Target,
    source: str = "embedded",
    split: str = "train",
    max_len: int = 512,
    num_train: int | None = 256,
    num_eval: int = 18,
    num_reference: int = 0,
    num_raw_chunks: int = 0,
    regenerate: bool = True,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    regen_batch_size: int = 16,
    regen_dtype: str = "auto",
    seed: int = 0,
    cache_dir: str | None = None,
    stdlib_files: int = 150,
    chat_template: str | None = None,
    progress: bool = True,
) -> PreparedData:
    """Training rows (target-regenerated by default), eval prompts, label token counts.
    `chat_template`: None = the tokenizer's, a preset name or a Jinja string (module doc).

    Beside the `num_train` rows (stream "regen", or "source" with regenerate=false), two
    streams that are never regenerated (cheap to build: no target forward):
    `num_reference` more conversations answered by their source's own answer (embedded:
    unused source units with a reference; a local source: its rows after the first
    num_train) and `num_raw_chunks` raw-text chunks of the embedded corpus (stdlib modules,
    play scenes) of up to max_len tokens, as "Continue this file:" conversations.
    """
    tok = target.tokenizer
    try:
        template = resolve_chat_template(tok, chat_template)
    except ValueError as err:
        raise ValueError(f"target {target.name!r}: {err}") from None
    max_prompt = max_len // 2  # leave at least half of max_len for the answer

    # Every token id the target stops on (e.g. <|eot_id|> besides <|end_of_text|>).
    end_tokens = tok.convert_ids_to_tokens(target.eos_token_ids)

    def tokenize(messages: list[dict], gen: bool = False) -> tuple[list[int], list[int]]:
        return tokenize_conversation(tok, messages, gen, end_tokens, template)

    def prompt_ids(messages: list[dict]) -> list[int]:
        return tokenize(messages, gen=True)[0]

    def fits(messages: list[dict]) -> bool:
        try:
            return len(prompt_ids(messages)) <= max_prompt
        except ValueError:  # the template cannot render it prefix by prefix
            return False

    stats: dict = {
        "source": source,
        "skipped_no_assistant": 0,
        "skipped_long_prompt": 0,
        "skipped_truncated_away": 0,
        "truncated": 0,
        "skipped_template_mismatch": 0,
        "dropped_eval_duplicates": 0,
    }
    if source == "embedded":
        train_convs, eval_convs, extra = embedded_conversations(
            num_train or 10**9, num_eval, seed, fits, not regenerate, stdlib_files
        )
        stats.update(extra)
    else:
        rows = load_conversations(source, split)
        stats["source_rows"] = len(rows)
        random.Random(seed).shuffle(rows)
        eval_convs, train_convs = [], []
        for r in rows:
            prompt = r["messages"][
                : next((i + 1 for i, m in enumerate(r["messages"]) if m["role"] == "user"), 0)
            ]
            fresh = prompt and all(
                prompt[-1]["content"] != c["messages"][-1]["content"] for c in eval_convs
            )
            if len(eval_convs) < num_eval and fresh and fits(prompt):
                eval_convs.append({**r, "messages": prompt})
            else:
                train_convs.append(r)
        # A duplicate of an eval prompt elsewhere in the file is the same item: drop it.
        eval_texts = {c["messages"][-1]["content"] for c in eval_convs}
        kept = [
            r
            for r in train_convs
            if not any(m["role"] == "user" and m["content"] in eval_texts for m in r["messages"])
        ]
        stats["dropped_eval_duplicates"] = len(train_convs) - len(kept)
        train_convs = kept

    # Prompt = everything before the last assistant turn: the answer regeneration replaces.
    # Embedded prompts without a source answer are `prompt_only`: regeneration answers them.
    items = []
    for c in train_convs:
        msgs = c["messages"]
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        prompt = msgs[:last] if last is not None else msgs
        if (
            (last is None and not c.get("prompt_only"))
            or not prompt
            or prompt[-1]["role"] == "assistant"
        ):
            stats["skipped_no_assistant"] += 1
            continue
        try:  # regenerate: prompt tokens (+ the target's answer later); else the whole row
            ids, flags = tokenize(prompt, gen=True) if regenerate else tokenize(msgs)
        except ValueError:  # e.g. a row that opens with an assistant turn
            stats["skipped_template_mismatch"] += 1
            continue
        if regenerate and len(ids) > max_prompt:  # no room left for the answer
            stats["skipped_long_prompt"] += 1
            continue
        items.append({**c, "ids": ids, "flags": flags})
    items, rest = (items[:num_train], items[num_train:]) if num_train else (items, [])
    for it in items:
        it["stream"] = "regen" if regenerate else "source"

    if regenerate and items:
        choice = regen_dtype_choice(
            target, regen_dtype, items, regen_batch_size, max_new_tokens, cache_dir
        )
        stats["regen_dtype"] = choice.as_record()
        if progress and choice.source != "explicit":
            print(f"dtype {choice.describe()}", flush=True)
        answers, stats["regen"] = regenerate_responses(
            target,
            [it["ids"] for it in items],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            batch_size=regen_batch_size,
            dtype=choice.dtype,
            seed=seed,
            cache_dir=cache_dir,
            chat_template=template,
            progress=progress,
        )
        for it, answer in zip(items, answers, strict=True):
            # The target's own tokens, EOS included when it stopped; all of them trained.
            it["ids"], it["flags"] = (
                it["ids"] + answer["ids"],
                it["flags"] + [1] * len(answer["ids"]),
            )

    # The streams that are not regenerated: whole conversations, assistant turns trained.
    extra = []
    if num_reference and source == "embedded":
        used = {c["unit"] for c in train_convs + eval_convs}
        extra += [
            {**c, "stream": "reference"}
            for c in reference_conversations(num_reference, seed, fits, used)
        ]
    elif num_reference:
        answered = [c for c in rest if not c.get("prompt_only")]
        if len(answered) < num_reference:
            raise ValueError(
                f"data.num_reference={num_reference}: data.source={source!r} has only "
                f"{len(answered)} answered rows beyond data.num_train={num_train}; lower one"
            )
        extra += [{**c, "stream": "reference"} for c in answered[:num_reference]]
    if num_raw_chunks:
        scaffold = tokenize([{"role": "user", "content": ""}, {"role": "assistant", "content": ""}])

        def line_tokens(lines: list[str]) -> list[int]:
            if not lines:
                return []
            ids = tok([line + "\n" for line in lines], add_special_tokens=False)["input_ids"]
            return [len(x) for x in ids]

        # Room for the chunk's text: max_len less the template, the intro line and fences.
        budget = max_len - len(scaffold[0]) - 32
        if budget < 32:
            raise ValueError(
                f"data.max_len={max_len} leaves no room for raw chunks after the chat "
                f"template ({len(scaffold[0])} tokens); raise data.max_len"
            )
        extra += [
            {**c, "stream": "raw"}
            for c in raw_chunk_conversations(num_raw_chunks, seed, budget, line_tokens)
        ]
    for c in extra:
        try:
            ids, flags = tokenize(c["messages"])
        except ValueError:
            stats["skipped_template_mismatch"] += 1
            continue
        items.append({**c, "ids": ids, "flags": flags})

    columns: dict[str, list] = {
        "input_ids": [],
        "loss_mask": [],
        "category": [],
        "group": [],
        "stream": [],
    }
    for it in items:
        ids, flags = it["ids"], it["flags"]
        if len(ids) > max_len:
            ids, flags = ids[:max_len], flags[:max_len]
            stats["truncated"] += 1
        mask = shift_mask(flags)
        if sum(mask) == 0:
            stats["skipped_truncated_away" if len(ids) == max_len else "skipped_no_assistant"] += 1
            continue
        columns["input_ids"].append(ids)
        columns["loss_mask"].append(mask)
        columns["category"].append(it.get("category", "chat"))
        columns["group"].append(it["group"])
        columns["stream"].append(it["stream"])
    if not columns["input_ids"]:
        raise ValueError(
            f"data.source={source!r} produced no training rows ({stats}); check the "
            "source has conversations with assistant turns, or raise data.max_len"
        )

    # Trained labels, input_ids[t+1] where loss_mask[t], of all rows: one bincount.
    labels = [
        ids[t + 1]
        for ids, mask in zip(columns["input_ids"], columns["loss_mask"], strict=True)
        for t in range(len(ids) - 1)
        if mask[t]
    ]
    counts = torch.bincount(torch.tensor(labels, dtype=torch.long), minlength=target.vocab_size)
    counts = counts[: target.vocab_size]  # [V]

    eval_prompts = [
        {
            "category": c["category"],
            "messages": c["messages"],
            "group": c["group"],
            "input_ids": prompt_ids(c["messages"]),
        }
        for c in eval_convs
    ]
    lengths = [len(x) for x in columns["input_ids"]]
    streams: dict[str, dict] = {}
    for ids, mask, name in zip(*(columns[k] for k in ("input_ids", "loss_mask", "stream"))):
        st = streams.setdefault(name, {"rows": 0, "tokens": 0, "trained_tokens": 0})
        st["rows"] += 1
        st["tokens"] += len(ids)
        st["trained_tokens"] += sum(mask)
    stats.update(
        {
            "train_rows": len(lengths),
            "eval_prompts": len(eval_prompts),
            "train_tokens": sum(lengths),
            "trained_tokens": int(counts.sum()),
            "mean_len": round(sum(lengths) / len(lengths), 1),
            "max_len": max(lengths),
            "train_categories": {
                c: columns["category"].count(c) for c in sorted(set(columns["category"]))
            },
            "eval_categories": {
                c: [p["category"] for p in eval_prompts].count(c) for c in CATEGORIES
            },
            "streams": streams,
        }
    )
    if progress:
        print(
            "[draftlab] training rows: "
            + "; ".join(
                f"{k} {v['rows']} rows, {v['tokens']} tokens, {v['trained_tokens']} trained"
                for k, v in streams.items()
            )
            + f"; {len(eval_prompts)} eval prompts"
        )
    return PreparedData(datasets.Dataset.from_dict(columns), eval_prompts, counts, stats)
