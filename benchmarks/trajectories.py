"""Bit-equality of whole optimizer trajectories across two trees: the check for
a refactor that must not change a bit (issue 17). ``native_ab.py`` compares
the C kernels of two commits; this compares what users get from the Python
step around them.

``record OUT`` runs about 120 configurations (GWT-AdamW through the native
kernels at levels 0-3 in fp32, fp64 and bf16, clip on and off, limiter on and
off, by ``step()`` and by ``step_param``; the eager and reference paths with
fp32, bf16 and int8 moments; every family; with ``TRITON_INTERPRET=1`` also the
Triton backend in its interpreter), each for a few steps with a NaN gradient
on the way, and saves the weights, the state, the param groups and the saved
state dict's bytes. ``compare A B`` prints a table of what differs.

    PYTHONPATH=OLD/src python benchmarks/trajectories.py record /tmp/old.pt
    PYTHONPATH=src     python benchmarks/trajectories.py record /tmp/new.pt
    python benchmarks/trajectories.py compare /tmp/old.pt /tmp/new.pt
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

SHAPES = [(24, 32), (40,), (8, 64), (3, 5, 16), (7, 12)]


def _run(out: dict, name: str, make: Callable, shapes, dtype=torch.float32, steps=4, nan_at=(2, 1),
         param_mode=False, seed=0) -> None:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]
    opt = make(params)
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            if nan_at and t == nan_at[0] and i == nan_at[1]:
                p.grad.view(-1)[0] = float("nan")
        if param_mode:
            for p in params:
                opt.step_param(p)
        else:
            opt.step()
    sd = opt.state_dict()
    buf = io.BytesIO()
    torch.save(sd, buf)
    out[name] = {
        "params": [p.detach().clone() for p in params],
        "state": {k: {kk: (vv.clone() if isinstance(vv, torch.Tensor) else vv) for kk, vv in v.items()}
                  for k, v in sd["state"].items()},
        "groups": [list(g.items()) for g in sd["param_groups"]],
        "defaults": list(opt.defaults.items()),
        "sd_bytes": buf.getvalue(),
    }


def record(path: str) -> int:
    from gwt_optim import GWTAdafactor, GWTAdamMini, GWTAdamW, GWTMuon
    from gwt_optim.optim import _dispatch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        md = "float32" if dtype == torch.bfloat16 else None
        for level in (0, 1, 2, 3):
            for clip in (0.5, None):
                for ngl in (1.01, None):
                    for pm in (False, True):
                        _run(out, f"adamw-native-{dtype}-{level}-{clip}-{ngl}-{pm}",
                             lambda ps: GWTAdamW(ps, lr=1e-2, level=level, detail_clip=clip, norm_growth_limit=ngl,
                                                 weight_decay=0.1, moment_dtype=md), SHAPES, dtype, param_mode=pm)
    # The case names keep the removed compile= option's values (False: eager, None: auto), so that
    # recordings made before its removal still compare.
    for comp, backend in ((False, "eager"), (None, "auto")):
        for impl in ("fast", "reference"):
            for md in (None, "bfloat16", "int8"):
                _run(out, f"adamw-{comp}-{impl}-{md}",
                     lambda ps: GWTAdamW(ps, lr=1e-2, backend=backend, impl=impl, moment_dtype=md), SHAPES)
    for impl in ("fast", "reference"):
        for block in ("neuron", "head"):
            _run(out, f"mini-{impl}-{block}", lambda ps: GWTAdamMini(ps, lr=1e-2, impl=impl, block=block, head_dim=4),
                 [(24, 32), (8, 64)])
        _run(out, f"muon-{impl}",
             lambda ps: GWTMuon([{"params": ps[:2]}, {"params": ps[2:], "use_muon": False}], lr=1e-2, impl=impl),
             [(24, 32), (8, 64), (40,), (6, 8)])
        for rel in (True, False):
            _run(out, f"adafactor-{impl}-{rel}",
                 lambda ps: GWTAdafactor(ps, lr=1e-2, impl=impl, relative_step=rel, beta1=0.9), SHAPES)
    if os.environ.get("TRITON_INTERPRET") == "1":
        from gwt_optim.optim import _triton

        _dispatch.BACKENDS["triton"] = lambda: _triton.TritonBackend(cpu=True, chunk=64)
        for level in (0, 2):
            for clip in (0.5, None):
                for pm in (False, True):
                    _run(out, f"adamw-triton-{level}-{clip}-{pm}",
                         lambda ps: GWTAdamW(ps, lr=1e-2, level=level, detail_clip=clip, backend="triton"),
                         [(24, 32), (40,), (8, 64)], steps=3, param_mode=pm)
    torch.save(out, path)
    print(f"{len(out)} cases -> {path}")
    return 0


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape):
            return False
        # bitwise: NaN payloads and signed zeros count
        return not x.numel() or torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    if isinstance(x, dict):
        return isinstance(y, dict) and list(x) == list(y) and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    return x == y


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            rows.append((name, "only in " + (a_path if name in a else b_path)))
            continue
        diff = [f for f in a[name] if not _equal(a[name][f], b[name].get(f))]
        if diff:
            rows.append((name, ", ".join(diff)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    print(f"# Trajectories: {a_path} vs {b_path}\n")
    print(f"torch {torch.__version__}, python {platform.python_version()}, {platform.machine()}, "
          f"this checkout at {commit or '?'}\n")
    print("| case | differs in |\n|---|---|")
    for name, what in rows:
        print(f"| {name} | {what} |")
    print(f"\n{len(set(a) | set(b))} cases; {len(rows)} differ")
    return 1 if rows else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run every configuration and save the trajectories")
    r.add_argument("out")
    c = sub.add_parser("compare", help="bitwise comparison of two recordings (exit 1 if any differs)")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    return record(args.out) if args.cmd == "record" else compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
