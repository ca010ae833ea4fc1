"""Answer training prompts with the target itself, cached on disk and resumable.

Training a draft on the target's own responses (instead of the dataset's) matches
what the draft sees at decode time: the field reports ~+10% τ from it.

Cache layout: <root>/data/regen/<settings-key>/responses.jsonl, one JSON line per
answered prompt, appended as each answer ends (train/data/answer_batch.py: a crash loses
only the answers in progress; a rerun skips every prompt already in the file). With several
processes (`ranks`, train/parallel/ranks.py) the prompts still missing are sorted and cut into batches
of `batch_size` as one process would, batch b goes to rank b mod world, and rank r appends
to its own shard file (rank 0: responses.jsonl, rank r > 0: responses.rank<r>.jsonl); every
rank then reads every shard file. Each prompt samples with its own generator (seeded by the
run's seed and the prompt), and the row order of the result is that of one process, so the
answers are the same (greedy and sampled); a restarted rank skips every prompt any shard
holds. The settings key hashes the target name, the
fingerprint of its weights (models/identity.py: weights re-saved under the same name or path
answer afresh), the chat template the prompts were rendered with (data.chat_template,
resolved) and the sampling settings; inside it each line is keyed by a hash of the
prompt's token ids, so a larger or reshuffled prompt set reuses every earlier answer.
A cache written before the fingerprint entered the key (`legacy_key`) is adopted once by the
first target of that name to ask for it, with a warning (delete it to answer afresh).
"""

from __future__ import annotations

import copy
import errno
import fcntl
import hashlib
import json
import os
import time
import warnings
from pathlib import Path
from typing import IO

import torch
from tqdm.auto import tqdm

from decoding.drafter import Sampling
from models.dtype_choice import DtypeChoice, cache_root, choose_dtype, time_forward
from models.dtypes import cast_keep_rotary, resolve_dtype
from models.target import Target
from train.data.answer_batch import answer_prompts
from train.disk import write_atomic
from train.parallel.ranks import Ranks


def default_cache_root() -> Path:
    # Read at call time so tests (and users) can point DRAFTLAB_CACHE elsewhere; an empty
    # DRAFTLAB_CACHE is unset (not the working directory)
    return cache_root(None)


