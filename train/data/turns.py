"""Every assistant turn of a conversation answered by the target, in order
(`data.regenerate_turns=all`), as speculators and SpecForge regenerate multi-turn data.

Round j answers the j-th assistant turn of every conversation that has one, its prompt the
source's other turns with turns 1..j-1 as the target answered them; a round is one call of
`answer` (the regeneration backend: batched, cached by prompt, split over ranks). A
conversation ends at its last answered turn when its next prompt is over `max_prompt`
tokens, the template cannot render it, or the server refuses it; it is dropped when its
first turn cannot be answered. The answers enter the next prompt as text (the answer's
tokens decoded), as a chat server would see them.
"""

from __future__ import annotations

from collections.abc import Callable


def regenerate_every_turn(
    conversations: list[list[dict]],  # messages, each with at least one assistant turn
    answer: Callable[[list[list[int]], list[list[dict]]], list[dict | None]],
    prompt_ids: Callable[[list[dict]], list[int]],  # a prompt's tokens, with the generation prompt
    decode: Callable[[list[int]], str],  # an answer's tokens as its text
    max_prompt: int,
) -> tuple[list[list[dict] | None], dict]:
    """The conversations with every assistant turn the target's (None: not even the first
    answered), and counts: rounds, answered turns, conversations cut short."""
    answered: list[list[dict]] = [[] for _ in conversations]  # each turn so far, as answered
    cursor = [0] * len(conversations)  # the source turn after the last answered one
    active = [c for c, msgs in enumerate(conversations) if msgs]
    counts = {"rounds": 0, "answered_turns": 0, "cut_short": 0}
    while active:
        who, prompts, ids = [], [], []
        for c in active:
            msgs = conversations[c]
            turn = next((i for i in range(cursor[c], len(msgs)) if msgs[i]["role"] == "assistant"), None)  # fmt: skip
            if turn is None:  # every turn answered
                continue
            prompt = answered[c] + msgs[cursor[c] : turn]
            try:
                tokens = prompt_ids(prompt)
            except ValueError:  # the template cannot render this prompt
                tokens = None
            if tokens is None or len(tokens) > max_prompt or prompt[-1]["role"] == "assistant":
                counts["cut_short"] += bool(answered[c])
                continue
            who.append((c, turn))
            prompts.append(prompt)
            ids.append(tokens)
        if not who:
            break
        counts["rounds"] += 1
        active = []
        for (c, turn), prompt, reply in zip(who, prompts, answer(ids, prompts), strict=True):
            if reply is None:  # refused: the conversation ends at its last answered turn
                counts["cut_short"] += bool(answered[c])
                continue
            answered[c] = prompt + [{"role": "assistant", "content": decode(reply["ids"])}]
            cursor[c] = turn + 1
            counts["answered_turns"] += 1
            active.append(c)
    return [a or None for a in answered], counts
