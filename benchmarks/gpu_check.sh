#!/usr/bin/env bash
# GWT-AdamW on a CUDA GPU in one short run (about 4 minutes on an H200 plus a sweep of at most 3, offline),
# most important first:
#
#   1. the Triton backend (docs/fast-step.md) against the eager path on the
#      LLaMA-130M attention/MLP shapes, fp32 and bf16, detail_clip, level 0,
#      non-finite gradients, a > 2^31-entry tensor (int64 offsets), launches
#      per step, and no host synchronization in step() (sync debug mode), nor
#      in step_param on each weight (bit-equal to step(), 3 launches each);
#   2. benchmarks/step.py --device cuda: GPU (CUDA-event) time, host time and
#      achieved GB/s of step() for GWT-AdamW (Triton) against fused AdamW, on
#      LLaMA-130M's shapes and SmolLM2-135M's 210 matrices, fp32 and bf16;
#   3. the older checks: level 0 against torch.optim.AdamW, the Triton and
#      eager fast paths against the reference path, no recompilation;
#   4. a sweep of the Triton kernels' chunk size and num_warps
#      (GWT_TRITON_CHUNK, GWT_TRITON_WARPS) on SmolLM2-135M's matrices, fp32
#      and bf16: GPU time and GB/s per configuration, to pick the defaults
#      (at most about 3 minutes; configurations left when time is up are skipped).
#
#   bash benchmarks/gpu_check.sh                 # prints markdown
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # also writes $OUT/gpu_step.md (+ JSON)
#   GPU_CHECK_DRY=1 bash benchmarks/gpu_check.sh # CPU rehearsal: section 1 in Triton's
#                                                # interpreter on tiny shapes, 2 on CPU
#
# Sections 1 and 3 are benchmarks/gpu_check.py (`triton` and `older`), which
# runs on its own too: python benchmarks/gpu_check.py --help.
#
# Needs only a Python with a CUDA build of torch and triton (taken from
# $PYTHON, .venv or the PATH, the first that sees a GPU); the package runs
# from src/ via PYTHONPATH, so nothing is installed or downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=${GPU_CHECK_DRY:-0}
# GPU_CHECK_SECTIONS=1 or =2,3 runs only those sections (benchmarks/device_session.sh
# runs the correctness section beside a training sweep and times the step alone).
SECTIONS=",${GPU_CHECK_SECTIONS:-1,2,3,4},"
want() { [[ "$SECTIONS" == *",$1,"* ]]; }
PY=""
for cand in ${PYTHON:-} .venv/bin/python python3 python; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=$cand
    break
  fi
done
if [[ -z "$PY" && "$DRY" == 1 ]]; then
  PY=${PYTHON:-.venv/bin/python}
fi
if [[ -z "$PY" ]]; then
  echo "gpu_check: no Python with a CUDA build of torch that sees a GPU (set PYTHON=...)" >&2
  exit 1
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT

JSON_DIR=$(mktemp -d)
trap 'rm -f "$REPORT"; rm -rf "$JSON_DIR"' EXIT
if [[ "$DRY" == 1 ]]; then
  DEVICE=cpu
  GPU_NAME="CPU rehearsal (GPU_CHECK_DRY=1)"
else
  DEVICE=cuda
  GPU_NAME=$("$PY" -c 'import torch; print(torch.cuda.get_device_name())')
fi

if want 1; then
{
  echo "# GWT-AdamW on $GPU_NAME"
  echo
  echo "## 1. The Triton backend against the eager path"
  echo
} >> "$REPORT"

# TRITON_INTERPRET must be set before triton is imported, so only in the rehearsal.
if [[ "$DRY" == 1 ]]; then export_interp="TRITON_INTERPRET=1"; else export_interp="GWT_CHECK_UNUSED=1"; fi
env "$export_interp" timeout 150 "$PY" benchmarks/gpu_check.py triton --device "$DEVICE" >> "$REPORT" 2>&1
status=$?
[[ $status -eq 0 ]] || echo "triton check exited with status $status" >> "$REPORT"
fi

