"""Evaluate a trained draft checkpoint, or an imported draft, with the shared decoder.

    python scripts/evaluate.py runs/debug/seed0/checkpoints/step_00000002
    python scripts/evaluate.py runs/eagle_tv/seed0 --tree dynamic --temperatures 0 0.7 1.0
    python scripts/evaluate.py CKPT --prompts my_prompts.jsonl --k 6 --num-prompts 20 --out ev.json
    python scripts/evaluate.py CKPT --target-path /models/smollm2   # the target has moved
    python scripts/evaluate.py --init-from out/medusa +experiment=medusa_kl   # an imported draft

CKPT is a `<run_dir>/checkpoints/step_N` directory written by train/checkpoint.py, or a run
directory (its newest checkpoint). The run's `config.yaml` (two levels above the checkpoint)
supplies the target, the data and the decode settings; the decoding flags override the
latter. With no flag this reproduces the run's own final evaluation of that checkpoint
exactly (same τ, α_i, acceptance histogram; only the timings, tokens/s and speedup, vary):
both go through train.evaluate.evaluate_checkpoint, and the output has its keys
("greedy/tau", "T0.7/alpha", ..., defined in docs/design.md), without the training proxy's.

`--init-from DIR` evaluates a draft saved in any format train/init_from.py reads (a
checkpoint, or an hf / medusa / vllm-medusa / speculators / eagle export: docs/export.md,
Import) without a run directory: the positional arguments are then Hydra overrides of
conf/train.yaml (`+experiment=NAME`, `target=...`, `decode.k=...`), which build the target, the
data and a draft of the right kind, and the files are loaded into that draft.

Prompts: by default the run's held-out eval prompts, rebuilt by
train.data.prepare.prepare_data from the run's data config (it reads the run's regeneration
cache; a missing cache means the training prompts are answered again first). `--prompts FILE.jsonl` takes one JSON object per
line with a "prompt" string instead, rendered as one user turn with the run's chat template
(data.chat_template) and the generation prompt, as the eval prompts are.

Prints progress to stderr and a table of τ, α per position and speedup vs AR to stdout;
`--out FILE.json` also writes every metric.
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
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from anywhere

from models.target import Target  # noqa: E402
from train.checkpoint import PREFIX, latest_checkpoint, load_draft  # noqa: E402
from train.data.chat import resolve_chat_template, tokenize_conversation  # noqa: E402
from train.data.prepare import prepare_data  # noqa: E402
from train.evaluate import evaluate_checkpoint, format_eval_table  # noqa: E402
from train.init_from import init_draft_from  # noqa: E402
from train.settings import check_decode  # noqa: E402

TREE_SHORTHANDS = {"static": "tree_static", "dynamic": "tree_dynamic"}


def progress(msg: str) -> None:
    print(f"[evaluate] {msg}", file=sys.stderr, flush=True)


def find_checkpoint(path: Path) -> tuple[Path, Path]:
    """A checkpoint directory (or a run directory: its newest checkpoint) -> (checkpoint,
    run directory)."""
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint {path} does not exist; give a <run_dir>/checkpoints/{PREFIX}N "
            "directory written by a draftlab training run, or the run directory itself"
        )
    if not path.name.startswith(PREFIX) and (path / "config.yaml").is_file():
        newest = latest_checkpoint(path)
        if newest is None:
            raise FileNotFoundError(f"run directory {path} holds no checkpoint in checkpoints/")
        path = newest
    missing = [n for n in ("draft.yaml", "draft.safetensors") if not (path / n).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path} is not a draftlab checkpoint (no {', '.join(missing)}); give a "
            f"<run_dir>/checkpoints/{PREFIX}N directory written by train/checkpoint.py"
        )
    run_dir = path.parent.parent
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(
            f"no config.yaml in {run_dir}: the checkpoint must stay inside its run directory "
            f"(<run_dir>/checkpoints/{PREFIX}N), whose config.yaml names the target and data"
        )
    return path, run_dir


def tree_node(name: str) -> DictConfig | None:
    """The `tree` settings of decode conf `name` (conf/decode/NAME.yaml; None = chain)."""
    name = TREE_SHORTHANDS.get(name, name)
    if not (ROOT / "conf" / "decode" / f"{name}.yaml").is_file():
        known = sorted(p.stem for p in (ROOT / "conf" / "decode").glob("*.yaml"))
        raise ValueError(
            f"--tree {name!r}: no conf/decode/{name}.yaml; use static, dynamic or one of {known}"
        )
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        decode = compose("train", overrides=[f"decode={name}"]).decode
    return decode.get("tree")


def run_config(run_dir: Path, args: argparse.Namespace) -> DictConfig:
    """The run's resolved config with the command line's decode/target overrides applied:
    what train.evaluate.evaluate_checkpoint reads (cfg.decode, cfg.seed)."""
    cfg = OmegaConf.load(run_dir / "config.yaml")
    loader = str(cfg.target.get("_target_", ""))
    if loader.startswith("train.target."):  # runs written before the loaders moved to models/
        cfg.target._target_ = "models.target_loaders." + loader.removeprefix("train.target.")
    return apply_flags(cfg, args)


def apply_flags(cfg: DictConfig, args: argparse.Namespace) -> DictConfig:
    """The command line's decoding, target and device flags, written over `cfg`."""
    dec = cfg.decode
    for key, value in [
        ("k", args.k),
        ("temperatures", args.temperatures),
        ("top_p", args.top_p),
        ("top_k", args.top_k),
        ("max_new_tokens", args.max_new_tokens),
        ("num_prompts", args.num_prompts),
        ("seed", args.seed),
        ("dtype", args.dtype),
        ("compile", args.compile),
        ("compile_mode", args.compile_mode),
    ]:
        if value is not None:
            dec[key] = value
    if args.tree is not None:
        dec.tree = tree_node(args.tree)
    if args.target_path is not None:
        cfg.target = {
            "_target_": "models.target_loaders.load_hf_target",
            "path": args.target_path,
            "dtype": cfg.target.get("dtype", "float32"),
            "device": cfg.target.get("device", "auto"),
        }
    if args.device is not None:
        cfg.device = args.device
        cfg.target.device = args.device
    return cfg


