"""Every assistant turn regenerated in order (train/data/turns.py, data.regenerate_turns=all):
each round's prompts carry the turns answered before, as text; a conversation is cut at its
last answered turn when its next prompt is too long or refused, and ends at an answer cut at
max_new_tokens; the training row holds each answer's own token ids (never its text
re-encoded), and no end-of-turn after a cut answer; through prepare_data, each turn of a
training row is the target's greedy answer to the row up to it."""

import pytest
import torch

import train.data.prepare as prepare
from models.tiny_tokenizer import CHATML_TEMPLATE, build_char_tokenizer
from tests.helpers import write_rows
from train.data.chat import resolve_chat_template, tokenize_conversation
from train.data.prepare import prepare_data
from train.data.turns import regenerate_every_turn


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


END = 9  # words()' end of a message, and the fake target's EOS


def fake_backend(refuse: set[str] = frozenset(), eos: int = END):
    """An answer per prompt: its turn count, then `eos`; records each round's prompts."""
    seen = []

    def answer(ids, prompts):
        seen.append([[m["content"] for m in p] for p in prompts])
        return [
            None if p[-1]["content"] in refuse else {"ids": [len(p), eos], "finished": True}
            for p in prompts
        ]

    return answer, seen


def words(messages: list[dict]) -> tuple[list[int], list[int]]:
    """A token 0 per word and END per message, flagged on the assistant's messages."""
    ids, flags = [], []
    for m in messages:
        n = len(m["content"].split())
        ids += [0] * n + [END]
        flags += [int(m["role"] == "assistant")] * (n + 1)
    return ids, flags


def test_each_round_sees_the_turns_answered_before():
    convs = [
        [user("a1"), bot("x"), user("a2"), bot("y"), user("a3"), bot("z")],
        [{"role": "system", "content": "s"}, user("b1"), bot("w")],
    ]
    answer, seen = fake_backend()
    out, counts = regenerate_every_turn(convs, answer, words, lambda ids: f"ans{ids[0]}", 100)
    assert seen == [[["a1"], ["s", "b1"]], [["a1", "ans1", "a2"]], [["a1", "ans1", "a2", "ans3", "a3"]]]  # fmt: skip
    assert [r["messages"] for r in out] == [
        [user("a1"), bot("ans1"), user("a2"), bot("ans3"), user("a3"), bot("ans5")],
        [{"role": "system", "content": "s"}, user("b1"), bot("ans2")],
    ]
    # words(): the first prompt, then each later prompt's tokens after the last answer.
    assert out[0]["ids"] == [0, END, 1, END, 0, END, 3, END, 0, END, 5, END]
    assert out[0]["flags"] == [0, 0, 1, 1] * 3
    assert counts == {"rounds": 3, "answered_turns": 4, "cut_short": 0, "truncated": 0}


def test_a_conversation_ends_at_its_last_answered_turn():
    convs = [
        [user("a1"), bot("x"), user("a2 long " * 5), bot("y")],  # second prompt too long
        [user("b1"), bot("x"), user("b2"), bot("y")],  # second prompt refused
        [user("c1"), bot("x")],  # first prompt refused: dropped
    ]
    answer, _ = fake_backend(refuse={"b2", "c1"})
    out, counts = regenerate_every_turn(convs, answer, words, lambda ids: "ok", max_prompt=8)
    assert [r and r["messages"] for r in out] == [[user("a1"), bot("ok")], [user("b1"), bot("ok")], None]  # fmt: skip
    assert counts == {"rounds": 2, "answered_turns": 2, "cut_short": 2, "truncated": 0}


# The tiny char-level tokenizer: `<unused0>` is one vocabulary entry that decodes to nine
# characters, each its own token again, so an answer holding it does not survive decode and
# re-encode; <|im_end|> (5) is the end of turn and the EOS.
TOK = build_char_tokenizer()
UNUSED = TOK.convert_tokens_to_ids("<unused0>")
EOT = TOK.convert_tokens_to_ids("<|im_end|>")


def chars(text: str) -> list[int]:
    return TOK.convert_tokens_to_ids(list(text))


def reply(text: str, finished: bool) -> dict:
    """The target's own ids: `text`, <unused0>, and the end of turn if it stopped by itself."""
    return {"ids": chars(text) + [UNUSED] + [EOT] * finished, "finished": finished}


def chatml(role: str, text: str) -> str:  # a turn's header and content, as CHATML_TEMPLATE
    return f"<|im_start|>{role}\n{text}"


