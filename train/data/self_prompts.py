"""Prompts the target writes itself (Magpie, arXiv 2406.08464): no data needed.

A chat model rendered up to the point where a user's text would start (`prefix_and_stop`:
the template of a one-message conversation cut at the message) and sampled there writes its
own idea of a user request, ended by the template's end-of-turn token. Drawn `count` times
from the same prefix, each draw with its own generator (`regenerate`'s keys: `self:<seed>:<i>`
hashed), cached, resumable and split over ranks like any regeneration
(train/data/regenerate.py). The requests are then filtered (`keep_prompts`):
  - unfinished (cut at max_new_tokens), shorter than `min_words` or longer than
    `max_words` words, or holding template markup ("<|", "|>");
  - repetitive: fewer than half of its word trigrams distinct;
  - near-duplicates of a kept request or of a protected prompt (the run's eval prompts and
    the out-of-domain prompts: `near_copy`), so no evaluation prompt, nor one that shares
    most of its word n-grams, is ever trained on.
What is kept is answered by the target like any training prompt (train/data/prepare.py).
"""

from __future__ import annotations

import hashlib
import re

from models.target import Target
from train.data.regenerate import regen_dtype_choice, regenerate
from train.parallel.ranks import Ranks

SENTINEL = "\x00draftlab-self-prompt\x00"
WORD = re.compile(r"\w+")


def prefix_and_stop(tokenizer, chat_template: str) -> tuple[list[int], list[int]]:
    """The token ids of the template up to where a user's message starts, and the token the
    template ends a user turn with (for ChatML `<|im_end|>`). Refused where the template does
    not render a user message between a fixed prefix and an end-of-turn token."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": SENTINEL}], chat_template=chat_template, tokenize=False
    )
    if text.count(SENTINEL) != 1:
        raise ValueError(
            "the chat template does not render a user message as given: no self prompts"
        )
    before, after = text.split(SENTINEL)
    stop = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    if not stop or not tokenizer.convert_ids_to_tokens(stop)[0].strip():
        raise ValueError(
            f"the chat template ends a user message with {after!r}, no end-of-turn token the "
            "target could emit: self prompts need a chat template with one (a chat model's)"
        )
    return tokenizer(before, add_special_tokens=False)["input_ids"], stop


def words(text: str) -> list[str]:
    return WORD.findall(text.lower())


def shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    """The text's word n-grams (the whole text as one when it is shorter than n words)."""
    w = words(text)
    if len(w) < n:
        return {tuple(w)} if w else set()
    return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}


class NearCopies:
    """An index of texts' word 5-grams: `near(text)` says whether `text` shares at least
    `threshold` of the smaller of the two n-gram sets with any indexed text (a copy, a copy
    with a word changed, a prompt quoted inside a longer one)."""

    def __init__(self, texts: list[str] = (), threshold: float = 0.5):
        self.threshold, self.sets, self.owners = threshold, [], {}
        for t in texts:
            self.add(t)

    def add(self, text: str) -> None:
        grams = shingles(text)
        for g in grams:
            self.owners.setdefault(g, []).append(len(self.sets))
        self.sets.append(grams)

    def near(self, text: str) -> bool:
        grams = shingles(text)
        shared: dict[int, int] = {}
        for g in grams:
            for owner in self.owners.get(g, ()):
                shared[owner] = shared.get(owner, 0) + 1
        return any(
            n >= self.threshold * max(1, min(len(grams), len(self.sets[o])))
            for o, n in shared.items()
        )


def keep_prompts(
    drafts: list[dict], protected: list[str], min_words: int = 3, max_words: int = 150
) -> tuple[list[str], dict]:
    """The requests worth answering from regenerate's rows (`text`, `finished`), in order,
    and how many each filter dropped (module doc)."""
    dropped = {"unfinished": 0, "length": 0, "markup": 0, "repetitive": 0, "duplicate": 0,
               "protected": 0}  # fmt: skip
    kept, seen, guard = [], NearCopies(), NearCopies(protected)
    for row in drafts:
        text = row["text"].strip()
        w = words(text)
        trigrams = [tuple(w[i : i + 3]) for i in range(len(w) - 2)]
        if not row["finished"]:
            dropped["unfinished"] += 1
        elif not min_words <= len(w) <= max_words:
            dropped["length"] += 1
        elif "<|" in text or "|>" in text:
            dropped["markup"] += 1
        elif trigrams and len(set(trigrams)) < 0.5 * len(trigrams):
            dropped["repetitive"] += 1
        elif guard.near(text):
            dropped["protected"] += 1
        elif seen.near(text):
            dropped["duplicate"] += 1
        else:
            kept.append(text)
            seen.add(text)
    return kept, dropped


def self_prompts(
    target: Target, count: int, chat_template: str, protected: list[str], *, seed: int,
    temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 96,
    dtype: str = "bfloat16", batch_size: int = 64, cache_dir=None, progress: bool = True,
    ranks=None,
) -> tuple[list[str], dict]:  # fmt: skip
    """`count` requests drawn from the target (cached, resumable, rank-split), filtered:
    (the kept requests' texts, stats with the draws, what each filter dropped, the seconds
    and tokens of the drawing)."""
    prefix, stop = prefix_and_stop(target.tokenizer, chat_template)
    keys = [hashlib.sha256(f"self:{seed}:{i}".encode()).hexdigest()[:16] for i in range(count)]
    drafts, st = regenerate(
        target, [prefix] * count, max_new_tokens=max_new_tokens, temperature=temperature,
        top_p=top_p, batch_size=batch_size, dtype=dtype, seed=seed, cache_dir=cache_dir,
        chat_template=chat_template, progress=progress, ranks=ranks, keys=keys,
        stop_ids=stop, desc="self prompts",
    )  # fmt: skip
    kept, dropped = keep_prompts(drafts, protected)
    return kept, {"drawn": count, "kept": len(kept), "dropped": dropped, "drawing": st}


def self_conversations(
    target: Target, count: int, chat_template: str, protected: list[str], *, seed: int,
    cache_dir=None, dtype: str = "auto", batch_size: int = 64, progress: bool = True, ranks=None,
) -> tuple[list[dict], dict]:  # fmt: skip
    """`data.self_prompts`: the kept requests as conversations to answer (`prompt_only`,
    stream "self", category "self"), and the drawing's stats. `dtype` "auto": the faster
    regeneration dtype on this machine for a request's prefix (rank 0 decides)."""
    ranks = ranks or Ranks()
    prefix, _ = prefix_and_stop(target.tokenizer, chat_template)
    choice = None
    if ranks.main:
        choice = regen_dtype_choice(target, dtype, [{"ids": prefix}], batch_size, 96, cache_dir)
        if progress and choice.source != "explicit":
            print(f"dtype self prompts: {choice.describe()}", flush=True)
    choice = ranks.broadcast(choice)
    texts, stats = self_prompts(
        target, count, chat_template, protected, seed=seed, dtype=choice.dtype,
        batch_size=batch_size, cache_dir=cache_dir, progress=progress, ranks=ranks,
    )  # fmt: skip
    if progress and ranks.main:
        print(f"[draftlab] self prompts: {stats['kept']} of {count} drawn kept "
              f"(dropped {stats['dropped']})", flush=True)  # fmt: skip
    convs = [{"messages": [{"role": "user", "content": t}], "category": "self",
              "group": f"self:{seed}:{i}", "prompt_only": True, "stream": "self"}
             for i, t in enumerate(texts)]  # fmt: skip
    return convs, stats
