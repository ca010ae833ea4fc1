"""Every assistant turn regenerated in order (train/data/turns.py, data.regenerate_turns=all):
each round's prompts carry the turns answered before; a conversation is cut at its last
answered turn when its next prompt is too long or refused; through prepare_data, each turn
of a training row is the target's greedy answer to the row up to it."""

import pytest
import torch

from tests.helpers import write_rows
from train.data.chat import resolve_chat_template, tokenize_conversation
from train.data.prepare import prepare_data
from train.data.turns import regenerate_every_turn


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def fake_backend(refuse: set[str] = frozenset()):
    """An answer per prompt: its turn count as ids; records each round's prompts."""
    seen = []

    def answer(ids, prompts):
        seen.append([[m["content"] for m in p] for p in prompts])
        return [None if p[-1]["content"] in refuse else {"ids": [len(p)]} for p in prompts]

    return answer, seen


def words(messages: list[dict]) -> list[int]:
    return [0] * sum(len(m["content"].split()) + 1 for m in messages)  # a token per word + 1


def test_each_round_sees_the_turns_answered_before():
    convs = [
        [user("a1"), bot("x"), user("a2"), bot("y"), user("a3"), bot("z")],
        [{"role": "system", "content": "s"}, user("b1"), bot("w")],
    ]
    answer, seen = fake_backend()
    out, counts = regenerate_every_turn(convs, answer, words, lambda ids: f"ans{ids[0]}", 100)
    assert seen == [[["a1"], ["s", "b1"]], [["a1", "ans1", "a2"]], [["a1", "ans1", "a2", "ans3", "a3"]]]  # fmt: skip
    assert out == [
        [user("a1"), bot("ans1"), user("a2"), bot("ans3"), user("a3"), bot("ans5")],
        [{"role": "system", "content": "s"}, user("b1"), bot("ans2")],
    ]
    assert counts == {"rounds": 3, "answered_turns": 4, "cut_short": 0}


def test_a_conversation_ends_at_its_last_answered_turn():
    convs = [
        [user("a1"), bot("x"), user("a2 long " * 5), bot("y")],  # second prompt too long
        [user("b1"), bot("x"), user("b2"), bot("y")],  # second prompt refused
        [user("c1"), bot("x")],  # first prompt refused: dropped
    ]
    answer, _ = fake_backend(refuse={"b2", "c1"})
    out, counts = regenerate_every_turn(convs, answer, words, lambda ids: "ok", max_prompt=8)
    assert out == [[user("a1"), bot("ok")], [user("b1"), bot("ok")], None]
    assert counts == {"rounds": 2, "answered_turns": 2, "cut_short": 2}


def greedy(target, ids: list[int], new: int) -> list[int]:
    out = target.model.generate(
        torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=0,
        eos_token_id=target.eos_token_ids,
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("turns", ["all", "last"])
def test_every_turn_of_a_row_is_the_targets_greedy_answer(tiny, tmp_path, turns):
    rows = [
        {"messages": [user(f"q{i}"), bot("src one"), user(f"more {i}"), bot("src two")]}
        for i in range(4)
    ]
    path = write_rows(tmp_path / "multi.jsonl", rows)
    data = prepare_data(tiny, source=str(path), num_eval=1, regenerate_turns=turns,
                        max_new_tokens=6, regen_dtype="float32", progress=False,
                        cache_dir=str(tmp_path / "c"))  # fmt: skip
    tok = tiny.tokenizer
    template = resolve_chat_template(tok, None)
    ends = tok.convert_ids_to_tokens(tiny.eos_token_ids)
    assert len(data.train) == 3
    for ids, mask, group in zip(data.train["input_ids"], data.train["loss_mask"], data.train["group"]):  # fmt: skip
        i = int(group.split(":")[1])
        first = greedy(tiny, tokenize_conversation(tok, [user(f"q{i}")], True, ends, template)[0], 6)  # fmt: skip
        first_text = tok.decode(first, skip_special_tokens=True) if turns == "all" else "src one"
        history = [user(f"q{i}"), bot(first_text), user(f"more {i}")]
        prompt = tokenize_conversation(tok, history, True, ends, template)[0]
        second = greedy(tiny, prompt, 6)
        if turns == "last":  # the answer's own tokens follow the prompt
            assert ids == prompt + second
        else:  # the row rendered from the answers' text
            full = [*history, bot(tok.decode(second, skip_special_tokens=True))]
            assert ids == tokenize_conversation(tok, full, False, ends, template)[0]
        trained = {t + 1 for t, m in enumerate(mask) if m}
        first_span = set(range(len(tokenize_conversation(tok, history[:1], True, ends, template)[0]), len(tokenize_conversation(tok, history[:2], False, ends, template)[0])))  # fmt: skip
        # Under `all` the first answer is the target's and trained; under `last` it is the
        # source's, and trained too (what `last` has always done: its flags come with it).
        assert first_span & trained
    assert data.stats["regen"]["generated"] == (3 + 3 if turns == "all" else 3)
