"""benchmarks/trajectories.py: the bitwise comparison finds a one-bit
difference, a NaN payload and a missing case, and passes identical ones."""

from __future__ import annotations

import torch
from benchmark_scripts import load_script


def test_compare_is_bitwise(tmp_path, capsys):
    T = load_script("trajectories")
    w = torch.randn(4, 8)
    base = {"a": {"params": [w], "state": {0: {"step": torch.tensor(3.0)}}, "sd_bytes": b"x"}}
    torch.save(base, tmp_path / "a.pt")
    torch.save({"a": {**base["a"], "params": [w.clone()]}}, tmp_path / "same.pt")
    assert T.compare(str(tmp_path / "a.pt"), str(tmp_path / "same.pt")) == 0
    flipped = w.clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # one bit of one weight
    torch.save({"a": {**base["a"], "params": [flipped]}, "b": base["a"]}, tmp_path / "b.pt")
    assert T.compare(str(tmp_path / "a.pt"), str(tmp_path / "b.pt")) == 1
    out = capsys.readouterr().out
    assert "| a | params |" in out and "| b | only in" in out and "2 differ" in out
    assert not T._equal(torch.tensor([float("nan")]), torch.tensor([-float("nan")]))
    assert not T._equal(torch.tensor([0.0]), torch.tensor([-0.0]))
