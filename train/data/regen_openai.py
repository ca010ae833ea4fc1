"""Regeneration through a serving engine: `data.regen_backend=openai`.

The prompts go to an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang and
llama.cpp all serve one) as chat messages, `data.regen_concurrency` requests in flight, each
retried with exponential backoff on a connection error, a timeout, HTTP 429 or 5xx. Each
answer's text is re-tokenised through the target's own chat template (the prompt plus an
assistant turn holding the text, `train/data/chat.py: tokenize_conversation`), so its ids
end with the template's end-of-turn token when the server stopped by itself, exactly as the
hf backend's generated ids do; prepare_data builds the rows and loss masks from them the
same way for both backends.

The cache is the hf backend's (`train/data/regenerate.py`: <root>/data/regen/<key>/
responses.jsonl, one line per answered prompt, keyed by the prompt's token ids), written one
line per finished answer (a crash loses only the requests in flight). Its settings key has
`backend: openai`, the served model's name and the extra request fields in place of the
dtype, so an engine's answers are never mixed with the hf backend's. The server is contacted
only when prompts are left to answer (a rerun over a full cache needs none), and then first
of all: an unreachable server or an unknown model name is refused before any request.

Only the standard library speaks HTTP (urllib): no client package is needed.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm.auto import tqdm

from models.target import Target
from train.data.chat import tokenize_conversation
from train.data.regenerate import (
    _ends_with_newline,
    _read_shard,
    _sha,
    default_cache_root,
    settings_key,
)
from train.run_files import write_atomic

BACKENDS = ("hf", "openai")
START_A_SERVER = (
    "start one that serves the target's weights, e.g. `python -m llama_cpp.server --model "
    "FILE.gguf --port 8000` (llama-cpp-python[server]), `vllm serve HF_ID --port 8000` or "
    "`python -m sglang.launch_server --model-path HF_ID --port 8000`, then set "
    "data.regen_url=http://HOST:PORT/v1 and data.regen_model=<its name>; or regenerate in "
    "this process with data.regen_backend=hf"
)
# Worth another try: the server is busy, restarting or overloaded. A 4xx is the request's fault.
RETRY_STATUS = (408, 429, 500, 502, 503, 504)


def check_backend_settings(
    backend: str,
    url: str | None,
    model: str | None,
    concurrency: int,
    retries: int,
    timeout: float,
    request: dict | None,
    chat_template: str | None,
) -> None:
    """The data.regen_* settings of a backend, before the target loads (no network)."""
    if backend not in BACKENDS:
        raise ValueError(f"data.regen_backend must be one of {list(BACKENDS)}, got {backend!r}")
    if backend != "openai":
        return
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(
            f"data.regen_url must be the server's base URL, http(s)://HOST:PORT/v1, got {url!r}"
        )
    if not model:
        raise ValueError(
            "data.regen_backend=openai needs data.regen_model=NAME, the model the server "
            f"serves (GET {url.rstrip('/')}/models lists them); it keys the cache"
        )
    if not (isinstance(concurrency, int) and concurrency >= 1):
        raise ValueError(f"data.regen_concurrency must be an integer >= 1, got {concurrency!r}")
    if not (isinstance(retries, int) and retries >= 0):
        raise ValueError(f"data.regen_retries must be an integer >= 0, got {retries!r}")
    if not (isinstance(timeout, int | float) and timeout > 0):
        raise ValueError(f"data.regen_timeout must be a number of seconds > 0, got {timeout!r}")
    if request is not None and not isinstance(request, dict):
        raise ValueError(f"data.regen_request must be a mapping of request fields, got {request!r}")
    if chat_template is not None:
        raise ValueError(
            f"data.chat_template={chat_template[:40]!r} with data.regen_backend=openai: the server "
            "renders chat prompts with the model's own template, so the answers would be to "
            "other prompts than the training rows hold; use data.chat_template=null (the "
            "tokenizer's own) or data.regen_backend=hf"
        )


# ---------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------


def _call(url: str, body: dict | None, timeout: float) -> dict:
    """GET (body None) or POST a JSON body; the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _reason(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        try:
            detail = err.read().decode(errors="replace")[:300]
        except OSError:
            detail = ""
        return f"HTTP {err.code} {err.reason}: {detail}".rstrip(": ")
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return f"{type(err).__name__}: {err}"


def _retryable(err: Exception) -> bool:
    if isinstance(err, urllib.error.HTTPError):
        return err.code in RETRY_STATUS
    transient = (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException)
    return isinstance(err, transient)


def check_server(url: str, model: str, timeout: float = 10.0) -> list[str]:
    """The models served at `url` (GET /models); refuse an unreachable server or `model`
    missing from the list."""
    base = url.rstrip("/")
    try:
        served = [m["id"] for m in _call(f"{base}/models", None, timeout)["data"]]
    except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
        hint = ""
        if isinstance(err, urllib.error.HTTPError) and err.code == 404 and not base.endswith("/v1"):
            hint = f" (the base URL usually ends in /v1: data.regen_url={base}/v1?)"
        raise ValueError(
            f"data.regen_url={url}: no OpenAI-compatible server answers there "
            f"({_reason(err)}){hint}; {START_A_SERVER}"
        ) from None
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"data.regen_url={url}: GET {base}/models did not answer an OpenAI model list "
            f"({type(err).__name__}: {err}); is it an OpenAI-compatible server?"
        ) from None
    if model not in served:
        raise ValueError(
            f"data.regen_model={model!r} is not served at {url}; it serves {served}: set "
            "data.regen_model to the one that holds the target's weights"
        )
    return served


