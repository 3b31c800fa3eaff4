#!/usr/bin/env bash
# The CPU budget study of docs/results/budget-cpu.md in one queue. Each stage is one `quality.py --budget
# --resume` call on the same folder, so a queue stopped anywhere (a signal saves every run in flight) and
# started again goes on where it stopped.
#
#   bash benchmarks/budget_cpu.sh OUT [COMMIT]
#
# With COMMIT, it runs from a snapshot of that commit (`git archive` into OUT.tree), so that editing the
# checkout while the queue runs (days, on 2 cores) never changes the code it runs; `--commit` records it.
# The two jobs run at one thread each and at nice 19. Save finished runs into the repository as they land:
#   python benchmarks/run_records.py save OUT docs/results/budget-cpu/records
# EXTRA (flags, last wins) shrinks it for a rehearsal:
#   EXTRA="--budget 512 --tune-steps 2 --data tests/data/finetune/lm_text --model llama_9m --vocab-size 320
#          --seq-len 32 --tokens-per-step 128 --val-tokens 256 --evals 2" bash benchmarks/budget_cpu.sh /tmp/b
set -uo pipefail
SCRIPT=benchmarks/budget_cpu.sh RECORDS=docs/results/budget-cpu/records
# shellcheck source=benchmarks/_queue.sh
source "$(dirname "$0")/_queue.sh" "$@"
GRIDS=(--grid adamw=5e-4,1e-3,2e-3,4e-3 --grid gwt-adamw:level=2=1.5e-3,3e-3,6e-3)

# One call for every contender (it was stage 2, then stage 3, until the first machine's runs were lost):
# - AdamW and GWT-AdamW l=2: the lr at the full horizon, then weight decay 0.1 at the best lr, reporting
#   seeds 1-4 at each best (lr, wd). The tuning of 2026-12-03 (runs lost with the machine, figures in
#   docs/results/budget-cpu.md) found AdamW 2e-3 at weight decay 0 and GWT-AdamW 6e-3 at 0.1: their seeds
#   run first (--prior-best), and the tuning that re-decides them runs after every contender's first three
#   seeds, because it repeats figures already measured (a run is deterministic given its seed and code).
# - Muon and GWT-Muon at their 1,000-step lrs (no device to tune them at the full horizon); the paper's update
#   (detail_clip=none) tuned at the full horizon on its 1,000-step best and its factor-2 neighbours, because
#   the default is judged against it and both AdamW's and GWT-AdamW's best lr doubled at the full horizon.
#   Reporting seeds 1-4 (each seed's runs of every contender before the next seed's; seed 4, beyond the
#   three an interval needs, after AdamW's and GWT-AdamW's re-tuning and the 0.75x runs). Each tries weight
#   decay 0.1 at its best lr, because it helped GWT-AdamW (the rule: give their family's evidence the axis
#   if 0.1 helped AdamW or GWT-AdamW).
# - AdamW at 0.75x of the budget on seeds 1-2 (the data-to-match ratio), at AdamW's prior best.
ALL=(--contenders adamw,gwt-adamw:level=2,muon,gwt-muon:level=2,gwt-adamw:level=2:detail_clip=none "${GRIDS[@]}"
  --grid muon=3e-3 --grid gwt-muon:level=2=1e-2 --grid gwt-adamw:level=2:detail_clip=none=5e-4,1e-3,2e-3
  --weight-decays 0,0.1 --match-budgets 0.75 --prior-best adamw=2e-3 --prior-best gwt-adamw:level=2=6e-3,0.1)
run --report-seeds 1,2,3,4 --extend-edges 2 "${ALL[@]}"
