"""The transfer study's figure and table (docs/results/transfer-cpu.md): each candidate rule's validation loss
minus AdamW's on the same seed, along the 16M-token budget run, from the committed records alone.

    python benchmarks/transfer_plot.py --plot docs/images/transfer-cpu-gap.png

Reads the run records of the budget study and of the transfer study (``run_records.py save`` folders: each run's
``metrics.jsonl.gz`` and ``summary.json``), pairs every candidate's run with AdamW's at (2e-3, 0) on the same
reporting seed, and prints the paired gap at every evaluation as a markdown table (mean over the seeds that
have run, and how many) with the versions, hardware and commit.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = "report/tokens8192-steps1953"
TOKENS_PER_STEP = 8192
ADAMW = "adamw-beta20.999-scale1-regular-lr0.003-lr0.002"
CANDIDATES = {  # label: run directory name
    "default at its own best (6e-3, wd 0.1)": "gwt-adamw-level2-beta20.999-weight-decay0.1-scale1-regular-lr0.003-lr0.006",
    "α 2 = 2^(l/2) (scale=2), at AdamW's (2e-3, 0)": "gwt-adamw-level2-scale2-beta20.999-regular-lr0.003-lr0.002",
    "adamw_units, at AdamW's (2e-3, 0)": "gwt-adamw-level2-adamw-unitstrue-beta20.999-scale1-regular-lr0.003-lr0.002",
    "match_rms, at AdamW's (2e-3, 0)": "gwt-adamw-level2-match-rmstrue-beta20.999-scale1-regular-lr0.003-lr0.002",
}
RECORDS = [ROOT / "docs/results/budget-cpu/records", ROOT / "docs/results/transfer-cpu/records"]


def curve(run: Path) -> dict[int, tuple[int, float]]:
    """step -> (tokens, validation loss) of one run (8,192 tokens per step, as the study's setting)."""
    with gzip.open(run / "metrics.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: (r["step"] * TOKENS_PER_STEP, r["val_loss"]) for r in rows if "val_loss" in r}


def find(name: str, seed: int) -> Path | None:
    for records in RECORDS:
        run = records / RUNS / f"seed{seed}" / name
        if (run / "summary.json").exists():
            return run
    return None


def gaps(name: str, seeds=range(1, 5)) -> dict[int, list[tuple[int, float]]]:
    """step -> [(tokens, candidate - AdamW) per seed that has both finished runs]."""
    out: dict[int, list[tuple[int, float]]] = {}
    for seed in seeds:
        mine, base = find(name, seed), find(ADAMW, seed)
        if mine is None or base is None:
            continue
        c, a = curve(mine), curve(base)
        for step in sorted(set(c) & set(a)):
            out.setdefault(step, []).append((c[step][0], c[step][1] - a[step][1]))
    return out


def environment() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return f"commit {commit}, python {platform.python_version()}, {platform.machine()} (reads records only)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", default="", help="write the figure here (PNG); empty: the table only")
    a = ap.parse_args(argv)
    table = {label: gaps(name) for label, name in CANDIDATES.items()}
    steps = sorted(set().union(*table.values()))
    print(f"# Validation loss minus AdamW's on the same seed, along the run\n\n{environment()}\n")
    print("| tokens | " + " | ".join(f"{label} (n)" for label in table) + " |")
    print("|---:|" + "---:|" * len(table))
    for step in steps:
        tokens = next(t for g in table.values() for t, _ in g.get(step, []))
        cells = []
        for g in table.values():
            d = [x for _, x in g.get(step, [])]
            cells.append(f"{sum(d) / len(d):+.3f} ({len(d)})" if d else "")
        print(f"| {tokens / 1e6:.1f}M | " + " | ".join(cells) + " |")
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for label, g in table.items():
            if not g:
                continue
            seeds = max(len(v) for v in g.values())
            xs = sorted(g)
            ax.plot([g[s][0][0] / 1e6 for s in xs], [sum(d for _, d in g[s]) / len(g[s]) for s in xs],
                    marker="o", markersize=3, label=f"{label}, {seeds} seed{'s' if seeds > 1 else ''}")
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_xlabel("training tokens (millions)")
        ax.set_ylabel("validation loss − AdamW's (paired, mean)")
        ax.set_title("llama_9m on pysrc, 16M tokens: GWT-AdamW l=2 against AdamW at (2e-3, 0)")
        ax.set_ylim(-0.15, 0.25)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
        print(f"\nwrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
