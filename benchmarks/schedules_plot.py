"""Issue 54's table and figure (docs/results/schedules-cpu.md): GWT-AdamW's validation loss minus AdamW's on the
same seed, at every evaluation of the 16M-token budget run, under the cosine and under WSD, on each corpus.

    python benchmarks/schedules_plot.py --plot docs/images/schedules-cpu-gap.png [--live /root/gwt-runs/schedules54]

Reads the committed run records (``run_records.py save`` folders) and, with ``--live``, the run folders of a
queue still running (``metrics.jsonl`` of runs not finished yet count as far as they got: such a column is
marked as partial). Each contender's run is paired with AdamW's at (2e-3, 0) on the same reporting seed and
setting. Prints, per setting, the paired gap at every evaluation (the seed mean and the worst seed), then the
issue's bar: after the warm-up, the seed-mean gap at most +0.02, no seed above +0.05, and the end level or
better (the 95% t interval not wholly above +0.02).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _paired import (ADAMW, ROOT, TOKENS_PER_STEP, curve, environment, find, gaps, pyplot, save, t975,  # noqa: E402
                     zero_line)

RECORDS = [ROOT / "docs/results/budget-cpu/records", ROOT / "docs/results/transfer-cpu/records",
           ROOT / "docs/results/schedules-cpu/records"]
TOTAL = 1953  # steps of a 16M-token run
STEPS = f"tokens8192-steps{TOTAL}"
WARMUP_END = 0.1 * TOTAL
MID = 873  # the evaluation at 7.2M tokens, where the default's worst seed trails most
SETTINGS = {  # label: the setting's folder under report/ (benchmarks/_protocol.folder_suffix)
    "pysrc, cosine": STEPS,
    "pysrc, WSD (1-sqrt, last 20%)": f"{STEPS}-wsd0.2-1-sqrt",
    "linux-c, cosine": f"{STEPS}-data-linux-c",
    "linux-c, WSD (1-sqrt, last 20%)": f"{STEPS}-wsd0.2-1-sqrt-data-linux-c",
}
CONTENDERS = {  # label: run folder name, each at AdamW's (2e-3, 0)
    "GWT-AdamW as shipped (α 2, clip 0.5)": "gwt-adamw-level2-scale2-beta20.999-regular-lr0.003-lr0.002",
    "C1: clip 0.25 at the peak, 0.5 at the floor": "gwt-adamw-level2-scale2-detail-clip0.25-detail-clip-end0.5-"
                                                   "beta20.999-regular-lr0.003-lr0.002",
    "C2: clip 0.2 in the step's units": "gwt-adamw-level2-scale2-detail-clip0.2-detail-clip-unitsstep-"
                                        "beta20.999-regular-lr0.003-lr0.002",
    "C4: clip 0.1 in the step's units": "gwt-adamw-level2-scale2-detail-clip0.1-detail-clip-unitsstep-"
                                        "beta20.999-regular-lr0.003-lr0.002",
}
BAR_MEAN, BAR_SEED = 0.02, 0.05
UNPAIRED = (582, 776, 873, 1067, TOTAL)  # evaluations at 4.8M, 6.4M, 7.2M, 8.7M tokens and the end
SHIPPED = CONTENDERS["GWT-AdamW as shipped (α 2, clip 0.5)"]
TWINS = {  # label: (run, the run it is measured against), on the cosine: how far a run moves from its twin
    "AdamW, foreach − fused (the same update, rounded differently)":
        ("adamw-fusedfalse-beta20.999-scale1-regular-lr0.003-lr0.002", ADAMW),
    "GWT-AdamW, eager − native kernel (the same update, rounded differently)":
        ("gwt-adamw-level2-scale2-backendeager-beta20.999-regular-lr0.003-lr0.002", SHIPPED),
    "AdamW, weight decay 0.1 − 0 (a small real change)":
        ("adamw-weight-decay0.1-beta20.999-scale1-regular-lr0.003-lr0.002", ADAMW),
}


def verdict(g: dict[int, dict[int, float]], partial: bool) -> str:
    """The issue's bar on one contender's gaps: a markdown row's last cells."""
    if not g:
        return "| | | | |"
    last = max(g)
    after = {s: v for s, v in g.items() if s > WARMUP_END}
    if not after:  # a live run still in its warm-up
        return f"| | | (step {last}, in the warm-up) | no |"
    means = {s: sum(v.values()) / len(v) for s, v in after.items()}
    worst_mean = max(means, key=means.get)
    worst_seed = max(((x, seed, s) for s, v in after.items() for seed, x in v.items()))
    end = list(g[last].values())
    n, m = len(end), sum(end) / len(end)
    ci, ok_end = "", m <= BAR_MEAN
    if n > 1:
        sd = (sum((x - m) ** 2 for x in end) / (n - 1)) ** 0.5
        h = t975(n - 1) * sd / n ** 0.5
        ci, ok_end = f" ± {h:.3f}", m - h <= BAR_MEAN
    ok = means[worst_mean] <= BAR_MEAN and worst_seed[0] <= BAR_SEED and ok_end and not partial
    return (f"| {means[worst_mean]:+.3f} at {worst_mean * TOKENS_PER_STEP / 1e6:.1f}M | {worst_seed[0]:+.3f} "
            f"(seed {worst_seed[1]}, {worst_seed[2] * TOKENS_PER_STEP / 1e6:.1f}M) | {m:+.3f}{ci} (n={n}"
            f"{', partial' if partial else ''}, step {last}) | {'yes' if ok else 'no'} |")


