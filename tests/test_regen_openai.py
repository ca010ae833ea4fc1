"""Regeneration through an OpenAI-compatible server (train/data/regen_openai.py).

Without a server: the settings refused before the target loads, an unreachable server
refused before any request (a real closed port), a full cache read with no server at all,
answers re-tokenised through the target's template. Against a fake server in a thread:
tests/test_regen_server.py. With a real llama.cpp server (the
`slow` test, skipped unless DRAFTLAB_LLAMA_PYTHON names a python with
`llama-cpp-python[server]`, docs/scaling.md): rows and masks built as the hf backend builds
them, a partial cache resumed (only the rest is requested), an unknown model refused, and
the greedy agreement with the hf backend reported."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import train.loop
from tests.helpers import ROOT, compose_debug, write_rows
from train.data.chat import tokenize_conversation
from train.data.prepare import prepare_data
from train.data.regen_openai import (
    answer_ids,
    check_backend_settings,
    openai_settings,
    regenerate_openai,
)
from train.data.regenerate import _sha, settings_key
from train.run.settings import check_settings

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Name three colours.",
    "Say hello.",
    "What is 2 + 2?",
]


def closed_port() -> int:
    """A port nothing listens on: bound by the OS, then released (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def chats(questions: list[str]) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
        for q in questions
    ]


def openai_data(url: str, model: str = "smollm2", **kw) -> dict:
    return {
        "regen_backend": "openai", "regen_url": url, "regen_model": model,
        "regen_concurrency": 2, "regen_retries": 1, "regen_timeout": 120,
        "regen_request": {"repeat_penalty": 1.0, "repetition_penalty": 1.0}, **kw,
    }  # fmt: skip


# -- without a server ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.regen_backend=vllm", "data.regen_backend must be one of ['hf', 'openai']"),
        ("data.regen_backend=openai", "needs data.regen_model=NAME"),
        ("data.regen_url=localhost:8000", "data.regen_url must be the server's base URL"),
        ("data.regen_concurrency=0", "data.regen_concurrency must be an integer >= 1"),
        ("data.regen_timeout=0", "data.regen_timeout must be a number of seconds > 0"),
        ("data.chat_template=chatml", "the server renders chat prompts with the model's own"),
    ],
)
def test_backend_settings_refused_before_the_target_loads(tmp_path, monkeypatch, override, message):
    def no_loading(*args, **kwargs):
        raise AssertionError("the target was loaded before the settings were checked")

    monkeypatch.setattr(train.loop, "load_target", no_loading)
    openai = [] if "regen_backend" in override else ["data.regen_backend=openai", "data.regen_model=m"]  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        train.loop.run(compose_debug(tmp_path / "run", override, *openai))
    assert not (tmp_path / "run").exists()
    # The hf backend ignores the server settings; no regeneration ignores the backend.
    if "regen_backend" not in override and "chat_template" not in override:
        check_settings(compose_debug(tmp_path, override))
    check_settings(compose_debug(tmp_path, "data.regenerate=false", override, *openai))


def test_unreachable_server_is_refused_before_any_request(tiny_target, tmp_path):
    port = closed_port()
    src = write_rows(tmp_path / "chats.jsonl", chats(QUESTIONS[:3]))
    with pytest.raises(ValueError) as err:
        prepare_data(
            tiny_target, source=str(src), num_eval=0, max_new_tokens=8, cache_dir=str(tmp_path),
            progress=False, **openai_data(f"http://127.0.0.1:{port}/v1"),
        )  # fmt: skip
    text = str(err.value)
    assert f"data.regen_url=http://127.0.0.1:{port}/v1: no OpenAI-compatible server" in text
    assert "Connection refused" in text and "python -m llama_cpp.server" in text
    assert not (tmp_path / "data" / "regen").exists()  # nothing written


