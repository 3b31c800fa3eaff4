"""The Python checks of ``benchmarks/gpu_check.sh``, as a module.

Two sections of the shell script run here; the others time the step with
``benchmarks/step.py``.

``triton`` (section 1)
    The Triton backend against the eager path on the LLaMA-130M
    attention/MLP shapes: fp32 at levels 1 and 2, with ``detail_clip`` and
    without the limiter; bf16 weights with fp32 and bf16 moments; level 0
    against ``torch.optim.AdamW``; non-finite gradients; launches per step and
    no host synchronization in ``step()`` nor in ``step_param`` on each weight
    (bit-equal to ``step()``); a tensor of more than 2^31 entries (int64
    offsets).
``older`` (section 3)
    Level 0 against ``torch.optim.AdamW``, the fused and eager fast paths
    against the reference path at levels 1-3, bf16 weights, and no
    recompilation over steps with a changing learning rate.

::

    python benchmarks/gpu_check.py triton                   # on CUDA
    python benchmarks/gpu_check.py triton --device cpu      # Triton's interpreter, tiny shapes
    python benchmarks/gpu_check.py triton --device cpu --checks level-0,non-finite
    python benchmarks/gpu_check.py older

Each prints a markdown table and exits 0: a check that fails or raises is a
FAIL row, so one failure does not hide the others and the shell script's
report keeps every section. Exit status 2 means the checks could not start
(no CUDA for ``--device cuda``, a bad argument).

``--device cpu`` needs Triton's interpreter, which Triton picks when it is
first imported: ``TRITON_INTERPRET=1`` is set here when Triton has not been
imported yet (``gpu_check.sh`` sets it in the environment for the rehearsal).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

__all__ = ["TRITON_CHECKS", "TritonChecks", "run_triton", "triton_table", "run_older", "older_table",
           "parse_args", "main"]

# (check, value, target, result, note)
Row = tuple[str, Any, Any, str, str]


def rel(a, b) -> float:
    """The largest relative error of any pair of tensors, against each ``b``'s largest entry."""
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp(min=1e-30)).item()
               for x, y in zip(a, b))


def _launch_names() -> tuple[str, ...]:
    return ("_launch_phase1", "_launch_limiter", "_launch_phase2")


# --------------------------------------------------------------------------- #
# Section 1: the Triton backend against the eager path
# --------------------------------------------------------------------------- #


