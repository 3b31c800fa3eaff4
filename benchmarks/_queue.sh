# The machinery of a CPU study queue (benchmarks/budget_cpu.sh, benchmarks/transfer_cpu.sh), sourced by them:
#   SCRIPT=benchmarks/NAME.sh RECORDS="dir ..." source benchmarks/_queue.sh "$@"   # then: run ARGS...
# OUT [COMMIT] come from the caller's arguments. With COMMIT the queue runs the code of a snapshot of that
# commit (`git archive` into OUT.tree), so that editing the checkout while the queue runs (days, on 2 cores)
# never changes the code it runs; `--commit` records it. The stage list is the checkout's: its SCRIPT is
# copied into the snapshot when the queue starts, so stages added later run on the study's code. Each run()
# is one `quality.py --budget --resume` call on OUT at one thread per job and nice 19, so a queue stopped
# anywhere (a signal saves every run in flight) and started again goes on where it stopped. RECORDS: folders of runs finished on earlier machines
# (`run_records.py save`), loaded first; a run finished here wins.
OUT=$(realpath -m "${1:?usage: $SCRIPT OUT [COMMIT]}")
COMMIT=${2:-}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
PY=$PYTHON
if [ -n "$COMMIT" ] && [ "${GWT_BUDGET_SNAPSHOT:-}" != "$COMMIT" ]; then
  # bash reads a script as it runs it: the snapshot's own copy of the script runs the queue, not the checkout's
  TREE=$OUT.tree
  rm -rf "$TREE" && mkdir -p "$TREE" && git -C "$ROOT" archive "$COMMIT" | tar -x -C "$TREE" || exit 2
  cp "$ROOT/$SCRIPT" "$TREE/$SCRIPT" || exit 2
  GWT_BUDGET_SNAPSHOT=$COMMIT GWT_QUEUE_CHECKOUT=$ROOT PYTHONPATH=$TREE/src exec bash "$TREE/$SCRIPT" "$OUT" "$COMMIT"
fi
cd "$ROOT" || exit 2
# the snapshot has no .git: each run's environment.json records COMMIT through this (metrics.git_commit)
[ -n "$COMMIT" ] && export GWT_OPTIM_COMMIT=$COMMIT
# the records are the checkout's, not the snapshot's: runs committed after COMMIT (a study's own, saved while its
# queue ran) must not run again
for records in $RECORDS; do
  records=${GWT_QUEUE_CHECKOUT:-$ROOT}/$records
  [ -d "$records" ] && { "$PY" benchmarks/run_records.py load "$records" "$OUT" || exit 2; }
done
stopped=0
run() {  # one quality.py call; a signal to this script stops it (its runs save) and the queue
  nice -n 19 "$PY" benchmarks/quality.py --budget 16M --beta2s 0.999 --beta2 0.999 --jobs 2 --threads 1 --resume \
    --out "$OUT" --plot '' ${COMMIT:+--commit "$COMMIT"} "$@" ${EXTRA:-} &
  local pid=$! rc
  trap 'stopped=1; kill -TERM "$pid" 2>/dev/null' INT TERM
  wait "$pid"; rc=$?
  while kill -0 "$pid" 2>/dev/null; do wait "$pid"; rc=$?; done  # a trapped signal ends the first wait early
  trap - INT TERM
  if [ "$stopped" = 1 ] || [ "$rc" -gt 1 ]; then  # 0: done, 1: done with a gate failing or runs missing
    echo "$SCRIPT: stopped (exit $rc); the same command goes on from here"
    exit $(( rc > 1 ? rc : 1 ))
  fi
}
