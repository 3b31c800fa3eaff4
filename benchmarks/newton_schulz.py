"""Newton-Schulz in bf16 (torch.optim.Muon's) against fp32, on LLaMA weight shapes.

For every distinct attention/MLP weight shape of a shipped LLaMA config, times
one orthogonalization (median of ``--repeats``) in each precision, and compares
the results: the relative Frobenius difference between the two, and how far
each pushes the singular values from 1. The per-step estimate multiplies by
the number of such weights in the model.

    python benchmarks/newton_schulz.py --config 60m
    python benchmarks/newton_schulz.py --config 9m --repeats 5 --threads 2

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gwt_optim.optim.muon import zeropower_via_newtonschulz  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def weight_shapes(config: str) -> Counter:
    """(out, in) -> count, for the attention and MLP weights of a shipped config."""
    cfg = json.loads((ROOT / "src" / "gwt_optim" / "configs" / f"llama_{config}.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    return Counter({(h, h): 4 * layers, (i, h): 2 * layers, (h, i): layers})


def time_ns(X: torch.Tensor, dtype: torch.dtype, repeats: int) -> tuple[float, torch.Tensor]:
    out = zeropower_via_newtonschulz(X, dtype=dtype)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = zeropower_via_newtonschulz(X, dtype=dtype)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out.float()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="60m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows, total = [], {k: 0.0 for k in DTYPES}
    for (m, n), count in sorted(weight_shapes(args.config).items()):
        # a gradient-like matrix: a few strong directions over noise
        X = torch.randn(m, 8, generator=gen) @ torch.randn(8, n, generator=gen) + 0.1 * torch.randn(m, n, generator=gen)
        res = {k: time_ns(X, dt, args.repeats) for k, dt in DTYPES.items()}
        diff = ((res["bf16"][1] - res["fp32"][1]).norm() / res["fp32"][1].norm()).item()
        sv = {k: torch.linalg.svdvals(res[k][1]) for k in DTYPES}
        for k in DTYPES:
            total[k] += count * res[k][0]
        rows.append(
            f"| {m}x{n} | {count} | {1e3 * res['bf16'][0]:.1f} | {1e3 * res['fp32'][0]:.1f} | "
            f"{res['bf16'][0] / res['fp32'][0]:.1f}x | {diff:.4f} | "
            f"{sv['bf16'].min():.2f}-{sv['bf16'].max():.2f} | {sv['fp32'].min():.2f}-{sv['fp32'].max():.2f} |"
        )
    print(f"LLaMA-{args.config.upper()}, torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| shape | count | bf16 ms | fp32 ms | bf16/fp32 | rel. diff | bf16 sing. values | fp32 sing. values |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    print("\n".join(rows))
    print(f"\nNewton-Schulz per optimizer step: bf16 {total['bf16']:.1f} s, fp32 {total['fp32']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
