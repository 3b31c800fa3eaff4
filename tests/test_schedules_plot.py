"""benchmarks/schedules_plot.py on the committed records (issue 54's figures), and the one reader of a run's
curve it shares with the budget protocol (benchmarks/_runs.py)."""

from __future__ import annotations

import gzip
import json
import sys

import pytest
from benchmark_scripts import BENCHMARKS, load_script

sys.path.insert(0, str(BENCHMARKS))
import _runs  # noqa: E402


def test_the_cosine_figures_come_from_the_records(capsys, tmp_path):
    plot = load_script("schedules_plot")
    assert plot.main(["--plot", str(tmp_path / "gap.png")]) == 0
    out = capsys.readouterr().out
    # the four seeds of the transfer study's records, as docs/results/schedules-cpu.md reports them
    assert ("| pysrc, cosine | GWT-AdamW as shipped (α 2, clip 0.5) | +0.023 at 8.7M | +0.111 (seed 4, 7.2M) | "
            "+0.003 ± 0.036 (n=4, step 1953) | no |") in out
    assert "| 7.2M | 3.151 3.042 3.037 2.936 | 0.087 | 3.120 3.053 3.016 3.047 | 0.044 |" in out
    assert (tmp_path / "gap.png").stat().st_size > 10_000


def test_a_curve_skips_a_torn_line_and_a_loss_that_is_not_finite(tmp_path):
    live, record = tmp_path / "live", tmp_path / "record"
    live.mkdir()
    record.mkdir()
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "val_loss": 4.5}, {"step": 3, "val_loss": float("nan")},
            {"step": 4, "val_loss": 4.25}]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (live / "metrics.jsonl").write_text(text + '{"step": 5, "val_lo')  # killed mid-line
    with gzip.open(record / "metrics.jsonl.gz", "wt") as f:
        f.write(text)
    assert _runs.curve(live) == _runs.curve(record) == {2: 4.5, 4: 4.25}
    assert _runs.curve(tmp_path / "missing") == {}


@pytest.mark.parametrize("name", ["schedules_plot", "transfer_plot"])
def test_the_plots_import_no_torch(name):
    import subprocess

    code = f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r}); import {name}; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
