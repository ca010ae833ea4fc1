"""Target-written data: requests the target writes itself (train/data/self_prompts.py) and
packs of target-written conversations (train/data/pack.py, scripts/build_pack.py), on the
tiny random target; the shipped pack of the embedded SmolLM2 checked for what it must never
hold."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

import train.data.self_prompts as self_prompts_module
from models.target_loaders import build_tiny_random
from train.data.chat import resolve_chat_template, tokenize_conversation
from train.data.pack import BUILTIN, load_pack, read_manifest, resolve_pack, write_pack
from train.data.prepare import prepare_data
from train.data.self_prompts import NearCopies, keep_prompts, prefix_and_stop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import build_pack  # noqa: E402


def test_near_copies_catch_copies_edits_and_quotes_not_other_text():
    index = NearCopies(["Write a haiku about the autumn moon over the quiet lake tonight."])
    assert index.near("write a haiku about the autumn moon over the quiet lake tonight")
    assert index.near("Write a haiku about the autumn moon over the still lake tonight.")
    assert index.near(
        "Please: write a haiku about the autumn moon over the quiet lake tonight. Thanks"
    )
    assert not index.near("Write a limerick about a cat who sails the sea in a sieve.")
    assert not index.near("haiku")  # shares no 5-gram
    assert NearCopies(["why"]).near("Why?")  # a text shorter than 5 words: as a whole


def test_keep_prompts_drops_what_each_filter_names():
    rows = [
        {
            "text": "How do I sort a list of tuples by their second element in Python?",
            "finished": True,
        },
        {
            "text": "Tell me about the history of the printing press and its inventor",
            "finished": False,
        },
        {"text": "Hi", "finished": True},
        {"text": "What is <|im_start|> for in this template?", "finished": True},
        {"text": "the cat the cat the cat the cat the cat the cat the cat", "finished": True},
        {
            "text": "How do I sort a list of tuples by their second element in Python??",
            "finished": True,
        },
        {
            "text": "Explain how photosynthesis turns sunlight into chemical energy in plants.",
            "finished": True,
        },
        {
            "text": "Give me three ideas for a birthday party for a seven year old.",
            "finished": True,
        },
    ]
    protected = ["Explain how photosynthesis turns sunlight into chemical energy in plants"]
    kept, dropped = keep_prompts(rows, protected)
    assert kept == [rows[0]["text"], rows[7]["text"]]
    assert dropped == {"unfinished": 1, "length": 1, "markup": 1, "repetitive": 1,
                       "duplicate": 1, "protected": 1}  # fmt: skip


def test_the_prefix_is_the_template_up_to_the_users_text(tiny):
    tok = tiny.tokenizer
    template = resolve_chat_template(tok, None)
    prefix, stop = prefix_and_stop(tok, template)
    text = tok.decode(prefix)
    assert text.endswith("<|im_start|>user\n") and tok.convert_ids_to_tokens(stop) == ["<|im_end|>"]
    with pytest.raises(ValueError, match="no end-of-turn token"):
        prefix_and_stop(tok, resolve_chat_template(tok, "plain"))


@pytest.fixture(scope="module")
def pack_dir(tmp_path_factory, tiny) -> Path:
    """A pack of the tiny target: 6 pool prompts and its self-written requests (its random
    weights never end a user turn, so the drawing is replaced by fixed requests, each
    "finished"), built by scripts/build_pack.py."""
    root = tmp_path_factory.mktemp("pack")
    texts = iter([
        "Tell me a short story about a cat who learns to fly over the sea.",
        "How do I reverse a linked list in C without using recursion?",
        "What were the main causes of the French Revolution in 1789?",
        "Suggest a name for a bakery that sells only sourdough bread.",
        "Tell me a short story about a cat who learns to fly over the sea!",  # a duplicate
    ])  # fmt: skip

    def fake_regenerate(target, prompts, **kw):
        return [{"text": next(texts), "finished": True, "ids": []} for _ in prompts], {}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(self_prompts_module, "regenerate", fake_regenerate)
        build_pack.main(["--self", "5", "--pool", "6", "--out", str(root / "pack"),
                         "target=tiny_random", "data=tiny", f"data.cache_dir={root / 'cache'}"])  # fmt: skip
    return root / "pack"


def read_rows(path: Path) -> list[dict]:
    with gzip.open(path / "conversations.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f]


def test_a_built_pack_holds_its_manifest_and_the_targets_own_answers(pack_dir, tiny):
    manifest, rows = read_manifest(pack_dir), read_rows(pack_dir)
    assert manifest["weights"] == tiny.fingerprint and manifest["target"] == tiny.name
    assert manifest["self_prompts"]["drawn"] == 5 and manifest["self_prompts"]["kept"] == 4
    assert manifest["self_prompts"]["dropped"]["duplicate"] == 1
    assert {r["source"] for r in rows} == {"self", "pool"} and len(rows) == 4 + 6
    assert manifest["answer_tokens"] == sum(len(r["answer_ids"]) for r in rows)
    assert manifest["command"].startswith("python scripts/build_pack.py --self 5 --pool 6")
    # the answers are the target's: regenerating one prompt gives the same tokens
    from train.data.regenerate import regenerate

    template = resolve_chat_template(tiny.tokenizer, None)
    end = tiny.tokenizer.convert_ids_to_tokens(tiny.eos_token_ids)
    row = rows[0]
    ids = tokenize_conversation(tiny.tokenizer, [{"role": "user", "content": row["prompt"]}],
                                True, end, template)[0]  # fmt: skip
    (answer,), _ = regenerate(tiny, [ids], max_new_tokens=16, dtype="float32", progress=False,
                              cache_dir=pack_dir.parent / "other")  # fmt: skip
    assert answer["ids"] == row["answer_ids"]


def test_a_run_trains_on_the_pack_and_a_prefix_of_it(pack_dir, tiny, tmp_path):
    kw = dict(num_train=0, num_eval=2, max_new_tokens=16, regen_dtype="float32",
              stdlib_files=20, progress=False, cache_dir=str(tmp_path), pack=str(pack_dir))  # fmt: skip
    data = prepare_data(tiny, **kw)
    rows = read_rows(pack_dir)
    assert set(data.train["stream"]) == {"pack"} and len(data.train) == len(rows)
    assert data.stats["pack"]["answer_tokens"] == read_manifest(pack_dir)["answer_tokens"]
    first = data.train[0]
    answer = rows[0]["answer_ids"]
    assert first["input_ids"][-len(answer) :] == answer  # the target's own ids, as written
    assert sum(first["loss_mask"]) == len(answer)  # every answer token, nothing else, trained
    held = prepare_data(tiny, **kw | {"pack_val": 2})  # the first 2: validation, not trained
    assert len(held.val_rows) == 2 and len(held.train) == len(rows) - 2
    assert held.val_rows[0]["input_ids"] == data.train[0]["input_ids"]
    few = prepare_data(tiny, **kw | {"pack_tokens": 1, "pack_sources": ["self"]})
    assert len(few.train) == 1 and set(few.train["group"]) <= {r["group"] for r in rows
                                                              if r["source"] == "self"}  # fmt: skip


def test_a_pack_of_other_weights_is_refused_with_the_command_that_builds_one(pack_dir, tmp_path):
    other = build_tiny_random(seed=1, device="cpu")
    with pytest.raises(ValueError, match=r"its answers are not this target's.*build_pack.py"):
        prepare_data(other, num_train=0, num_eval=2, stdlib_files=20, progress=False,
                     cache_dir=str(tmp_path), pack=str(pack_dir))  # fmt: skip
    with pytest.raises(FileNotFoundError, match="build one with"):
        resolve_pack(str(tmp_path / "nothing"))


def test_a_protected_prompt_in_a_pack_is_never_trained(pack_dir, tiny, tmp_path):
    """A pack holding an eval prompt (and a near-copy of an OOD prompt): the loader drops
    both, whatever seed split the eval prompts."""
    rows, manifest = read_rows(pack_dir), read_manifest(pack_dir)
    eval_text = "Which day of the week comes after a Tuesday in a normal calendar week?"
    ood = json.loads((ROOT / "train/data/ood_prompts.jsonl").read_text().splitlines()[0])["prompt"]
    bad = [{**rows[0], "prompt": eval_text}, {**rows[1], "prompt": ood + " Please."}]
    write_pack(tmp_path / "bad", bad + rows, {k: v for k, v in manifest.items() if k != "format"})
    template = resolve_chat_template(tiny.tokenizer, None)
    end = tiny.tokenizer.convert_ids_to_tokens(tiny.eos_token_ids)

    def prompt_ids(messages):
        return tokenize_conversation(tiny.tokenizer, messages, True, end, template)[0]

    items, val, stats = load_pack(tmp_path / "bad", tiny, template, prompt_ids, [eval_text, ood],
                                  val=3)  # fmt: skip
    assert stats["protected_dropped"] == 2 and len(items) + len(val) == len(rows)
    assert [v["group"] for v in val] == [r["group"] for r in rows[:3]]  # the first, held out
    assert {v["stream"] for v in val} == {"val"} and not {i["group"] for i in items} & {
        v["group"] for v in val}  # fmt: skip
    assert all(it["messages"][0]["content"] not in (eval_text, ood + " Please.") for it in items)


def test_the_shipped_pack_holds_no_eval_or_ood_prompt_nor_a_near_copy():
    """The embedded target's pack: none of its prompts is a near-copy of any prompt of the
    groups data.seed=0 holds out for evaluation (the 24 eval prompts are drawn from them),
    nor of an out-of-domain prompt; it holds at least the ~300k answer tokens one pass of the
    first run's training budget uses."""
    from train.data.corpus import held_out_prompts
    from train.data.prompt_file import ood_prompt_texts

    manifest, rows = read_manifest(BUILTIN), read_rows(BUILTIN)
    protected = held_out_prompts(0) + ood_prompt_texts()
    guard = NearCopies(protected)
    assert not [r["prompt"] for r in rows if guard.near(r["prompt"])]
    assert manifest["answer_tokens"] == sum(len(r["answer_ids"]) for r in rows) >= 300_000
    assert {r["source"] for r in rows} == {"self", "pool"}