def composed_config(overrides: list[str], args: argparse.Namespace) -> DictConfig:
    """--init-from: conf/train.yaml with the command line's Hydra overrides, then its flags."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return apply_flags(compose("train", overrides=overrides), args)


def imported_draft(cfg: DictConfig, path: Path, target: Target) -> torch.nn.Module:
    """The draft cfg.draft builds for `target`, with the draft saved in `path` loaded into it."""
    draft = hydra.utils.instantiate(cfg.draft.model, target=target, token_counts=None)
    fmt = init_draft_from(path, draft, target)
    progress(f"{path}: {fmt} format, loaded into draft={cfg.draft.kind}")
    return draft.eval()


def load_prompts(path: Path, target: Target, chat_template: str | None) -> list[dict]:
    """A .jsonl file of {"prompt": str, ...} -> eval prompts as train.data builds them: one
    user turn through the run's chat template (data.chat_template) with the generation prompt."""
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {path} does not exist")
    template = resolve_chat_template(target.tokenizer, chat_template)
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {n}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(
                f'{path} line {n}: expected an object with a "prompt" string, e.g. '
                '{"prompt": "Write a haiku about tests."}'
            )
        if not row["prompt"].strip():
            raise ValueError(f'{path} line {n}: "prompt" is empty')
        messages = [{"role": "user", "content": row["prompt"]}]
        ids, _ = tokenize_conversation(
            target.tokenizer, messages, add_generation_prompt=True, chat_template=template
        )
        prompts.append(
            {"category": row.get("category", "chat"), "messages": messages, "input_ids": ids}
        )
    if not prompts:
        raise ValueError(f"{path} has no prompts (one JSON object per line)")
    return prompts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "positional",
        nargs="*",
        metavar="CKPT | OVERRIDE",
        help=f"<run_dir>/checkpoints/{PREFIX}N, or a run directory (its newest checkpoint); "
        "with --init-from: Hydra overrides of conf/train.yaml, e.g. +experiment=medusa_kl",
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
    group = parser.add_argument_group("decoding (default: the run's decode settings)")
    group.add_argument(
        "--tree",
        default=None,
        metavar="NAME",
        help="static | dynamic (draft trees, docs/tree.md) | chain | any conf/decode name",
    )
    group.add_argument(
        "--k", type=int, default=None, metavar="K", help="draft tokens per round (chains)"
    )
    group.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=None,
        metavar="T",
        help="one evaluation per temperature; 0 = greedy (e.g. --temperatures 0 0.7)",
    )
    group.add_argument(
        "--top-p", type=float, default=None, metavar="P", help="applied to p and q; 1 = off"
    )
    group.add_argument(
        "--top-k", type=int, default=None, metavar="N", help="applied to p and q; 0 = off"
    )
    group.add_argument(
        "--max-new-tokens", type=int, default=None, metavar="N", help="new tokens per prompt"
    )
    group.add_argument(
        "--num-prompts", type=int, default=None, metavar="N", help="decode the first N prompts"
    )
    group.add_argument(
        "--seed", type=int, default=None, metavar="S", help="the decoder's sampling seed"
    )
    group.add_argument("--dtype", default=None, help="decoding dtype: bf16 | fp32 | fp16")
    group.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also decode through the compiled path and report its speedup beside the eager "
        "one (<tag>/compiled_*, docs/fastpath.md)",
    )
    group.add_argument(
        "--compile-mode",
        default=None,
        metavar="MODE",
        help="auto | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs | "
        "aot_eager (decode.compile_mode)",
    )
    parser.add_argument(
        "--target-path",
        default=None,
        metavar="DIR",
        help="load the target from this HF directory or hub id instead of the run's target",
    )
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: the run's)")
    parser.add_argument(
        "--out", type=Path, default=None, metavar="FILE.json", help="also write the metrics here"
    )
    args = parser.parse_args(argv)

    ckpt = None
    if args.init_from is not None:
        cfg = composed_config(args.positional, args)
        progress(f"draft.init_from={args.init_from}, draft={cfg.draft.kind}")
    elif len(args.positional) == 1:
        ckpt, run_dir = find_checkpoint(Path(args.positional[0]))
        cfg = run_config(run_dir, args)
        progress(f"checkpoint {ckpt} (run {run_dir})")
    else:
        parser.error("give one CKPT, or --init-from DIR followed by config overrides")
    t0 = time.perf_counter()
    node = OmegaConf.to_container(cfg.target, resolve=True)
    target = hydra.utils.get_method(node.pop("_target_"))(**node)
    progress(f"target {target.name} on {target.device} ({time.perf_counter() - t0:.1f}s)")
    check_decode(cfg.decode)  # the same start-up checks as training (train/settings.py)
    if args.prompts is not None:
        eval_prompts = load_prompts(args.prompts, target, cfg.data.get("chat_template"))
        source = str(args.prompts)
    else:
        progress(
            f"eval prompts of data.source={cfg.data.source!r} (train.data.prepare.prepare_data)"
        )
        data = prepare_data(target, **OmegaConf.to_container(cfg.data, resolve=True))
        eval_prompts = data.eval_prompts
        source = "the run's eval split"
        if not eval_prompts:
            raise ValueError(
                "the run's data config holds no eval prompts (data.num_eval=0); "
                "pass --prompts FILE.jsonl"
            )
    if ckpt is None:
        draft = imported_draft(cfg, args.init_from, target)
    else:
        draft = load_draft(ckpt, target).eval()
    dec = cfg.decode
    num = min(int(dec.get("num_prompts") or len(eval_prompts)), len(eval_prompts))
    tree = dec.get("tree")
    shape = f"{tree.kind} tree" if tree is not None else f"chain k={dec.k}"
    progress(
        f"decoding {num} prompts from {source}, {shape}, temperatures "
        f"{list(dec.temperatures)}, {dec.max_new_tokens} new tokens, {dec.dtype}, AR and "
        "speculative side by side"
    )
    t0 = time.perf_counter()
    result, _ = evaluate_checkpoint(target, draft, eval_prompts, cfg, proxy=None)
    meta = ckpt / "meta.json" if ckpt else None  # the step, as the run's eval records carry it
    result["step"] = json.loads(meta.read_text())["step"] if meta and meta.is_file() else None
    progress(f"done in {time.perf_counter() - t0:.1f}s")
    print(format_eval_table([result]))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))
        progress(f"metrics -> {args.out}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"evaluate.py: error: {err}")