def _sha(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def settings_key(
    target: Target,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    chat_template: str | None = None,
    dtype: str = "bfloat16",
) -> dict:
    """Everything that changes an answer besides the prompt itself. `chat_template`: the
    template the prompts were rendered with; None = the tokenizer's own. `dtype`: the
    generation dtype (bf16 and fp32 greedy answers part at near-ties). Caches written before
    the dtype was part of the key came from a bf16 copy whose rotary frequencies were rounded
    to bf16 (not the target's own answers), so they are deliberately not reused."""
    if chat_template is None:
        chat_template = target.tokenizer.chat_template or ""
    key = {
        "target": target.name,
        "weights": target.fingerprint,
        "chat_template": _sha(chat_template),
        "eos": target.eos_token_ids,
        "dtype": str(resolve_dtype(dtype)).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        # top_p and the seed do not matter for greedy decoding; keep one cache for it.
        "top_p": top_p if temperature > 0 else None,
        "seed": seed if temperature > 0 else None,
    }
    if temperature > 0:  # each prompt draws from its own generator (train/data/answer_batch.py)
        key["sampler"] = "per-prompt"
    return key


def legacy_key(settings: dict) -> str:
    """The key a cache had before the weights' fingerprint was part of it."""
    return _sha({k: v for k, v in settings.items() if k != "weights"})


def _adopt_legacy(regen: Path, settings: dict, shard_dir: Path) -> None:
    """Rename a cache of these settings written before the fingerprint entered the key to
    the new key: its answers are taken as those of the weights the target's name stands
    for now (true of the embedded target, whose weights never change)."""
    legacy = regen / legacy_key(settings)
    if shard_dir.exists() or not (legacy / "responses.jsonl").is_file():
        return
    try:
        os.rename(legacy, shard_dir)
    except OSError:  # another process adopted it first
        return
    warnings.warn(
        f"regeneration cache {legacy} (written before caches were keyed by the target's "
        f"weights) is taken as the answers of target {settings['target']!r} with weights "
        f"{settings['weights']} and moved to {shard_dir}; delete that directory if the "
        "weights under this name have changed since",
        stacklevel=3,
    )


def shard_file(shard_dir: Path, rank: int) -> Path:
    """The file rank `rank` appends its answers to (rank 0's is a single process's)."""
    return shard_dir / ("responses.jsonl" if rank == 0 else f"responses.rank{rank}.jsonl")


def _read_shard(path: Path) -> dict[str, dict]:
    done: dict[str, dict] = {}
    if not path.is_file():
        return done
    with path.open() as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a crash
                continue
            done[row["prompt"]] = row
    return done


def read_answers(shard_dir: Path) -> dict[str, dict]:
    """Every answer in every shard file of a cache directory, keyed by prompt hash; a prompt
    two files hold (answered under another world size) is taken from the first file in
    name order, so every rank reads the same answer."""
    done: dict[str, dict] = {}
    for path in sorted(shard_dir.glob("responses*.jsonl")):
        for key, row in _read_shard(path).items():
            done.setdefault(key, row)
    return done


def merged_stats(
    per_rank: list[dict], counts: tuple[str, ...] = ("generated", "new_tokens")
) -> dict:
    """One regeneration's stats from every rank's: `counts` summed, seconds the slowest
    rank's (the ranks ran at once), `by_rank` the prompts each rank answered."""
    if len(per_rank) == 1:
        return per_rank[0]
    merged = {**per_rank[0], **{k: sum(s[k] for s in per_rank) for k in counts}}
    seconds = max(s["seconds"] for s in per_rank)
    return {
        **merged,
        "seconds": seconds,
        "tokens_per_s": round(merged["new_tokens"] / seconds, 1) if seconds > 0 else None,
        "by_rank": [s["generated"] for s in per_rank],
    }


def prompts_left(keys: list[str], lengths: list[int], done: dict) -> list[int]:
    """The indices of the prompts with no answer in `done`, each prompt once, longest first
    (the hf backend prefills prompts of similar lengths together; a server gets no long
    request left alone at the end)."""
    todo = {k: i for i, k in enumerate(keys) if k not in done}.values()
    return sorted(todo, key=lambda i: -lengths[i])


def rank_share(todo: list[int], group: int, ranks: Ranks) -> list[int]:
    """This rank's prompts of `todo`: cut into groups of `group` as one process would, group
    g going to rank g mod world (the same split in every rank, from the same `todo`)."""
    groups = [todo[start : start + group] for start in range(0, len(todo), group)]
    return [i for g, batch in enumerate(groups) if g % ranks.world == ranks.rank for i in batch]


def write_settings(shard_dir: Path, settings: dict, ranks: Ranks) -> None:
    """The main rank creates the cache directory with its settings.json; every rank returns
    once it exists."""
    if ranks.main:
        shard_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(shard_dir / "settings.json", json.dumps(settings, indent=1))
    ranks.barrier()


def check_all_answered(keys: list[str], done: dict, shard_dir: Path) -> None:
    """Every prompt is in `done` (its answer; with a server, its answer or its refusal)."""
    missing = sum(k not in done for k in keys)
    if missing:
        raise RuntimeError(
            f"{missing} of {len(keys)} prompts have no answer in {shard_dir} after every rank "
            "answered its share: another job writing the same cache? Run again to answer them"
        )


def _ends_with_newline(path: Path) -> bool:
    if path.stat().st_size == 0:
        return True
    with path.open("rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def append_line(f: IO[str], line: str, path: Path) -> None:
    """`line` (ending in a newline) appended whole to `path`, open for appending as `f`, under
    an exclusive lock: two jobs answering into one cache append to the same file, and the
    check for a partial last line that a killed writer left (this job's or the other's; it
    is ended first) must not race the other job's append. Where the file system has no flock
    (Lustre mounted noflock), unlocked."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        locked = True
    except OSError as err:
        if err.errno not in (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK):
            raise
        locked = False
    try:
        if not _ends_with_newline(path):
            f.write("\n")
        f.write(line)
        f.flush()
    finally:
        if locked:
            fcntl.flock(f, fcntl.LOCK_UN)


@torch.no_grad()
def regenerate(
    target: Target,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 16,
    dtype: str = "bfloat16",
    seed: int = 0,
    cache_dir: str | Path | None = None,
    chat_template: str | None = None,
    progress: bool = True,
    ranks: Ranks | None = None,
    keys: list[str] | None = None,
    stop_ids: list[int] | None = None,
    desc: str = "regenerate",
) -> tuple[list[dict], dict]:
    """Answer each prompt (token ids, chat template applied with the generation prompt;
    `chat_template` is the template used, None = the tokenizer's: part of the cache key).
    `ranks`: with several processes every rank calls this with the same prompts and answers
    its share of the batches (module doc); None = this process alone.
    `keys`: one hex string per prompt naming its answer in the cache and seeding its sampler
    (default: a hash of its ids); distinct keys draw distinct samples of one prompt
    (train/data/self_prompts.py). `stop_ids`: the tokens an answer ends at (default the
    target's EOS), part of the cache key.

    Returns one dict per prompt, in order: `ids` (new tokens, the EOS included when the
    target stopped by itself) and `finished`; plus stats (cache hits, tokens/s; with several
    ranks summed over them, `by_rank` the prompts each answered).
    """
    ranks = ranks or Ranks()
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    settings = settings_key(target, max_new_tokens, temperature, top_p, seed, chat_template, dtype)
    if stop_ids is not None:
        settings["eos"] = sorted(stop_ids)
    root = Path(cache_dir) if cache_dir else default_cache_root()
    shard_dir = root / "data" / "regen" / _sha(settings)
    if ranks.main:
        _adopt_legacy(root / "data" / "regen", settings, shard_dir)
    write_settings(shard_dir, settings, ranks)
    shard = shard_file(shard_dir, ranks.rank)

    keys = [_sha(p) for p in prompts] if keys is None else list(keys)
    if len(keys) != len(prompts):
        raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts: give one key per prompt")
    done = read_answers(shard_dir)
    ranks.barrier()  # every rank has read the same answers before any rank appends more
    todo = prompts_left(keys, [len(p) for p in prompts], done)
    share = rank_share(todo, batch_size, ranks)  # this rank's batches, longest first
    stats = {
        "prompts": len(prompts),
        "cached": len(prompts) - len(todo),
        "generated": 0,
        "new_tokens": 0,
        "seconds": 0.0,
        "tokens_per_s": None,
        "cache": str(shard),
    }
    if share:
        answering = target  # in the generation dtype: the faster one on this machine (auto)
        gen_dtype = resolve_dtype(dtype)
        if target.dtype != gen_dtype:  # float32 rotary (models/dtypes.py)
            model = cast_keep_rotary(copy.deepcopy(target.model), gen_dtype)
            answering = Target(model, target.tokenizer, name=target.name)
        eos = set(settings["eos"])
        pad_id = target.tokenizer.pad_token_id
        pad_id = pad_id if pad_id is not None else target.eos_token_ids[0]
        bar = tqdm(total=len(share), desc=desc, unit="prompt",
                   disable=not (progress and ranks.main))  # fmt: skip
        t0 = time.perf_counter()
        with shard.open("a") as out:

            def save(position: int, new: list[int]) -> None:  # as each answer ends
                i, ids = share[position], list(new)  # an answer ends at its first EOS
                row = {
                    "prompt": keys[i],
                    "ids": ids,
                    "finished": bool(ids) and ids[-1] in eos,
                    "text": target.tokenizer.decode(ids, skip_special_tokens=True),
                }
                done[keys[i]] = row
                append_line(out, json.dumps(row) + "\n", shard)
                stats["new_tokens"] += len(ids)
                stats["generated"] += 1
                bar.update(1)  # the rate counts every decoded token, in-flight answers' too
                bar.set_postfix(tok_s=f"{decoded[0] / (time.perf_counter() - t0):.0f}")

            decoded = [0]

            def count() -> None:
                decoded[0] += 1

            # Each prompt's own generator (sampling): its answer does not depend on which
            # slot, batch or rank answers it, and the caller's random stream (a run's draft
            # init) is left alone.
            answer_prompts(
                answering, [prompts[i] for i in share], max_new_tokens,
                Sampling(temperature=temperature, top_p=top_p), sorted(eos), pad_id,
                slots=batch_size, seeds=[seed + int(keys[i], 16) % 2**62 for i in share],
                on_answer=save, on_token=count,
            )  # fmt: skip
        bar.close()
        stats["seconds"] = round(time.perf_counter() - t0, 2)
        stats["tokens_per_s"] = round(stats["new_tokens"] / max(stats["seconds"], 1e-9), 1)
    if ranks.world > 1:  # gathering waits for every rank's shard: then read them all
        stats = merged_stats(ranks.gather(stats))
        done = read_answers(shard_dir)
    check_all_answered(keys, done, shard_dir)
    return [done[k] for k in keys], stats


def regen_dtype_choice(
    target: Target, setting: str, items: list[dict], rows: int, max_new_tokens: int,
    cache_dir: str | None,
) -> DtypeChoice:  # fmt: skip
    """data.regen_dtype, or with "auto" the faster dtype for batched generation on this
    machine (models/dtype_choice.py): one step of `rows` rows over a cache as long as a
    typical prompt plus half an answer (rounded to 32 tokens, so similar data share a key)."""
    prompt = sorted(len(it["ids"]) for it in items)[len(items) // 2]
    cached = max(32, 32 * round((prompt + max_new_tokens / 2) / 32))
    shapes = {"target": target.name, "rows": rows, "new": 1, "cached": cached}
    return choose_dtype(
        "regenerate", setting, shapes,
        lambda dtype: time_forward(target, dtype, rows, 1, cached), target.device, cache_dir,
    )  # fmt: skip
