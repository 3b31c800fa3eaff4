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
env "$export_interp" GWT_CHECK_DEVICE=$DEVICE timeout 150 "$PY" - >> "$REPORT" 2>&1 <<'PYEOF'
import math
import os
import time

import torch

from gwt_optim import GWTAdamW
from gwt_optim.optim import _triton

dev = os.environ["GWT_CHECK_DEVICE"]
tiny = dev == "cpu"  # the rehearsal: interpreter, tiny shapes
compile_opt = "triton" if tiny else None  # on CUDA the default must pick Triton by itself
rows = []


def record(check, value, tol, ok, note=""):
    rows.append((check, value, tol, "ok" if ok else "FAIL", note))


def rel(a, b):
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b))


def attempt(check, fn):
    try:
        fn()
    except Exception as exc:  # keep going: one failure must not hide the rest
        rows.append((check, float("nan"), "", "FAIL", f"{type(exc).__name__}: {exc}"[:300]))


torch.manual_seed(0)
if tiny:
    shapes = [(16, 24), (40, 24), (24, 40), (24,), (10, 30)]
else:  # one LLaMA-130M layer (attention, MLP), a norm weight, a partial last block
    shapes = [(768, 768)] * 4 + [(2048, 768), (2048, 768), (768, 2048), (768,), (100, 30)]
W0 = [torch.randn(s, device=dev) for s in shapes]
grads = [[torch.randn(s, device=dev) for s in shapes] for _ in range(5)]
lrs = [1e-2 / (t + 1) for t in range(5)]


def train(dtype=torch.float32, steps=5, opt_out=None, **kw):
    params = [torch.nn.Parameter(w.clone().to(dtype)) for w in W0]
    # eps = 1e-3: a near-zero approximation amplifies fp32 rounding in its
    # details by up to 1/(eps sqrt(1 - beta2^t)); this bounds it.
    opt = GWTAdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1, **kw)
    for t in range(steps):
        opt.param_groups[0]["lr"] = lrs[t]
        for p, g in zip(params, grads[t]):
            p.grad = g.to(dtype)
        opt.step()
    if opt_out is not None:
        opt_out.append(opt)
    return [p.detach() for p in params]


def backends(opt):
    return sorted(opt._kernels._backends) if opt._kernels else []


def fp32(level, **kw):
    opts = []
    got = train(level=level, compile=compile_opt, opt_out=opts, **kw)
    want = train(level=level, compile=False, **kw)
    err = rel(got, want)
    record(f"fp32 level {level}{' ' + str(kw) if kw else ''}: triton == eager", err, 1e-5,
           err <= 1e-5 and backends(opts[0]) == ["triton"], f"backends {backends(opts[0])}")


t0 = time.perf_counter()
attempt("fp32 level 2", lambda: fp32(2))
first_s = time.perf_counter() - t0
attempt("fp32 level 1", lambda: fp32(1))
attempt("fp32 level 2, detail_clip", lambda: fp32(2, detail_clip=0.5))
attempt("fp32 level 2, no limiter", lambda: fp32(2, norm_growth_limit=None))


def bf16():
    for md in (None, "bfloat16"):
        got = train(torch.bfloat16, level=2, compile=compile_opt, moment_dtype=md)
        want = train(torch.bfloat16, level=2, compile=False, moment_dtype=md)
        same = sum((a == b).sum().item() for a, b in zip(got, want)) / sum(a.numel() for a in got)
        err = rel(got, want)
        record(f"bf16 weights, {md or 'fp32'} moments: share of entries bitwise equal to eager", same, 0.99,
               same >= 0.99 and err <= 2e-2, f"max rel. error {err:.1e}")


attempt("bf16", bf16)


def level0():
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    ref = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)
    for t in range(5):
        ref.param_groups[0]["lr"] = lrs[t]
        for p, g in zip(params, grads[t]):
            p.grad = g.clone()
        ref.step()
    opts = []
    got = train(level=0, scale=1.0, norm_growth_limit=None, compile=compile_opt, opt_out=opts)
    err = rel(got, [p.detach() for p in params])
    record("level 0 (Triton, b = 1) == torch.optim.AdamW", err, 1e-5, err <= 1e-5, f"backends {backends(opts[0])}")


attempt("level 0", level0)


def nonfinite():
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = GWTAdamW(params, lr=1e-2, level=2, compile=compile_opt)
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    opt.step()
    before = [p.detach().clone() for p in params]
    state0 = {k: v.clone() for k, v in opt.state[params[0]].items()}
    bad = [g.clone() for g in grads[1]]
    bad[0][3, 5] = float("nan")
    bad[3][0] = float("inf")  # the 1-D parameter, in the level-0 bucket
    for p, g in zip(params, bad):
        p.grad = g
    opt.step()
    kept = torch.equal(params[0], before[0]) and torch.equal(params[3], before[3]) and all(
        torch.equal(opt.state[params[0]][k], v) for k, v in state0.items() if k != "step")
    moved = not torch.equal(params[1], before[1])
    skips = opt.nonfinite_skips
    record("non-finite gradients: those parameters keep weight and state, the rest step", skips, 2,
           kept and moved and skips == 2, f"kept {kept}, others moved {moved}, nonfinite_skips {skips}")


