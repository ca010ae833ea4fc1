"""The one chat template and the assistant-only loss mask.

One template (`data.chat_template`) serves regeneration, training masks and evaluation
prompts alike: null = the tokenizer's own; a preset, `chatml` or `plain`; or a Jinja
template string. `plain` is for base models, which have no template: the messages' text one
after another, a newline between them, the answer then the EOS (after the BOS when the
tokenizer adds one to plain text). `loss_mask[t] = 1` iff `input_ids[t+1]` is a token the
assistant produced (its content and its end-of-turn token), so position t is trained
exactly where the target's logits at t predict an assistant token.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from transformers import PreTrainedTokenizerBase

from models.tiny_tokenizer import CHATML_TEMPLATE

# ---------------------------------------------------------------------------------
# The chat template
# ---------------------------------------------------------------------------------

# Base models: each message's text, a newline between messages and after the prompt (the
# generation prompt), the EOS after each answer. Prefix by prefix, as the mask needs.
PLAIN_TEMPLATE = (
    "{% for message in messages %}{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' and eos_token %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '\\n' }}{% endif %}"
)
CHAT_TEMPLATES = {"chatml": CHATML_TEMPLATE, "plain": PLAIN_TEMPLATE}


def resolve_chat_template(
    tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None
) -> str:
    """The one template for regeneration, training masks and evaluation (a Jinja string).

    None: the tokenizer's own; `chatml` / `plain`: a preset; anything else: a Jinja
    template. `plain` starts with the BOS when the tokenizer puts one before plain text
    (the template's text is tokenized without special tokens)."""
    if chat_template is None:
        if tokenizer.chat_template is None:
            raise ValueError(
                "the target's tokenizer has no chat template (a base model?); set "
                "data.chat_template=plain (prompt text, then the answer), a preset "
                f"({', '.join(CHAT_TEMPLATES)}) or a Jinja template string; one template "
                "is used for regeneration, training masks and evaluation"
            )
        return tokenizer.get_chat_template()
    if chat_template == "plain":
        bos = tokenizer.bos_token_id
        adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
        return ("{{ bos_token }}" if adds_bos else "") + PLAIN_TEMPLATE
    if chat_template in CHAT_TEMPLATES:
        return CHAT_TEMPLATES[chat_template]
    if "{{" not in chat_template and "{%" not in chat_template:
        raise ValueError(
            f"data.chat_template={chat_template!r} is neither a preset "
            f"({', '.join(CHAT_TEMPLATES)}) nor a Jinja template string"
        )
    return chat_template


# ---------------------------------------------------------------------------------
# Tokenization with the assistant-only mask
# ---------------------------------------------------------------------------------


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = False,
    end_tokens: list[str] | None = None,
    chat_template: str | None = None,  # a Jinja template; None = the tokenizer's
) -> tuple[list[int], list[int]]:
    """input_ids and per-token assistant flags (not yet shifted) for one conversation
    (`assistant_spans`, then the text encoded and its tokens flagged by `span_flags`)."""
    text, spans = assistant_spans(tokenizer, messages, add_generation_prompt, end_tokens, chat_template)  # fmt: skip
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return enc["input_ids"], span_flags(enc["offset_mapping"], spans)


def assistant_spans(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = False,
    end_tokens: list[str] | None = None,
    chat_template: str | None = None,
    render: Callable[[list[dict], bool], str] | None = None,  # default: apply_chat_template
) -> tuple[str, list[tuple[int, int]]]:
    """The conversation rendered, and the character spans of what the assistant emitted.

    An assistant span starts after its turn's generation prompt (the template rendered up
    to that turn with add_generation_prompt=True) and ends after the first end-of-turn
    token inside the turn (`end_tokens`, default the tokenizer's EOS): what the model
    emits, not the template's trailing newline.
    Character spans map to tokens through the fast tokenizer's offsets (`span_flags`), so
    BPE merges across a boundary cannot shift the mask.
    """
    if not tokenizer.is_fast:
        raise ValueError(
            "the assistant mask needs a fast tokenizer (offset mapping); "
            "load the target's tokenizer with use_fast=True"
        )

    render = render or (
        lambda msgs, gen=False: tokenizer.apply_chat_template(
            msgs, chat_template=chat_template, tokenize=False, add_generation_prompt=gen
        )
    )
    text = render(messages, add_generation_prompt)
    ends = [e for e in (end_tokens or [tokenizer.eos_token]) if e]
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if text.startswith(through) and through.startswith(before):
            start, limit = len(before), len(through)
        else:  # history rendered otherwise (Qwen3 drops earlier turns' <think> blocks)
            start = answer_start(text, cursor, before, render(messages[:i], False), i, messages)
            limit = len(text)
        stops = [(at, e) for e in ends if (at := text.find(e, start, limit)) >= 0]
        stop, end = min(stops) if stops else (limit, "")
        spans.append((start, stop + len(end)))
        cursor = stop + len(end)
    return text, spans


def answer_start(text: str, cursor: int, before: str, history: str, turn: int, messages) -> int:
    """Where answer `turn` starts in `text` when the template renders the conversation
    differently from its prefixes: after the next occurrence (from `cursor`) of the header
    the template puts before an answer (the generation prompt: `before` less `history`)."""
    header = before[len(history) :] if before.startswith(history) else ""
    at = text.find(header, cursor) if header else -1
    if at < 0:
        raise ValueError(
            f"the chat template does not render this conversation prefix by prefix (turn "
            f"{turn}) and puts no generation prompt before the answer, so its assistant "
            f"tokens cannot be located: {str(messages)[:200]}"
        )
    return at + len(header)


def fast_renderer(tokenizer, chat_template: str) -> Callable[[list[dict], bool], str]:
    """`apply_chat_template(..., tokenize=False)` for plain role/content messages, without
    its per-call conversion of the messages (two thirds of its time at 10^5 rows): the
    compiled template rendered with the tokenizer's special tokens, as transformers does."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: its own path
        return lambda msgs, gen: tokenizer.apply_chat_template(
            msgs, chat_template=chat_template, tokenize=False, add_generation_prompt=gen
        )
    compiled, tokens = _compile_jinja_template(chat_template), dict(tokenizer.special_tokens_map)

    def render(msgs: list[dict], gen: bool) -> str:
        return compiled.render(
            messages=msgs, tools=None, documents=None, add_generation_prompt=gen, **tokens
        )

    return render


def encode_batch(tokenizer, texts: list[str]) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:  # fmt: skip
    """Token ids and character offsets of each text (no special tokens added), through the
    fast tokenizer's backend in one call."""
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    return [e.ids for e in encodings], [e.offsets for e in encodings]


def span_flags(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character lies in one of `spans`, else 0."""
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    flags = np.zeros(len(offsets), dtype=bool)
    for a, b in spans:
        flags |= (starts >= a) & (starts < b)
    return flags.astype(np.int64).tolist()


def shift_mask(flags: list[int]) -> list[int]:
    """loss_mask[t] = 1 iff token t+1 is an assistant token (the target's logits at t)."""
    return flags[1:] + [0]