def chat_completion(
    url: str, body: dict, retries: int, timeout: float, backoff_s: float = 1.0
) -> tuple[dict, int]:
    """POST one chat request, retried `retries` times (waits backoff_s, 2x, 4x ... capped at
    30 s) on errors worth another try; the answer and the retries it took."""
    for attempt in range(retries + 1):
        try:
            return _call(f"{url.rstrip('/')}/chat/completions", body, timeout), attempt
        except Exception as err:  # noqa: BLE001 - sorted below: retried or refused
            if not _retryable(err):
                raise RuntimeError(
                    f"{url}: the server refused a chat request ({_reason(err)}); model "
                    f"{body['model']!r}, {len(json.dumps(body['messages']))} characters of "
                    "messages"
                ) from None
            if attempt == retries:
                raise RuntimeError(
                    f"{url}: a chat request failed {retries + 1} times ({_reason(err)}); raise "
                    "data.regen_retries or data.regen_timeout, or lower data.regen_concurrency; "
                    "a rerun resumes from the answers cached so far"
                ) from None
            time.sleep(min(30.0, backoff_s * 2**attempt))
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------
# Re-tokenising an answer
# ---------------------------------------------------------------------------------


def answer_ids(
    target: Target,
    messages: list[dict],
    prompt_ids: list[int],
    text: str,
    finished: bool,
    max_new_tokens: int,
    chat_template: str | None,
) -> tuple[list[int], bool]:
    """The answer's token ids as the target's own template renders `text` after the prompt:
    its content and end-of-turn token (dropped when the server stopped at the length limit),
    at most max_new_tokens of them; and whether they end the turn. Where the rendered prompt
    is not a prefix of the rendered conversation (a BPE merge across the boundary), the text
    is tokenised alone and the target's EOS appended when finished."""
    tok = target.tokenizer
    end_tokens = tok.convert_ids_to_tokens(target.eos_token_ids)
    turn = messages + [{"role": "assistant", "content": text}]
    try:
        ids, flags = tokenize_conversation(tok, turn, False, end_tokens, chat_template)
    except ValueError:
        ids, flags = [], []
    n = len(prompt_ids)
    if ids[:n] == prompt_ids and any(flags[n:]):
        start = n + flags[n:].index(1)
        answer = ids[start : start + sum(flags[n:])]
        if not finished and answer and answer[-1] in target.eos_token_ids:
            answer = answer[:-1]
    else:
        answer = tok(text, add_special_tokens=False)["input_ids"]
        answer += [target.eos_token_ids[0]] if finished else []
    answer = answer[:max_new_tokens]
    return answer, bool(answer) and answer[-1] in target.eos_token_ids


# ---------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------


def openai_settings(
    target: Target,
    model: str,
    request: dict | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    chat_template: str | None,
) -> dict:
    """The cache key's settings: the hf backend's, the dtype (the server's business) replaced
    by the backend, the served model's name and the extra request fields."""
    settings = settings_key(target, max_new_tokens, temperature, top_p, seed, chat_template)
    settings.pop("dtype")
    return {**settings, "backend": "openai", "model": model, "request": request or {}}