attempt("non-finite", nonfinite)


def launches_and_sync():
    counts = {"n": 0}
    originals = {k: getattr(_triton, k) for k in ("_launch_phase1", "_launch_limiter", "_launch_phase2")}

    def counting(fn):
        def wrapped(*a, **k):
            counts["n"] += 1
            return fn(*a, **k)
        return wrapped

    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = GWTAdamW(params, lr=1e-2, level=2, compile=compile_opt)
    for t in range(2):
        for p, g in zip(params, grads[t]):
            p.grad = g.clone()
        opt.step()
    for k, fn in originals.items():
        setattr(_triton, k, counting(fn))
    try:
        for p, g in zip(params, grads[2]):
            p.grad = g.clone()  # new gradient tensors: the pointer table is rebuilt
        opt.step()
    finally:
        for k, fn in originals.items():
            setattr(_triton, k, fn)
    # fp32 level-2 matrices and the level-0 (1-D) bucket: 3 launches each
    record(f"kernel launches in one step() of {len(params)} parameters", counts["n"], 6, counts["n"] == 6)
    if dev != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in (3, 4):
            opt.param_groups[0]["lr"] = lrs[t]
            for p, g in zip(params, grads[t]):
                p.grad = g.clone()
            opt.step()
        record("no host synchronization in step() (set_sync_debug_mode('error'), 2 steps)", 0, 0, True)
    except RuntimeError as exc:
        record("no host synchronization in step()", float("nan"), 0, False, str(exc)[:300])
    finally:
        torch.cuda.set_sync_debug_mode(0)


attempt("launches and sync", launches_and_sync)


def step_param_sync():
    """step_param on each weight, as step_in_backward calls it: each
    parameter's own plan, bit-equal to step(), three launches each, no sync."""
    counts = {"n": 0}
    originals = {k: getattr(_triton, k) for k in ("_launch_phase1", "_launch_limiter", "_launch_phase2")}
    each = [torch.nn.Parameter(w.clone()) for w in W0]
    whole = [torch.nn.Parameter(w.clone()) for w in W0]
    opt_each = GWTAdamW(each, lr=1e-2, level=2, compile=compile_opt)
    opt_whole = GWTAdamW(whole, lr=1e-2, level=2, compile=compile_opt)

    def step(t):
        for p, q, g in zip(each, whole, grads[t]):
            p.grad, q.grad = g.clone(), g.clone()
        for p in each:
            opt_each.step_param(p, opt_each.param_groups[0])
            p.grad = None
        opt_whole.step()

    for t in range(2):
        step(t)
    for k, fn in originals.items():
        setattr(_triton, k, lambda *a, _fn=fn, **kw: (counts.__setitem__("n", counts["n"] + 1), _fn(*a, **kw))[1])
    try:
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        for t in (2, 3):
            step(t)
    except RuntimeError as exc:
        record("no host synchronization in step_param", float("nan"), 0, False, str(exc)[:300])
        return
    finally:
        for k, fn in originals.items():
            setattr(_triton, k, fn)
        if dev == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    per_param = (counts["n"] - 2 * 6) / (2 * len(each))  # two steps of step(): 6 launches each
    same = all(torch.equal(p, q) for p, q in zip(each, whole))
    record("step_param on each weight: launches per parameter, no sync, bit-equal to step()", per_param, 3,
           per_param == 3 and same, f"bit-equal to step(): {same}")


attempt("step_param", step_param_sync)


