"""Evaluate a trained draft checkpoint, or an imported draft, with the shared decoder.

    python scripts/evaluate.py CKPT [KEY=VALUE ...] [--prompts FILE.jsonl] [--out FILE.json]
    python scripts/evaluate.py --init-from DIR [KEY=VALUE ...] [--prompts ...] [--out ...]

    python scripts/evaluate.py runs/debug/seed0/checkpoints/step_00000002
    python scripts/evaluate.py runs/eagle_tv/seed0 decode.k=6 'decode.temperatures=[0,0.7,1.0]'
    python scripts/evaluate.py runs/eagle_tv/seed0 decode=tree_dynamic decode.num_prompts=24
    python scripts/evaluate.py CKPT decode.num_prompts=20 --prompts my_prompts.jsonl --out ev.json
    python scripts/evaluate.py CKPT target=hf target.path=/models/smollm2   # the target has moved
    python scripts/evaluate.py CKPT target.device=cuda decode.compile=true
    python scripts/evaluate.py --init-from out/medusa +experiment=medusa_kl   # an imported draft

CKPT is a `<run_dir>/checkpoints/step_N` directory written by train/core/checkpoint.py, or a run
directory (its newest checkpoint). Its config is the run's full resolved config:
CKPT/config.yaml, or for a checkpoint without one the run's config.yaml two levels above (the
first segment's: a resumed run writes its own config.resume-<step>.yaml beside it). It
supplies the target, the data and the decode settings. What the checkpoint was trained with
(its identity.json: the draft's settings, the target's weights and chat template;
train/run/identity.py) is compared with the config after the overrides, and a difference is
refused with the overrides that match: a moved target evaluates, other weights do not. With no override this reproduces the
run's own final evaluation of that checkpoint exactly (same τ, α_i, acceptance histogram; only
the timings, tokens/s and speedup, vary): both go through train.eval.evaluate.evaluate_checkpoint,
and the output has its keys ("greedy/tau", "T0.7/alpha", ..., defined in docs/design.md),
without the training proxy's.

The overrides after CKPT are written over that config in Hydra's override grammar
(https://hydra.cc/docs/advanced/override_grammar/basic/): `decode.k=5`,
`'decode.temperatures=[0,1.0]'` (quoted for the shell), `decode.compile=true`; `+KEY=VALUE`
adds a key, `~KEY` deletes one. `GROUP=NAME` for a config group of conf/ (`decode=tree_dynamic`,
`decode=tree_static`, `target=hf`) replaces the config's whole GROUP node with
conf/GROUP/NAME.yaml as training composes it, the run's own values of that node included. As in
Hydra, the group choices come first wherever they stand, then the keys in order
(`decode=tree_dynamic decode.num_prompts=24`: the group's decode settings, then 24 prompts).
The run's config is resolved, so `device=` does not reach the target: write
`target.device=cuda`. Decode settings are checked as at the start of training
(train.run.settings: check_decode, check_draft_decode: a k beyond what one round of the draft
drafts is refused, not silently cut; check_decode_context: prompts + new tokens within the
target's context window).

`--init-from DIR` evaluates a draft saved in any format train/run/init_from.py reads (a
checkpoint, or an hf / medusa / vllm-medusa / speculators / eagle export: docs/export.md,
Import) without a run directory: no CKPT, and the overrides are those of conf/train.yaml
composed by Hydra as for training (`+experiment=NAME`, `target=...`, `decode.k=...`), which
build the target, the data and a draft of the right kind; the files are loaded into that draft.

Not overrides: `--prompts FILE.jsonl` decodes a file of prompts instead of the run's held-out
eval prompts (an input, not a setting of the run: data.* describes how the eval split was
built). Each line is one JSON object with a "prompt" string, rendered as one user turn with the
run's chat template (data.chat_template) and the generation prompt, as the eval prompts are.
Without it the run's own eval prompts are decoded: those the run stored beside its config
(<run_dir>/eval_prompts.json, train/run/files.py), or, for a run from before runs stored them,
for a checkpoint outside its run directory, or with data.* overrides that choose other prompts,
rebuilt by train.data.prepare.prepare_data from the data config (it reads the run's
regeneration cache; a missing cache means the training prompts are answered again first).
`--out FILE.json` also writes every metric.

Prints progress to stderr and a table of τ, α per position and speedup vs AR to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import hydra.utils
import torch
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from models.target import Target
from train.core.checkpoint import PREFIX, latest_checkpoint, load_draft
from train.data.prepare import prepare_data
from train.data.prompt_file import load_prompt_file, spread
from train.eval.evaluate import evaluate_checkpoint, format_eval_table
from train.formats.export import checkpoint_config, load_target
from train.phase_memory import HEAP_MMAP_THRESHOLD, set_mmap_threshold
from train.run.files import read_eval_prompts, route_third_party_output
from train.run.identity import evaluate_differences, refusal
from train.run.init_from import detect_format, init_draft_from
from train.run.settings import (
    check_decode,
    check_decode_context,
    check_draft_decode,
    eval_settings,
)

CONF = Path(__file__).resolve().parents[1] / "conf"


def progress(msg: str) -> None:
    print(f"[evaluate] {msg}", file=sys.stderr, flush=True)


def find_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory (its newest checkpoint)."""
    if not path.is_dir():
        hint = " (CKPT comes first, then the overrides)" if "=" in str(path) else ""
        raise FileNotFoundError(
            f"checkpoint {path} does not exist{hint}; give a <run_dir>/checkpoints/{PREFIX}N "
            "directory written by a draftlab training run, or the run directory itself"
        )
    is_run = (path / "config.yaml").is_file() or (path / "checkpoints").is_dir()
    if not (path / "draft.yaml").is_file() and is_run:
        newest = latest_checkpoint(path)
        if newest is None:
            raise FileNotFoundError(f"run directory {path} holds no checkpoint in checkpoints/")
        path = newest
    missing = [n for n in ("draft.yaml", "draft.safetensors") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a draftlab checkpoint (no {', '.join(missing)}); give a "
            f"<run_dir>/checkpoints/{PREFIX}N directory written by train/core/checkpoint.py"
        )
    return path


