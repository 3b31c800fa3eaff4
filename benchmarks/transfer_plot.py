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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import ADAMW, ROOT, TOKENS_PER_STEP, environment, find, pyplot, save, t975, zero_line  # noqa: E402
from _paired import gaps as _gaps  # noqa: E402

SETTING = "tokens8192-steps1953"
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
RECORDS = [ROOT / "docs/results/budget-cpu/records", ROOT / "docs/results/transfer-cpu/records"]


def finished(name: str, seed: int) -> bool:
    run = find(RECORDS, SETTING, seed, name)
    return run is not None and run[1]


def gaps(name: str, seeds=range(1, 5), against: str = ADAMW) -> dict[int, dict[int, float]]:
    """step -> {seed: candidate - reference} over the seeds that have both finished runs."""
    return _gaps(RECORDS, SETTING, name, against=against, seeds=seeds, finished=True)[0]


def paired_rows() -> list[str]:
    """The markdown rows of :data:`PAIRS` at the end of the run (the pairs with no seed finished are left out)."""
    rows = []
    for what, name, against in PAIRS:
        seeds = [s for s in range(1, 5) if finished(name, s) and finished(against, s)]
        if not seeds:
            continue
        g = gaps(name, seeds, against)
        last = max(g)
        d = list(g[last].values())
        n, m = len(d), sum(d) / len(d)
        ci = ""
        if n > 1:
            sd = (sum((x - m) ** 2 for x in d) / (n - 1)) ** 0.5
            h = t975(n - 1) * sd / n ** 0.5
            ci = f" ± {h:.3f} ({m - h:+.3f} to {m + h:+.3f})"
        # after the warm-up (the first 10% of the steps), where the curves still fall by nats per evaluation
        after = {step: v for step, v in g.items() if step > 0.1 * last}
        means = {step: sum(v.values()) / len(v) for step, v in after.items() if len(v) == n}
        worst_mean = max(means, key=means.get)
        worst_seed = max((x, step * TOKENS_PER_STEP) for step, v in after.items() for x in v.values())
        rows.append(f"| {what} | {', '.join(f'{x:+.3f}' for x in d)} | {m:+.3f}{ci} (n={n}) | "
                    f"{means[worst_mean]:+.3f} at {worst_mean * TOKENS_PER_STEP / 1e6:.1f}M | "
                    f"{worst_seed[0]:+.3f} at {worst_seed[1] / 1e6:.1f}M |")
    return rows


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
        tokens = step * TOKENS_PER_STEP
        cells = []
        for g in table.values():
            d = list(g.get(step, {}).values())
            cells.append(f"{sum(d) / len(d):+.3f} ({len(d)})" if d else "")
        print(f"| {tokens / 1e6:.1f}M | " + " | ".join(cells) + " |")
    print("\n# At the end (16M tokens), paired by reporting seed\n")
    print("| difference | per seed (1, 2, ...) | mean ± 95% t | largest after the warm-up, seed mean | one seed |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(paired_rows()))
    if a.plot:
        fig, ax = pyplot().subplots(figsize=(8, 4.5))
        for label, g in table.items():
            if not g:
                continue
            seeds = max(len(v) for v in g.values())
            xs = sorted(g)
            ax.plot([s * TOKENS_PER_STEP / 1e6 for s in xs], [sum(g[s].values()) / len(g[s]) for s in xs],
                    marker="o", markersize=3, label=f"{label}, {seeds} seed{'s' if seeds > 1 else ''}")
        ax.set_ylabel("validation loss − AdamW's (paired, mean)")
        ax.set_title("llama_9m on pysrc, 16M tokens: GWT-AdamW l=2 against AdamW at (2e-3, 0)")
        ax.set_ylim(-0.15, 0.25)
        zero_line(ax, legend_size=8)
        save(fig, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
