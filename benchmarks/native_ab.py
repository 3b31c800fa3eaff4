"""A/B of two versions of the native CPU kernels in one process.

On a noisy machine the only trustworthy speed comparison of a kernel change is
one taken in the same process, interleaved: this builds ``_fused_cpu.c`` as
it is in the working tree and as it was at ``--base`` (a git revision) into
two libraries with the flags the package uses, gives each its own GWT-AdamW
optimizers (default and paper update) whose batched steps call that library,
and times their ``step()`` round by round beside fused ``torch.optim.AdamW``
on LLaMA's attention/MLP shapes. At the end it checks that both versions left
bit-identical weights and state: a kernel change that is only about speed
must not change a bit.

    python benchmarks/native_ab.py --base HEAD~1
    python benchmarks/native_ab.py --base 406333d~1 --threads 1 --rounds 21

Only the batched whole-step entry points (``gwt_adamw_haar_steps_*``) are
swapped, so the two versions must agree on their signature and on the
workspace the backend allocates. Prints a markdown table and the versions,
hardware and git commit.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step import environment, llama_shapes  # noqa: E402

from gwt_optim import GWTAdamW  # noqa: E402
from gwt_optim import _toolchain
from gwt_optim.optim import _native  # noqa: E402

SOURCE = "src/gwt_optim/optim/_fused_cpu.c"


def build(source: str, directory: Path, name: str) -> ctypes.CDLL:
    """Compile one version of the kernels with the package's first flag set."""
    c = directory / f"{name}.c"
    c.write_text(source)
    so = directory / f"{name}.so"
    subprocess.run([_toolchain._compiler(), *_toolchain._FLAG_SETS[0], *_toolchain._COMMON_FLAGS, "-o", str(so),
                    str(c)], check=True)
    lib = ctypes.CDLL(str(so))
    for suffix in _native._DTYPE_SUFFIX.values():
        steps = getattr(lib, f"gwt_adamw_haar_steps_{suffix}")
        steps.restype = None
        steps.argtypes = [ctypes.POINTER(_native._Task), ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                          ctypes.c_int, ctypes.c_int64]
    return lib


def optimizer(kind: str, shapes: list, lib: ctypes.CDLL | None, warmup: int):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    if lib is None:
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        opt = GWTAdamW(params, lr=1e-3, backend="native", detail_clip=None if kind == "paper" else 0.5)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    if lib is not None:
        opt.step()  # makes the backend
        backend = opt._kernels.get("native")
        backend._steps = {dt: getattr(lib, f"gwt_adamw_haar_steps_{sfx}") for dt, sfx in _native._DTYPE_SUFFIX.items()}
    for _ in range(warmup):
        opt.step()
    return opt, params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the kernels to compare the working tree with")
    ap.add_argument("--config", default="60m", help="a LLaMA config of benchmarks/step.py (default 60m)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    base = subprocess.run(["git", "show", f"{args.base}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout
    shapes = llama_shapes(args.config)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {args.base: build(base, Path(tmp), "base"), "working tree": build((ROOT / SOURCE).read_text(),
                                                                                   Path(tmp), "new")}
        cases = {("AdamW fused", "-"): optimizer("adamw", shapes, None, args.warmup)}
        for version, lib in libs.items():
            for kind in ("default", "paper"):
                cases[(f"GWT-AdamW l=2 ({kind})", version)] = optimizer(kind, shapes, lib, args.warmup)
        times = {key: [] for key in cases}
        for _ in range(args.rounds):
            for key, (opt, _) in cases.items():
                t0 = time.perf_counter()
                opt.step()
                times[key].append(time.perf_counter() - t0)

    ref = statistics.median(times[("AdamW fused", "-")])
    print(f"<!-- {environment()} -->")
    print(f"| optimizer | kernels | ms/step | ratio to fused AdamW | bit-equal to {args.base} |")
    print("|---|---|---:|---:|---|")
    for (label, version), (opt, params) in cases.items():
        same = "-"
        if version == "working tree":
            base_opt, base_params = cases[(label, args.base)]
            same = "yes" if all(torch.equal(a, b) for a, b in zip(params, base_params)) and all(
                torch.equal(x, y) for sa, sb in zip(opt.state.values(), base_opt.state.values())
                for x, y in zip(sa.values(), sb.values())) else "NO"
        ms = statistics.median(times[(label, version)]) * 1e3
        print(f"| {label} | {version} | {ms:.2f} | {ms / (ref * 1e3):.3f}x | {same} |")
    print(f"\n{environment()}; {args.threads} threads, {args.rounds} rounds, config {args.config}")


if __name__ == "__main__":
    main()
