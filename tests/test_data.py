"""Data pipeline: assistant-only masks on real templates, held-out eval prompts, local
ShareGPT/OpenAI sources, clear errors. Regeneration and its cache: tests/test_regenerate.py."""

import inspect
import json
from pathlib import Path

import datasets
import pytest
import torch

from train.data.chat import CHAT_TEMPLATES, resolve_chat_template, shift_mask, tokenize_conversation
from train.data.corpus import (
    embedded_conversations,
    held_out,
    parse_speeches,
    raw_chunk_conversations,
    reference_conversations,
)
from train.data.prepare import collate, prepare_data

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hello."},
    {"role": "assistant", "content": "Hello there!"},
    {"role": "user", "content": "Now say bye."},
    {"role": "assistant", "content": "Bye."},
]


def trained_text(tokenizer, ids: list[int], loss_mask: list[int]) -> str:
    """The tokens position t is trained to predict: input_ids[t+1] where loss_mask[t]."""
    return tokenizer.decode([ids[t + 1] for t in range(len(ids) - 1) if loss_mask[t]])


@pytest.fixture(scope="module")
def tiny():
    from models.target_loaders import build_tiny_random

    return build_tiny_random(seed=0, device="cpu")


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from models.target_loaders import DEFAULT_CACHE_DIR, smollm2_gguf_path

    converted = DEFAULT_CACHE_DIR / "smollm2-135m-instruct"
    if (converted / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(converted))  # <1 s
    gguf = smollm2_gguf_path()  # first use on a fresh machine: read it from the GGUF
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module")
def tiny_embedded(tiny, tmp_path_factory):
    cache = tmp_path_factory.mktemp("regen")
    return prepare_data(
        tiny,
        num_train=24,
        num_eval=6,
        max_new_tokens=8,
        max_len=512,
        regen_dtype="float32",
        stdlib_files=20,
        cache_dir=str(cache),
        progress=False,
    )


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


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
    src = write_rows(tmp_path / "c.jsonl", [openai(i, f"answer {i}") for i in range(5)])
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
        assert ids[start:] == greedy(base, ids[:start], 6)  # the target's own answer to it
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


def test_parse_speeches_keeps_speakers_and_drops_stage_directions():
    play = (
        "# Hamlet\n\n## ACT I\n\n### SCENE II. A room of state.\n\n_Enter KING_\n\n"
        "**KING CLAUDIUS**  \nThough yet of Hamlet our dear brother's death  \n"
        "_\\[Aside]_  \nThe memory be green,--\n\n**HAMLET**  \nA little more than kin.\n"
    )
    assert parse_speeches(play) == [
        {
            "title": "Hamlet",
            "act": "Act I",
            "scene": "Scene II",
            "speaker": "King Claudius",
            "lines": ["Though yet of Hamlet our dear brother's death", "The memory be green,--"],
        },
        {
            "title": "Hamlet",
            "act": "Act I",
            "scene": "Scene II",
            "speaker": "Hamlet",
            "lines": ["A little more than kin."],
        },
    ]


# -- the embedded corpus --------------------------------------------------------------


def test_eval_prompts_are_held_out_by_source_item(tiny, tiny_embedded):
    data, tok = tiny_embedded, tiny.tokenizer
    train_groups, eval_groups = set(data.train["group"]), {p["group"] for p in data.eval_prompts}
    assert train_groups and eval_groups and not train_groups & eval_groups
    assert all(held_out(g, seed=0) for g in eval_groups)
    assert not any(held_out(g, seed=0) for g in train_groups)
    assert [p["category"] for p in data.eval_prompts] == ["code"] * 2 + ["prose"] * 2 + ["qa"] * 2
    assert sorted(set(data.train["category"])) == ["code", "prose", "qa"]
    train_text = "\n".join(tok.decode(ids) for ids in data.train["input_ids"])
    for p in data.eval_prompts:
        assert p["messages"][-1]["content"] not in train_text
        assert p["input_ids"] == list(
            tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_dict=False)
        )


def test_embedded_split_is_deterministic():
    kw = {"seed": 3, "need_reference": False, "stdlib_files": 10}
    a_train, a_eval, _ = embedded_conversations(12, 6, fits=lambda m: True, **kw)
    b_train, b_eval, _ = embedded_conversations(12, 6, fits=lambda m: True, **kw)
    assert a_eval == b_eval and a_train == b_train
    assert len({c["unit"] for c in a_train + a_eval}) == 18  # each source unit used once


@pytest.fixture(scope="module")
def tiny_streams(tiny, tmp_path_factory):
    """tiny_embedded's settings plus the two streams that are not regenerated."""
    cache = tmp_path_factory.mktemp("regen")
    return prepare_data(
        tiny,
        num_train=24,
        num_eval=6,
        num_reference=9,
        num_raw_chunks=6,
        max_new_tokens=8,
        max_len=512,
        regen_dtype="float32",
        stdlib_files=20,
        cache_dir=str(cache),
        progress=False,
    )


def rows_of(data, stream: str) -> list[dict]:
    return [r for r in data.train if r["stream"] == stream]


