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
    """input_ids and per-token assistant flags (not yet shifted) for one conversation.

    An assistant span starts after its turn's generation prompt (the template rendered up
    to that turn with add_generation_prompt=True) and ends after the first end-of-turn
    token inside the turn (`end_tokens`, default the tokenizer's EOS): what the model
    emits, not the template's trailing newline.
    Character spans map to tokens through the fast tokenizer's offsets, so BPE merges
    across a boundary cannot shift the mask.
    """
    if not tokenizer.is_fast:
        raise ValueError(
            "the assistant mask needs a fast tokenizer (offset mapping); "
            "load the target's tokenizer with use_fast=True"
        )

    def render(msgs: list[dict], gen: bool = False) -> str:
        return tokenizer.apply_chat_template(
            msgs, chat_template=chat_template, tokenize=False, add_generation_prompt=gen
        )

    text = render(messages, add_generation_prompt)
    ends = [e for e in (end_tokens or [tokenizer.eos_token]) if e]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], gen=True), render(messages[: i + 1])
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError(
                f"the chat template does not render this conversation prefix by "
                f"prefix (turn {i}), so its assistant tokens cannot be located: "
                f"{str(messages)[:200]}"
            )
        stops = [(at, e) for e in ends if (at := through.find(e, len(before))) >= 0]
        stop, end = min(stops) if stops else (len(through), "")
        spans.append((len(before), stop + len(end)))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    flags = [int(any(a <= s < b for a, b in spans)) for s, _ in enc["offset_mapping"]]
    return enc["input_ids"], flags


def shift_mask(flags: list[int]) -> list[int]:
    """loss_mask[t] = 1 iff token t+1 is an assistant token (the target's logits at t)."""
    return flags[1:] + [0]
