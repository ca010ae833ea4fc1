"""Regeneration against a fake OpenAI-compatible server in a thread (train/data/regen_openai.py,
train/data/openai_server.py): each answer on disk as it arrives; the pre-flight check (model
list, vLLM's max_model_len, llama.cpp's /props n_ctx); refused prompts recorded with the
server's message, left out of the rows, not resent, and too many of them refusing the run;
one seed per prompt when sampling; two ranks each sending their share, and resuming."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ALL_COMPLETED, wait
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers import chat_ids, write_rows
from tests.test_ranks import ThreadRanks
from train.data import regen_openai
from train.data.prepare import prepare_data
from train.data.regen_openai import regenerate_openai, request_seed
from train.data.regenerate import _sha
from train.run.records import RunRecords, write_summary

QUESTIONS = ["What is 2 + 2?", "Name three colours.", "Say hello.", "Why?", "Count to three."]
TOO_LONG = "This model's maximum context length is 64 tokens. However, you requested 90 tokens."


class FakeServer(BaseHTTPRequestHandler):
    """GET /v1/models lists `models`; GET /props answers `props` (404 when None); a chat
    request is answered "re <question>", unless its question is in `refuse` (HTTP 400 with
    that message, as vLLM words it) or `fatal` (HTTP 404). `seen`: the chat bodies received."""

    models: list = [{"id": "m", "object": "model"}]
    props: dict | None = None
    refuse: dict = {}
    fatal: tuple = ()
    seen: list

    def log_message(self, *args) -> None:  # quiet
        pass

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self.reply(200, {"object": "list", "data": self.models})
        elif self.path == "/props" and self.props is not None:
            self.reply(200, self.props)
        else:
            self.reply(404, {"error": {"message": f"no {self.path}"}})

    def answer(self, body: dict) -> None:
        question = body["messages"][-1]["content"]
        if question in self.refuse:
            self.reply(400, {"object": "error", "message": self.refuse[question], "code": 400})
        elif question in self.fatal:
            self.reply(404, {"error": {"message": "The model `m` does not exist."}})
        else:
            choice = {"index": 0, "finish_reason": "stop",
                      "message": {"role": "assistant", "content": f"re {question}"}}  # fmt: skip
            self.reply(200, {"choices": [choice], "usage": {"completion_tokens": 3}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(body)
        self.answer(body)


@contextmanager
def fake_server(handler: type = FakeServer, **attrs):
    """The server's base URL and the list of chat bodies it receives."""
    seen: list = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (handler,), {"seen": seen, **attrs}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1", seen
    finally:
        server.shutdown()
        server.server_close()


def asked(seen: list) -> list[str]:
    return sorted(b["messages"][-1]["content"] for b in seen)


def prepare(target, tmp_path: Path, url: str, **kw):
    src = write_rows(tmp_path / "chats.jsonl", [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "x"}]}
        for q in QUESTIONS
    ])  # fmt: skip
    return prepare_data(
        target, source=str(src), num_eval=0, max_new_tokens=8, cache_dir=str(tmp_path),
        progress=False, regen_backend="openai", regen_url=url, regen_model="m",
        **{"regen_concurrency": 2, "regen_retries": 2, **kw},
    )  # fmt: skip


class AnswersOnDisk(FakeServer):
    """Answers "last" only once every other answer is on disk (else HTTP 400): a regeneration
    that holds finished answers back while a request is in flight fails against it."""

    cache: Path
    others: int

    def answer(self, body: dict) -> None:
        if body["messages"][-1]["content"] == "last":
            deadline = time.monotonic() + 10
            while sum(len(f.read_text().splitlines())
                      for f in self.cache.rglob("responses*.jsonl")) < self.others:  # fmt: skip
                if time.monotonic() > deadline:
                    self.reply(400, {"error": {"message": "the answers never reached disk"}})
                    return
                time.sleep(0.05)
        super().answer(body)


def test_each_answer_is_on_disk_as_it_arrives(tiny_target, tmp_path):
    questions = ["last", *QUESTIONS]  # "last" is sent first: in flight while the rest finish
    messages = [[{"role": "user", "content": q}] for q in questions]
    prompts = [chat_ids(tiny_target, q) for q in questions]
    with fake_server(AnswersOnDisk, cache=tmp_path, others=len(QUESTIONS)) as (url, _):
        answers, stats = regenerate_openai(
            tiny_target, prompts, messages, url=url, model="m", concurrency=2, retries=0,
            max_new_tokens=16, cache_dir=tmp_path, progress=False,
        )  # fmt: skip
    assert (stats["generated"], stats["failed"]) == (len(questions), 0)
    assert [a["text"] for a in answers] == [f"re {q}" for q in questions]