def encode(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_a_row_holds_the_answers_own_ids_and_a_cut_answer_ends_it():
    answers = {"u1": reply("hi", True), "u2": reply("cut", False), "v1": reply("no", False),
               "w1": reply("ok", True)}  # fmt: skip
    convs = [
        [user("u1"), bot("x"), user("u2"), bot("y"), user("u3"), bot("z")],  # 2nd answer cut
        [user("v1"), bot("x"), user("v2"), bot("y")],  # first answer cut
        [user("w1"), bot("x")],
    ]
    seen = []

    def answer(ids, prompts):
        seen.extend(p[-1]["content"] for p in prompts)
        return [answers[p[-1]["content"]] for p in prompts]

    out, counts = regenerate_every_turn(
        convs, answer,
        lambda msgs: tokenize_conversation(TOK, msgs, True, ["<|im_end|>"], CHATML_TEMPLATE),
        lambda ids: TOK.decode(ids, skip_special_tokens=True), max_prompt=200,
    )  # fmt: skip
    text = TOK.decode(answers["u1"]["ids"], skip_special_tokens=True)
    assert text == "hi<unused0>" and encode(text) + [EOT] != answers["u1"]["ids"]  # no round trip
    assert seen == ["u1", "v1", "w1", "u2"]  # a cut answer is not replied to
    assert out[0]["messages"][2:] == [user("u2"), bot("cut<unused0>")]  # the next prompt: text
    # The rows, from the template's text between the answers and the ids injected above.
    first = encode(chatml("user", "u1") + "<|im_end|>\n" + chatml("assistant", ""))
    between = encode("\n" + chatml("user", "u2") + "<|im_end|>\n" + chatml("assistant", ""))
    r1, r2 = answers["u1"]["ids"], answers["u2"]["ids"]
    assert out[0]["ids"] == first + r1 + between + r2  # ends with the cut answer: no <|im_end|>
    assert out[0]["flags"] == [0] * len(first) + [1] * len(r1) + [0] * len(between) + [1] * len(r2)  # fmt: skip
    start = encode(chatml("user", "v1") + "<|im_end|>\n" + chatml("assistant", ""))
    assert out[1]["ids"] == start + answers["v1"]["ids"] and out[1]["ids"][-1] == UNUSED
    assert out[1]["messages"] == [user("v1"), bot("no<unused0>")]
    assert out[2]["ids"][-3:] == chars("k") + [UNUSED, EOT]
    assert counts == {"rounds": 2, "answered_turns": 4, "cut_short": 0, "truncated": 2}


def test_prepare_data_trains_the_answers_own_ids(tiny, tmp_path, monkeypatch):
    """Through prepare_data, a backend whose first answers end their turn and whose second
    answers are cut: each row is the prompt, the first answer's ids, the next user turn and
    the second answer's ids, and its trained labels are exactly the answers' ids."""
    first, cut = reply("yes", True), reply("abc", False)

    def backend(target, prompts, **kwargs):  # the hf backend: train/data/regenerate.py
        replies = [first if TOK.decode(p).count("<|im_start|>user") == 1 else cut for p in prompts]  # fmt: skip
        return replies, {"generated": len(prompts), "new_tokens": 0, "seconds": 0.0}

    monkeypatch.setattr(prepare, "regenerate_responses", backend)
    turns = [[user(f"q{i}"), bot("a"), user(f"more {i}"), bot("b"), user("end"), bot("c")]
             for i in range(4)]  # fmt: skip
    rows = [{"messages": msgs} for msgs in turns]
    data = prepare_data(tiny, source=str(write_rows(tmp_path / "multi.jsonl", rows)),
                        num_eval=1, regenerate_turns="all", max_new_tokens=4,
                        regen_dtype="float32", progress=False, cache_dir=str(tmp_path / "c"))  # fmt: skip
    assert len(data.train) == 3
    assert data.stats["regen_turns"] == {"rounds": 2, "answered_turns": 6, "cut_short": 0, "truncated": 3}  # fmt: skip
    for ids, mask, group in zip(data.train["input_ids"], data.train["loss_mask"], data.train["group"]):  # fmt: skip
        i = int(group.split(":")[1])
        start = encode(chatml("user", f"q{i}") + "<|im_end|>\n" + chatml("assistant", ""))
        between = encode("\n" + chatml("user", f"more {i}") + "<|im_end|>\n" + chatml("assistant", ""))  # fmt: skip
        assert ids == start + first["ids"] + between + cut["ids"]
        assert [ids[t + 1] for t, m in enumerate(mask) if m] == first["ids"] + cut["ids"]


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
        start = tokenize_conversation(tok, [user(f"q{i}")], True, ends, template)[0]
        first = greedy(tiny, start, 6)
        if turns == "all":  # the random target never ends its turn: its first answer is cut
            assert first[-1] not in tiny.eos_token_ids
            assert ids == start + first  # nothing after the cut answer
            assert mask == [0] * (len(start) - 1) + [1] * len(first) + [0]
            continue
        history = [user(f"q{i}"), bot("src one"), user(f"more {i}")]
        prompt = tokenize_conversation(tok, history, True, ends, template)[0]
        assert ids == prompt + greedy(tiny, prompt, 6)  # the answer's own tokens follow
        trained = {t + 1 for t, m in enumerate(mask) if m}
        first_span = set(range(len(start), len(tokenize_conversation(tok, history[:2], False, ends, template)[0])))  # fmt: skip
        # The first answer is the source's, and trained too (what `last` has always done:
        # its flags come with it).
        assert first_span & trained
    assert data.stats["regen"]["generated"] == 3
    if turns == "all":
        assert data.stats["regen_turns"]["truncated"] == 3


def test_an_answer_ended_by_another_eos_than_the_templates_ends_its_conversation():
    """The target stopped on an EOS id (8) that is not the end-of-turn the template closes
    the answer with (END) in the next prompt: a row going on would hold 8 followed by the
    next user turn, a context the target never answered from; the conversation ends there."""
    answer, seen = fake_backend(eos=8)
    convs = [[user("a1"), bot("x"), user("a2"), bot("y")]]
    out, counts = regenerate_every_turn(convs, answer, words, lambda ids: "ok", 100)
    assert seen == [[["a1"]]] and out[0]["ids"] == [0, END, 1, 8]
    assert counts == {"rounds": 1, "answered_turns": 1, "cut_short": 1, "truncated": 0}
