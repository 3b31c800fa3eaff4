"""The regime study: GWT-AdamW's gap to AdamW against tokens per step.

    python benchmarks/regime.py --plan                            # the jobs and their count
    python benchmarks/regime.py --jobs 12 --device cuda --resume  # 2K, 8K, 32K; levels 1-3; eps 1e-8, 1e-6
    python benchmarks/regime.py --extra gwt-adamw:level=2:detail_clip=0.5   # a remedy as one more line
    python benchmarks/regime.py --plot-only                       # redraw the plot from OUT/*.json

For every tokens-per-step value (``--regime-tokens``, default 2048, 8192,
32768) this runs the fair protocol of ``benchmarks/quality.py`` (the same
runner, budget and seeds) on AdamW and GWT-AdamW at ``--levels`` x ``--eps``,
plus any ``--extra`` specs, and draws the mean gap to AdamW (nats, with the
std of the per-seed differences) against tokens per step on a log2 axis, one
line per (level, eps) and per extra spec, with the +0.03 bar:
``docs/images/gap-vs-batch.png`` (``--plot``) and ``OUT/gap-vs-batch.png``.
The token budget is the same at every batch size (default one epoch), so a
larger batch takes fewer steps. ``--tokens-per-step`` and ``--contenders`` add
quality studies to the same run (one shared pool of jobs).

Tables and raw results go to ``OUT/regime.md`` and ``OUT/regime.json``. With
``--out`` shared with quality.py and ``--resume``, runs the two have in common
are run once.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _protocol import main as protocol_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return protocol_main(argv, mode="regime", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