def test_the_server_is_checked_before_any_request(tiny_target, tmp_path):
    """Its model list, and its context where it reports one: vLLM / SGLang max_model_len in
    /v1/models, llama.cpp's per-slot n_ctx at /props; refused with what to change."""
    longest = max(len(chat_ids(tiny_target, q)) for q in QUESTIONS)
    short = [{"id": "m", "max_model_len": longest + 8 - 1}]
    with fake_server(models=short) as (url, seen), pytest.raises(ValueError) as err:
        prepare(tiny_target, tmp_path, url)
    assert f"context of {longest + 7} tokens (max_model_len in GET /models)" in str(err.value)
    assert f"({longest} tokens) plus data.max_new_tokens=8 needs {longest + 8}" in str(err.value)
    assert "--max-model-len" in str(err.value) and not seen
    llama = {"default_generation_settings": {"n_ctx": 16}}
    with fake_server(props=llama) as (url, seen), pytest.raises(ValueError, match="n_ctx in GET"):
        prepare(tiny_target, tmp_path, url)
    unknown = r"data.regen_model='m' is not served .*\['other'\]"
    with fake_server(models=[{"id": "other"}]) as (url, seen), pytest.raises(ValueError, match=unknown):  # fmt: skip
        prepare(tiny_target, tmp_path, url)
    assert not seen and not (tmp_path / "data" / "regen").exists()  # nothing sent, nothing written
    enough = [{"id": "m", "max_model_len": longest + 8}]
    with fake_server(models=enough) as (url, seen):
        data = prepare(tiny_target, tmp_path, url)
    assert data.stats["regen"]["context_length"] == longest + 8 and len(seen) == len(QUESTIONS)


def test_refused_prompts_are_recorded_skipped_and_not_resent(tiny_target, tmp_path):
    refuse = {QUESTIONS[1]: TOO_LONG}
    with fake_server(refuse=refuse) as (url, seen):
        data = prepare(tiny_target, tmp_path, url, max_failed_share=0.25)
    regen = data.stats["regen"]
    assert (regen["generated"], regen["failed"], regen["failed_examples"]) == (4, 1, [TOO_LONG])
    assert data.stats["skipped_regen_refused"] == 1 and len(data.train) == 4
    assert asked(seen).count(QUESTIONS[1]) == 1  # a 400 is not retried (regen_retries=2)
    (failure,) = [json.loads(x) for x in (Path(regen["cache"]).parent / "failures.jsonl").open()]
    assert failure == {"prompt": _sha(chat_ids(tiny_target, QUESTIONS[1])), "status": 400,
                       "error": TOO_LONG}  # fmt: skip
    summary = write_summary(None, tmp_path, {"data_stats": data.stats}, RunRecords())
    assert json.loads((tmp_path / "summary.json").read_text())["regen_failed"] == 1 == summary["regen_failed"]  # fmt: skip

    # A rerun sends nothing: the answers and the refusal are cached; the refusal still counts.
    with fake_server(refuse=refuse) as (url, seen):
        again = prepare(tiny_target, tmp_path, url, max_failed_share=0.25)
        assert not seen and again.stats["regen"]["failed"] == 1
        assert again.train["input_ids"] == data.train["input_ids"]
        with pytest.raises(ValueError) as err:  # under a lower share: refused, nothing sent
            prepare(tiny_target, tmp_path, url, max_failed_share=0.1)
    text = str(err.value)
    assert "refused 1 of 5 prompts, more than data.max_failed_share=0.1" in text
    assert TOO_LONG in text and "failures*.jsonl" in text and not seen
    # Deleting the failures file sends that prompt again; now the server answers it.
    for path in Path(regen["cache"]).parent.glob("failures*.jsonl"):
        path.unlink()
    with fake_server() as (url, seen):
        fixed = prepare(tiny_target, tmp_path, url, max_failed_share=0.0)
    assert asked(seen) == [QUESTIONS[1]] and len(fixed.train) == 5


@pytest.mark.parametrize("together", [False, True])
def test_too_many_refusals_stop_sending_and_refuse_the_run(tiny_target, tmp_path, monkeypatch, together):  # fmt: skip
    if together:  # the first two refusals reach the client at once (as a slow client sees them)
        monkeypatch.setattr(regen_openai, "wait", lambda fs, return_when: wait(fs, return_when=ALL_COMPLETED))  # fmt: skip
    refused = r"refused 3 of 5 prompts, more than data.max_failed_share=0.2"
    with fake_server(refuse={q: "no" for q in QUESTIONS}) as (url, seen), pytest.raises(ValueError, match=refused):  # fmt: skip
        prepare(tiny_target, tmp_path, url, max_failed_share=0.2, regen_concurrency=1)
    # Sure to be refused after the second refusal: only the request queued then was sent.
    assert len(seen) == 3
    fatal = "no request can succeed"  # a 404
    with fake_server(fatal=(QUESTIONS[0],)) as (url, seen), pytest.raises(RuntimeError, match=fatal):  # fmt: skip
        prepare(tiny_target, tmp_path / "other", url)