def test_full_cache_needs_no_server_and_is_apart_from_the_hf_cache(tiny_target, tmp_path):
    prompts = [[1, 5, 9, 14], [2, 6, 10, 3, 7]]
    messages = [[{"role": "user", "content": q}] for q in ("a", "b")]
    settings = openai_settings(tiny_target, "m", None, 6, 0.0, 1.0, 0, None)
    hf = settings_key(tiny_target, 6, 0.0, 1.0, 0, None, "float32")
    assert _sha(settings) != _sha(hf) and settings["backend"] == "openai"
    assert "backend" not in hf  # the hf key, and so every hf cache, is as it was
    shard = tmp_path / "data" / "regen" / _sha(settings) / "responses.jsonl"
    shard.parent.mkdir(parents=True)
    rows = [{"prompt": _sha(p), "ids": [3, 4], "finished": False, "text": "hi"} for p in prompts]
    shard.write_text("".join(json.dumps(r) + "\n" for r in rows))
    url = f"http://127.0.0.1:{closed_port()}/v1"
    kw = {"url": url, "model": "m", "max_new_tokens": 6, "cache_dir": tmp_path, "progress": False}
    answers, stats = regenerate_openai(tiny_target, prompts, messages, **kw)
    assert answers == rows and (stats["cached"], stats["generated"]) == (2, 0)
    with pytest.raises(ValueError, match="no OpenAI-compatible server"):  # one prompt left
        regenerate_openai(tiny_target, prompts + [[7, 7]], messages + [[]], **kw)


def test_answers_are_retokenised_through_the_targets_template(tiny_target):
    tok = tiny_target.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))
    end = tiny_target.eos_token_ids
    whole = tokenize_conversation(
        tok, msgs + [{"role": "assistant", "content": "ok then"}], False,
        tok.convert_ids_to_tokens(end),
    )[0]  # fmt: skip
    ids, finished = answer_ids(tiny_target, msgs, prompt, "ok then", True, 50, None)
    assert finished and ids[-1] in end and prompt + ids == whole[: len(prompt) + len(ids)]
    assert tok.decode(ids[:-1]) == "ok then"
    cut, finished = answer_ids(tiny_target, msgs, prompt, "ok then", False, 50, None)
    assert cut == ids[:-1] and not finished  # stopped at the length limit: no end token
    assert answer_ids(tiny_target, msgs, prompt, "ok then", True, 3, None) == (ids[:3], False)


# -- against a real llama.cpp server --------------------------------------------------------

LLAMA_PYTHON = os.environ.get("DRAFTLAB_LLAMA_PYTHON")


@pytest.fixture(scope="module")
def llama_server():
    """llama-cpp-python's server over the embedded SmolLM2 GGUF, on a free port."""
    from models.target_loaders import smollm2_gguf_path

    port = closed_port()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"llama_server_{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [LLAMA_PYTHON, "-m", "llama_cpp.server", "--model", str(smollm2_gguf_path()),
         "--model_alias", "smollm2", "--host", "127.0.0.1", "--port", str(port),
         "--n_ctx", "2048", "--n_threads", str(os.cpu_count() or 1)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(240):
            if proc.poll() is not None:
                pytest.fail(f"the llama.cpp server exited ({proc.returncode}); see {log.name}")
            try:
                urllib.request.urlopen(f"{url}/models", timeout=2).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"the llama.cpp server did not answer in 120 s; see {log.name}")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@pytest.mark.slow