def unpaired(folders: list[Path]) -> None:
    """Each finished run's validation loss by seed, AdamW and the default apart: whether a seed's paired gap is
    a slow GWT run or a fast AdamW run (the cosine's seed 4 is AdamW's fastest, docs/results/schedules-cpu.md)."""
    runs = {"AdamW": ADAMW, "GWT-AdamW": SHIPPED}
    for s, folder in SETTINGS.items():
        loss = {who: {seed: curve(hit[0]) for seed in range(1, 9)
                      if (hit := find(folders, folder, seed, name)) and hit[1]} for who, name in runs.items()}
        seeds = sorted(set(loss["AdamW"]) & set(loss["GWT-AdamW"]))
        if len(seeds) < 2:
            continue
        print(f"\n## {s}: each finished run unpaired, by seed ({', '.join(map(str, seeds))}); sd across seeds\n")
        print("| tokens | " + " | ".join(f"{who}, seeds | sd" for who in runs) + " |")
        print("|---:|" + "---|---:|" * len(runs))
        for step in UNPAIRED:
            cells = []
            for who in runs:
                v = [loss[who][seed].get(step) for seed in seeds]
                if None in v:
                    cells += ["", ""]
                    continue
                cells += [" ".join(f"{x:.3f}" for x in v), f"{statistics.stdev(v):.3f}"]
            print(f"| {step * TOKENS_PER_STEP / 1e6:.1f}M | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--plot", default="", help="write the figure here (PNG); empty: the tables only")
    ap.add_argument("--live", action="append", default=[], type=Path, help="a queue's OUT folder, read too")
    a = ap.parse_args(argv)
    folders = RECORDS + a.live
    found = {(s, c): gaps(folders, folder, name) for s, folder in SETTINGS.items() for c, name in CONTENDERS.items()}
    print(f"# GWT-AdamW minus AdamW along the run, by schedule and corpus\n\n{environment()}\n")
    print(f"The bar (issue 54): after the warm-up the seed-mean gap at most +{BAR_MEAN}, no seed above "
          f"+{BAR_SEED}, the end level or better.\n")
    print("| setting | contender | largest seed-mean gap | largest one-seed gap | at the end, mean ± 95% t | "
          "meets the bar |")
    print("|---|---|---:|---:|---:|---|")
    for (s, c), (g, partial) in found.items():
        if g:
            print(f"| {s} | {c} " + verdict(g, partial))
    for s in SETTINGS:
        cols = {c: found[(s, c)][0] for c in CONTENDERS if found[(s, c)][0]}
        if not cols:
            continue
        print(f"\n## {s}: the paired gap at every evaluation (seed mean; worst seed)\n")
        print("| tokens | " + " | ".join(cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for step in sorted(set().union(*cols.values())):
            cells = []
            for g in cols.values():
                v = list(g.get(step, {}).values())
                cells.append(f"{sum(v) / len(v):+.3f}; {max(v):+.3f} (n={len(v)})" if v else "")
            print(f"| {step * TOKENS_PER_STEP / 1e6:.1f}M | " + " | ".join(cells) + " |")
    unpaired(folders)
    twins = {label: gaps(folders, STEPS, run, against=twin) for label, (run, twin) in TWINS.items()}
    if any(g for g, _ in twins.values()):
        print("\n## The noise floor: a run against its twin (pysrc, cosine; each seed's gap)\n")
        print("| pair | seed | largest gap after the warm-up | at 7.2M | at the end |")
        print("|---|---:|---:|---:|---:|")
        for label, (g, partial) in twins.items():
            for seed in sorted({seed for v in g.values() for seed in v}):
                after = {st: v[seed] for st, v in g.items() if st > WARMUP_END and seed in v}
                if not after:
                    continue
                top = max(after, key=lambda st: abs(after[st]))
                last = max(after)
                print(f"| {label} | {seed} | {after[top]:+.3f} ({top * TOKENS_PER_STEP / 1e6:.1f}M) | "
                      f"{after.get(MID, float('nan')):+.3f} | {after[last]:+.3f}"
                      f"{f' (step {last}, partial)' if partial and last < TOTAL else ''} |")
    if a.plot:
        fig, axes = pyplot().subplots(1, 2, figsize=(11, 4.2), sharey=True)
        low = -0.12  # the bar's lines and the warm-up in view, and every line whole (a corpus may lead by more)
        for ax, schedule in zip(axes, ("cosine", "WSD")):
            for (s, c), (g, partial) in found.items():
                if schedule not in s or not g:
                    continue
                xs = sorted(g)
                seeds = sorted({seed for v in g.values() for seed in v})
                ys = [sum(g[x].values()) / len(g[x]) for x in xs]
                low = min([low, *ys])
                line, = ax.plot([x * TOKENS_PER_STEP / 1e6 for x in xs], ys,
                                marker="o", markersize=2.5, linestyle="-" if s.startswith("pysrc") else "--",
                                label=f"{s.split(',')[0]}: {c.split(':')[0]} (seed{'s' if len(seeds) > 1 else ''} "
                                      f"{', '.join(map(str, seeds))}{', partial' if partial else ''})")
                if len(seeds) > 1:  # each seed faintly behind its mean: a user watches one curve, not the mean
                    for seed in seeds:
                        pts = [(x * TOKENS_PER_STEP / 1e6, g[x][seed]) for x in xs if seed in g[x]]
                        ax.plot(*zip(*pts), color=line.get_color(), linewidth=0.7, alpha=0.35)
            zero_line(ax, legend_size=7)
            for y in (BAR_MEAN, BAR_SEED):
                ax.axhline(y, color="grey", linewidth=0.6, linestyle=":")
            ax.set_title(f"under the {schedule}")
        axes[0].set_ylabel("validation loss − AdamW's (paired)")
        axes[0].set_ylim(low - 0.01, 0.2)  # room above the worst seed for the legend
        fig.suptitle("llama_9m, 16M tokens, both at AdamW's (2e-3, 0); the seed mean, and each seed faint", fontsize=10)
        save(fig, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
