"""benchmarks/transfer_finetune.py: the lrs come from the tuning seed's grid, the reporting seeds are paired at
them in nats, and a missing file is one line and exit code 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmark_scripts import load_script


def _results(path: Path, seed: int, runs: dict[tuple[str, float], float], scale=None) -> Path:
    settings = {"data": "demo", "steps": 30, "batch_size": 4, "seq_len": 128, "warmup": 0.3, "weight_decay": 0.0,
                "seed": seed, "scale": scale}
    path.write_text(json.dumps({"settings": settings, "model": "tiny", "val_ppl_before": 30.0, "environment": {},
                                "runs": [{"method": m, "lr": lr, "val_ppl": v} for (m, lr), v in runs.items()]}))
    return path


def test_reporting_seeds_are_paired_at_the_tuning_seeds_lrs(tmp_path, capsys):
    T = load_script("transfer_finetune")
    tune = _results(tmp_path / "s0.json", 0, {("adamw", 1e-4): 19.0, ("adamw", 3e-4): 21.0, ("adamw", 3e-5): 20.0,
                                              ("gwt-adamw:level=2", 1e-4): 19.5, ("gwt-adamw:level=2", 3e-4): 19.2,
                                              ("gwt-adamw:level=2", 3e-5): 21.0})
    reports = [_results(tmp_path / f"s{s}.json", s, {("adamw", 1e-4): a, ("gwt-adamw:level=2", 1e-4): g,
                                                      ("gwt-adamw:level=2", 3e-4): g_own})
               for s, a, g, g_own in ((1, 18.0, 18.5, 18.2), (2, 20.0, 19.0, 19.5))]
    assert T.main([str(p) for p in (tune, *reports)]) == 0
    out = capsys.readouterr().out
    assert "AdamW's best lr 0.0001, gwt-adamw:level=2's 0.0003" in out
    d1 = [math.log(18.5 / 18.0), math.log(19.0 / 20.0)]
    d2 = [math.log(18.5 / 18.2), math.log(19.0 / 19.5)]
    assert f"{d1[0]:+.4f} | {d2[0]:+.4f}" in out and f"{d1[1]:+.4f} | {d2[1]:+.4f}" in out
    h = 12.706 * abs(d1[0] - d1[1]) / math.sqrt(2) / math.sqrt(2)  # t(1) * sd / sqrt(n), sd of two = |a-b|/sqrt(2)
    assert f"GWT at AdamW's lr − AdamW: {sum(d1) / 2:+.4f} ± {h:.4f}" in out


def test_a_missing_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    T = load_script("transfer_finetune")
    assert T.main([str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such file" in err
