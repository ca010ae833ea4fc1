"""Every assistant turn of a conversation answered by the target, in order
(`data.regenerate_turns=all`), as speculators and SpecForge regenerate multi-turn data.

Round j answers the j-th assistant turn of every conversation that has one, its prompt the
source's other turns with turns 1..j-1 as the target answered them; a round is one call of
`answer` (the regeneration backend: batched, cached by prompt, split over ranks). A
conversation ends at its last answered turn when its next prompt is over `max_prompt`
tokens, the template cannot render it, or the server refuses it; it is dropped when its
first turn cannot be answered.

The answers enter the next prompt as text (the answer's tokens decoded), as a chat server
would see them, but the training row holds each answer's own token ids: decoding and
re-encoding need not give them back, and re-rendering a cut answer through the template
would close it with an end-of-turn token the target never produced. The row is each round's
prompt tokens after the previous answer's end-of-turn (the template's text between two
answers: the next user turn, the generation prompt), then the answer's ids, trained.
An answer cut at max_new_tokens (no EOS) ends its conversation: the next turn's prompt
would need an end-of-turn after it that the target never produced, and a cut answer is not
a context a user replies to; so nothing follows it in the row and no end-of-turn is trained.
"""

from __future__ import annotations

from collections.abc import Callable


def after_last_answer(ids: list[int], flags: list[int], answer_end: int) -> list[int] | None:
    """The prompt's tokens after its last assistant token (the end-of-turn closing the
    previous answer): what the template puts between that answer and the next. None where
    the prompt flags no assistant token, or where that token is not `answer_end`, the last
    token the target answered with (it stopped on another of its EOS ids than the one the
    template closes a turn with: the row would splice a context the target never saw)."""
    last = max((t for t, f in enumerate(flags) if f), default=None)
    return None if last is None or ids[last] != answer_end else ids[last + 1 :]


def regenerate_every_turn(
    conversations: list[list[dict]],  # messages, each with at least one assistant turn
    answer: Callable[[list[list[int]], list[list[dict]]], list[dict | None]],
    # a prompt's tokens (the generation prompt included) and their assistant flags
    tokenize_prompt: Callable[[list[dict]], tuple[list[int], list[int]]],
    decode: Callable[[list[int]], str],  # an answer's tokens as its text
    max_prompt: int,
) -> tuple[list[dict | None], dict]:
    """A training row per conversation (None: not even the first turn answered): `messages`
    (the answers as text), `ids` and `flags` (1 on each answer's own ids); and counts:
    rounds, answered turns, conversations cut short (next prompt too long, unrenderable or
    refused), truncated turns (answers cut at max_new_tokens, each ending its conversation).
    `answer` gives per prompt a reply with `ids` (the EOS included when the target stopped)
    and `finished` (False: cut at max_new_tokens), or None where it refuses."""
    answered: list[list[dict]] = [[] for _ in conversations]  # each turn so far, as answered
    rows: list[tuple[list[int], list[int]]] = [([], []) for _ in conversations]  # ids, flags
    cursor = [0] * len(conversations)  # the source turn after the last answered one
    active = [c for c, msgs in enumerate(conversations) if msgs]
    counts = {"rounds": 0, "answered_turns": 0, "cut_short": 0, "truncated": 0}
    while active:
        who, prompts, ids, gaps = [], [], [], []
        for c in active:
            msgs = conversations[c]
            turn = next((i for i in range(cursor[c], len(msgs)) if msgs[i]["role"] == "assistant"), None)  # fmt: skip
            if turn is None:  # every turn answered
                continue
            prompt = answered[c] + msgs[cursor[c] : turn]
            try:
                tokens, flags = tokenize_prompt(prompt)
            except ValueError:  # the template cannot render this prompt
                tokens, flags = None, None
            # The first prompt enters the row whole; a later one from the previous answer on.
            gap = tokens if tokens is None or not answered[c] else after_last_answer(tokens, flags, rows[c][0][-1])  # fmt: skip
            if gap is None or len(tokens) > max_prompt or prompt[-1]["role"] == "assistant":
                counts["cut_short"] += bool(answered[c])
                continue
            who.append((c, turn))
            prompts.append(prompt)
            ids.append(tokens)
            gaps.append(gap)
        if not who:
            break
        counts["rounds"] += 1
        active = []
        for (c, turn), prompt, gap, reply in zip(who, prompts, gaps, answer(ids, prompts), strict=True):  # fmt: skip
            if reply is None:  # refused: the conversation ends at its last answered turn
                counts["cut_short"] += bool(answered[c])
                continue
            answered[c] = prompt + [{"role": "assistant", "content": decode(reply["ids"])}]
            rows[c][0].extend(gap + reply["ids"])
            rows[c][1].extend([0] * len(gap) + [1] * len(reply["ids"]))
            cursor[c] = turn + 1
            counts["answered_turns"] += 1
            if not reply["finished"]:  # cut at max_new_tokens: the row ends with it (module doc)
                counts["truncated"] += 1
                continue
            active.append(c)
    return [
        {"messages": a, "ids": ids, "flags": flags} if a else None
        for a, (ids, flags) in zip(answered, rows, strict=True)
    ], counts