def regenerate_openai(
    target: Target,
    prompts: list[list[int]],
    messages: list[list[dict]],
    *,
    url: str,
    model: str,
    concurrency: int = 8,
    retries: int = 3,
    timeout: float = 600.0,
    request: dict | None = None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    chat_template: str | None = None,
    progress: bool = True,
    backoff_s: float = 1.0,
) -> tuple[list[dict], dict]:
    """Answer each prompt (`messages[i]`, whose rendering by the target's template is
    `prompts[i]`) through the server; the hf backend's return: one dict per prompt, in order
    (`ids`, `finished`, `text`), and stats. `chat_template`: the template `prompts` were
    rendered with (None = the tokenizer's)."""
    if len(prompts) != len(messages):
        raise ValueError(f"{len(prompts)} prompts but {len(messages)} message lists")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    settings = openai_settings(
        target, model, request, max_new_tokens, temperature, top_p, seed, chat_template
    )
    root = Path(cache_dir) if cache_dir else default_cache_root()
    shard_dir = root / "data" / "regen" / _sha(settings)
    shard = shard_dir / "responses.jsonl"
    keys = [_sha(p) for p in prompts]
    done = _read_shard(shard)
    todo = sorted(
        {k: i for i, k in enumerate(keys) if k not in done}.values(), key=lambda i: -len(prompts[i])
    )  # the longest first: no long request left alone at the end
    stats = {
        "backend": "openai",
        "model": model,
        "url": url,
        "prompts": len(prompts),
        "cached": len(prompts) - len(todo),
        "generated": 0,
        "new_tokens": 0,
        "server_tokens": 0,  # completion_tokens as the server counted them
        "prompt_tokens_differ": 0,  # the server's prompt was not ours, token for token
        "retries": 0,
        "seconds": 0.0,
        "tokens_per_s": None,
        "cache": str(shard),
    }
    if not todo:
        return [done[k] for k in keys], stats
    check_server(url, model, min(timeout, 10.0))  # before any request
    shard_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(shard_dir / "settings.json", json.dumps(settings, indent=1))
    sampling = {"temperature": temperature}
    if temperature > 0:
        sampling |= {"top_p": top_p, "seed": seed}

    def body(i: int) -> dict:
        return {
            "model": model,
            "messages": messages[i],
            "max_tokens": max_new_tokens,
            **sampling,
            **(request or {}),
        }

    bar = tqdm(total=len(todo), desc="regenerate (openai)", unit="prompt", disable=not progress)
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        with shard.open("a") as out:
            if not _ends_with_newline(shard):  # a crash left a partial last line: end it
                out.write("\n")
            pending = {
                pool.submit(chat_completion, url, body(i), retries, timeout, backoff_s): i
                for i in todo
            }
            while pending:
                # FIRST_COMPLETED, not FIRST_EXCEPTION: the latter waits for every request
                # unless one fails, so no answer reached the file (or the bar) before the last.
                finished_now, _ = wait(pending, return_when=FIRST_COMPLETED)
                failed = [f for f in finished_now if f.exception() is not None]
                for future in finished_now:  # the answers first, then the failure
                    i = pending.pop(future)
                    if future in failed:
                        continue
                    answer, tries = future.result()
                    choice = answer["choices"][0]
                    text = choice["message"].get("content") or ""
                    ids, stopped = answer_ids(
                        target, messages[i], prompts[i], text,
                        choice.get("finish_reason") == "stop", max_new_tokens, chat_template,
                    )  # fmt: skip
                    row = {"prompt": keys[i], "ids": ids, "finished": stopped, "text": text}
                    done[keys[i]] = row
                    out.write(json.dumps(row) + "\n")  # one line per answer: a crash loses
                    out.flush()  # only the requests in flight
                    usage = answer.get("usage") or {}
                    stats["server_tokens"] += usage.get("completion_tokens") or 0
                    if usage.get("prompt_tokens") not in (None, len(prompts[i])):
                        stats["prompt_tokens_differ"] += 1
                    stats["retries"] += tries
                    stats["generated"] += 1
                    stats["new_tokens"] += len(ids)
                    bar.update(1)
                bar.set_postfix(tok_s=f"{stats['new_tokens'] / (time.perf_counter() - t0):.0f}")
                if failed:  # a request that failed for good (after its retries)
                    raise failed[0].exception()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # the requests in flight are lost
        bar.close()
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)
    if stats["prompt_tokens_differ"]:
        print(
            f"[draftlab] regeneration: for {stats['prompt_tokens_differ']} of "
            f"{stats['generated']} prompts the server counted another number of prompt tokens "
            "than the target's template gives: it may render another template (or add a BOS); "
            "its answers are then to other prompts than the training rows hold",
            flush=True,
        )
    return [done[k] for k in keys], stats
