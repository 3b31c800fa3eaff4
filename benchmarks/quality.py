"""The quality bar on the demo: the same lr grid, budget and seeds for every optimizer.

    python benchmarks/quality.py                                  # fair view, 8K tokens/step, the defaults
    python benchmarks/quality.py --tokens-per-step 2048,8192 --view fair,paper \\
        --extra gwt-adamw:level=2:detail_clip=0.5 --jobs 12 --device cuda --resume
    python benchmarks/quality.py --plan                           # list the jobs, run nothing
    python benchmarks/quality.py --regime ...                     # also the regime study (see regime.py)
    python benchmarks/quality.py --budget 16M --tune-steps 1000 --jobs 2 --threads 1 --resume --out runs/budget
                                                                  # quality at a real budget (_budget.py)

Protocol (benchmarks/_protocol.py has the details):

1. Views. ``fair`` (default, matrix-only fairness): AdamW is first tuned over
   the whole model on the grid; its best lr is the *regular lr* every contender
   then uses for embeddings, head, norms and biases (AdamW math, alpha 1). Only
   the attention and MLP matrices change optimizer, at a matrix lr from the same
   grid with alpha 1. ``paper``: one lr from the grid for every parameter,
   alpha 0.25 on the matrices for GWT and GaLore, 1 for the rest.
2. Budget. ``--tokens-per-step T`` sets the batch to T / seq_len sequences; the
   run trains on ``--epochs`` (default 1, at most 1) of the demo training split,
   so no sequence is seen twice and a larger batch takes fewer steps.
3. Tune on the tuning seeds (default 0), then report each contender at its
   best lr on separate reporting seeds (default 1, 2, 3): mean ± std, and the
   gap to AdamW as the mean ± std of the per-seed differences.

Each (optimizer, lr, seed) is one ``python -m gwt_optim pretrain`` process;
``--jobs`` run at a time with ``--threads`` OMP threads each. Finished runs are
reused with ``--resume`` and never deleted. A failed run is reported, not
fatal. Writes the tables, verdicts, environment and commit to stdout and
``OUT/quality.md``, the raw results to ``OUT/quality.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _protocol import main as protocol_main  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a == "--budget" or a.startswith("--budget=") for a in args):
        from _budget import __doc__ as budget_doc
        from _budget import main as budget_main

        return budget_main(argv, budget_doc)
    return protocol_main(argv, mode="quality", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