def test_sampled_requests_send_each_prompt_its_own_seed(tiny_target, tmp_path):
    prompts = [chat_ids(tiny_target, q) for q in QUESTIONS]
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    kw = {"model": "m", "max_new_tokens": 8, "progress": False, "seed": 3}
    with fake_server() as (url, seen):
        regenerate_openai(tiny_target, prompts, messages, url=url, temperature=0.7,
                          cache_dir=tmp_path / "a", **kw)  # fmt: skip
        regenerate_openai(tiny_target, prompts[::-1], messages[::-1], url=url, temperature=0.7,
                          cache_dir=tmp_path / "b", **kw)  # another order: the same seeds  # fmt: skip
        regenerate_openai(tiny_target, prompts, messages, url=url, cache_dir=tmp_path / "c", **kw)
    seeds = {b["messages"][-1]["content"]: b["seed"] for b in seen[:5]}
    assert seeds == {b["messages"][-1]["content"]: b["seed"] for b in seen[5:10]}
    assert seeds == {q: request_seed(3, _sha(p)) for q, p in zip(QUESTIONS, prompts, strict=True)}
    assert len(set(seeds.values())) == 5 and all(0 <= s < 2**31 for s in seeds.values())
    assert all("seed" not in b and b["temperature"] == 0.0 for b in seen[10:])  # greedy


def regenerate_on_two_ranks(target, prompts, messages, **kw) -> list:
    """regenerate_openai on two threads standing in for two ranks; each result or error."""
    barrier, slots, results = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int) -> None:
        try:
            ranks = ThreadRanks(r, 2, barrier, slots)
            results[r] = regenerate_openai(target, prompts, messages, ranks=ranks, **kw)
        except Exception as err:  # noqa: BLE001 - compared by the test
            results[r] = err

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_two_ranks_each_send_their_share_and_resume(tiny_target, tmp_path):
    questions = [*QUESTIONS, "One more."]
    prompts = [chat_ids(tiny_target, q) for q in questions]
    messages = [[{"role": "user", "content": q}] for q in questions]
    kw = {"model": "m", "max_new_tokens": 8, "progress": False, "max_failed_share": 0.2}
    refuse = {questions[2]: TOO_LONG}
    with fake_server(refuse=refuse) as (url, seen):
        alone, _ = regenerate_openai(tiny_target, prompts, messages, url=url,
                                     cache_dir=tmp_path / "one", **kw)  # fmt: skip
        seen.clear()
        (first, s0), (same, s1) = regenerate_on_two_ranks(
            tiny_target, prompts, messages, url=url, cache_dir=tmp_path, **kw
        )
    assert asked(seen) == sorted(questions)  # every prompt sent once, by one rank
    assert first == same == alone and first[2] is None  # the refused prompt: None on both
    assert s0 == s1 and sorted(s0["by_rank"]) == [2, 3]  # answers; the sixth prompt refused
    assert (s0["generated"], s0["failed"], s0["refused"]) == (5, 1, 1)
    (cache,) = (tmp_path / "data" / "regen").iterdir()
    lines = {f.name: f.read_text().splitlines() for f in cache.glob("*.jsonl")}
    assert sorted(lines) == ["failures.jsonl", "failures.rank1.jsonl", "responses.jsonl",
                             "responses.rank1.jsonl"]  # fmt: skip
    assert len(lines["responses.jsonl"]) + len(lines["failures.jsonl"]) == 3  # rank 0: 3 prompts
    # Rank 1 died writing its second answer: a rerun sends only that prompt.
    (cache / "responses.rank1.jsonl").write_text(lines["responses.rank1.jsonl"][0] + "\n"
                                                 + lines["responses.rank1.jsonl"][1][:15])  # fmt: skip
    with fake_server(refuse=refuse) as (url, seen):
        (again, s0), _ = regenerate_on_two_ranks(
            tiny_target, prompts, messages, url=url, cache_dir=tmp_path, **kw
        )
    assert again == alone and len(seen) == 1 and s0["by_rank"] == [1, 0]
    # One rank's fatal error reaches both ranks (neither waits for the other for ever).
    with fake_server(fatal=(questions[0],)) as (url, seen):
        errors = regenerate_on_two_ranks(tiny_target, prompts, messages, url=url,
                                         cache_dir=tmp_path / "fatal", **kw)  # fmt: skip
    assert all(isinstance(e, RuntimeError) and "no request can succeed" in str(e)
               for e in errors), errors  # fmt: skip
