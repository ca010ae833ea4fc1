"""Data pipeline: assistant-only masks on real templates, chat template presets, local
ShareGPT/OpenAI sources, clear errors, collation and the data configs. The embedded corpus
and its streams: tests/test_corpus.py; regeneration and its cache: tests/test_regenerate.py."""

import inspect

import pytest

from tests.helpers import (
    CONF,
    greedy_tokens,
    openai_row,
    sharegpt_row,
    trained_text,
    write_rows,
)
from train.data.chat import CHAT_TEMPLATES, resolve_chat_template, shift_mask, tokenize_conversation
from train.data.prepare import collate, prepare_data

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Now say bye."},
    {"role": "assistant", "content": "Bye."},
]


# -- masks --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_chatml", "smollm2"])
def test_mask_covers_exactly_the_assistant_turns(which, tiny, smollm2_tokenizer):
    tok = tiny.tokenizer if which == "tiny_chatml" else smollm2_tokenizer
    ids, flags = tokenize_conversation(tok, CONV)
    # Same tokens as the template's own tokenization; nothing but assistant content + EOS.
    assert ids == list(tok.apply_chat_template(CONV, tokenize=True, return_dict=False))
    mask = shift_mask(flags)
    assert trained_text(tok, ids, mask) == "Hello there!<|im_end|>Bye.<|im_end|>"
    # loss_mask[t] trains the logits at t: the first trained position is the last token
    # of the generation prompt ("assistant\n"), predicting the answer's first token.
    first = mask.index(1)
    assert tok.decode(ids[: first + 1]).endswith("<|im_start|>assistant\n")
    assert tok.decode([ids[first + 1]]).startswith("H")
    assert mask[-1] == 0 and sum(mask) == sum(flags)
    if which == "smollm2":  # its template injects a default system prompt only without one
        solo = tok.apply_chat_template(CONV[1:3], tokenize=False)
        assert "You are a helpful AI assistant named SmolLM" in solo
        ids, flags = tokenize_conversation(tok, CONV[1:3])
        assert trained_text(tok, ids, shift_mask(flags)) == "Hello there!<|im_end|>"


def base_tokenizer(adds_bos: bool):
    """The tiny char tokenizer as a base model's: no chat template; optionally a BOS in front
    of plain text, as Llama's and Gemma's tokenizers do."""
    from tokenizers.processors import TemplateProcessing

    from models.tiny_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer(128, chat_template=False)
    if adds_bos:
        tok.backend_tokenizer.post_processor = TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)]
        )
    return tok


@pytest.mark.parametrize("adds_bos", [False, True])
def test_plain_template_trains_the_answers_of_a_base_model(adds_bos):
    tok = base_tokenizer(adds_bos)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template.*data.chat_template=plain"):
        resolve_chat_template(tok, None)
    plain = resolve_chat_template(tok, "plain")
    ids, flags = tokenize_conversation(tok, CONV, chat_template=plain)
    bos = "<s>" if adds_bos else ""
    assert (
        tok.decode(ids)
        == bos + "Be brief.\nSay hello.\nHello there!<|im_end|>\nNow say bye.\nBye.<|im_end|>"
    )
    assert (ids[0] == tok.bos_token_id) == adds_bos
    assert trained_text(tok, ids, shift_mask(flags)) == "Hello there!<|im_end|>Bye.<|im_end|>"
    prompt, _ = tokenize_conversation(tok, CONV[:2], True, chat_template=plain)
    assert tok.decode(prompt) == bos + "Be brief.\nSay hello.\n"  # then the answer


def test_chat_template_presets_and_strings(tiny):
    from models.tiny_tokenizer import CHATML_TEMPLATE

    tok = tiny.tokenizer
    assert resolve_chat_template(tok, None) == tok.chat_template
    assert resolve_chat_template(tok, "chatml") == CHATML_TEMPLATE == CHAT_TEMPLATES["chatml"]
    custom = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert resolve_chat_template(tok, custom) == custom
    ids, flags = tokenize_conversation(tok, CONV[1:3], chat_template=custom)
    assert tok.decode(ids) == "[user] Say hello.\n[assistant] Hello there!\n"
    with pytest.raises(ValueError, match="'chatm' is neither a preset .*chatml, plain"):
        resolve_chat_template(tok, "chatm")


