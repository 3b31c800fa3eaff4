"""The transfer study's figure and table (docs/results/transfer-cpu.md): each candidate rule's validation loss
minus AdamW's on the same seed, along the 16M-token budget run, from the committed records alone.

    python benchmarks/transfer_plot.py --plot docs/images/transfer-cpu-gap.png

Reads the run records of the budget study and of the transfer study (``run_records.py save`` folders: each run's
``metrics.jsonl.gz`` and ``summary.json``), pairs every candidate's run with AdamW's at (2e-3, 0) on the same
reporting seed, and prints the paired gap at every evaluation as a markdown table (mean over the seeds that
have run, and how many) with the versions, hardware and commit; then the paired differences at the end
(:data:`PAIRS`: each rule against AdamW and against the tuned run it should come close to), each with its 95%
t interval and the largest gap behind along the run.
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
TUNED = CANDIDATES["default at its own best (6e-3, wd 0.1)"]
ALPHA2 = CANDIDATES["α 2 = 2^(l/2) (scale=2), at AdamW's (2e-3, 0)"]
MUON_TUNED = "gwt-muon-level2-beta20.999-weight-decay0.1-scale1-regular-lr0.003-lr0.01"
MUON_ALPHA2 = "gwt-muon-level2-scale2-beta20.999-regular-lr0.003-lr0.002"
# Stage 5: AdamW's weight decay 0.1 kept (the weight decay is in the labels).
ADAMW_WD = "adamw-weight-decay0.1-beta20.999-scale1-regular-lr0.003-lr0.002"
ALPHA2_WD = "gwt-adamw-level2-scale2-weight-decay0.1-beta20.999-regular-lr0.003-lr0.002"
# Stage 6: the rule at levels 1 and 3 (alpha 2^(l/2) to four digits), at AdamW's (2e-3, 0).
LEVEL1 = "gwt-adamw-level1-scale1.414-beta20.999-regular-lr0.003-lr0.002"
LEVEL3 = "gwt-adamw-level3-scale2.828-beta20.999-regular-lr0.003-lr0.002"
PAIRS = [  # (what, run, the run it is paired with)
    ("GWT-AdamW α 2 at AdamW's (2e-3, 0) − AdamW (2e-3, 0)", ALPHA2, ADAMW),
    ("GWT-AdamW α 2 at AdamW's (2e-3, 0) − GWT-AdamW at its own best (6e-3 at α 1, wd 0.1)", ALPHA2, TUNED),
    ("GWT-AdamW at its own best − AdamW", TUNED, ADAMW),
    ("GWT-Muon α 2 at AdamW's (2e-3, 0) − AdamW", MUON_ALPHA2, ADAMW),
    ("GWT-Muon α 2 at AdamW's (2e-3, 0) − GWT-Muon at its own best (1e-2 at α 1, wd 0.1)", MUON_ALPHA2, MUON_TUNED),
    ("GWT-AdamW α 2 at (2e-3, wd 0.1) − AdamW at (2e-3, wd 0.1)", ALPHA2_WD, ADAMW_WD),
    ("AdamW at (2e-3, wd 0.1) − AdamW at (2e-3, 0)", ADAMW_WD, ADAMW),
    ("GWT-AdamW l=1, α 1.414, at AdamW's (2e-3, 0) − AdamW", LEVEL1, ADAMW),
    ("GWT-AdamW l=3, α 2.828, at AdamW's (2e-3, 0) − AdamW", LEVEL3, ADAMW),
]
# Two-sided 95% quantiles of Student's t by degrees of freedom.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}
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


def gaps(name: str, seeds=range(1, 5), against: str = ADAMW) -> dict[int, list[tuple[int, float]]]:
    """step -> [(tokens, candidate - reference) per seed that has both finished runs]."""
    out: dict[int, list[tuple[int, float]]] = {}
    for seed in seeds:
        mine, base = find(name, seed), find(against, seed)
        if mine is None or base is None:
            continue
        c, a = curve(mine), curve(base)
        for step in sorted(set(c) & set(a)):
            out.setdefault(step, []).append((c[step][0], c[step][1] - a[step][1]))
    return out


def paired_rows() -> list[str]:
    """The markdown rows of :data:`PAIRS` at the end of the run (the pairs with no seed finished are left out)."""
    rows = []
    for what, name, against in PAIRS:
        seeds = [s for s in range(1, 5) if find(name, s) and find(against, s)]
        if not seeds:
            continue
        g = gaps(name, seeds, against)
        last = max(g)
        d = [x for _, x in g[last]]
        n, m = len(d), sum(d) / len(d)
        ci = ""
        if n > 1:
            sd = (sum((x - m) ** 2 for x in d) / (n - 1)) ** 0.5
            h = T975[n - 1] * sd / n ** 0.5
            ci = f" ± {h:.3f} ({m - h:+.3f} to {m + h:+.3f})"
        # after the warm-up (the first 10% of the steps), where the curves still fall by nats per evaluation
        after = {step: v for step, v in g.items() if step > 0.1 * last}
        means = {step: sum(x for _, x in v) / len(v) for step, v in after.items() if len(v) == n}
        worst_mean = max(means, key=means.get)
        worst_seed = max((x, t) for v in after.values() for t, x in v)
        rows.append(f"| {what} | {', '.join(f'{x:+.3f}' for x in d)} | {m:+.3f}{ci} (n={n}) | "
                    f"{means[worst_mean]:+.3f} at {g[worst_mean][0][0] / 1e6:.1f}M | "
                    f"{worst_seed[0]:+.3f} at {worst_seed[1] / 1e6:.1f}M |")
    return rows


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
    print("\n# At the end (16M tokens), paired by reporting seed\n")
    print("| difference | per seed (1, 2, ...) | mean ± 95% t | largest after the warm-up, seed mean | one seed |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(paired_rows()))
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
