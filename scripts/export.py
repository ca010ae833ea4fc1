"""Export a trained draft checkpoint in a layout a serving engine loads (train/formats/export.py).

    python scripts/export.py runs/distill_kl/seed0/checkpoints/step_00000120 --format hf --out out/draft
    python scripts/export.py CKPT --format medusa --out out/medusa           # FasterDecoding/Medusa
    python scripts/export.py CKPT --format vllm-medusa --out out/vllm_medusa # vLLM's Medusa
    python scripts/export.py CKPT --format hf --out out/medusa2_target       # Medusa-2: merged target
    python scripts/export.py CKPT --format speculators --out out/eagle3      # EAGLE-3: vLLM, speculators
    python scripts/export.py CKPT --format eagle --out out/eagle3            # EAGLE-3: SGLang/SpecForge; EAGLE-1: vLLM

CKPT is a `<run_dir>/checkpoints/step_N` directory; its config.yaml (for an older checkpoint,
the run's) names the target. `--format speculators` also writes the served target's id
(`--verifier`, default: the target's hub id where the config names one) and the draft length
per round (`--speculative-tokens`, default: the run's decode.k).
Which draft kind is written as which format (`--help`; train/formats/kinds.py) is checked
from the checkpoint's draft.yaml before the target loads. Formats, what each engine needs and
what is refused: docs/export.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from train.formats.eagle import hub_id
from train.formats.export import (
    ExportError,
    check_out_dir,
    check_served_settings,
    checkpoint_config,
    export,
    load_run_draft,
)
from train.formats.kinds import FORMATS, check_kind_format, checkpoint_export_kind, formats_by_kind
from train.run.identity import read_identity


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "checkpoint", type=Path, metavar="CKPT", help="<run_dir>/checkpoints/step_N"
    )
    parser.add_argument(
        "--format",
        required=True,
        choices=FORMATS,
        help=f"what each draft kind is written as: {formats_by_kind()} (docs/export.md)",
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty DIR")
    parser.add_argument("--device", default="cpu", help="where to load the target (default cpu)")
    parser.add_argument(
        "--verifier",
        metavar="ID",
        help="speculators: the hub id or path the engine loads the target from (default: the "
        "target's hub id where known, e.g. HuggingFaceTB/SmolLM2-135M-Instruct for the embedded one)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        metavar="K",
        help="speculators: draft tokens per round the engine proposes (default: the run's decode.k)",
    )
    args = parser.parse_args(argv)
    if not args.checkpoint.is_dir():
        raise FileNotFoundError(
            f"checkpoint {args.checkpoint} does not exist; give a <run_dir>/checkpoints/step_N "
            "directory written by a draftlab training run"
        )
    verifier, k = args.verifier, args.speculative_tokens
    try:  # everything refusable is refused before the target loads
        check_out_dir(args.out, args.overwrite)
        check_kind_format(checkpoint_export_kind(args.checkpoint), args.format)
        if args.format == "speculators":  # defaults from the run's config, checked before loading
            cfg = checkpoint_config(args.checkpoint)
            verifier = verifier or hub_id(cfg.get("target") or {})
            k = k if k is not None else (cfg.get("decode") or {}).get("k")
        check_served_settings(args.format, verifier, k)
    except ExportError as err:
        sys.exit(f"export refused, nothing written: {err}")
    draft, target = load_run_draft(args.checkpoint, device=args.device)
    try:
        identity = read_identity(args.checkpoint)  # refused if the target is another one
        out = export(draft, target, args.format, args.out, args.overwrite, verifier, k, identity)
    except ExportError as err:
        sys.exit(f"export refused, nothing written: {err}")
    served = ""
    if args.format == "speculators":  # as written: DFlash and MTP carry their own draft length
        written = json.loads((out / "config.json").read_text())["speculators_config"]
        tokens = written["proposal_methods"][0]["speculative_tokens"]
        served = f" (verifier {verifier}, {tokens} speculative tokens)"
    print(f"{args.format} export of {args.checkpoint} -> {out}{served}")
    return out


if __name__ == "__main__":
    try:
        main()
    except (FileNotFoundError, FileExistsError, ValueError) as err:  # one line, no traceback
        sys.exit(f"export.py: error: {err}")
