"""What a checkpoint was trained with, compared wherever its weights are used again.

Every checkpoint holds `identity.json` (beside config.yaml, the whole resolved run config):
  draft   its kind and every `draft.model` setting but the ones that only pick a fresh
          draft's starting weights (INIT_ONLY), whether or not a tensor's shape shows it:
          taps, unroll steps, block size, anchors, gamma, vocabulary size..., and `taps`, the
          target layers it reads resolved (`layers: null` is the kind's default for that
          target). The tap scale and the vocabulary ids are buffers of draft.safetensors,
          loaded with the weights; `vocab` records a hash of the ids.
  target  its name, a fingerprint of its weights (models/identity.py), the dtype it ran in,
          and a hash of the chat template the data was rendered with.

Compared, refused with ONE message that lists every difference (the checkpoint's value, the
current one) and the overrides that match:
  resume=true          `check_resume`, after the target is loaded and before the data is
                       prepared: the draft, the target (weights, chat template, dtype), the
                       process count, and every setting of the run's course but the free
                       ones (RESUME_FREE) and those a resumed run continues (RESUME_CONTINUED)
  draft.init_from      `init_differences` (train/run/init_from.py): the draft and the
                       target's weights; the message says what is free to change (FREE_ON_INIT)
  scripts/evaluate.py  `evaluate_differences`: the draft (the checkpoint's draft.yaml builds
                       it, so an override of draft.* would be ignored), the target's weights
                       and the chat template
A checkpoint written before identity.json: its draft settings come from draft.yaml (taps
unresolved) and nothing is known of its target.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from models.target import Target
from train.data.chat import resolve_chat_template

IDENTITY_FILE = "identity.json"
FORMAT = 1
INIT_ONLY = ("init", "init_from", "seed")  # draft.model keys a loaded state overrides
VOCAB_BUFFERS = ("d2t", "t2d", "vocab_ids")  # models/vocab.py
FREE_ON_INIT = (
    "Free to change when starting from a checkpoint: the optimiser (optim.*), the loss "
    "(loss.*), the data (data.*), train.*, decode.*, replay.*, seed, target.dtype, and the "
    f"draft's fresh-start settings (draft.model.{{{','.join(INIT_ONLY)}}})."
)
# What a resumed run may change freely: where and how it reports, not what it trains.
# (`target` and `draft` are compared through the identity; the target may have moved.)
RESUME_FREE = (
    "name", "run_dir", "resume", "overwrite", "device", "logger", "decode", "target", "draft",
    "train.log_every", "train.ckpt_every", "train.keep_last", "train.eval_at_ckpt",
    "train.eval_every", "train.feature_cache", "train.heldout_proxy", "data.progress",
    "data.cache_dir", "data.regen_batch_size", "train.dist_timeout_s", "data.regen_url",
    "data.regen_concurrency", "data.regen_retries", "data.regen_timeout",
    "data.max_failed_share",
)  # fmt: skip
# What a resumed run continues from the saved state when changed: the data from the rows
# consumed, the LR schedule the run started with.
RESUME_CONTINUED = ("train.batch_size", "train.grad_accum", "train.steps", "train.time_budget_s")
_MISSING = "(not set)"


@dataclass
class Difference:
    setting: str  # a config key, or what differs ("target weights")
    checkpoint: Any
    now: Any
    override: str | None = None  # the Hydra override that matches the checkpoint
    hint: str | None = None  # what to do where no override does


@dataclass
class Resumed:
    """What a resumed run continues from (trainer_state.pt) and what it was told."""

    rows_consumed: int
    schedule: dict  # `schedule_settings`, as the run started
    notes: list[str] = field(default_factory=list)
    # The dtype the target ran in: a target.dtype=auto run keeps it instead of measuring again
    # (another verdict would change the features the draft reads mid-run).
    target_dtype: str | None = None


def schedule_settings(cfg: DictConfig) -> dict:
    """What the LR schedule (train/core/schedule.py: lr_lambda) is built from. Saved in every
    checkpoint, so a resumed run keeps the schedule it started with whatever its train.steps
    or time budget."""
    return {
        "warmup_steps": int(cfg.optim.warmup_steps),
        "steps": int(cfg.train.steps),
        "min_lr_ratio": float(cfg.optim.min_lr_ratio),
        "time_budget_s": cfg.train.get("time_budget_s"),
    }


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def hydra_value(value: Any) -> str:
    """`value` as the right-hand side of a Hydra override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if re.fullmatch(r"[A-Za-z_][\w./-]*", text) and text.lower() not in ("null", "true", "false"):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _show(value: Any) -> str:
    return value if value is _MISSING else json.dumps(value, default=str)


