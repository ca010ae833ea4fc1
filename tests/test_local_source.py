"""A local source read and tokenized on disk (train/data/local_source.py): the rows equal a
plain in-memory reference, every file form gives the same rows, the second preparation
reads the cache, an interrupted one redoes only its missing shards, two processes and two
ranks split the tokenization, a damaged row is named by its line and skipped or refused."""

import json
import os
import random
import subprocess
import sys

import datasets
import numpy as np
import pytest

import train.data.local_source as local_source
from tests.helpers import ROOT, write_rows
from train.data.chat import resolve_chat_template, shift_mask, tokenize_conversation
from train.data.local_source import (
    NO_ASSISTANT,
    OK,
    STATUS_STATS,
    TEMPLATE_MISMATCH,
    json_records,
    read_source,
    text_hash,
)
from train.data.prepare import prepare_data
from train.data.row_selection import pick_rows
from train.parallel.ranks import Ranks


def conversations(n: int) -> list[dict]:
    """Multi-turn ShareGPT rows of varied length; some without an answer, some duplicates of
    an earlier user turn, one with a system turn."""
    rng, rows = random.Random(1), []
    for i in range(n):
        turns = [{"from": "system", "value": "be brief"}] if i == 3 else []
        for t in range(1 + i % 3):
            pad = "x " * rng.randrange(30) if t else ""  # rows i and i + 37 open alike
            turns.append({"from": "human", "value": f"question {i % 37}.{t} " + pad})
            if i % 11 != 5 or t < i % 3:
                turns.append({"from": "gpt", "value": f"answer {i}.{t} " + "y " * rng.randrange(80)})  # fmt: skip
        rows.append({"conversations": turns, **({"category": "code"} if i % 7 == 0 else {})})
    return rows


def reference(tiny, rows: list[dict], seed: int, num_eval: int, max_len: int) -> tuple[list, list]:
    """The rows prepare_data should give, computed in memory as plainly as possible."""
    tok = tiny.tokenizer
    template = resolve_chat_template(tok, None)
    ends = tok.convert_ids_to_tokens(tiny.eos_token_ids)
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    convs = [
        (i, [{"role": roles[m["from"]], "content": m["value"]} for m in r["conversations"]])
        for i, r in enumerate(rows)
    ]
    random.Random(seed).shuffle(convs)
    evals, train = [], []
    for i, msgs in convs:
        first = next(n + 1 for n, m in enumerate(msgs) if m["role"] == "user")
        prompt = msgs[:first]
        prompt_len = len(tokenize_conversation(tok, prompt, True, ends, template)[0])
        fresh = all(prompt[-1]["content"] != e[-1]["content"] for e in evals)
        if len(evals) < num_eval and fresh and prompt_len <= max_len // 2:
            evals.append(prompt)
        else:
            train.append((i, msgs))
    texts = {e[-1]["content"] for e in evals}
    out = []
    for i, msgs in train:
        if any(m["role"] == "user" and m["content"] in texts for m in msgs):
            continue
        answers = [n for n, m in enumerate(msgs) if m["role"] == "assistant"]
        if not answers or answers[-1] == 0 or msgs[answers[-1] - 1]["role"] == "assistant":
            continue
        ids, flags = tokenize_conversation(tok, msgs, False, ends, template)
        ids, mask = ids[:max_len], shift_mask(flags[:max_len])
        if any(mask):
            out.append((f"row:{i}", ids, mask))
    return evals, out


def prepared_rows(data) -> list[tuple]:
    return list(zip(data.train["group"], data.train["input_ids"], data.train["loss_mask"]))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("local")
    rows = conversations(60)
    return tmp, rows, write_rows(tmp / "chat.jsonl", rows)


def test_rows_equal_an_in_memory_reference(tiny, source):
    tmp, rows, path = source
    data = prepare_data(tiny, source=str(path), num_train=None, num_eval=4, max_len=96,
                        regenerate=False, cache_dir=str(tmp / "c1"), progress=False)  # fmt: skip
    evals, expected = reference(tiny, rows, seed=0, num_eval=4, max_len=96)
    assert [p["messages"] for p in data.eval_prompts] == evals
    assert prepared_rows(data) == expected
    assert data.stats["dropped_eval_duplicates"] > 0 and data.stats["truncated"] > 0
    labels = [ids[t + 1] for _, ids, mask in expected for t in range(len(ids) - 1) if mask[t]]
    assert data.token_counts.tolist() == np.bincount(labels, minlength=tiny.vocab_size).tolist()
    assert data.stats["streams"]["source"]["trained_tokens"] == len(labels)


