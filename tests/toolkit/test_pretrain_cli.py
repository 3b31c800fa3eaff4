"""The command line: help, settings layering, offline errors, and `compare`
end to end (table, compare.json, plots) followed by `report`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from _waiting import CAP_S

from gwt_optim.cli import build_parser, main

REQUIRED = {"optimizer", "val_loss", "val_ppl", "state_bytes", "peak_rss_bytes", "tokens_per_s", "steps"}


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("pretrain", "compare", "report"):
        assert cmd in out
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    out = capsys.readouterr().out
    for flag in ("--optimizers", "--model", "--data", "--steps", "--seed", "--lr", "--out", "--paper"):
        assert flag in out


def _config(argv: list[str]):
    from gwt_optim.toolkit.pretrain import resolve_config

    return resolve_config(build_parser().parse_args(argv))


def test_settings_layer_defaults_paper_config_and_flags(tmp_path):
    assert _config(["pretrain"]).model == "llama_9m"
    paper = _config(["pretrain", "--paper", "130m"])
    assert (paper.model, paper.data, paper.tokenizer) == ("llama_130m", "c4", "t5-base")
    assert (paper.seq_len, paper.batch_size, paper.steps, paper.warmup) == (256, 512, 20_000, 0.1)
    assert paper.optimizer == "gwt-adamw:level=2:lr=1e-2:scale=0.25"
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps({**paper.to_dict(), "steps": 77}))
    cfg = _config(["pretrain", "--paper", "60m", "--config", str(saved), "--seed", "3", "--alpha", "0.5"])
    assert (cfg.steps, cfg.seed, cfg.scale, cfg.model) == (77, 3, 0.5, "llama_130m")
    with pytest.raises(ValueError, match="60m, 130m"):
        _config(["pretrain", "--paper", "13b"])


def test_compare_lists_the_registry(capsys):
    assert main(["compare", "--list"]) == 0
    out = capsys.readouterr().out
    assert "| gwt-adamw |" in out and "| galore | peers |" in out


def test_offline_c4_exits_with_a_clear_message(monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    rc = main(["pretrain", "--data", "c4", "--tokenizer", "bpe", "--out", str(tmp_path / "c4"), "--no-progress"])
    assert rc == 2
    assert "allenai/c4" in capsys.readouterr().err
    rc = main(["pretrain", "--data", "c4", "--out", str(tmp_path / "t5"), "--no-progress"])  # t5-base tokenizer
    assert rc == 2
    assert "'t5-base'" in capsys.readouterr().err


@pytest.mark.slow
def test_compare_end_to_end_then_report(tiny_model, corpus, tmp_path):
    out = tmp_path / "cmp"
    argv = [sys.executable, "-m", "gwt_optim", "compare", "--optimizers", "adamw:lr=3e-3,gwt-adamw:level=2:scale=0.25",
            "--model", tiny_model, "--data", corpus, "--tokenizer", "bpe:320", "--seq-len", "32",
            "--batch-size", "4", "--steps", "6", "--eval-every", "3", "--val-tokens", "512", "--lr", "1e-2",
            "--device", "cpu", "--no-progress", "--out", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CAP_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| adamw | 0.003 | 1 |" in done.stdout  # the per-entry lr overrides --lr
    assert "| gwt-adamw (level=2) | 0.01 | 0.25 |" in done.stdout
    assert "val_loss.png" in done.stdout and "memory_vs_ppl.png" in done.stdout
    rows = json.loads((out / "compare.json").read_text())
    assert [r["optimizer"] for r in rows] == ["adamw:lr=3e-3", "gwt-adamw:level=2:scale=0.25"]
    assert all(REQUIRED <= set(r) for r in rows)
    # Same model, data and seed: the first step's loss is identical for both.
    runs = sorted(p for p in out.iterdir() if (p / "summary.json").is_file())
    first = [json.loads((r / "metrics.jsonl").read_text().splitlines()[0])["loss"] for r in runs]
    assert first[0] == first[1]
    # GWT at level 2 keeps 1/4 of the moments on the attention and MLP weights.
    assert rows[1]["state_bytes"] < rows[0]["state_bytes"]
    for png in ("val_loss.png", "memory_vs_ppl.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "compare.md").read_text()
    assert "| optimizer | lr | alpha | val loss |" in md and "commit" in md

    (out / "compare.md").unlink()
    assert main(["report", str(out), "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "compare.json").read_text())
    assert again == rows