def _container(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _flat(node: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict) and value:
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def _under(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


# -- the records ---------------------------------------------------------------------------------
def draft_identity(draft_cfg, draft: nn.Module | None = None) -> dict:
    """The draft settings `cfg.draft` gives (INIT_ONLY left out), with the taps resolved when
    the built `draft` is given."""
    node = _container(draft_cfg)
    model = {k: v for k, v in (node.get("model") or {}).items() if k not in INIT_ONLY}
    taps = list(draft.hidden_layers) if draft is not None else None
    return {"kind": node.get("kind"), "model": model, "taps": taps}


def target_identity(target: Target, chat_template: str | None) -> dict:
    """`chat_template`: data.chat_template, resolved against the target's tokenizer."""
    return {
        "name": target.name,
        "weights": target.fingerprint,
        "dtype": str(target.dtype).removeprefix("torch."),
        "chat_template": _sha(resolve_chat_template(target.tokenizer, chat_template)),
    }


def run_identity(cfg: DictConfig, target: Target, draft: nn.Module) -> dict:
    """identity.json of a run's checkpoints."""
    state = draft.state_dict()
    vocab = [state[k] for k in sorted(state) if k.rsplit(".", 1)[-1] in VOCAB_BUFFERS]
    vocab_sha = None
    if vocab:
        h = hashlib.sha256()
        for t in vocab:
            h.update(t.detach().cpu().to(torch.int64).numpy().tobytes())
        vocab_sha = h.hexdigest()[:16]
    return {
        "format": FORMAT,
        "draft": draft_identity(cfg.draft, draft),
        "target": target_identity(target, cfg.data.get("chat_template")),
        "vocab": vocab_sha,
    }


def read_identity(ckpt: Path) -> dict:
    """A checkpoint's identity.json, or for an older checkpoint what its draft.yaml says."""
    if (ckpt / IDENTITY_FILE).is_file():
        return json.loads((ckpt / IDENTITY_FILE).read_text())
    return {"draft": draft_identity(OmegaConf.load(ckpt / "draft.yaml")), "target": None}


def saved_config(ckpt: Path) -> dict | None:
    """The resolved config checkpoint `ckpt` was trained with (its own, else its run's)."""
    for path in (ckpt / "config.yaml", ckpt.parent.parent / "config.yaml"):
        if path.is_file():
            return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return None


# -- the comparisons -----------------------------------------------------------------------------
def _taps_differ(saved: dict, now: dict, num_layers: int) -> bool:
    """hidden_states indices, -1 = L (the last layer)."""
    n = num_layers + 1
    mod = lambda taps: [int(i) % n for i in taps]  # noqa: E731
    raw_saved, raw_now = saved["model"].get("layers"), now["model"].get("layers")
    if saved.get("taps") is not None and now.get("taps") is not None:
        return mod(saved["taps"]) != mod(now["taps"])
    if raw_saved == raw_now:
        return False
    if saved.get("taps") is not None and raw_now is not None:  # explicit now, resolved then
        return mod(saved["taps"]) != mod(raw_now)
    return True


def draft_differences(saved: dict, now: dict, num_layers: int) -> list[Difference]:
    """`saved`, `now`: draft_identity records, the taps compared resolved where known."""
    kind_then = (saved["kind"], saved["model"].get("_target_"))
    kind_now = (now["kind"], now["model"].get("_target_"))
    if kind_then != kind_now:
        return [Difference("draft (kind, builder)", list(kind_then), list(kind_now),
                           f"draft={saved['kind']}",
                           hint=f"the checkpoint's draft.model: {json.dumps(saved['model'])}")]  # fmt: skip
    out = []
    for key in sorted(set(saved["model"]) | set(now["model"])):
        then, cur = saved["model"].get(key, _MISSING), now["model"].get(key, _MISSING)
        if key == "layers" and then is not _MISSING and cur is not _MISSING:
            if _taps_differ(saved, now, num_layers):
                shown_then = then if then is not None else saved["taps"]
                shown_now = cur if now.get("taps") is None else now["taps"]
                fix = f"draft.model.layers={hydra_value(shown_then)}"
                out.append(Difference("draft.model.layers", shown_then, shown_now, fix))
            continue
        if then == cur:
            continue
        key_path = f"draft.model.{key}"
        if then is _MISSING:
            fix = f"~{key_path}"
        else:
            fix = ("+" if cur is _MISSING else "") + f"{key_path}={hydra_value(then)}"
        out.append(Difference(key_path, then, cur, fix))
    return out


def target_differences(
    saved: dict | None, now: dict, fields: tuple[str, ...], template_fix: str | None = None
) -> list[Difference]:
    """`fields` of the target's identity: weights, chat_template, dtype."""
    if saved is None:
        return []
    out = []
    if "weights" in fields and saved["weights"] != now["weights"]:
        out.append(Difference(
            "target weights", f"{saved['weights']} ({saved['name']})",
            f"{now['weights']} ({now['name']})",
            hint=f"load the target the checkpoint was trained with: {saved['name']}",
        ))  # fmt: skip
    if "chat_template" in fields and saved["chat_template"] != now["chat_template"]:
        out.append(Difference(
            "chat template (data.chat_template resolved, hashed)", saved["chat_template"],
            now["chat_template"], template_fix,
            hint=None if template_fix else "the target's tokenizer has another template now",
        ))  # fmt: skip
    if "dtype" in fields and saved["dtype"] != now["dtype"]:
        out.append(Difference("target.dtype", saved["dtype"], now["dtype"],
                              f"target.dtype={saved['dtype']}"))  # fmt: skip
    return out


def config_differences(saved: dict, cfg: DictConfig) -> tuple[list[Difference], list[str]]:
    """The course of a run: every key both configs hold (a key one of them lacks came or
    went with a code change), RESUME_FREE and RESUME_CONTINUED excepted; replay.* only when
    enabled in either. -> (differences, the RESUME_CONTINUED keys that changed)."""
    then = _flat(OmegaConf.to_container(OmegaConf.create(saved), resolve=True))
    now = _flat(OmegaConf.to_container(cfg, resolve=True))
    replay = then.get("replay.enabled") or now.get("replay.enabled")
    out, continued = [], []
    for key in sorted(set(then) & set(now)):
        if then[key] == now[key] or _under(key, RESUME_FREE):
            continue
        if not replay and _under(key, ("replay",)):
            continue
        if _under(key, RESUME_CONTINUED):
            continued.append(key)
            continue
        out.append(Difference(key, then[key], now[key], f"{key}={hydra_value(then[key])}"))
    return out, continued


def refusal(head: str, diffs: list[Difference], tail: str = "") -> str:
    """The one message: a line per difference, then the overrides that match."""
    lines = [head]
    for d in diffs:
        line = f"  {d.setting}: checkpoint {_show(d.checkpoint)}, now {_show(d.now)}"
        lines.append(line + (f"; {d.hint}" if d.hint else ""))
    overrides = [d.override for d in diffs if d.override]
    if overrides:
        lines.append("To match the checkpoint: " + " ".join(overrides))
    return "\n".join(lines + ([tail] if tail else []))


# -- where they are used -------------------------------------------------------------------------
def check_resume(
    cfg: DictConfig, ckpt: Path, target: Target, world_size: int, strategy: str = "single"
) -> Resumed:
    """Refuse (ValueError) a resume that would not continue the run of checkpoint `ckpt`;
    else what it continues from, with a note per changed RESUME_CONTINUED setting.
    `strategy`: this run's (train/parallel/strategy.py); FSDP and the others save the optimizer
    differently."""
    saved_cfg = saved_config(ckpt) or {}
    identity = read_identity(ckpt)
    state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False)
    diffs = draft_differences(identity["draft"], draft_identity(cfg.draft), target.num_layers)
    course, continued = config_differences(saved_cfg, cfg) if saved_cfg else ([], [])
    listed = "data.chat_template" in {d.setting for d in course}  # the raw setting changed
    fields = ("weights", "dtype") if listed else ("weights", "chat_template", "dtype")
    if str(cfg.target.get("dtype")) == "auto":  # a resumed auto run loads in the saved dtype
        fields = tuple(f for f in fields if f != "dtype")
    now = target_identity(target, cfg.data.get("chat_template"))
    diffs += target_differences(identity.get("target"), now, fields)
    warm_start = not diffs  # draft.init_from would take these weights with the new settings
    diffs += course
    if state["world_size"] != world_size:
        diffs.append(Difference(
            "processes", state["world_size"], world_size,
            hint=f"resume with {state['world_size']} processes: each rank's RNG state and "
            "replay buffer are saved for its own rank",
        ))  # fmt: skip
    saved_strategy = state.get("strategy", "single")  # written before the key: not FSDP
    if (saved_strategy == "fsdp") != (strategy == "fsdp"):
        diffs.append(Difference(
            "strategy", saved_strategy, strategy,
            hint="an FSDP checkpoint keys its optimizer state by parameter name, the others "
            "by position: resume under the launch config it was written with",
        ))  # fmt: skip
    if diffs:
        other = (f"Or keep the new settings and start a new run from its weights: "
                 f"draft.init_from={ckpt} with another run_dir (the optimiser, LR schedule and "
                 "data position then start afresh).")  # fmt: skip
        raise ValueError(refusal(
            f"resume=true: {ckpt} was trained with other settings, so this run would not "
            "continue it:", diffs, other if warm_start else "",
        ))  # fmt: skip
    old = OmegaConf.create(saved_cfg) if saved_cfg else cfg
    schedule = state.get("schedule") or schedule_settings(old)
    rows = int(state.get("rows_consumed", state["step"] * _rows_per_step(old, world_size)))
    notes = []
    if {"train.batch_size", "train.grad_accum"} & set(continued):
        notes.append(
            f"train.batch_size x grad_accum x processes is now {_rows_per_step(cfg, world_size)} "
            f"rows per step (was {_rows_per_step(old, world_size)}): the data continues at row "
            f"{rows} of the run's seeded order, none skipped or repeated"
        )
    if {"train.steps", "train.time_budget_s"} & set(continued):
        length = (f"{schedule['steps']} steps" if schedule["time_budget_s"] is None
                  else f"a {schedule['time_budget_s']} s time budget")  # fmt: skip
        notes.append(
            f"train.steps={cfg.train.steps}, train.time_budget_s={cfg.train.get('time_budget_s')}"
            f": the LR schedule stays the one the run started with ({schedule['warmup_steps']} "
            f"warmup steps, cosine over {length} to min_lr_ratio {schedule['min_lr_ratio']}); "
            "past its end the rate stays at min_lr_ratio"
        )
    target_dtype = (identity.get("target") or {}).get("dtype")
    return Resumed(rows, schedule, notes, target_dtype)


def _rows_per_step(cfg: DictConfig, world_size: int) -> int:
    return int(cfg.train.batch_size) * world_size * int(cfg.train.grad_accum)


def init_differences(
    ckpt: Path, target: Target, draft_cfg=None, draft: nn.Module | None = None
) -> list[Difference]:
    """draft.init_from of checkpoint `ckpt`: the draft `draft_cfg` (cfg.draft) builds, its
    taps resolved when the built `draft` is given (without `draft_cfg`, only the taps of
    `draft` are compared), and the target's weights."""
    identity = read_identity(ckpt)
    if draft_cfg is not None:
        now = draft_identity(draft_cfg, draft)
    else:  # the checkpoint's own settings: only the taps can differ
        now = {**identity["draft"], "taps": None if draft is None else list(draft.hidden_layers)}
    diffs = draft_differences(identity["draft"], now, target.num_layers)
    saved_target = identity.get("target")
    if saved_target is not None:
        current = {"name": target.name, "weights": target.fingerprint}
        diffs += target_differences(saved_target, current, ("weights",))
    return diffs


def evaluate_differences(ckpt: Path, cfg: DictConfig, target: Target) -> list[Difference]:
    """scripts/evaluate.py CKPT: `cfg` (the checkpoint's config with the command line's
    overrides) against what the checkpoint was trained with."""
    identity = read_identity(ckpt)
    diffs = draft_differences(identity["draft"], draft_identity(cfg.draft), target.num_layers)
    raw = (saved_config(ckpt) or {}).get("data", {}).get("chat_template", _MISSING)
    changed = raw is not _MISSING and raw != cfg.data.get("chat_template")
    fix = f"data.chat_template={hydra_value(raw)}" if changed else None
    now = target_identity(target, cfg.data.get("chat_template"))
    fields = ("weights", "chat_template")
    return diffs + target_differences(identity.get("target"), now, fields, fix)