def test_reference_and_raw_streams_train_only_their_answers(tiny, tiny_streams):
    data, tok = tiny_streams, tiny.tokenizer
    streams = data.stats["streams"]
    assert {k: v["rows"] for k, v in streams.items()} == {"regen": 24, "reference": 9, "raw": 6}
    for name, st in streams.items():
        rows = rows_of(data, name)
        assert st["tokens"] == sum(len(r["input_ids"]) for r in rows)
        assert st["trained_tokens"] == sum(map(sum, (r["loss_mask"] for r in rows)))
    assert sum(st["trained_tokens"] for st in streams.values()) == data.stats["trained_tokens"]
    reference, raw = rows_of(data, "reference"), rows_of(data, "raw")
    assert [r["category"] for r in reference] == ["code"] * 3 + ["prose"] * 3 + ["qa"] * 3
    assert [r["category"] for r in raw] == ["code", "prose"] * 3
    for r in reference + raw:
        ids, mask = r["input_ids"], r["loss_mask"]
        text = tok.decode(ids)
        assert len(ids) <= 512 and mask[-1] == 0
        # One user turn, one assistant turn: exactly the answer and its end-of-turn trained.
        assert text.count("<|im_start|>assistant\n") == 1
        answer = text.split("<|im_start|>assistant\n")[1].removesuffix("\n")
        assert trained_text(tok, ids, mask) == answer
        assert tok.decode(ids[: mask.index(1) + 1]).endswith("<|im_start|>assistant\n")
    for r in raw:  # the chunk's first lines ask for its continuation, the rest is the answer
        user = tok.decode(r["input_ids"]).split("<|im_start|>user\n")[1]
        assert user.startswith("Continue this " + ("file" if r["category"] == "code" else "scene"))
        assert sum(r["loss_mask"]) > 128  # raw chunks fill most of max_len


def test_extra_streams_leave_regenerated_rows_and_eval_prompts_alone(tiny_embedded, tiny_streams):
    regen = [(r["input_ids"], r["loss_mask"]) for r in rows_of(tiny_streams, "regen")]
    assert regen == list(zip(tiny_embedded.train["input_ids"], tiny_embedded.train["loss_mask"]))
    assert tiny_streams.eval_prompts == tiny_embedded.eval_prompts
    # The same settings key: the same regeneration cache entry.
    keys = [Path(d.stats["regen"]["cache"]).parent.name for d in (tiny_embedded, tiny_streams)]
    assert keys[0] == keys[1]


def test_every_stream_is_disjoint_from_eval_by_source_item(tiny_streams):
    eval_groups = {p["group"] for p in tiny_streams.eval_prompts}
    train_groups = set(tiny_streams.train["group"])
    assert {g.split(":")[0] for g in train_groups} == {"humaneval", "play", "stdlib"}
    assert not train_groups & eval_groups
    assert not any(held_out(g, seed=0) for g in train_groups)
    # At scale too: hundreds of chunks and references, none from a held-out group.
    raw = raw_chunk_conversations(300, 0, 400, lambda lines: [len(x) + 1 for x in lines])
    refs = reference_conversations(300, 0, lambda m: True, used_units=set())
    assert len(raw) == len(refs) == 300
    assert not any(held_out(c["group"], seed=0) for c in raw + refs)
    assert len({c["unit"] for c in refs}) == 300  # each source unit once


def test_extra_streams_are_deterministic_given_the_seed():
    line_tokens = lambda lines: [len(x) + 1 for x in lines]  # noqa: E731
    raw = [raw_chunk_conversations(8, s, 400, line_tokens) for s in (1, 1, 2)]
    refs = [reference_conversations(9, s, lambda m: True, used_units=set()) for s in (1, 1, 2)]
    assert raw[0] == raw[1] != raw[2] and refs[0] == refs[1] != refs[2]
    # A unit the main rows used is never a reference row.
    taken = {c["unit"] for c in refs[0]}
    assert not taken & {c["unit"] for c in reference_conversations(9, 1, lambda m: True, taken)}


def test_extra_streams_say_how_many_they_can_give(tiny, tmp_path):
    with pytest.raises(ValueError, match=r"num_raw_chunks=100000: .* only \d+ chunks"):
        raw_chunk_conversations(10**5, 0, 10**7, lambda lines: [1] * len(lines))
    src = write_rows(tmp_path / "c.jsonl", [openai(i, f"answer {i}") for i in range(6)])
    kw = {"source": str(src), "num_eval": 0, "num_train": 4, "regenerate": False}
    data = prepare_data(tiny, num_reference=2, progress=False, **kw)
    assert {k: v["rows"] for k, v in data.stats["streams"].items()} == {"source": 4, "reference": 2}
    assert len({tuple(ids) for ids in data.train["input_ids"]}) == 6  # the 2 rows after the 4
    with pytest.raises(ValueError, match="num_reference=3.*only 2 answered rows"):
        prepare_data(tiny, num_reference=3, progress=False, **kw)


