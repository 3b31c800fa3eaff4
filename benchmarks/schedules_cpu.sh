#!/usr/bin/env bash
# Issue 54's measurement in one queue: is GWT-AdamW level with AdamW at every step, under the cosine and under
# warmup-stable-decay? The budget study's protocol and setting (llama_9m, 16M tokens, spanning validation,
# regular lr 3e-3 for every contender), both at AdamW's tuned (2e-3, wd 0), GWT-AdamW as shipped (level 2,
# alpha 2^(l/2) = 2, detail_clip 0.5). Results: docs/results/schedules-cpu.md.
#
#   bash benchmarks/schedules_cpu.sh OUT [COMMIT]
#
# With COMMIT it runs from a snapshot of that commit (benchmarks/_queue.sh). Save finished runs as they land:
#   python benchmarks/run_records.py save OUT docs/results/schedules-cpu/records
# CORPUS2 is the second corpus's folder, built once by `bash benchmarks/corpus_linux_c.sh DIR` (default
# /root/gwt-data/linux-c); the stages on it are skipped where it is missing. EXTRA shrinks the queue for a
# rehearsal, as in benchmarks/budget_cpu.sh.
set -uo pipefail
SCRIPT=benchmarks/schedules_cpu.sh
RECORDS="docs/results/budget-cpu/records docs/results/transfer-cpu/records docs/results/schedules-cpu/records"
# shellcheck source=benchmarks/_queue.sh
source "$(dirname "$0")/_queue.sh" "$@"
CORPUS2=${CORPUS2:-/root/gwt-data/linux-c}
GWT=gwt-adamw:level=2:scale=2
PAIR=(--gate-seeds none --contenders "adamw,$GWT" --grid adamw=2e-3 --grid "$GWT=2e-3")
# WSD as Hägele et al. (2024) found it level with cosine at small scale: the peak held, then a 1-sqrt
# cool-down over the last 20% of the steps, here to the cosine's end (0.1x the peak) so that the two schedules
# differ in shape only.
WSD=(--schedule wsd --decay 0.2 --decay-shape 1-sqrt)
# The first remedy candidate (zero state): the clip follows the lr, 0.25 at the peak (the details' tails halved
# while the lr is high, where GWT trails) and the default 0.5 where the lr reaches its floor (where the run
# wants the full detail step: docs/algorithm.md, adamw_units).
C1=$GWT:detail_clip=0.25:detail_clip_end=0.5
CAND=(--gate-seeds none --contenders "adamw,$GWT,$C1" --grid adamw=2e-3 --grid "$GWT=2e-3" --grid "$C1=2e-3")
# 1. WSD on pysrc, seeds 1-2 (the cosine's paired runs at this setting, seeds 1-4, are the transfer study's
#    stage 2: docs/results/transfer-cpu/records, loaded above).
run "${WSD[@]}" --report-seeds 1,2 "${PAIR[@]}"
# 2. C1 where GWT trailed most: the cosine's seed 4 (+0.111 at 7.2M tokens), then WSD seeds 1-2.
run --report-seeds 4 "${CAND[@]}"
run "${WSD[@]}" --report-seeds 1,2 "${CAND[@]}"
# 3. The second corpus (Linux's C sources, never tuned on), cosine and WSD, seed 1.
if [ -d "$CORPUS2" ]; then
  run --data "$CORPUS2" --report-seeds 1 "${CAND[@]}"
  run --data "$CORPUS2" "${WSD[@]}" --report-seeds 1 "${CAND[@]}"
fi
# 4. WSD on pysrc, seeds 3-4, for the four-seed interval; then C1 under the cosine on seeds 1-3.
run "${WSD[@]}" --report-seeds 1,2,3,4 "${CAND[@]}"
run --report-seeds 1,2,3,4 "${CAND[@]}"
