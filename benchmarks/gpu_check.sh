#!/usr/bin/env bash
# GWT-AdamW on a CUDA GPU in one short run (a few minutes on an H200, offline):
#
#   1. correctness on CUDA: level 0 against torch.optim.AdamW, the fused
#      (torch.compile) and eager fast paths against the reference path, bf16
#      parameters, and no recompilation across steps with a changing lr;
#   2. step time of GWT-AdamW (fused, eager, reference) against fused and
#      foreach AdamW on the LLaMA-60M and -130M attention/MLP weights
#      (benchmarks/step.py).
#
#   bash benchmarks/gpu_check.sh             # prints markdown
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # also writes $OUT/gpu_step.md
#
# Needs only a Python with a CUDA build of torch (taken from $PYTHON, .venv or
# the PATH, the first that sees a GPU); the package runs from src/ via
# PYTHONPATH, so nothing is installed or downloaded.
set -uo pipefail
cd "$(dirname "$0")/.."

PY=""
for cand in ${PYTHON:-} .venv/bin/python python3 python; do
  if command -v "$cand" >/dev/null 2>&1 &&
     "$cand" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=$cand
    break
  fi
done
if [[ -z "$PY" ]]; then
  echo "gpu_check: no Python with a CUDA build of torch that sees a GPU (set PYTHON=...)" >&2
  exit 1
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
REPORT=$(mktemp)
trap 'rm -f "$REPORT"' EXIT

{
  echo "# GWT-AdamW on $("$PY" -c 'import torch; print(torch.cuda.get_device_name())')"
  echo
  echo "## Correctness on CUDA"
  echo
} >> "$REPORT"

timeout 240 "$PY" - >> "$REPORT" 2>&1 <<'PYEOF'
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

{
  echo
  echo "## Step time (benchmarks/step.py --device cuda --config 60m,130m)"
  echo
} >> "$REPORT"
timeout 300 "$PY" benchmarks/step.py --device cuda --config 60m,130m --rounds 5 --steps 10 \
  --only "AdamW fused,AdamW foreach,GWT-AdamW l=1,GWT-AdamW l=2,GWT-AdamW l=3" >> "$REPORT" 2>&1
status=$?
[[ $status -eq 0 ]] || echo "step benchmark exited with status $status" >> "$REPORT"

cat "$REPORT"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT" && cp "$REPORT" "$OUT/gpu_step.md"
fi