@pytest.mark.skipif(
    not (LLAMA_PYTHON and Path(LLAMA_PYTHON).is_file()),
    reason="no llama.cpp server: set DRAFTLAB_LLAMA_PYTHON to a python with "
    "llama-cpp-python[server] installed (docs/scaling.md)",
)
def test_llama_cpp_server_answers_like_the_hf_backend(llama_server, tmp_path):
    from models.target_loaders import load_smollm2

    target = load_smollm2(dtype="float32", device="cpu")
    src = write_rows(tmp_path / "chats.jsonl", chats(QUESTIONS))
    common = {"source": str(src), "num_eval": 0, "max_new_tokens": 24, "max_len": 256,
              "cache_dir": str(tmp_path), "progress": False}  # fmt: skip
    with pytest.raises(ValueError, match=r"data.regen_model='nope' is not served .*'smollm2'"):
        prepare_data(target, **common, **openai_data(llama_server, model="nope"))
    served = prepare_data(target, **common, **openai_data(llama_server))
    hf = prepare_data(target, **common, regen_dtype="float32", regen_batch_size=5)
    stats = served.stats["regen"]
    assert (stats["generated"], stats["backend"], stats["prompt_tokens_differ"]) == (5, "openai", 0)
    assert stats["server_tokens"] > 0
    exact, prefix = 0, []
    cache = [json.loads(x) for x in Path(stats["cache"]).read_text().splitlines()]
    tok, asked = target.tokenizer, {}
    for q in QUESTIONS:
        msgs = [{"role": "user", "content": q}]
        asked[tuple(tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False))] = q  # fmt: skip
    for s_row, h_row in zip(served.train, hf.train, strict=True):
        start = h_row["loss_mask"].index(1) + 1  # the first answer token
        q = asked[tuple(h_row["input_ids"][:start])]
        assert s_row["input_ids"][:start] == h_row["input_ids"][:start]  # the same prompt
        assert s_row["loss_mask"].index(1) + 1 == start
        answer = s_row["input_ids"][start:]
        assert answer and sum(s_row["loss_mask"]) == len(answer)  # every answer token trained
        # The row's answer is the server's text through the target's template.
        text = next(r["text"] for r in cache if r["ids"] == answer)
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": text}]
        whole = tokenize_conversation(tok, msgs, False, ["<|im_end|>"])[0]
        assert s_row["input_ids"] == whole[: len(s_row["input_ids"])]
        theirs = h_row["input_ids"][start:]
        exact += answer == theirs
        prefix.append(next((j for j, (a, b) in enumerate(zip(answer, theirs)) if a != b), min(len(answer), len(theirs))))  # fmt: skip
    print(
        f"\ngreedy agreement llama.cpp Q4_1 vs hf float32: {exact}/5 exact, common prefix {prefix}"
    )
    assert sum(prefix) > 0  # the same weights: their first tokens agree at least somewhere

    # Resume: drop two answers from the cache; only those two are requested again.
    path = Path(stats["cache"])
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-2]) + lines[-2][:10])  # and a line cut by a crash
    again = prepare_data(target, **common, **openai_data(llama_server))
    assert (again.stats["regen"]["cached"], again.stats["regen"]["generated"]) == (3, 2)
    assert list(again.train["input_ids"]) == list(served.train["input_ids"])  # greedy: the same

    # Two ranks: each sends its share and writes its own shard; both get the rows of one.
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS.format(url=llama_server, src=src, cache=tmp_path / "two"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        out = json.loads((tmp_path / "two" / f"rank{rank}.json").read_text())
        assert out["ids"] == list(served.train["input_ids"])
        assert sorted(out["by_rank"]) == [2, 3]  # 5 prompts: 3 and 2 requests


TWO_RANKS = """
import json, torch.distributed as dist
from pathlib import Path
from models.target_loaders import load_smollm2
from tests.test_regen_openai import openai_data
from train.data.prepare import prepare_data
from train.parallel.ranks import Ranks

dist.init_process_group("gloo")
data = prepare_data(load_smollm2(dtype="float32", device="cpu"), source="{src}", num_eval=0,
                    max_new_tokens=24, max_len=256, cache_dir="{cache}", progress=False,
                    ranks=Ranks.current(), **openai_data("{url}"))
out = {{"ids": list(data.train["input_ids"]), "by_rank": data.stats["regen"]["by_rank"]}}
Path("{cache}", f"rank{{dist.get_rank()}}.json").write_text(json.dumps(out))
dist.barrier()  # no rank tears gloo down while another still uses it
dist.destroy_process_group()
"""


def test_max_failed_share_is_a_share():
    args = ("openai", "http://127.0.0.1:8000/v1", "m", 8, 3, 600, None, None)
    check_backend_settings(*args, 0.0)
    with pytest.raises(ValueError, match=r"data.max_failed_share must be a share .* got 1.5"):
        check_backend_settings(*args, 1.5)
