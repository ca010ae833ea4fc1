"""Chat data for draft training: sources, eval prompts, training rows, batches.

`prepare_data(target, **cfg.data)` is the one entry point. Every source becomes a list
of conversations (`messages` with role/content); a held-out slice becomes the eval
prompts; the rest is (by default) re-answered by the target (train/data/regenerate.py) and
tokenized with ONE chat template, used for regeneration, training masks and evaluation
prompts alike, with the assistant-only loss mask (train/data/chat.py).

Sources: "embedded" (train/data/corpus.py: HumanEval, Shakespeare, CPython stdlib; no network),
a local .json/.jsonl/.parquet file, or a local directory / hub dataset name (both go
through `datasets.load_dataset(source, split=...)`), in ShareGPT (`conversations` with
from/value) or OpenAI (`messages` with role/content) form (train/data/sources.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from torch import Tensor

from decoding.rounds import check_context
from models.target import Target
from train.data.chat import resolve_chat_template, tokenize_conversation
from train.data.corpus import CATEGORIES, embedded_conversations, reference_conversations
from train.data.local_source import read_source, tokenize_rows
from train.data.pack import load_pack, resolve_pack
from train.data.prompt_file import ood_prompt_texts
from train.data.raw_chunks import raw_chunks_for
from train.data.regen_openai import check_backend_settings, regenerate_openai
from train.data.regenerate import default_cache_root, regen_dtype_choice
from train.data.regenerate import regenerate as regenerate_responses
from train.data.row_selection import RowScan, held_out_split, pick_rows, rows_dataset
from train.data.self_prompts import self_conversations
from train.data.turns import regenerate_every_turn
from train.parallel.ranks import Ranks


@dataclass
class PreparedData:
    train: datasets.Dataset  # input_ids, loss_mask (+ category, group, stream for inspection)
    eval_prompts: list[dict]  # category, messages, input_ids, group
    token_counts: Tensor  # [V] counts of trained label tokens
    stats: dict
    val_rows: list[dict] = field(default_factory=list)  # data.pack_val: input_ids, loss_mask


# ---------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------


def collate(rows: list[dict], pad_token_id: int, multiple: int = 1) -> dict[str, Tensor]:
    """Right-padded batch: input_ids, attention_mask, loss_mask, each [B, T], T the longest
    row rounded up to a multiple of `multiple` (train.pad_multiple). On a CPU every new T
    leaves oneDNN state behind for good (a primitive and its JIT kernels per matmul shape):
    batches padded to their own longest row meet a new T nearly every step, and the process
    grew ~4.6 MiB a step for it (docs/memory.md); a few widths stop that growth."""
    width = max(len(r["input_ids"]) for r in rows)
    width = -(-width // multiple) * multiple
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
    regenerate_turns: str = "last",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    regen_batch_size: int = 16,
    regen_dtype: str = "auto",
    regen_backend: str = "hf",
    regen_url: str | None = None,
    regen_model: str | None = None,
    regen_concurrency: int = 8,
    regen_retries: int = 3,
    regen_timeout: float = 600.0,
    regen_request: dict | None = None,
    max_failed_share: float = 0.01,
    seed: int = 0,
    cache_dir: str | None = None,
    stdlib_files: int = 150,
    chat_template: str | None = None,
    bad_rows: str = "skip",
    num_proc: int | None = None,
    self_prompts: int = 0,
    pack: str | None = None,
    pack_tokens: int | None = None,
    pack_sources: tuple[str, ...] = ("self", "pool"),
    pack_val: int = 0,
    progress: bool = True,
    ranks: Ranks | None = None,
) -> PreparedData:
    """Training rows (target-regenerated by default), eval prompts, label token counts.
    `chat_template`: None = the tokenizer's, a preset name or a Jinja string (module doc).

    Beside the `num_train` rows (stream "regen", or "source" with regenerate=false), two
    streams that are never regenerated (cheap to build: no target forward):
    `num_reference` more conversations answered by their source's own answer (embedded:
    unused source units with a reference; a local source: its rows after the first
    num_train) and `num_raw_chunks` raw-text chunks of the embedded corpus (stdlib modules,
    play scenes) of up to max_len tokens, as "Continue this file:" conversations.

    A local source is read and tokenized once into Arrow shards under the cache and
    memory-mapped (train/data/local_source.py): `bad_rows` (skip | refuse) says what a damaged
    row does, `num_proc` how many processes tokenize (None: the CPUs over the ranks).

    Target-written rows beside them: `self_prompts` requests the target writes itself
    (train/data/self_prompts.py; drawn, filtered, then answered by regeneration as the
    others: stream "self"), and `pack` (null | builtin | a directory: train/data/pack.py),
    conversations a pack holds, trained as they are (stream "pack"; `pack_tokens` answer
    tokens of it at most, from `pack_sources`, after its first `pack_val` conversations: the
    validation rows, `val_rows`, never trained). Neither ever holds an eval prompt or an
    out-of-domain prompt, nor a near-copy of one.

    `ranks` (train/parallel/ranks.py): every rank of a run calls this and answers its share of the
    prompts; rank 0 picks the regeneration dtype for all of them; every rank gets the
    same data. `regen_backend`: hf (the target in this process, in `regen_dtype`,
    `regen_batch_size` slots of continuous batching: train/data/answer_batch.py) or openai (an OpenAI-compatible server: the other
    regen_* settings, train/data/regen_openai.py; each rank sends its share of the requests;
    prompts the server refuses are left out, at most `max_failed_share` of them).
    """
    started, ranks = time.perf_counter(), ranks or Ranks()
    if regenerate_turns not in ("last", "all"):
        raise ValueError(f"data.regenerate_turns={regenerate_turns!r}: use last or all")
    every_turn = regenerate and regenerate_turns == "all"
    if regenerate:
        check_backend_settings(
            regen_backend, regen_url, regen_model, regen_concurrency, regen_retries,
            regen_timeout, regen_request, chat_template, max_failed_share,
        )  # fmt: skip
    tok = target.tokenizer
    try:
        template = resolve_chat_template(tok, chat_template)
    except ValueError as err:
        raise ValueError(f"target {target.name!r}: {err}") from None
    window = target.context_length
    if window is not None and max_len > window:
        raise ValueError(
            f"data.max_len={max_len} tokens per training row is beyond the context window of "
            f"target {target.name!r} ({window} positions, config.max_position_embeddings); set "
            f"data.max_len<={window}"
        )
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
    cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_root()
    local_rows, local_order, local_used = None, [], 0  # a local source's rows, on disk
    if source == "embedded":
        train_convs, eval_convs, extra = embedded_conversations(
            10**9 if num_train is None else num_train,
            num_eval,
            seed,
            fits,
            not regenerate,
            stdlib_files,
        )
        stats.update(extra)
    else:  # read once into Arrow shards (train/data/local_source.py), rows fetched by index
        conversations, read_info, conv_key = read_source(
            source, split, bad_rows, cache_root, ranks, progress
        )
        stats["source_rows"] = len(conversations) + read_info["bad_rows"]
        stats["bad_rows"] = read_info["bad_rows"]
        if read_info["bad_rows"]:
            stats["bad_rows_first"] = read_info["bad_rows_first"]
            if progress and ranks.main:
                print(
                    f"[draftlab] data.source: {read_info['bad_rows']} damaged rows skipped "
                    f"(data.bad_rows=skip), e.g. {read_info['bad_rows_first'][0]}", flush=True
                )  # fmt: skip
        eval_convs, local_order, stats["dropped_eval_duplicates"] = held_out_split(
            conversations, seed, num_eval, fits
        )

        def local_conversations():  # training conversations in seeded order, read lazily
            for i in local_order:
                r = conversations[i]
                yield {"messages": r["messages"], "category": r["category"], "group": f"row:{r['index']}"}  # fmt: skip

        train_convs = local_conversations() if regenerate else []
        if not regenerate or num_reference:  # whole conversations tokenized, on disk
            local_rows = tokenize_rows(
                conv_key, tok, template, end_tokens, max_len, cache_root, num_proc, ranks, progress
            )  # fmt: skip

    # What no target-written row may hold: the eval prompts and the out-of-domain prompts.
    protected = [m["content"] for c in eval_convs for m in c["messages"] if m["role"] == "user"]
    protected += ood_prompt_texts()
    self_convs = []
    if self_prompts:  # requests the target writes itself: answered below as the others
        self_convs, stats["self_prompts"] = self_conversations(
            target, self_prompts, template, protected, seed=seed, cache_dir=cache_dir,
            dtype=regen_dtype, batch_size=regen_batch_size, progress=progress, ranks=ranks,
        )  # fmt: skip

    # Prompt = everything before the last assistant turn: the answer regeneration replaces.
    # Embedded prompts without a source answer are `prompt_only`: regeneration answers them.
    items = []

    def add(c: dict) -> None:
        msgs = c["messages"]
        if c.get("prompt_only") and every_turn:  # its one answer still to come
            msgs = c["messages"] = [*msgs, {"role": "assistant", "content": ""}]
        turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        last = (turns[0] if every_turn else turns[-1]) if turns else None  # the first answered
        prompt = msgs[:last] if last is not None else msgs
        if (
            (last is None and not c.get("prompt_only"))
            or not prompt
            or prompt[-1]["role"] == "assistant"
        ):
            stats["skipped_no_assistant"] += 1
            return
        try:  # regenerate: prompt tokens (+ the target's answer later); else the whole row
            ids, flags = tokenize(prompt, gen=True) if regenerate else tokenize(msgs)
        except ValueError:  # e.g. a row that opens with an assistant turn
            stats["skipped_template_mismatch"] += 1
            return
        if regenerate and len(ids) > max_prompt:  # no room left for the answer
            stats["skipped_long_prompt"] += 1
            return
        items.append({"stream": "regen" if regenerate else "source", **c, "ids": ids,
                      "flags": flags, "prompt_messages": prompt})  # fmt: skip

    for c in train_convs:
        if num_train is not None and len(items) >= num_train:  # None: all of them
            break
        local_used += 1
        add(c)
    for c in self_convs if regenerate else ():
        add(c)

    if regenerate and items:
        longest = max_prompt if every_turn else max(len(it["ids"]) for it in items)
        check_context(
            target, longest, max_new_tokens, "regeneration (the longest training prompt)",
            f"set data.max_new_tokens<={window - longest if window else max_new_tokens}, or a "
            "smaller data.max_len (prompts over data.max_len/2 are dropped)",
        )  # fmt: skip
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p}
        choice = None  # one verdict for every rank: they must answer in the same dtype
        if regen_backend != "openai":  # (a server's dtype is its own)
            if ranks.main:
                choice = regen_dtype_choice(
                    target, regen_dtype, items, regen_batch_size, max_new_tokens, cache_dir
                )
            choice = ranks.broadcast(choice)
            stats["regen_dtype"] = choice.as_record()
            if progress and ranks.main and choice.source != "explicit":
                print(f"dtype {choice.describe()}", flush=True)
        rounds: list[dict] = []  # each call's stats (regenerate_turns=all: one per turn)

        def answer(prompts: list[list[int]], messages: list[list[dict]]) -> list[dict | None]:
            if regen_backend == "openai":  # a server answers
                answers, st = regenerate_openai(
                    target, prompts, messages, url=regen_url, model=regen_model,
                    concurrency=regen_concurrency, retries=regen_retries, timeout=regen_timeout,
                    request=regen_request, **sampling, seed=seed, cache_dir=cache_dir,
                    chat_template=template, max_failed_share=max_failed_share,
                    progress=progress, ranks=ranks,
                )  # fmt: skip
            else:
                answers, st = regenerate_responses(
                    target, prompts, **sampling, batch_size=regen_batch_size, dtype=choice.dtype,
                    seed=seed, cache_dir=cache_dir, chat_template=template, progress=progress,
                    ranks=ranks,
                )  # fmt: skip
            rounds.append(st)
            return answers

        if every_turn:  # each assistant turn answered in order (train/data/turns.py)
            convs, stats["regen_turns"] = regenerate_every_turn(
                [it["messages"] for it in items], answer, lambda msgs: tokenize(msgs, gen=True),
                lambda ids: tok.decode(ids, skip_special_tokens=True), max_prompt,
            )  # fmt: skip
            stats["skipped_regen_refused"] = sum(c is None for c in convs)
            # Rows of the target's own ids, every turn of them trained, as `last` below.
            items = [{**it, **row} for it, row in zip(items, convs, strict=True) if row]
        else:
            answers = answer([it["ids"] for it in items], [it["prompt_messages"] for it in items])
            kept = [(it, a) for it, a in zip(items, answers, strict=True) if a is not None]
            stats["skipped_regen_refused"] = len(items) - len(kept)  # the server refused them
            for it, reply in kept:
                # The target's own tokens, EOS included when it stopped; all of them trained.
                it["ids"], it["flags"] = (
                    it["ids"] + reply["ids"],
                    it["flags"] + [1] * len(reply["ids"]),
                )
            items = [it for it, _ in kept]
        stats["regen"] = rounds[0] if len(rounds) == 1 else {
            **{k: sum(r[k] for r in rounds) for k in ("generated", "new_tokens")},
            "seconds": round(sum(r["seconds"] for r in rounds), 2), "by_round": rounds,
        }  # fmt: skip

    local_parts, local_main = [], None  # a local source's rows, tokenized on disk
    if local_rows is not None:
        num_local = 0 if regenerate else num_train
        local_parts, local_main = pick_rows(local_rows, local_order[local_used:], num_local, num_reference, stats)  # fmt: skip
        if num_reference and len(local_parts[-1]) < num_reference:
            raise ValueError(
                f"data.num_reference={num_reference}: data.source={source!r} has only "
                f"{len(local_parts[-1])} answered rows beyond data.num_train={num_train}; lower one"
            )

    # The in-memory streams that are not regenerated: whole conversations, answers trained.
    extra = []
    if num_reference and source == "embedded":
        used = {c["unit"] for c in train_convs + eval_convs}
        extra += [
            {**c, "stream": "reference"}
            for c in reference_conversations(num_reference, seed, fits, used)
        ]
    if num_raw_chunks:
        extra += [
            {**c, "stream": "raw"}
            for c in raw_chunks_for(tok, tokenize, max_len, num_raw_chunks, seed)
        ]
    extra_items, val_items = [], []
    if pack:  # target-written conversations, trained as they are
        extra_items, val_items, stats["pack"] = load_pack(
            resolve_pack(pack), target, template, prompt_ids, protected, pack_tokens,
            tuple(pack_sources), pack_val,
        )  # fmt: skip
    for c in extra:
        try:
            ids, flags = tokenize(c["messages"])
        except ValueError:
            stats["skipped_template_mismatch"] += 1
            continue
        extra_items.append({**c, "ids": ids, "flags": flags})

    parts = [rows_dataset(items, max_len, stats), *local_parts,
             rows_dataset(extra_items, max_len, stats)]  # fmt: skip
    train = datasets.concatenate_datasets([p for p in parts if len(p)] or parts[:1])
    if not len(train):
        lost = ", ".join(
            f"{k} {v}" for k, v in stats.items() if v and (k.startswith(("skipped", "bad_rows")) or k in (
                "truncated", "dropped_eval_duplicates", "source_rows"))
        )  # fmt: skip
        raise ValueError(
            f"data.source={source!r} gives no training rows ({lost}; {len(eval_convs)} held "
            f"out as eval prompts, data.num_eval={num_eval}): it needs conversations with an "
            "assistant answer beyond the eval prompts; add rows, lower data.num_eval, or raise "
            "data.max_len"
        )

    scan = RowScan(target.vocab_size)  # counts, streams, lengths: one pass, part by part
    for i, part in enumerate(parts):
        if i == 1 and local_main is not None:  # the rows on disk, read without mapping them
            shards = [Path(f["filename"]) for f in local_rows.cache_files]
            scan.add_shards(shards, local_main, "source")
        else:
            scan.add_dataset(part)
    counts = torch.from_numpy(scan.counts)  # [V] trained labels
    eval_prompts = [
        {
            "category": c["category"],
            "messages": c["messages"],
            "group": c["group"],
            "input_ids": prompt_ids(c["messages"]),
        }
        for c in eval_convs
    ]
    streams, longest, categories = scan.streams, scan.longest, dict(sorted(scan.categories.items()))
    train_tokens = sum(s["tokens"] for s in streams.values())
    stats.update(
        {
            "train_rows": len(train),
            "eval_prompts": len(eval_prompts),
            "train_tokens": train_tokens,
            "trained_tokens": int(counts.sum()),
            "mean_len": round(train_tokens / len(train), 1),
            "max_len": longest,
            "train_categories": categories,
            "eval_categories": {
                c: [p["category"] for p in eval_prompts].count(c) for c in CATEGORIES
            },
            "streams": streams,
        }
    )
    if progress and ranks.main:
        print(
            "[draftlab] training rows: "
            + "; ".join(
                f"{k} {v['rows']} rows, {v['tokens']} tokens, {v['trained_tokens']} trained"
                for k, v in streams.items()
            )
            + f"; {len(eval_prompts)} eval prompts; prepared in "
            + f"{time.perf_counter() - started:.1f} s",
            flush=True,
        )
    val = rows_dataset(val_items, max_len, {"truncated": 0, "skipped_no_assistant": 0,
                                            "skipped_truncated_away": 0})  # fmt: skip
    val_rows = [{"input_ids": r["input_ids"], "loss_mask": r["loss_mask"]} for r in val]
    return PreparedData(train, eval_prompts, counts, stats, val_rows)