class TritonChecks:
    """One problem (weights, five steps of gradients, learning rates) and the
    checks that run on it; each check appends its rows to :attr:`rows`.

    On ``"cpu"`` (the rehearsal) the shapes are tiny and ``backend="triton"``
    is forced; on CUDA the default (``backend="auto"``) must pick Triton itself.
    """

    def __init__(self, device: str) -> None:
        import torch

        self.device = device
        self.tiny = device == "cpu"
        self.backend = "triton" if self.tiny else "auto"
        self.rows: list[Row] = []
        torch.manual_seed(0)
        if self.tiny:
            shapes = [(16, 24), (40, 24), (24, 40), (24,), (10, 30)]
        else:  # one LLaMA-130M layer (attention, MLP), a norm weight, a partial last block
            shapes = [(768, 768)] * 4 + [(2048, 768), (2048, 768), (768, 2048), (768,), (100, 30)]
        self.W0 = [torch.randn(s, device=device) for s in shapes]
        self.grads = [[torch.randn(s, device=device) for s in shapes] for _ in range(5)]
        self.lrs = [1e-2 / (t + 1) for t in range(5)]

    def record(self, check: str, value: Any, tol: Any, ok: bool, note: str = "") -> None:
        self.rows.append((check, value, tol, "ok" if ok else "FAIL", note))

    def attempt(self, check: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # keep going: one failure must not hide the rest
            self.rows.append((check, float("nan"), "", "FAIL", f"{type(exc).__name__}: {exc}"[:300]))

    def train(self, dtype=None, steps: int = 5, opt_out: list | None = None, **kw):
        import torch

        from gwt_optim import GWTAdamW

        dtype = dtype or torch.float32
        params = [torch.nn.Parameter(w.clone().to(dtype)) for w in self.W0]
        # eps = 1e-3: a near-zero approximation amplifies fp32 rounding in its
        # details by up to 1/(eps sqrt(1 - beta2^t)); this bounds it.
        opt = GWTAdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1, **kw)
        for t in range(steps):
            opt.param_groups[0]["lr"] = self.lrs[t]
            for p, g in zip(params, self.grads[t]):
                p.grad = g.to(dtype)
            opt.step()
        if opt_out is not None:
            opt_out.append(opt)
        return [p.detach() for p in params]

    @staticmethod
    def backends(opt) -> list[str]:
        return sorted(opt._kernels._backends) if opt._kernels else []

    def fp32(self, level: int, **kw) -> None:
        opts: list = []
        got = self.train(level=level, backend=self.backend, opt_out=opts, **kw)
        want = self.train(level=level, backend="eager", **kw)
        err = rel(got, want)
        self.record(f"fp32 level {level}{' ' + str(kw) if kw else ''}: triton == eager", err, 1e-5,
                    err <= 1e-5 and self.backends(opts[0]) == ["triton"], f"backends {self.backends(opts[0])}")

    def bf16(self) -> None:
        import torch

        for md in (None, "bfloat16"):
            got = self.train(torch.bfloat16, level=2, backend=self.backend, moment_dtype=md)
            want = self.train(torch.bfloat16, level=2, backend="eager", moment_dtype=md)
            same = sum((a == b).sum().item() for a, b in zip(got, want)) / sum(a.numel() for a in got)
            err = rel(got, want)
            self.record(f"bf16 weights, {md or 'fp32'} moments: share of entries bitwise equal to eager", same, 0.99,
                        same >= 0.99 and err <= 2e-2, f"max rel. error {err:.1e}")

    def level0(self) -> None:
        import torch

        params = [torch.nn.Parameter(w.clone()) for w in self.W0]
        ref = torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)
        for t in range(5):
            ref.param_groups[0]["lr"] = self.lrs[t]
            for p, g in zip(params, self.grads[t]):
                p.grad = g.clone()
            ref.step()
        opts: list = []
        got = self.train(level=0, scale=1.0, norm_growth_limit=None, backend=self.backend, opt_out=opts)
        err = rel(got, [p.detach() for p in params])
        self.record("level 0 (Triton, b = 1) == torch.optim.AdamW", err, 1e-5, err <= 1e-5,
                    f"backends {self.backends(opts[0])}")

    def nonfinite(self) -> None:
        import torch

        from gwt_optim import GWTAdamW

        params = [torch.nn.Parameter(w.clone()) for w in self.W0]
        opt = GWTAdamW(params, lr=1e-2, level=2, backend=self.backend)
        for p, g in zip(params, self.grads[0]):
            p.grad = g.clone()
        opt.step()
        before = [p.detach().clone() for p in params]
        state0 = {k: v.clone() for k, v in opt.state[params[0]].items()}
        bad = [g.clone() for g in self.grads[1]]
        bad[0][3, 5] = float("nan")
        bad[3][0] = float("inf")  # the 1-D parameter, in the level-0 bucket
        for p, g in zip(params, bad):
            p.grad = g
        opt.step()
        kept = torch.equal(params[0], before[0]) and torch.equal(params[3], before[3]) and all(
            torch.equal(opt.state[params[0]][k], v) for k, v in state0.items() if k != "step")
        moved = not torch.equal(params[1], before[1])
        skips = opt.nonfinite_skips
        self.record("non-finite gradients: those parameters keep weight and state, the rest step", skips, 2,
                    kept and moved and skips == 2, f"kept {kept}, others moved {moved}, nonfinite_skips {skips}")

    def launches_and_sync(self) -> None:
        import torch

        from gwt_optim import GWTAdamW
        from gwt_optim.optim import _triton

        counts = {"n": 0}
        originals = {k: getattr(_triton, k) for k in _launch_names()}

        def counting(fn):
            def wrapped(*a, **k):
                counts["n"] += 1
                return fn(*a, **k)
            return wrapped

        params = [torch.nn.Parameter(w.clone()) for w in self.W0]
        opt = GWTAdamW(params, lr=1e-2, level=2, backend=self.backend)
        for t in range(2):
            for p, g in zip(params, self.grads[t]):
                p.grad = g.clone()
            opt.step()
        for k, fn in originals.items():
            setattr(_triton, k, counting(fn))
        try:
            for p, g in zip(params, self.grads[2]):
                p.grad = g.clone()  # new gradient tensors: the pointer table is rebuilt
            opt.step()
        finally:
            for k, fn in originals.items():
                setattr(_triton, k, fn)
        # fp32 level-2 matrices and the level-0 (1-D) bucket: 3 launches each
        self.record(f"kernel launches in one step() of {len(params)} parameters", counts["n"], 6, counts["n"] == 6)
        if self.device != "cuda":
            return
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in (3, 4):
                opt.param_groups[0]["lr"] = self.lrs[t]
                for p, g in zip(params, self.grads[t]):
                    p.grad = g.clone()
                opt.step()
            self.record("no host synchronization in step() (set_sync_debug_mode('error'), 2 steps)", 0, 0, True)
        except RuntimeError as exc:
            self.record("no host synchronization in step()", float("nan"), 0, False, str(exc)[:300])
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def step_param_sync(self) -> None:
        """step_param on each weight, as step_in_backward calls it: each
        parameter's own plan, bit-equal to step(), three launches each, no sync."""
        import torch

        from gwt_optim import GWTAdamW
        from gwt_optim.optim import _triton

        counts = {"n": 0}
        originals = {k: getattr(_triton, k) for k in _launch_names()}
        each = [torch.nn.Parameter(w.clone()) for w in self.W0]
        whole = [torch.nn.Parameter(w.clone()) for w in self.W0]
        opt_each = GWTAdamW(each, lr=1e-2, level=2, backend=self.backend)
        opt_whole = GWTAdamW(whole, lr=1e-2, level=2, backend=self.backend)

        def step(t):
            for p, q, g in zip(each, whole, self.grads[t]):
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
            if self.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            for t in (2, 3):
                step(t)
        except RuntimeError as exc:
            self.record("no host synchronization in step_param", float("nan"), 0, False, str(exc)[:300])
            return
        finally:
            for k, fn in originals.items():
                setattr(_triton, k, fn)
            if self.device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        per_param = (counts["n"] - 2 * 6) / (2 * len(each))  # two steps of step(): 6 launches each
        same = all(torch.equal(p, q) for p, q in zip(each, whole))
        self.record("step_param on each weight: launches per parameter, no sync, bit-equal to step()", per_param, 3,
                    per_param == 3 and same, f"bit-equal to step(): {same}")

    def int64_offsets(self) -> None:
        # More than 2^31 entries in one tensor; with the limiter off each row's
        # update depends on that row only, so a few rows are checked against the
        # eager path on copies of just those rows.
        import torch

        from gwt_optim import GWTAdamW

        dev = self.device
        n = 576
        rows_ = (2**31) // n + 64 if not self.tiny else 64
        W = torch.nn.Parameter(torch.randn(rows_, n, device=dev, dtype=torch.bfloat16))
        G = torch.randn(rows_, n, device=dev, dtype=torch.bfloat16)
        pick = [0, 1, rows_ // 2, rows_ - 2, rows_ - 1]
        small = torch.nn.Parameter(W.detach()[pick].clone())
        opt = GWTAdamW([W], lr=1e-2, level=2, norm_growth_limit=None, backend=self.backend)
        W.grad = G
        opt.step()
        ref = GWTAdamW([small], lr=1e-2, level=2, norm_growth_limit=None, backend="eager")
        small.grad = G[pick].clone()
        ref.step()
        got = W.detach()[pick]
        same = (got == small.detach()).float().mean().item()
        err = rel([got], [small.detach()])
        self.record(f"{W.numel() / 2**31:.3f} x 2^31 entries, bf16 (int64 offsets): rows vs eager, share equal", same,
                    0.99, same >= 0.99 and err <= 2e-2 and self.backends(opt) == ["triton"],
                    f"max rel. error {err:.1e}")
        del W, G, opt


# name on the command line -> (label of a check that raised, the check); in the report's order.
TRITON_CHECKS: dict[str, tuple[str, Callable[[TritonChecks], None]]] = {
    "fp32-level-2": ("fp32 level 2", lambda c: c.fp32(2)),
    "fp32-level-1": ("fp32 level 1", lambda c: c.fp32(1)),
    "fp32-detail-clip": ("fp32 level 2, detail_clip", lambda c: c.fp32(2, detail_clip=0.5)),
    "fp32-no-limiter": ("fp32 level 2, no limiter", lambda c: c.fp32(2, norm_growth_limit=None)),
    "bf16": ("bf16", TritonChecks.bf16),
    "level-0": ("level 0", TritonChecks.level0),
    "non-finite": ("non-finite", TritonChecks.nonfinite),
    "launches-and-sync": ("launches and sync", TritonChecks.launches_and_sync),
    "step-param": ("step_param", TritonChecks.step_param_sync),
    "int64-offsets": ("int64 offsets", TritonChecks.int64_offsets),
}


def run_triton(device: str, names: Sequence[str] | None = None) -> tuple[list[Row], float]:
    """The rows of the chosen checks (all by default, in the report's order),
    and the seconds the first one took (it includes compiling the kernels)."""
    # Imported before any check: without Triton the section stops here with
    # one traceback instead of a FAIL row per check.
    from gwt_optim.optim import _triton  # noqa: F401

    checks = TritonChecks(device)
    first_s = 0.0
    for i, name in enumerate(n for n in TRITON_CHECKS if names is None or n in names):
        label, check = TRITON_CHECKS[name]
        t0 = time.perf_counter()
        checks.attempt(label, lambda: check(checks))
        if i == 0:
            first_s = time.perf_counter() - t0
    return checks.rows, first_s


def triton_table(rows: Sequence[Row], first_s: float) -> str:
    import torch

    from gwt_optim.optim import _triton

    lines = ["| check | value | target | result | note |", "|---|---:|---:|---|---|"]
    for check, value, tol, res, note in rows:
        v = f"{value:.3g}" if isinstance(value, float) else str(value)
        lines.append(f"| {check} | {v} | {tol} | {res} | {note} |")
    lines.append(f"\nFirst triton run incl. compilation: {first_s:.1f} s; torch {torch.__version__}, triton "
                 f"{_triton.triton.__version__}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Section 3: the older checks
# --------------------------------------------------------------------------- #


def run_older(device: str = "cuda") -> tuple[list[tuple[str, float, float, str]], float]:
    """The rows (check, max rel. error, tolerance, result) and the seconds of
    the first fused run (it includes building the kernels)."""
    import torch

    from gwt_optim import GWTAdamW

    dev = device
    rows: list[tuple[str, float, float, str]] = []

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
    fused, opt = run(level=2, fused=True)
    compile_s = time.perf_counter() - t0
    backends = sorted(opt._kernels._backends) if opt._kernels else []
    record(f"fused ({'+'.join(backends) or 'none'}) == reference, level 2", rel(fused, reference), 1e-4)
    eager, _ = run(level=2, backend="eager")
    record("eager fast == reference, level 2", rel(eager, reference), 1e-4)
    for level in (1, 3):
        a, _ = run(level=level, fused=True)
        b, _ = run(level=level, impl="reference")
        record(f"fused == reference, level {level}", rel(a, b), 1e-4)
    bf16, _ = run(torch.bfloat16, level=2, fused=True)
    fp32, _ = run(grad_dtype=torch.bfloat16, level=2, impl="reference")
    record("bf16 params (fp32 moments) vs fp32 on the same gradients", rel(bf16, fp32), 2e-2)

    # No recompilation after the first step, with lr and bias corrections changing.
    params = [torch.nn.Parameter(w.clone()) for w in W0]
    opt = GWTAdamW(params, lr=1e-2, level=2, fused=True)
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
    return rows, compile_s


def older_table(rows: Sequence[tuple[str, float, float, str]], compile_s: float) -> str:
    import torch

    lines = ["| check | max rel. error | tolerance | result |", "|---|---:|---:|---|"]
    lines += [f"| {check} | {err:.2e} | {tol:.0e} | {res} |" for check, err, tol, res in rows]
    lines.append(f"\nFirst fused run incl. torch.compile: {compile_s:.1f} s; torch {torch.__version__}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Command line
# --------------------------------------------------------------------------- #


def _check_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRITON_CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown check(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(TRITON_CHECKS)}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="section", required=True, metavar="SECTION")
    t = sub.add_parser("triton", help="section 1: the Triton backend against the eager path")
    t.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default), or cpu: Triton's interpreter on tiny shapes (the rehearsal)")
    t.add_argument("--checks", type=_check_names, default=None,
                   help=f"comma-separated, default all: {', '.join(TRITON_CHECKS)}")
    o = sub.add_parser("older", help="section 3: level 0, fused and eager against the reference, no recompiles")
    o.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default); cpu checks the native C kernels instead")
    return p.parse_args(argv)


def _not_ready(args: argparse.Namespace) -> str | None:
    """Why the chosen section cannot start here, or None."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        return ("CUDA is not available here (no GPU, or a CPU build of torch); "
                "`triton --device cpu` runs section 1 in Triton's interpreter")
    if args.section == "triton" and args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            return "--device cpu needs TRITON_INTERPRET=1 in the environment before Triton is imported"
        os.environ["TRITON_INTERPRET"] = "1"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    problem = _not_ready(args)
    if problem is not None:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    if args.section == "triton":
        print(triton_table(*run_triton(args.device, args.checks)))
    else:
        print(older_table(*run_older(args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
