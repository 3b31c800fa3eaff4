"""The Triton kernels' PTX for an H100/H200 (sm_90), compiled without a GPU,
and their global loads and stores counted by width.

Bandwidth-bound kernels reach the memory system's peak only with wide
accesses: 128-bit (``.v4.b32``) per thread for fp32. This prints, per kernel
and configuration, the global loads and stores in the PTX by vector width, so
that a change to the kernels' memory access can be judged on a machine
without a GPU (``ptxas`` and the compiler ship in the triton wheel).

    python benchmarks/triton_ptx.py                 # the table
    python benchmarks/triton_ptx.py --dump out/     # and the PTX files

``ALIGNED`` is the kernels' contiguous form (every block whole, every
address 16-byte aligned; see ``_tile`` in ``gwt_optim/optim/_triton.py``);
without it the tile's addresses come from row/column arithmetic on a runtime
row length and stay scalar.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from gwt_optim.optim import _triton  # noqa: E402

PHASE1 = {"ptrs": "*i64", "geom": "*i64", "chunk_tensor": "*i32", "partial": "*fp32", "flags": "*i32",
          "h": "fp32", "w1": "fp32", "beta2": "fp32", "w2": "fp32", "eps2": "fp32"}
PHASE2 = {"ptrs": "*i64", "geom": "*i64", "chunk_tensor": "*i32", "inv_r": "*fp32", "skip": "*i32",
          "h": "fp32", "w1": "fp32", "beta2": "fp32", "w2": "fp32", "eps2": "fp32", "scale": "fp32",
          "decay": "fp32", "clip": "fp32"}
# Global accesses by width: ld.global[.nc][.v2|.v4].b16/b32/... and st.global likewise.
ACCESS = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(\.v[248])?\.(b|f|u|s)(8|16|32|64)\b")


def compile_ptx(fn, signature: dict, constexprs: dict, num_warps: int) -> str:
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]


def count(ptx: str) -> dict[str, int]:
    """``{"ld 128": k, "ld 32": j, ...}``: accesses by bits per thread."""
    out: dict[str, int] = {}
    for op, vec, _, bits in ACCESS.findall(ptx):
        width = int(bits) * (int(vec[2:]) if vec else 1)
        key = f"{op} {width}"
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", type=Path, default=None, help="write each kernel's PTX into this folder")
    ap.add_argument("--chunk", type=int, default=_triton.DEFAULT_CHUNK)
    ap.add_argument("--warps", type=int, default=_triton.DEFAULT_WARPS)
    ap.add_argument("--levels", default="1,2,3")
    args = ap.parse_args()
    kinds = {"fp32": 0, "bf16": 1}
    print(f"<!-- triton {triton.__version__}, sm_90, chunk {args.chunk}, num_warps {args.warps} -->")
    print("| kernel | level | W/G dtype | ALIGNED | global accesses (op bits: count) |")
    print("|---|---:|---|---|---|")
    for level in map(int, args.levels.split(",")):
        b = 1 << level
        tb = max(1, args.chunk // b)
        for name, kind in kinds.items():
            for aligned in (True, False):
                cases = [
                    ("phase1", _triton._phase1_kernel, PHASE1,
                     dict(B=b, TB=tb, G_KIND=kind, M_KIND=0, LIMITED=True, ALIGNED=aligned)),
                    ("phase2", _triton._phase2_kernel, PHASE2,
                     dict(B=b, TB=tb, W_KIND=kind, G_KIND=kind, M_KIND=0, ALIGNED=aligned)),
                ]
                for label, fn, sig, const in cases:
                    ptx = compile_ptx(fn, sig, const, args.warps)
                    if args.dump is not None:
                        args.dump.mkdir(parents=True, exist_ok=True)
                        (args.dump / f"{label}_l{level}_{name}_{'aligned' if aligned else 'general'}.ptx").write_text(ptx)
                    counts = ", ".join(f"{k}: {v}" for k, v in count(ptx).items())
                    print(f"| {label} | {level} | {name} | {aligned} | {counts} |", flush=True)


if __name__ == "__main__":
    main()