def parse_overrides(overrides: list[str]) -> list[Override]:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        raise ValueError(f"{err} (an override is KEY=VALUE, +KEY=VALUE or ~KEY)") from None
    for override in parsed:
        if override.is_sweep_override():
            raise ValueError(f"{override.input_line}: one value per key here (no sweeps)")
    return parsed


def group_node(override: Override) -> dict:
    """`GROUP=NAME`: the GROUP node of conf/train.yaml composed with that choice, its
    interpolations (`${device}`) left to resolve against the config it goes into."""
    group, name = override.key_or_group, override.value()
    if not (CONF / group / f"{name}.yaml").is_file():
        known = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        raise ValueError(
            f"{override.input_line}: there is no conf/{group}/{name}.yaml; conf/{group} has {known}"
        )
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            composed = compose("train", overrides=[override.input_line])
    except HydraException as err:
        raise ValueError(f"{override.input_line}: {err}") from None
    if group not in composed:
        raise ValueError(
            f"{override.input_line} is a recipe over the whole config, not one node of it; a "
            "checkpoint's config already holds its own: override its keys (decode.k=5), or "
            "compose a config from conf/ with --init-from DIR"
        )
    return OmegaConf.to_container(composed[group], resolve=False)


def set_key(cfg: DictConfig, override: Override) -> None:
    """One `KEY=VALUE`, `+KEY=VALUE`, `++KEY=VALUE` or `~KEY[=VALUE]`, with Hydra's meaning."""
    key, line, value = override.key_or_group, override.input_line, override.value()
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, throw_on_missing=False) if parent_key else cfg
    if isinstance(parent, DictConfig):
        exists = leaf in parent.keys()  # noqa: SIM118 (`in parent` is False for a ??? value)
    else:
        exists = isinstance(parent, ListConfig) and leaf.isdigit() and int(leaf) < len(parent)
    current = OmegaConf.select(cfg, key, throw_on_missing=False) if exists else None
    if override.is_delete():
        if not exists:
            raise ValueError(f"{line}: the config has no {key} to delete")
        if value is not None and value != current:
            raise ValueError(f"{line}: {key} is {current!r}, not {value!r}; nothing deleted")
        with open_dict(cfg):
            del parent[int(leaf) if isinstance(parent, ListConfig) else leaf]
    elif override.is_add() and exists:
        raise ValueError(
            f"{line}: {key} is already set ({current!r}); write {key}=... to change it"
        )
    elif not (override.is_add() or override.is_force_add()) and not exists:
        raise ValueError(
            f"{line}: the config has no {key} (see the run's config.yaml); write +{line} to add it"
        )
    else:
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """`overrides` (Hydra's grammar) written over a checkpoint's resolved config as Hydra
    composes: the config groups' choices first, then the keys, each in command-line order."""
    parsed = parse_overrides(overrides)
    groups = [o for o in parsed if (CONF / o.key_or_group).is_dir()]
    for override in groups:
        line, group = override.input_line, override.key_or_group
        if override.is_delete():
            raise ValueError(f"{line}: the config cannot lose its {group}")
        if not isinstance(override.value(), str):
            raise ValueError(f"{line}: {group}=NAME names a file of conf/{group}/; set keys one "
                             f"by one ({group}.KEY=VALUE)")  # fmt: skip
        with open_dict(cfg):
            cfg[group] = group_node(override)
    for override in parsed:
        if override not in groups:
            set_key(cfg, override)
    return cfg


