"""A character-level tokenizer with a ChatML template, for the tiny random test target.
`chat_template=False` gives a base model's tokenizer: no template at all."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_char_tokenizer(
    vocab_size: int = 128, chat_template: bool = True
) -> PreTrainedTokenizerFast:
    base = SPECIALS + CHARS
    if vocab_size < len(base):
        raise ValueError(f"tiny tokenizer needs vocab_size >= {len(base)}, got {vocab_size}")
    tokens = base + [f"<unused{i}>" for i in range(vocab_size - len(base))]
    vocab = {t: i for i, t in enumerate(tokens)}
    # BPE with no merges = one token per character; unknown characters map to <unk>.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "</s>"],
    )
    if chat_template:
        fast.chat_template = CHATML_TEMPLATE
    return fast
