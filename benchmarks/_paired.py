"""The committed run records read as paired gaps to AdamW: the one reader of ``schedules_plot.py`` and
``transfer_plot.py``.

A run is ``FOLDER/report/SETTING/seedN/NAME`` in a record (``run_records.py save``: ``metrics.jsonl.gz``) or
``FOLDER/report/runs/SETTING/seedN/NAME`` in a queue's live ``--out`` (``metrics.jsonl``); a run with a
``summary.json`` has finished. Each gap is a run's validation loss minus AdamW's at (2e-3, 0) on the same
reporting seed and setting, at every evaluation both have made. Reads no checkpoint and imports no torch.
"""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

from _runs import curve  # noqa: F401  (the one reader of a run's validation curve)
from _stats import t975  # noqa: F401  (the plots' intervals)

ROOT = Path(__file__).resolve().parents[1]
TOKENS_PER_STEP = 8192  # the studies' setting: every record here ran at it
ADAMW = "adamw-beta20.999-scale1-regular-lr0.003-lr0.002"


def find(folders: list[Path], setting: str, seed: int, name: str) -> tuple[Path, bool] | None:
    """The run's folder and whether it finished: a record or a finished live run first, else a live partial."""
    partial = None
    for base in folders:
        for run in (base / "report" / setting / f"seed{seed}" / name,
                    base / "report" / "runs" / setting / f"seed{seed}" / name):
            if (run / "summary.json").exists():
                return run, True
            if partial is None and (run / "metrics.jsonl").exists():
                partial = (run, False)
    return partial


def gaps(folders: list[Path], setting: str, name: str, *, against: str = ADAMW, seeds=range(1, 9),
         finished: bool = False) -> tuple[dict[int, dict[int, float]], bool]:
    """step -> {seed: ``name`` - ``against``} over the seeds with both runs, and whether any run is partial
    (``finished``: finished runs only, so never)."""
    out: dict[int, dict[int, float]] = {}
    partial = False
    for seed in seeds:
        mine, base = find(folders, setting, seed, name), find(folders, setting, seed, against)
        if mine is None or base is None or (finished and not (mine[1] and base[1])):
            continue
        partial |= not (mine[1] and base[1])
        c, a = curve(mine[0]), curve(base[0])
        for step in sorted(set(c) & set(a)):
            out.setdefault(step, {})[seed] = c[step] - a[step]
    return out, partial


def environment() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
    except OSError:
        commit = "unknown"
    return f"commit {commit}, python {platform.python_version()}, {platform.machine()} (reads records only)"


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def zero_line(ax, legend_size: int) -> None:
    """The axes of a gap against tokens: the zero line, the tokens label and the legend."""
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("training tokens (millions)")
    ax.legend(fontsize=legend_size)


def save(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nwrote {path}")