if want 2; then
if [[ "$DRY" == 1 ]]; then
  CONFIGS=9m,smollm2; ONLY="AdamW fused,GWT-AdamW l=2"; ROUNDS=1; STEPS=1
else
  CONFIGS=130m,smollm2; ONLY="AdamW fused,GWT-AdamW l=2 (triton)"; ROUNDS=5; STEPS=10
fi
for dtype in float32 bfloat16; do
  {
    echo
    echo "## 2. Step time, $dtype (benchmarks/step.py --device $DEVICE --config $CONFIGS --dtype $dtype)"
    echo
  } >> "$REPORT"
  timeout 75 "$PY" benchmarks/step.py --device $DEVICE --config $CONFIGS --rounds $ROUNDS --steps $STEPS \
    --dtype $dtype --only "$ONLY" --json "$JSON_DIR/step_$dtype.json" >> "$REPORT" 2>&1
  status=$?
  [[ $status -eq 0 ]] || echo "step benchmark ($dtype) exited with status $status" >> "$REPORT"
done

if [[ "$DRY" != 1 && "${GPU_CHECK_LEVELS:-1}" != 0 ]]; then
  {
    echo
    echo "## 2b. Levels 1 and 3 (smollm2, fp32)"
    echo
  } >> "$REPORT"
  timeout 75 "$PY" benchmarks/step.py --device cuda --config smollm2 --rounds 3 --steps 5 \
    --only "AdamW fused,GWT-AdamW l=1 (triton),GWT-AdamW l=3 (triton)" \
    --json "$JSON_DIR/step_levels.json" >> "$REPORT" 2>&1
  status=$?
  [[ $status -eq 0 ]] || echo "step benchmark (levels) exited with status $status" >> "$REPORT"
fi
fi

if want 3; then
{
  echo
  echo "## 3. Older checks on $DEVICE"
  echo
} >> "$REPORT"

if [[ "$DRY" == 1 ]]; then
  echo "(skipped in the rehearsal)" >> "$REPORT"
else
timeout 60 "$PY" benchmarks/gpu_check.py older >> "$REPORT" 2>&1
status=$?
[[ $status -eq 0 ]] || echo "correctness check exited with status $status" >> "$REPORT"
fi
fi

if want 4 && [[ "$DRY" != 1 ]]; then
{
  echo
  echo "## 4. Chunk and num_warps of the Triton kernels (GWT_TRITON_CHUNK, GWT_TRITON_WARPS; smollm2, l=2)"
  echo
  echo "Defaults: chunk 4096, num_warps 4. Each row: benchmarks/step.py --rounds 3 --steps 5 under that setting."
  echo
} >> "$REPORT"
SWEEP_START=$SECONDS
for dtype in float32 bfloat16; do
  for config in 4096:4 2048:4 8192:4 4096:8 8192:8 16384:8; do
    if (( SECONDS - SWEEP_START > 180 )); then
      echo "- $dtype chunk:warps $config skipped: the sweep's 3 minutes are up" >> "$REPORT"
      continue
    fi
    echo "- $dtype, chunk:warps $config" >> "$REPORT"
    GWT_TRITON_CHUNK=${config%%:*} GWT_TRITON_WARPS=${config##*:} timeout 60 "$PY" benchmarks/step.py --device cuda \
      --config smollm2 --rounds 3 --steps 5 --dtype $dtype --only "AdamW fused,GWT-AdamW l=2 (triton)" \
      2>&1 | grep -E "^\| smollm2" >> "$REPORT"
  done
done
fi

cat "$REPORT"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT" && cp "$REPORT" "$OUT/gpu_step.md" && cp "$JSON_DIR"/*.json "$OUT"/ 2>/dev/null
fi
exit 0