def composed_config(overrides: list[str]) -> DictConfig:
    """--init-from: conf/train.yaml composed with the command line's Hydra overrides."""
    parse_overrides(overrides)  # the same clear refusals as after CKPT
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose("train", overrides=overrides)
    except HydraException as err:
        raise ValueError(str(err)) from None


def imported_draft(cfg: DictConfig, path: Path, target: Target) -> torch.nn.Module:
    """The draft cfg.draft builds for `target`, with the draft saved in `path` loaded into it."""
    # plain lists and dicts for the builder, as a run builds it (train/run/setup.py)
    model = cfg.draft.model
    draft = hydra.utils.instantiate(model, target=target, token_counts=None, _convert_="all")
    fmt = init_draft_from(path, draft, target, cfg.draft)
    progress(f"{path}: {fmt} format, loaded into draft={cfg.draft.kind}")
    return draft.eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="CKPT [KEY=VALUE ...]",
        help=f"<run_dir>/checkpoints/{PREFIX}N, or a run directory (its newest checkpoint), then "
        "Hydra overrides of its config (decode.k=5); with --init-from: overrides of "
        "conf/train.yaml only (+experiment=medusa_kl)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        metavar="DIR",
        help="evaluate the draft saved in DIR (any format of docs/export.md, Import) in the draft "
        "the overrides configure, without a run directory",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help='.jsonl, one {"prompt": "..."} per line (default: the run\'s eval prompts)',
    )
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE.json", help="also write the metrics here"
    )
    args = parser.parse_intermixed_args(argv)
    if args.out is not None:  # checked here, not after the decoding
        above = next(p for p in args.out.parents if p.exists())
        if args.out.is_dir():
            raise ValueError(f"--out {args.out} is a directory; give a file path (FILE.json)")
        if not above.is_dir():
            raise ValueError(f"--out {args.out}: {above} is a file, not a directory")

    ckpt = None
    if args.init_from is not None:
        cfg = composed_config(args.args)
        detect_format(args.init_from)  # a missing or unreadable DIR, before the target loads
        progress(f"draft.init_from={args.init_from}, draft={cfg.draft.kind}")
    elif args.args:
        ckpt = find_checkpoint(Path(args.args[0]))
        cfg = apply_overrides(checkpoint_config(ckpt), args.args[1:])
        progress(f"checkpoint {ckpt}")
    else:
        parser.error("give CKPT [KEY=VALUE ...], or --init-from DIR [KEY=VALUE ...]")
    # The same start-up checks as training (train/run/settings.py), the draft's own limits (a
    # block-8 DFlash drafts at most 7 per round) included.
    check_decode(cfg.decode)
    check_draft_decode(cfg)
    t0 = time.perf_counter()
    target = load_target(cfg)
    progress(f"target {target.name} on {target.device} ({time.perf_counter() - t0:.1f}s)")
    if ckpt is not None and (diffs := evaluate_differences(ckpt, cfg, target)):
        raise ValueError(refusal(
            f"{ckpt} was trained with other settings than the config given here:", diffs,
            "The checkpoint's own draft.yaml builds the draft, so an override of draft.* would "
            "be ignored: drop it; and give the target the checkpoint was trained with.",
        ))  # fmt: skip
    if args.prompts is not None:
        eval_prompts = load_prompt_file(
            args.prompts, target.tokenizer, cfg.data.get("chat_template")
        )
        source = str(args.prompts)
    else:
        data, eval_prompts = OmegaConf.to_container(cfg.data, resolve=True), None
        if ckpt is not None:  # <run_dir>/checkpoints/step_N: the prompts the run stored
            eval_prompts, source = read_eval_prompts(ckpt.parent.parent, data)
            if eval_prompts is None:  # why not, in one line
                progress(f"{source}: rebuilding the eval prompts through the data preparation")
        if eval_prompts is None:
            progress(
                f"eval prompts of data.source={cfg.data.source!r} (train.data.prepare.prepare_data)"
            )
            eval_prompts, source = prepare_data(target, **data).eval_prompts, "the run's eval split"
        if not eval_prompts:
            raise ValueError(
                "the run's data config holds no eval prompts (data.num_eval=0); "
                "pass --prompts FILE.jsonl"
            )
    check_decode_context(target, cfg.decode, eval_prompts)  # before any draft is loaded
    if ckpt is None:
        draft = imported_draft(cfg, args.init_from, target)
    else:
        draft = load_draft(ckpt, target).eval()
    settings = eval_settings(cfg)  # what train/eval/ decodes with, as a run's evaluation
    num = len(spread(eval_prompts, settings.num_prompts))  # those train/eval/plan.py decodes
    tree = settings.tree
    shape = f"{tree.kind} tree" if tree is not None else f"chain k={settings.k}"
    progress(
        f"decoding {num} prompts from {source}, {shape}, temperatures "
        f"{list(settings.temperatures)}, {settings.max_new_tokens} new tokens, {settings.dtype}, "
        "AR and speculative side by side"
    )
    log_dir = ckpt.parent.parent if ckpt else (args.out.parent if args.out else None)
    if log_dir is not None:  # autotuning tables, library warnings: the run's third_party.log
        log_dir.mkdir(parents=True, exist_ok=True)
        route_third_party_output(log_dir)
    t0 = time.perf_counter()
    # no training record: no proxy beside the decode
    result, _ = evaluate_checkpoint(target, draft, eval_prompts, settings, None)
    meta = ckpt / "meta.json" if ckpt else None  # step and train_s, as a run's eval records
    meta = json.loads(meta.read_text()) if meta and meta.is_file() else {}
    result["step"], result["train_s"] = meta.get("step"), meta.get("train_s")
    result["eval_s"] = round(time.perf_counter() - t0, 1)  # as a run's eval records have it
    progress(f"done in {result['eval_s']:.1f}s")
    print(format_eval_table([result]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
        progress(f"metrics -> {args.out}")
    return result


if __name__ == "__main__":
    set_mmap_threshold(HEAP_MMAP_THRESHOLD)  # as train.py: the allocator a run evaluates with
    try:
        main()
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"evaluate.py: error: {err}")
