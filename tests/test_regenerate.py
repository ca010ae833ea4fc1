"""Target-regenerated answers (train/data/regenerate.py): equal to the target's greedy
output, and a cache that resumes after a crash, is keyed by the settings, and keeps the
default data config's key."""

import torch

from tests.helpers import CONF, greedy_tokens, write_rows
from train.data.chat import CHAT_TEMPLATES, resolve_chat_template
from train.data.prepare import prepare_data
from train.data.regenerate import regenerate


def test_regenerated_answers_are_the_targets_greedy_output(tiny_target, tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
        for q in ("Hi", "What is 2+2?", "Name a colour, please.")
    ]
    src = write_rows(tmp_path / "chats.jsonl", rows)
    data = prepare_data(
        tiny_target,
        source=str(src),
        num_eval=0,
        max_new_tokens=12,
        max_len=256,
        regen_dtype="float32",
        regen_batch_size=3,
        cache_dir=str(tmp_path),
        progress=False,
    )
    assert data.stats["regen"]["generated"] == 3
    for ids, mask in zip(data.train["input_ids"], data.train["loss_mask"], strict=True):
        start = mask.index(1) + 1  # first answer token
        assert tiny_target.tokenizer.decode(ids[:start]).endswith("<|im_start|>assistant\n")
        assert ids[start:] == greedy_tokens(tiny_target, ids[:start], 12)
        assert sum(mask) == len(ids) - start  # every answer token trained, prompt not


def test_regeneration_cache_resumes_and_is_keyed_by_settings(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False
            )
        )
        for q in ("a", "bb", "ccc")
    ]
    kw = {
        "max_new_tokens": 5,
        "dtype": "float32",
        "batch_size": 2,
        "cache_dir": tmp_path,
        "progress": False,
    }
    first, s1 = regenerate(tiny_target, prompts[:2], **kw)
    assert (s1["cached"], s1["generated"]) == (0, 2)
    with open(s1["cache"], "a") as f:
        f.write('{"prompt": "cut short by a cra')  # a crash mid-write
    again, s2 = regenerate(tiny_target, prompts, **kw)
    assert (s2["cached"], s2["generated"]) == (2, 1)
    assert again[:2] == first
    assert regenerate(tiny_target, prompts, **kw)[1]["generated"] == 0
    other = regenerate(tiny_target, prompts[:1], **{**kw, "max_new_tokens": 3})[1]
    assert other["generated"] == 1 and other["cache"] != s1["cache"]
    # The template the prompts were rendered with is part of the key (data.chat_template).
    assert (
        regenerate(tiny_target, prompts, **kw, chat_template=tok.chat_template)[1]["generated"] == 0
    )
    plain = regenerate(tiny_target, prompts[:1], **kw, chat_template=CHAT_TEMPLATES["plain"])[1]
    assert plain["generated"] == 1 and plain["cache"] != s1["cache"]
    for r in again:
        assert len(r["ids"]) <= 5 and r["finished"] == (r["ids"][-1] in tiny_target.eos_token_ids)


def test_default_regeneration_cache_key_is_unchanged(smollm2_tokenizer):
    """The default data config keys SmolLM2's regeneration cache as before, up to the weights'
    fingerprint, which a cache of the former key is adopted under (legacy_key; the test of
    the adoption is in tests/test_identity.py): a change here would silently re-answer the
    256 prompts on every machine with a cache. The default dtype is `auto`: a machine whose
    measurement picks bfloat16 (the former default) keeps its cache; one that picks float32
    answers once more, in its faster dtype."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from train.data.regenerate import legacy_key, settings_key

    cfg = OmegaConf.load(CONF / "data" / "default.yaml")
    tok = smollm2_tokenizer
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"  # SmolLM2's generation_config EOS
    target = SimpleNamespace(
        name="smollm2-135m-instruct", tokenizer=tok, eos_token_ids=[2], fingerprint="0" * 16
    )
    key = settings_key(
        target,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_p,
        cfg.seed,
        resolve_chat_template(tok, cfg.chat_template),
        "bfloat16" if cfg.regen_dtype == "auto" else cfg.regen_dtype,
    )
    assert key["weights"] == "0" * 16
    assert legacy_key(key) == "fff452cf1ef00c83"


def test_regeneration_leaves_the_callers_random_stream_alone(tiny_target, tmp_path):
    """A training run builds its draft after the data: its initial weights must be the same
    whether the answers were generated in this process or read from the cache."""
    prompts = [[1, 5, 9, 14], [2, 6, 10, 3, 7]]
    for temperature in (0.0, 1.0):  # greedy and sampled generation
        torch.manual_seed(123)
        regenerate(tiny_target, prompts, max_new_tokens=6, temperature=temperature,
                   dtype="float32", cache_dir=str(tmp_path / f"t{temperature}"), progress=False)  # fmt: skip
        after_generating = torch.rand(4)
        torch.manual_seed(123)
        after_nothing = torch.rand(4)
        assert torch.equal(after_generating, after_nothing)


def test_batched_answers_end_per_row_and_equal_each_rows_greedy_output(tiny_target):
    """answer_batch: rows of different lengths, each ended by its own EOS (then it leaves the
    batch) or by the budget, give what plain argmax decoding of that row alone gives."""
    from decoding.rounds import GREEDY
    from train.data.answer_batch import answer_batch

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (5, 9, 7, 12)]
    free = [greedy_tokens(tiny_target, p, 10) for p in prompts]  # no EOS of ours yet
    # Each row's 3rd / 6th token as end tokens: rows stop at different steps (or never).
    eos = [free[0][2], free[1][5], *tiny_target.eos_token_ids]
    answers = answer_batch(tiny_target, prompts, 10, GREEDY, eos, pad_id=0)

    def cut(tokens: list[int]) -> list[int]:
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        return tokens if stop is None else tokens[: stop + 1]

    assert answers == [cut(t) for t in free]
    assert len(answers[0]) <= 3 and len({len(a) for a in answers}) > 1  # rows left early
