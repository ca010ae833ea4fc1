"""Prompts from a file, as eval prompts: the `--prompts` file of scripts/evaluate.py and the
out-of-domain set every evaluation decodes beside the held-out eval prompts (decode.ood_prompts).

`ood_prompts.jsonl` beside this file is that set: 24 prompts written for it, of kinds the
embedded training pool (train/data/corpus.py: Python functions, Shakespeare's plays, questions
about either) has none of: arithmetic word problems, everyday how-to, letters and short
pieces of writing, science explanations, 6 each. Their τ against the in-domain τ says whether
a draft learned the target or the kinds of text it was trained on.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from train.data.chat import resolve_chat_template, tokenize_conversation

BUILTIN_OOD = Path(__file__).with_name("ood_prompts.jsonl")


def ood_prompt_texts() -> list[str]:
    """The builtin out-of-domain prompts' user texts: what no training row may copy."""
    return [json.loads(line)["prompt"] for line in BUILTIN_OOD.read_text().splitlines()]


def spread(prompts: list, num: int | None) -> list:
    """`num` of `prompts` (None or more than there are: all) spread evenly over the list, in
    its order: eval prompts and the builtin OOD file come in blocks of one kind, so their first
    `num` would be the first kinds alone."""
    if not num or num >= len(prompts):
        return list(prompts)
    return [prompts[i * len(prompts) // num] for i in range(num)]


def load_prompt_file(
    path: Path,
    tokenizer: PreTrainedTokenizerBase,
    chat_template: str | None,
    what: str = "--prompts",
) -> list[dict]:
    """A .jsonl file of {"prompt": str, "category": str (optional)} -> eval prompts as
    train.data builds them: one user turn through the run's chat template (data.chat_template)
    with the generation prompt. `what` names the setting in error messages."""
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    template = resolve_chat_template(tokenizer, chat_template)
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what} {path} line {n}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(
                f'{what} {path} line {n}: expected an object with a "prompt" string, e.g. '
                '{"prompt": "Write a haiku about tests."}'
            )
        if not row["prompt"].strip():
            raise ValueError(f'{what} {path} line {n}: "prompt" is empty')
        messages = [{"role": "user", "content": row["prompt"]}]
        ids, _ = tokenize_conversation(
            tokenizer, messages, add_generation_prompt=True, chat_template=template
        )
        prompts.append(
            {"category": str(row.get("category", "chat")), "messages": messages,
             "group": f"file:{n}", "input_ids": ids}
        )  # fmt: skip
    if not prompts:
        raise ValueError(f"{what} {path} has no prompts (one JSON object per line)")
    return prompts


def ood_prompts(
    setting: str | None, tokenizer: PreTrainedTokenizerBase, chat_template: str | None
) -> list[dict]:
    """decode.ood_prompts: "builtin" (ood_prompts.jsonl beside this module), a .jsonl path
    in the form of `load_prompt_file`, or None / "" for none."""
    if not setting:
        return []
    path = BUILTIN_OOD if setting == "builtin" else Path(setting)
    return load_prompt_file(path, tokenizer, chat_template, "decode.ood_prompts")