def test_held_out_pool_gives_48_balanced_eval_prompts(smollm2_tokenizer):
    """The recipe evaluates on >= 24 prompts: at the default settings the held-out pool has
    at least 48, balanced."""
    tok = smollm2_tokenizer

    def fits(messages: list[dict]) -> bool:  # prepare_data's check at max_len 512
        return len(tok.apply_chat_template(messages, add_generation_prompt=True)) <= 256

    picks = embedded_conversations(0, 48, 0, fits, need_reference=False)[1]
    assert [c["category"] for c in picks] == ["code"] * 16 + ["prose"] * 16 + ["qa"] * 16
    assert len({c["unit"] for c in picks}) == 48
    assert all(held_out(c["group"], seed=0) for c in picks)


def test_default_regeneration_cache_key_is_unchanged(smollm2_tokenizer):
    """The default data config keys SmolLM2's regeneration cache as before: a change here
    would silently re-answer the 256 prompts (minutes) on every machine with a cache."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from train.data.regenerate import _sha, settings_key

    cfg = OmegaConf.load(CONF / "data" / "default.yaml")
    tok = smollm2_tokenizer
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"  # SmolLM2's generation_config EOS
    target = SimpleNamespace(name="smollm2-135m-instruct", tokenizer=tok, eos_token_ids=[2])
    key = settings_key(
        target,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_p,
        cfg.seed,
        resolve_chat_template(tok, cfg.chat_template),
        cfg.regen_dtype,
    )
    assert _sha(key) == "fff452cf1ef00c83"


def test_token_counts_and_lengths(tiny, tiny_embedded):
    data = tiny_embedded
    counts = torch.zeros(tiny.vocab_size, dtype=torch.long)
    for ids, mask in zip(data.train["input_ids"], data.train["loss_mask"], strict=True):
        assert len(ids) == len(mask) <= 512 and mask[-1] == 0
        assert mask.index(1) + 1 <= 256  # prompts over max_len/2 were never drawn
        counts += torch.bincount(
            torch.tensor([ids[t + 1] for t in range(len(ids) - 1) if mask[t]]),
            minlength=tiny.vocab_size,
        )
    assert torch.equal(counts, data.token_counts)
    assert (
        int(counts.sum()) == sum(map(sum, data.train["loss_mask"])) == data.stats["trained_tokens"]
    )
    assert data.stats["train_rows"] == len(data.train) == 24


def greedy(target, prompt: list[int], n: int) -> list[int]:
    """Reference: plain argmax decoding through the Target wrapper, no cache, no batch."""
    ids = list(prompt)
    for _ in range(n):
        nxt = int(target(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt in target.eos_token_ids:
            break
    return ids[len(prompt) :]


# -- local sources ------------------------------------------------------------------


def sharegpt(i: int, answer: str | None) -> dict:
    turns = [{"from": "human", "value": f"question {i}?"}]
    return {"conversations": turns + ([{"from": "gpt", "value": answer}] if answer else [])}


def openai(i: int, answer: str | None) -> dict:
    turns = [{"role": "user", "content": f"question {i}?"}]
    return {"messages": turns + ([{"role": "assistant", "content": answer}] if answer else [])}


@pytest.mark.parametrize(("form", "where"), [(sharegpt, "dir/part.parquet"), (openai, "f.jsonl")])
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
        tmp_path / "c.jsonl", [openai(i, f"answer {i}") for i in range(8)] + [openai(99, "dup")] * 2
    )  # a duplicated row must not straddle the split
    data = prepare_data(tiny, source=str(path), num_eval=3, regenerate=False, progress=False)
    assert len(data.eval_prompts) == 3 and len(data.train) == 6
    assert data.stats["dropped_eval_duplicates"] == 1  # seed 0 draws the duplicated row
    eval_q = {p["messages"][-1]["content"] for p in data.eval_prompts}
    train_text = "\n".join(tiny.tokenizer.decode(ids) for ids in data.train["input_ids"])
    assert not any(q in train_text for q in eval_q)


def test_truncation_to_max_len(tiny, tmp_path):
    path = write_rows(tmp_path / "long.jsonl", [openai(0, "z" * 300), openai(1, "short")])
    data = prepare_data(
        tiny, source=str(path), num_eval=0, regenerate=False, max_len=64, progress=False
    )
    assert max(map(len, data.train["input_ids"])) == 64 and data.stats["truncated"] == 1


def test_bad_sources_fail_clearly(tiny, tmp_path):
    empty = write_rows(tmp_path / "empty.jsonl", [openai(i, None) for i in range(3)])
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


CONF = Path(__file__).resolve().parents[1] / "conf"


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF / "data").glob("*.yaml")))
def test_data_configs_are_prepare_data_arguments(name):
    from hydra import compose, initialize_config_dir

    conf = CONF
    with initialize_config_dir(config_dir=str(conf), version_base=None):
        cfg = compose(config_name=None, overrides=[f"+data={name}"])
    params = set(inspect.signature(prepare_data).parameters) - {"target"}
    assert set(cfg.data) <= params, set(cfg.data) - params
