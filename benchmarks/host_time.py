"""Host time of ``GWTAdamW.step()`` on the Triton backend, without a GPU
(or, with ``--device cuda``, on one, with the real launches).

``step_param each`` is one ``step_param(p, group)`` per parameter, as
``gwt_optim.step_in_backward`` steps; ``one optimizer per parameter`` is
PyTorch's recipe for the same with its own optimizers, for scale.

On a GPU the Triton step is host-bound when its Python work per parameter
exceeds the kernels' time (about 1 ms for SmolLM2-135M). That Python work does
not depend on the device, so it is measured here on CPU tensors with the
kernel launches replaced by no-ops that count the calls: the Triton backend is
built with ``cpu=True`` (it then takes CPU tensors; the launches never run, so
no kernel sees them).

The parameters are SmolLM2-135M's: its 210 attention and MLP matrices (dims
divided by ``--shrink``, 16 by default: the tables and the Python work do not
depend on sizes, and the moments stay small) and its 61 RMSNorm weights as
1-D parameters (level 0). ``step()`` is timed with ``perf_counter`` over
``--steps`` steps after ``--warmup`` ones; the table gives the median.

Gradients: ``fixed`` keeps the same gradient tensors (pointers unchanged, as
with ``zero_grad(set_to_none=False)`` or DDP's bucket views); ``new`` swaps
between two sets every step (every gradient pointer changes, as with fresh
gradients from each backward).

For comparison, on the same CPU tensors with real compute (tiny at these
sizes): ``torch.optim.AdamW(fused=True)``, and GWT-AdamW on the native C
backend.

    python benchmarks/host_time.py
    python benchmarks/host_time.py --steps 500 --shrink 8
    python benchmarks/host_time.py --device cuda --shrink 1   # on a GPU, real launches

Prints a markdown table and the versions and git commit.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step import SMOLLM2_135M, environment, llama_shapes  # noqa: E402

from gwt_optim import GWTAdamW  # noqa: E402
from gwt_optim.optim import _dispatch  # noqa: E402
from gwt_optim.optim import _triton  # noqa: E402

LAUNCHES = ("_launch_phase1", "_launch_limiter", "_launch_phase2")


def count_launches(run: bool = False) -> dict[str, int]:
    """Count the kernel launches (for the rest of the process); ``run=False``
    replaces them by the counters, ``run=True`` (on a GPU) still launches."""
    counts = {name: 0 for name in LAUNCHES}

    def counting(name):
        launch_for_real = getattr(_triton, name)

        def launch(*args, **meta):
            counts[name] += 1
            if run:
                launch_for_real(*args, **meta)

        return launch

    for name in LAUNCHES:
        setattr(_triton, name, counting(name))
    return counts


def parameters(shrink: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu") -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(max(1, r // shrink), max(1, n // shrink)) for r, n in llama_shapes("smollm2")]
    # input/post-attention norms of each layer and the final norm
    norms = [(max(1, SMOLLM2_135M["hidden_size"] // shrink),)] * (2 * SMOLLM2_135M["num_hidden_layers"] + 1)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes + norms]


class PerParameter:
    """One torch optimizer per parameter, each stepped alone: PyTorch's recipe
    for an optimizer step inside backward (its "optimizer in backward" tutorial)."""

    def __init__(self, params: list, make) -> None:
        self.optimizers = [make([p]) for p in params]
        self.param_groups = []

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


def time_steps(opt: torch.optim.Optimizer, params: list, grads: list[list], warmup: int, steps: int,
               counts: dict[str, int], per_param: bool = False) -> list[float]:
    """Host seconds of each timed step: ``step()``, or with ``per_param``
    one ``step_param`` per parameter (as stepping inside backward does)."""
    owners = [(p, g) for g in opt.param_groups for p in g["params"]]
    cuda = params[0].device.type == "cuda"
    times = []
    for t in range(warmup + steps):
        if t == warmup:
            counts.update(dict.fromkeys(counts, 0))
        for p, g in zip(params, grads[t % len(grads)]):
            p.grad = g
        t0 = time.perf_counter()
        if per_param:  # with its group, as step_in_backward passes it
            for p, group in owners:
                opt.step_param(p, group)
        else:
            opt.step()
        dt = time.perf_counter() - t0
        if cuda:  # host time only: the queued kernels finish outside the timing
            torch.cuda.synchronize()
        if t >= warmup:
            times.append(dt)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="timed steps per case (median reported)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--shrink", type=int, default=16, help="divide SmolLM2's matrix dims by this")
    ap.add_argument("--level", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: real tensors and real launches (counted, not mocked); host time of step() alone")
    args = ap.parse_args()

    cuda = args.device == "cuda"
    counts = count_launches(run=cuda)
    if not cuda:
        _dispatch.BACKENDS["triton"] = lambda: _triton.TritonBackend(cpu=True)
    mocked = "" if cuda else ", launches mocked"

    print(f"<!-- {environment()} -->")
    print("| optimizer | dtype | gradients | host ms/step | launches/step | parameters |")
    print("|---|---|---|---:|---:|---|")
    for dtype in (torch.float32, torch.bfloat16):
        triton = lambda p: GWTAdamW(p, lr=1e-3, level=args.level, backend="triton")  # noqa: E731
        where = "CUDA" if cuda else "CPU, computes"
        cases = [
            (f"GWT-AdamW l={args.level} (triton{mocked})", "fixed", triton),
            (f"GWT-AdamW l={args.level} (triton{mocked})", "new", triton),
            # what gwt_optim.step_in_backward costs: one step_param per weight
            (f"GWT-AdamW l={args.level} (triton{mocked}), step_param each", "new", triton),
            (f"AdamW fused ({where})", "fixed", lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)),
            # what stepping inside backward costs with torch's own optimizers
            (f"AdamW fused ({where}), one optimizer per parameter", "new",
             lambda p: PerParameter(p, lambda q: torch.optim.AdamW(q, lr=1e-3, fused=True))),
        ]
        if not cuda:
            cases.append((f"GWT-AdamW l={args.level} (native, computes)", "fixed",
                          lambda p: GWTAdamW(p, lr=1e-3, level=args.level, backend="native")))
        for label, grad_kind, make in cases:
            params = parameters(args.shrink, dtype, device=args.device)
            gen = torch.Generator().manual_seed(1)
            sets = 2 if grad_kind == "new" else 1
            grads = [[torch.randn(p.shape, generator=gen).to(args.device, dtype) for p in params] for _ in range(sets)]
            opt = make(params)
            times = time_steps(opt, params, grads, args.warmup, args.steps, counts, "step_param" in label)
            launched = sum(counts.values()) / args.steps
            n_mat = sum(p.ndim >= 2 for p in params)
            ms = statistics.median(times) * 1e3
            print(f"| {label} | {str(dtype).replace('torch.', '')} | {grad_kind} | {ms:.3f} | "
                  f"{launched:.1f} | {n_mat} matrices + {len(params) - n_mat} vectors |", flush=True)
    print(f"\n{environment()}")


if __name__ == "__main__":
    main()