def test_every_file_form_gives_the_same_rows(tiny, source):
    tmp, rows, path = source
    array = tmp / "chat.json"  # one pretty-printed JSON array: elements span lines
    array.write_text(json.dumps(rows, indent=2))
    parquet = write_rows(tmp / "chat.parquet", rows)
    common = dict(num_eval=4, max_len=96, regenerate=False, progress=False)
    got = [
        prepare_data(tiny, source=str(p), cache_dir=str(tmp / "c2"), **common)
        for p in (path, array, parquet)
    ]
    assert [prepared_rows(d) for d in got] == [prepared_rows(got[0])] * 3
    # The array's rows are named by the line their element starts on.
    starts = [n + 1 for n, line in enumerate(array.read_text().split("\n")) if line == "  {"]
    assert [line for line, _ in json_records(array)] == starts and len(starts) == 60


def test_second_preparation_reads_the_cache_and_resumes_missing_shards(tiny, source, monkeypatch):
    tmp, rows, path = source
    monkeypatch.setattr(local_source, "SHARD_ROWS", 8)  # 60 rows: 8 shards
    common = dict(source=str(path), num_eval=4, max_len=96, regenerate=False, progress=False,
                  cache_dir=str(tmp / "c3"), num_proc=1)  # fmt: skip
    first = prepare_data(tiny, **common)
    written = []
    real = local_source.tokenize_shard
    monkeypatch.setattr(local_source, "tokenize_shard", lambda job: written.append(job[1]) or real(job))  # fmt: skip
    assert prepared_rows(prepare_data(tiny, **common)) == prepared_rows(first)
    assert written == []  # warm: nothing tokenized again
    shards = sorted((tmp / "c3" / "data" / "tokenized").glob("*/rows-*.arrow"))
    assert len(shards) == 8
    shards[5].unlink()  # as if the preparation had stopped before this shard
    assert prepared_rows(prepare_data(tiny, **common)) == prepared_rows(first)
    assert written == [str(shards[5])]
    prepare_data(tiny, **{**common, "max_len": 64})  # other settings: another key, all shards
    assert len(written) == 1 + 8


def test_two_processes_give_the_rows_of_one(tiny, source, monkeypatch):
    tmp, rows, path = source
    monkeypatch.setattr(local_source, "SHARD_ROWS", 16)
    common = dict(source=str(path), num_eval=4, max_len=96, regenerate=False, progress=False)
    one = prepare_data(tiny, **common, num_proc=1, cache_dir=str(tmp / "p1"))
    two = prepare_data(tiny, **common, num_proc=2, cache_dir=str(tmp / "p2"))
    assert prepared_rows(two) == prepared_rows(one)


RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
import train.data.local_source as ls
from models.target_loaders import build_tiny_random
from train.data.prepare import prepare_data
from train.parallel.ranks import Ranks

dist.init_process_group("gloo")
ls.SHARD_ROWS = 8
written, real = [], ls.tokenize_shard
ls.tokenize_shard = lambda job: written.append(int(job[1][-11:-6])) or real(job)
data = prepare_data(build_tiny_random(seed=0, device="cpu"), source=sys.argv[1], num_eval=4,
                    max_len=96, regenerate=False, progress=False, cache_dir=sys.argv[2],
                    num_proc=1, ranks=Ranks.current())
