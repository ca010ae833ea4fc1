"""Talking to an OpenAI-compatible server (vLLM, SGLang, llama.cpp) for
`data.regen_backend=openai` (train/data/regen_openai.py): the pre-flight check, one chat
request with its retries, and what the server's answers and errors mean.

Pre-flight (`check_server`), before the first request: the server answers at the URL, serves
the model by that name (GET /models), and has room for the longest prompt plus the answer
where it says how much room it has: vLLM and SGLang give `max_model_len` in each /models entry
(the prompt and the answer together); llama.cpp's own server (`llama-server`) gives its
per-slot context at GET /props, `default_generation_settings.n_ctx` (the `-c` context divided
among the `--parallel` slots). llama-cpp-python's server reports neither: its context is
then not checked, and a prompt too long for it is refused by it request by request.

Errors of a request: a connection error, a timeout, HTTP 408, 429 and 5xx are worth another
try (the server is busy, restarting or overloaded); HTTP 401, 403 and 404 mean no request to
that server can succeed (a key, a path, a model), so the regeneration stops; any other 4xx is
this request's own fault (vLLM, SGLang and llama.cpp answer 400 for a prompt beyond their
context), raised as `Refused` with the server's message for the caller to record and skip.

Only the standard library speaks HTTP (urllib): no client package is needed.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

START_A_SERVER = (
    "start one that serves the target's weights, e.g. `python -m llama_cpp.server --model "
    "FILE.gguf --port 8000` (llama-cpp-python[server]), `vllm serve HF_ID --port 8000` or "
    "`python -m sglang.launch_server --model-path HF_ID --port 8000`, then set "
    "data.regen_url=http://HOST:PORT/v1 and data.regen_model=<its name>; or regenerate in "
    "this process with data.regen_backend=hf"
)
RETRY_STATUS = (408, 429, 500, 502, 503, 504)  # worth another try
FATAL_STATUS = (401, 403, 404)  # no request to this server can succeed
LONGER_CONTEXT = (
    "start the server with a longer context (vLLM --max-model-len, SGLang --context-length, "
    "llama.cpp -c: its context is shared by its --parallel slots)"
)


class Refused(Exception):
    """The server refused this one request (HTTP 4xx, not 401/403/404/408/429): `message` is
    what it said; the prompt is recorded as failed, not retried."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message = status, message


def _call(url: str, body: dict | None, timeout: float) -> dict:
    """GET (body None) or POST a JSON body; the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def server_message(text: str) -> str:
    """The message in an error body: {"error": {"message"}} (OpenAI, llama.cpp, newer vLLM),
    {"message"} (SGLang, older vLLM), {"detail"} (FastAPI), else the text itself."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip()[:500]
    if isinstance(body, dict):
        error = body.get("error")
        for found in (
            error.get("message") if isinstance(error, dict) else error,
            body.get("message"),
            body.get("detail"),
        ):
            if isinstance(found, str) and found:
                return found[:500]
    return text.strip()[:500]


def _error_body(err: urllib.error.HTTPError) -> str:
    try:
        return server_message(err.read().decode(errors="replace"))
    except OSError:
        return ""


def _reason(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}: {_error_body(err)}".rstrip(": ")
    if isinstance(err, urllib.error.URLError):
        return str(err.reason)
    return f"{type(err).__name__}: {err}"


def _retryable(err: Exception) -> bool:
    if isinstance(err, urllib.error.HTTPError):
        return err.code in RETRY_STATUS
    transient = (urllib.error.URLError, TimeoutError, ConnectionError, http.client.HTTPException)
    return isinstance(err, transient)


def served_models(url: str, timeout: float) -> list[dict]:
    """The entries of GET <url>/models; refused clearly when no OpenAI server answers."""
    base = url.rstrip("/")
    try:
        entries = _call(f"{base}/models", None, timeout)["data"]
        if not all(isinstance(e, dict) and isinstance(e.get("id"), str) for e in entries):
            raise TypeError("entries without an id")
        return entries
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


def context_length(url: str, entry: dict, timeout: float) -> tuple[int | None, str]:
    """The tokens one request may hold (prompt and answer) as the server reports it, and
    where that was read; (None, why) when it does not say (module doc)."""
    if isinstance(entry.get("max_model_len"), int):  # vLLM, SGLang
        return entry["max_model_len"], "max_model_len in GET /models"
    props = url.rstrip("/").removesuffix("/v1") + "/props"  # llama-server: beside /v1
    try:
        n_ctx = _call(props, None, timeout)["default_generation_settings"]["n_ctx"]
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError, KeyError,
            TypeError):  # fmt: skip
        return None, "the server reports no context length (not checked)"
    if not isinstance(n_ctx, int) or n_ctx <= 0:
        return None, "the server reports no context length (not checked)"
    return n_ctx, "default_generation_settings.n_ctx in GET /props"


def check_server(
    url: str, model: str, longest_prompt: int, max_new_tokens: int, timeout: float = 10.0
) -> dict:
    """Refuse, before any request: no server at `url`, `model` not among the models it serves,
    or (where it reports one) a context shorter than `longest_prompt` + `max_new_tokens`
    tokens. Returns what was found: the served names, the context length and its source."""
    entries = served_models(url, timeout)
    served = [e["id"] for e in entries]
    if model not in served:
        raise ValueError(
            f"data.regen_model={model!r} is not served at {url}; it serves {served}: set "
            "data.regen_model to the one that holds the target's weights"
        )
    window, source = context_length(url, entries[served.index(model)], timeout)
    needed = longest_prompt + max_new_tokens
    if window is not None and window < needed:
        raise ValueError(
            f"{url} serves {model!r} with a context of {window} tokens ({source}), but the "
            f"longest prompt left to answer ({longest_prompt} tokens) plus "
            f"data.max_new_tokens={max_new_tokens} needs {needed}: {LONGER_CONTEXT}, or lower "
            "data.max_new_tokens, or data.max_len (prompts over data.max_len/2 are dropped)"
        )
    return {"served": served, "context_length": window, "context_source": source}


def chat_completion(
    url: str, body: dict, retries: int, timeout: float, backoff_s: float = 1.0
) -> tuple[dict, int]:
    """POST one chat request, retried `retries` times (waits backoff_s, 2x, 4x ... capped at
    30 s) on errors worth another try; the answer and the retries it took. Raises `Refused`
    for a request the server refuses, RuntimeError when no request can succeed."""
    for attempt in range(retries + 1):
        try:
            return _call(f"{url.rstrip('/')}/chat/completions", body, timeout), attempt
        except Exception as err:  # noqa: BLE001 - sorted below: retried, refused or fatal
            if (
                isinstance(err, urllib.error.HTTPError)
                and 400 <= err.code < 500
                and (err.code not in RETRY_STATUS + FATAL_STATUS)
            ):
                raise Refused(err.code, _error_body(err) or str(err.reason)) from None
            if not _retryable(err):
                raise RuntimeError(
                    f"{url}: the server refused a chat request ({_reason(err)}); model "
                    f"{body['model']!r}: no request can succeed, check data.regen_url and "
                    "data.regen_model"
                ) from None
            if attempt == retries:
                raise RuntimeError(
                    f"{url}: a chat request failed {retries + 1} times ({_reason(err)}); raise "
                    "data.regen_retries or data.regen_timeout, or lower data.regen_concurrency; "
                    "a rerun resumes from the answers cached so far"
                ) from None
            time.sleep(min(30.0, backoff_s * 2**attempt))
    raise AssertionError("unreachable")