def test_one_template_for_regeneration_masks_and_eval_prompts(tmp_path):
    """A base model (no template) with data.chat_template=plain: the prompts the target
    answers, the trained rows and the eval prompts all use the plain template."""
    from models.target_loaders import build_tiny_random

    base = build_tiny_random(seed=0, chat_template=False, device="cpu")
    src = write_rows(tmp_path / "c.jsonl", [openai_row(i, f"answer {i}") for i in range(5)])
    kw = {"source": str(src), "num_eval": 2, "max_new_tokens": 6, "regen_dtype": "float32"}
    kw |= {"cache_dir": str(tmp_path), "progress": False}
    with pytest.raises(ValueError, match="has no chat template.*data.chat_template=plain"):
        prepare_data(base, **kw)
    data = prepare_data(base, chat_template="plain", **kw)
    tok = base.tokenizer
    for ids, mask in zip(data.train["input_ids"], data.train["loss_mask"], strict=True):
        start = mask.index(1) + 1  # the first answer token, right after "question i?\n"
        assert (
            tok.decode(ids[:start]).startswith("question ")
            and ids[start - 1] == tok.encode("\n")[0]
        )
        assert ids[start:] == greedy_tokens(base, ids[:start], 6)  # the target's own answer to it
    plain = resolve_chat_template(tok, "plain")
    for p in data.eval_prompts:
        assert tok.decode(p["input_ids"]) == p["messages"][-1]["content"] + "\n"
        assert p["input_ids"] == list(
            tok.apply_chat_template(
                p["messages"], chat_template=plain, add_generation_prompt=True, return_dict=False
            )
        )
    # The same rows under another template: other prompts, another regeneration cache.
    chatml = prepare_data(base, chat_template="chatml", **kw)
    assert chatml.stats["regen"]["cache"] != data.stats["regen"]["cache"]
    assert chatml.stats["regen"]["generated"] == 3


# -- local sources ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("form", "where"), [(sharegpt_row, "dir/part.parquet"), (openai_row, "f.jsonl")]
)
def test_local_sources_train_on_their_answers(tiny, tmp_path, form, where):
    answers = ["alpha", "beta", "gamma", "delta", None]  # the last row has no assistant turn
    path = write_rows(tmp_path / where, [form(i, a) for i, a in enumerate(answers)])
    source = str(path.parent) if where.startswith("dir/") else str(path)  # dir: load_dataset(dir)
    data = prepare_data(tiny, source=source, num_eval=0, regenerate=False, progress=False)
    assert data.stats["source_rows"] == 5 and data.stats["skipped_no_assistant"] == 1
    got = {trained_text(tiny.tokenizer, r["input_ids"], r["loss_mask"]) for r in data.train}
    assert got == {f"{a}<|im_end|>" for a in answers if a}
    assert set(data.train["category"]) == {"qa"}  # guessed: the prompts are questions


def test_local_eval_rows_never_enter_training(tiny, tmp_path):
    path = write_rows(
        tmp_path / "c.jsonl",
        [openai_row(i, f"answer {i}") for i in range(8)] + [openai_row(99, "dup")] * 2,
    )  # a duplicated row must not straddle the split
    data = prepare_data(tiny, source=str(path), num_eval=3, regenerate=False, progress=False)
    assert len(data.eval_prompts) == 3 and len(data.train) == 6
    assert data.stats["dropped_eval_duplicates"] == 1  # seed 0 draws the duplicated row
    eval_q = {p["messages"][-1]["content"] for p in data.eval_prompts}
    train_text = "\n".join(tiny.tokenizer.decode(ids) for ids in data.train["input_ids"])
    assert not any(q in train_text for q in eval_q)


def test_truncation_to_max_len(tiny, tmp_path):
    path = write_rows(tmp_path / "long.jsonl", [openai_row(0, "z" * 300), openai_row(1, "short")])
    data = prepare_data(
        tiny, source=str(path), num_eval=0, regenerate=False, max_len=64, progress=False
    )
    assert max(map(len, data.train["input_ids"])) == 64 and data.stats["truncated"] == 1


def test_bad_sources_fail_clearly(tiny, tmp_path):
    empty = write_rows(tmp_path / "empty.jsonl", [openai_row(i, None) for i in range(3)])
    with pytest.raises(ValueError, match=r"empty\.jsonl.*no training rows"):
        prepare_data(tiny, source=str(empty), num_eval=0, regenerate=False, progress=False)
    odd = write_rows(tmp_path / "odd.jsonl", [{"prompt": "hi", "completion": "yo"}])
    with pytest.raises(ValueError, match="`messages` column.*`conversations` column"):
        prepare_data(tiny, source=str(odd), regenerate=False, progress=False)
    with pytest.raises(FileNotFoundError, match="someone/no-such-chats.*could not be loaded"):
        prepare_data(tiny, source="someone/no-such-chats", progress=False)  # offline in tests
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        prepare_data(tiny, source=str(tmp_path / "nope.jsonl"), progress=False)


# -- plumbing -----------------------------------------------------------------------


def test_collate_right_pads():
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 0]},
            {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [1, 1, 1, 1, 0]},
        ],
        pad_token_id=0,
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [1, 2, 3, 4, 5]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 0, 0], [1, 1, 1, 1, 0]]


def test_collate_pads_to_a_multiple():
    rows = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [1], "loss_mask": [1]}]
    batch = collate(rows, pad_token_id=0, multiple=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [1, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0], [1, 0, 0, 0]]
    assert collate(rows * 2, 0, multiple=3)["input_ids"].shape == (4, 3)  # already a multiple


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_data_configs_are_prepare_data_arguments(name):
    from hydra import compose, initialize_config_dir

    conf = CONF
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name=None, overrides=[f"+data={name}"])
    params = set(inspect.signature(prepare_data).parameters) - {"target"}
    assert set(cfg.data) <= params, set(cfg.data) - params