def int64_offsets():
    # More than 2^31 entries in one tensor; with the limiter off each row's
    # update depends on that row only, so a few rows are checked against the
    # eager path on copies of just those rows.
    n = 576
    rows_ = (2**31) // n + 64 if not tiny else 64
    W = torch.nn.Parameter(torch.randn(rows_, n, device=dev, dtype=torch.bfloat16))
    G = torch.randn(rows_, n, device=dev, dtype=torch.bfloat16)
    pick = [0, 1, rows_ // 2, rows_ - 2, rows_ - 1]
    small = torch.nn.Parameter(W.detach()[pick].clone())
    opt = GWTAdamW([W], lr=1e-2, level=2, norm_growth_limit=None, compile=compile_opt)
    W.grad = G
    opt.step()
    ref = GWTAdamW([small], lr=1e-2, level=2, norm_growth_limit=None, compile=False)
    small.grad = G[pick].clone()
    ref.step()
    got = W.detach()[pick]
    same = (got == small.detach()).float().mean().item()
    err = rel([got], [small.detach()])
    record(f"{W.numel() / 2**31:.3f} x 2^31 entries, bf16 (int64 offsets): rows vs eager, share equal", same, 0.99,
           same >= 0.99 and err <= 2e-2 and backends(opt) == ["triton"], f"max rel. error {err:.1e}")
    del W, G, opt


attempt("int64 offsets", int64_offsets)

print("| check | value | target | result | note |")
print("|---|---:|---:|---|---|")
for check, value, tol, res, note in rows:
    v = f"{value:.3g}" if isinstance(value, float) else str(value)
    print(f"| {check} | {v} | {tol} | {res} | {note} |")
print(f"\nFirst triton run incl. compilation: {first_s:.1f} s; torch {torch.__version__}, triton "
      f"{_triton.triton.__version__}")
PYEOF
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
timeout 60 "$PY" - >> "$REPORT" 2>&1 <<'PYEOF'
import time

import torch

from gwt_optim import GWTAdamW

dev = "cuda"
rows = []


def record(check, err, tol):
    rows.append((check, err, tol, "ok" if err <= tol else "FAIL"))


def train(params, opt, grads, lrs=None):
    for t, gs in enumerate(grads):
        if lrs is not None:
            opt.param_groups[0]["lr"] = lrs[t]
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach().float() for p in params]


def rel(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp(min=1e-30)).item() for x, y in zip(a, b))


torch.manual_seed(0)
shapes = [(64, 128), (32, 3, 64), (48, 96), (10, 30)]  # (10, 30): 30 % 4 != 0 takes the eager path
W0 = [torch.randn(s, device=dev) for s in shapes]
grads = [[torch.randn(s, device=dev) for s in shapes] for _ in range(6)]
lrs = [1e-2 / (t + 1) for t in range(6)]


# A near-zero approximation coefficient amplifies float32 rounding in its
# block's details by up to 1/(eps sqrt(1 - beta2^t)); eps = 1e-3 bounds that
# (the eager path, measured the same way, is the yardstick for the fused one).
def run(dtype=torch.float32, grad_dtype=None, **kw):
    params = [torch.nn.Parameter(w.clone().to(dtype)) for w in W0]
    opt = GWTAdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1, **kw)
    gdt = grad_dtype or dtype
    return train(params, opt, [[g.to(gdt).to(dtype) for g in gs] for gs in grads], lrs), opt


# Level 0, alpha 1, no limiter == torch AdamW.
params = [torch.nn.Parameter(w.clone()) for w in W0]
ref = train(params, torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1), grads, lrs)
got, _ = run(level=0, scale=1.0, norm_growth_limit=None)
record("level 0 == torch.optim.AdamW", rel(got, ref), 1e-5)

reference, _ = run(level=2, impl="reference")
t0 = time.perf_counter()
fused, opt = run(level=2, compile=True)
compile_s = time.perf_counter() - t0
backends = sorted(opt._kernels._backends) if opt._kernels else []
record(f"fused ({'+'.join(backends) or 'none'}) == reference, level 2", rel(fused, reference), 1e-4)
eager, _ = run(level=2, compile=False)
record("eager fast == reference, level 2", rel(eager, reference), 1e-4)
for level in (1, 3):
    a, _ = run(level=level, compile=True)
    b, _ = run(level=level, impl="reference")
    record(f"fused == reference, level {level}", rel(a, b), 1e-4)
bf16, _ = run(torch.bfloat16, level=2, compile=True)
fp32, _ = run(grad_dtype=torch.bfloat16, level=2, impl="reference")
record("bf16 params (fp32 moments) vs fp32 on the same gradients", rel(bf16, fp32), 2e-2)

# No recompilation after the first step, with lr and bias corrections changing.
params = [torch.nn.Parameter(w.clone()) for w in W0]
opt = GWTAdamW(params, lr=1e-2, level=2, compile=True)
try:
    for t, gs in enumerate(grads):
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.param_groups[0]["lr"] = lrs[t]
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            opt.step()
    record("no recompiles over 6 steps with a changing lr", 0.0, 0.0)
except Exception as exc:  # torch._dynamo.exc.RecompileError
    rows.append(("no recompiles over 6 steps with a changing lr", float("nan"), 0.0, f"FAIL: {exc}"[:120]))

print("| check | max rel. error | tolerance | result |")
print("|---|---:|---:|---|")
for check, err, tol, res in rows:
    print(f"| {check} | {err:.2e} | {tol:.0e} | {res} |")
print(f"\nFirst fused run incl. torch.compile: {compile_s:.1f} s; torch {torch.__version__}")
PYEOF
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
