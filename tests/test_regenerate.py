"""Target-regenerated answers (train/data/regenerate.py): equal to the target's greedy
output, and a cache that resumes after a crash, is keyed by the settings, and keeps the
default data config's key."""

import pytest
import torch

from decoding.drafter import Sampling
from decoding.rounds import GREEDY
from models.target_loaders import build_tiny_random
from tests.helpers import CONF, greedy_tokens, write_rows
from train.data.answer_batch import SlotCache, answer_prompts, decode_step
from train.data.chat import CHAT_TEMPLATES, resolve_chat_template
from train.data.prepare import prepare_data
from train.data.regenerate import append_line, regenerate


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


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding-window layers
def test_slot_cache_steps_give_each_sequences_own_next_token_logits(arch):
    """Slots holding sequences of different lengths, stepped together (each slot writing and
    attending at its own position, sliding layers within their window): every step's logits
    equal a full forward of that slot's sequence alone, with no cache."""
    target = build_tiny_random(seed=0, device="cpu", arch=arch, sliding_window=4)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (5, 11)]
    width = max(map(len, seqs))
    ids = torch.tensor([[0] * (width - len(q)) + q for q in seqs])  # [2, 11] left-padded
    attn = (torch.arange(width)[None] >= torch.tensor([[width - len(q)] for q in seqs])).long()
    with torch.inference_mode():
        out = target(ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp_min(0))
        cache = SlotCache(slots=2, max_len=width + 8, device=torch.device("cpu"))
        for slot, q in enumerate(seqs):
            cache.fill(slot, out.cache, slot, len(q))
        for _ in range(6):
            last = torch.randint(3, 100, (2,), generator=gen)
            seqs = [q + [int(t)] for q, t in zip(seqs, last)]
            logits = decode_step(target, cache, last)  # [2, V]
            cache.lengths += 1
            for slot, q in enumerate(seqs):
                alone = target(torch.tensor([q]), use_cache=False).logits[0, -1]
                torch.testing.assert_close(logits[slot], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding-window layers
def test_streamed_answers_equal_each_prompts_greedy_output(arch):
    """answer_prompts: 5 prompts of different lengths through 2 slots, each answer ended by
    its own EOS (its slot then takes the next prompt) or by the budget, give what plain
    argmax decoding of that prompt alone gives; each answer is handed over as it ends."""
    target = build_tiny_random(seed=0, device="cpu", arch=arch, sliding_window=8)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (5, 9, 7, 12, 6)]
    free = [greedy_tokens(target, p, 20) for p in prompts]  # answers past the 8-token window
    # A token of row 0 and one of row 1 as end tokens: answers end at different steps.
    eos = [free[0][2], free[1][5], *target.eos_token_ids]

    def cut(tokens: list[int]) -> list[int]:
        stop = next((i for i, t in enumerate(tokens) if t in eos), None)
        return tokens if stop is None else tokens[: stop + 1]

    ended, decoded = [], []
    answers = answer_prompts(target, prompts, 20, GREEDY, eos, pad_id=0, slots=2,
                             on_answer=lambda i, a: ended.append((i, list(a))),
                             on_token=lambda: decoded.append(len(ended)))  # fmt: skip
    assert answers == [cut(t) for t in free]
    # Every decoded token counted once, as it is decoded (before its answer ends).
    assert len(decoded) == sum(len(a) for a in answers) and decoded[-1] < len(answers)
    assert len({len(a) for a in answers}) > 1  # answers of different lengths: slots refilled
    assert sorted(ended) == list(enumerate(answers))


def test_sampled_answers_do_not_depend_on_the_slots(tiny_target):
    """Each prompt samples with its own generator: 1 slot or 3 give the same answers; the
    seeds, not the slots, decide them."""
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (5, 9, 7, 12)]
    hot = Sampling(temperature=5.0, top_p=0.95)  # flat: the tiny target is peaked
    kw = dict(max_new_tokens=10, sampling=hot, eos_token_ids=[], pad_id=0)
    alone = answer_prompts(tiny_target, prompts, slots=1, seeds=[1, 2, 3, 4], **kw)
    assert answer_prompts(tiny_target, prompts, slots=3, seeds=[1, 2, 3, 4], **kw) == alone
    assert answer_prompts(tiny_target, prompts, slots=3, seeds=[5, 6, 7, 8], **kw) != alone


def test_an_append_after_another_writers_cut_line_starts_a_line_of_its_own(tmp_path):
    """Two jobs append to one answers file; the other one is killed mid-line between this
    job's appends: this job's next line is not glued onto the cut one."""
    path = tmp_path / "responses.jsonl"
    path.write_text('{"a": 1}\n')
    with path.open("a") as mine:
        append_line(mine, '{"x": 1}\n', path)
        with path.open("a") as other:
            other.write('{"cut')  # killed here
        append_line(mine, '{"y": 1}\n', path)
    assert path.read_text().splitlines() == ['{"a": 1}', '{"x": 1}', '{"cut', '{"y": 1}']