out = {"written": written, "groups": list(data.train["group"]), "ids": list(data.train["input_ids"])}
open(sys.argv[3] + f".{dist.get_rank()}", "w").write(json.dumps(out))
dist.barrier()  # no rank tears gloo down while another still uses it
dist.destroy_process_group()
"""


def test_two_ranks_split_the_tokenization(tiny, source):
    tmp, rows, path = source
    script = tmp / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(path), str(tmp / "r2"), str(tmp / "out")]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp / f"out.{r}").read_text()) for r in range(2)]
    assert sorted(ranks[0]["written"]) == [0, 2, 4, 6] and sorted(ranks[1]["written"]) == [1, 3, 5, 7]  # fmt: skip
    data = prepare_data(tiny, source=str(path), num_eval=4, max_len=96, regenerate=False,
                        progress=False, cache_dir=str(tmp / "r1"))  # fmt: skip
    for r in ranks:
        assert (r["groups"], r["ids"]) == (list(data.train["group"]), list(data.train["input_ids"]))


def test_a_damaged_row_is_named_by_its_line_and_skipped_or_refused(tiny, tmp_path):
    rows = [json.dumps(r) for r in conversations(30)]
    rows[17] = rows[17][:40]  # cut off mid-row
    rows[22] = json.dumps({"conversations": [{"from": "robot", "value": "hi"}]})
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(rows) + "\n")
    data = prepare_data(tiny, source=str(path), num_eval=2, regenerate=False, progress=False,
                        cache_dir=str(tmp_path / "c"))  # fmt: skip
    assert data.stats["bad_rows"] == 2 and data.stats["source_rows"] == 30
    assert data.stats["bad_rows_first"][0].startswith("line 18: not JSON")
    assert data.stats["bad_rows_first"][1].startswith("line 23: ") and "robot" in data.stats["bad_rows_first"][1]  # fmt: skip
    assert not {"row:17", "row:22"} & set(data.train["group"])  # rows 17, 22: lines 18, 23
    for cache in ("c", "c2"):  # refused, whether read before (with skip) or not
        with pytest.raises(ValueError, match=r"line 18: not JSON"):
            prepare_data(tiny, source=str(path), num_eval=2, regenerate=False, progress=False,
                         cache_dir=str(tmp_path / cache), bad_rows="refuse")  # fmt: skip
    assert not list((tmp_path / "c2").rglob("*.arrow"))  # nothing half-written


def test_a_broken_row_at_90000_of_100000_is_skipped(tmp_path):
    """Read alone (tokenizing 10^5 rows is the benchmark's work): the row is named, the
    other 99 999 are kept, in order."""
    path = tmp_path / "big.jsonl"
    row = '{"messages": [{"role": "user", "content": "q%d"}, {"role": "assistant", "content": "a"}]}\n'  # fmt: skip
    with path.open("w") as f:
        for i in range(100_000):
            f.write('{"messages": [{"role": "user", "con\n' if i == 89_999 else row % i)
    convs, info, _ = read_source(str(path), "train", "skip", tmp_path / "c", Ranks(), False)
    assert (len(convs), info["bad_rows"]) == (99_999, 1)
    assert info["bad_rows_first"][0].startswith("line 90000: not JSON")
    assert (convs[89_999]["index"], convs[89_999]["where"]) == (90_000, 90_001)
    assert convs[89_999]["user_hashes"] == [text_hash("q90000")]


def test_a_damaged_json_array_is_refused_at_its_line(tiny, tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n{"messages": []},\n{"messages": [}\n]\n')
    with pytest.raises(ValueError, match=r"line 3: not JSON .* cannot be skipped"):
        list(json_records(path))


def test_two_runs_reading_one_file_on_one_cache_keep_one_whole_copy(source, tmp_path, monkeypatch):
    """Stage 1 of two runs at once (here: the second runs whole while the first is between
    two rows): each writes its own directory; the first to finish is renamed into place and
    the other drops its copy; what a killed writer of this host left is removed."""
    _, rows, path = source
    out = tmp_path / "sources" / "key"
    out.parent.mkdir()
    dead = out.with_name(f"{out.name}.tmp-{local_source.socket.gethostname()}-999999999-x")
    dead.mkdir()  # no process has that pid
    real, calls = local_source.conversation, []

    def between(row, src):
        calls.append(1)
        if len(calls) == 5:  # the other run, start to finish
            monkeypatch.setattr(local_source, "conversation", real)
            local_source.write_conversations(str(path), "train", "skip", out, False)
        return real(row, src)

    monkeypatch.setattr(local_source, "conversation", between)
    local_source.write_conversations(str(path), "train", "skip", out, False)
    assert json.loads((out / "info.json").read_text())["rows"] == len(rows)
    assert sorted(p.name for p in out.parent.iterdir()) == ["key"]  # no copy, no leftover


def test_pick_rows_counts_the_unusable_rows_it_read_past_and_no_others():
    # order position: 0 ok, 1 no-assistant, 2 ok, 3 mismatch, 4 ok, 5 no-assistant, 6 ok (trunc.)
    status = [OK, NO_ASSISTANT, OK, TEMPLATE_MISMATCH, OK, NO_ASSISTANT, OK]
    rows = datasets.Dataset.from_dict({
        "x": list(range(7)), "stream": ["source"] * 7, "status": status,
        "truncated": [False] * 6 + [True],
    })  # fmt: skip

    def counts(num_train, num_reference):
        stats = {name: 0 for name in [*STATUS_STATS.values(), "truncated"]}
        parts, main = pick_rows(rows, list(range(7)), num_train, num_reference, stats)
        return list(main), [len(p) for p in parts], stats

    main, sizes, stats = counts(2, 0)  # rows 0 and 2: read up to position 2
    assert main == [0, 2] and sizes == [2]
    assert (stats["skipped_no_assistant"], stats["skipped_template_mismatch"]) == (1, 0)
    _, sizes, stats = counts(2, 1)  # the reference row is 4: past the mismatch at 3
    assert sizes == [2, 1] and (stats["skipped_no_assistant"], stats["skipped_template_mismatch"]) == (1, 1)  # fmt: skip
    assert stats["truncated"] == 0
    for num_train in (None, 9):  # everything read: every unusable row counted, the truncated too
        _, _, stats = counts(num_train, 0)
        assert (stats["skipped_no_assistant"], stats["skipped_template_mismatch"], stats["truncated"]) == (2, 1, 1)  # fmt: skip
    _, sizes, stats = counts(0, 0)
    assert sizes == [0] and sum(stats.values()) == 0


class FakeTokenizer:
    """What a cache key reads of a tokenizer: its serialized vocabulary and special tokens."""

    is_fast = True

    def __init__(self, vocab: str = "v1", eos: str = "<|im_end|>"):
        self.backend_tokenizer = type("Backend", (), {"to_str": lambda _: vocab})()
        self.special_tokens_map = {"eos_token": eos, "pad_token": "<pad>"}


KEY_INPUTS = ["stage1", "vocab", "special_tokens", "template", "end_tokens", "max_len", "format",
              "transformers"]  # fmt: skip
KEY_ARGS = {"conv_key": "rows-abc-r1", "tok": FakeTokenizer(), "template": "{{ m }}",
            "end_tokens": ["<|im_end|>"], "max_len": 512}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        {"conv_key": "rows-abd-r1"},  # another stage 1
        {"tok": FakeTokenizer(vocab="v2")},
        {"tok": FakeTokenizer(eos="</s>")},  # the template renders eos_token
        {"template": "{{ m }}!"},
        {"end_tokens": ["</s>"]},
        {"max_len": 256},
        "FORMAT",
        "transformers",
    ],
    ids=KEY_INPUTS,
)
def test_every_input_of_the_tokenized_rows_key_changes_it(change, monkeypatch):
    before = local_source.tokenized_key(**KEY_ARGS)
    assert local_source.tokenized_key(**KEY_ARGS) == before  # a key, not a nonce
    if change == "FORMAT":
        monkeypatch.setattr(local_source, "FORMAT", local_source.FORMAT + 1)
    elif change == "transformers":
        monkeypatch.setattr(local_source.transformers, "__version__", "0.0.0")
    else:
        monkeypatch.setitem(KEY_ARGS, *next(iter(change.items())))
    assert local_source.tokenized_key(**KEY_ARGS) != before


def test_the_source_key_follows_the_file_and_the_reader_version(tmp_path, monkeypatch):
    path = write_rows(tmp_path / "a.jsonl", conversations(3))
    before = local_source.source_key(str(path), "train")
    assert local_source.source_key(str(path), "train") == before
    monkeypatch.setattr(local_source, "READ_FORMAT", local_source.READ_FORMAT + 1)
    assert local_source.source_key(str(path), "train") != before
    monkeypatch.undo()
    path.write_text(path.read_text() + "\n")  # the same rows, one byte more
    assert local_source.source_key(str(path), "train") != before
