"""The assistant spans of a multi-turn conversation, per template kind (train/data/chat.py):
each span is exactly what the model emits for its turn, as the full conversation renders it:
ChatML (every prefix renders as the start of the whole), a reasoning template that keeps a
<think> block only after the last user turn (as Qwen3's does: the history is rendered
otherwise than its prefixes), and `plain` (no end-of-turn token but the EOS)."""

import pytest

from train.data.chat import assistant_spans, resolve_chat_template, tokenize_conversation

# Qwen3's rule, written small: an answer after the last user turn is rendered with its
# <think> block, an earlier one with its final text only; the generation prompt opens an answer.
THINKING_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}{%- endif -%}"
    "{%- if loop.index0 > ns.last_query -%}"
    "{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "one?"},
    {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nOne."},
    {"role": "user", "content": "two?"},
    {"role": "assistant", "content": "<think>\nsecond thought\n</think>\n\nTwo."},
]


@pytest.mark.parametrize(
    "template, expected",
    [
        ("chatml", ["<think>\nfirst thought\n</think>\n\nOne.<|im_end|>",
                    "<think>\nsecond thought\n</think>\n\nTwo.<|im_end|>"]),
        # The history's answer without its <think> block, the last one with it.
        (THINKING_TEMPLATE, ["One.<|im_end|>", "<think>\nsecond thought\n</think>\n\nTwo.<|im_end|>"]),
        ("plain", ["<think>\nfirst thought\n</think>\n\nOne.EOS", "<think>\nsecond thought\n</think>\n\nTwo.EOS"]),
    ],
    ids=["chatml", "thinking", "plain"],
)  # fmt: skip
def test_each_answer_span_is_what_the_model_emits(tiny, template, expected):
    tok = tiny.tokenizer
    jinja = resolve_chat_template(tok, template)
    ends = ["<|im_end|>", tok.eos_token]
    text, spans = assistant_spans(tok, CONVERSATION, False, ends, jinja)
    assert [text[a:b] for a, b in spans] == [e.replace("EOS", tok.eos_token) for e in expected]
    # The tokens flagged are those spans' tokens, nothing of the prompts between them.
    ids, flags = tokenize_conversation(tok, CONVERSATION, False, ends, jinja)
    flagged = tok.decode([t for t, f in zip(ids, flags, strict=True) if f])
    assert flagged == "".join(text[a:b] for a, b in spans)


def test_a_template_without_a_generation_prompt_is_refused_when_history_differs(tiny):
    no_header = THINKING_TEMPLATE.replace("{{ '<|im_start|>assistant\\n' }}{%- endif -%}", "{%- endif -%}")  # fmt: skip
    with pytest.raises(ValueError, match=r"not render this conversation prefix by prefix \(turn 2\) and puts no generation prompt"):  # fmt: skip
        assistant_spans(tiny.tokenizer, CONVERSATION, False, ["<|im_end|>"], no_header)
