"""Trace ``benchmarks/big_model.py``'s peak RSS by phase, on this tree or on
another commit's copy (see ``benchmarks/_memtrace.py``).

    git archive 930940a | tar -x -C /tmp/c930
    python benchmarks/trace_memory.py --tree /tmp/c930 --trace-json t.json -- \\
        --model llama_20m --optimizer gwt-adamw:level=3 --moment-dtype int8 --steps 2 --seq-len 256

Everything after ``--`` goes to that tree's ``big_model.py``. Prints the
phase table and the largest parameter steps; ``--trace-json`` keeps every
phase's row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 1 << 30


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", default=str(HERE.parent), help="the source tree whose big_model.py runs")
    p.add_argument("--trace-json", default=None)
    p.add_argument("--top", type=int, default=6, help="list this many largest parameter steps")
    args = p.parse_args(argv[:split])
    bench_args = argv[split + 1:]
    tree = Path(args.tree).resolve()
    sys.path.insert(0, str(tree / "src"))
    sys.path.insert(0, str(HERE))
    import _memtrace

    trace = _memtrace.MemTrace()
    spec = importlib.util.spec_from_file_location("big_model_traced", tree / "benchmarks" / "big_model.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import gwt_optim

    assert Path(gwt_optim.__file__).resolve().is_relative_to(tree), gwt_optim.__file__
    own = hasattr(bench, "attach")  # this tree's big_model.py marks its phases itself
    if not own:
        _memtrace.install(trace)
    out = Path(tempfile.mkdtemp()) / "bench.json"
    if "--json" not in bench_args:
        bench_args = [*bench_args, "--json", str(out)]
    else:
        out = Path(bench_args[bench_args.index("--json") + 1])
    rows = out.with_name("rows.json")
    if own:
        bench_args = [*bench_args, "--trace-json", str(rows)]
    rc = bench.main(bench_args)
    trace.mark(None)
    if own:
        trace.rows = json.loads(rows.read_text())["rows"]
    r = json.loads(out.read_text())
    peak = trace.peak_row()
    print(f"\n[trace] tree {tree}")
    print(trace.table())
    steps = sorted((row for row in trace.rows if ":step " in row["phase"]),
                   key=lambda row: -(row["peak"] - row["rss_start"]))
    print("\nlargest parameter steps (transient = peak - RSS at its start; kept = RSS after - before):")
    for row in steps[:args.top]:
        print(f"  {row['phase']}: transient {(row['peak'] - row['rss_start']) / 1e6:.1f} MB, kept "
              f"{(row['rss_end'] - row['rss_start']) / 1e6:.1f} MB, grad {row.get('grad_bytes', 0) / 1e6:.1f} MB")
    kept = sum(row["rss_end"] - row["rss_start"] for row in steps)
    print(f"RSS kept over all parameter steps: {kept / 1e6:.1f} MB")
    print(f"peak RSS {peak['peak'] / GIB:.3f} GiB at {peak['phase']}; weights {r['weight_bytes'] / 1e9:.3f} GB, "
          f"state {r['state_bytes'] / 1e9:.3f} GB, baseline {r['baseline_rss_bytes'] / 1e9:.3f} GB; "
          f"RSS before that phase {peak['rss_start'] / GIB:.3f} GiB, malloc at its start {peak['malloc_start']}")
    print("losses", r["losses"])
    print("file mappings (RSS MB):", [(n.rsplit('/', 1)[-1], round(b / 1e6, 1)) for n, b in _memtrace.file_mappings()])
    print("malloc now:", _memtrace.malloc_info(), "smaps_rollup:",
          {k: v for k, v in _memtrace.smaps_rollup().items() if k in ("Rss", "Anonymous", "Private_Dirty")})
    if args.trace_json:
        trace.dump(args.trace_json, bench=r, tree=str(tree), bench_args=bench_args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
