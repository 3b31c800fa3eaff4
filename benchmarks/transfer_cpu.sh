#!/usr/bin/env bash
# The transfer study of docs/results/transfer-cpu.md (issue 46) in one queue: does the transfer rule
# (match_rms) let GWT keep AdamW's tuned learning rate and weight decay? The budget study's protocol and
# setting (llama_9m, pysrc, 16M tokens, spanning validation, regular lr 3e-3 for every contender), AdamW
# at its tuned (2e-3, wd 0), whose runs the budget study's records hold.
#
#   bash benchmarks/transfer_cpu.sh OUT [COMMIT]
#
# With COMMIT it runs from a snapshot of that commit (benchmarks/_queue.sh). Save finished runs into the
# repository as they land (the study's records also keep the AdamW runs it reports against):
#   python benchmarks/run_records.py save OUT docs/results/transfer-cpu/records
# EXTRA shrinks it for a rehearsal, as in benchmarks/budget_cpu.sh.
set -uo pipefail
SCRIPT=benchmarks/transfer_cpu.sh RECORDS="docs/results/budget-cpu/records docs/results/transfer-cpu/records"
# shellcheck source=benchmarks/_queue.sh
source "$(dirname "$0")/_queue.sh" "$@"
RULE=gwt-adamw:level=2:match_rms=true
# 1. The claim: the rule at AdamW's (lr 2e-3, wd 0) on the reporting seeds, against AdamW's runs (one-lr
#    grids: reported at that lr, untuned; AdamW's runs come from the budget study's records).
run --report-seeds 1,2,3,4 --gate-seeds none --contenders "adamw,$RULE" --grid adamw=2e-3 --grid "$RULE=2e-3"
# 2. The rule at its own best: lr x0.5, x1, x2 around AdamW's at the full horizon (seed 0; x1 is stage 1's
#    tuning run), an edge extended, weight decay 0.1 at the best lr, then its reporting seeds at that best
#    (stage 1's runs, where the best is AdamW's setting).
run --report-seeds 1,2,3,4 --gate-seeds none --contenders "adamw,$RULE" --grid adamw=2e-3 \
  --grid "$RULE=1e-3,2e-3,4e-3" --weight-decays 0,0.1 --extend-edges 2
# 3. GWT-Muon (the registry's: adjust_lr_fn=match_rms_adamw) at AdamW's setting, seeds 1-3; its own best
#    (1e-2, wd 0.1) is the budget study's (docs/results/budget-cpu.md).
run --report-seeds 1,2,3 --gate-seeds none --contenders adamw,gwt-muon:level=2 --grid adamw=2e-3 \
  --grid gwt-muon:level=2=2e-3
