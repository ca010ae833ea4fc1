"""Regeneration through a serving engine: `data.regen_backend=openai`.

The prompts go to an OpenAI-compatible `/v1/chat/completions` endpoint (vLLM, SGLang and
llama.cpp all serve one) as chat messages, `data.regen_concurrency` requests in flight per
rank (train/data/openai_server.py: the pre-flight check, retries, refusals). Each answer's
text is re-tokenised through the target's own chat template (the prompt plus an assistant
turn holding the text, `train/data/chat.py: tokenize_conversation`), so its ids end with the
template's end-of-turn token when the server stopped by itself, exactly as the hf backend's
generated ids do; prepare_data builds the rows and loss masks from them the same way for both
backends.

Sharing and the cache are the hf backend's (train/data/regenerate.py): every rank of a run
sends its own share of the prompts left (one prompt per group, longest first, dealt round
the ranks) and appends each answer as it arrives to its own shard file of <root>/data/regen/
<key>/ (a crash loses only the requests in flight; a rerun, under any world size, sends only
the prompts no shard holds); then every rank reads every shard. The settings key has
`backend: openai`, the served model's name and the extra request fields in place of the
dtype, so an engine's answers are never mixed with the hf backend's. Sampled answers
(temperature > 0) send each prompt its own seed, data.seed plus the prompt's hash (the key its
answer is cached under), so the prompts draw independently, and a prompt's answer is the same
whichever rank sends it, in whatever order or data set.

A prompt the server refuses (an HTTP 4xx, e.g. a prompt beyond its context) is recorded with
the server's message in the rank's failures file (failures.jsonl, failures.rank<r>.jsonl) and
not sent again by a rerun (delete those files to resend); its answer is None, so prepare_data
keeps it out of the training rows; more than `max_failed_share` of the prompts refused fails
the run. The server is contacted only when prompts are left (a rerun over a full cache needs
none), and then first: an unreachable server, an unknown model name or too short a context
is refused before any request.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from tqdm.auto import tqdm

from models.target import Target
from train.data.chat import tokenize_conversation
from train.data.openai_server import Refused, chat_completion, check_server
from train.data.regenerate import (
    _read_shard,
    _sha,
    append_line,
    check_all_answered,
    default_cache_root,
    merged_stats,
    prompts_left,
    rank_share,
    read_answers,
    settings_key,
    shard_file,
    write_settings,
)
from train.parallel.ranks import Ranks

BACKENDS = ("hf", "openai")
# Summed over the ranks (train/data/regenerate.py: merged_stats).
COUNTS = ("generated", "new_tokens", "server_tokens", "prompt_tokens_differ", "retries", "refused")


def check_backend_settings(
    backend: str,
    url: str | None,
    model: str | None,
    concurrency: int,
    retries: int,
    timeout: float,
    request: dict | None,
    chat_template: str | None,
    max_failed_share: float = 0.01,
) -> None:
    """The data.regen_* settings of a backend, before the target loads (no network), and
    data.max_failed_share."""
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
    if not (isinstance(max_failed_share, int | float) and 0 <= max_failed_share <= 1):
        raise ValueError(
            f"data.max_failed_share must be a share of the prompts in [0, 1], got "
            f"{max_failed_share!r}; e.g. 0.01 lets 1% of the prompts be refused by the server"
        )
    if chat_template is not None:
        raise ValueError(
            f"data.chat_template={chat_template[:40]!r} with data.regen_backend=openai: the server "
            "renders chat prompts with the model's own template, so the answers would be to "
            "other prompts than the training rows hold; use data.chat_template=null (the "
            "tokenizer's own) or data.regen_backend=hf"
        )


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
# The cache: settings, seeds, refusals
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
    if temperature > 0:  # one seed per prompt (request_seed); not the caches of one seed for all
        settings["sampler"] = "seed+prompt-hash"
    return {**settings, "backend": "openai", "model": model, "request": request or {}}


def request_seed(seed: int, key: str) -> int:
    """The seed sent with a prompt's request: data.seed plus the prompt's hash (its cache
    key), below 2**31 so every engine takes it (llama.cpp reads a 32-bit seed)."""
    return (seed + int(key, 16)) % 2**31


def failure_file(shard_dir: Path, rank: int) -> Path:
    """The file rank `rank` records the prompts the server refused in."""
    return shard_dir / ("failures.jsonl" if rank == 0 else f"failures.rank{rank}.jsonl")


def read_failures(shard_dir: Path, answered: dict) -> dict[str, dict]:
    """The refusals of every rank's failures file, keyed by prompt hash, less the prompts
    that have an answer (sent again after their failures file was deleted)."""
    failed: dict[str, dict] = {}
    for path in sorted(shard_dir.glob("failures*.jsonl")):
        for key, row in _read_shard(path).items():
            if key not in answered:
                failed.setdefault(key, row)
    return failed


def check_failed_share(
    keys: list[str], failed: dict, max_failed_share: float, url: str, shard_dir: Path
) -> int:
    """The prompts of `keys` the server refused; refused when more than max_failed_share of
    them."""
    refused = [k for k in keys if k in failed]
    if len(refused) > max_failed_share * len(keys):
        first = "; ".join(f"{failed[k]['error']!r}" for k in dict.fromkeys(refused[:3]))
        raise ValueError(
            f"the server at {url} refused {len(refused)} of {len(keys)} prompts, more than "
            f"data.max_failed_share={max_failed_share} allows; the first: {first}. Fix what it "
            f"says (e.g. a longer context) and delete {shard_dir}/failures*.jsonl to send them "
            "again, or raise data.max_failed_share to train without them"
        )
    return len(refused)


# ---------------------------------------------------------------------------------
# The backend
# ---------------------------------------------------------------------------------


def send_share(
    target: Target, prompts: list[list[int]], messages: list[list[dict]], keys: list[str],
    share: list[int], fields: dict, seeds: dict[int, int], out: Path, refusals: Path, *,
    url: str, concurrency: int, retries: int, timeout: float, backoff_s: float,
    max_new_tokens: int, chat_template: str | None, refusals_allowed: float, stats: dict,
    progress: bool,
) -> None:  # fmt: skip
    """Send the prompts `share` (indices) with `concurrency` requests in flight, appending each
    answer to `out` and each refusal to `refusals` as it arrives; counts into `stats`. Stops
    sending once this rank's refusals pass `refusals_allowed` (the run is refused anyway)."""

    def body(i: int) -> dict:
        return {**fields, "messages": messages[i], **({"seed": seeds[i]} if i in seeds else {})}

    bar = tqdm(total=len(share), desc="regenerate (openai)", unit="prompt", disable=not progress)
    t0 = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    left, pending = iter(share), {}
    try:
        with out.open("a") as answers, refusals.open("a") as failures:
            while True:
                # A bounded window of requests (not all of them at once: 10^6 futures), kept
                # full; no new request once the run is sure to be refused.
                while len(pending) < 2 * concurrency and stats["refused"] <= refusals_allowed:
                    i = next(left, None)
                    if i is None:
                        break
                    pending[pool.submit(chat_completion, url, body(i), retries, timeout,
                                        backoff_s)] = i  # fmt: skip
                if not pending:
                    break
                # FIRST_COMPLETED: each answer reaches the file (and the bar) as it arrives.
                # One answer a turn, the earliest sent first, the window refilled between: what
                # is sent next follows from the answers so far, not from how many of them
                # arrived together (two refusals handled at once sent one request fewer).
                finished_now, _ = wait(pending, return_when=FIRST_COMPLETED)
                future = next(f for f in pending if f in finished_now)
                i = pending.pop(future)
                err = future.exception()
                if isinstance(err, Refused):  # this prompt's fault: recorded, not retried
                    row = {"prompt": keys[i], "status": err.status, "error": err.message}
                    append_line(failures, json.dumps(row) + "\n", refusals)
                    stats["refused"] += 1
                elif err is not None:  # failed for good (after its retries)
                    raise err
                else:
                    answer, tries = future.result()
                    choice = answer["choices"][0]
                    text = choice["message"].get("content") or ""
                    ids, stopped = answer_ids(
                        target, messages[i], prompts[i], text,
                        choice.get("finish_reason") == "stop", max_new_tokens, chat_template,
                    )  # fmt: skip
                    row = {"prompt": keys[i], "ids": ids, "finished": stopped, "text": text}
                    # One line per answer: a crash loses only the requests in flight.
                    append_line(answers, json.dumps(row) + "\n", out)
                    usage = answer.get("usage") or {}
                    stats["server_tokens"] += usage.get("completion_tokens") or 0
                    if usage.get("prompt_tokens") not in (None, len(prompts[i])):
                        stats["prompt_tokens_differ"] += 1
                    stats["retries"] += tries
                    stats["generated"] += 1
                    stats["new_tokens"] += len(ids)
                bar.update(1)
                elapsed = time.perf_counter() - t0
                bar.set_postfix(tok_s=f"{stats['new_tokens'] / elapsed:.0f}")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # the requests in flight are lost
        bar.close()
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)


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
    max_failed_share: float = 0.01,
    progress: bool = True,
    backoff_s: float = 1.0,
    ranks: Ranks | None = None,
) -> tuple[list[dict | None], dict]:
    """Answer each prompt (`messages[i]`, whose rendering by the target's template is
    `prompts[i]`) through the server; the hf backend's return: one dict per prompt, in order
    (`ids`, `finished`, `text`), None for a prompt the server refused, and stats (`failed`:
    the prompts refused, `failed_examples`: the first messages). `chat_template`: the template
    `prompts` were rendered with (None = the tokenizer's). `ranks`: with several processes
    every rank calls this with the same prompts and sends its share (module doc)."""
    ranks = ranks or Ranks()
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
    keys = [_sha(p) for p in prompts]
    done = read_answers(shard_dir)
    failed = read_failures(shard_dir, done)
    cached_failed = check_failed_share(keys, failed, max_failed_share, url, shard_dir)
    todo = prompts_left(keys, [len(p) for p in prompts], done | failed)
    stats = {
        "backend": "openai", "model": model, "url": url, "prompts": len(prompts),
        "cached": len(prompts) - len(todo), "generated": 0, "new_tokens": 0,
        "server_tokens": 0,  # completion_tokens as the server counted them
        "prompt_tokens_differ": 0,  # the server's prompt was not ours, token for token
        "retries": 0, "refused": 0, "failed": cached_failed, "failed_examples": [],
        "context_length": None, "seconds": 0.0, "tokens_per_s": None,
        "cache": str(shard_file(shard_dir, 0)),
    }  # fmt: skip
    if todo:
        # Every rank checks the server, and all learn any rank's refusal: a rank that raised
        # alone would leave the others waiting at the next collective.
        longest, error = max(len(prompts[i]) for i in todo), None
        try:
            server = check_server(url, model, longest, max_new_tokens, min(timeout, 10.0))
            stats["context_length"] = server["context_length"]
        except ValueError as err:
            error = str(err)
        if errors := [e for e in ranks.gather(error) if e]:
            raise ValueError(errors[0])
        write_settings(shard_dir, settings, ranks)
        fields = {"model": model, "max_tokens": max_new_tokens, "temperature": temperature}
        fields |= {"top_p": top_p} if temperature > 0 else {}
        share = rank_share(todo, 1, ranks)
        seeds = {i: request_seed(seed, keys[i]) for i in share} if temperature > 0 else {}
        try:
            send_share(
                target, prompts, messages, keys, share, {**fields, **(request or {})}, seeds,
                shard_file(shard_dir, ranks.rank), failure_file(shard_dir, ranks.rank),
                url=url, concurrency=concurrency, retries=retries, timeout=timeout,
                backoff_s=backoff_s, max_new_tokens=max_new_tokens, chat_template=chat_template,
                refusals_allowed=max_failed_share * len(keys) - cached_failed, stats=stats,
                progress=progress and ranks.main,
            )  # fmt: skip
            error = None
        except Exception as err:  # noqa: BLE001 - every rank learns of it (below)
            if ranks.world == 1:
                raise
            error = f"rank {ranks.rank}: {err}"
        per_rank = ranks.gather((stats, error))  # waits for every rank's share
        if errors := [e for _, e in per_rank if e]:
            raise RuntimeError(errors[0])
        stats = merged_stats([s for s, _ in per_rank], COUNTS)
        done = read_answers(shard_dir)
        failed = read_failures(shard_dir, done)
        stats["failed"] = check_failed_share(keys, failed, max_failed_share, url, shard_dir)
    check_all_answered(keys, done | failed, shard_dir)
    refused = [k for k in dict.fromkeys(keys) if k in failed]
    stats["failed_examples"] = [failed[k]["error"] for k in refused[:3]]
    if stats["failed"] and progress and ranks.main:
        print(
            f"[draftlab] regeneration: the server refused {stats['failed']} of {len(keys)} "
            f"prompts (kept out of the training rows; data.max_failed_share={max_failed_share}"
            f"), e.g. {stats['failed_examples'][0]!r}",
            flush=True,
        )
    if stats["prompt_tokens_differ"] and ranks.main:
        print(
            f"[draftlab] regeneration: for {stats['prompt_tokens_differ']} of "
            f"{stats['generated']} prompts the server counted another number of prompt tokens "
            "than the target's template gives: it may render another template (or add a BOS); "
            "its answers are then to other prompts than the training rows hold",
            flush=True,
        )
    return [done.get(k) for k in keys], stats
